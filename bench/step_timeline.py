"""Where a decode step's time goes in dspark.Engine: the host's phases against the device's busy and idle time.

    python3 bench/step_timeline.py --target runs/quickstart/target/final --drafter runs/quickstart/drafter/final \
        [--runs ar,k4,auto] [--temperatures 0,0.7] [--batches 1,16] [--prompts 16] [--max-tokens 128] [--out F.json]
        [--kernels 8 [--kernels-batch 1]] [--per-step]

Each run (bench/step_ops.py's engine_for: ar, no drafter; kN, N drafts pinned; auto, the k policy; plain, every step
k = 0; nocontext, plain with no request keeping the drafter's context, the AR step inside the DSpark engine, as a
server's sampled requests decode where drafting does not pay for them) decodes at least --prompts requests, --batches
of them at a time, through Engine.generate (overlap as the engine defaults it). Per decode step it records, on the
host: step() in all, the launch (of it the graph replay call and the wait for the step's staging buffer), the eager
context flush, the read's wait for the device and the rest of the read (unpacking, stop handling); on the device,
with events recorded on the stream before a launch's input copies and after its output copy: the step's busy time,
and the idle time since the step before ended (0 when the host queued it in time). A cycle (start to start) longer
than the device's busy time is the host's, and the phases say which part. Those probes cost host time themselves, so
each run first decodes the same requests with Engine.step alone timed: `host` (the step less its waits for the
device: the host's own work) and `cycle_bare` come from that pass. Means over the decode steps between prefills;
--per-step keeps every step (with the launch's host time before and after its replay call), --kernels N profiles N
steps at batch --kernels-batch (default 1; torch.profiler, CPU and CUDA): the device's kernels, and the host's time
per step with the calls it spends it in (the CUDA runtime's and torch's; the profiler's own cost per call included).
On CUDA each run ends with the host's time in CUDAGraph.replay for each of its one-row step graphs. An auto run also
reports the cycles the k policy sampled in the unprobed pass, per kind of step and by place in a run of that kind
(PolicySamples).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pair_decode import encode  # noqa: E402  (bench/pair_decode.py: prompts encoded as python -m eval does)
from step_ops import engine_for  # noqa: E402

from dspark import Engine, SamplingParams, load_drafter, load_target  # noqa: E402
from dspark.device import resolve_device, resolve_dtype  # noqa: E402
from eval.tasks import build_task  # noqa: E402

PHASES = ("step", "launch", "replay_call", "staging_wait", "flush", "read_wait", "read_rest", "other")


class Timeline:
    """Wraps one engine's step, its runner's launch and read, and CUDAGraph.replay to time them per decode step.
    bare: Engine.step alone (its time and the runner's waits, no events, no per-phase timers): the host's own work
    per step as the engine does it without probes."""

    def __init__(self, engine: Engine, bare: bool = False):
        self.engine, self.rows, self.group, self.bare = engine, [], 0, bare
        self.cuda = engine.device.type == "cuda" and not bare
        self.cur: dict | None = None
        runner = engine.runner
        step, launch, read, replay = engine.step, runner.launch, runner.read, torch.cuda.CUDAGraph.replay
        flush = runner.flush_context

        def timed_step():
            s = engine.scheduler  # a step that admits or prefills is not a decode step
            prefill = bool(s.waiting) or any(r.num_computed < len(r.prompt_ids) for r in s.running)
            self.cur = dict.fromkeys(PHASES, 0.0) | {"events": [], "prefill": prefill, "group": self.group,
                                                      "graphs": len(runner.steps), "keys": []}
            waits = runner.wait_s + runner.launch_wait_s
            self.cur["t0"] = time.perf_counter()
            out = step()
            self.cur["step"] = time.perf_counter() - self.cur["t0"]
            self.cur["waits"] = runner.wait_s + runner.launch_wait_s - waits
            self.cur["captured"] = len(runner.steps) - self.cur["graphs"]
            self.rows.append(self.cur)
            return out

        engine.step = timed_step
        if bare:
            return

        def timed_launch(rows, tables, num_cached, slots, key):
            t0, w0 = time.perf_counter(), runner.launch_wait_s
            self.cur["keys"].append((key.rows, key.k, key.width, len(rows), key.context))
            ev = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)] if self.cuda else []
            if ev:
                ev[0].record()
            self.cur["launch_start"] = t0
            out = launch(rows, tables, num_cached, slots, key)
            self.cur["launch_end"] = time.perf_counter()
            if ev:
                ev[1].record()
                self.cur["events"].append(ev)
            self.cur["launch"] += time.perf_counter() - t0
            self.cur["staging_wait"] += runner.launch_wait_s - w0
            return out

        def timed_read(*a, **kw):
            t0, w0 = time.perf_counter(), runner.wait_s
            out = read(*a, **kw)
            self.cur["read_wait"] += runner.wait_s - w0
            self.cur["read_rest"] += time.perf_counter() - t0 - (runner.wait_s - w0)
            return out

        def timed_flush(*a, **kw):
            t0 = time.perf_counter()
            flush(*a, **kw)
            self.cur["flush"] += time.perf_counter() - t0

        def timed_replay(graph, *a, **kw):
            t0 = time.perf_counter()
            replay(graph, *a, **kw)
            if self.cur is not None:
                t1 = time.perf_counter()
                self.cur["replay_call"] += t1 - t0
                self.cur["replay_at"] = (t0, t1)

        runner.launch, runner.read, runner.flush_context = timed_launch, timed_read, timed_flush
        self._replay = replay
        torch.cuda.CUDAGraph.replay = timed_replay

    def close(self) -> None:
        del self.engine.step  # the class's methods again
        if not self.bare:
            torch.cuda.CUDAGraph.replay = self._replay
            r = self.engine.runner
            del r.launch, r.read, r.flush_context

    def summary(self) -> dict:
        """Means (ms) over the decode steps: a step after one that prefilled (or the first of a generate call) and
        the last of each call are left out."""
        if self.cuda:
            torch.cuda.synchronize()
        rows = [b for a, b, c in zip(self.rows, self.rows[1:], self.rows[2:])
                if not (a["prefill"] or b["prefill"]) and a["group"] == b["group"] == c["group"]]
        if not rows:
            raise ValueError("no decode step to time between the prefills: raise --max-tokens")
        nxt = {id(a): b for a, b in zip(self.rows, self.rows[1:])}
        cyc = [nxt[id(r)]["t0"] - r["t0"] for r in rows]
        host = 1e3 * statistics.fmean(r["step"] - r["waits"] for r in rows)  # the step less its waits for the device
        if self.bare:
            return {"host": host, "cycle": 1e3 * statistics.fmean(cyc), "steps": len(rows)}
        out = {p: 1e3 * statistics.fmean(r[p] for r in rows) for p in PHASES if p != "other"}
        out["other"] = out["step"] - out["launch"] - out["flush"] - out["read_wait"] - out["read_rest"]
        out["host_probed"] = host
        out["cycle"] = 1e3 * statistics.fmean(cyc)
        out["between_steps"] = out["cycle"] - out["step"]  # the caller's loop
        pairs = [(e, n) for r in rows for e in r["events"][-1:] for n in nxt[id(r)]["events"][:1]]
        if pairs:
            out["device_busy"] = statistics.fmean(e[0].elapsed_time(e[1]) for r in rows for e in r["events"])
            out["device_idle"] = statistics.fmean(max(0.0, e[1].elapsed_time(n[0])) for e, n in pairs)
        out["steps"] = len(rows)
        by_k: dict[int, list[float]] = {}
        for r, cy in zip(rows, cyc):
            if r["keys"]:
                by_k.setdefault(r["keys"][-1][1], []).append(cy)
        out["cycle_per_k"] = {k: 1e3 * statistics.fmean(v) for k, v in sorted(by_k.items())}
        out["per_step"] = [{"keys": r["keys"], **{p: round(1e3 * r[p], 4) for p in PHASES if p != "other"},
                            "cycle": round(1e3 * (nxt[id(r)]["t0"] - r["t0"]), 4),
                            "device": [round(e[0].elapsed_time(e[1]), 4) for e in r["events"]],
                            # of the (last) launch: the host's work before the replay call and after it (ms)
                            **({"pre_replay": round(1e3 * (r["replay_at"][0] - r["launch_start"]), 4),
                                "post_replay": round(1e3 * (r["launch_end"] - r["replay_at"][1]), 4)}
                               if "replay_at" in r and "launch_start" in r else {})}
                           for r in rows]
        out["captures"] = sum(r["captured"] for r in self.rows)  # step graphs captured during the run (0: warm)
        return out


class PolicySamples:
    """The cycles the k policy samples (its step costs are medians of them), each with its place in its run of
    consecutive steps of one kind (batch bucket, k, mode; a prefill or a flush ends a run): whether the cycles it keeps
    stand for the steps of their kind, or the first steps after a switch weigh more than they take."""

    def __init__(self, policy):
        self.policy, self.rows, self._kind, self._place = policy, [], None, 0
        started = policy.step_started

        def sampled_step_started(*a, **kw):
            last = policy.last_step
            key = None if last is None else last[2]
            kind = None if key is None else (key.rows, key.k, key.mode)
            self._place = self._place + 1 if kind is not None and kind == self._kind else 1
            self._kind = kind
            n = 0 if key is None else policy.cycles[key.k]
            started(*a, **kw)
            if key is not None and policy.cycles[key.k] > n:  # its cycle was sampled: the last of its kind's cycles
                self.rows.append((f"{key.rows},{key.k},{key.mode}", self._place, policy.cycle_by_kind[kind][-1]))

        policy.step_started = sampled_step_started

    def close(self) -> None:
        del self.policy.step_started  # the class's method again

    def summary(self) -> dict:
        """Per kind "rows,k,mode": the samples' count, mean and median (ms), and by place in their run (2, 3, 4, 5:
        the fifth and later) their count and median."""
        out = {}
        for kind in sorted({r[0] for r in self.rows}):
            cycles = [c for k, _, c in self.rows if k == kind]
            places: dict[int, list[float]] = {}
            for k, place, c in self.rows:
                if k == kind:
                    places.setdefault(min(place, 5), []).append(c)
            out[kind] = {"n": len(cycles), "mean": statistics.fmean(cycles), "median": statistics.median(cycles),
                         "by_place": {p: [len(v), statistics.median(v)] for p, v in sorted(places.items())}}
        return out


def run_one(engine: Engine, groups: list[list[list[int]]], max_tokens: int, temperature: float) -> dict:
    """Each group of prompts through one Engine.generate call (the group's size is the batch)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    engine.generate(groups[0], SamplingParams(max_tokens=min(16, max_tokens), temperature=temperature,
                                              ignore_eos=True))
    bare, toks, wall = Timeline(engine, bare=True), 0, 0.0  # first the same requests, unprobed but for step()
    policy = engine.drafts is not None and engine.pinned_k is None
    samples = PolicySamples(engine.policy) if policy else None
    try:
        for g in groups:
            bare.group += 1
            t0 = time.perf_counter()
            toks += sum(len(o.token_ids) for o in engine.generate(g, params))
            wall += time.perf_counter() - t0
        plain = bare.summary()
    finally:
        bare.close()
        if samples is not None:
            samples.close()
    plain["tok_s"] = toks / wall
    c = engine.counters
    before, tokens_before = list(c["decode_steps_per_k"]), list(c["tokens_per_k"])
    tl, outs, wall = Timeline(engine), [], 0.0
    try:
        for g in groups:
            tl.group += 1
            t0 = time.perf_counter()
            outs += engine.generate(g, params)
            wall += time.perf_counter() - t0
        res = tl.summary()
    finally:
        tl.close()
    toks = sum(len(o.token_ids) for o in outs)
    acc = [a for o in outs for a in o.accepted_per_step]
    steps = [a - b for a, b in zip(c["decode_steps_per_k"], before)]
    tokens = [a - b for a, b in zip(c["tokens_per_k"], tokens_before)]
    res.update(host=plain["host"], cycle_bare=plain["cycle"], tok_s_bare=plain["tok_s"], tok_s=toks / wall,
               tau=1 + statistics.fmean(acc) if acc else None, steps_per_k=steps,
               # per k that ran: tokens per row-step, the mean cycle (ms), so tokens per ms as it happened
               per_k={k: {"steps": n, "tokens_per_row_step": tokens[k] / n / len(groups[0]),
                          "cycle_ms": res["cycle_per_k"].get(k)} for k, n in enumerate(steps) if n})
    if policy:
        # what the policy weighs at the end of the run, at the batch and a mid-run context length (None: no graphs);
        # the cycles it sampled in the unprobed pass
        longest = max(len(p) for g in groups for p in g) + max_tokens // 2
        mode = "greedy" if temperature == 0 else "sample"
        res["policy"] = {"estimates": engine.policy.estimates(len(groups[0]), longest, mode),
                         "cycles_ms": {f"{rows},{k},{m}": statistics.median(v)
                                       for (rows, k, m), v in engine.policy.cycle_by_kind.items()},
                         "host_ms": engine.policy.host_ms, "flush_ms": engine.policy.flush_ms,
                         "samples": samples.summary()}
    return res


