"""LatentMoE's weighted sum of its experts' outputs in one pass: out[n] = sum_j w[n, j] * y[row(n, j)].

  dense     y [E, N, R] (every expert on every token): row(n, j) = y[idx[n, j], n]
  gathered  y [N, k, R] (one row per (token, slot) pair): row(n, j) = y[n, j]
w [N, k] (the routing weights), accumulated in fp32; out [N, R] in `dtype` (default fp32). Kernel: grid
(N, cdiv(R, BLOCK)), the k slots unrolled. In eager torch the dense form is five kernels per MoE layer (zeros, scatter,
cast, mul, sum over the experts) and the cast to the layer's dtype a sixth; the gathered form four.
"""
from __future__ import annotations

import torch

from dspark.kernels import next_pow2, tl, triton, use_triton


def moe_combine_ref(y: torch.Tensor, w: torch.Tensor, idx: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch definition: idx None -> the gathered form, else the dense form (see the module doc)."""
    if idx is None:
        out = (y.float() * w.float()[..., None]).sum(1)
    else:
        E, N = y.shape[:2]
        route = torch.zeros(N, E, dtype=torch.float32, device=y.device).scatter_(1, idx, w.float())  # [N, E]
        out = (y.float() * route.t()[..., None]).sum(0)
    return out if dtype is None else out.to(dtype)


@triton.jit
def _combine_kernel(y_ptr, w_ptr, idx_ptr, out_ptr, R, stride_a, stride_b,
                    K: tl.constexpr, DENSE: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < R
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        wj = tl.load(w_ptr + n * K + j).to(tl.float32)
        if DENSE:
            base = tl.load(idx_ptr + n * K + j).to(tl.int64) * stride_a + n * stride_b
        else:
            base = n * stride_a + j * stride_b
        acc += wj * tl.load(y_ptr + base + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * R + c, acc.to(out_ptr.dtype.element_ty), mask=m)


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def moe_combine_triton(y: torch.Tensor, w: torch.Tensor, idx: torch.Tensor | None = None,
                       dtype: torch.dtype | None = None, block: int | None = None) -> torch.Tensor:
    y = y if y.stride(-1) == 1 else y.contiguous()
    N, K = w.shape
    R = y.shape[-1]
    out = torch.empty(N, R, dtype=dtype or torch.float32, device=y.device)
    if N == 0:
        return out
    dense = idx is not None
    stride_a, stride_b = y.stride(0), y.stride(1)
    BLOCK = block or min(1024, next_pow2(R))
    _combine_kernel[(N, triton.cdiv(R, BLOCK))](
        y, w.contiguous(), idx.contiguous() if dense else w, out, R, stride_a, stride_b,
        K=K, DENSE=dense, BLOCK=BLOCK, num_warps=4)
    return out


def moe_combine(y: torch.Tensor, w: torch.Tensor, idx: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """The kernel for inference on CUDA (or under the interpreter), else the reference."""
    if not torch.is_grad_enabled() and not torch.compiler.is_compiling() and use_triton(y, w):
        return moe_combine_triton(y, w, idx, dtype)
    return moe_combine_ref(y, w, idx, dtype)
