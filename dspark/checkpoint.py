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
        raise FileNotFoundError(f"checkpoint dir {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: missing; a checkpoint dir needs config.json and {WEIGHTS}")
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
        from dspark.models.qwen3 import Qwen3ForCausalLM

        return Qwen3ForCausalLM.from_pretrained(path, device=device, dtype=dtype)
    if mt in ("kimi_linear", "kimi_k3"):
        from dspark.models.k3.model import K3ForCausalLM

        return K3ForCausalLM.from_pretrained(path, device=device, dtype=dtype)
    raise ValueError(f"{Path(path) / 'config.json'}: model_type {mt!r} is not a supported target; "
                     "expected 'qwen3', 'kimi_linear' or 'kimi_k3'")
