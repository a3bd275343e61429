"""The sampling distribution of rows without top-k / top-p: probs = softmax(logits / t) per row, and a one-hot at the
argmax (first index on ties) where t <= 0 (greedy rows).

  logits [..., V] (any float dtype), t [...] fp32 (per row)  ->  probs [..., V] fp32

In torch this is about ten kernels per call (cast, max, subtract, divide, clamp, the one-hot's zeros / argmax /
scatter, softmax, select), and a sampled speculative step makes it k + 1 times: once per drafted position and once
for the target's k + 1 positions. Kernel, two launches over S slices of SLICE columns per row:
  1. grid (R, S): each program's online softmax statistics of its slice (max, sum of exp((x - max) / t)) and its
     first argmax.
  2. grid (R, S): the row's max and sum from the S pairs; each program writes its slice's probabilities.
"""
from __future__ import annotations

import torch

from dspark.kernels import as_rows, next_pow2, tl, triton, use_triton

TEMPERATURE_FLOOR = 1e-5  # sampled rows divide by at least this (callers map smaller temperatures to 0 = greedy)
SLICE = 2048  # columns per program (K3's vocabulary: 80 programs per row)
BLOCK = 1024  # columns per chunk


def temperature_softmax_ref(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The torch definition: logits [..., V], t [...] -> probs [..., V] fp32."""
    logits = logits.float()
    t = t.to(torch.float32)[..., None]
    greedy = t <= 0
    x = (logits - logits.amax(-1, keepdim=True)) / torch.where(greedy, 1.0, t.clamp(min=TEMPERATURE_FLOOR))
    onehot = torch.zeros_like(x).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, onehot, x.softmax(-1))


@triton.jit
def _divisor(t, FLOOR: tl.constexpr):
    return tl.where(t <= 0, 1.0, tl.maximum(t, FLOOR))


@triton.jit
def _stats_kernel(x_ptr, t_ptr, max_ptr, sum_ptr, arg_ptr, V, stride_x, S,
                  FLOOR: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    div = _divisor(tl.load(t_ptr + r), FLOOR)
    m = float("-inf")
    acc = 0.0
    arg = 0
    for c0 in tl.static_range(0, SLICE, BLOCK):
        cols = s * SLICE + c0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + r * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        cm = tl.max(x, 0)
        arg = tl.where(cm > m, s * SLICE + c0 + tl.argmax(x, 0), arg)  # strictly greater: the first argmax stays
        new = tl.maximum(m, cm)
        ref = tl.where(new == float("-inf"), 0.0, new)  # a slice of -inf so far: no nan from -inf - -inf
        acc = acc * tl.exp((m - ref) / div) + tl.sum(tl.exp((x - ref) / div), 0)
        m = new
    tl.store(max_ptr + r * S + s, m)
    tl.store(sum_ptr + r * S + s, acc)
    tl.store(arg_ptr + r * S + s, arg)


@triton.jit
def _write_kernel(x_ptr, t_ptr, max_ptr, sum_ptr, arg_ptr, out_ptr, V, stride_x, S,
                  FLOOR: tl.constexpr, SLICE: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    t = tl.load(t_ptr + r)
    div = _divisor(t, FLOOR)
    si = tl.arange(0, SP)
    ms = tl.load(max_ptr + r * S + si, mask=si < S, other=float("-inf"))
    sums = tl.load(sum_ptr + r * S + si, mask=si < S, other=0.0)
    args = tl.load(arg_ptr + r * S + si, mask=si < S, other=V)
    mx = tl.max(ms, 0)
    ref = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.sum(sums * tl.exp((ms - ref) / div), 0)
    arg = tl.min(tl.where(ms == mx, args, V), 0)  # the first slice holding the max: the row's first argmax
    for c0 in tl.static_range(0, SLICE, BLOCK):
        cols = s * SLICE + c0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + r * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        p = tl.where(t <= 0, (cols == arg).to(tl.float32), tl.exp((x - ref) / div) / total)
        tl.store(out_ptr + r * V + cols, p, mask=cols < V)


@torch.compiler.disable  # a torch.compile'd caller launches the kernels as they are
def temperature_softmax_triton(logits: torch.Tensor, t: torch.Tensor, slice_cols: int = SLICE, block: int = BLOCK
                               ) -> torch.Tensor:
    lead, x = as_rows(logits)
    R, V = x.shape
    out = torch.empty(R, V, dtype=torch.float32, device=logits.device)
    if R == 0:
        return out.view(*lead, V)
    tr = t.to(torch.float32).expand(lead).reshape(R).contiguous()
    block = min(block, slice_cols)
    S = triton.cdiv(V, slice_cols)
    mx = torch.empty(R, S, dtype=torch.float32, device=logits.device)
    sums, arg = torch.empty_like(mx), torch.empty(R, S, dtype=torch.int32, device=logits.device)
    _stats_kernel[(R, S)](x, tr, mx, sums, arg, V, x.stride(0), S, FLOOR=TEMPERATURE_FLOOR, SLICE=slice_cols,
                          BLOCK=block, num_warps=4)
    _write_kernel[(R, S)](x, tr, mx, sums, arg, out, V, x.stride(0), S, FLOOR=TEMPERATURE_FLOOR, SLICE=slice_cols,
                          SP=next_pow2(S), BLOCK=block, num_warps=4)
    return out.view(*lead, V)


def temperature_softmax(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The kernel on CUDA (or under the interpreter), else the reference."""
    if logits.shape[-1] > 0 and not torch.compiler.is_compiling() and use_triton(logits, t):
        return temperature_softmax_triton(logits, t)
    return temperature_softmax_ref(logits, t)
