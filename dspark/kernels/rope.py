"""Rotary position embeddings: the torch definitions the models use and decode_attention fuses. No kernel of its own.
NeoX style (rotate-half; Qwen3 and the Qwen3 drafter) and GPT-J style (interleaved pairs; DeepSeek / K3 MLA)."""
from __future__ import annotations

import torch

_INV_FREQ: dict[tuple, torch.Tensor] = {}  # (dim, theta, device) -> [dim]: the frequencies, each half twice


def inv_freq(dim: int, theta: float, device) -> torch.Tensor:
    """[dim] fp32: 1 / theta^(2i/dim) for i < dim/2, then the same again (rotate-half layout). Cached per device, so
    a step computes cos/sin in four kernels; never cached while a CUDA graph is being captured (a tensor computed
    there holds nothing until the graph replays)."""
    if torch.compiler.is_compiling():  # traced: computed in the graph, which fuses it
        return _inv_freq(dim, theta, device)
    key = (dim, float(theta), str(device))
    f = _INV_FREQ.get(key)
    if f is None:
        f = _inv_freq(dim, theta, device)
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            _INV_FREQ[key] = f
    return f


def _inv_freq(dim: int, theta: float, device) -> torch.Tensor:
    half = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    return torch.cat([half, half])


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype=torch.float32):
    """cos/sin tables for rotary embeddings. positions: [..., T] -> cos, sin: [..., T, dim]."""
    emb = positions.float()[..., None] * inv_freq(dim, theta, positions.device)  # [..., T, dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style (rotate-half) RoPE. x: [B, H, T, D]; cos/sin: [B, T, D] or [T, D]."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J-style (interleaved pairs, is_neox_style=False) RoPE, as DeepSeek MLA uses.
    x: [B, H, T, D]; cos/sin as from rope_cos_sin (the first D/2 columns are used)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return out.flatten(-2)
