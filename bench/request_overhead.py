"""Time a request spends outside the engine: HTTP, tokenizing, the pipe to the engine process and the stream back.

    python bench/request_overhead.py --url http://127.0.0.1:8000 [--requests 60] [--prompt-chars 400]

Sends one-token streaming /v1/completions requests one after another over a raw socket (no client library's own
time in the figure). Per request: the client's time to first token (bytes sent -> first `data:` event) and the
engine's (admission -> first token, the delta of `vllm:time_to_first_token_seconds_sum` on /metrics around it); their
difference is the time outside the engine. Prints the medians (ms) after --warmup requests left out.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from eval.measure import parse_prometheus  # noqa: E402


def engine_ttft_s(url: str) -> float:
    """The server's summed time to first token over every request so far (s)."""
    return sum(v for name, _, v in parse_prometheus(httpx.get(url + "/metrics").text)
               if name == "vllm:time_to_first_token_seconds_sum")


def first_token_ms(host: str, port: int, payload: bytes) -> float:
    """One streaming request over a fresh connection: ms from its bytes sent to its first `data:` event."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection((host, port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall(head + payload)
        buf = b""
        while b"data:" not in buf and not (buf.startswith(b"HTTP/1.1 4") and b"\r\n\r\n" in buf):
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError(f"the server closed the stream before its first event: {buf[:300]!r}")
            buf += chunk
        ms = 1e3 * (time.perf_counter() - t0)
        while s.recv(65536):
            pass
    if not buf.startswith(b"HTTP/1.1 200"):
        status = buf.split(b"\r\n", 1)[0].decode(errors="replace")
        raise RuntimeError(f"the server answered {status}")
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="a running `python -m serve`")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--prompt-chars", type=int, default=400, help="the prompt: this many characters of README.md")
    p.add_argument("--model", default=None, help="default: the server's first model")
    a = p.parse_args()
    u = urlparse(a.url)
    model = a.model or httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
    prompt = (ROOT / "README.md").read_text()[:a.prompt_chars]
    payload = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
                          "ignore_eos": True}).encode()
    client, engine = [], []
    for i in range(a.warmup + a.requests):
        before = engine_ttft_s(a.url)
        ms = first_token_ms(u.hostname, u.port, payload)
        if i >= a.warmup:
            client.append(ms)
            engine.append(1e3 * (engine_ttft_s(a.url) - before))
    outside = [c - e for c, e in zip(client, engine)]
    print(f"{a.requests} requests, {a.prompt_chars}-character prompt: time to first token (median ms) client "
          f"{statistics.median(client):.3f}, engine {statistics.median(engine):.3f}, outside the engine "
          f"{statistics.median(outside):.3f}")


if __name__ == "__main__":
    main()
