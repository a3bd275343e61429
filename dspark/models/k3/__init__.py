"""Kimi K3 / Kimi Linear text model in plain torch (CPU fp32 reference; fla fast path on CUDA)."""
from .attn_res import AttnResStream, attn_res
from .config import K3TextConfig
from .kda import KimiDeltaAttention, kda_chunked, kda_gate, kda_recurrent, l2norm
from .mla import MLAttention
from .model import K3ForCausalLM
from .moe import LatentMoE
from .mxfp4 import convert_to_mxfp4, dequantize_mxfp4, quantize_mxfp4

__all__ = [
    "AttnResStream", "attn_res", "K3TextConfig", "KimiDeltaAttention", "kda_chunked", "kda_gate", "kda_recurrent",
    "l2norm", "MLAttention", "K3ForCausalLM", "LatentMoE", "convert_to_mxfp4", "dequantize_mxfp4", "quantize_mxfp4",
]
