"""A drafter's config.json in vLLM's forms <-> `DrafterConfig`: one resolver for every loader, and the export.

Architectures: `Qwen3DSparkModel` / `DSparkDraftModel` (qwen3 backbone, DSpark), `DFlashDraftModel` (qwen3
backbone, DFlash), `K3DSparkModel` (k3 backbone, DSpark). The fields are resolved in vLLM's order:

- Aux layer ids, the first non-empty list wins. vLLM captures aux id j as the output of target layer j - 1 (id 0
  is the embedding); our `target_layer_ids` are 0-based "after layer i" ids, i.e. aux id - 1:
  1. `eagle_aux_hidden_state_layer_ids` (aux ids),
  2. `dflash_config.target_layer_ids` (after-layer ids; vLLM adds 1),
  3. `dspark_target_layer_ids` (after-layer ids; vLLM adds 1),
  4. `target_layer_ids` (after-layer ids; vLLM adds 1),
  5. `dflash_config.layer_ids`, then `eagle_config.layer_ids` (aux ids).
- Mask (noise) token id, the first present wins: `dflash_config.mask_token_id`, `mask_token_id`,
  `dspark_noise_token_id`, `pard_token`, `ptd_token_id`.
- Query layout: DSpark reads `sample_from_anchor` (default true: anchor-as-first; false: the 1+N fill-in block);
  `dspark_bonus_anchor` (the speculators-format spelling) is its negation and must agree when both are given.
  DFlash reads `dflash_config.sample_from_anchor` (default false: 1+N fill-in).
- `draft_vocab_size` defaults to `vocab_size`; a reduced draft vocabulary is not supported.

The export writes the form vLLM reads first for each field it writes (nothing of higher priority beside it).
"""
from __future__ import annotations

from dspark.fields import check_bool, check_int
from dspark.models.drafter_config import DrafterConfig

DSPARK_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel")
DFLASH_ARCHS = ("DFlashDraftModel",)
K3_DSPARK_ARCHS = ("K3DSparkModel",)
DRAFTER_ARCHS = DSPARK_ARCHS + DFLASH_ARCHS + K3_DSPARK_ARCHS
K3_DEFAULT_ROPE_THETA = 50000.0  # K3DSparkConfig's default
K3_REJECTED = ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm")  # must be false or absent
MASK_FIELDS = ("dflash_config.mask_token_id", "mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")
# (field, offset): our after-layer id = value - offset
AUX_ID_FIELDS = (("eagle_aux_hidden_state_layer_ids", 1), ("dflash_config.target_layer_ids", 0),
                 ("dspark_target_layer_ids", 0), ("target_layer_ids", 0), ("dflash_config.layer_ids", 1),
                 ("eagle_config.layer_ids", 1))


def _get(cfg: dict, dotted: str, where: str):
    """cfg["a"]["b"] for "a.b" (None when absent); a section that is not a mapping is an error."""
    head, _, tail = dotted.partition(".")
    if not tail:
        return cfg.get(head)
    section = cfg.get(head)
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ValueError(f"{where}: {head}: expected a mapping, got {section!r}")
    return section.get(tail)


def json_int(value, field: str, where: str, low: int | None = None) -> int:
    return check_int(f"{where}: {field}", value, low)


def json_bool(value, field: str, where: str) -> bool:
    return check_bool(f"{where}: {field}", value)


def resolve_target_layer_ids(cfg: dict, where: str) -> tuple[list[int], str]:
    """-> (0-based after-layer ids, the field they came from), in vLLM's order of precedence."""
    for field, offset in AUX_ID_FIELDS:
        value = _get(cfg, field, where)
        if not value:  # absent or empty: vLLM reads on
            continue
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: {field}: expected a list of layer ids, got {value!r}")
        ids = [json_int(v, field, where) - offset for v in value]
        if any(i < 0 for i in ids):
            what = ("aux id 0 is the embedding (aux id j = the output of target layer j-1); the targets here expose "
                    "layer outputs only, so aux ids start at 1") if offset else "layer ids are 0-based"
            raise ValueError(f"{where}: {field}: {list(value)} has an id below {offset}: {what}")
        if ids != sorted(set(ids)):
            raise ValueError(f"{where}: {field}: {list(value)} must be strictly increasing (the target concatenates "
                             "the aux features in layer order)")
        return ids, field
    raise ValueError(f"{where}: no target layer ids; expected one of " + ", ".join(f for f, _ in AUX_ID_FIELDS))


