"""torch.argmax over the last dim, for the few rows of a decode step: the target's argmax over its k + 1 positions
(greedy steps) and the first token after a greedy prefill. aten's reduce kernel is built for many rows: a profiled
decode step spent 9.3 us in it for [1, 9, 4096] bf16 logits (3.7 us for one row).

  x [..., V] bf16 / fp16 / fp32  ->  [...] int64

Same picks as torch.argmax: the first index of the maximum on ties, -0.0 == 0.0, and a row holding NaN gives its
first NaN's index (a NaN ranks above +inf, as in torch). Each value becomes an int64 key that orders as (value,
-index): its fp32 bits mapped to an int32 of the same order (zeros to +0.0, NaNs to the top) in the high 32 bits,
minus the column; one max over the keys is then the value's max and its first index at once, across chunks too.
Kernel: grid (R, S) over slices of SLICE columns, each a loop over BLOCK-column chunks; with one slice (V <= SLICE:
the quickstart's 4096) a program per row writes the index, one launch; else each slice writes its key and a second
launch reduces a row's S keys (K3's 163840 columns would otherwise be one program's 40 serial chunks).
"""
from __future__ import annotations

import torch

from dspark.kernels import as_rows, next_pow2, tl, triton, use_triton

SLICE = 8192  # columns per program
BLOCK = 4096  # columns per chunk
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp64 would round to fp32 (new ties): the reference


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    """The torch definition: x [..., V] -> [...] int64."""
    return x.argmax(-1)


@triton.jit
def _lowest():
    """-2^63, below every key (the smallest is about -2^63 + 2^55): built by shifts, no wide literal."""
    low = tl.full([], -1, tl.int64) << 62
    return low + low


@triton.jit
def _column_of(key):
    """A key's column: key = hi * 2^32 - col with 0 <= col < 2^32, so col = -key mod 2^32 (shifts: no wide literal)."""
    neg = -key
    return neg - ((neg >> 32) << 32)


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, key_ptr, V, stride_x, S, SLICE: tl.constexpr, BLOCK: tl.constexpr,
                   FINAL: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    best = _lowest()
    for c0 in tl.static_range(0, SLICE, BLOCK):
        cols = s * SLICE + c0 + tl.arange(0, BLOCK)  # [BLOCK]; past V: -inf at a later column, so never picked
        x = tl.load(x_ptr + r * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x == 0, 0.0, x)  # -0.0 -> +0.0: equal, as torch compares them
        bits = x.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # the float order as int32 order
        ordered = tl.where(x != x, 0x7FFFFFFF, ordered)  # NaN (either sign) above +inf (0x7F800000)
        key = (ordered.to(tl.int64) << 32) - cols.to(tl.int64)  # larger value first, then smaller column
        best = tl.maximum(best, tl.max(key, 0))
    if FINAL:
        tl.store(out_ptr + r, _column_of(best))
    else:
        tl.store(key_ptr + r * S + s, best)


@triton.jit
def _argmax_merge_kernel(key_ptr, out_ptr, S, SP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    si = tl.arange(0, SP)
    keys = tl.where(si < S, tl.load(key_ptr + r * S + si, mask=si < S, other=0), _lowest())
    tl.store(out_ptr + r, _column_of(tl.max(keys, 0)))


@torch.compiler.disable  # a torch.compile'd caller launches the kernels as they are
def argmax_triton(x: torch.Tensor, slice_cols: int = SLICE, block: int = BLOCK) -> torch.Tensor:
    """x [..., V] (V > 0) -> [...] int64. Rows are read through their stride: [B, k+1, V] logits need no copy."""
    lead, rows = as_rows(x)
    R, V = rows.shape
    out = torch.empty(R, dtype=torch.int64, device=x.device)
    if R == 0:
        return out.view(lead)
    slice_cols = min(slice_cols, next_pow2(V))
    block = min(block, slice_cols)
    S = triton.cdiv(V, slice_cols)
    warps = 8 if block >= 2048 else 4
    keys = out if S == 1 else torch.empty(R, S, dtype=torch.int64, device=x.device)  # [R, S] slice keys
    _argmax_kernel[(R, S)](rows, out, keys, V, rows.stride(0), S, SLICE=slice_cols, BLOCK=block, FINAL=S == 1,
                           num_warps=warps)
    if S > 1:
        _argmax_merge_kernel[(R,)](keys, out, S, SP=next_pow2(S), num_warps=1)
    return out.view(lead)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) (x [..., V] -> [...] int64): the kernel on CUDA (or under the interpreter) for bf16 / fp16 / fp32,
    else the reference."""
    if x.dim() and x.shape[-1] > 0 and x.dtype in DTYPES and use_triton(x):
        return argmax_triton(x)
    return argmax_ref(x)
