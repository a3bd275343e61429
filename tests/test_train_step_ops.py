"""bench/train_step_ops.py on CPU over a tiny Qwen3 pair: a training step's ops by part, and what they say about the
optimizers (Muon's launches follow the matrices' shapes, not their number; AdamW is fused)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_train_drafter import recipe, train

ROOT = Path(__file__).resolve().parents[1]


def count(path: Path, target: Path, sequences: Path, out: Path, *overrides: str) -> dict:
    cmd = [sys.executable, "bench/train_step_ops.py", str(path), "--target", str(target), "--sequences",
           str(sequences), "--steps", "2", "--out", str(out), "--set", *overrides]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())


def test_step_ops_by_part_and_optimizer_launches(setup, tmp_path):
    path = recipe(setup, "ops-seqs")
    res = train(path, "max_steps=1")  # writes the sequences the counted runs start from
    assert res.returncode == 0, res.stderr[-2000:]
    sequences = setup / "ops-seqs" / "sequences.pt"
    one, two = (count(path, setup / "target", sequences, tmp_path / f"{n}.json", "optim.optimizer=muon",
                      f"drafter.num_layers={n}") for n in (1, 2))
    for r in (one, two):
        assert r["steps"] == 2 and abs(sum(r["parts"].values()) - r["ops_per_step"]) < 1e-6
        assert {"target forward", "drafter forward", "loss", "backward", "optimizer: muon", "optimizer: adamw",
                "anchors"} <= set(r["parts"])
        assert r["parts"]["optimizer: adamw"] <= 4  # fused: a kernel per dtype and device, and its step count
    # a second layer adds its matrices to the batches of the first layer's shapes: no Muon op more
    assert two["parts"]["optimizer: muon"] == one["parts"]["optimizer: muon"]
    assert two["parts"]["drafter forward"] > one["parts"]["drafter forward"]
