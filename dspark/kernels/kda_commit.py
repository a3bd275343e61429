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


def kda_commit_ref(states, ext, n_keep, state_pool, window_pool, slots) -> None:
    """The definition, in torch: index ops on the pools, no data-dependent shapes (a captured step runs it)."""
    B, T = states.shape[:2]
    W1 = window_pool.shape[1]
    n = n_keep.to(states.device).long()
    keep = (n > 0)[:, None, None]
    S = states[torch.arange(B, device=states.device), (n - 1).clamp(min=0)]  # [B, H, K, V]
    cols = n[:, None] + torch.arange(W1, device=states.device)  # [B, W-1]: ext rows n .. n+W-2
    win = ext.gather(1, cols[..., None].expand(-1, -1, ext.shape[-1]))
    S = torch.where(keep[..., None], S.to(state_pool.dtype), state_pool.index_select(0, slots))
    state_pool.index_copy_(0, slots, S)
    window_pool.index_copy_(0, slots, torch.where(keep, win.to(window_pool.dtype), window_pool.index_select(0, slots)))


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
        offs = tl.arange(0, BD)
        dm = offs < D
        for part in tl.static_range(3):
            ch = part * P + h * D + offs
            for pos in tl.static_range(W1):
                x = tl.load(ext_ptr + (b * (T + W1) + n + pos) * 3 * P + ch, mask=dm, other=0.0)
                tl.store(w_pool_ptr + (slot * W1 + pos) * 3 * P + ch, x.to(w_pool_ptr.dtype.element_ty), mask=dm)


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
