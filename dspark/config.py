"""Recipes: YAML -> validated dataclasses, with dotted `key=value` overrides from the command line.

Every error is one line naming the field and what was expected (the valid fields, the expected type).
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class RecipeError(ValueError):
    """A recipe that does not validate; the message names the field."""


# --------------------------------------------------------------------------- generic loader
def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp, where: str):
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except RecipeError as e:
                errors.append(str(e))
        raise RecipeError(f"{where}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is Literal:
        if value is False and "no" in typing.get_args(tp):  # YAML 1.1 reads a bare `no` as false
            value = "no"
        if value not in typing.get_args(tp):
            raise RecipeError(f"{where}: expected one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: expected a mapping of {sorted(f.name for f in dataclasses.fields(tp))}, got {value!r}")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", value.strip()):
            value = float(value)  # YAML 1.1 (PyYAML) reads 3e-3, without a dot, as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls, data: dict, where: str = ""):
    """Build dataclass `cls` from a dict; unknown keys, wrong types and missing required fields are errors."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    prefix = f"{where}." if where else ""
    for key in data:
        if key not in fields:
            raise RecipeError(f"{prefix}{key}: unknown field; valid fields{' of ' + where if where else ''}: "
                              f"{', '.join(sorted(fields))}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], prefix + name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecipeError(f"{prefix}{name}: required field is missing")
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        try:
            obj.validate()
        except RecipeError as e:  # a section's own check names its field; say which section
            raise RecipeError(f"{prefix}{e}") from None
    return obj


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`a.b.c=value` (value parsed as YAML) into a nested dict copy."""
    import copy

    data = copy.deepcopy(data)
    for ov in overrides:
        if "=" not in ov:
            raise RecipeError(f"override {ov!r}: expected key=value, e.g. output_dir=/tmp/run max_steps=30")
        key, raw = ov.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {key}: {p} is not a mapping")
        node[parts[-1]] = yaml.safe_load(raw) if raw != "" else ""
    return data


def describe(cls, indent: str = "  ") -> list[str]:
    """Lines listing a dataclass's fields, types and defaults (for --help)."""
    lines, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"{indent}{f.name}:")
            lines += describe(tp, indent + "  ")
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
        doc = f.metadata.get("doc", "")
        lines.append(f"{indent}{f.name}: {_type_name(tp)} = {default!r}" + (f"  # {doc}" if doc else ""))
    return lines


# --------------------------------------------------------------------------- value checks
def at_least(obj, names: str, low, what: str = "") -> None:
    """Each of the space-separated fields `names` of obj is None or >= low (RecipeError naming the first that is
    not)."""
    for name in names.split():
        v = getattr(obj, name)
        if v is not None and not v >= low:
            raise RecipeError(f"{name}: expected >= {low}{what}, got {v!r}")


def positive(obj, names: str) -> None:
    for name in names.split():
        v = getattr(obj, name)
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise RecipeError(f"{name}: expected a finite number > 0, got {v!r}")


# --------------------------------------------------------------------------- recipe sections
def doc(default, text: str, **kw):
    if callable(default) and not isinstance(default, (int, float, str, bool)) and default is not None:
        return field(default_factory=default, metadata={"doc": text}, **kw)
    return field(default=default, metadata={"doc": text}, **kw)


MIN_VOCAB = 261  # a byte-level BPE (dspark.data.tokenizer): 256 byte tokens + 5 special tokens


@dataclass
class DataConfig:
    corpus_dir: str = doc(".cache/corpus", "where the built corpus (datasets arrow) lives; built if missing")
    sources: list[str] | None = doc(None, "corpus sources (None = all); see `python -m dspark.data card`")
    max_bytes_per_source: int | None = doc(None, "deterministic slice per source")
    allow_missing: bool = doc(False, "carry on when a source is not installed on this machine")
    tokenizer_dir: str = doc(".cache/tokenizer", "HF tokenizer dir; trained on the train split if missing")
    vocab_size: int = doc(4096, "BPE vocabulary size (incl. special tokens)")
    seq_len: int = doc(256, "tokens per training row")
    holdout_tokens: int = doc(65536, "holdout tokens used for the periodic holdout loss")

    def validate(self):
        at_least(self, "vocab_size", MIN_VOCAB, " (the 256 byte tokens and 5 special tokens)")
        at_least(self, "seq_len", 8)
        at_least(self, "holdout_tokens max_bytes_per_source", 1)


