"""Serving benchmark of `python -m serve`: AR vs DSpark through OpenAI-compatible streaming clients.

    python bench/serve_bench.py --target DIR --drafter DIR [--modes ar,dspark] [--tasks humaneval,creative]
        [--temperatures 0,0.7] [--concurrency 1,4,16,64] [--requests-per-level N] [--min-level-s 3]
        [--max-tokens 128] [--rounds 1] [--out FILE.json] [-- EXTRA SERVE FLAGS]   # e.g. -- --num-speculative-tokens 7

Per mode (ar: no drafter; dspark: with --drafter) the server runs as a subprocess on 127.0.0.1 (`python -m serve`,
device and dtype auto unless given after `--`; --max-batch-size defaults to the highest concurrency, --max-concurrent
to twice it, --max-model-len to the prompt budget + max_tokens + 64), is polled on GET /health, measured, then
terminated; with --rounds R > 1 both servers run at once and each level runs R times, the modes taking turns (AR,
DSpark, then DSpark, AR, ...: a drift of the machine over the run falls on both alike), and each figure is the median
over the rounds, DSpark ÷ AR the median of the rounds' ratios. Per (task, temperature, concurrency C) level: one
untimed warm-up request, then C clients each send streaming /v1/completions requests back to back until N
(--requests-per-level, default max(4C, 16)) have been sent and the level has lasted --min-level-s (default 3 s: a
level of a fraction of a second measures a GPU whose clocks and caches have not settled, and one stall is a large part
of it), then finish what they sent; the clients run in ceil(C / 8) processes (--client-procs), each with its share of
them and of the requests, timed from the moment all are ready (one Python process streaming 16 clients' tokens used a
whole core).
Request i sends prompt i mod P of the task (text, built as `python -m eval` builds it: raw prefix or --chat template,
the last --max-prompt-tokens tokens), `max_tokens` with `ignore_eos`, and with --seed S, seed S + i when T > 0 (no
seed by default, as vLLM's benchmark_serving: the engine decodes seeded sampled requests plainly unless k is pinned).

Metrics, as vLLM's benchmark_serving defines them (times in ms; p50/p99 are numpy's interpolated percentiles):
- output tok/s = the requests' completion_tokens (from the usage chunk) / wall time of the level; req/s likewise.
- TTFT: request sent -> first SSE event carrying text.
- ITL: gaps between successive text-carrying SSE events of a request, pooled over the level. This is vLLM's per-chunk
  convention: a DSpark verify step streams all its accepted tokens in one event (the wire format does not say how
  many), so DSpark's ITL is the time per step; tokens/event is reported beside it.
- TPOT = (latency - TTFT) / (completion_tokens - 1) per request, latency = request sent -> `data: [DONE]`.
- tau = 1 + accepted / drafts (mean tokens per verify) from the deltas of vLLM's spec-decode counters on /metrics
  over the level (read with the server idle before and after); steps per k likewise from our server's
  dspark:decode_steps_total (how often the engine drafted k tokens per row, 0 = plain).
- errors: HTTP errors, error events, streams without a finish_reason and [DONE], timeouts.
The JSON (--out, written whole at the end, also after a failure; the servers' output beside it as FILE.serve-MODE.log)
holds every request's times and text, the commands and torch/GPU info; each greedy DSpark text is compared with the
greedy AR text of its prompt. Bounded: each request by --request-timeout, each server start by --startup-timeout, the
whole run by --time-limit (each mode gets an equal share of the time left; levels run greedy first). Exit status 1
when a request failed, a server did not come up or the time limit cut the run; 2 for a bad option.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.serve_clients import ClientError, Req, clients, http_client, in_processes, one  # noqa: E402
from eval.__main__ import encode, versions  # noqa: E402
from eval.measure import counters_delta, parse_prometheus, spec_decode_counters, stats_from_counters  # noqa: E402
from eval.tasks import TASKS, build_task, select  # noqa: E402
from serve import free_port, target_positions  # noqa: E402

MODES = ("ar", "dspark")
SET_HERE = ("--target", "--drafter", "--host", "--port", "--engine", "--dry-run")  # not allowed after `--`
LEN_MARGIN = 64  # max_model_len room beyond prompt + max_tokens: the draft block and re-tokenized prompts
CLIENTS_PER_PROCESS = 8  # streaming clients per client process (--client-procs 0): at 16, one process used a core
MORE_PER_LEVEL = 63  # requests a level may add to its N to last --min-level-s, per request of N


class BenchError(RuntimeError):
    """A server that did not come up or a run cut short: reported, the JSON still written, exit status 1."""


def _list(text: str, conv, flag: str, ok, expected: str) -> list:
    try:
        vals = [conv(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or not all(ok(v) for v in vals):
        raise ValueError(f"{flag}: expected comma-separated {expected}, got {text!r}")
    return vals


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # a ValueError (one line from main), not argparse's usage + exit
        raise ValueError(message)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(options, extra serve flags: everything after `--`); a bad option is a ValueError naming it."""
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = _Parser(prog="bench/serve_bench.py", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter")
    p.add_argument("--modes", default="ar,dspark")
    p.add_argument("--tasks", default="humaneval,creative")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--requests-per-level", type=int, default=0, help="default max(4 x concurrency, 16)")
    p.add_argument("--min-level-s", type=float, default=3.0, help="seconds a level sends requests at least")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=0, help="prompts per task, evenly spread (0: all)")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="keep the last N prompt tokens")
    p.add_argument("--chat", action="store_true", help="wrap chat tasks' prompts in the chat template")
    p.add_argument("--seed", type=int, help="seed S + i for request i when T > 0 (default: none)")
    p.add_argument("--max-model-len", type=int, default=0, help="0: prompt budget + max_tokens + 64")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a server to answer /health")
    p.add_argument("--time-limit", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--out", help="JSON file for every number")
    p.add_argument("--client-procs", type=int, default=0, help="client processes per level (0: one per "
                   f"{CLIENTS_PER_PROCESS} clients): one Python process streaming many clients is itself the limit")
    p.add_argument("--rounds", type=int, default=1, help="times each level runs per mode, the modes' servers up at "
                   "once and taking turns (1: one server at a time)")
    p.add_argument("--profile", default="", help="TASK:T:C, e.g. creative:0.7:4: each server's engine thread under "
                   "torch.profiler over that level (POST /start_profile, /stop_profile), written next to --out")
    a = p.parse_args(argv)
    a.modes = _list(a.modes, str, "--modes", lambda m: m in MODES, "modes from ar,dspark")
    a.tasks = _list(a.tasks, str, "--tasks", lambda t: t in TASKS, f"tasks from {','.join(TASKS)}")
    a.temperatures = _list(a.temperatures, float, "--temperatures", lambda t: 0 <= t <= 2, "numbers in [0, 2]")
    a.concurrency = _list(a.concurrency, int, "--concurrency", lambda c: c >= 1, "integers >= 1")
    for flag, v, lo in [("--requests-per-level", a.requests_per_level, 0), ("--max-tokens", a.max_tokens, 1),
                        ("--num-prompts", a.num_prompts, 0), ("--max-prompt-tokens", a.max_prompt_tokens, 1),
                        ("--max-model-len", a.max_model_len, 0), ("--port", a.port, 0),
                        ("--client-procs", a.client_procs, 0), ("--rounds", a.rounds, 1)]:
        if v < lo:
            raise ValueError(f"{flag}: expected an integer >= {lo}, got {v}")
    if not a.min_level_s >= 0:
        raise ValueError(f"--min-level-s: expected seconds >= 0, got {a.min_level_s}")
    for flag, v in [("--request-timeout", a.request_timeout), ("--startup-timeout", a.startup_timeout),
                    ("--time-limit", a.time_limit)]:
        if not v > 0:
            raise ValueError(f"{flag}: expected seconds > 0, got {v}")
    if a.profile:
        parts = a.profile.split(":")
        try:
            a.profile = (parts[0], float(parts[1]), int(parts[2])) if len(parts) == 3 else None
        except ValueError:
            a.profile = None
        if a.profile is None or a.profile[0] not in a.tasks or a.profile[1] not in a.temperatures \
                or a.profile[2] not in a.concurrency:
            raise ValueError(f"--profile: expected TASK:T:C naming one of the levels run (--tasks, --temperatures, "
                             f"--concurrency), got {':'.join(parts)!r}")
    if "dspark" in a.modes and not a.drafter:
        raise ValueError("--drafter: required for mode dspark (or pass --modes ar)")
    for flag, d in [("--target", a.target), ("--drafter", a.drafter)]:
        if d is not None and not (Path(d) / "config.json").is_file():
            raise ValueError(f"{flag} {d}: not a checkpoint dir (no config.json)")
    taken = [x for x in extra if x.split("=")[0] in SET_HERE]
    if taken:
        raise ValueError(f"{taken[0]}: set by this script; give it before `--`, not among the serve flags")
    if not a.max_model_len:
        a.max_model_len = a.max_prompt_tokens + a.max_tokens + LEN_MARGIN
        positions = target_positions(a.target)
        a.max_model_len = min(a.max_model_len, positions or a.max_model_len)
    return a, extra


def load_prompts(a) -> dict[str, list[str]]:
    """Per task, the prompt texts: eval's encoding (raw prefix or chat template, last max_prompt_tokens), decoded."""
    from transformers import AutoTokenizer

    if not (Path(a.target) / "tokenizer.json").is_file():
        raise ValueError(f"--target {a.target}: no tokenizer.json; the benchmark sends text prompts")
    tok = AutoTokenizer.from_pretrained(a.target)
    out = {}
    for name in a.tasks:
        task = build_task(name)
        task.prompts = select(task.prompts, a.num_prompts or None)
        out[name] = [tok.decode(ids) for ids in encode(task, tok, a.chat, a.max_prompt_tokens)]
    return out


# ---------------------------------------------------------------------------- the server subprocess
def _has(extra: list[str], flag: str) -> bool:
    return any(x == flag or x.startswith(flag + "=") for x in extra)


def serve_command(a, mode: str, port: int, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "serve", "--target", a.target, "--host", "127.0.0.1", "--port", str(port)]
    if mode == "dspark":
        cmd += ["--drafter", a.drafter]
    c = max(a.concurrency)
    # --max-concurrent with room: a client may send its next request before the server has released the last one
    for flag, v in [("--max-batch-size", c), ("--max-concurrent", 2 * c), ("--max-model-len", a.max_model_len)]:
        if not _has(extra, flag):
            cmd += [flag, str(v)]
    if a.profile and not _has(extra, "--profile-dir"):
        cmd += ["--profile-dir", str(profile_dir(a, mode))]
    return cmd + extra


def profile_dir(a, mode: str) -> Path:
    """Where a server writes the --profile level's engine profile: beside --out, else in the temp dir."""
    return (Path(a.out).with_suffix(f".profile-{mode}") if a.out
            else Path(tempfile.gettempdir()) / f"serve-bench-profile-{mode}")


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, limit: float) -> None:
    t0 = time.monotonic()
    with httpx.Client(base_url=url, timeout=5.0) as c:
        while True:
            if proc.poll() is not None:
                raise BenchError(f"the server exited with status {proc.returncode} before /health answered; its "
                                 f"output ({log}) ends:\n{_tail(log)}")
            try:
                if c.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() - t0 > limit:
                raise BenchError(f"the server did not answer /health within {limit:.0f} s; its output ({log}) ends:\n"
                                 f"{_tail(log)}")
            time.sleep(0.25)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


