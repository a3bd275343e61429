"""bench/serve_bench.py end to end on CPU: two `python -m serve` subprocesses (AR, then DSpark) over a tiny random
Qwen3 target with a real BPE tokenizer and a random DSpark drafter, driven by the script's streaming clients. The
servers run on the CPU, also where a GPU is visible: the test compares fp32 greedy texts with and without the drafter,
and a CPU step drafts the whole block (with CUDA graphs the engine picks k by measured step times and may verify no
drafts at all for a random drafter, leaving a level without tau)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.serve_clients import Req
from bench.serve_metrics import step_ms_per_k, weighed, weighed_against_ran

ROOT = Path(__file__).resolve().parents[1]
TASKS, TEMPS, CONC = ("humaneval", "creative"), (0.0, 0.7), (1, 2)


@pytest.mark.timeout(600)  # on CUDA two servers each capture their step graphs first: 222 s on an H200
def test_serve_bench_end_to_end(models, tmp_path):
    target, drafter = models
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "bench/serve_bench.py", "--target", str(target), "--drafter", str(drafter),
           "--tasks", ",".join(TASKS), "--temperatures", "0,0.7", "--concurrency", "1,2", "--requests-per-level", "2",
           "--min-level-s", "0", "--max-tokens", "8", "--max-prompt-tokens", "48", "--num-prompts", "4",
           "--startup-timeout", "120", "--time-limit", "240", "--out", str(out), "--profile", "creative:0.7:2",
           "--client-procs", "2", "--",
           "--device", "cpu"]
    with open(tmp_path / "stdout.txt", "w+") as outf, open(tmp_path / "stderr.txt", "w+") as errf:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=outf, stderr=errf, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        while not out.exists() and proc.poll() is None:  # written after each level, whole each time
            time.sleep(0.05)
        early = json.loads(out.read_text())
        rc = proc.wait(timeout=300)
        errf.seek(0)
        assert rc == 0, errf.read()[-3000:]
        outf.seek(0)
        stdout = outf.read()
    assert early["partial"] and 1 <= len(early["levels"]) < 16 and early["rows"]
    rep = json.loads(out.read_text())
    assert rep["status"] == "complete" and rep["partial"] is False
    assert set(rep["servers"]) == {"ar", "dspark"} and "--drafter" in rep["servers"]["dspark"]["command"]
    assert "--drafter" not in rep["servers"]["ar"]["command"]

    levels = {(lv["mode"], lv["task"], lv["temperature"], lv["concurrency"]): lv for lv in rep["levels"]}
    assert len(levels) == len(rep["levels"]) == 2 * 2 * 2 * 2
    made = 0  # the DSpark server's k choices over its levels
    # events apart in time
    assert any(r["itl_ms"]["max"] > 0 for lv in levels.values() for r in lv["per_request"])
    for (mode, _, _temp, _), lv in levels.items():
        assert lv["errors"] == 0 and lv["completed"] == 2, lv["error_messages"]
        assert lv["client_procs"] == lv["concurrency"]  # --client-procs 2, at most one process per client
        assert lv["output_tok_s"] > 0 and lv["request_s"] > 0 and lv["output_tokens"] == 2 * 8
        assert lv["server_generation_tokens"] == 16  # the timed requests only: the warm-up is outside the deltas
        # events that reach the client in one read are 0 ms apart (a loaded CPU coalesces them): the median may be 0
        assert lv["ttft_ms"]["p50"] > 0 and lv["itl_ms"]["p50"] >= 0 and lv["tpot_ms"]["p50"] > 0
        assert lv["itl_first_ms"]["p50"] >= 0 and lv["itl_last_ms"]["p50"] >= 0 and lv["tail_ms"]["p50"] >= 0
        for r in lv["per_request"]:
            assert r["completion_tokens"] == 8 and r["text"] and r["itl_ms"]["n"] == r["events"] - 1
            gaps = r["itl_ms"]
            assert 0 <= gaps["p50"] <= gaps["max"] and max(gaps["first"], gaps["last"]) <= gaps["max"]
            # the stream's parts add up: first text, the gaps between events, then [DONE] after the last
            assert r["tail_ms"] >= 0
            assert r["seed"] is None  # no --seed: unseeded, so sampled DSpark rows draft
        steps = {int(k): v for k, v in lv["steps_per_k"].items()}  # (JSON keys are strings)
        if mode == "dspark":
            assert lv["tau"] >= 1 and lv["spec_decode"]["num_steps"] > 0
            assert steps[max(steps)] == sum(steps.values()) > 0  # CPU: the whole block every step
            # the policy's view at the level's end: its acceptance estimates per position (a probability each);
            # no kind timed (CPU: no graph replays)
            acc = lv["policy"]["acceptance"]
            assert set(acc) == {"greedy", "sampled"} and all(0 < x < 1 for g in acc.values() for x in g.values())
            assert lv["policy"]["step_cost_ms"] == {}
            # the level's choices ("rows/k/mode/basis": how many; a choice lasts up to 16 steps, so a level may
            # make none): the whole block, as probes for the first statistics, then on no measured cost (CPU)
            choices = lv["policy"]["choices"]
            assert all(key.split("/")[1] == str(max(steps)) and key.split("/")[3] in ("probe", "modelled")
                       for key in choices) and all(n >= 1 for n in choices.values())
            assert lv["policy"]["weighed"] == {}  # CPU: the whole block, drafted without weighing
            made += sum(choices.values())
        else:
            assert lv["tau"] is None and lv["spec_decode"]["num_steps"] == 0
            assert set(steps) == {0} and steps[0] > 0
            assert lv["policy"] == {"step_cost_ms": {}, "acceptance": {}, "choices": {}, "weighed": {}}  # no policy
        assert lv["step_ms_per_k"] == {}  # CPU: eager steps, none timed against a replay
        # --profile: that level only, each server's engine thread, its named phases in the table
        profiled = (lv["task"], lv["temperature"], lv["concurrency"]) == ("creative", 0.7, 2)
        assert len(lv["profile_files"]) == (2 if profiled else 0)
        if profiled:
            txt = open(lv["profile_files"][0]).read()
            assert f"{out.stem}.profile-{mode}" in lv["profile_files"][0] and "engine.launch" in txt
        host = lv["host_ms_per_step"]  # the engine thread's busy time per step holds its step()'s, which holds waits
        assert host["loop"] >= host["step"] > host["read_wait"] + host["launch_wait"] >= 0
        first = lv["server_first_token_ms"]  # the server's share of the TTFT: within what the client saw
        assert 0 < first["queue"] < first["ttft"] and 0 < first["prefill"] < first["ttft"]
        assert abs(first["queue"] + first["prefill"] - first["ttft"]) < 1e-6 * first["ttft"]
        assert first["ttft"] < lv["ttft_ms"]["mean"]
    assert made > 0

    rows = {(r["task"], r["temperature"], r["concurrency"]): r for r in rep["rows"]}
    assert set(rows) == {(t, T, c) for t in TASKS for T in TEMPS for c in CONC}
    for (task, temp, conc), row in rows.items():
        ar, ds = levels[("ar", task, temp, conc)], levels[("dspark", task, temp, conc)]
        assert row["speedup"] == ds["output_tok_s"] / ar["output_tok_s"]
        if temp == 0:  # lossless: greedy DSpark text == greedy AR text, request by request (same prompts)
            assert row["greedy_equal"] == row["greedy_compared"] == 2
            assert [r["text"] for r in ds["per_request"]] == [r["text"] for r in ar["per_request"]]
        else:
            assert row["greedy_compared"] is None
    assert rep["environment"]["torch"] and "gpus" in rep["environment"]
    lines = [x for x in stdout.splitlines() if x.startswith("| ")]  # the markdown table: header + one per row
    assert len(lines) == len(rows) + 1 and all(x.split(" | ")[0][2:] in TASKS for x in lines[1:])


def test_greedy_texts_compared_by_prompt():
    """The greedy check pairs each DSpark request with the AR text of its prompt: the levels sent different numbers
    of requests, reported in another order."""
    def level(mode, texts):  # (prompt, text) per request
        return {"mode": mode, "task": "humaneval", "temperature": 0.0, "concurrency": 4, "output_tok_s": 1.0,
                "request_s": 1.0, "tau": None, "errors": 0, "tokens_per_event": 1.0, "ttft_ms": {"p50": 1.0},
                "itl_ms": {"p50": 1.0, "p99": 1.0}, "tpot_ms": {"p50": 1.0},
                "per_request": [{"prompt": p, "text": t, "ok": True} for p, t in texts]}

    ar = level("ar", [(0, "a"), (1, "b"), (2, "c")])
    ds = level("dspark", [(1, "b"), (0, "a"), (3, "d"), (0, "a"), (2, "x")])  # prompt 3: no AR text to compare
    bench = _bench()
    row = bench.rows([ar, ds])[0]
    assert (row["greedy_equal"], row["greedy_compared"]) == (3, 4)
    assert row["speedup"] == 1.0 and not row["cut"] and "| 1.00× |" in bench.table([row])
    # a level the time limit ended: its part is no ratio, and the table says so
    row = bench.rows([ar, {**ds, "cut_by_time_limit": True, "errors": 2}])[0]
    assert row["cut"] and row["speedup"] is None
    assert "| cut |" in bench.table([row]) and "| 0 / 2 |" in bench.table([row])


def _bench():
    spec = importlib.util.spec_from_file_location("serve_bench", ROOT / "bench" / "serve_bench.py")
    bench = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look the module up
    spec.loader.exec_module(bench)
    return bench


def test_a_levels_choices_to_draft_weighed_are_the_counters_differences():
    """Per k the level's choices to draft and the means of what they weighed, from the policy's cumulative sums at
    the level's start and end; a k with no new choice in the level is left out."""
    w0 = {2: {"n": 3.0, "plain_ms": 0.36, "ms": 0.75, "expected": 4.5}}
    w1 = {2: {"n": 5.0, "plain_ms": 0.66, "ms": 1.25, "expected": 7.5}, 4: {"n": 3.0, "plain_ms": 0.45,
                                                                            "ms": 0.9, "expected": 6.0}}
    assert weighed(w0, w1) == {2: {"n": 2.0, "plain_ms": 0.15, "ms": 0.25, "expected": 1.5},
                               4: {"n": 3.0, "plain_ms": 0.15, "ms": 0.3, "expected": 2.0}}
    assert weighed(w1, w1) == {}


