"""Checkpoint I/O shared by every model (Qwen3 and K3 targets, drafters): HF-style dirs written whole through a temp
dir and one rename, weights read from `model.safetensors` or the shards of `model.safetensors.index.json`, and a
strict name/shape check whose errors name the tensor.

Checkpoint names vs the modules' own: a module that holds merged weights (dspark.models.layers.MergedLinear, the
stacked experts of dspark.models.k3.experts) answers `checkpoint_views()` -> {own tensor name: [(checkpoint name
beside the module, index into the tensor)]}; checkpoint_state() turns a model's state into the HF/vLLM names
(views of the merged tensors, no copy) and merge_checkpoint_state() assembles the merged tensors back.

Low level on purpose: it imports no model, so the models import it and `dspark.checkpoint` (which builds models)
sits above both.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@contextlib.contextmanager
def atomic_dir(out_dir: str | Path):
    """Yields a temp dir beside out_dir to fill; on success it is renamed into place (an existing out_dir is replaced
    whole), on any error removed: a crash never leaves a half-written dir."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{str(out)!r} exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
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


def save_checkpoint_dir(out_dir: str | Path, config: dict, state: dict[str, torch.Tensor],
                        extra_files: dict[str, Path] | None = None) -> Path:
    """Write config.json + model.safetensors (+ copies of extra files) into out_dir atomically (atomic_dir)."""
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        for name, src in (extra_files or {}).items():
            shutil.copy2(src, tmp / name)
    return Path(out_dir)


def read_config(path: str | Path) -> dict:
    """config.json of a checkpoint dir, as a dict."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint dir {str(path)!r} does not exist (not a directory)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: config.json missing; a checkpoint dir needs config.json and {WEIGHTS}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object at the top level")
    return cfg


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint dir: the shards named by model.safetensors.index.json when there is
    one, else model.safetensors."""
    path = Path(path)
    index = path / INDEX
    if not index.is_file():
        f = path / WEIGHTS
        if not f.is_file():
            raise FileNotFoundError(f"{f}: missing; expected the weights in safetensors format ({WEIGHTS}, or shards "
                                    f"listed in {INDEX})")
        return [f]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a safetensors index (expected JSON with a 'weight_map'; {e})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: 'weight_map' must map tensor names to shard files")
    files = [path / name for name in sorted(set(weight_map.values()))]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: shard listed in {INDEX} is missing")
    return files


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint dir (single file or sharded); a tensor found in two shards is an error."""
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    if k in out:
                        raise ValueError(f"{f}: tensor {k!r} appears in more than one shard")
                    out[k] = sf.get_tensor(k)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f}: corrupt or truncated safetensors file ({e})") from None
    return out


def check_state(expected: dict[str, torch.Tensor | torch.Size], got: dict[str, torch.Tensor], where: str,
                ignore: set[str] = frozenset()) -> None:
    """Strict name/shape check of `got` against `expected` (tensors or shapes); the error names the first offending
    tensor, its shape and the expected one. Names in `ignore` may be present or absent."""
    exp = {k: tuple(v.shape if isinstance(v, torch.Tensor) else v) for k, v in expected.items() if k not in ignore}
    missing = [k for k in exp if k not in got]
    extra = sorted(set(got) - set(exp) - set(ignore))
    if missing:
        raise ValueError(f"{where}: missing tensor {missing[0]!r} (expected shape {exp[missing[0]]})"
                         + (f"; {len(missing)} missing in all" if len(missing) > 1 else ""))
    if extra:
        raise ValueError(f"{where}: unexpected tensor {extra[0]!r} with shape {tuple(got[extra[0]].shape)}"
                         + (f"; {len(extra)} unexpected in all" if len(extra) > 1 else ""))
    for k, shape in exp.items():
        if tuple(got[k].shape) != shape:
            raise ValueError(f"{where}: tensor {k!r} has shape {tuple(got[k].shape)}, expected {shape}")


def _views(model: torch.nn.Module) -> dict[str, list[tuple[str, Any]]]:
    """state_dict name of every merged tensor -> [(checkpoint name, index into the merged tensor)]."""
    out = {}
    for name, module in model.named_modules():
        views = getattr(module, "checkpoint_views", None)
        if views is None:
            continue
        own = name + "." if name else ""
        parent = name.rpartition(".")[0] + "." if "." in name else ""
        for tensor, parts in views().items():
            out[own + tensor] = [(parent + ck, idx) for ck, idx in parts]
    return out


def checkpoint_state(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """`state` (default model.state_dict()) under the checkpoint's names: each merged tensor replaced by its blocks,
    as views (no copy); every other tensor as it is."""
    views = _views(model)
    out = {}
    for k, t in (model.state_dict() if state is None else state).items():
        if k in views:
            out.update((ck, t[idx]) for ck, idx in views[k])
        else:
            out[k] = t
    return out


def merge_checkpoint_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """checkpoint_state's inverse: checkpoint-named tensors -> the model's state_dict names, each merged tensor
    assembled once from its blocks (in the blocks' dtype and device). Other names pass through; a merged tensor
    with a block missing is left out (check_state against checkpoint_state(model) names it first)."""
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    out = dict(tensors)
    for k, parts in _views(model).items():
        if not all(ck in out for ck, _ in parts):
            continue
        first = out[parts[0][0]]
        merged = torch.zeros(shapes[k], dtype=first.dtype, device=first.device)  # rows no block covers stay 0
        for ck, idx in parts:
            merged[idx] = out.pop(ck)
        out[k] = merged
    return out


def load_state_strict(path: str | Path, model: torch.nn.Module, ignore: set[str] = frozenset()):
    """The weights of checkpoint dir `path`, checked strictly against the model's checkpoint names and shapes
    (checkpoint_state, minus `ignore`), returned under the model's own names (merge_checkpoint_state)."""
    state = read_weights(path)
    check_state(checkpoint_state(model), state, str(Path(path)), ignore)
    return merge_checkpoint_state(model, {k: v for k, v in state.items() if k not in ignore})


def nonfinite_tensors(state: dict[str, torch.Tensor]) -> list[tuple[str, int]]:
    """(name, count of NaN/inf values) of every floating-point tensor that has any, in name order."""
    bad = []
    for k in sorted(state):
        t = state[k]
        if t.is_floating_point() and t.device.type != "meta":
            n = int((~torch.isfinite(t)).sum())
            if n:
                bad.append((k, n))
    return bad
