"""Loading targets and drafters, exporting drafters in vLLM's layouts, and `python -m dspark.checkpoint check|convert`.

File-level I/O (atomic save, strict load, sharded read) is dspark.checkpoint_io, shared with the models; the
drafter config.json forms vLLM reads are dspark.drafter_json, speculators' DSpark format dspark.speculators_format.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from dspark.checkpoint_io import (
    check_state,
    checkpoint_state,
    merge_checkpoint_state,
    nonfinite_tensors,
    read_config,
    read_weights,
    save_checkpoint_dir,
)
from dspark.drafter_json import (
    AUX_ID_FIELDS,
    K3_DEFAULT_ROPE_THETA,
    drafter_config_from_json,
    drafter_export_config,
    resolve_mask_token_id,
    resolve_target_layer_ids,
)
from dspark.models.drafter import DrafterConfig, DSparkDrafter
from dspark.models.k3.model import K3ForCausalLM
from dspark.models.qwen3 import Qwen3ForCausalLM
from dspark.speculators_format import (
    AUX_FIELD,
    check_speculators_tensors,
    drafter_config_from_speculators,
    is_speculators_config,
    speculators_config,
)

TARGETS = {"qwen3": Qwen3ForCausalLM, "kimi_linear": K3ForCausalLM, "kimi_k3": K3ForCausalLM}
TOKENIZER_FILE = "tokenizer.json"


def load_target(path: str | Path, device="cpu", dtype="float32"):
    """A target model from an HF dir: Qwen3 (`qwen3`) or K3 (`kimi_linear` / `kimi_k3`), with its tokenizer
    (`model.tokenizer`, None when the dir has none)."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    cfg = read_config(path)
    mt = cfg.get("model_type")
    if mt not in TARGETS:
        raise ValueError(f"{Path(path) / 'config.json'}: model_type {mt!r} is not a supported target; "
                         "expected 'qwen3', 'kimi_linear' or 'kimi_k3'")
    model = TARGETS[mt].from_pretrained(path, device=device, dtype=dtype)
    model.tokenizer = load_tokenizer(path)
    model.name_or_path = str(path)
    return model


def load_tokenizer(path: str | Path):
    """The tokenizer of a checkpoint dir, None when it has none."""
    if not (Path(path) / TOKENIZER_FILE).is_file():
        return None
    from transformers import AutoTokenizer  # slow to import: only when there is a tokenizer

    return AutoTokenizer.from_pretrained(str(path))


def export_drafter(drafter, out_dir: str | Path, layout: str = "dspark", tokenizer=None) -> Path:
    """The drafter as a vLLM drafter dir: config.json (dspark.drafter_json) + model.safetensors (+ tokenizer)."""
    cfg = drafter.config
    if layout not in ("dspark", "dflash"):
        raise ValueError(f"export.layout: expected 'dspark' or 'dflash', got {layout!r}")
    if cfg.backbone == "k3" and layout != "dspark":
        raise ValueError(f"export.layout: {layout!r} is not defined for the k3 backbone; K3DSparkModel has only "
                         "the dspark layout")
    if layout != cfg.mode:
        raise ValueError(f"export.layout: a {cfg.mode!r}-mode drafter cannot be exported as {layout!r} "
                         "(the query layouts differ: anchor-as-first vs 1+N fill-in)")
    state = checkpoint_state(drafter)  # vLLM's names: merged weights as their separate blocks
    if layout == "dspark" and cfg.enable_confidence_head is False:
        state = {k: v for k, v in state.items() if not k.startswith("confidence_head.")}
    out = save_checkpoint_dir(out_dir, drafter_export_config(cfg, layout), state)
    if tokenizer is not None:  # convenient for `vllm serve` and our loaders; vLLM uses the target's
        tokenizer.save_pretrained(str(out))
    return out