SYNCS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def kernels(engine: Engine, prompts: list[list[int]], temperature: float, steps: int) -> dict:
    """`steps` decode steps of these prompts decoded together under torch.profiler (CPU and CUDA activity): the
    device's kernels per step and the top ones by device time (µs; the kernels inside graphs too); on the host,
    Engine.step's time per step, its waits for the device (the CUDA synchronize calls), the rest (the host's own
    work) and the top host calls by self time per step."""
    reqs = [engine.add_request(p, SamplingParams(max_tokens=steps * 8 + 8, temperature=temperature, ignore_eos=True))
            for p in prompts]
    while any(r.num_computed < len(r.prompt_ids) for r in reqs):  # the prefills (several steps for many rows)
        engine.step()
    for _ in range(2):  # the first token, the first decode step
        engine.step()
    cuda = engine.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("engine.step"):
                engine.step()
        if cuda:
            torch.cuda.synchronize()
    while engine.has_work():
        engine.step()
    ev = prof.key_averages()
    # the kernels and copies (not the CPU ops over them, nor the engine's ranges, which the profiler times on the
    # device too)
    dev = [e for e in ev if e.self_device_time_total > 0 and e.device_type != DeviceType.CPU
           and not e.key.startswith("engine.")]
    top = sorted(dev, key=lambda e: -e.self_device_time_total)[:15]
    host = [e for e in ev if e.self_cpu_time_total > 0 and e.key != "engine.step"]
    step_us = sum(e.cpu_time_total for e in ev if e.key == "engine.step") / steps
    wait_us = sum(e.self_cpu_time_total for e in host if e.key in SYNCS) / steps
    return {"kernels_per_step": sum(e.count for e in dev) / steps,
            "device_us_per_step": sum(e.self_device_time_total for e in dev) / steps,
            "top": [(e.key[:90], e.count / steps, e.self_device_time_total / steps) for e in top],
            "host_step_us": step_us, "host_wait_us": wait_us, "host_own_us": step_us - wait_us,
            "host_top": [(e.key[:90], e.count / steps, e.self_cpu_time_total / steps)
                         for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:12]]}


