"""RMSNorm as HF Qwen3 / DeepSeek compute it: the torch definition that the fused kernels' prologues and epilogues
(decode_gemv, decode_attention, attn_res, kda_decode) reproduce. No kernel of its own."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, cast back to x's dtype, scale."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
