"""Serving benchmark of `python -m serve`: AR vs DSpark through OpenAI-compatible streaming clients.

    python bench/serve_bench.py --target DIR --drafter DIR [--modes ar,dspark] [--tasks humaneval,creative]
        [--temperatures 0,0.7] [--concurrency 1,4,16,64] [--requests-per-level N] [--min-level-s 3]
        [--max-tokens 128] [--rounds 1] [--variant SPEC] [--out FILE.json] [-- EXTRA SERVE FLAGS]
        # e.g. -- --num-speculative-tokens 7

Per mode (ar: no drafter; dspark: with --drafter) the server runs as a subprocess on 127.0.0.1 (`python -m serve`,
device and dtype auto unless given after `--`; --max-batch-size defaults to the highest concurrency, --max-concurrent
to twice it, --max-model-len to the prompt budget + max_tokens + 64), is polled on GET /health, measured, then
terminated; with --rounds R > 1 every mode's server runs at once and each level runs R times, the modes taking turns
(AR, DSpark, then DSpark, AR, ...: a drift of the machine over the run falls on all alike), and each figure is the
median over the rounds, DSpark ÷ AR the median of the rounds' ratios. --variant SPEC adds a third mode, dspark-b: the
DSpark server with DSPARK_POLICY=SPEC (dspark.policy's constants replaced, e.g. DRAFT_GAIN=1.25), its ratio to AR per
round beside DSpark's: an A/B of the k policy under the same drift (with --modes ar, ar-b: the AR server with it, for
the constants the engine reads, e.g. FIRST_TOKENS_AFTER_LAUNCH=1). Per (task, temperature, concurrency C) level: one
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.serve_clients import ClientError, Req, clients, http_client, in_processes, one  # noqa: E402
from bench.serve_metrics import BenchError, counters, server_figures  # noqa: E402
from bench.serve_report import MODES, rows, table  # noqa: E402
from dspark.policy import EARLY_STEPS, overrides  # noqa: E402
from eval.__main__ import encode, versions  # noqa: E402
from eval.tasks import TASKS, build_task, select  # noqa: E402
from serve import free_port, target_positions  # noqa: E402

SET_HERE = ("--target", "--drafter", "--host", "--port", "--engine", "--dry-run")  # not allowed after `--`
LEN_MARGIN = 64  # max_model_len room beyond prompt + max_tokens: the draft block and re-tokenized prompts
CLIENTS_PER_PROCESS = 8  # streaming clients per client process (--client-procs 0): at 16, one process used a core
MORE_PER_LEVEL = 63  # requests a level may add to its N to last --min-level-s, per request of N


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
    p.add_argument("--variant", default="", help="NAME=VALUE,...: a third mode, dspark-b (ar-b with --modes ar), "
                   "whose server runs with DSPARK_POLICY set to it (module doc)")
    p.add_argument("--profile", default="", help="TASK:T:C, e.g. creative:0.7:4: each server's engine thread under "
                   "torch.profiler over that level (POST /start_profile, /stop_profile), written next to --out")
    a = p.parse_args(argv)
    a.modes = _list(a.modes, str, "--modes", lambda m: m in MODES[:2], "modes from ar,dspark")
    if a.variant:
        try:
            overrides(a.variant)
        except ValueError as e:
            raise ValueError(f"--variant: {e}") from None
        a.modes.append("dspark-b" if "dspark" in a.modes else "ar-b")
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
    if {"dspark", "dspark-b"} & set(a.modes) and not a.drafter:
        raise ValueError("--drafter: required for mode dspark and --variant (or pass --modes ar)")
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
    if mode.startswith("dspark"):
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
    return {
        "requests": n, "completed": len(ok), "errors": n - len(ok), "cut_by_time_limit": cut,
        "error_messages": sorted({r.error for r in reqs if r.error})[:5], "warmup_error": warm.error or None,
        "wall_s": wall, "output_tokens": toks, "output_tok_s": toks / wall, "request_s": len(ok) / wall,
        "ttft_ms": pcts([r.ttft for r in ok]), "itl_ms": pcts([x for r in ok for x in r.itl]),
        "tpot_ms": pcts([(r.latency - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]),
        # where a request's decode time beyond its steps goes: its first and last gap between events (the first
        # decode step after its prefill, its last step and finish), and [DONE] after its last text
        "itl_first_ms": pcts([r.itl[0] for r in ok if r.itl]), "itl_last_ms": pcts([r.itl[-1] for r in ok if r.itl]),
        "tail_ms": pcts([r.latency - r.ttft - sum(r.itl) for r in ok]),
        "tokens_per_event": toks / max(sum(r.events for r in ok), 1), **server_figures(c0, c1),
        "client_procs": procs,
        "client_cpu_fraction": cpu_frac,  # the busiest client process's CPU time / the level's wall time
        "profile_files": files,
        "per_request": [r.record() for r in reqs]}


# ---------------------------------------------------------------------------- report
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
    env = {**os.environ, "DSPARK_POLICY": a.variant} if mode.endswith("-b") else None
    srv = {"command": shlex.join(cmd), "log": str(logfile)}
    if env:
        srv["DSPARK_POLICY"] = a.variant
    report["servers"][mode] = srv
    log(f"[serve_bench] {mode}: {srv['command']}")
    t0 = time.monotonic()
    with open(logfile, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", logfile, limit)
    except BaseException:
        stop(proc)
        raise
    srv["startup_s"] = time.monotonic() - t0
    srv["banner"] = next((x for x in logfile.read_text(errors="replace").splitlines() if x.startswith("serving ")),
                         None)
    return proc


def p50(lv: dict, name: str) -> float | None:
    """A level's median of one of its client timings (ms, 3 decimals; None where it has none)."""
    v = (lv.get(name) or {}).get("p50")
    return None if v is None else round(v, 3)