FIRST_TOKEN = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
               "prefill": "vllm:request_prefill_time_seconds"}  # histograms: their _sum and _count
PER_K = {"dspark:decode_steps_total": "steps_per_k", "dspark:step_cycles_total": "cycles_per_k",
         "dspark:step_cycle_ms_total": "cycle_ms_per_k", "dspark:step_replay_ms_total": "replay_ms_per_k",
         "dspark:step_device_timed_total": "device_steps_per_k", "dspark:step_device_ms_total": "device_ms_per_k"}
# the engine thread's time (s): busy, inside step(), waiting for results, waiting to refill a step's inputs
HOST = {"loop": "dspark:engine_loop_seconds_total", "step": "dspark:engine_step_seconds_total",
        "read_wait": "dspark:step_read_wait_seconds_total", "launch_wait": "dspark:step_launch_wait_seconds_total"}


# drafting after plain steps: the stashed context's flushes, those queued behind a plain step in flight, host seconds
FLUSH = {"count": "dspark:context_flushes_total", "queued": "dspark:context_flushes_queued_total",
         "seconds": "dspark:context_flush_seconds_total"}


def per_k_delta(c0: dict, c1: dict, key: str) -> dict[int, float]:
    return {k: v - c0[key].get(k, 0.0) for k, v in sorted(c1[key].items())}


