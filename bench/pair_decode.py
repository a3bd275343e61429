"""A target + drafter pair through `dspark.Engine` (the path `python -m serve` and `python -m eval` run): AR vs
DSpark, greedy (or --temperature T, no seeds), at bs=1 per prompt and for batches of prompts decoded together.

    python3 bench/pair_decode.py --target runs/quickstart/target/final --drafter runs/quickstart/drafter/final \
        [--tasks humaneval,creative] [--prompts 8] [--max-tokens 128] [--batches 1,4,16,64] [--k auto] [--out F.json]
        [--temperature 0.7] [--profile F.txt [--profile-batch 4]]

Per task, each prompt alone (max_tokens, no EOS stop): decode tok/s = tokens after the first / wall time of the
engine steps after the prefill step; ms per step; τ = mean (accepted + 1) per verify; host µs per step = step wall
time minus the time the host waited for the device's result (the step's one read); greedy DSpark output identical
to AR (sampled runs: not compared). Engines are warmed up first (CUDA graphs captured, kernels autotuned).
--batches: B prompts decoded together (continuous batching in one engine), aggregate decode tok/s. On CPU (fp32, no
graphs) it checks the script only.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark import Engine, SamplingParams, load_drafter, load_target  # noqa: E402
from dspark.device import resolve_device, resolve_dtype  # noqa: E402
from eval.__main__ import encode as encode_task  # noqa: E402
from eval.tasks import build_task, select  # noqa: E402


def encode(task, tok, n: int, prompt_tokens: int) -> list[list[int]]:
    """n prompts of the task, evenly spread, encoded the way `python -m eval` does."""
    return encode_task(dataclasses.replace(task, prompts=select(task.prompts, n)), tok, False, prompt_tokens)


def decode_run(engine: Engine, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0) -> dict:
    """All prompts added at once (one batch), stepped to the end: the first step (prefill + first tokens) is timed
    apart; the rest are decode steps."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    t0 = time.perf_counter()
    while any(r.num_computed < len(r.prompt_ids) or not r.output_ids for r in reqs):
        engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    wait0, steps, c = engine.runner.wait_s, 0, engine.counters
    dev0 = (sum(c["device_ms_per_k"]), sum(c["device_steps_per_k"]))
    while engine.has_work():
        engine.step()
        steps += 1
    t2 = time.perf_counter()
    timed = sum(c["device_steps_per_k"]) - dev0[1]
    outs = [r.output() for r in reqs]
    acc = [a for o in outs for a in o.accepted_per_step]
    return {"decode_s": t2 - t1, "prefill_s": t1 - t0, "steps": steps, "wait_s": engine.runner.wait_s - wait0,
            # the mean time of a step's graph on the device (CUDA events around the replays)
            "device_ms_step": (sum(c["device_ms_per_k"]) - dev0[0]) / timed if timed else None,
            "tokens": sum(len(o.token_ids) - 1 for o in outs), "token_ids": [o.token_ids for o in outs],
            "tau": 1 + sum(acc) / len(acc) if acc else 1.0, "accepted": acc,
            "drafts": [n for o in outs for n in o.num_drafts_per_step]}


def per_prompt(engine: Engine, prompts, max_tokens: int, temperature: float = 0.0) -> dict:
    runs = [decode_run(engine, [p], max_tokens, temperature) for p in prompts]
    secs, steps = sum(r["decode_s"] for r in runs), sum(r["steps"] for r in runs)
    acc = [a for r in runs for a in r["accepted"]]
    return {"tok_s": sum(r["tokens"] for r in runs) / secs, "ms_step": 1e3 * secs / steps,
            "host_us_step": 1e6 * (secs - sum(r["wait_s"] for r in runs)) / steps,
            "tau": 1 + sum(acc) / len(acc) if acc else 1.0, "prefill_ms": 1e3 * sum(r["prefill_s"] for r in runs)
            / len(runs), "token_ids": [r["token_ids"][0] for r in runs],
            "mean_drafts": sum(n for r in runs for n in r["drafts"]) / max(steps, 1)}