def log_level(where: str, lv: dict, log) -> None:
    step_ms = {k: tuple(None if v[x] is None else round(v[x], 3) for x in ("cycle_ms", "replay_ms", "device_ms"))
               for k, v in lv["step_ms_per_k"].items()}
    host = {k: None if v is None else round(v, 3) for k, v in lv["host_ms_per_step"].items()}
    switches = {k: (int(v["switches"]), round(v["switch_ms"], 3)) for k, v in lv["step_ms_per_k"].items()
                if v.get("switches")}
    early = {k: (int(v["early"]), round(v["early_ms"], 3)) for k, v in lv["step_ms_per_k"].items() if v.get("early")}
    log(f"[serve_bench] {where} ({lv['level_s']:.1f} s in all): {lv['output_tok_s']:.1f} tok/s, "
        f"tau {lv['tau'] if lv['tau'] is None else round(lv['tau'], 2)}, errors {lv['errors']}, "
        f"steps per k {({k: int(v) for k, v in lv['steps_per_k'].items() if v})} "
        f"({int(lv.get('overlapped_steps', 0))} overlapped), context flushes "
        f"{ {k: round(v, 4) for k, v in lv.get('context_flushes', {}).items()} }, "
        f"host ms per step {lv.get('step_host_ms')}, ms per step by k (whole / replay / device) "
        f"{step_ms}, switches to k (n, ms start to start) {switches}, of the whole the first {EARLY_STEPS} of each "
        f"run (n, ms) {early}, the choices to draft's costs over the level's steps' {lv.get('weighed_vs_ran')}, "
        f"engine thread ms per step {host}, "
        f"server first-token ms "
        f"{({k: v if v is None else round(v, 2) for k, v in lv['server_first_token_ms'].items()})}, client ms "
        f"p50 (first / median / last gap between events, [DONE] after the last) {p50(lv, 'itl_first_ms')} / "
        f"{p50(lv, 'itl_ms')} / {p50(lv, 'itl_last_ms')}, {p50(lv, 'tail_ms')}")
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
