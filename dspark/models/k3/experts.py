"""The routed experts of a LatentMoE as two stacked weights, vLLM FusedMoE's layout, and the only copy of them:

    w13_weight [E, 2I, R]   rows [w1 (gate) | w3 (up)] of each expert
    w2_weight  [E, R, I]    down

MXFP4 (`to_mxfp4`): the same stacks as uint8 buffers `w13_weight_packed` [E, 2I, R/2] / `w13_weight_scale`
[E, 2I, R/32] and `w2_weight_packed` / `w2_weight_scale`, dequantised on use (only the experts a step reads).
The checkpoint keeps one tensor per expert and projection, `experts.{e}.w1.weight` (w2, w3; `.weight_packed` and
`.weight_scale` when quantised): `checkpoint_views` maps them onto the stacks (dspark.checkpoint_io).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dspark.kernels.glu import glu
from dspark.kernels.mxfp4_matmul import BLOCK, dequantize_mxfp4, quantize_mxfp4


def _dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """[..., N, K/2] / [..., N, K/32] -> [..., N, K] in dtype."""
    lead = packed.shape[:-1]
    return dequantize_mxfp4(packed.reshape(-1, packed.shape[-1]), scale.reshape(-1, scale.shape[-1]),
                            dtype).view(*lead, -1)


class RoutedExperts(nn.Module):
    """E experts z [n, R] -> w2 glu(w13 z) [n, R] held as the two stacks; LatentMoE routes tokens to them."""

    def __init__(self, num_experts: int, dim: int, intermediate: int, act: str = "silu",
                 situ_beta: float | None = None, situ_linear_beta: float | None = None):
        super().__init__()
        self.num_experts, self.dim, self.intermediate = num_experts, dim, intermediate
        self.act, self.situ_beta, self.situ_linear_beta = act, situ_beta, situ_linear_beta
        self.mxfp4 = False
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, dim))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, dim, intermediate))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's w1, w2, w3 initialised in that order as nn.Linear would (kaiming-uniform)."""
        n = self.intermediate
        for e in range(self.num_experts):
            for w in (self.w13_weight[e, :n], self.w2_weight[e], self.w13_weight[e, n:]):
                nn.init.kaiming_uniform_(w, a=math.sqrt(5))

    # ---- weights ------------------------------------------------------------------------------------------
    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacks as held: (w13_weight, w2_weight), or their packed MXFP4 buffers."""
        if self.mxfp4:
            return self.w13_weight_packed, self.w2_weight_packed
        return self.w13_weight, self.w2_weight

    def stacks(self, dtype: torch.dtype | None = None,
               idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [n, 2I, R], w2 [n, R, I]) of experts idx (all when None) in dtype: the parameters themselves when
        idx is None and the dtype is theirs; else a per-call copy of what is read (index_select, dequantisation)."""
        if self.mxfp4:
            parts = (self.w13_weight_packed, self.w13_weight_scale, self.w2_weight_packed, self.w2_weight_scale)
            if idx is not None:
                parts = tuple(t.index_select(0, idx) for t in parts)
            dtype = dtype or torch.float32
            return _dequantize(parts[0], parts[1], dtype), _dequantize(parts[2], parts[3], dtype)
        w13, w2 = self.w13_weight, self.w2_weight
        if idx is not None:
            w13, w2 = w13.index_select(0, idx), w2.index_select(0, idx)
        return (w13, w2) if dtype is None else (w13.to(dtype), w2.to(dtype))

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13 [2I, R], w2 [R, I]) in dtype (views of the stacks unless dequantised or cast)."""
        if self.mxfp4:
            return (dequantize_mxfp4(self.w13_weight_packed[e], self.w13_weight_scale[e], dtype),
                    dequantize_mxfp4(self.w2_weight_packed[e], self.w2_weight_scale[e], dtype))
        return self.w13_weight[e].to(dtype), self.w2_weight[e].to(dtype)

    # ---- math ---------------------------------------------------------------------------------------------
    def glu(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., 2I] = [gate | up] -> the expert activation [..., I]."""
        gate, up = h.chunk(2, -1)
        return glu(gate, up, self.act, self.situ_beta, self.situ_linear_beta)

    def expert(self, e: int, z: torch.Tensor) -> torch.Tensor:
        """Expert e on z [n, R] -> [n, R]: w2 glu(w13 z)."""
        w13, w2 = self.expert_weights(e, z.dtype)
        return F.linear(self.glu(F.linear(z, w13)), w2)

    # ---- checkpoint names and MXFP4 -----------------------------------------------------------------------
    def checkpoint_views(self) -> dict[str, list[tuple[str, tuple]]]:
        """Stack name -> [(experts.{e}.w{1,3,2}.<suffix>, index into the stack)]; the module is LatentMoE.experts."""
        n, E = self.intermediate, self.num_experts
        out = {}
        for suffix in (("weight_packed", "weight_scale") if self.mxfp4 else ("weight",)):
            out[f"w13_{suffix}"] = [(f"experts.{e}.{w}.{suffix}", (e, rows)) for e in range(E)
                                    for w, rows in (("w1", slice(0, n)), ("w3", slice(n, 2 * n)))]
            out[f"w2_{suffix}"] = [(f"experts.{e}.w2.{suffix}", (e,)) for e in range(E)]
        return out

    def to_mxfp4(self, quantize: bool = True) -> None:
        """Replace the float stacks with MXFP4 buffers, in place: quantised from the current weights, or empty
        (quantize=False: loading a quantised checkpoint fills them). Rows are quantised one by one, as per expert."""
        if self.mxfp4:
            return
        for name, K in (("w13", self.dim), ("w2", self.intermediate)):
            if K % BLOCK:
                raise ValueError(f"MXFP4 experts: {name} input dim {K} is not a multiple of {BLOCK}")
            w = getattr(self, f"{name}_weight")
            if quantize:
                packed, scale = quantize_mxfp4(w.detach().reshape(-1, K))
                packed, scale = packed.view(*w.shape[:2], -1), scale.view(*w.shape[:2], -1)
            else:
                packed = torch.zeros(*w.shape[:2], K // 2, dtype=torch.uint8, device=w.device)
                scale = torch.full((*w.shape[:2], K // BLOCK), 127, dtype=torch.uint8, device=w.device)
            delattr(self, f"{name}_weight")
            self.register_buffer(f"{name}_weight_packed", packed)
            self.register_buffer(f"{name}_weight_scale", scale)
        self.mxfp4 = True

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, dim={self.dim}, intermediate={self.intermediate}"
                + (", mxfp4" if self.mxfp4 else ""))
