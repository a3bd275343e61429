"""The `speculators` (vllm-project/speculators, Apache-2.0) DSpark checkpoint format <-> our `DrafterConfig`.

A speculators DSpark dir is `config.json` + `model.safetensors`, written by `DSparkDraftModel.save_pretrained` (or its
trainer, `save_path/<epoch>/`). The config carries `speculators_model_type: "dspark"`, the draft decoder as a nested
Qwen3 config (`transformer_layer_config`) and the DSpark fields; the tensor names are ours (`fc`, `hidden_norm`,
`layers.i.*`, `norm`, `markov_head.markov_w1/w2`, `confidence_head.proj.*`), and the embedding and LM head are the
target's (not saved) unless the draft vocabulary is reduced.

Field by field:
- `aux_hidden_state_layer_ids`: HF `hidden_states` indices (id 0 = the embedding output, id j = the output of
  decoder layer j-1, before the final norm, as vLLM captures aux id j), so our 0-based "after layer i" id = id - 1.
- `sample_from_anchor` true: our dspark (anchor-as-first) layout; false (the 1+N fill-in block): our dflash layout,
  which has no Markov or confidence head.
- `markov_rank`, `enable_confidence_head`, `confidence_head_with_markov`: ours (their defaults: 256, true, true);
  `markov_head_type` must be "vanilla" (the first-order bias vLLM implements; "gated" / "rnn" have no equivalent here).
- `transformer_layer_config`: a Qwen3 decoder (silu MLP, default RoPE), every layer full attention. A layer of
  `layer_types` "sliding_attention" with a window attends to a window of the context and, unless
  `sliding_window_non_causal`, causally inside the block: our drafter attends to the whole context, non-causally, so
  such a checkpoint is refused (train it with `--full-attention-indices` covering every draft layer).
- `draft_vocab_size` below the target vocabulary (t2d / d2t, an own `lm_head`): refused, our drafter drafts over the
  target's full vocabulary.
"""
from __future__ import annotations

from transformers import Qwen3Config

from dspark.drafter_json import json_bool, json_int
from dspark.models.drafter_config import DrafterConfig

MODEL_TYPE = "dspark"
AUX_FIELD = ("aux_hidden_state_layer_ids", 1)  # (field, offset): our after-layer id = value - offset
VERSION = "0.9.0"  # the speculators release whose format this writes
REDUCED_VOCAB_TENSORS = ("t2d", "d2t", "lm_head.weight")


def is_speculators_config(cfg: dict) -> bool:
    """True for a speculators-format config.json (any speculators model type)."""
    return isinstance(cfg, dict) and "speculators_model_type" in cfg


def _layer_config(raw: dict, where: str) -> Qwen3Config:
    """`transformer_layer_config` as transformers reads it (its omitted fields take Qwen3Config's defaults)."""
    tl = raw.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise ValueError(f"{where}: transformer_layer_config: expected the draft decoder's config (a mapping), "
                         f"got {tl!r}")
    model_type = tl.get("model_type", "qwen3")
    if model_type != "qwen3":
        raise ValueError(f"{where}: transformer_layer_config.model_type {model_type!r}: expected 'qwen3' (our "
                         "drafter's layers are Qwen3 decoder layers)")
    try:
        return Qwen3Config(**tl)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: transformer_layer_config: not a valid Qwen3 config ({e})") from None


def _check_layers(tl: Qwen3Config, raw: dict, where: str) -> None:
    """Refuse what our drafter cannot compute: sliding-window layers, other activations, scaled or partial RoPE."""
    sliding = [i for i, t in enumerate(tl.layer_types or []) if t == "sliding_attention"]
    if sliding and tl.sliding_window is not None:
        causal = "" if raw.get("sliding_window_non_causal", False) else (
            " and causally inside the block (sliding_window_non_causal false)")
        raise ValueError(f"{where}: transformer_layer_config.layer_types: draft layers {sliding} are "
                         f"sliding_attention (sliding_window {tl.sliding_window}): they attend to a window of the "
                         f"context{causal}; our drafter attends to the whole context, non-causally (train with "
                         "--full-attention-indices covering every draft layer)")
    if tl.hidden_act != "silu":
        raise ValueError(f"{where}: transformer_layer_config.hidden_act {tl.hidden_act!r}: expected 'silu'")
    rope = tl.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{where}: transformer_layer_config.rope_parameters.rope_type {rope.get('rope_type')!r}: "
                         "expected 'default' (our drafter has plain RoPE)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0 or "mrope_section" in rope:
        raise ValueError(f"{where}: transformer_layer_config.rope_parameters: partial or multimodal RoPE "
                         f"({rope}) is not supported; expected RoPE over the whole head")


