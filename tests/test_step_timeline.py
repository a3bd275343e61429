"""bench/step_timeline.py on CPU over a tiny pair: every run and setting is reported, the host's phases add up to the
step, the cycle holds the step, and the engine's own methods are back once a run ends."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dspark import Engine, load_drafter, load_target
from tests.targets import make_target
from tests.test_engine import V, make_drafter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from pair_decode import profile  # noqa: E402
from step_timeline import PolicySamples  # noqa: E402


def test_step_timeline_phases_add_up(models, tmp_path):
    target, drafter = models
    out = tmp_path / "timeline.json"
    cmd = [sys.executable, "bench/step_timeline.py", "--target", str(target), "--drafter", str(drafter),
           "--runs", "ar,k2,auto", "--temperatures", "0,0.7", "--batches", "1,2", "--prompts", "2",
           "--max-tokens", "40", "--device", "cpu", "--per-step", "--kernels", "3", "--kernels-batch", "2",
           "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    res_json = json.loads(out.read_text())
    runs = res_json["runs"]
    assert {(r["run"], r["temperature"], r["batch"]) for r in runs} == {
        (n, t, b) for n in ("ar", "k2", "auto") for t in (0.0, 0.7) for b in (1, 2)}
    for r in runs:
        assert r["tok_s"] > 0 and r["steps"] > 0 and len(r["per_step"]) == r["steps"]
        parts = r["launch"] + r["flush"] + r["read_wait"] + r["read_rest"] + r["other"]
        assert abs(parts - r["step"]) < 1e-6 and r["other"] >= 0 and r["cycle"] >= r["step"] > 0
        # the unprobed pass: the host's own work within its cycle; the probed step holds its own host work
        assert 0 < r["host"] <= r["cycle_bare"] and 0 < r["host_probed"] <= r["step"] and r["tok_s_bare"] > 0
        ks = {key[1] for s in r["per_step"] for key in s["keys"]}
        assert ks == ({0} if r["run"] == "ar" else {2} if r["run"] == "k2" else {4})  # CPU: the whole block
        assert (r["tau"] is None) == (r["run"] == "ar")
        # per k as it ran: the k of every step; tokens per row-step at batch 1 = τ for a drafting run (1 for AR)
        assert set(r["per_k"]) == {str(k) for k in ks} and r["per_k"][str(max(ks))]["cycle_ms"] > 0
        assert ("policy" in r) == (r["run"] == "auto") and r.get("policy", {}).get("estimates") is None  # CPU
        if r["batch"] == 1:
            want = 1.0 if r["tau"] is None else r["tau"]
            assert abs(r["per_k"][str(max(ks))]["tokens_per_row_step"] - want) < 0.35
    assert "| k2 | 0.7 | 2 |" in res.stdout
    # the profiled steps (one per run and temperature): the host's time per step, split into waits and its own work
    prof = res_json["kernels"]
    assert [(k["run"], k["temperature"]) for k in prof] == [(n, t) for n in ("ar", "k2", "auto") for t in (0.0, 0.7)]
    assert all(k["batch"] == 2 for k in prof)
    for k in prof:
        assert k["host_step_us"] > 0 and 0 < k["host_own_us"] <= k["host_step_us"] and k["host_top"]
        assert k["kernels_per_step"] == 0  # no device on the CPU


def test_step_timeline_nocontext_run_is_the_ar_step_inside_the_dspark_engine(models, tmp_path):
    """--runs nocontext: the drafter loaded, no request keeping its context: every decode step is plain and stashes
    nothing (key.context False), as AR's steps are, and it runs as many of them as AR; plain stashes."""
    target, drafter = models
    out = tmp_path / "timeline.json"
    cmd = [sys.executable, "bench/step_timeline.py", "--target", str(target), "--drafter", str(drafter),
           "--runs", "nocontext,plain,ar", "--temperatures", "0.7", "--batches", "2", "--prompts", "2", "--max-tokens", "24",
           "--device", "cpu", "--per-step", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    runs = {r["run"]: r for r in json.loads(out.read_text())["runs"]}
    keys = {name: {(key[1], key[4]) for s in r["per_step"] for key in s["keys"]} for name, r in runs.items()}
    # AR's key says context: without a drafter there is nothing to stash
    assert keys == {"nocontext": {(0, False)}, "plain": {(0, True)}, "ar": {(0, True)}}, keys
    assert runs["nocontext"]["steps"] == runs["ar"]["steps"] > 0 and set(runs["nocontext"]["per_k"]) == {"0"}


def test_pair_profile_has_the_prefill_then_the_decode_steps(models):
    """bench/pair_decode.py's profile: the kernels of the prefill step (the engine's part of the time to first token)
    in a table of its own, then those of the decode steps; the requests run to the end."""
    target = load_target(models[0])
    engine = Engine(target, load_drafter(models[1], target), max_model_len=256)
    text = profile("dspark", engine, [[5, 6, 7, 8] * 10, [9, 10] * 7], max_tokens=12, steps=3)
    prefill, _, decode = text.partition("\n\n## ")
    assert prefill.startswith("## dspark: the prefill step of 2 prompts of 14-40 tokens, T=0 (")
    assert decode.startswith("dspark: 3 steps at bs=2, T=0") and "Self CPU" in prefill and "Self CPU" in decode
    assert not engine.has_work()


def test_policy_samples_by_place_in_a_run(monkeypatch):
    """bench/step_timeline.py's PolicySamples: the cycles the k policy keeps, by place in a run of one kind. Runs of 6
    plain steps after 6 drafting ones, whose second step takes 0.3 ms and the later ones 0.14 (under overlap the
    first of a run carries the drafting step before it and is not kept), show as 0.3 at place 2 and 0.14 from place 3
    on; the policy's own method is back once it is closed."""
    target = make_target("qwen3", vocab=V)
    engine = Engine(target, make_drafter(target), overlap=True)
    p, key = engine.policy, engine.runner.key_for
    now = [0.0]
    monkeypatch.setattr("dspark.policy.time.perf_counter", lambda: now[0])
    samples = PolicySamples(p)
    for _ in range(10):
        for k in (4, 0):
            for place in range(1, 7):
                p.step_started(0.0)
                p.step_replayed(0.1, key(1, k, 100, "sample"))
                now[0] += (0.27 if k else 0.3 if place == 2 else 0.14) / 1e3
    samples.close()
    assert "step_started" not in vars(p)
    got = samples.summary()
    plain, drafting = got["1,0,sample"], got["1,4,sample"]
    # places 2-6 of each run; the last step's cycle ends with no step after it
    assert drafting["n"] == 10 * 5 and plain["n"] == 10 * 5 - 1
    assert plain["by_place"][2] == [10, pytest.approx(0.3)]
    assert plain["by_place"][3][1] == pytest.approx(0.14) and plain["by_place"][5] == [19, pytest.approx(0.14)]
    assert plain["median"] == pytest.approx(0.14) and plain["mean"] > 0.14
