"""DrafterConfig: the shapes and options of a DSpark / DFlash drafter (both backbones), validated.

`target_layer_ids` are 0-based "after layer i" ids of the target, the form vLLM's `target_layer_ids` use
(dspark.drafter_json maps the other config.json forms onto it).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

BACKBONE_NAMES = ("qwen3", "k3")


@dataclass
class DrafterConfig:
    vocab_size: int
    hidden_size: int  # = the target's hidden size (shared embedding / LM head)
    target_hidden_size: int
    target_layer_ids: list[int]  # 0-based "after layer i" of the target
    # qwen3: the target's depth (Qwen3 DSpark / DFlash convention); k3: len(target_layer_ids) (K3DSparkModel)
    num_target_layers: int
    mask_token_id: int
    block_size: int = 4
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4  # qwen3 only
    head_dim: int = 64  # qwen3 only
    intermediate_size: int = 768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # K3DSparkModel's default is 50000 (set explicitly for k3)
    max_position_embeddings: int = 4096
    mode: str = "dspark"  # dspark | dflash
    markov_rank: int = 32  # 0 = no Markov head
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = False
    hidden_act: str = "silu"  # silu | situ (SiTU-GLU with beta = 1)
    attention_bias: bool = False  # qwen3 only
    backbone: str = "qwen3"  # qwen3 (GQA, fc + hidden_norm) | k3 (MLA, context_proj + context_norm)
    # MLA dims, k3 only; q_lora_rank is required there
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    logit_scale: float = 1.0  # logits = logit_scale * (lm_head(h) + markov bias)
    extra: dict = field(default_factory=dict)

    @property
    def num_drafts(self) -> int:
        return self.block_size if self.mode == "dspark" else self.block_size - 1

    def validate(self) -> None:
        if self.backbone not in BACKBONE_NAMES:
            raise ValueError(f"backbone: expected one of {BACKBONE_NAMES}, got {self.backbone!r}")
        if self.mode not in ("dspark", "dflash"):
            raise ValueError(f"mode: expected 'dspark' or 'dflash', got {self.mode!r}")
        if self.mode == "dflash" and (self.markov_rank or self.enable_confidence_head):
            raise ValueError("mode: the dflash layout has no Markov or confidence head; set markov_rank=0 and "
                             "enable_confidence_head=false")
        if self.block_size < (1 if self.mode == "dspark" else 2):
            raise ValueError(f"block_size: too small for mode {self.mode!r}: {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids: expected a non-empty list")
        ids = list(self.target_layer_ids)
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise ValueError(f"target_layer_ids: expected integers, got {ids!r}")
        if ids != sorted(set(ids)):
            raise ValueError(f"target_layer_ids: {ids} must be strictly increasing (the target concatenates the aux "
                             "features in layer order)")
        if self.backbone == "k3":
            self._validate_k3()
        else:
            bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
            if bad:
                raise ValueError(f"target_layer_ids: {bad} out of range for a target of {self.num_target_layers} "
                                 f"layers (valid 0..{self.num_target_layers - 1})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id: {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")

    def _validate_k3(self) -> None:
        """K3DSparkModel: dspark layout only, q_lora_rank required, num_target_layers = #aux."""
        if self.mode != "dspark":
            raise ValueError("mode: the k3 backbone has only the dspark layout (K3DSparkModel); dflash is not "
                             "defined for K3")
        if not self.q_lora_rank or self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank: required (> 0) for the k3 (MLA) backbone, got {self.q_lora_rank!r}")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: RoPE rotates pairs; expected an even size, got {self.qk_rope_head_dim}")
        if self.hidden_act not in ("silu", "situ"):
            raise ValueError(f"hidden_act: expected 'silu' or 'situ', got {self.hidden_act!r}")
        bad = [i for i in self.target_layer_ids if i < 0]
        if bad:
            raise ValueError(f"target_layer_ids: {bad} are negative (0-based 'after layer i')")
        if self.num_target_layers != len(self.target_layer_ids):
            raise ValueError(f"num_target_layers: for the k3 backbone it is the number of aux layers "
                             f"(len(target_layer_ids) = {len(self.target_layer_ids)}), got {self.num_target_layers}")

    def as_qwen3(self):
        from transformers import Qwen3Config

        return Qwen3Config(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, attention_bias=self.attention_bias)

    def to_dict(self) -> dict:
        return asdict(self)