def profile(name: str, engine: Engine, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
            steps: int = 32) -> str:
    """The kernels of the prefill step of these requests (their first tokens: the time to first token's engine
    part), then of `steps` decode steps decoded together, each by total device time."""
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True))
    cuda = engine.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    sort = "device_time_total" if cuda else "cpu_time_total"
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        engine.step()
        if cuda:
            torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - t0)
    lens = sorted(len(p) for p in prompts)
    out = [f"## {name}: the prefill step of {len(prompts)} prompts of {lens[0]}-{lens[-1]} tokens, T={temperature:g} "
           f"({wall:.2f} ms wall under the profiler)\n" + prof.key_averages().table(sort_by=sort, row_limit=20)]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_work():
        engine.step()
    table = prof.key_averages().table(sort_by=sort, row_limit=30)
    return "\n\n".join(out + [f"## {name}: {steps} steps at bs={len(prompts)}, T={temperature:g}\n" + table])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--tasks", default="humaneval,creative")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per task (evenly spread over the task)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=256, help="keep the last N prompt tokens")
    ap.add_argument("--k", default="auto", help="drafts per step: auto (the engine's choice) or a number")
    ap.add_argument("--batches", default="", help="also throughput vs batch size, e.g. 1,4,16,64 (first task)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", action="store_true", help="torch.compile the engine's decode step")
    ap.add_argument("--out", help="write every figure as JSON here")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (no seeds)")
    ap.add_argument("--profile", help="also write the device kernels of 32 steps per engine (torch.profiler, by "
                    "device time) to this text file")
    ap.add_argument("--profile-batch", type=int, default=1, help="requests decoded together in the profiled steps")
    a = ap.parse_args(argv)
    dev = resolve_device(a.device)
    target = load_target(a.target, device=dev, dtype=resolve_dtype(a.dtype, dev))
    drafter = load_drafter(a.drafter, target)
    tok = target.tokenizer
    k = None if a.k == "auto" else int(a.k)
    batches = [int(b) for b in a.batches.split(",") if b]
    tasks = {name: encode(build_task(name), tok, a.prompts, a.prompt_tokens) for name in a.tasks.split(",")}
    longest = max(len(p) for ps in tasks.values() for p in ps)
    mml = longest + a.max_tokens + drafter.config.num_drafts + 1
    mbs = max([1, a.profile_batch, *batches])
    engines = {"AR": Engine(target, None, max_batch_size=mbs, max_model_len=mml, compile=a.compile),
               "DSpark": Engine(target, drafter, num_speculative_tokens=k, max_batch_size=mbs, max_model_len=mml,
                                compile=a.compile)}
    first = next(iter(tasks.values()))
    warm = {}
    for m, e in engines.items():  # warm-up: compile, every step graph, then a short run (autotuning, allocator)
        t0 = time.perf_counter()
        e.warmup()
        warm[m] = {"graphs": len(e.runner.steps), "seconds": time.perf_counter() - t0, "compiled": e.runner.compiled}
        print(f"{m}: {warm[m]['graphs']} step graphs in {warm[m]['seconds']:.0f} s (compiled: {e.runner.compiled})",
              flush=True)
        for b in sorted({1, *batches}):
            decode_run(e, [first[i % len(first)] for i in range(b)], min(a.max_tokens, 16))
    res = {"command": "python3 bench/pair_decode.py " + " ".join(argv or sys.argv[1:]), "device": dev,
           "gpu": torch.cuda.get_device_name() if dev.startswith("cuda") else platform.processor(),
           "torch": torch.__version__, "warmup": warm, "tasks": {}, "batches": {}}
    print("| task | prompts | AR tok/s | DSpark tok/s | speedup | τ | mean k | AR ms/step | DSpark ms/step | "
          "AR host µs/step | DSpark host µs/step | identical to AR |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name, prompts in tasks.items():
        ar, ds = (per_prompt(engines[m], prompts, a.max_tokens, a.temperature) for m in ("AR", "DSpark"))
        same = sum(x == y for x, y in zip(ar["token_ids"], ds["token_ids"])) if a.temperature == 0 else None
        res["tasks"][name] = {"AR": ar, "DSpark": ds, "identical": same, "speedup": ds["tok_s"] / ar["tok_s"]}
        print(f"| {name} | {len(prompts)} | {ar['tok_s']:.0f} | {ds['tok_s']:.0f} | {ds['tok_s'] / ar['tok_s']:.2f}x | "
              f"{ds['tau']:.2f} | {ds['mean_drafts']:.1f} | {ar['ms_step']:.3f} | {ds['ms_step']:.3f} | "
              f"{ar['host_us_step']:.0f} | {ds['host_us_step']:.0f} | "
              f"{'—' if same is None else f'{same}/{len(prompts)}'} |", flush=True)
    if batches:
        print("\n| batch | AR tok/s | DSpark tok/s | DSpark / AR | τ | mean k | ms/step AR / DSpark | "
              "device ms/step AR / DSpark |\n|--:|--:|--:|--:|--:|--:|--:|--:|")
    for b in batches:
        ps = [first[i % len(first)] for i in range(b)]
        ar, ds = (decode_run(engines[m], ps, a.max_tokens, a.temperature) for m in ("AR", "DSpark"))
        row = {m: {"tok_s": r["tokens"] / r["decode_s"], "tau": r["tau"],
                   "mean_drafts": sum(r["drafts"]) / max(len(r["drafts"]), 1),
                   "ms_step": 1e3 * r["decode_s"] / max(r["steps"], 1), "device_ms_step": r["device_ms_step"]}
               for m, r in (("AR", ar), ("DSpark", ds))}
        res["batches"][b] = row
        dev = " / ".join("—" if row[m]["device_ms_step"] is None else f"{row[m]['device_ms_step']:.3f}"
                         for m in ("AR", "DSpark"))
        print(f"| {b} | {row['AR']['tok_s']:.0f} | {row['DSpark']['tok_s']:.0f} | "
              f"{row['DSpark']['tok_s'] / row['AR']['tok_s']:.2f}x | {ds['tau']:.2f} | "
              f"{row['DSpark']['mean_drafts']:.1f} | {row['AR']['ms_step']:.3f} / {row['DSpark']['ms_step']:.3f} | "
              f"{dev} |", flush=True)
    if a.profile:
        ps = [first[i % len(first)] for i in range(a.profile_batch)]
        Path(a.profile).write_text("\n\n".join(profile(name, e, ps, a.max_tokens, a.temperature)
                                               for name, e in engines.items()))
    if a.out:
        for t in res["tasks"].values():
            for m in ("AR", "DSpark"):
                t[m].pop("token_ids")
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
