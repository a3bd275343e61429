"""The streaming OpenAI-compatible clients of bench/serve_bench.py, and a level's clients spread over processes.

A client process is this file run as a script (`python bench/serve_clients.py`): its job as one JSON line on stdin,
"ready" on stdout, then "go" on stdin starts it, and the requests as it filled them come back as one JSON line on
stdout. It imports aiohttp alone, so that a level's eight client processes start in well under a second (spawned from
serve_bench they would each import torch and transformers, seconds per level). aiohttp, as vLLM's benchmark_serving
uses: per streamed request httpx's client costs about 0.4 ms more of its own.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import aiohttp


class ClientError(RuntimeError):
    """A client process that did not start or did not report."""


@dataclass
class Req:
    index: int
    prompt: int
    seed: int | None
    sent: bool = False
    ok: bool = False
    error: str = ""
    text: str = ""
    completion_tokens: int = 0
    events: int = 0  # text-carrying SSE events
    ttft: float = 0.0  # s
    latency: float = 0.0  # s, to [DONE]
    itl: list[float] = field(default_factory=list)  # s, gaps between text-carrying events

    def record(self) -> dict:
        """What the report keeps of it: its gaps as a summary (ms; None without two events), not the list (at
        thousands of requests a level the lists made the report too large to copy back from a GPU machine), and
        tail_ms, the time from its last text-carrying event to [DONE]."""
        out = asdict(self)
        gaps = sorted(out.pop("itl"))
        out["itl_ms"] = None if not gaps else {
            "n": len(gaps), "first": 1e3 * self.itl[0], "p50": 1e3 * gaps[len(gaps) // 2], "max": 1e3 * gaps[-1],
            "last": 1e3 * self.itl[-1]}
        out["tail_ms"] = 1e3 * (self.latency - self.ttft - sum(self.itl)) if self.ok else None
        return out


async def one(client: aiohttp.ClientSession, a, prompt: str, temperature: float, r: Req) -> None:
    """One streaming completion, timed per SSE event (the time its network chunk arrived)."""
    body = {"prompt": prompt, "max_tokens": a.max_tokens, "temperature": temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if r.seed is not None:
        body["seed"] = r.seed
    parts, last, done, finish = [], None, False, None
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(a.request_timeout), client.post("/v1/completions", json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.read())[:300].decode(errors='replace')}"
                return
            buf = b""
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                *events, buf = (buf + chunk).split(b"\n\n")
                for ev in events:
                    data = ev.strip()[6:] if ev.strip().startswith(b"data: ") else None
                    if data is None:
                        continue
                    if data == b"[DONE]":
                        done = True
                        continue
                    obj = json.loads(data)
                    if "error" in obj:
                        r.error = f"error event: {obj['error'].get('message')}"
                        return
                    if obj.get("usage"):
                        r.completion_tokens = obj["usage"]["completion_tokens"]
                    for ch in obj.get("choices") or ():
                        if ch.get("text"):
                            if last is None:
                                r.ttft = now - t0
                            else:
                                r.itl.append(now - last)
                            last = now
                            r.events += 1
                            parts.append(ch["text"])
                        finish = ch.get("finish_reason") or finish
        r.latency, r.text = time.perf_counter() - t0, "".join(parts)
        if not (done and finish):
            r.error = "the stream ended without a finish_reason and data: [DONE]"
        elif not r.completion_tokens or not r.events:
            r.error = "no usage chunk or no text in the stream"
        else:
            r.ok = True
    except TimeoutError:
        r.error = f"timed out after {a.request_timeout:.0f} s (--request-timeout)"
    except (aiohttp.ClientError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"


def http_client(url: str, a, conc: int) -> aiohttp.ClientSession:
    """The client a level's (or a client process's) conc streams share: a connection each, and two spare."""
    return aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=a.request_timeout),
                                 connector=aiohttp.TCPConnector(limit=conc + 2))


async def clients(client: aiohttp.ClientSession, a, prompts: list[str], temperature: float, conc: int, reqs: list[Req],
                  limit: float, need: int) -> tuple[float, float, bool]:
    """conc clients sending reqs back to back, those of index < need and the others until a.min_level_s has passed
    -> (perf_counter at the end, this process's CPU seconds, cut by the time limit). Each sent request is marked."""
    todo = iter(reqs)
    t0 = time.perf_counter()

    async def worker():
        for r in todo:  # one shared iterator: each request is taken by exactly one client
            if r.index >= need and time.perf_counter() - t0 >= a.min_level_s:
                return
            r.sent = True
            await one(client, a, prompts[r.prompt], temperature, r)

    cpu0, cut = time.process_time(), False
    try:
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(conc))), limit)
    except TimeoutError:
        cut = True
    return time.perf_counter(), time.process_time() - cpu0, cut