@dataclass
class OptimConfig:
    optimizer: Literal["adamw", "muon"] = doc("adamw", "muon: Muon for the hidden 2D matrices, AdamW for the rest "
                                                       "(train/optim.py)")
    lr: float = 1.5e-3
    min_lr_ratio: float = doc(0.1, "cosine floor as a fraction of lr")
    warmup_steps: int = 40
    weight_decay: float = 0.1
    betas: list[float] = doc(lambda: [0.9, 0.95], "AdamW betas")
    decay_vectors: bool = doc(False, "weight decay on AdamW's 1-D parameters too (norm weights, biases), as torch's "
                                     "AdamW over every parameter (speculators) does")
    grad_clip: float = 1.0
    batch_size: int = doc(16, "global batch (rows of seq_len)")
    grad_accum: int = 1
    muon_lr: float | None = doc(None, "the Muon group's lr (None = lr; its step is scaled to AdamW's update RMS)")
    muon_momentum: float = 0.95
    muon_ns_steps: int = doc(5, "Newton-Schulz iterations per Muon step")

    def validate(self):
        positive(self, "lr muon_lr")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise RecipeError(f"muon_momentum: expected a number in [0, 1), got {self.muon_momentum}")
        at_least(self, "muon_ns_steps", 1)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise RecipeError(f"min_lr_ratio: expected a fraction in [0, 1], got {self.min_lr_ratio}")
        at_least(self, "warmup_steps", 0)
        at_least(self, "weight_decay", 0.0)
        at_least(self, "grad_clip", 0.0, " (0 = off)")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise RecipeError(f"betas: expected two numbers in [0, 1), got {self.betas}")
        at_least(self, "batch_size grad_accum", 1)


@dataclass
class LogConfig:
    wandb_project: str = "dspark"
    wandb_mode: Literal["offline", "online", "disabled"] = doc("offline", "online only when configured")
    log_every: int = 10
    eval_every: int = doc(100, "steps between holdout evaluations")
    save_every: int = doc(100, "steps between resumable checkpoints")
    profile_steps: int = doc(0, "profile this many steps after the first (torch.profiler, rank 0) into "
                                "<output_dir>/profile.txt: wall ms per step and the top ops by device time")
    keep_best: Literal["", "tau", "ce", "loss"] = doc("", "also keep the model with the best value of this holdout "
                                                          "metric in <output_dir>/best (tau: highest; ce, loss: "
                                                          "lowest); '' = off")

    def validate(self):
        at_least(self, "log_every eval_every save_every", 1, " (steps)")
        at_least(self, "profile_steps", 0)


_RESUME = ("continue from the last checkpoint in output_dir; the recipe must match the checkpoint's (architecture, "
           "data, optimizer, schedule)")
_OVERWRITE = ("start over in an output_dir that holds an earlier run: its checkpoints, final model, logs and cached "
              "sequences are deleted first (without it or resume, such a dir is an error)")


def validate_run(recipe) -> None:
    """The fields every training recipe has."""
    if not recipe.output_dir.strip():
        raise RecipeError("output_dir: expected a directory path, got ''")
    at_least(recipe, "max_steps", 1)
    at_least(recipe, "max_minutes", 0.0, " (0: stop after the first step)")
    at_least(recipe, "num_threads", 1)
    if recipe.resume and recipe.overwrite:
        raise RecipeError("resume, overwrite: choose one (resume=true continues the run in output_dir, "
                          "overwrite=true deletes it and starts over)")


