"""Small building blocks shared by every model in the project (targets and drafters). The functional ops (rms_norm,
RoPE) live with the kernels that fuse them (dspark/kernels/rms_norm.py, rope.py) and are re-exported here.

Merged weights: projections of one input live as one weight whose row blocks are the checkpoint's separate tensors
([q | k | v], [gate | up]), as vLLM's QKVParallelLinear / MergedColumnParallelLinear hold them: one GEMM, one copy.
`checkpoint_views()` says where each block goes in the checkpoint (dspark.checkpoint_io.checkpoint_state).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import nn

from dspark.kernels.add_rms_norm import add_rms_norm
from dspark.kernels.glu import glu
from dspark.kernels.rms_norm import rms_norm, rms_norm_layer
from dspark.kernels.rope import Rope, apply_rope_interleaved, apply_rope_neox, norm_rope, rope_cos_sin

__all__ = ["RMSNorm", "GatedMLP", "MergedLinear", "MergedConv1d", "attention", "glu", "flex_kernel_options",
           "rms_norm", "rope_cos_sin", "apply_rope_neox", "apply_rope_interleaved", "Rope", "norm_rope"]

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
    the HF form (rms_norm) takes seven: the same value in fp32; in bf16 the two round differently."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_layer(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + r, this norm of it): a pre-norm layer's residual add and the norm after it, one kernel on CUDA at
        inference (dspark.kernels.add_rms_norm)."""
        return add_rms_norm(x, r, self.weight, self.eps)

    def rope(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """This norm over each head, then NeoX RoPE: x [B, T, H, D] -> [B, H, T, D] (one kernel on CUDA at
        inference: dspark.kernels.rope.norm_rope)."""
        return norm_rope(x, self.weight, self.eps, rope)


class RowBlocks:
    """Mixin for a module whose `weight` (and `bias`) rows are several checkpoint tensors stacked in order:
    `parts` maps each one's name (a sibling module in the checkpoint, e.g. "q_proj") to its row count."""

    parts: dict[str, int]

    def set_parts(self, parts: dict[str, int]) -> None:
        self.parts, self._spans, a = dict(parts), {}, 0
        for name, n in self.parts.items():
            self._spans[name], a = (a, a + n), a + n

    def part_rows(self, *names: str) -> slice:
        """The rows of the named parts, which must be adjacent and in order."""
        lo, hi = self._spans[names[0]][0], self._spans[names[-1]][1]
        if sum(self.parts[n] for n in names) != hi - lo:
            raise ValueError(f"part_rows: {names} are not adjacent in {list(self.parts)}")
        return slice(lo, hi)

    def checkpoint_views(self) -> dict[str, list[tuple[str, slice]]]:
        """Own tensor name -> [(checkpoint name beside this module, rows)], e.g. weight -> q_proj.weight, ..."""
        own = ["weight"] + (["bias"] if getattr(self, "bias", None) is not None else [])
        return {t: [(f"{name}.{t}", self.part_rows(name)) for name in self.parts] for t in own}

    def reset_parameters(self) -> None:
        if hasattr(self, "parts"):  # the base class's __init__ calls this before `parts` is set
            self.reset_parts(*self.parts)

    def reset_parts(self, *names: str) -> None:
        """Each named block initialised as its own module would be (kaiming-uniform weight, then its bias), in
        order: a model built from a seed draws the same weights as with separate modules."""
        for name in names:
            rows = self.part_rows(name)
            w = self.weight[rows]
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            if self.bias is not None:
                fan_in = w[0].numel()
                nn.init.uniform_(self.bias[rows], -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))


class MergedLinear(RowBlocks, nn.Linear):
    """Linear projections of one input as one weight [sum(parts) (+ pad), in]: one GEMM; `split` cuts the output per
    part. `parts` in checkpoint order, e.g. {"q_proj": Hq*D, "k_proj": Hkv*D, "v_proj": Hkv*D}."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False, init: bool = True,
                 align: int = 1):
        n = sum(parts.values())
        super().__init__(in_features, n + (-n % align), bias=bias)
        self.set_parts(parts)
        self.pad = -n % align  # zero rows after the parts (not in the checkpoint): an output width that is a multiple
        with torch.no_grad():  # of `align` keeps the GEMM on cuBLAS's aligned kernels
            self.weight[n:].zero_()
            if self.bias is not None:
                self.bias[n:].zero_()
        self._sizes = list(self.parts.values()) + ([self.pad] if self.pad else [])
        if init:  # init=False: the owner calls reset_parts itself (to keep its modules' initialisation order)
            self.reset_parameters()

    @property
    def row_sizes(self) -> list[int]:
        """The weight's row count per part, then the padding rows (if any): sums to out_features."""
        return self._sizes

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """y [..., out_features] -> one [..., n] view per part (the padding columns dropped)."""
        return y.split(self._sizes, -1)[: len(self.parts)]

    def forward_parts(self, x: torch.Tensor, *names: str) -> torch.Tensor:
        """Only the named (adjacent) parts' outputs: the GEMM on their rows of the weight (a view, no copy)."""
        rows = self.part_rows(*names)
        return F.linear(x, self.weight[rows], None if self.bias is None else self.bias[rows])


class MergedConv1d(RowBlocks, nn.Conv1d):
    """Depthwise causal convs of several channel groups as one weight [sum(parts), 1, W] (no bias); the forward is
    the owner's (kernels/kda_decode.causal_conv_silu)."""

    def __init__(self, parts: dict[str, int], kernel_size: int):
        channels = sum(parts.values())
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False)
        self.set_parts(parts)
        self.reset_parameters()


class GatedMLP(nn.Module):
    """gate/up/down MLP with SiLU (SwiGLU) or SiTU-GLU activation; [gate | up] is one MergedLinear, checkpoint names
    gate_proj/up_proj/down_proj."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu",
                 situ_beta: float | None = None, situ_linear_beta: float | None = None):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate})
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act, self.situ_beta, self.situ_linear_beta = act, situ_beta, situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(glu(gate, up, self.act, self.situ_beta, self.situ_linear_beta))


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
