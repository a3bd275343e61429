"""The engine as it is (eager PyTorch, no CUDA graphs) on a GPU: where a bs=1 speculative step spends its time, and
throughput against batch size with and without speculation: the baseline for the CUDA-graph paths.

    python3 bench/engine_gpu.py --target runs/k3-mini/final --drafter runs/k3-mini-drafter-2gpu/final [--append]

- step profile (bs=1, greedy, humaneval prompts): wall ms per engine step (AR decode step / speculative step) and
  the GPU busy time inside it (sum of CUDA kernel times from torch.profiler); host overhead = wall - GPU busy.
- throughput: B prompts submitted together (B = 1, 4, 16, 64), max_tokens tokens each, generated tokens / wall s.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark import Engine, SamplingParams, load_drafter, load_target  # noqa: E402
from eval.tasks import humaneval_prompts  # noqa: E402


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def step_profile(engine: Engine, prompt_ids: list[int], steps: int) -> dict:
    """Prefill one request, then time `steps` engine steps (wall, synchronised) and profile their GPU kernels."""
    from torch.profiler import ProfilerActivity, profile

    dev = engine.device
    engine.add_request(prompt_ids, SamplingParams(max_tokens=steps * (engine.k + 1) + 8, ignore_eos=True))
    engine.step()  # prefill
    walls, emitted = [], 0
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            sync(dev)
            t0 = time.perf_counter()
            out = engine.step()
            sync(dev)
            walls.append(time.perf_counter() - t0)
            emitted += sum(len(t) for _, t in out)
    while engine.has_work():
        engine.step()
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") \
        if dev.type == "cuda" else 0.0
    wall = sum(walls)
    return {"wall_ms": 1e3 * statistics.median(walls), "gpu_ms": gpu_us / 1e3 / steps,
            "host_ms": 1e3 * wall / steps - gpu_us / 1e3 / steps, "tokens_per_step": emitted / steps,
            "tok_s": emitted / wall}


def throughput(engine: Engine, prompts: list[list[int]], batch: int, max_tokens: int) -> float:
    ids = [prompts[i % len(prompts)] for i in range(batch)]
    sync(engine.device)
    t0 = time.perf_counter()
    outs = engine.generate(ids, [SamplingParams(max_tokens=max_tokens, ignore_eos=True) for _ in ids])
    sync(engine.device)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--append", action="store_true", help="append the tables to bench/RESULTS.md")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype) if dev.type == "cuda" else torch.float32
    target = load_target(a.target, device=dev, dtype=dtype)
    drafter = load_drafter(a.drafter, target)
    tok = target.tokenizer
    prompts = [tok.encode(p, add_special_tokens=False)[-256:] for p in humaneval_prompts()[:16]]
    batches = [int(b) for b in a.batches.split(",")]
    engines = {"AR": lambda: Engine(target, None, max_batch_size=max(batches)),
               "DSpark": lambda: Engine(target, drafter, max_batch_size=max(batches))}
    lines = ["| engine | wall ms/step | GPU busy ms/step | host ms/step | tokens/step | tok/s (bs=1) |",
             "|---|--:|--:|--:|--:|--:|"]
    tput = {}
    for name, make in engines.items():
        engine = make()
        step_profile(engine, prompts[0], 5)  # warm-up (allocator, kernels, fla autotune)
        r = step_profile(engine, prompts[1], a.steps)
        lines.append(f"| {name} | {r['wall_ms']:.2f} | {r['gpu_ms']:.2f} | {r['host_ms']:.2f} | "
                     f"{r['tokens_per_step']:.2f} | {r['tok_s']:.1f} |")
        tput[name] = {b: throughput(make(), prompts, b, a.max_tokens) for b in batches}
    lines += ["", "| batch | AR tok/s | DSpark tok/s | ratio |", "|--:|--:|--:|--:|"]
    lines += [f"| {b} | {tput['AR'][b]:.0f} | {tput['DSpark'][b]:.0f} | {tput['DSpark'][b] / tput['AR'][b]:.2f}x |"
              for b in batches]
    table = "\n".join(lines)
    print(table)
    if a.append:
        gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
        head = (f"\n## Engine as-is on {gpu}: step profile and throughput vs batch ({datetime.date.today()})\n\n"
                f"`python3 bench/engine_gpu.py --target {a.target} --drafter {a.drafter}` — torch {torch.__version__}, "
                f"{a.dtype}, eager (no CUDA graphs), greedy, humaneval prompts, {a.max_tokens} tokens per request "
                f"for throughput.\n\n")
        with open(Path(__file__).resolve().parent / "RESULTS.md", "a") as f:
            f.write(head + table + "\n")


if __name__ == "__main__":
    main()