def resolve_mask_token_id(cfg: dict, where: str) -> tuple[int, str]:
    """-> (mask token id, the field it came from), in vLLM's order of precedence."""
    for field in MASK_FIELDS:
        value = _get(cfg, field, where)
        if value is not None:
            return json_int(value, field, where), field
    raise ValueError(f"{where}: no mask token id; expected one of {', '.join(MASK_FIELDS)}")


def resolve_sample_from_anchor(cfg: dict, arch: str, where: str) -> bool:
    """True: the anchor-as-first layout (our mode "dspark"); False: the 1+N fill-in block (our mode "dflash")."""
    if arch in DFLASH_ARCHS:
        sfa = json_bool(_get(cfg, "dflash_config.sample_from_anchor", where) or False,
                    "dflash_config.sample_from_anchor", where)
        top = cfg.get("sample_from_anchor")
        if top is not None and json_bool(top, "sample_from_anchor", where) != sfa:
            raise ValueError(f"{where}: sample_from_anchor {top} contradicts dflash_config.sample_from_anchor {sfa} "
                             "(a DFlashDraftModel reads the dflash_config one); make them agree")
        return sfa
    sfa = json_bool(cfg.get("sample_from_anchor", True), "sample_from_anchor", where)
    bonus = cfg.get("dspark_bonus_anchor")
    if bonus is not None and json_bool(bonus, "dspark_bonus_anchor", where) == sfa:
        raise ValueError(f"{where}: dspark_bonus_anchor {bonus} contradicts sample_from_anchor {sfa}"
                         f"{'' if 'sample_from_anchor' in cfg else ' (its default)'}; dspark_bonus_anchor is its "
                         "negation: set both (sample_from_anchor true = anchor-as-first, false = 1+N fill-in)")
    return sfa


def _check_draft_vocab(cfg: dict, where: str) -> None:
    draft = cfg.get("draft_vocab_size")
    if draft is not None and json_int(draft, "draft_vocab_size", where) != cfg.get("vocab_size"):
        raise ValueError(f"{where}: draft_vocab_size {draft} != vocab_size {cfg.get('vocab_size')} (a reduced draft "
                         "vocabulary is not supported)")


def _check_aux_features(cfg: dict, where: str) -> None:
    for field in ("use_aux_hidden_state", "dflash_config.use_aux_hidden_state", "eagle_config.use_aux_hidden_state"):
        if _get(cfg, field, where) is False:
            raise ValueError(f"{where}: {field} false (a drafter without target features) is not supported")