def test_serve_bench_bad_options(models, capsys):
    """Bad options are one line on stderr and exit status 2, before any server starts."""
    bench = _bench()
    target = str(models[0])
    for args, msg in [(["--concurrency", "1,0"], "--concurrency: expected comma-separated integers >= 1"),
                      (["--modes", "ar,fast"], "--modes"), ([], "--drafter: required for mode dspark"),
                      (["--modes", "ar", "--", "--port", "9"], "--port: set by this script"),
                      (["--modes", "ar", "--tasks", "nope"], "--tasks"), (["--modes", "ar", "--max-tokens", "0"],
                                                                        "--max-tokens: expected an integer >= 1"),
                      (["--modes", "ar", "--profile", "creative:0.7:3"], "--profile: expected TASK:T:C"),
                      (["--modes", "ar", "--profile", "creative"], "--profile: expected TASK:T:C")]:
        assert bench.main(["--target", target, *args]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
    assert bench.main(["--target", str(models[1].parent / "missing"), "--modes", "ar"]) == 2
    assert "not a checkpoint dir" in capsys.readouterr().err


def test_serve_bench_time_limit_shares(models, monkeypatch):
    """A time limit that cannot fit every level still measures every mode (an equal share each of the time left), and
    greedy levels come before sampled ones. The servers and clients are replaced by a clock that each level advances
    by 10 s: this checks the schedule only (the end-to-end test above runs the real servers)."""
    bench = _bench()
    now = [0.0]

    async def level(url, a, prompts, temperature, conc, deadline, profile=False):
        now[0] += 10.0
        return {"output_tok_s": 1.0, "tau": None, "errors": 0, "steps_per_k": {}, "step_ms_per_k": {},
                "host_ms_per_step": {}, "server_first_token_ms": {}, "profile_files": [],
                "cut_by_time_limit": now[0] > deadline}

    monkeypatch.setattr(bench.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(bench, "run_level", level)
    monkeypatch.setattr(bench, "wait_healthy", lambda *a: None)
    monkeypatch.setattr(bench, "stop", lambda proc: None)
    monkeypatch.setattr(bench.subprocess, "Popen", lambda *a, **k: None)
    a, extra = bench.parse_args(["--target", str(models[0]), "--drafter", str(models[1]), "--time-limit", "45",
                                 "--concurrency", "1,4", "--out", ""])
    report = {"status": "complete", "servers": {}, "levels": []}
    bench.run(a, extra, {t: ["p"] for t in a.tasks}, report, lambda *x, **k: None)
    done = [(lv["mode"], lv["task"], lv["temperature"], lv["concurrency"]) for lv in report["levels"]]
    # ar gets 22.5 s: three 10 s levels start before its share ends; dspark then gets the 15 s left: two levels
    assert done == [("ar", "humaneval", 0.0, 1), ("ar", "humaneval", 0.0, 4), ("ar", "creative", 0.0, 1),
                    ("dspark", "humaneval", 0.0, 1), ("dspark", "humaneval", 0.0, 4)]
    assert report["status"].startswith("failed: ar's share of the time limit")


def test_serve_bench_rounds_take_turns(models, monkeypatch):
    """--rounds 2: both servers come up before the first level, each level runs twice per mode with the modes taking
    turns (AR, DSpark, DSpark, AR), and a row's figures are the medians over the rounds, its ratio the median of the
    rounds' ratios with each round's kept. Servers and clients replaced as in the test above (the schedule only)."""
    bench = _bench()
    events = []
    tok_s = iter([100.0, 110.0, 120.0, 90.0, 100.0, 80.0, 100.0, 125.0])  # ar, ds, ds, ar per level

    async def level(url, a, prompts, temperature, conc, deadline, profile=False):
        events.append(("level", url.rsplit(":", 1)[1], profile))
        return {"output_tok_s": next(tok_s), "request_s": 1.0, "tau": None, "errors": 1, "tokens_per_event": 1.0,
                "ttft_ms": {"p50": 1.0}, "itl_ms": {"p50": 1.0, "p99": 1.0}, "tpot_ms": {"p50": 1.0},
                "per_request": [], "steps_per_k": {}, "step_ms_per_k": {}, "host_ms_per_step": {},
                "server_first_token_ms": {}, "profile_files": [], "cut_by_time_limit": False}

    def popen(cmd, **kw):
        events.append(("start", cmd[cmd.index("--port") + 1]))
        return cmd

    monkeypatch.setattr(bench, "run_level", level)
    monkeypatch.setattr(bench, "wait_healthy", lambda *a: None)
    monkeypatch.setattr(bench, "stop", lambda proc: events.append(("stop", proc[proc.index("--port") + 1])))
    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    a, extra = bench.parse_args(["--target", str(models[0]), "--drafter", str(models[1]), "--rounds", "2",
                                 "--temperatures", "0.7", "--tasks", "creative", "--concurrency", "1,4",
                                 "--port", "9000", "--profile", "creative:0.7:1", "--out", ""])
    report = {"status": "complete", "servers": {}, "levels": []}
    bench.run(a, extra, {t: ["p"] for t in a.tasks}, report, lambda *x, **k: None)
    assert report["status"] == "complete" and set(report["servers"]) == {"ar", "dspark"}
    # ar on 9000, dspark on 9001; the profile in the first round only (one per server)
    assert events == [("start", "9000"), ("start", "9001"),
                      ("level", "9000", True), ("level", "9001", True), ("level", "9001", False),
                      ("level", "9000", False)] + [("level", p, False) for p in ("9000", "9001", "9001", "9000")] + [
                      ("stop", "9000"), ("stop", "9001")]
    assert [(lv["mode"], lv["round"]) for lv in report["levels"][:4]] == [("ar", 0), ("dspark", 0), ("dspark", 1),
                                                                        ("ar", 1)]
    c1, c4 = bench.rows(report["levels"])
    assert c1["speedups"] == [110 / 100, 120 / 90] and c1["speedup"] == (110 / 100 + 120 / 90) / 2
    assert c1["ar"]["output_tok_s"] == 95.0 and c1["dspark"]["output_tok_s"] == 115.0 and c1["ar"]["errors"] == 2
    assert c4["speedups"] == [80 / 100, 100 / 125] and c4["speedup"] == 0.8
    assert "| 0.80× (0.80–0.80) |" in bench.table([c4]) and "| 1.22× (1.10–1.33) |" in bench.table([c1])
    for bad in ("0", "-1"):
        with pytest.raises(ValueError, match="--rounds: expected an integer >= 1"):
            bench.parse_args(["--target", str(models[0]), "--modes", "ar", "--rounds", bad])


def test_serve_bench_variant_is_a_third_server_with_its_policy_taking_turns(models, monkeypatch):
    """--variant SPEC: a third server, dspark-b, with the drafter and DSPARK_POLICY=SPEC in its environment (the others
    without it), up with the other two and taking turns with them each round (AR, DSpark, DSpark-b, then the reverse);
    each row has dspark-b's figures and its ratio to AR per round beside DSpark's, and the table a column for each;
    with --modes ar it is ar-b, the AR server with SPEC. A SPEC that names no policy constant is an error naming
    --variant. Servers and clients replaced as above."""
    bench = _bench()
    events, envs = [], {}
    tok_s = iter([100.0, 110.0, 130.0, 140.0, 120.0, 90.0])  # ar, ds, dsb, then dsb, ds, ar

    async def level(url, a, prompts, temperature, conc, deadline, profile=False):
        events.append(url.rsplit(":", 1)[1])
        return {"output_tok_s": next(tok_s), "request_s": 1.0, "tau": None, "errors": 0, "tokens_per_event": 1.0,
                "ttft_ms": {"p50": 1.0}, "itl_ms": {"p50": 1.0, "p99": 1.0}, "tpot_ms": {"p50": 1.0},
                "per_request": [], "steps_per_k": {}, "step_ms_per_k": {}, "host_ms_per_step": {},
                "server_first_token_ms": {}, "profile_files": [], "cut_by_time_limit": False}

    def popen(cmd, **kw):
        envs[cmd[cmd.index("--port") + 1]] = ("--drafter" in cmd, (kw.get("env") or {}).get("DSPARK_POLICY"))
        return cmd

    monkeypatch.delenv("DSPARK_POLICY", raising=False)
    monkeypatch.setattr(bench, "run_level", level)
    monkeypatch.setattr(bench, "wait_healthy", lambda *a: None)
    monkeypatch.setattr(bench, "stop", lambda proc: None)
    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    args = ["--target", str(models[0]), "--drafter", str(models[1]), "--rounds", "2", "--temperatures", "0.7",
            "--tasks", "creative", "--concurrency", "4", "--port", "9000", "--out", ""]
    a, extra = bench.parse_args(args + ["--variant", "DRAFT_GAIN=1.25"])
    assert a.modes == ["ar", "dspark", "dspark-b"]
    report = {"status": "complete", "servers": {}, "levels": []}
    bench.run(a, extra, {t: ["p"] for t in a.tasks}, report, lambda *x, **k: None)
    assert envs == {"9000": (False, None), "9001": (True, None), "9002": (True, "DRAFT_GAIN=1.25")}
    assert report["servers"]["dspark-b"]["DSPARK_POLICY"] == "DRAFT_GAIN=1.25"
    assert events == ["9000", "9001", "9002", "9002", "9001", "9000"]
    (row,) = bench.rows(report["levels"])
    assert row["speedups"] == [110 / 100, 120 / 90] and row["speedups_b"] == [130 / 100, 140 / 90]
    assert row["speedup_b"] == (130 / 100 + 140 / 90) / 2 and row["dspark-b"]["output_tok_s"] == 135.0
    assert row["b_over_dspark"] == [130 / 110, 140 / 120]
    text = bench.table([row])
    assert "| DSpark-b ÷ AR | DSpark-b ÷ DSpark |" in text and "AR / DSpark / DSpark-b" in text
    assert "| 135.0 | 1.43× (1.30–1.56) | 1.17× (1.17–1.18) |" in text
    assert "DSpark-b" not in bench.table(bench.rows([lv for lv in report["levels"] if lv["mode"] != "dspark-b"]))
    for bad, what in [("NOPE=1", "'NOPE' is not one of"), ("DRAFT_GAIN=x", "DRAFT_GAIN='x': expected float")]:
        with pytest.raises(ValueError, match=f"--variant: DSPARK_POLICY: {what}"):
            bench.parse_args(args + ["--variant", bad])
    # with --modes ar the variant is the AR server's (an engine constant's A/B): ar-b, no drafter, DSPARK_POLICY set
    events.clear(), envs.clear()
    tok_s = iter([100.0, 120.0, 130.0, 90.0])  # ar, ar-b, then ar-b, ar
    a, extra = bench.parse_args(args + ["--modes", "ar", "--variant", "FIRST_TOKENS_AFTER_LAUNCH=1"])
    assert a.modes == ["ar", "ar-b"]
    report = {"status": "complete", "servers": {}, "levels": []}
    bench.run(a, extra, {t: ["p"] for t in a.tasks}, report, lambda *x, **k: None)
    assert envs == {"9000": (False, None), "9001": (False, "FIRST_TOKENS_AFTER_LAUNCH=1")}
    (row,) = bench.rows(report["levels"])
    assert row["variant"] == "ar-b" and row["speedups_b"] == [120 / 100, 130 / 90] and row["speedups"] == []
    text = bench.table([row])
    assert "| AR-b tok/s | AR-b ÷ AR | AR-b ÷ DSpark |" in text and "AR / DSpark / AR-b" in text
    assert "| 125.0 | 1.32× (1.20–1.44) | — |" in text


def test_clients_keep_sending_until_the_level_has_lasted_min_level_s(monkeypatch):
    """A level's clients send the `need` requests it asks for, then more until --min-level-s has passed (each one
    sent is marked; the rest stay unsent), and with --min-level-s 0 exactly `need`. The HTTP request is replaced by a
    10 ms sleep: this checks the clients' schedule (the end-to-end test above streams from real servers)."""
    import asyncio
    from types import SimpleNamespace

    from bench import serve_clients

    async def fake_one(client, a, prompt, temperature, r):
        await asyncio.sleep(0.01)
        r.ok = True

    monkeypatch.setattr(serve_clients, "one", fake_one)
    for min_s, need in ((0.3, 3), (0.0, 5)):
        a = SimpleNamespace(min_level_s=min_s)
        reqs = [serve_clients.Req(i, 0, None) for i in range(400)]
        t0 = time.perf_counter()
        end, _, cut = asyncio.run(serve_clients.clients(None, a, ["p"], 0.0, 2, reqs, 60.0, need))
        sent = [r for r in reqs if r.sent]
        assert not cut and all(r.ok for r in sent) and not any(r.ok for r in reqs if not r.sent)
        assert [r.index for r in sent] == list(range(len(sent)))  # taken in order
        if min_s:
            assert end - t0 >= min_s and need < len(sent) < len(reqs)  # ~2 clients x 30 requests in 0.3 s
        else:
            assert len(sent) == need


def test_a_requests_record_summarises_its_gaps():
    """The report keeps each request's gaps between events as first / median / max / last (ms) and the time from its
    last text to [DONE], not the list."""
    r = Req(0, 0, None, sent=True, ok=True, events=4, ttft=0.010, latency=0.020, itl=[0.001, 0.003, 0.002])
    rec = r.record()
    assert "itl" not in rec and rec["itl_ms"] == pytest.approx({"n": 3, "first": 1.0, "p50": 2.0, "max": 3.0,
                                                               "last": 2.0})
    assert rec["tail_ms"] == pytest.approx(4.0)
    one_event = Req(1, 0, None, sent=True, ok=True, events=1, ttft=0.010, latency=0.011).record()
    assert one_event["itl_ms"] is None and one_event["tail_ms"] == pytest.approx(1.0)
    assert Req(2, 0, None, sent=True, error="timed out").record()["tail_ms"] is None


def test_a_levels_switches_of_k_are_the_counters_differences():
    """Per k the level's timed steps, its switches (the first step of a run of k after another kind) and its early
    cycles (the first timed steps of each run): counts and mean ms from /metrics' counters before and after the
    level; a k with no timed step is left out."""
    zero = {"cycles_per_k": {}, "cycle_ms_per_k": {}, "replay_ms_per_k": {}, "device_steps_per_k": {},
            "device_ms_per_k": {}, "switches_per_k": {}, "switch_ms_per_k": {}, "early_per_k": {},
            "early_ms_per_k": {}}
    c0 = {**zero, "cycles_per_k": {0: 10.0, 4: 2.0}, "cycle_ms_per_k": {0: 1.5, 4: 0.6},
          "replay_ms_per_k": {0: 1.0, 4: 0.5}, "switches_per_k": {4: 1.0}, "switch_ms_per_k": {4: 0.4}}
    c1 = {**zero, "cycles_per_k": {0: 20.0, 4: 6.0, 8: 0.0}, "cycle_ms_per_k": {0: 3.0, 4: 1.8, 8: 0.0},
          "replay_ms_per_k": {0: 2.0, 4: 1.5, 8: 0.0}, "device_steps_per_k": {0: 2.0}, "device_ms_per_k": {0: 0.3},
          "switches_per_k": {0: 2.0, 4: 3.0, 8: 1.0}, "switch_ms_per_k": {0: 0.5, 4: 1.2, 8: 0.5},
          "early_per_k": {0: 4.0}, "early_ms_per_k": {0: 0.8}}
    got = step_ms_per_k(c0, c1)
    assert set(got) == {0, 4}  # k = 8 switched once but was never timed back to back
    assert got[0] == pytest.approx({"steps": 10.0, "cycle_ms": 0.15, "replay_ms": 0.1, "device_ms": 0.15,
                                    "switches": 2.0, "switch_ms": 0.25, "early": 4.0, "early_ms": 0.2})
    assert got[4] == pytest.approx({"steps": 4.0, "cycle_ms": 0.3, "replay_ms": 0.25, "device_ms": None,
                                    "switches": 2.0, "switch_ms": 0.4, "early": 0.0, "early_ms": None})


def test_what_the_choices_to_draft_weighed_is_set_against_what_the_steps_took():
    """Over a level's choices to draft (n as weights): the plain cost they weighed over the level's mean plain step,
    and each k's cost over its k's mean step; None without choices, or without plain steps to compare with."""
    step_ms = {0: {"cycle_ms": 0.2}, 2: {"cycle_ms": 0.25}, 4: {"cycle_ms": 0.3}}
    w = {2: {"n": 1.0, "plain_ms": 0.3, "ms": 0.25}, 4: {"n": 3.0, "plain_ms": 0.22, "ms": 0.27},
         8: {"n": 5.0, "plain_ms": 9.0, "ms": 9.0}}  # k = 8 never stepped in the level: left out
    got = weighed_against_ran(w, step_ms)
    assert got == pytest.approx({"plain": (0.3 + 3 * 0.22) / 4 / 0.2, "draft": (1.0 + 3 * 0.9) / 4}, abs=1e-3)
    assert weighed_against_ran({}, step_ms) is None
    assert weighed_against_ran(w, {4: {"cycle_ms": 0.3}}) is None