_MAX_MINUTES = ("stop after this wall time, counted from the end of the first step (its compile and autotune "
                "excluded); the lr schedule follows steps")


@dataclass
class TargetRecipe:
    kind: Literal["target"]
    output_dir: str
    arch: Literal["qwen3", "k3"] = "qwen3"
    model: dict = doc(dict, "architecture fields: qwen3 -> qwen3_config(...) args; k3 -> KimiLinearConfig fields")
    data: DataConfig = doc(DataConfig, "")
    optim: OptimConfig = doc(OptimConfig, "")
    log: LogConfig = doc(LogConfig, "")
    max_steps: int = 400
    max_minutes: float | None = doc(None, _MAX_MINUTES)
    seed: int = 0
    resume: bool = doc(False, _RESUME)
    overwrite: bool = doc(False, _OVERWRITE)
    device: Literal["auto", "cpu", "cuda"] = doc("auto", "auto: the GPU when there is one")
    mixed_precision: Literal["no", "bf16", "fp16"] = doc("no", "accelerate mixed precision (bf16 on GPU)")
    num_threads: int | None = doc(None, "torch CPU threads (None = torch default)")

    def validate(self):
        validate_run(self)


@dataclass
class DrafterModelConfig:
    backbone: Literal["auto", "qwen3", "k3"] = doc("auto", "qwen3 (GQA, fc+hidden_norm) or k3 (MLA, context_proj); auto = from the target")
    mode: Literal["dspark", "dflash"] = doc("dspark", "dspark: anchor-as-first + Markov head; dflash: 1+N fill-in")
    block_size: int = doc(4, "queries per block (drafts: N for dspark, N-1 for dflash)")
    num_layers: int = 2
    num_heads: int | None = doc(None, "None = the target's")
    num_kv_heads: int | None = doc(None, "None = the target's")
    head_dim: int | None = doc(None, "None = the target's")
    intermediate_size: int | None = doc(None, "None = the target's")
    target_layer_ids: list[int] | None = doc(None, "0-based 'after layer i'; None = spread like DFlash")
    markov_rank: int = doc(32, "0 = no Markov head (forced 0 in dflash mode)")
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = False

    def validate(self):
        at_least(self, "block_size", 1 if self.mode == "dspark" else 2, f" in {self.mode} mode")
        at_least(self, "num_layers num_heads num_kv_heads head_dim intermediate_size", 1)
        at_least(self, "markov_rank", 0)
        if self.backbone == "k3" and self.mode == "dflash":
            raise RecipeError("drafter.mode: the k3 backbone (K3DSparkModel) has only the dspark layout; a DFlash "
                              "drafter for a K3 target takes Qwen3 layers: set drafter.backbone=qwen3")
        ids = self.target_layer_ids
        if ids is not None and (not ids or min(ids) < 0 or ids != sorted(set(ids))):
            raise RecipeError(f"target_layer_ids: expected strictly increasing 0-based layer ids (or null), got {ids}")


@dataclass
class RegenerateConfig:
    enabled: bool = doc(True, "the target writes the responses the drafter learns from")
    num_sequences: int = doc(512, "prompts to continue")
    prompt_tokens: int | list[int] = doc(64, "prompt length cut from each source sequence; a list: the prompts take "
                                         "these lengths in turn, so anchors cover the positions serving sees")
    new_tokens: int = doc(192, "tokens the target writes per prompt")
    temperature: float = doc(0.0, "0 = greedy, as evaluated")
    batch_size: int = 64
    code_prompts: float = doc(0.0, "share of the train prompts that end where a Python function's body begins (after "
                                   "its docstring, HumanEval's form), cut from the corpus's train .py files; the rest "
                                   "are corpus windows")
    chat_prompts: float = doc(0.0, "share of the train prompts wrapped as a user turn in the target tokenizer's chat "
                                   "template (with the assistant's generation prompt), so the target answers them as "
                                   "a chat reply; needs a tokenizer with a chat template")

    def validate(self):
        at_least(self, "num_sequences new_tokens batch_size", 1)
        at_least(self, "temperature", 0.0, " (0 = greedy)")