def drafter_config_from_json(cfg: dict, where: str) -> DrafterConfig:
    """A drafter config.json (any of vLLM's forms) -> DrafterConfig; errors name the field."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: expected a JSON object")
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in DRAFTER_ARCHS:
        raise ValueError(f"{where}: architectures {cfg.get('architectures')} is not a drafter; expected one of "
                         f"{list(DRAFTER_ARCHS)}")
    if arch in K3_DSPARK_ARCHS:
        _k3_precheck(cfg, where)
    ids, _ = resolve_target_layer_ids(cfg, where)
    mask, _ = resolve_mask_token_id(cfg, where)
    anchor_first = resolve_sample_from_anchor(cfg, arch, where)
    _check_draft_vocab(cfg, where)
    _check_aux_features(cfg, where)
    if arch in K3_DSPARK_ARCHS:
        return _k3_config(cfg, ids, mask, anchor_first, where)
    if arch in DSPARK_ARCHS:
        if "markov_rank" not in cfg:
            raise ValueError(f"{where}: markov_rank: required for a {arch} drafter")
        markov = json_int(cfg["markov_rank"], "markov_rank", where)
        confidence = json_bool(cfg.get("enable_confidence_head", False), "enable_confidence_head", where)
        if not anchor_first and (markov or confidence):
            raise ValueError(f"{where}: sample_from_anchor false (the 1+N fill-in block) with a Markov or confidence "
                             "head is not supported; only the anchor-as-first layout has them here")
    else:  # DFlash: no Markov or confidence head
        markov, confidence = 0, False
    mode = "dspark" if anchor_first else "dflash"
    try:
        return DrafterConfig(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]), target_layer_ids=ids,
            num_target_layers=cfg.get("num_target_layers", max(ids) + 1), mask_token_id=mask,
            block_size=cfg.get("block_size", cfg.get("dspark_block_size", 8)),
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
            intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=(cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096), mode=mode, markov_rank=markov,
            enable_confidence_head=confidence,
            confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", False)),
            hidden_act=cfg.get("hidden_act", "silu"), attention_bias=cfg.get("attention_bias", False))
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e.args[0]!r}") from None


def _k3_precheck(cfg: dict, where: str) -> None:
    """What K3DSparkModel rejects outright (before the fields shared with the other architectures are read)."""
    if cfg.get("model_type", "k3_dspark") != "k3_dspark":
        raise ValueError(f"{where}: model_type {cfg['model_type']!r}; a K3DSparkModel has model_type 'k3_dspark'")
    for key in K3_REJECTED:
        if cfg.get(key):
            raise ValueError(f"{where}: {key} must be false or absent for K3DSparkModel")
    if cfg.get("dspark_bonus_anchor"):
        raise ValueError(f"{where}: dspark_bonus_anchor must be false or absent for K3DSparkModel (it has only the "
                         "anchor-as-first layout)")


def _k3_config(cfg: dict, ids: list[int], mask: int, anchor_first: bool, where: str) -> DrafterConfig:
    """A `K3DSparkModel` config.json -> DrafterConfig(backbone="k3"); strict on the fields K3DSparkConfig requires
    (it has no defaults at init)."""
    if not anchor_first:
        raise ValueError(f"{where}: sample_from_anchor false (1+N layout) is not supported for K3DSparkModel")
    if cfg.get("q_lora_rank") is None:
        raise ValueError(f"{where}: q_lora_rank is required for K3DSparkModel")
    block = cfg.get("block_size", cfg.get("dspark_block_size"))
    if block is None:
        raise ValueError(f"{where}: missing field 'block_size' (required for K3DSparkModel)")
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", K3_DEFAULT_ROPE_THETA))
    try:
        return DrafterConfig(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], target_hidden_size=cfg["target_hidden_size"],
            target_layer_ids=ids, num_target_layers=cfg.get("num_target_layers", len(ids)),
            mask_token_id=mask, block_size=block,
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_attention_heads"], intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg["rms_norm_eps"], rope_theta=rope, max_position_embeddings=cfg["max_position_embeddings"],
            mode="dspark", markov_rank=cfg["markov_rank"],
            enable_confidence_head=bool(cfg.get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", False)),
            hidden_act=cfg["hidden_act"], backbone="k3", q_lora_rank=cfg["q_lora_rank"],
            kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
            logit_scale=float(cfg.get("logit_scale", 1.0)))
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e.args[0]!r} (required for K3DSparkModel)") from None


# --------------------------------------------------------------------------- export
def k3_drafter_export_config(cfg: DrafterConfig) -> dict:
    """config.json of a `K3DSparkModel`. K3DSparkConfig has no defaults at init, so every field is explicit;
    num_target_layers is the number of aux layers, the MLA is RoPE'd and ungated, the MLP dense."""
    return {
        "architectures": ["K3DSparkModel"], "model_type": "k3_dspark",
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.hidden_act, "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "logit_scale": cfg.logit_scale, "tie_word_embeddings": False, "attention_bias": False,
        "torch_dtype": "float32", "mla_use_nope": False, "mla_use_output_gate": False,
        "n_routed_experts": 0, "n_shared_experts": 0, "num_experts_per_tok": 0,
        "target_hidden_size": cfg.target_hidden_size, "target_layer_ids": list(cfg.target_layer_ids),
        "num_target_layers": len(cfg.target_layer_ids), "markov_rank": cfg.markov_rank,
        "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id, "sample_from_anchor": True,
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov,
    }


def drafter_export_config(cfg: DrafterConfig, layout: str) -> dict:
    """config.json for vLLM: `Qwen3DSparkModel` (method dspark) or `DFlashDraftModel` (method dflash); for a k3
    backbone `K3DSparkModel` (dspark only)."""
    if cfg.backbone == "k3":
        if layout != "dspark":
            raise ValueError(f"export.layout: {layout!r} is not defined for the k3 backbone; K3DSparkModel has only "
                             "the dspark layout")
        return k3_drafter_export_config(cfg)
    base = {
        "model_type": "qwen3", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": False, "attention_bias": cfg.attention_bias, "torch_dtype": "float32",
        "block_size": cfg.block_size, "num_target_layers": cfg.num_target_layers,
        "target_hidden_size": cfg.target_hidden_size,
    }
    if layout == "dspark":
        return {**base, "architectures": ["Qwen3DSparkModel"], "target_layer_ids": list(cfg.target_layer_ids),
                "mask_token_id": cfg.mask_token_id, "markov_rank": cfg.markov_rank, "sample_from_anchor": True,
                "enable_confidence_head": cfg.enable_confidence_head,
                "confidence_head_with_markov": cfg.confidence_head_with_markov}
    return {**base, "architectures": ["DFlashDraftModel"],
            "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}}
