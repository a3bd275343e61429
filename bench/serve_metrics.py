"""The server's side of a serve_bench level: our server's /metrics read with the server idle before and after the
level, and what their differences say (tau, steps and step times per k, the engine thread's time, the k policy's
choices and what they weighed, the server's share of the time to first token)."""
from __future__ import annotations

import asyncio
import time

import httpx

from eval.measure import counters_delta, parse_prometheus, spec_decode_counters, stats_from_counters


class BenchError(RuntimeError):
    """A server that did not come up or a run cut short: reported, the JSON still written, exit status 1."""


FIRST_TOKEN = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
               "prefill": "vllm:request_prefill_time_seconds"}  # histograms: their _sum and _count
PER_K = {"dspark:decode_steps_total": "steps_per_k", "dspark:step_cycles_total": "cycles_per_k",
         "dspark:step_cycle_ms_total": "cycle_ms_per_k", "dspark:step_replay_ms_total": "replay_ms_per_k",
         "dspark:step_device_timed_total": "device_steps_per_k", "dspark:step_device_ms_total": "device_ms_per_k",
         "dspark:step_switches_total": "switches_per_k", "dspark:step_switch_ms_total": "switch_ms_per_k",
         "dspark:step_early_cycles_total": "early_per_k", "dspark:step_early_cycle_ms_total": "early_ms_per_k"}
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
        # k its choices to draft k with the sums of what they weighed (the policy's WEIGHED)
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
    """Per k the level's choices to draft k: how many (n), and the means of what they weighed (plain decoding's cost
    and k's, ms; k's expected tokens per row; the plain cost's cycles, the least of them, its age in steps: the
    policy's WEIGHED), to set beside the level's measured step times and tau."""
    out = {}
    for k, now in w1.items():
        was = w0.get(k, {})
        n = now.get("n", 0.0) - was.get("n", 0.0)
        if n > 0:
            out[k] = {"n": n, **{x: round((v - was.get(x, 0.0)) / n, 3) for x, v in now.items() if x != "n"}}
    return out


def step_ms_per_k(c0: dict, c1: dict) -> dict[int, dict[str, float]]:
    """Per k the server chose in the level: its back-to-back graph steps' mean time from one start to the next and
    mean replay (ms), what the k policy weighs against the drafts' acceptance; and its switches (the first step of
    a run of k after another kind, left out of those cycles: dspark.policy.KPolicy.step_started); and of the timed
    steps the first of each run apart (early: how many and their mean time start to start)."""
    d = {key: per_k_delta(c0, c1, key) for key in ("cycles_per_k", "cycle_ms_per_k", "replay_ms_per_k",
                                                   "device_steps_per_k", "device_ms_per_k", "switches_per_k",
                                                   "switch_ms_per_k", "early_per_k", "early_ms_per_k")}

    def mean(total: str, count: str, k: int) -> float | None:  # a level's ms per step of k, None without steps
        return d[total][k] / d[count][k] if d[count].get(k) else None

    return {k: {"steps": c, "cycle_ms": mean("cycle_ms_per_k", "cycles_per_k", k),
                "replay_ms": mean("replay_ms_per_k", "cycles_per_k", k),
                "device_ms": mean("device_ms_per_k", "device_steps_per_k", k),
                # the steps of k that began a run of it after another kind, and their mean time start to start
                "switches": d["switches_per_k"].get(k, 0.0), "switch_ms": mean("switch_ms_per_k", "switches_per_k", k),
                "early": d["early_per_k"].get(k, 0.0), "early_ms": mean("early_ms_per_k", "early_per_k", k)}
            for k, c in d["cycles_per_k"].items() if c > 0}


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


def weighed_against_ran(w: dict[int, dict], step_ms: dict[int, dict]) -> dict[str, float] | None:
    """What the level's choices to draft weighed against what its steps took: over those choices (their n as
    weights), plain decoding's cost they weighed over the level's mean plain step (start to start), and k's cost over
    its k's mean step; None without such choices or those steps. Above 1 a cost was weighed dearer than its steps
    ran. (The level's means pool its batch buckets: at a concurrency whose batch size moves across buckets they
    compare unlike steps.)"""
    if 0 not in step_ms:
        return None
    ks = {k: x for k, x in w.items() if k in step_ms and x.get("n")}
    n = sum(x["n"] for x in ks.values())
    if not n:
        return None
    return {"plain": round(sum(x["n"] * x["plain_ms"] for x in ks.values()) / n / step_ms[0]["cycle_ms"], 3),
            "draft": round(sum(x["n"] * x["ms"] / step_ms[k]["cycle_ms"] for k, x in ks.items()) / n, 3)}


def server_figures(c0: dict, c1: dict) -> dict:
    """A level's figures from the server's counters before (c0) and after (c1) it."""
    spec = stats_from_counters(counters_delta(c0, c1))
    steps = per_k_delta(c0, c1, "steps_per_k")
    choices, step_ms = weighed(c0["policy"]["weighed"], c1["policy"]["weighed"]), step_ms_per_k(c0, c1)
    return {
        "tau": spec["tau"], "spec_decode": spec,
        "server_generation_tokens": c1["generation_tokens"] - c0["generation_tokens"],
        "steps_per_k": steps, "step_host_ms": c1["step_host_ms"],
        # at the level's end: each measured kind's cost and the acceptance estimates; the level's choices
        "policy": {**c1["policy"], "choices": {key: n - c0["policy"]["choices"].get(key, 0.0)
                                               for key, n in c1["policy"]["choices"].items()
                                               if n > c0["policy"]["choices"].get(key, 0.0)},
                   "weighed": choices},
        "weighed_vs_ran": weighed_against_ran(choices, step_ms),
        "overlapped_steps": c1["overlapped_steps"] - c0["overlapped_steps"],
        "context_flushes": {key: c1["flushes"][key] - c0["flushes"][key] for key in FLUSH},
        "step_ms_per_k": step_ms, "server_first_token_ms": server_first_token_ms(c0, c1),
        "host_ms_per_step": host_ms_per_step(c0, c1, sum(steps.values())),
        "server_idle_at_reads": c0["idle"] and c1["idle"]}
