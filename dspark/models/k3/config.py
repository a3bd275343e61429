"""K3TextConfig: the `KimiLinearConfig` schema (model_type `kimi_linear`), optionally wrapped in a `kimi_k3` config.

Field names and defaults follow the HF/vLLM `KimiLinearConfig` (docs/k3-model.md, "Config"). Layer ids in
`linear_attn_config` are 1-based; layer i (0-based) is KDA iff (i+1) in kda_layers, otherwise NoPE MLA.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ACTIVATIONS = ("silu", "situ")
ROUTER_ACTIVATIONS = ("sigmoid", "softmax")
MXFP4_FORMAT = "mxfp4-pack-quantized"


@dataclass
class K3TextConfig:
    vocab_size: int = 163840
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = False
    mla_use_output_gate: bool = False
    # KDA schedule: {kda_layers, full_attn_layers (1-based), num_heads, head_dim, short_conv_kernel_size,
    #                gate_lower_bound (optional), use_full_rank_gate}
    linear_attn_config: dict | None = None
    # AttnRes (None = plain pre-norm residual stream)
    attn_res_block_size: int | None = None
    # MoE (num_experts None = dense everywhere)
    num_experts: int | None = None
    num_experts_per_token: int = 1
    num_shared_experts: int = 0
    moe_intermediate_size: int | None = None
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    routed_scaling_factor: float = 1.0
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    num_expert_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    quantization_config: dict | None = None
    # not HF fields: where the config came from, and fields we carry through untouched
    wrapped_in_k3: bool = field(default=False, metadata={"hf": False})
    extra: dict = field(default_factory=dict, metadata={"hf": False})

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.validate()

    # ---- layer schedule -------------------------------------------------------------------------------------
    def is_kda_layer(self, i: int) -> bool:
        """i is 0-based."""
        return self.linear_attn_config is not None and (i + 1) in self.linear_attn_config.get("kda_layers", [])

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts is not None and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    @property
    def has_mla_layers(self) -> bool:
        return any(not self.is_kda_layer(i) for i in range(self.num_hidden_layers))

    # ---- validation -----------------------------------------------------------------------------------------
    def validate(self) -> None:
        L = self.num_hidden_layers
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act: expected one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if self.moe_router_activation_func not in ROUTER_ACTIVATIONS:
            raise ValueError(f"moe_router_activation_func: expected one of {ROUTER_ACTIVATIONS}, "
                             f"got {self.moe_router_activation_func!r}")
        lac = self.linear_attn_config
        if lac is not None:
            for key in ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size"):
                if lac.get(key) is None:
                    raise ValueError(f"linear_attn_config.{key}: required")
            kda, full = list(lac["kda_layers"]), list(lac["full_attn_layers"])
            counts: dict[int, int] = {}
            for n in kda + full:
                counts[n] = counts.get(n, 0) + 1
            duplicated = sorted(n for n, c in counts.items() if c > 1)
            uncovered = [n for n in range(1, L + 1) if n not in counts]
            out_of_range = sorted(n for n in counts if not 1 <= n <= L)
            if duplicated or uncovered or out_of_range:
                raise ValueError(
                    "linear_attn_config.kda_layers/full_attn_layers: must cover exactly layers 1.."
                    f"{L} (1-based) once each; uncovered={uncovered} duplicated={duplicated} "
                    f"out_of_range={out_of_range}")
            lb = lac.get("gate_lower_bound")
            if lb is not None and not -5.0 <= float(lb) < 0.0:
                raise ValueError(f"linear_attn_config.gate_lower_bound: expected a float in [-5, 0), got {lb}")
        if self.has_mla_layers and not self.mla_use_nope:
            raise ValueError("mla_use_nope: must be true when there are MLA (full attention) layers "
                             "(the K3 target MLA is NoPE only)")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"num_key_value_heads: MLA has no KV-head sharing; expected "
                             f"{self.num_attention_heads}, got {self.num_key_value_heads}")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ValueError(f"attn_res_block_size: expected None or >= 1, got {self.attn_res_block_size}")
        if self.num_experts is not None:
            if self.moe_intermediate_size is None:
                raise ValueError("moe_intermediate_size: required when num_experts is set")
            if not 1 <= self.num_experts_per_token < self.num_experts + 1:
                raise ValueError(f"num_experts_per_token: expected 1..{self.num_experts}, "
                                 f"got {self.num_experts_per_token}")
            if self.num_experts % self.num_expert_group:
                raise ValueError(f"num_expert_group: must divide num_experts={self.num_experts}")
        qc = self.quantization_config
        if qc is not None and qc.get("format") not in (None, MXFP4_FORMAT):
            raise ValueError(f"quantization_config.format: only {MXFP4_FORMAT!r} is supported, got {qc.get('format')!r}")

    @property
    def is_mxfp4(self) -> bool:
        return bool(self.quantization_config) and self.quantization_config.get("format") == MXFP4_FORMAT

    # ---- (de)serialisation ----------------------------------------------------------------------------------
    @classmethod
    def _hf_fields(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("hf", True)]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> K3TextConfig:
        """Accepts a plain `kimi_linear` config.json dict or a `kimi_k3` one (text model under `text_config`)."""
        d = dict(d)
        wrapped = d.get("model_type") == "kimi_k3" or "text_config" in d
        if wrapped:
            outer = d
            if not isinstance(outer.get("text_config"), dict):
                raise ValueError("text_config: a kimi_k3 config needs a text_config dict")
            d = dict(outer["text_config"])
            if d.get("quantization_config") is None and outer.get("quantization_config") is not None:
                d["quantization_config"] = outer["quantization_config"]
        names = set(cls._hf_fields())
        known = {k: v for k, v in d.items() if k in names}
        ignored = {"model_type", "architectures", "transformers_version", "auto_map"}
        extra = {k: v for k, v in d.items() if k not in names and k not in ignored}
        if "linear_attn_config" in known and known["linear_attn_config"] is not None:
            known["linear_attn_config"] = dict(known["linear_attn_config"])
        return cls(**known, wrapped_in_k3=wrapped, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The text config in HF config.json layout (model_type kimi_linear)."""
        out: dict[str, Any] = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear"}
        out.update(self.extra)
        for name in self._hf_fields():
            value = getattr(self, name)
            if name == "quantization_config" and value is None:
                continue
            out[name] = value
        return out

    def to_config_json(self) -> dict[str, Any]:
        """What config.json holds: the text config, or a kimi_k3 wrapper around it."""
        text = self.to_dict()
        if not self.wrapped_in_k3:
            return text
        outer = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text}
        if self.quantization_config is not None:
            outer["quantization_config"] = self.quantization_config
        return outer


def k3_tiny_config(**overrides) -> K3TextConfig:
    """A tiny hybrid K3-like config for tests: 4 layers (KDA, KDA, MLA, KDA), AttnRes blocks of 2, LatentMoE with
    8 experts top-2 after one dense layer, SiTU activation, K3 safe gate, full-rank KDA gate, MLA output gate."""
    base = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        rms_norm_eps=1e-5, hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
        max_position_embeddings=256, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, mla_use_nope=True, mla_use_output_gate=True,
        linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 2, "head_dim": 16,
                            "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
        attn_res_block_size=2, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
        moe_intermediate_size=32, routed_expert_hidden_size=32, latent_moe_use_norm=True,
        first_k_dense_replace=1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    base.update(overrides)
    return K3TextConfig(**base)