def replay_costs(engine: Engine, reps: int = 20) -> list[dict]:
    """The host's time in CUDAGraph.replay for each step graph of one row (µs, the median of reps replays, each on
    an idle device) beside its time on the device: whether one graph costs the host more to launch than another.
    The graphs run on whatever inputs they hold: the engine is spent after this."""
    out = []
    for key, st in engine.runner.steps.items():
        if key.rows != 1 or st.graph is None:
            continue
        ts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            st.graph.replay()
            ts.append(time.perf_counter() - t0)
        out.append({"k": key.k, "width": key.width, "mode": key.mode, "replay_us": 1e6 * statistics.median(ts),
                    "device_us": 1e3 * st.ms})
    torch.cuda.synchronize()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--runs", default="ar,k4,auto")
    ap.add_argument("--task", default="creative")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kernels", type=int, default=0, help="also profile this many decode steps per run and "
                    "temperature at batch --kernels-batch: the device's kernels (CUDA), the host's time and calls")
    ap.add_argument("--kernels-batch", type=int, default=1, help="rows of the profiled steps (at most the largest "
                    "of --batches)")
    ap.add_argument("--per-step", action="store_true", help="keep every decode step's figures in --out")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not 1 <= a.kernels_batch <= max(int(b) for b in a.batches.split(",")):
        ap.error(f"--kernels-batch: expected 1..the largest of --batches ({a.batches}), got {a.kernels_batch}")
    dev = resolve_device(a.device)
    target = load_target(a.target, device=dev, dtype=resolve_dtype(a.dtype, dev))
    drafter = load_drafter(a.drafter, target)
    task = build_task(a.task)
    prompts = encode(task, target.tokenizer, a.prompts, 256)
    temps = [float(t) for t in a.temperatures.split(",")]
    batches = [int(b) for b in a.batches.split(",")]
    rows = [prompts[i % len(prompts)] for i in range(a.kernels_batch)]  # the profiled steps' requests
    mml = max(len(p) for p in prompts) + a.max_tokens + drafter.config.num_drafts + 1
    res = {"command": "python3 bench/step_timeline.py " + " ".join(argv or sys.argv[1:]), "runs": []}
    cols = ("tok_s_bare", "host", "cycle_bare", "cycle", "device_busy", "device_idle", "step", "launch", "replay_call",
            "staging_wait", "flush", "read_wait", "read_rest", "other", "between_steps", "captures")
    print("| run | T | batch | tok/s (probed) | τ | steps per k | " + " | ".join(cols) + " |\n|---|--:|--:|--:|--:|---|"
          + "--:|" * len(cols))
    for name in a.runs.split(","):
        engine = engine_for(name, target, drafter, mml, max(batches))
        engine.warmup(modes=("greedy", "sample"))
        for t in temps:
            for b in batches:
                n = max(b, a.prompts)  # at least --prompts requests, b at a time
                ps = [prompts[i % len(prompts)] for i in range(n)]
                r = run_one(engine, [ps[i: i + b] for i in range(0, n, b)], a.max_tokens, t)
                r.update(run=name, temperature=t, batch=b)
                res["runs"].append(r)
                if not a.per_step:
                    r.pop("per_step")
                cells = " | ".join("—" if r.get(c) is None else f"{r[c]:.0f}" if c == "tok_s_bare" else f"{r[c]:.3f}"
                                   for c in cols)
                tau = "—" if r["tau"] is None else f"{r['tau']:.2f}"
                print(f"| {name} | {t:g} | {b} | {r['tok_s']:.0f} | {tau} | {r['steps_per_k']} | {cells} |", flush=True)
                if "policy" in r:  # as it ran, against what the policy expected at the end
                    ran = "; ".join(f"k={k} {v['tokens_per_row_step']:.2f} tok/{v['cycle_ms'] or 0:.3f} ms"
                                    for k, v in r["per_k"].items())
                    est = "; ".join(f"k={k} {e['expected']:.2f}/{e['cost_ms']:.3f}{'' if e['measured'] else '*'}"
                                    for k, e in (r["policy"]["estimates"] or {}).items())
                    print(f"<!-- {name} T={t:g} B={b}: ran {ran} | policy {est} (* modelled) -->", flush=True)
                    for kind, v in r["policy"]["samples"].items():  # the cycles sampled, by place in their run
                        places = ", ".join(f"{p}{'+' if p == 5 else ''}: {n} at {m:.3f}"
                                           for p, (n, m) in v["by_place"].items())
                        print(f"<!-- {name} T={t:g} B={b}: sampled {kind}: {v['n']}, median {v['median']:.3f} ms, "
                              f"mean {v['mean']:.3f}; by place in a run of its kind {places} -->", flush=True)
            if a.kernels:
                res.setdefault("kernels", []).append({"run": name, "temperature": t,
                                                      "batch": a.kernels_batch, **kernels(engine, rows, t,
                                                                                          a.kernels)})
        if dev.startswith("cuda"):
            res.setdefault("replay", []).extend({"run": name, **r} for r in replay_costs(engine))
        del engine
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    for kr in res.get("kernels", []):
        print(f"\n{kr['run']} T={kr['temperature']:g} B={kr['batch']}: {kr['kernels_per_step']:.0f} kernels, "
              f"{kr['device_us_per_step']:.0f} µs per step on the device; the top ones (per step: calls, µs):")
        for name, calls, us in kr["top"]:
            print(f"  {calls:5.1f} {us:7.1f}  {name}")
        print(f"  host, under the profiler: {kr['host_step_us']:.0f} µs per step, of it {kr['host_wait_us']:.0f} "
              f"waiting for the device, {kr['host_own_us']:.0f} its own; the top calls (per step: calls, self µs):")
        for name, calls, us in kr["host_top"]:
            print(f"  {calls:5.1f} {us:7.1f}  {name}")
    if res.get("replay"):
        print("\nthe host's time in CUDAGraph.replay per step graph of one row (µs, median of 20 on an idle device):")
        for r in res["replay"]:
            print(f"  {r['run']:5} k={r['k']} width={r['width']:3} {r['mode']:7} {r['replay_us']:6.1f} µs host, "
                  f"{r['device_us']:7.1f} µs device")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