@dataclass
class DrafterDataConfig:
    dataset: str | None = doc(None, "local json/jsonl/parquet/txt file or dir (or a hub id when online); None = the corpus")
    corpus: DataConfig = doc(DataConfig, "the real corpus, used when dataset is None (tokenizer: the target's)")
    seq_len: int = 256
    labels: Literal["target", "data"] = doc("target", "train on the target's argmax (KD) or on the data tokens")
    regenerate: RegenerateConfig = doc(RegenerateConfig, "")
    holdout_sequences: int = doc(32, "sequences for the holdout acceptance estimate")
    order: Literal["replacement", "passes"] = doc(
        "replacement", "which train sequences a step draws: replacement = independently at random; passes = "
                       "consecutive slices of a shuffled order, each sequence once per pass (as epochs)")

    def validate(self):
        at_least(self, "seq_len", 8)
        at_least(self, "holdout_sequences", 1)


@dataclass
class LossConfig:
    ce: float = doc(1.0, "weight of the cross-entropy on the labels (the target's argmax)")
    distill: float = doc(0.0, "weight of the TV distance to the target distribution")
    kl: float = doc(0.0, "weight of KL(p_target || q_draft) at each drafted position (soft targets)")
    confidence: float = doc(0.1, "weight of the confidence-head BCE")
    confidence_target: Literal["correct", "tv"] = doc(
        "correct", "what the confidence head learns: correct = whether the greedy draft is the label (0/1); tv = "
        "1 - TV(q_draft, p_target), the chance a draft sampled from q is accepted by rejection sampling")
    decay_gamma: float | None = doc(None, "position decay exp(-d/gamma) of the ce, distill and kl terms; None = "
                                          "block_size")
    decay_norm: Literal["weights", "tokens"] = doc(
        "weights", "the decayed terms' denominator: the sum of the decay weights (a weighted mean), or the number of "
        "drafted tokens (speculators' DSpark)")
    confidence_grad: bool = doc(False, "the confidence BCE's gradient reaches the draft layers (speculators' DSpark); "
                                       "false: the head learns on detached hidden states")

    def validate(self):
        at_least(self, "ce distill kl confidence", 0.0)
        if self.ce + self.distill + self.kl <= 0:
            raise RecipeError(f"ce: expected > 0 when distill and kl are 0 (the drafter learns the tokens from one "
                              f"of them), got ce={self.ce}, distill={self.distill}, kl={self.kl}")
        positive(self, "decay_gamma")


@dataclass
class ExportConfig:
    layout: Literal["dspark", "dflash"] | None = doc(None, "None = the drafter's mode")


