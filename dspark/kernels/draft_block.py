"""The inputs of a draft step's parallel pass in one launch: the block's embeddings, its positions and its key mask.

  anchors, p0 [B] int64 (each row's last token and its position); E [V, H] the target's embedding; mask_id; N the
  block size; L the context positions the step's view sees
  ->  x [B, N, H] = [E[anchor], E[mask] x (N-1)] in dtype    the block [anchor, mask x (N-1)], embedded
      q_pos [B, N] = p0 + j                                   the block's positions
      mask [B, 1, 1, L + N] in dtype                           additive, one row for all N queries: 0 for the context
                                                              keys before p0 and for the whole block (non-causal),
                                                              -inf for the rest of the context
The mask's storage is padded to a multiple of 16 columns (the -inf past L + N): a row stride SDPA's memory-efficient
kernel takes as it is (an unaligned mask is copied into a padded one on every call). In torch these are eight small
kernels per step (arange, full, compare, masked fill, fill, add, embedding, cat). Grid (B, max(mask tiles, N)):
program (b, i) writes tile i of row b's mask and, for i < N, the block's row i and its position.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.kernels import next_pow2, tl, triton, use_triton

BLOCK_C = 512  # mask columns per program
MAX_BLOCK_H = 1024  # hidden elements per inner step of a block row


def padded_columns(L: int, N: int) -> int:
    """The mask row's storage: L + N columns rounded up to a multiple of 16."""
    return -(-(L + N) // 16) * 16


def block_embeddings(anchors: torch.Tensor, E: torch.Tensor, mask_id: int, N: int, dtype: torch.dtype
                     ) -> torch.Tensor:
    """anchor tokens [...] -> their embedded blocks [..., N, H] = [E[anchor], E[mask] x (N-1)] in dtype (the mask
    rows a view of the embedding's row: no token block is built)."""
    mask_rows = E[mask_id].expand(*anchors.shape, N - 1, E.shape[1])
    return torch.cat([F.embedding(anchors[..., None], E), mask_rows], -2).to(dtype)


def draft_block_ref(anchors: torch.Tensor, p0: torch.Tensor, E: torch.Tensor, mask_id: int, N: int, L: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch definition -> (x [B, N, H], q_pos [B, N], mask [B, 1, 1, L + N]) (module doc)."""
    dev = anchors.device
    cols = torch.arange(padded_columns(L, N), device=dev)
    mask = torch.full((len(p0), 1, 1, len(cols)), float("-inf"), dtype=dtype, device=dev)
    mask.masked_fill_(cols < p0[:, None, None, None], 0.0)
    mask[..., L:L + N] = 0.0
    return block_embeddings(anchors, E, mask_id, N, dtype), p0[:, None] + cols[:N], mask[..., :L + N]


@triton.jit
def _draft_block_kernel(ANC, P0, E, X, QPOS, MASK, s_e, H, L, N, C, MASK_ID,
                        BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    p0 = tl.load(P0 + b)
    cols = i * BLOCK_C + tl.arange(0, BLOCK_C)
    visible = (cols < p0) | ((cols >= L) & (cols < L + N))
    tl.store(MASK + b * C + cols, tl.where(visible, 0.0, float("-inf")).to(MASK.dtype.element_ty), mask=cols < C)
    if i < N:
        tl.store(QPOS + b * N + i, p0 + i)
        tok = tl.where(i == 0, tl.load(ANC + b), MASK_ID).to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            tl.store(X + (b * N + i) * H + h, tl.load(E + tok * s_e + h, mask=h < H, other=0.0), mask=h < H)


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def draft_block_triton(anchors, p0, E, mask_id: int, N: int, L: int, dtype: torch.dtype):
    B, (V, H) = len(anchors), E.shape
    dev = anchors.device
    if not 0 <= mask_id < V:
        raise ValueError(f"draft_block: mask_id {mask_id} outside the embedding's {V} rows")
    C = padded_columns(L, N)
    x = torch.empty(B, N, H, dtype=dtype, device=dev)
    q_pos = torch.empty(B, N, dtype=torch.long, device=dev)
    mask = torch.empty(B, 1, 1, C, dtype=dtype, device=dev)
    block_c = min(BLOCK_C, next_pow2(C))
    _draft_block_kernel[(B, max(triton.cdiv(C, block_c), N))](
        anchors, p0, E, x, q_pos, mask, E.stride(0), H, L, N, C, mask_id, BLOCK_C=block_c,
        BLOCK_H=min(MAX_BLOCK_H, next_pow2(H)))
    return x, q_pos, mask[..., :L + N]


def draft_block(anchors: torch.Tensor, p0: torch.Tensor, E: torch.Tensor, mask_id: int, N: int, L: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, q_pos, mask) of a draft step (module doc): the kernel on CUDA (or under the interpreter) for int64
    anchors / p0 vectors and an embedding with unit-stride rows in the output's dtype (the kernel copies its rows,
    it does not round them), else the torch definition."""
    if (use_triton(anchors, p0, E) and not torch.compiler.is_compiling() and not torch.is_grad_enabled()
            and anchors.dtype == p0.dtype == torch.long and anchors.dim() == p0.dim() == 1
            and anchors.is_contiguous() and p0.is_contiguous() and E.stride(1) == 1 and E.dtype == dtype):
        return draft_block_triton(anchors, p0, E, mask_id, N, L, dtype)
    return draft_block_ref(anchors, p0, E, mask_id, N, L, dtype)