def _job(url: str, a, prompts: list[str], temperature: float, conc: int, reqs: list[Req], limit: float,
         need: int) -> str:
    return json.dumps({"url": url, "max_tokens": a.max_tokens, "request_timeout": a.request_timeout,
                       "min_level_s": a.min_level_s, "prompts": prompts, "temperature": temperature, "conc": conc,
                       "reqs": [asdict(r) for r in reqs], "limit": limit, "need": need}) + "\n"


def in_processes(url: str, a, prompts: list[str], temperature: float, conc: int, reqs: list[Req], procs: int,
                 limit: float, need: int) -> tuple[float, float, bool, list[Req]]:
    """A level's clients spread over `procs` client processes (process g takes requests i with i % procs == g),
    timed from the moment all are ready -> (wall s, the busiest process's CPU fraction, cut, the requests as the
    processes filled them, in order)."""
    shares = [(conc // procs + (g < conc % procs), reqs[g::procs]) for g in range(procs)]
    errs = [tempfile.TemporaryFile("w+") for _ in shares]  # a file, not a pipe: a pipe nobody reads can fill
    workers = [subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=e, text=True) for e in errs]

    def stderr(g: int) -> str:
        errs[g].seek(0)
        return errs[g].read()[-2000:]
    try:
        for w, (n, share) in zip(workers, shares):
            w.stdin.write(_job(url, a, prompts, temperature, n, share, limit, need))
            w.stdin.flush()
        for g, w in enumerate(workers):
            if w.stdout.readline().strip() != "ready":
                w.kill()
                raise ClientError(f"a client process did not start: {stderr(g)}")
        t0 = time.perf_counter()
        for w in workers:
            w.stdin.write("go\n")
            w.stdin.flush()
        got = []
        for g, w in enumerate(workers):
            out = w.communicate(timeout=limit + a.request_timeout + 60)[0]
            if w.returncode != 0 or not out.strip():
                raise ClientError(f"a client process failed (exit status {w.returncode}): {stderr(g)}")
            got.append(json.loads(out))
    finally:
        for w, e in zip(workers, errs):
            if w.poll() is None:
                w.kill()
            e.close()
    wall = max(g["end"] for g in got) - t0
    done = {r["index"]: Req(**r) for g in got for r in g["reqs"]}
    return wall, max(g["cpu"] for g in got) / wall, any(g["cut"] for g in got), [done[r.index] for r in reqs]


def main() -> None:
    """A client process: its share of a level's clients and requests (the job on stdin), started by "go"."""
    job = json.loads(sys.stdin.readline())
    a = SimpleNamespace(max_tokens=job["max_tokens"], request_timeout=job["request_timeout"],
                        min_level_s=job["min_level_s"])
    reqs = [Req(**r) for r in job["reqs"]]

    async def go():
        async with http_client(job["url"], a, job["conc"]) as client:
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.readline)  # "go"
            return await clients(client, a, job["prompts"], job["temperature"], job["conc"], reqs, job["limit"],
                                 job["need"])

    end, cpu, cut = asyncio.run(go())
    print(json.dumps({"reqs": [asdict(r) for r in reqs], "end": end, "cpu": cpu, "cut": cut}), flush=True)


if __name__ == "__main__":
    main()