async def counters(client: httpx.AsyncClient, timeout: float = 30.0) -> dict:
    """vLLM's spec-decode counters + generation_tokens, read once the server is idle (its snapshot is per step)."""
    t0 = time.monotonic()
    while True:
        try:
            text = (await client.get("/metrics", timeout=10.0)).raise_for_status().text
        except httpx.HTTPError as e:
            raise BenchError(f"GET /metrics failed ({type(e).__name__}: {e}); see the server's output") from None
        vals: dict[str, float] = {}
        # our server's counters by the k it chose (absent on vLLM): decode steps, and the back-to-back graph steps
        # it timed with their whole time and replay time
        per_k: dict[str, dict[int, float]] = {name: {} for name in PER_K}
        # what our server's k policy weighs now: each measured kind's cost ("rows/k/mode": ms), the acceptance
        # estimates per group and draft position; the choices it made since it started ("rows/k/mode/basis"); and per
        # k its choices to draft k with the sums of what they weighed (n, plain_ms, ms, expected)
        policy: dict[str, dict] = {"step_cost_ms": {}, "acceptance": {}, "choices": {}, "weighed": {}}
        for name, labels, v in parse_prometheus(text):
            vals[name] = vals.get(name, 0.0) + v
            if name in per_k and "k" in labels:
                per_k[name][int(labels["k"])] = per_k[name].get(int(labels["k"]), 0.0) + v
            elif name == "dspark:policy_step_cost_ms":
                policy["step_cost_ms"][f"{labels['rows']}/{labels['k']}/{labels['mode']}"] = round(v, 3)
            elif name == "dspark:policy_acceptance":
                policy["acceptance"].setdefault(labels["group"], {})[int(labels["position"])] = round(v, 3)
            elif name == "dspark:policy_choices_total":
                policy["choices"]["/".join(labels[x] for x in ("rows", "k", "mode", "basis"))] = v
            elif name == "dspark:policy_draft_weighed_total":
                policy["weighed"].setdefault(int(labels["k"]), {})[labels["what"]] = v
        busy = vals.get("vllm:num_requests_running", 0) + vals.get("vllm:num_requests_waiting", 0)
        if not busy or time.monotonic() - t0 > timeout:
            return {**spec_decode_counters(text), "generation_tokens": vals.get("vllm:generation_tokens_total", 0.0),
                    "overlapped_steps": vals.get("dspark:overlapped_steps_total", 0.0),
                    "flushes": {key: vals.get(name, 0.0) for key, name in FLUSH.items()},
                    **{key: per_k[name] for name, key in PER_K.items()},
                    "step_host_ms": vals.get("dspark:step_host_ms"), "idle": not busy, "policy": policy,
                    "host_s": {key: vals.get(name, 0.0) for key, name in HOST.items()},
                    "first_token": {key: (vals.get(f"{name}_sum", 0.0), vals.get(f"{name}_count", 0.0))
                                    for key, name in FIRST_TOKEN.items()}}
        await asyncio.sleep(0.05)


