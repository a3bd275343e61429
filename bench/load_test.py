"""Load test of `python -m serve` on loopback: concurrent streaming clients, some cancelling mid-stream.

    .venv/bin/python bench/load_test.py                       # tiny random models (as in tests/test_serve.py)
    .venv/bin/python bench/load_test.py --target DIR --drafter DIR --requests 256 --concurrency 64

Starts the server as a subprocess on 127.0.0.1 (a free port), runs every prompt alone first (greedy reference),
then `--requests` streaming requests with `--concurrency` clients in flight, every `--cancel-every`-th one closing
its connection after a few chunks. Reports requests/s, tokens/s, p50/p99 latency and TTFT, errors (must be 0),
that `dspark:cache_blocks_used` returns to 0, and that greedy outputs under load equal the outputs alone.
Prints a table, appends it to bench/RESULTS.md, and exits non-zero if a check fails. Bounded by `--timeout`.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["def add(a, b):", "import os\n", "class Parser:\n    def", "for i in range(", "while True:\n",
           "x = [1, 2, 3]\n", "return self.", "if __name__ == ", "with open(path) as f:", "try:\n    import",
           "def __init__(self, ", "raise ValueError(", "# Copyright", "print(", "lambda x:", "from typing import"]


@dataclass
class Result:
    idx: int
    prompt: int
    cancel: bool
    ok: bool = False
    error: str = ""
    text: str = ""
    finish: str | None = None
    tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0


def metrics(client: httpx.Client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, val = line.rsplit(" ", 1)
            pos = re.search(r'position="(\d+)"', name)
            out[name.split("{")[0] + (f"[{pos.group(1)}]" if pos else "")] = float(val)
    return out


async def one(client: httpx.AsyncClient, r: Result, body: dict, cancel_after: int) -> Result:
    t0 = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            done = False
            async for line in resp.aiter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                ev = json.loads(line[6:])
                if "error" in ev:
                    r.error = ev["error"]["message"]
                    return r
                if ev.get("usage"):
                    r.tokens = ev["usage"]["completion_tokens"]
                if ev["choices"]:
                    c = ev["choices"][0]
                    if c["text"] and not r.ttft:
                        r.ttft = time.perf_counter() - t0
                    r.text += c["text"]
                    r.finish = c["finish_reason"] or r.finish
                    chunks += 1
                if r.cancel and chunks >= cancel_after:
                    r.ok, r.latency = True, time.perf_counter() - t0
                    return r  # leaving the block closes the connection: the server must abort and free the cache
            r.ok = done and r.finish is not None
            if not r.ok:
                r.error = "stream ended without a finish_reason and [DONE]"
    except Exception as e:  # noqa: BLE001 - every failure is counted
        r.error = f"{type(e).__name__}: {e}"
    r.latency = time.perf_counter() - t0
    return r


async def run_load(url: str, args) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    sem = asyncio.Semaphore(args.concurrency)
    results = [Result(i, i % len(PROMPTS), args.cancel_every > 0 and i % args.cancel_every == args.cancel_every - 1)
               for i in range(args.requests)]

    async def worker(client, r):
        async with sem:
            body = {"model": args.model_name, "prompt": PROMPTS[r.prompt], "max_tokens": args.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            return await one(client, r, body, args.cancel_after)

    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker(client, r) for r in results)), args.timeout)
        return results, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "serve", "--target", str(args.target), "--port", str(port), "--host", "127.0.0.1",
           "--max-concurrent", str(args.concurrency), "--max-batch-size", str(args.max_batch_size),
           "--served-model-name", args.model_name]
    if args.drafter:
        cmd += ["--drafter", str(args.drafter)]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    log = open(Path(tempfile.gettempdir()) / f"dspark-load-test-{port}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def wait_health(client: httpx.Client, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming healthy")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not healthy after {timeout} s")


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPU cores, no GPU use (CPU fp32), Python {platform.python_version()}, " \
           f"torch {torch.__version__}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path)
    p.add_argument("--drafter", type=Path)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--cancel-every", type=int, default=4, help="every n-th request cancels (0: none)")
    p.add_argument("--cancel-after", type=int, default=3, help="chunks a cancelling client reads first")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--model-name", default="load-test")
    p.add_argument("--timeout", type=float, default=300.0, help="bound on each phase, seconds")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="dspark-load-")
    models = "given dirs"
    if args.target is None:
        from tests.test_serve import MAX_LEN, build_tiny_models

        args.target, args.drafter = build_tiny_models(Path(tmp.name))
        args.max_model_len = args.max_model_len or MAX_LEN
        models = "tiny random Qwen3 target (2 layers, d=64, vocab 512) + random DSpark drafter (block 4)"

    from serve import free_port

    port = free_port()
    proc = start_server(args, port)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=args.timeout) as c:
            wait_health(c, proc, 180)
            alone = {}
            for i, prompt in enumerate(PROMPTS):  # the greedy reference: one request at a time
                r = c.post("/v1/completions", json={"model": args.model_name, "prompt": prompt, "temperature": 0,
                                                    "max_tokens": args.max_tokens, "ignore_eos": True})
                r.raise_for_status()
                alone[i] = r.json()["choices"][0]["text"]
            before = metrics(c)
            results, wall = asyncio.run(run_load(url, args))
            t0, after = time.time(), metrics(c)
            while (after["dspark:cache_blocks_used"] or after["dspark:num_requests_running"]) and time.time() - t0 < 30:
                time.sleep(0.1)
                after = metrics(c)
            idle_s = time.time() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        tmp.cleanup()

    errors = [r for r in results if not r.ok]
    full = [r for r in results if r.ok and not r.cancel]
    cancelled = [r for r in results if r.ok and r.cancel]
    mismatched = [r for r in full if r.text != alone[r.prompt]]
    gen = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    drafts = after["vllm:spec_decode_num_drafts_total"] - before["vllm:spec_decode_num_drafts_total"]
    acc = after["vllm:spec_decode_num_accepted_tokens_total"] - before["vllm:spec_decode_num_accepted_tokens_total"]
    lat = [r.latency for r in full]
    ttft = [r.ttft for r in results if r.ok and r.ttft]
    pool_ok = after["dspark:cache_blocks_used"] == 0 and after["dspark:num_requests_running"] == 0
    rows = [("requests (completed / cancelled / errors)", f"{len(full)} / {len(cancelled)} / {len(errors)}"),
            ("concurrency, max_tokens", f"{args.concurrency}, {args.max_tokens}"),
            ("wall time (s)", f"{wall:.2f}"),
            ("requests/s (all finished or cancelled)", f"{(len(full) + len(cancelled)) / wall:.2f}"),
            ("generated tokens/s (server counter)", f"{gen / wall:.1f}"),
            ("latency p50 / p99 (s, completed)", f"{pct(lat, .5):.2f} / {pct(lat, .99):.2f}"),
            ("TTFT p50 / p99 (s)", f"{pct(ttft, .5):.2f} / {pct(ttft, .99):.2f}"),
            ("mean acceptance length (1 + accepted/drafts)", f"{1 + acc / drafts:.3f}" if drafts else "n/a"),
            ("tokens generated for the cancelled requests (aborted early)",
             f"{gen - sum(r.tokens for r in full):.0f} (vs {len(cancelled) * args.max_tokens} if run to the end)"),
            ("cache blocks used after run (must be 0)", f"{after['dspark:cache_blocks_used']:.0f} "
             f"(idle after {idle_s:.2f} s)"),
            ("greedy under load == alone", f"{len(full) - len(mismatched)}/{len(full)}")]
    table = "| metric | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    print(table)
    for r in errors[:5]:
        print(f"error: request {r.idx}: {r.error}", file=sys.stderr)
    ok = not errors and pool_ok and not mismatched
    if not args.no_append:
        cmd = "python bench/load_test.py " + " ".join(argv if argv is not None else sys.argv[1:])
        new = not args.results.exists()
        with open(args.results, "a") as f:
            if new:
                f.write("# Benchmark results\n\nEach section: the command, the machine, the date, the numbers.\n")
            f.write(f"\n## serve load test ({datetime.date.today().isoformat()})\n\n`{cmd.strip()}`\n\n"
                    f"Machine: {machine()}. Models: {models}. Loopback HTTP, server in a subprocess, streaming "
                    f"clients (httpx), every {args.cancel_every}th cancelling after {args.cancel_after} chunks. "
                    f"Checks: {'all passed' if ok else 'FAILED'}.\n\n{table}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
