"""The residual add and the RMSNorm after it in one launch: a pre-norm decoder layer's `h = h + attn(...)` followed by
`post_attention_layernorm(h)` (vLLM's fused_add_rms_norm).

  x, r [..., H] (same dtype), weight [H]  ->  (s = x + r in x's dtype, RMSNorm(s) * weight in x's dtype)

The torch definition is the add and the model's RMSNorm (dspark.kernels.rms_norm.rms_norm_layer: torch's fused
F.rms_norm at inference): two kernels. Kernel: one program per row; the sum is rounded to the dtype first, then
normalised in fp32 (statistics and weight in fp32, one rounding at the end), as F.rms_norm computes from that sum.
"""
from __future__ import annotations

import torch

from dspark.kernels import next_pow2, tl, triton, use_triton
from dspark.kernels.rms_norm import rms_norm_layer

MAX_H = 16384  # widest row one program holds


def add_rms_norm_ref(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + r
    return s, rms_norm_layer(s, weight, eps)


@triton.jit
def _add_rms_norm_kernel(X, R, W, S, OUT, H, sx, sr, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < H
    dt = S.dtype.element_ty
    s = (tl.load(X + row * sx + c, mask=m, other=0.0).to(tl.float32)
         + tl.load(R + row * sr + c, mask=m, other=0.0).to(tl.float32)).to(dt)  # the add, rounded as torch's
    tl.store(S + row * H + c, s, mask=m)
    sf = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / H + eps)
    out = sf * rstd * tl.load(W + c, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + row * H + c, out.to(OUT.dtype.element_ty), mask=m)


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def add_rms_norm_triton(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    H = x.shape[-1]
    xr, rr = x.reshape(-1, H), r.reshape(-1, H)
    s, out = torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if xr.shape[0]:
        _add_rms_norm_kernel[(xr.shape[0],)](xr, rr, weight, s, out, H, xr.stride(0), rr.stride(0), float(eps),
                                             BLOCK=next_pow2(H), num_warps=4 if H <= 4096 else 8)
    return s, out


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, RMSNorm(x + r) * weight): the kernel at inference on CUDA (or under the interpreter) where x, r and
    the weight share a dtype and rows of unit stride, else the torch definition."""
    if (not torch.is_grad_enabled() and not torch.compiler.is_compiling() and x.shape == r.shape
            and x.dtype == r.dtype == weight.dtype and x.shape[-1] <= MAX_H and x.stride(-1) == r.stride(-1) == 1
            and use_triton(x, r, weight)):
        return add_rms_norm_triton(x, r, weight, eps)
    return add_rms_norm_ref(x, r, weight, eps)