def check_drafter_against_target(dcfg, target, where: str, ids_field: str = "target_layer_ids",
                                 mask_field: str = "mask_token_id") -> None:
    """The drafter fits the target: vocabulary, hidden size, layer ids, mask token. ids_field / mask_field: the
    config.json fields the ids and the mask came from (errors name them, in their own numbering)."""
    tc = target.config
    if dcfg.vocab_size != tc.vocab_size:
        raise ValueError(f"{where}: vocab_size {dcfg.vocab_size} != target vocab_size {tc.vocab_size}")
    if dcfg.hidden_size != tc.hidden_size or dcfg.target_hidden_size != tc.hidden_size:
        raise ValueError(f"{where}: hidden_size {dcfg.hidden_size} / target_hidden_size {dcfg.target_hidden_size} "
                         f"!= target hidden_size {tc.hidden_size}")
    off = dict((*AUX_ID_FIELDS, AUX_FIELD)).get(ids_field, 0)  # aux-id fields count from 1
    bad = [i + off for i in dcfg.target_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad:
        raise ValueError(f"{where}: {ids_field} {bad} out of range for the target's {tc.num_hidden_layers} "
                         f"layers (valid {off}..{tc.num_hidden_layers - 1 + off})")
    if not 0 <= dcfg.mask_token_id < tc.vocab_size:
        raise ValueError(f"{where}: {mask_field} {dcfg.mask_token_id} is outside the target vocabulary "
                         f"(size {tc.vocab_size})")
    tok = getattr(target, "tokenizer", None)
    if tok is not None and tok.mask_token is not None:
        tid = tok.convert_tokens_to_ids(tok.mask_token)
        if tid != dcfg.mask_token_id:
            raise ValueError(f"{where}: {mask_field} {dcfg.mask_token_id} != the target tokenizer's mask token "
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


def drafter_config_of(raw: dict, where: str, num_target_layers: int) -> tuple[DrafterConfig, str, str]:
    """A drafter config.json, in any of vLLM's forms (dspark.drafter_json) or speculators' DSpark form
    (dspark.speculators_format) -> (DrafterConfig, the field the layer ids came from, that of the mask token)."""
    if is_speculators_config(raw):
        return drafter_config_from_speculators(raw, where, num_target_layers), AUX_FIELD[0], "mask_token_id"
    return (drafter_config_from_json(raw, where), resolve_target_layer_ids(raw, where)[1],
            resolve_mask_token_id(raw, where)[1])


def read_drafter_weights(path: str | Path, dcfg: DrafterConfig, speculators: bool = False):
    """-> (a drafter on the meta device, the dir's weights (under the file's names) checked strictly against it, in
    their stored dtype)."""
    state = read_weights(path)
    if speculators:
        check_speculators_tensors(state, str(Path(path)))
    with torch.device("meta"):
        drafter = DSparkDrafter(dcfg, torch.empty(dcfg.vocab_size, dcfg.hidden_size),
                                torch.empty(dcfg.vocab_size, dcfg.hidden_size))
    check_state(checkpoint_state(drafter), state, str(Path(path)))  # the file's (vLLM's) names
    return drafter, state


def load_drafter(path: str | Path, target, device=None, dtype=None):
    """A drafter dir in any of vLLM's config forms (dspark.drafter_json) or a speculators DSpark dir
    (`speculators_model_type: "dspark"`), bound to (and checked against) its target; weights loaded strictly."""
    where = str(Path(path) / "config.json")
    raw = read_config(path)
    dcfg, ids_field, mask_field = drafter_config_of(raw, where, target.config.num_hidden_layers)
    check_drafter_against_target(dcfg, target, where, ids_field, mask_field)
    dcfg.validate()
    drafter, state = read_drafter_weights(path, dcfg, is_speculators_config(raw))
    drafter.load_state_dict(merge_checkpoint_state(drafter, state), strict=False, assign=True)
    drafter.set_target_weights(target.model.embed_tokens.weight, target.lm_head.weight)
    p = next(target.parameters())
    return drafter.to(device=device or p.device, dtype=dtype or p.dtype).eval()


def target_facts(target_dir: str | Path) -> tuple[SimpleNamespace, dict]:
    """What checking a drafter needs of its target, without its weights: (an object with `.config` (vocab_size,
    hidden_size, num_hidden_layers) and `.tokenizer` (None without one), the raw config.json)."""
    cfg = read_config(target_dir)
    keys = ("vocab_size", "hidden_size", "num_hidden_layers")
    for k in keys:
        if isinstance(cfg.get(k), bool) or not isinstance(cfg.get(k), int):
            raise ValueError(f"{Path(target_dir) / 'config.json'}: {k}: expected an integer (a target's config), "
                             f"got {cfg.get(k)!r}")
    tok = None
    if (Path(target_dir) / TOKENIZER_FILE).is_file():
        from transformers import AutoTokenizer  # slow to import: only when there is a tokenizer

        tok = AutoTokenizer.from_pretrained(str(target_dir))
    return SimpleNamespace(config=SimpleNamespace(**{k: cfg[k] for k in keys}), tokenizer=tok), cfg


def convert(src: str | Path, target_dir: str | Path, out: str | Path, overwrite: bool = False) -> str:
    """A speculators DSpark dir -> our vLLM layout (Qwen3DSparkModel, or DFlashDraftModel for its 1+N block), or one
    of ours (qwen3 backbone) -> speculators' DSpark form; the direction follows SRC's config.json. The same checks as
    load_drafter (against the target's config and tokenizer; its weights are not loaded), then the weights are copied
    as stored (names and dtype unchanged) and the dir written whole. Returns the layout written."""
    src, out = Path(src), Path(out)
    if out.exists() and not overwrite:
        raise ValueError(f"--out {out}: exists; pass --overwrite to replace it")
    if out.resolve() in (src.resolve(), Path(target_dir).resolve()):
        raise ValueError(f"--out {out}: must differ from the source and the target dirs")
    where, raw = str(src / "config.json"), read_config(src)
    target, tcfg = target_facts(target_dir)
    dcfg, ids_field, mask_field = drafter_config_of(raw, where, target.config.num_hidden_layers)
    check_drafter_against_target(dcfg, target, where, ids_field, mask_field)
    dcfg.validate()
    from_speculators = is_speculators_config(raw)
    _, state = read_drafter_weights(src, dcfg, from_speculators)
    dtypes = {str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else "float32"  # what config.json says the weights are stored in
    if from_speculators:
        config, layout = {**drafter_export_config(dcfg, dcfg.mode), "torch_dtype": dtype}, dcfg.mode
    else:
        config = {**speculators_config(dcfg, str(target_dir), tcfg.get("architectures") or []), "dtype": dtype}
        layout = "speculators"
    save_checkpoint_dir(out, config, state)
    return layout


def check_pair(drafter_dir: str | Path, target_dir: str | Path, tp: int = 1):
    """What `check` verifies -> (target, drafter); ValueError / FileNotFoundError naming the problem: the target has
    a tokenizer, both load strictly, the drafter fits the target, no weight is NaN/inf, the drafter shards at tp."""
    target = load_target(target_dir)
    if target.tokenizer is None:
        raise FileNotFoundError(f"{target_dir}: the target has no tokenizer ({TOKENIZER_FILE}); serving and "
                                "evaluation need it (save the tokenizer into the target dir)")
    drafter = load_drafter(drafter_dir, target)
    for name, model, d in (("target", target, target_dir), ("drafter", drafter, drafter_dir)):
        bad = nonfinite_tensors(checkpoint_state(model))
        if bad:
            k, n = bad[0]
            raise ValueError(f"{d}: {name} tensor {k!r} has {n} non-finite values (NaN/inf)"
                             + (f"; {len(bad)} tensors have some" if len(bad) > 1 else ""))
    problems = tensor_parallel_problems(drafter_export_config(drafter.config, drafter.config.mode), tp)
    if problems:
        raise ValueError(f"{Path(drafter_dir) / 'config.json'}: cannot shard at tensor_parallel_size {tp}: "
                         + "; ".join(problems) + " (serve it with draft_tensor_parallel_size 1)")
    return target, drafter


def main(argv: list[str] | None = None) -> int:
    """python -m dspark.checkpoint check DRAFTER --target TARGET [--tensor-parallel-size N]
    python -m dspark.checkpoint convert SRC --target TARGET --out DST [--overwrite]"""
    ap = argparse.ArgumentParser(prog="python -m dspark.checkpoint", description=main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    chk = sub.add_parser("check", help="validate a drafter against its target (vocab, hidden, layer ids, mask, "
                                       "shapes, finite weights, the target's tokenizer)")
    chk.add_argument("drafter")
    chk.add_argument("--target", required=True)
    chk.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="also check that the drafter shards at this draft TP (vLLM's draft_tensor_parallel_size)")
    conv = sub.add_parser("convert", help="a speculators DSpark checkpoint <-> our vLLM drafter layout (the "
                                          "direction follows SRC's config.json)")
    conv.add_argument("src")
    conv.add_argument("--target", required=True, help="the target dir the drafter belongs to")
    conv.add_argument("--out", required=True)
    conv.add_argument("--overwrite", action="store_true", help="replace --out when it exists")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "convert":
            layout = convert(args.src, args.target, args.out, args.overwrite)
            name = {"speculators": "speculators DSpark", "dspark": "vLLM Qwen3DSparkModel",
                    "dflash": "vLLM DFlashDraftModel"}[layout]
            print(f"ok: {args.src} -> {args.out} ({name} layout)")
            return 0
        target, drafter = check_pair(args.drafter, args.target, args.tensor_parallel_size)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c = drafter.config
    print(f"ok: {c.mode} drafter ({c.backbone} backbone), block {c.block_size} ({c.num_drafts} drafts), "
          f"{c.num_hidden_layers} layers, target_layer_ids {c.target_layer_ids} of {target.config.num_hidden_layers}, "
          f"mask {c.mask_token_id}, markov_rank {c.markov_rank}, confidence head {c.enable_confidence_head}"
          + (f", shards at tensor_parallel_size {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""))
    return 0


__all__ = ["load_target", "load_drafter", "export_drafter", "check_drafter_against_target", "check_pair",
           "convert", "drafter_config_of", "read_drafter_weights", "target_facts", "tensor_parallel_problems",
           "read_config", "K3_DEFAULT_ROPE_THETA", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
