"""MXFP4 routed experts: the checkpoint's quantization_config, the in-place conversion of a model's experts (their
stacks become packed buffers: RoutedExperts.to_mxfp4), and a single MXFP4 Linear holding `weight_packed` /
`weight_scale` (the kernels' tests use it). The format itself (OCP Microscaling v1.0, E2M1 elements with one
E8M0 scale per 32 inputs) and its codec live with the matmul kernel that decodes it: dspark/kernels/mxfp4_matmul.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.kernels.mxfp4_matmul import BLOCK, dequantize_mxfp4, quantize_mxfp4

from .config import MXFP4_FORMAT
from .experts import RoutedExperts


class MXFP4Linear(nn.Module):
    """A bias-free Linear whose weight lives as MXFP4 buffers (`weight_packed`, `weight_scale`), dequantised on use."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"MXFP4Linear: in_features {in_features} is not a multiple of {BLOCK}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.full((out_features, in_features // BLOCK), 127, dtype=torch.uint8))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> MXFP4Linear:
        q = cls(linear.in_features, linear.out_features).to(linear.weight.device)
        q.weight_packed, q.weight_scale = quantize_mxfp4(linear.weight)
        return q

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_mxfp4(self.weight_packed, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


def mxfp4_quantization_config() -> dict:
    """The compressed-tensors style entry written to config.json."""
    return {
        "quant_method": "compressed-tensors",
        "format": MXFP4_FORMAT,
        "config_groups": {"group_0": {
            "targets": ["re:.*experts\\.\\d+\\.w[123]$"],
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": BLOCK,
                        "symmetric": True, "scale_dtype": "e8m0"},
        }},
        "ignore": ["lm_head", "re:.*shared_experts.*", "re:.*self_attn.*", "re:.*mlp\\..*"],
    }


def convert_to_mxfp4(model: nn.Module, quantize: bool = True) -> nn.Module:
    """Turn every routed expert stack's w1/w2/w3 into MXFP4, in place. quantize=False only swaps the storage (empty
    buffers: loading a quantised checkpoint fills them). Sets config.quantization_config if present."""
    for experts in [m for m in model.modules() if isinstance(m, RoutedExperts)]:
        experts.to_mxfp4(quantize)
    config = getattr(model, "config", None)
    if config is not None and (quantize or not config.quantization_config):
        config.quantization_config = mxfp4_quantization_config()
    return model
