"""Inverse-CDF sampling, one index per row: ids[r] = the first column whose cumulative weight exceeds u[r] · total.

  w [..., V] >= 0 (unnormalised weights: a sampling distribution, or the residual max(p - q, 0) of a rejection);
  u [...] in [0, 1)  ->  ids [...] int64.  A row without weight gives 0 (torch.argmax's pick on zeros).

The torch definition is three scans along V per call (cumsum; cummax for the zero-weight fallback; searchsorted).
torch runs a scan along one row in a single thread block, so at a K3 vocabulary (163840) each sampled token costs a
long serial pass per scan, and a sampled speculative step draws k + 1 of them. Kernel, two launches:
  1. grid (R, S): program (r, s) sums its SLICE columns of row r (fp32) and notes its last positive column.
  2. grid (R,): the prefix of the S slice sums picks the slice where u · total falls; that slice is scanned in
     BLOCK chunks (running total + tl.cumsum) for the first column past the target that has positive weight. Past
     the end (u · total rounded up to total) it takes the last positive column, as the definition's fallback does.
Sums run in fp32 in another order than torch.cumsum's, so the two can pick different columns where u · total lies
within fp32 rounding of a cumulative boundary; every pick has positive weight.
"""
from __future__ import annotations

import torch

from dspark.kernels import as_rows, next_pow2, tl, triton, use_triton

SLICE = 2048  # columns per program of the first pass (K3's vocabulary: 80 programs per row)
BLOCK = 1024  # columns per chunk


def inverse_cdf_ref(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The torch definition. Rounding in the cumsum (a parallel scan may not be monotone) never yields a zero-weight
    column: it falls back to the nearest positive column below."""
    w = w if w.dtype == torch.float64 else w.float()
    V = w.shape[-1]
    cdf = w.cumsum(-1)
    target = u.to(w.dtype)[..., None] * cdf[..., -1:]
    i = torch.searchsorted(cdf, target, right=True).clamp(max=V - 1)  # [..., 1]
    arange = torch.arange(V, device=w.device)
    last_pos = torch.where(w > 0, arange, -1).cummax(-1).values  # the last positive column at or before each
    j = last_pos.gather(-1, i)[..., 0]
    return torch.where(j >= 0, j, w.argmax(-1))


@triton.jit
def _slice_kernel(w_ptr, sums_ptr, last_ptr, V, stride_w, S, SLICE: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    last = tl.full([BLOCK], -1, dtype=tl.int32)
    for c0 in tl.static_range(0, SLICE, BLOCK):
        cols = s * SLICE + c0 + tl.arange(0, BLOCK)
        x = tl.load(w_ptr + r * stride_w + cols, mask=cols < V, other=0.0).to(tl.float32)
        acc += x
        last = tl.maximum(last, tl.where(x > 0, cols, -1))
    tl.store(sums_ptr + r * S + s, tl.sum(acc, 0))
    tl.store(last_ptr + r * S + s, tl.max(last, 0))


@triton.jit
def _pick_kernel(w_ptr, u_ptr, sums_ptr, last_ptr, out_ptr, V, stride_w, S,
                 SLICE: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    si = tl.arange(0, SP)
    sums = tl.load(sums_ptr + r * S + si, mask=si < S, other=0.0)
    lasts = tl.load(last_ptr + r * S + si, mask=si < S, other=-1)
    incl = tl.cumsum(sums, 0)
    total = tl.max(incl, 0)  # sums >= 0: the prefix never decreases
    target = tl.load(u_ptr + r) * total
    hit = tl.min(tl.where((incl > target) & (si < S), si, SP), 0)  # the slice where the target falls (SP: none)
    run = tl.sum(tl.where(si == hit - 1, incl, 0.0), 0)  # the mass before it (<= target)
    lim = tl.where(hit < S, V, 0)  # no slice: nothing to scan
    pick = V
    for c0 in tl.static_range(0, SLICE, BLOCK):
        cols = hit * SLICE + c0 + tl.arange(0, BLOCK)
        m = cols < lim
        x = tl.load(w_ptr + r * stride_w + cols, mask=m, other=0.0).to(tl.float32)
        c = run + tl.cumsum(x, 0)
        pick = tl.minimum(pick, tl.min(tl.where((c > target) & (x > 0) & m, cols, V), 0))
        run += tl.sum(x, 0)
    last_hit = tl.sum(tl.where(si == hit, lasts, 0), 0)  # the slice's own sum was > 0: it has a positive column
    fallback = tl.where(hit < S, last_hit, tl.maximum(tl.max(lasts, 0), 0))
    tl.store(out_ptr + r, tl.where(pick < V, pick, fallback).to(tl.int64))


@torch.compiler.disable  # a torch.compile'd caller launches the kernels as they are
def inverse_cdf_triton(w: torch.Tensor, u: torch.Tensor, slice_cols: int = SLICE, block: int = BLOCK
                       ) -> torch.Tensor:
    lead, w2 = as_rows(w)
    R, V = w2.shape
    out = torch.empty(R, dtype=torch.long, device=w.device)
    if R == 0:
        return out.view(lead)
    block = min(block, slice_cols)
    S = triton.cdiv(V, slice_cols)
    sums = torch.empty(R, S, dtype=torch.float32, device=w.device)
    last = torch.empty(R, S, dtype=torch.int32, device=w.device)
    _slice_kernel[(R, S)](w2, sums, last, V, w2.stride(0), S, SLICE=slice_cols, BLOCK=block, num_warps=4)
    _pick_kernel[(R,)](w2, u.reshape(-1).float().contiguous(), sums, last, out, V, w2.stride(0), S,
                       SLICE=slice_cols, SP=next_pow2(S), BLOCK=block, num_warps=4)
    return out.view(lead)


def inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The kernel on CUDA (or under the interpreter) for fp32 / bf16 / fp16 weights, else the reference."""
    if (w.dtype != torch.float64 and w.shape[-1] > 0 and not torch.compiler.is_compiling()
            and use_triton(w, u)):
        return inverse_cdf_triton(w, u)
    return inverse_cdf_ref(w, u)