def drafter_config_from_speculators(raw: dict, where: str, num_target_layers: int) -> DrafterConfig:
    """A speculators DSpark config.json -> DrafterConfig (qwen3 backbone); errors name the field.
    num_target_layers: the target's depth (speculators' config does not record it)."""
    kind = raw.get("speculators_model_type")
    if kind != MODEL_TYPE:
        raise ValueError(f"{where}: speculators_model_type {kind!r}: only {MODEL_TYPE!r} checkpoints convert to "
                         "our drafter")
    tl = _layer_config(raw, where)
    _check_layers(tl, raw, where)
    vocab, hidden = tl.vocab_size, tl.hidden_size
    draft_vocab = json_int(raw.get("draft_vocab_size", 32000), "draft_vocab_size", where, 1)  # their default
    if draft_vocab != vocab:
        raise ValueError(f"{where}: draft_vocab_size {draft_vocab} != transformer_layer_config.vocab_size {vocab}: "
                         "a reduced draft vocabulary (t2d/d2t, an own lm_head) is not supported; our drafter "
                         "drafts over the target's full vocabulary")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and target_hidden != hidden:
        raise ValueError(f"{where}: target_hidden_size {target_hidden} != transformer_layer_config.hidden_size "
                         f"{hidden} (the drafter works at the target's width)")
    field, offset = AUX_FIELD
    aux = raw.get(field)
    if not isinstance(aux, list) or not aux:
        raise ValueError(f"{where}: {field}: expected a non-empty list of HF hidden_states indices, got {aux!r}")
    aux = [json_int(i, field, where, 0) for i in aux]
    if min(aux) < offset:
        raise ValueError(f"{where}: {field}: {aux} has id 0, the embedding output; our targets expose decoder layer "
                         "outputs only (ids 1..num_hidden_layers)")
    if raw.get("mask_token_id") is None:
        raise ValueError(f"{where}: mask_token_id: required (the token the draft block's queries are filled with)")
    anchor_first = json_bool(raw.get("sample_from_anchor", True), "sample_from_anchor", where)
    markov = json_int(raw.get("markov_rank", 256), "markov_rank", where, 0)
    head_type = raw.get("markov_head_type", "vanilla")
    if markov and head_type != "vanilla":
        raise ValueError(f"{where}: markov_head_type {head_type!r}: only 'vanilla' (the first-order Markov bias) is "
                         "supported")
    confidence = json_bool(raw.get("enable_confidence_head", True), "enable_confidence_head", where)
    with_markov = json_bool(raw.get("confidence_head_with_markov", True), "confidence_head_with_markov", where)
    if confidence and with_markov and not markov:
        raise ValueError(f"{where}: confidence_head_with_markov true needs markov_rank > 0")
    if not anchor_first and (markov or confidence):
        raise ValueError(f"{where}: sample_from_anchor false (the 1+N fill-in block) with a Markov or confidence "
                         "head is not supported; only the anchor-as-first layout has them here")
    return DrafterConfig(
        vocab_size=vocab, hidden_size=hidden, target_hidden_size=hidden, target_layer_ids=[i - offset for i in aux],
        num_target_layers=num_target_layers, mask_token_id=json_int(raw["mask_token_id"], "mask_token_id", where, 0),
        block_size=json_int(raw.get("block_size", 8), "block_size", where, 1), num_hidden_layers=tl.num_hidden_layers,
        num_attention_heads=tl.num_attention_heads, num_key_value_heads=tl.num_key_value_heads,
        head_dim=tl.head_dim or hidden // tl.num_attention_heads, intermediate_size=tl.intermediate_size,
        rms_norm_eps=tl.rms_norm_eps, rope_theta=float((tl.rope_parameters or {}).get("rope_theta", 10000.0)),
        max_position_embeddings=tl.max_position_embeddings, mode="dspark" if anchor_first else "dflash",
        markov_rank=markov, enable_confidence_head=confidence, confidence_head_with_markov=with_markov,
        hidden_act="silu", attention_bias=bool(tl.attention_bias))


def check_speculators_tensors(names, where: str) -> None:
    """The weights of a full-vocabulary drafter: no vocabulary mapping or own LM head."""
    extra = [n for n in REDUCED_VOCAB_TENSORS if n in names]
    if extra:
        raise ValueError(f"{where}: tensors {extra} belong to a reduced draft vocabulary, which is not supported")


def speculators_config(cfg: DrafterConfig, verifier: str, verifier_architectures: list[str]) -> dict:
    """config.json of our qwen3-backbone drafter in speculators' DSpark form (as `save_pretrained` writes it).
    verifier: the target's path or id (speculators loads the embedding and LM head from it)."""
    if cfg.backbone != "qwen3":
        raise ValueError(f"backbone {cfg.backbone!r}: speculators has no {cfg.backbone} (MLA) drafter; only the "
                         "qwen3 backbone converts")
    if cfg.hidden_act != "silu" or cfg.logit_scale != 1.0:
        raise ValueError(f"hidden_act {cfg.hidden_act!r} / logit_scale {cfg.logit_scale}: speculators' DSpark has "
                         "silu layers and unscaled logits")
    if cfg.target_hidden_size != cfg.hidden_size:
        raise ValueError(f"target_hidden_size {cfg.target_hidden_size} != hidden_size {cfg.hidden_size}: "
                         "speculators' fc reads aux features of the drafter's width")
    n = cfg.num_hidden_layers
    layer = {
        "model_type": "qwen3", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": n,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": cfg.attention_bias, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": n,
        "layer_types": ["full_attention"] * n,
    }
    anchor_first = cfg.mode == "dspark"
    return {
        "architectures": ["DSparkDraftModel"], "speculators_model_type": MODEL_TYPE, "speculators_version": VERSION,
        "transformer_layer_config": layer, "draft_vocab_size": cfg.vocab_size, "target_hidden_size": None,
        "block_size": cfg.block_size, AUX_FIELD[0]: [i + AUX_FIELD[1] for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id, "sample_from_anchor": anchor_first, "sliding_window_non_causal": False,
        "markov_rank": cfg.markov_rank, "markov_head_type": "vanilla",
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov, "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": MODEL_TYPE, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.num_drafts,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }


__all__ = ["AUX_FIELD", "MODEL_TYPE", "is_speculators_config", "drafter_config_from_speculators",
           "check_speculators_tensors", "speculators_config"]
