"""A verify step's KDA rollback into the cache's pools in one launch per layer (docs/k3-model.md, "KDA state under
verification").

A record=True step hands over every position's state and the extended conv window; the commit keeps, for each row
b with n = n_keep[b] > 0, the state after its n-th new token and the window of its last W-1 kept raw inputs, written
at pool row slots[b]; a row with n = 0 keeps what its pool row holds.
  states [B, T, H, K, V] fp32    ext [B, W-1+T, C] (the old window, then the new raw inputs; C = 3 H D)
  n_keep [B] in 0..T             state_pool [N, H, K, V] fp32, window_pool [N, W-1, C], slots [B]
Kernel: one program per (row, head) copies the head's [K, V] state and its channels of the window.
"""
from __future__ import annotations

import torch

from dspark.kernels import next_pow2, tl, triton, use_triton
from dspark.kernels.kda_decode import _store_kept_window, kept_conv_window


def committed_kda_state(states: torch.Tensor, conv_ext: torch.Tensor, n_keep, S_old: torch.Tensor | None = None):
    """The rollback of a record=True forward, for every cache (paged pool, DenseCache), with device ops only.
    states [B, T, H, K, V] after each new position; conv_ext [B, W-1+T, C] = the old window then the new raw inputs;
    n_keep [B] in 0..T -> (S [B, H, K, V]: the state after n_keep tokens, S_old (zeros when None) where n_keep = 0;
    conv [B, W-1, C]: the window of the last W-1 kept raw inputs)."""
    B, T = states.shape[:2]
    n = torch.as_tensor(n_keep, dtype=torch.long).to(states.device)
    at = torch.arange(B, device=n.device) * T + (n - 1).clamp(min=0)  # each row's last kept position
    S = states.reshape(B * T, *states.shape[2:]).index_select(0, at)
    S = S.to(S_old.dtype) if S_old is not None else S
    S = torch.where((n > 0)[:, None, None, None], S, S_old if S_old is not None else torch.zeros_like(S))
    return S, kept_conv_window(conv_ext, n, conv_ext.shape[1] - T)


def kda_commit_ref(states, ext, n_keep, state_pool, window_pool, slots) -> None:
    """The definition: committed_kda_state of the rows, written back at their pool rows."""
    S, win = committed_kda_state(states, ext, n_keep, state_pool.index_select(0, slots))
    state_pool.index_copy_(0, slots, S)
    window_pool.index_copy_(0, slots, win.to(window_pool.dtype))


@triton.jit
def _kda_commit_kernel(states_ptr, ext_ptr, n_ptr, slot_ptr, s_pool_ptr, w_pool_ptr, T, H, P, KV,
                       W1: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(n_ptr + b).to(tl.int32)
    if n > 0:
        slot = tl.load(slot_ptr + b).to(tl.int32)
        src = states_ptr + ((b * T + n - 1) * H + h) * KV
        dst = s_pool_ptr + (slot * H + h) * KV
        for start in range(0, KV, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < KV
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)
        _store_kept_window(ext_ptr, w_pool_ptr, b, slot, n, h, T, P, D, BD, W1)


@torch.compiler.disable
def kda_commit_triton(states, ext, n_keep, state_pool, window_pool, slots) -> None:
    B, T, H, K, V = states.shape
    W1, C = window_pool.shape[1:]
    if not (states.is_contiguous() and ext.is_contiguous() and state_pool.is_contiguous()
            and window_pool.is_contiguous() and K == V and C == 3 * H * K):
        raise ValueError("kda_commit_triton: contiguous states, ext and pools with K == V and C == 3 H K expected")
    _kda_commit_kernel[(B, H)](states, ext, n_keep.contiguous(), slots.contiguous(), state_pool, window_pool,
                               T, H, H * K, K * V, W1=W1, D=K, BD=next_pow2(K), BLOCK=min(4096, next_pow2(K * V)),
                               num_warps=4)


def kda_commit(states, ext, n_keep, state_pool, window_pool, slots) -> None:
    """Keep n_keep [B] new tokens' KDA state and conv window of every row, in place in the pools (module doc)."""
    fn = kda_commit_triton if use_triton(states, state_pool, n_keep) else kda_commit_ref
    fn(states, ext, n_keep, state_pool, window_pool, slots)
