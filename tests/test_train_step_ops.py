"""bench/train_step_ops.py on CPU over a tiny Qwen3 pair: a training step's ops by part, and what they say about the
optimizers (Muon's launches follow the matrices' shapes, not their number; AdamW is fused)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

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


def test_train_speed_rows_on_a_random_target(setup, tmp_path):
    """bench/train_speed.py: a random target of a target recipe, random sequences, one training run per row; each
    row's tokens/s is its steps/s times the step's tokens, the step's FLOPs are counted, no MFU without a GPU peak, and
    a row whose training fails is reported (exit 1) without stopping the others."""
    path = recipe(setup, "speed")
    out = tmp_path / "speed"
    cmd = [sys.executable, "bench/train_speed.py", str(path), "--target-recipe", "recipes/targets/qwen3-tiny.yaml",
           "--tokenizer", str(setup / "target"), "--vocab", "512", "--out", str(out), "--steps", "6", "--skip", "2",
           "--sequences", "16", "--row", "eager:", "--row", "muon: optim.optimizer=muon",
           "--row", "bad: optim.lr=-1"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stderr[-3000:]
    got = json.loads((out / "speed.json").read_text())
    # a GPU's bf16 peak where the GPU is a known one (a CUDA run of the suite), else none: no MFU
    peak = got["peak_tflops"]
    assert got["vocab"] == 512 and got["flops_per_step"] > got["target_fwd"] > 0
    assert peak is None or (torch.cuda.is_available() and peak > 0)
    assert got["tokens"] == 4 * 96  # optim.batch_size x data.seq_len of the test recipe
    for name in ("eager", "muon"):
        r = got["rows"][name]
        assert r["steps_timed"] == 4 and r["steps_per_s"] > 0
        assert r["mfu"] is None if peak is None else r["mfu"] == r["tflops"] / peak
        assert abs(r["tokens_per_s"] - r["steps_per_s"] * got["tokens"]) < 1e-6 * r["tokens_per_s"]
    assert "error" in got["rows"]["bad"] and "| bad |" in (out / "speed.md").read_text()
