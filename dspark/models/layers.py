"""Small building blocks shared by every model in the project (targets and drafters). The functional ops (rms_norm,
RoPE) live with the kernels that fuse them (dspark/kernels/rms_norm.py, rope.py) and are re-exported here."""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

from dspark.kernels.rms_norm import rms_norm
from dspark.kernels.rope import apply_rope_interleaved, apply_rope_neox, rope_cos_sin

__all__ = ["RMSNorm", "GatedMLP", "attention", "glu", "flex_kernel_options", "rms_norm", "rope_cos_sin",
           "apply_rope_neox", "apply_rope_interleaved"]

_compiled_flex = None
# Flex tiles for wide heads (MLA: qk 192 = nope 128 + rope 64) or fp32: the default tiles stage a head dim padded
# to 256 and can exceed shared memory, which inductor reports as NoValidChoicesError (pytorch#180278, #198224).
SMALL_FLEX_TILES = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32,
                    "num_stages": 1, "num_warps": 4}


def flex_kernel_options(q: torch.Tensor, v: torch.Tensor) -> dict | None:
    """None (inductor's defaults) for head dims <= 128 in 16-bit; SMALL_FLEX_TILES otherwise."""
    wide = max(q.shape[-1], v.shape[-1]) > 128 or q.dtype == torch.float32
    return dict(SMALL_FLEX_TILES) if wide and q.is_cuda else None


def attention(q, k, v, mask=None, scale=None, enable_gqa=False, is_causal=False):
    """q [B, H, Q, D], k/v [B, Hkv, L, *]. `mask` is a bool tensor [B, 1, Q, L] (True = may attend; SDPA) or a flex
    `BlockMask` (block-sparse training: only the live tiles are computed; compiled on CUDA)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if isinstance(mask, BlockMask):
        global _compiled_flex
        fn = flex_attention
        if q.is_cuda:
            _compiled_flex = _compiled_flex or torch.compile(flex_attention, dynamic=False)
            fn = _compiled_flex
        return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=enable_gqa,
                  kernel_options=flex_kernel_options(q, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa,
                                          is_causal=is_causal and mask is None)


class RMSNorm(nn.Module):
    """RMSNorm (fp32 statistics). In inference with matching dtypes it is torch's fused rms_norm, one kernel where
    the HF form (rms_norm) takes seven: the same value in fp32, and in bf16 the weight is applied before the one
    rounding to bf16 instead of after (as vLLM's kernel does)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and not torch.is_grad_enabled():
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """gate/up/down MLP with SiLU (SwiGLU) or SiTU-GLU activation, HF names gate_proj/up_proj/down_proj."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu",
                 situ_beta: float | None = None, situ_linear_beta: float | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act, self.situ_beta, self.situ_linear_beta = act, situ_beta, situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), self.act, self.situ_beta, self.situ_linear_beta))


def glu(gate: torch.Tensor, up: torch.Tensor, act: str = "silu",
        situ_beta: float | None = None, situ_linear_beta: float | None = None) -> torch.Tensor:
    """silu(gate)*up, or K3's SiTU-GLU computed in fp32:
    gate' = b1*tanh(gate/b1)*sigmoid(gate), up' = b2*tanh(up/b2) (only when b2 is set)."""
    if act == "silu":
        return F.silu(gate) * up
    if act == "situ":
        dtype = gate.dtype
        g, u = gate.float(), up.float()
        b1 = 1.0 if situ_beta is None else situ_beta
        g = b1 * torch.tanh(g / b1) * torch.sigmoid(g)
        if situ_linear_beta is not None:
            u = situ_linear_beta * torch.tanh(u / situ_linear_beta)
        return (g * u).to(dtype)
    raise ValueError(f"hidden_act: expected 'silu' or 'situ', got {act!r}")


def check_aux_layer_ids(ids: list[int] | None, num_layers: int) -> set[int]:
    """Validate a target's `aux_layer_ids` (0-based "after layer i", vLLM's `target_layer_ids`): integers in range and
    strictly increasing, because the aux features are concatenated in layer order (the drafter's `fc` /
    `context_proj` columns follow it). The same rule for every target: unsorted or repeated ids are an error."""
    if ids is None:
        return set()
    try:
        if any(isinstance(i, bool) for i in ids):
            raise TypeError
        ids = [operator.index(i) for i in ids]
    except TypeError:
        raise ValueError(f"aux_layer_ids: expected a list of integers, got {ids!r}") from None
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"aux_layer_ids: {bad} out of range; valid are 0..{num_layers - 1} "
                         f"(0-based 'after layer i', as vLLM's target_layer_ids)")
    if ids != sorted(set(ids)):
        raise ValueError(f"aux_layer_ids: {ids} must be strictly increasing (the aux features are concatenated in "
                         "layer order)")
    return set(ids)
