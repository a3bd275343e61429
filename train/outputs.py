"""A run's output_dir: checked before any work, never deleted silently.

- An output_dir holding an earlier run (checkpoints/, final/ or train_log.jsonl) needs `resume=true` (continue it)
  or `overwrite=true` (delete what the earlier run wrote, then start over); otherwise the run stops with an error
  naming both.
- A resume continues only a run of the same recipe: every checkpoint records the recipe, and a field that changes
  what is trained (architecture, data, optimizer, schedule such as max_steps) must be the same; run-control fields
  (RUN_CONTROL) may differ.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from dspark.config import RecipeError
from train.sync import wait_for_everyone

log = logging.getLogger(__name__)

PREVIOUS_RUN = ("checkpoints", "final", "train_log.jsonl")  # what marks a dir as holding an earlier run
RUN_OUTPUTS = PREVIOUS_RUN + ("best", ".best.tmp", "final_metrics.json", "recipe.json", "profile.txt",
                              "sequences.pt", "wandb")  # everything a run writes there (overwrite deletes these)
# fields that do not change what is trained: they may differ between a run and its resume
RUN_CONTROL = ("output_dir", "resume", "overwrite", "max_minutes", "device", "num_threads", "mixed_precision", "log",
               "export", "serve", "block_mask", "target_sharding", "data.regenerate.batch_size")


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint (one with trainer_state.json) under ckpt_root, or None."""
    done = [p for p in ckpt_root.glob("step-*") if (p / "trainer_state.json").is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1])) if done else None


def check_output_dir(recipe) -> Path | None:
    """Before any work: output_dir is usable for this recipe (see the module doc). -> the checkpoint a resume starts
    from (None: the run starts at step 0). RecipeError names the field and the choices."""
    out = Path(recipe.output_dir)
    if out.exists() and not out.is_dir():
        raise RecipeError(f"output_dir: {out} exists and is not a directory")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise RecipeError(f"output_dir: {out} cannot be created: {parent} is a file")
    if not os.access(parent, os.W_OK):
        raise RecipeError(f"output_dir: {out} cannot be written ({parent} is not writable)")
    earlier = [name for name in PREVIOUS_RUN if (out / name).exists()]
    last = latest_checkpoint(out / "checkpoints")
    if recipe.resume:
        if last is None and earlier:
            raise RecipeError(f"resume: {out} holds an earlier run ({', '.join(earlier)}) but no complete checkpoint "
                              "to resume from; set overwrite=true to start over, or choose another output_dir")
        if last is not None:
            check_resume_matches(recipe, last)
        return last
    if earlier and not recipe.overwrite:
        raise RecipeError(f"output_dir: {out} holds an earlier run ({', '.join(earlier)}); set resume=true to "
                          "continue it, overwrite=true to delete it and start over, or choose another output_dir")
    return None


def recipe_fields(recipe, prefix: str = "") -> dict:
    """{dotted field: value} over the recipe's dataclass sections (a dict-valued field is one value)."""
    out = {}
    for f in dataclasses.fields(recipe):
        v = getattr(recipe, f.name)
        if dataclasses.is_dataclass(v):
            out.update(recipe_fields(v, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = v
    return out


def _saved(saved: dict, key: str):
    node = saved
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


_ABSENT = object()


def check_resume_matches(recipe, checkpoint: Path) -> None:
    """The recipe matches the one the checkpoint was trained with, outside RUN_CONTROL; RecipeError names the first
    field that differs. A checkpoint that recorded no recipe (or a field added since) is not compared."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    saved = state.get("recipe")
    if not isinstance(saved, dict):
        log.warning("resume: %s records no recipe; the recipe is not compared with it", checkpoint)
        return
    for key, value in recipe_fields(recipe).items():
        if key in RUN_CONTROL or key.split(".")[0] in RUN_CONTROL:
            continue
        old = _saved(saved, key)
        if old is _ABSENT:
            continue
        if json.loads(json.dumps(value)) != old:  # compare as the checkpoint stored it (JSON)
            why = ("the lr schedule follows it" if key == "max_steps" or key.startswith("optim.")
                   else "the model would not be the one checkpointed" if key.startswith(("model", "drafter", "arch"))
                   else "the run would not continue the same training")
            raise RecipeError(f"resume: {key} is {value!r} but the checkpoint {checkpoint} was trained with {old!r} "
                              f"({why}); set {key}={json.dumps(old)} to resume it, or overwrite=true to start over")


def clear_earlier_run(out: Path) -> None:
    """overwrite=true: delete what an earlier run wrote in `out` (RUN_OUTPUTS and regeneration parts), nothing else."""
    removed = []
    for name in RUN_OUTPUTS:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
        else:
            continue
        removed.append(name)
    for p in out.glob("regenerated-*.pt"):
        p.unlink()
        removed.append(p.name)
    if removed:
        log.warning("overwrite=true: deleted the earlier run's %s in %s", ", ".join(removed), out)


def check_devices(recipe) -> None:
    """What depends on the machine: the device exists, fp16 has a GPU, the global batch splits over the processes
    (WORLD_SIZE, set by torchrun / accelerate launch)."""
    num_processes = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if recipe.device == "cuda" and not cuda:
        raise RecipeError("device: cuda, but torch sees no CUDA GPU here; use device=auto or device=cpu")
    if recipe.mixed_precision == "fp16" and (recipe.device == "cpu" or not cuda):
        raise RecipeError("mixed_precision: fp16 needs a CUDA GPU; use bf16 or no on CPU")
    if recipe.optim.batch_size % num_processes:
        raise RecipeError(f"optim.batch_size: {recipe.optim.batch_size} does not split over the {num_processes} "
                          "data-parallel processes; use a multiple of it")


def preflight(recipe) -> None:
    """Every check that needs no model or data, before any work: the machine, then output_dir."""
    check_devices(recipe)
    check_output_dir(recipe)


def start_run(recipe, accelerator) -> None:
    """After the checks, before the work: overwrite=true clears the earlier run (main process; all wait)."""
    if recipe.overwrite and accelerator.is_main_process:
        clear_earlier_run(Path(recipe.output_dir))
    wait_for_everyone(accelerator)