def weighed(w0: dict[int, dict], w1: dict[int, dict]) -> dict[int, dict[str, float]]:
    """Per k the level's choices to draft k: how many (n), and the means of what they weighed: plain decoding's cost
    and k's (ms), k's expected tokens per row; to set beside the level's measured step times and tau."""
    out = {}
    for k, now in w1.items():
        was = w0.get(k, {})
        n = now.get("n", 0.0) - was.get("n", 0.0)
        if n > 0:
            out[k] = {"n": n, **{x: round((now.get(x, 0.0) - was.get(x, 0.0)) / n, 3)
                                 for x in ("plain_ms", "ms", "expected")}}
    return out


def step_ms_per_k(c0: dict, c1: dict) -> dict[int, dict[str, float]]:
    """Per k the server chose in the level: its back-to-back graph steps' mean time from one start to the next and
    mean replay (ms), what the k policy weighs against the drafts' acceptance."""
    n, cycle, replay = (per_k_delta(c0, c1, key) for key in ("cycles_per_k", "cycle_ms_per_k", "replay_ms_per_k"))
    timed, device = (per_k_delta(c0, c1, key) for key in ("device_steps_per_k", "device_ms_per_k"))
    return {k: {"steps": c, "cycle_ms": cycle[k] / c, "replay_ms": replay[k] / c,
                "device_ms": device[k] / timed[k] if timed.get(k) else None} for k, c in n.items() if c > 0}


