"""MXFP4 (OCP Microscaling v1.0): FP4 E2M1 elements, one E8M0 scale per 32 values along the input dim.

Storage as in K3 / compressed-tensors "mxfp4-pack-quantized": `weight_packed` uint8 [out, in/2] (low nibble = even
element, high nibble = odd element; nibble bit 3 = sign) and `weight_scale` uint8 [out, in/32] (value 2^(s-127)).
Quantisation (OCP): shared_exp = floor(log2(amax_block)) - 2, P_i = RNE_saturate(x_i / 2^shared_exp) to +-6.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import MXFP4_FORMAT

BLOCK = 32
E2M1_EMAX = 2
# code -> value; codes 0..7 positive magnitudes, 8..15 the same negated
FP4_E2M1_LUT = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                             -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x fp32 (already divided by the block scale) -> uint8 codes 0..15, round-to-nearest-even, saturating at 6."""
    grid = FP4_E2M1_LUT[:8].to(x.device)  # [8]
    mag = x.abs().clamp(max=6.0)
    dist = (mag[..., None] - grid).abs()  # [..., 8]
    is_min = dist == dist.min(-1, keepdim=True).values
    even = (torch.arange(8, device=x.device) % 2 == 0)
    # ties go to the even code (mantissa bit 0): rank 0 = even nearest, 1 = odd nearest, 2 = not nearest
    rank = torch.where(is_min & even, 0, torch.where(is_min, 1, 2))
    code = rank.argmin(-1).to(torch.uint8)
    sign = ((x < 0) & (code > 0)).to(torch.uint8) << 3  # no -0 codes
    return code | sign


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (in % 32 == 0) -> (packed uint8 [out, in/2], scale uint8 [out, in/32])."""
    out_f, in_f = w.shape
    if in_f % BLOCK:
        raise ValueError(f"quantize_mxfp4: input dim {in_f} is not a multiple of {BLOCK}")
    blocks = w.detach().float().reshape(out_f, in_f // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)  # [out, G]
    shared_exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - E2M1_EMAX, torch.full_like(amax, -127.0))
    shared_exp = shared_exp.clamp(-127, 127)
    codes = round_to_e2m1(blocks / torch.exp2(shared_exp)[..., None]).reshape(out_f, in_f)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = (shared_exp + 127).to(torch.uint8)
    return packed.contiguous(), scale.contiguous()


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(packed uint8 [out, in/2], scale uint8 [out, in/32]) -> w [out, in] in dtype."""
    lut = FP4_E2M1_LUT.to(packed.device)
    out_f, half = packed.shape
    vals = torch.empty(out_f, half * 2, device=packed.device)
    vals[:, 0::2] = lut[(packed & 0x0F).long()]
    vals[:, 1::2] = lut[(packed >> 4).long()]
    exp = scale.long() - 127  # [out, G]
    vals = torch.ldexp(vals.view(out_f, -1, BLOCK), exp[..., None].float()).reshape(out_f, half * 2)
    return vals.to(dtype)


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
    """Replace every routed expert's w1/w2/w3 with MXFP4Linear, in place. quantize=False only swaps the modules
    (empty buffers: loading a quantised checkpoint fills them). Sets config.quantization_config if present."""
    from .moe import Expert  # local import: moe imports this module

    for expert in [m for m in model.modules() if isinstance(m, Expert)]:
        for name in ("w1", "w2", "w3"):
            lin = getattr(expert, name)
            if isinstance(lin, MXFP4Linear):
                continue
            new = MXFP4Linear.from_linear(lin) if quantize else MXFP4Linear(lin.in_features, lin.out_features)
            setattr(expert, name, new.to(lin.weight.device))
    config = getattr(model, "config", None)
    if config is not None and (quantize or not config.quantization_config):
        config.quantization_config = mxfp4_quantization_config()
    return model