@dataclass
class DrafterRecipe:
    kind: Literal["drafter"]
    output_dir: str
    target: str = doc("runs/qwen3-tiny/final", "target checkpoint dir (HF)")
    drafter: DrafterModelConfig = doc(DrafterModelConfig, "")
    data: DrafterDataConfig = doc(DrafterDataConfig, "")
    anchors_per_seq: int = doc(32, "random blocks trained per sequence in one pass")
    anchors: Literal["uniform", "rejection"] = doc(
        "uniform", "where blocks start: uniform = random loss positions; rejection = a share of them where a greedy "
        "decode with the current drafter would start its next block (train/anchors.py)")
    rejection_share: float = doc(0.5, "anchors=rejection: the share of each row's anchors drawn from those decode "
                                      "starts (the rest uniform)")
    block_mask: Literal["auto", "flex", "dense"] = doc(
        "auto", "flex: flex-attention BlockMask (compiled, CUDA); dense: SDPA bool mask; auto: flex on CUDA "
        "(dense if its first step fails to compile, with a warning), dense on CPU")
    compile: bool = doc(False, "torch.compile the step's forward (the target's features, the drafter, the loss) and "
                                "its backward: a few fused kernels where eager launches some 600 ops a step (the "
                                "step of a small drafter is bound by its launches); the first step compiles")
    target_sharding: Literal["none", "fsdp"] = doc(
        "none", "fsdp: shard the frozen target over the data-parallel processes (FSDP2, one unit per layer) for "
        "targets that do not fit one GPU; needs pre-regenerated data (data.regenerate.enabled=false)")
    loss: LossConfig = doc(LossConfig, "")
    optim: OptimConfig = doc(lambda: OptimConfig(lr=1e-3, warmup_steps=20, batch_size=8), "")
    log: LogConfig = doc(LogConfig, "")
    export: ExportConfig = doc(ExportConfig, "")
    serve: dict = doc(dict, "deployment for `python -m serve --engine vllm --recipe` (keys: serve/vllm.py docstring)")
    max_steps: int = 400
    max_minutes: float | None = doc(None, _MAX_MINUTES)
    seed: int = 0
    resume: bool = doc(False, _RESUME)
    overwrite: bool = doc(False, _OVERWRITE)
    device: Literal["auto", "cpu", "cuda"] = doc("auto", "auto: the GPU when there is one")
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    num_threads: int | None = None

    def validate(self):
        validate_run(self)
        if not self.target.strip():
            raise RecipeError("target: expected the target checkpoint dir, got ''")
        if self.anchors_per_seq < 1:
            raise RecipeError(f"anchors_per_seq: expected >= 1, got {self.anchors_per_seq}")
        if self.drafter.block_size + 2 > self.data.seq_len:
            raise RecipeError(f"drafter.block_size: {self.drafter.block_size} leaves no room in data.seq_len={self.data.seq_len}")
        lens = self.data.regenerate.prompt_tokens
        lens = [lens] if isinstance(lens, int) else lens
        if not lens or min(lens) < 1:
            raise RecipeError(f"data.regenerate.prompt_tokens: expected a length >= 1 or a non-empty list of them, "
                              f"got {self.data.regenerate.prompt_tokens!r}")
        share = self.data.regenerate.code_prompts
        if not 0.0 <= share <= 1.0:
            raise RecipeError(f"data.regenerate.code_prompts: expected a share in [0, 1], got {share}")
        if share > 0 and self.data.dataset is not None:
            raise RecipeError("data.regenerate.code_prompts: cut from the corpus, so it needs data.dataset unset "
                              f"(got data.dataset={self.data.dataset!r}); set code_prompts: 0 for a dataset")
        if not 0.0 <= self.rejection_share <= 1.0:
            raise RecipeError(f"rejection_share: expected a share in [0, 1], got {self.rejection_share}")
        chat = self.data.regenerate.chat_prompts
        if not 0.0 <= chat <= 1.0:
            raise RecipeError(f"data.regenerate.chat_prompts: expected a share in [0, 1], got {chat}")
        if chat > 0 and not self.data.regenerate.enabled:
            raise RecipeError("data.regenerate.chat_prompts: wraps regeneration prompts, so it needs "
                              "data.regenerate.enabled=true (or chat_prompts: 0)")
        if self.data.regenerate.enabled and max(lens) >= self.data.seq_len:
            raise RecipeError(f"data.regenerate.prompt_tokens: {max(lens)} leaves no response tokens in "
                              f"data.seq_len={self.data.seq_len} (sequences are cut to seq_len)")


RECIPES = {"target": TargetRecipe, "drafter": DrafterRecipe}


def load_recipe(path: str | Path, overrides: list[str] = ()):
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {str(path)!r}: no such file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe {path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path}: expected a mapping at the top level")
    data = apply_overrides(data, list(overrides))
    kind = data.get("kind")
    if kind not in RECIPES:
        raise RecipeError(f"kind: expected one of {sorted(RECIPES)}, got {kind!r}")
    return from_dict(RECIPES[kind], data)
