"""Device ops per drafter training step, by part of the step: a CPU proxy for the kernels a GPU step launches.

    python bench/train_step_ops.py recipes/quickstart.yaml --target runs/quickstart/target/final \
        --sequences runs/quickstart/drafter/sequences.pt [--steps 2] [--set key=value ...] [--ops] [--out F]

A small drafter's training step on a GPU is bound by the host: each eager op costs it microseconds to launch, so the
step's time follows its op count (the k3-mini and peer-qwen3-mini steps of bench/RESULTS.md). This runs the recipe
through `python -m train`'s own code (train.drafter, train.loop) from a regenerated sequences file (no regeneration)
and counts, over `--steps` steps after the first, every aten op that computes (views and allocations left out, as
bench/step_ops.py) by the part of the step that issued it: anchor sampling, the target's forward, the block targets,
the drafter's forward, the loss, the backward, gradient clipping, each optimizer, zero_grad and the loop's logging.
`F.rms_norm` counts once (one kernel on CUDA), but its backward counts the CPU's decomposition (CUDA runs a fused
backward). A foreach or fused op counts once (on CUDA: one kernel per chunk of tensors). Under `compile=true` the
step runs as compiled kernels this counter does not see: count it with the profiler on the GPU.
"""
from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import accelerate
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from step_ops import OpCounter, labelled, one_op, print_counts  # noqa: E402  (bench/step_ops.py)

import train.drafter as drafter_mod  # noqa: E402
import train.loop as loop_mod  # noqa: E402
from dspark.config import load_recipe  # noqa: E402
from dspark.models.drafter import DSparkDrafter  # noqa: E402
from dspark.models.k3.model import K3ForCausalLM  # noqa: E402
from dspark.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from train import optim as optim_mod  # noqa: E402

COUNTER = OpCounter()


class CountingProfile:
    """Stands in for train.loop._StepProfile (log.profile_steps): counts the ops of steps first..first+n-1."""

    def __init__(self, device, first_step: int, n: int):
        self.first, self.last = first_step, first_step + n - 1
        COUNTER.__enter__()

    def done(self, step: int, out: Path, end: bool = False) -> bool:
        if step < self.last and not end:
            return False
        COUNTER.__exit__(None, None, None)
        COUNTER.steps = step - self.first + 1
        return True


def _method(cls, name: str, label: str):
    """cls.name with its ops counted under `label` (its signature kept: accelerate reads zero_grad's)."""
    fn = getattr(cls, name)
    return mock.patch.object(cls, name, functools.wraps(fn)(labelled(COUNTER, label, fn)))


def count_steps(recipe_path: str, target: str, sequences: str, steps: int, overrides: list[str]) -> dict:
    """-> {steps, ops_per_step, parts, ops} over `steps` training steps after the first."""
    work = Path(tempfile.mkdtemp(prefix="train-step-ops-"))
    try:
        shutil.copy(sequences, work / "sequences.pt")
        recipe = load_recipe(recipe_path, [
            f"target={target}", f"output_dir={work}", "resume=true", f"max_steps={steps + 1}", "max_minutes=null",
            f"log.profile_steps={steps}", "log.eval_every=1000000", "log.save_every=1000000",
            "log.wandb_mode=disabled", "log.keep_best=", *overrides])
        with ExitStack() as stack:
            patch = stack.enter_context
            patch(mock.patch.object(loop_mod, "_StepProfile", CountingProfile))
            patch(mock.patch.object(loop_mod, "_evaluate", lambda *a: {}))
            patch(mock.patch.object(F, "rms_norm", one_op("rms_norm", F.rms_norm)))
            for name, label in (("sample_anchors", "anchors"), ("block_targets", "block targets"),
                                ("drafter_loss", "loss")):
                patch(mock.patch.object(drafter_mod, name, labelled(COUNTER, label, getattr(drafter_mod, name))))
            patch(mock.patch.object(loop_mod, "_read_values", labelled(COUNTER, "logging", loop_mod._read_values)))
            for cls in (Qwen3ForCausalLM, K3ForCausalLM):
                patch(_method(cls, "forward", "target forward"))
            patch(_method(DSparkDrafter, "train_forward", "drafter forward"))
            patch(_method(accelerate.Accelerator, "backward", "backward"))
            patch(_method(accelerate.Accelerator, "clip_grad_norm_", "grad clip"))
            patch(_method(torch.optim.AdamW, "step", "optimizer: adamw"))
            patch(_method(optim_mod.Muon, "step", "optimizer: muon"))
            patch(_method(torch.optim.Optimizer, "zero_grad", "zero_grad"))
            drafter_mod.train_drafter(recipe)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = COUNTER.steps
    parts = {p: c / n for p, c in sorted(COUNTER.per_part().items(), key=lambda kv: -kv[1])}
    return {"recipe": recipe_path, "overrides": overrides, "steps": n, "ops_per_step": sum(parts.values()),
            "parts": parts, "ops": {f"{p} / {o}": c / n for (p, o), c in
                                    sorted(COUNTER.ops.items(), key=lambda kv: -kv[1])}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--target", required=True)
    ap.add_argument("--sequences", required=True, help="a sequences.pt written by a drafter run (train/sequences.py)")
    ap.add_argument("--steps", type=int, default=2, help="steps counted (after the first)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ops", action="store_true", help="print each op's count per part too")
    ap.add_argument("--out", help="write the result as JSON here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    r = count_steps(a.recipe, a.target, a.sequences, a.steps, a.set)
    print(f"{a.recipe} {' '.join(a.set)}: {r['ops_per_step']:.0f} ops per step over {r['steps']} steps")
    print_counts(r, a.ops)
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
