"""RMSNorm as HF Qwen3 / DeepSeek compute it: the torch definition that the fused kernels' prologues and epilogues
(decode_gemv, decode_attention, attn_res, kda_decode) reproduce. No kernel of its own."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, cast back to x's dtype, scale."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_layer(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What an RMSNorm module computes: in the weight's dtype torch's F.rms_norm (one fused kernel on CUDA, forward
    and backward, where the HF form takes seven and some ten in training), else rms_norm (the HF form)."""
    if x.dtype == weight.dtype:
        return F.rms_norm(x, weight.shape, weight, eps)
    return rms_norm(x, weight, eps)
