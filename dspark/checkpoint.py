"""Checkpoint I/O: HF-style dirs (config.json + model.safetensors) written atomically, strict loading with
errors that name the tensor, and `load_target` that picks the model class from config.json."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"


def save_hf_dir(out_dir: str | Path, config: dict, state: dict[str, torch.Tensor],
                extra_files: dict[str, Path] | None = None) -> Path:
    """Write config.json + model.safetensors (+ copies of extra files) to a temp dir beside out_dir, then
    rename it into place, so a crash never leaves a half-written checkpoint."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        for name, src in (extra_files or {}).items():
            shutil.copy2(src, tmp / name)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint dir {str(path)!r} does not exist (not a directory)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: config.json missing; a checkpoint dir needs config.json and {WEIGHTS}")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    f = Path(path) / WEIGHTS
    if not f.is_file():
        raise FileNotFoundError(f"{f}: missing; expected the weights in safetensors format")
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{f}: corrupt or truncated safetensors file ({e})") from None


def check_state(expected: dict[str, torch.Tensor | torch.Size], got: dict[str, torch.Tensor], where: str,
                ignore: set[str] = frozenset()) -> None:
    """Strict name/shape check; the error names the first offending tensors and what was expected."""
    exp = {k: tuple(v.shape if isinstance(v, torch.Tensor) else v) for k, v in expected.items() if k not in ignore}
    missing = sorted(set(exp) - set(got))
    extra = sorted(set(got) - set(exp) - set(ignore))
    if missing:
        raise ValueError(f"{where}: missing tensor {missing[0]!r} (shape {exp[missing[0]]})"
                         + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    if extra:
        raise ValueError(f"{where}: unexpected tensor {extra[0]!r}" + (f" and {len(extra) - 1} more" if len(extra) > 1 else ""))
    for k, shape in exp.items():
        if tuple(got[k].shape) != shape:
            raise ValueError(f"{where}: tensor {k!r} has shape {tuple(got[k].shape)}, expected {shape}")


def load_state_strict(path: str | Path, model: torch.nn.Module, ignore: set[str] = frozenset()):
    state = read_weights(path)
    expected = dict(model.state_dict())
    check_state(expected, state, str(Path(path) / WEIGHTS), ignore)
    return {k: v for k, v in state.items() if k not in ignore}


def load_target(path: str | Path, device="cpu", dtype="float32"):
    """A target model from an HF dir: Qwen3 (`qwen3`) or K3 (`kimi_linear` / `kimi_k3`)."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    cfg = read_config(path)
    mt = cfg.get("model_type")
    if mt == "qwen3":
        from dspark.models.qwen3 import Qwen3ForCausalLM as cls
    elif mt in ("kimi_linear", "kimi_k3"):
        from dspark.models.k3.model import K3ForCausalLM as cls
    else:
        raise ValueError(f"{Path(path) / 'config.json'}: model_type {mt!r} is not a supported target; "
                         "expected 'qwen3', 'kimi_linear' or 'kimi_k3'")
    model = cls.from_pretrained(path, device=device, dtype=dtype)
    model.tokenizer = None
    if (Path(path) / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        model.tokenizer = AutoTokenizer.from_pretrained(str(path))
    model.name_or_path = str(path)
    return model


# --------------------------------------------------------------------------- drafters (vLLM layouts)
DSPARK_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel")
DFLASH_ARCHS = ("DFlashDraftModel",)
K3_DSPARK_ARCHS = ("K3DSparkModel",)
K3_DEFAULT_ROPE_THETA = 50000.0  # K3DSparkConfig's default (docs/vllm-contract.md, "The query block")
K3_REJECTED = ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor")  # must be false
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def k3_drafter_export_config(cfg) -> dict:
    """config.json of a `K3DSparkModel` (docs/vllm-contract.md, "Checkpoint layouts"). K3DSparkConfig has no
    defaults at init, so every field is explicit; num_target_layers is the number of aux layers, the MLA is RoPE'd and
    ungated, the MLP dense."""
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


def drafter_export_config(cfg, layout: str) -> dict:
    """config.json for vLLM: `Qwen3DSparkModel` (method dspark) or `DFlashDraftModel` (method dflash); for a k3
    backbone `K3DSparkModel` (dspark only)."""
    if getattr(cfg, "backbone", "qwen3") == "k3":
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


def export_drafter(drafter, out_dir: str | Path, layout: str = "dspark", tokenizer=None) -> Path:
    cfg = drafter.config
    if layout not in ("dspark", "dflash"):
        raise ValueError(f"export.layout: expected 'dspark' or 'dflash', got {layout!r}")
    if cfg.backbone == "k3" and layout != "dspark":
        raise ValueError(f"export.layout: {layout!r} is not defined for the k3 backbone; K3DSparkModel has only "
                         "the dspark layout")
    if layout != cfg.mode:
        raise ValueError(f"export.layout: a {cfg.mode!r}-mode drafter cannot be exported as {layout!r} "
                         "(the query layouts differ: anchor-as-first vs 1+N fill-in)")
    state = {k: v for k, v in drafter.state_dict().items()}
    if layout == "dspark" and cfg.enable_confidence_head is False:
        state = {k: v for k, v in state.items() if not k.startswith("confidence_head.")}
    out = save_hf_dir(out_dir, drafter_export_config(cfg, layout), state)
    if tokenizer is not None:  # convenient for `vllm serve` and our loaders; vLLM uses the target's
        tokenizer.save_pretrained(str(out))
    return out


def drafter_config_from_json(cfg: dict, where: str):
    from dspark.models.drafter import DrafterConfig

    arch = (cfg.get("architectures") or [None])[0]
    if arch in K3_DSPARK_ARCHS:
        return k3_drafter_config_from_json(cfg, where)
    if arch in DSPARK_ARCHS:
        mode = "dspark"
        ids = cfg.get("target_layer_ids", cfg.get("dspark_target_layer_ids"))
        mask = cfg.get("mask_token_id", cfg.get("dspark_noise_token_id"))
        if "markov_rank" not in cfg:
            raise ValueError(f"{where}: a dspark drafter needs 'markov_rank'")
    elif arch in DFLASH_ARCHS:
        mode = "dflash"
        dc = cfg.get("dflash_config") or {}
        ids, mask = dc.get("target_layer_ids"), dc.get("mask_token_id", cfg.get("mask_token_id"))
    else:
        raise ValueError(f"{where}: architectures {cfg.get('architectures')} is not a drafter; expected one of "
                         f"{list(DSPARK_ARCHS + DFLASH_ARCHS + K3_DSPARK_ARCHS)}")
    if mask is None:
        raise ValueError(f"{where}: no mask token id (mask_token_id / dflash_config.mask_token_id)")
    if not ids:
        raise ValueError(f"{where}: no target_layer_ids")
    try:
        return DrafterConfig(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]), target_layer_ids=list(ids),
            num_target_layers=cfg.get("num_target_layers", max(ids) + 1), mask_token_id=mask,
            block_size=cfg.get("block_size", cfg.get("dspark_block_size", 8)),
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
            intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=(cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096), mode=mode,
            markov_rank=cfg.get("markov_rank", 0) if mode == "dspark" else 0,
            enable_confidence_head=bool(cfg.get("enable_confidence_head", False)) if mode == "dspark" else False,
            confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", False)),
            hidden_act=cfg.get("hidden_act", "silu"), attention_bias=cfg.get("attention_bias", False))
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e.args[0]!r}") from None


def k3_drafter_config_from_json(cfg: dict, where: str):
    """A `K3DSparkModel` config.json (docs/vllm-contract.md) -> DrafterConfig(backbone="k3"); strict on required
    fields."""
    from dspark.models.drafter import DrafterConfig

    if cfg.get("model_type", "k3_dspark") != "k3_dspark":
        raise ValueError(f"{where}: model_type {cfg['model_type']!r}; a K3DSparkModel has model_type 'k3_dspark'")
    for key in K3_REJECTED:
        if cfg.get(key):
            raise ValueError(f"{where}: {key} must be false or absent for K3DSparkModel")
    if cfg.get("sample_from_anchor", True) is False:
        raise ValueError(f"{where}: sample_from_anchor false (1+N layout) is not supported for K3DSparkModel")
    if cfg.get("q_lora_rank") is None:
        raise ValueError(f"{where}: q_lora_rank is required for K3DSparkModel")
    ids = cfg.get("target_layer_ids", cfg.get("dspark_target_layer_ids"))
    mask = cfg.get("mask_token_id", cfg.get("dspark_noise_token_id"))
    if mask is None:
        raise ValueError(f"{where}: no mask token id (mask_token_id / dspark_noise_token_id)")
    if not ids:
        raise ValueError(f"{where}: no target_layer_ids")
    if cfg.get("draft_vocab_size", cfg.get("vocab_size")) != cfg.get("vocab_size"):
        raise ValueError(f"{where}: draft_vocab_size {cfg['draft_vocab_size']} != vocab_size {cfg.get('vocab_size')} "
                         "(a reduced draft vocabulary is not supported)")
    block = cfg.get("block_size", cfg.get("dspark_block_size"))
    if block is None:
        raise ValueError(f"{where}: missing field 'block_size' (required for K3DSparkModel)")
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", K3_DEFAULT_ROPE_THETA))
    try:
        return DrafterConfig(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], target_hidden_size=cfg["target_hidden_size"],
            target_layer_ids=list(ids), num_target_layers=cfg.get("num_target_layers", len(ids)),
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


def check_drafter_against_target(dcfg, target, where: str) -> None:
    tc = target.config
    if dcfg.vocab_size != tc.vocab_size:
        raise ValueError(f"{where}: vocab_size {dcfg.vocab_size} != target vocab_size {tc.vocab_size}")
    if dcfg.hidden_size != tc.hidden_size or dcfg.target_hidden_size != tc.hidden_size:
        raise ValueError(f"{where}: hidden_size {dcfg.hidden_size} / target_hidden_size {dcfg.target_hidden_size} "
                         f"!= target hidden_size {tc.hidden_size}")
    bad = [i for i in dcfg.target_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad:
        raise ValueError(f"{where}: target_layer_ids {bad} out of range for the target's {tc.num_hidden_layers} "
                         f"layers (valid 0..{tc.num_hidden_layers - 1})")
    if not 0 <= dcfg.mask_token_id < tc.vocab_size:
        raise ValueError(f"{where}: mask_token_id {dcfg.mask_token_id} is outside the target vocabulary")
    tok = getattr(target, "tokenizer", None)
    if tok is not None and tok.mask_token is not None:
        tid = tok.convert_tokens_to_ids(tok.mask_token)
        if tid != dcfg.mask_token_id:
            raise ValueError(f"{where}: mask_token_id {dcfg.mask_token_id} != the target tokenizer's mask token "
                             f"{tok.mask_token!r} ({tid})")


def tensor_parallel_problems(cfg: dict, tp: int) -> list[str]:
    """Why a drafter config (config.json dict) cannot be sharded at tensor-parallel size `tp` the way vLLM shards it
    (attention heads and MLP columns split across ranks; GQA kv heads split, or replicated when tp is a multiple of
    them); [] when it can. vLLM's `draft_tensor_parallel_size` is 1 or the target's TP, so a drafter that does not
    shard at the target's TP runs unsharded (draft_tensor_parallel_size 1) on every rank."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size: expected >= 1, got {tp}")
    out = []
    heads, inter = cfg.get("num_attention_heads"), cfg.get("intermediate_size")
    if heads is not None and heads % tp:
        out.append(f"num_attention_heads {heads} is not divisible by {tp}")
    if inter is not None and inter % tp:
        out.append(f"intermediate_size {inter} is not divisible by {tp}")
    kv = cfg.get("num_key_value_heads")
    if kv is not None and "kv_lora_rank" not in cfg and kv % tp and tp % kv:  # GQA (the MLA latent is replicated)
        out.append(f"num_key_value_heads {kv} neither divides nor is divisible by {tp}")
    return out


def load_drafter(path: str | Path, target, device=None, dtype=None):
    """A drafter in vLLM's dspark or dflash layout, bound to (and checked against) its target."""
    from dspark.models.drafter import DSparkDrafter

    where = str(Path(path) / "config.json")
    dcfg = drafter_config_from_json(read_config(path), where)
    dcfg.validate()
    check_drafter_against_target(dcfg, target, where)
    emb, head = target.model.embed_tokens.weight, target.lm_head.weight
    with torch.device("meta"):
        drafter = DSparkDrafter(dcfg, emb.to("meta"), head.to("meta"))
    state = load_state_strict(path, drafter)
    drafter.load_state_dict(state, strict=False, assign=True)
    drafter.set_target_weights(emb, head)
    p = next(target.parameters())
    return drafter.to(device=device or p.device, dtype=dtype or p.dtype).eval()


def main(argv: list[str] | None = None) -> int:
    """python -m dspark.checkpoint check DRAFTER --target TARGET [--tensor-parallel-size N]"""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m dspark.checkpoint", description=main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    chk = sub.add_parser("check", help="validate a drafter against its target (vocab, hidden, layer ids, mask, shapes)")
    chk.add_argument("drafter")
    chk.add_argument("--target", required=True)
    chk.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="also check that the drafter shards at this draft TP (vLLM's draft_tensor_parallel_size)")
    args = ap.parse_args(argv)
    try:
        target = load_target(args.target)
        drafter = load_drafter(args.drafter, target)
        problems = tensor_parallel_problems(read_config(args.drafter), args.tensor_parallel_size)
        if problems:
            raise ValueError(f"{Path(args.drafter) / 'config.json'}: cannot shard at tensor_parallel_size "
                             f"{args.tensor_parallel_size}: " + "; ".join(problems) +
                             " (serve it with draft_tensor_parallel_size 1)")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c = drafter.config
    print(f"ok: {c.mode} drafter ({c.backbone} backbone), block {c.block_size} ({c.num_drafts} drafts), {c.num_hidden_layers} layers, "
          f"target_layer_ids {c.target_layer_ids} of {target.config.num_hidden_layers}, mask {c.mask_token_id}, "
          f"markov_rank {c.markov_rank}, confidence head {c.enable_confidence_head}"
          + (f", shards at tensor_parallel_size {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