def host_ms_per_step(c0: dict, c1: dict, steps: float) -> dict[str, float | None]:
    """The engine thread's time per decode step of the level (ms): busy (loop), inside step(), and of that waiting
    for results (read_wait) and to refill a step's inputs (launch_wait)."""
    return {key: 1e3 * (c1["host_s"][key] - c0["host_s"][key]) / steps if steps else None for key in HOST}


def server_first_token_ms(c0: dict, c1: dict) -> dict[str, float | None]:
    """The server's own mean time per request, in ms, from its engine taking the request to its first token (ttft),
    split into waiting for a batch slot (queue) and admission to first token (prefill); the client's TTFT less this
    is HTTP, tokenizing and delivery."""
    out = {}
    for key in FIRST_TOKEN:
        (s0, n0), (s1, n1) = c0["first_token"][key], c1["first_token"][key]
        out[key] = 1e3 * (s1 - s0) / (n1 - n0) if n1 > n0 else None
    return out


def pcts(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p99": None}
    ms = np.asarray(xs) * 1e3
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


async def run_level(url: str, a, prompts: list[str], temperature: float, conc: int, deadline: float,
                    profile: bool = False) -> dict:
    """One level: max(4C, 16) requests (or --requests-per-level) from C clients, and more until it has lasted
    --min-level-s; profile: the server's engine thread under torch.profiler over the timed requests."""
    n = a.requests_per_level or max(4 * conc, 16)  # a level long enough that one prefill stall is not its wall time
    seed = (lambda i: a.seed + i) if temperature > 0 and a.seed is not None else (lambda i: None)
    # the requests the clients may take: n, and up to MORE_PER_LEVEL x n more while the level is shorter than
    # --min-level-s (those not sent are left out of the level)
    reqs = [Req(i, i % len(prompts), seed(i)) for i in range(n * (1 + MORE_PER_LEVEL * (a.min_level_s > 0)))]
    # the streams' client, and one for /metrics and the profile routes
    async with http_client(url, a, conc) as client, httpx.AsyncClient(base_url=url) as ctl:
        warm = Req(-1, 0, seed(0))
        await one(client, a, prompts[0], temperature, warm)
        c0 = await counters(ctl)
        if profile:
            (await ctl.post("/start_profile", timeout=60.0)).raise_for_status()
        procs = min(a.client_procs or -(-conc // CLIENTS_PER_PROCESS), conc)
        left = max(deadline - time.monotonic(), 0)
        if procs == 1:
            t0 = time.perf_counter()
            end, cpu, cut = await clients(client, a, prompts, temperature, conc, reqs, left, n)
            wall, cpu_frac = end - t0, cpu / (end - t0)
        else:
            wall, cpu_frac, cut, reqs[:] = await asyncio.to_thread(in_processes, url, a, prompts, temperature, conc,
                                                                   reqs, procs, left, n)
        c1 = await counters(ctl)
        files = (await ctl.post("/stop_profile", timeout=300.0)).raise_for_status().json()["files"] if profile \
            else []
    reqs[:] = [r for r in reqs if r.sent or r.index < n]
    n = len(reqs)
    for r in reqs:
        if not r.ok and not r.error:
            r.error = "not finished when the time limit (--time-limit) was reached"
    ok = [r for r in reqs if r.ok]
    toks = sum(r.completion_tokens for r in ok)
    spec = stats_from_counters(counters_delta(c0, c1))
    return {
        "requests": n, "completed": len(ok), "errors": n - len(ok), "cut_by_time_limit": cut,
        "error_messages": sorted({r.error for r in reqs if r.error})[:5], "warmup_error": warm.error or None,
        "wall_s": wall, "output_tokens": toks, "output_tok_s": toks / wall, "request_s": len(ok) / wall,
        "ttft_ms": pcts([r.ttft for r in ok]), "itl_ms": pcts([x for r in ok for x in r.itl]),
        "tpot_ms": pcts([(r.latency - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]),
        "tokens_per_event": toks / max(sum(r.events for r in ok), 1), "tau": spec["tau"], "spec_decode": spec,
        "server_generation_tokens": c1["generation_tokens"] - c0["generation_tokens"],
        "steps_per_k": per_k_delta(c0, c1, "steps_per_k"), "step_host_ms": c1["step_host_ms"],
        # at the level's end: each measured kind's cost and the acceptance estimates; the level's choices
        "policy": {**c1["policy"], "choices": {key: n - c0["policy"]["choices"].get(key, 0.0)
                                               for key, n in c1["policy"]["choices"].items()
                                               if n > c0["policy"]["choices"].get(key, 0.0)},
                   "weighed": weighed(c0["policy"]["weighed"], c1["policy"]["weighed"])},
        "overlapped_steps": c1["overlapped_steps"] - c0["overlapped_steps"],
        "context_flushes": {key: c1["flushes"][key] - c0["flushes"][key] for key in FLUSH},
        "step_ms_per_k": step_ms_per_k(c0, c1), "server_first_token_ms": server_first_token_ms(c0, c1),
        "host_ms_per_step": host_ms_per_step(c0, c1, sum(per_k_delta(c0, c1, "steps_per_k").values())),
        "server_idle_at_reads": c0["idle"] and c1["idle"], "client_procs": procs,
        "client_cpu_fraction": cpu_frac,  # the busiest client process's CPU time / the level's wall time
        "profile_files": files,
        "per_request": [asdict(r) for r in reqs]}


# ---------------------------------------------------------------------------- report
def rows(levels: list[dict]) -> list[dict]:
    """One row per (task, temperature, concurrency) with both modes side by side (each figure the median over the
    rounds), DSpark ÷ AR (the median of each round's ratio, every round's in `speedups`) and the greedy text check."""
    by: dict[tuple, list[dict]] = {}
    for lv in levels:
        by.setdefault((lv["mode"], lv["task"], lv["temperature"], lv["concurrency"]), []).append(lv)
    out = []
    for key in dict.fromkeys((lv["task"], lv["temperature"], lv["concurrency"]) for lv in levels):
        ar, ds = by.get(("ar", *key), []), by.get(("dspark", *key), [])
        row = {"task": key[0], "temperature": key[1], "concurrency": key[2], "ar": _brief(ar), "dspark": _brief(ds),
               "speedup": None, "speedups": [], "greedy_equal": None, "greedy_compared": None}
        row["cut"] = any(lv.get("cut_by_time_limit") for lv in ar + ds)  # a part of a level: no ratio
        if not row["cut"]:
            ar_round = {lv.get("round", 0): lv["output_tok_s"] for lv in ar}
            row["speedups"] = [lv["output_tok_s"] / ar_round[lv.get("round", 0)] for lv in ds
                               if ar_round.get(lv.get("round", 0))]
            row["speedup"] = statistics.median(row["speedups"]) if row["speedups"] else None
        if ar and ds and key[1] == 0:  # each DSpark text against the AR text of its prompt (levels differ in how
            # many requests they sent, and client processes report theirs in their own order)
            ar_text = {x["prompt"]: x["text"] for lv in ar for x in lv["per_request"] if x["ok"]}
            pairs = [(ar_text[y["prompt"]], y["text"]) for lv in ds for y in lv["per_request"]
                     if y["ok"] and y["prompt"] in ar_text]
            row["greedy_compared"] = len(pairs)
            row["greedy_equal"] = sum(x == y for x, y in pairs)
        out.append(row)
    return out


def _brief(lvs: list[dict]) -> dict | None:
    """A mode's figures at one level: the median over its rounds (errors: their sum); None without a level."""
    if not lvs:
        return None
    each = [{k: lv[k] for k in ("output_tok_s", "request_s", "tau", "errors", "tokens_per_event")} | {
        "ttft_p50_ms": lv["ttft_ms"]["p50"], "itl_p50_ms": lv["itl_ms"]["p50"], "itl_p99_ms": lv["itl_ms"]["p99"],
        "tpot_p50_ms": lv["tpot_ms"]["p50"]} for lv in lvs]
    out = {}
    for k in each[0]:
        xs = [x[k] for x in each if x[k] is not None]
        out[k] = sum(xs) if k == "errors" else statistics.median(xs) if xs else None
    return out


def table(rs: list[dict]) -> str:
    def f(x, d=1):
        return "—" if x is None else f"{x:.{d}f}"

    def both(r, k, d=2):
        return " / ".join(f((r[m] or {}).get(k), d) for m in MODES)

    def ratio(r):
        if r.get("cut"):
            return "cut"
        sp = r.get("speedups") or []
        return f(r["speedup"], 2) + "×" * (r["speedup"] is not None) + (
            f" ({min(sp):.2f}–{max(sp):.2f})" if len(sp) > 1 else "")

    lines = ["| task | T | C | AR tok/s | DSpark tok/s | DSpark ÷ AR | τ | TTFT p50 ms | ITL p50 ms | ITL p99 ms "
             "| TPOT p50 ms | errors | greedy = AR |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rs:
        ar, ds = r["ar"] or {}, r["dspark"] or {}
        greedy = "—" if r["greedy_compared"] is None else f"{r['greedy_equal']}/{r['greedy_compared']}"
        lines.append(f"| {r['task']} | {r['temperature']:g} | {r['concurrency']} | {f(ar.get('output_tok_s'))} | "
                     f"{f(ds.get('output_tok_s'))} | {ratio(r)} | {f(ds.get('tau'), 2)} | "
                     f"{both(r, 'ttft_p50_ms')} | {both(r, 'itl_p50_ms')} | {both(r, 'itl_p99_ms')} | "
                     f"{both(r, 'tpot_p50_ms')} | {' / '.join(str((r[m] or {}).get('errors', '—')) for m in MODES)} "
                     f"| {greedy} |")
    return "\n".join(lines) + "\n\nTwo figures per cell: AR / DSpark. ITL is per SSE event (a DSpark event carries a " \
                              "whole verify step's tokens); TPOT is per token. cut: the time limit (--time-limit) " \
                              "ended a level, its errors the requests left unfinished. With --rounds R a figure is " \
                              "the median over the rounds, and the ratio's range over them follows it.\n"


def environment() -> dict:
    import torch

    info = {**versions(), "torch_cuda": torch.version.cuda, "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "gpus": []}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        info["gpus"] = [x.strip() for x in smi.stdout.splitlines() if x.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def write_json(path: str, report: dict) -> None:
    """Whole or not at all: a temp file beside it, then renamed."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    tmp.replace(out)


# ---------------------------------------------------------------------------- main
def start_server(a, mode: str, port: int, extra: list[str], report: dict, limit: float, log) -> subprocess.Popen:
    """One mode's `python -m serve` on port, its output in a log beside --out; returns once /health answers."""
    cmd = serve_command(a, mode, port, extra)
    if a.out:
        logfile = Path(a.out).with_suffix(f".serve-{mode}.log")
        logfile.parent.mkdir(parents=True, exist_ok=True)
    else:
        fd, name = tempfile.mkstemp(prefix=f"serve-bench-{mode}-", suffix=".log")
        os.close(fd)
        logfile = Path(name)
    srv = {"command": shlex.join(cmd), "log": str(logfile)}
    report["servers"][mode] = srv
    log(f"[serve_bench] {mode}: {srv['command']}")
    t0 = time.monotonic()
    with open(logfile, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", logfile, limit)
    except BaseException:
        stop(proc)
        raise
    srv["startup_s"] = time.monotonic() - t0
    srv["banner"] = next((x for x in logfile.read_text(errors="replace").splitlines() if x.startswith("serving ")),
                         None)
    return proc


def log_level(where: str, lv: dict, log) -> None:
    step_ms = {k: tuple(None if v[x] is None else round(v[x], 3) for x in ("cycle_ms", "replay_ms", "device_ms"))
               for k, v in lv["step_ms_per_k"].items()}
    host = {k: None if v is None else round(v, 3) for k, v in lv["host_ms_per_step"].items()}
    log(f"[serve_bench] {where} ({lv['level_s']:.1f} s in all): {lv['output_tok_s']:.1f} tok/s, "
        f"tau {lv['tau'] if lv['tau'] is None else round(lv['tau'], 2)}, errors {lv['errors']}, "
        f"steps per k {({k: int(v) for k, v in lv['steps_per_k'].items() if v})} "
        f"({int(lv.get('overlapped_steps', 0))} overlapped), context flushes "
        f"{ {k: round(v, 4) for k, v in lv.get('context_flushes', {}).items()} }, "
        f"host ms per step {lv.get('step_host_ms')}, ms per step by k (whole / replay / device) "
        f"{step_ms}, engine thread ms per step {host}, server first-token ms "
        f"{({k: v if v is None else round(v, 2) for k, v in lv['server_first_token_ms'].items()})}")
    if lv.get("policy", {}).get("step_cost_ms"):
        log(f"[serve_bench] {where}: policy step cost ms (rows/k/mode) {lv['policy']['step_cost_ms']}, "
            f"acceptance {lv['policy']['acceptance']}, choices (rows/k/mode/basis) {lv['policy'].get('choices')}, "
            f"choices to draft by k and the means of what they weighed {lv['policy'].get('weighed')}")
    if lv["profile_files"]:
        log(f"[serve_bench] {where}: engine profile in {lv['profile_files'][0]}")


def run(a, extra: list[str], prompts: dict[str, list[str]], report: dict, log) -> None:
    """With --rounds 1 one mode's server at a time, each running every level; with more, every mode's server up at
    once and each level run --rounds times by the modes in turn (AR, DSpark, then DSpark, AR, ...), so that a drift
    of the machine over the run (clocks, another process) falls on both modes alike."""
    end = time.monotonic() + a.time_limit
    groups = [[m] for m in a.modes] if a.rounds == 1 else [list(a.modes)]
    for i, group in enumerate(groups):
        # each server group gets an equal share of the time left, so that a short --time-limit measures every mode
        deadline = time.monotonic() + (end - time.monotonic()) / (len(groups) - i)
        who = "/".join(group)
        procs: dict[str, subprocess.Popen] = {}
        try:
            ports = {}
            for j, mode in enumerate(group):
                ports[mode] = a.port + j if a.port else free_port()
                procs[mode] = start_server(a, mode, ports[mode], extra, report,
                                           min(a.startup_timeout, deadline - time.monotonic()), log)
            if not run_levels(a, group, ports, prompts, report, deadline, log):
                msg = f"{who}'s share of the time limit (--time-limit {a.time_limit:.0f} s) ended a level"
                report["status"] = f"failed: {msg}" if report["status"] == "complete" else report["status"]
                log(f"[serve_bench] {msg}")
        finally:
            for proc in procs.values():
                stop(proc)


def run_levels(a, group: list[str], ports: dict[str, int], prompts: dict[str, list[str]], report: dict,
               deadline: float, log) -> bool:
    """Every level by the group's servers (greedy on every task first, then the next temperature: a cut run keeps
    the most-asked cells) -> False when the deadline came first or cut a level."""
    for temp, task, conc in [(T, t, c) for T in a.temperatures for t in a.tasks for c in a.concurrency]:
        for r in range(a.rounds):
            for mode in group if r % 2 == 0 else group[::-1]:
                where = f"{mode} {task} T={temp:g} C={conc}" + (f" round {r + 1}" if a.rounds > 1 else "")
                if time.monotonic() >= deadline:
                    log(f"[serve_bench] the time limit came before {where}")
                    return False
                # the earlier levels' results out of the client's full collections: a pause of the client would
                # read as the server's inter-token latency
                gc.collect()
                gc.freeze()
                t_level = time.monotonic()
                try:
                    lv = asyncio.run(run_level(f"http://127.0.0.1:{ports[mode]}", a, prompts[task], temp, conc,
                                               deadline, r == 0 and a.profile == (task, temp, conc)))
                finally:
                    gc.unfreeze()
                # the level's whole time: warm-up, counters and client processes' start included, not only wall_s
                lv["level_s"] = time.monotonic() - t_level
                report["levels"].append({"mode": mode, "task": task, "temperature": temp, "concurrency": conc,
                                         "round": r, **lv})
                if a.out:  # the levels so far, so that a run stopped from outside still leaves them
                    write_json(a.out, {**report, "partial": True, "rows": rows(report["levels"])})
                log_level(where, lv, log)
                if lv["cut_by_time_limit"]:
                    log(f"[serve_bench] the time limit cut {where}")
                    return False
    return True


def main(argv: list[str] | None = None, log=print) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    err = lambda *x: log(*x, file=sys.stderr)  # noqa: E731
    try:
        a, extra = parse_args(argv)
        prompts = load_prompts(a)
    except (ValueError, FileNotFoundError) as e:
        err(f"error: {e}")
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the server subprocess is stopped too
    report = {"command": shlex.join(["python", "bench/serve_bench.py", *argv]),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "config": {**vars(a), "serve_flags": extra},
              "prompts": {t: len(p) for t, p in prompts.items()}, "servers": {}, "levels": [], "status": "complete"}
    try:
        run(a, extra, prompts, report, err)
    except (BenchError, ClientError) as e:
        report["status"] = f"failed: {e}"
        err(f"error: {e}")
    finally:
        report["rows"] = rows(report["levels"])
        report["environment"] = environment()
        report["partial"] = False
        if a.out:
            write_json(a.out, report)
    log(table(report["rows"]), end="")
    if a.out:
        err(f"[serve_bench] wrote {a.out}")
    failed = report["status"] != "complete" or any(lv["errors"] for lv in report["levels"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
