"""A target + drafter pair on the static, graph-safe decode path (dspark/static_spec.py): AR vs DSpark at bs=1, greedy.

    python3 bench/pair_decode.py --target runs/k3-mini/final --drafter runs/k3-mini-drafter-2gpu/final \
        [--tasks humaneval,creative] [--prompts 8] [--max-tokens 128] [--append bench/RESULTS.md]
    python3 bench/pair_decode.py --target DIR --drafter DIR --device cpu --prompts 2 --max-tokens 16   # CPU check

Per task (humaneval = code, creative = prose; prompts from eval.tasks, the last --prompt-tokens tokens, raw text
or the chat template with --chat): N prompts one at a time, max_tokens each (no EOS stop), with a StaticGenerator
per mode (CUDA graphs of the whole step on CUDA unless --no-graphs; captured in a warm-up call, not timed).
Reports decode AR tok/s, DSpark tok/s (tokens after the prefill's first one / wall time of the decode steps), speedup,
tau = mean (accepted + 1) per verify, wall ms per step, the prefill (eager, one forward) apart, and greedy
agreement of the static DSpark tokens with the eager engine's (dspark.Engine) on the first --agree prompts, as the
matched prefix (tokens equal up to the first difference; bf16 rounding may split late near-ties).
On CPU (fp32, no graphs) it is a correctness check of the script, not a benchmark.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import shlex
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark import Engine, SamplingParams, load_drafter, load_target  # noqa: E402
from dspark.models.k3.moe import set_static_moe  # noqa: E402
from dspark.static_decode import _round_up  # noqa: E402
from dspark.static_spec import StaticGenerator  # noqa: E402
from eval.__main__ import encode as encode_task  # noqa: E402
from eval.tasks import build_task, select  # noqa: E402

KINDS = {"humaneval": "code", "creative": "prose"}


def encode(task, tok, n: int, prompt_tokens: int, chat: bool) -> list[list[int]]:
    """n prompts of the task, evenly spread, encoded the way `python -m eval` does."""
    return encode_task(dataclasses.replace(task, prompts=select(task.prompts, n)), tok, chat, prompt_tokens)


def timed(gen: StaticGenerator, prompts: list[list[int]], max_tokens: int) -> dict:
    """Generate each prompt; decode tok/s and ms/step count the decode steps only (the tokens after the prefill's
    first one, timed from the end of the prefill to the last step's host read), the prefill is reported apart."""
    secs, pre, toks, steps, acc, outs, hist = 0.0, 0.0, 0, 0, 0, [], Counter()
    for p in prompts:
        out = gen.generate(p, max_tokens)
        secs += out.decode_s
        pre += out.prefill_s
        toks += len(out.token_ids[0]) - 1
        steps += out.num_steps
        acc += sum(out.accepted_per_step[0]) if out.accepted_per_step else 0
        hist.update(out.accepted_per_step[0] if out.accepted_per_step else [])
        outs.append(out.token_ids[0])
    return {"tok_s": toks / secs, "ms_step": 1e3 * secs / max(steps, 1), "tau": (acc + steps) / max(steps, 1),
            "prefill_ms": 1e3 * pre / len(prompts), "outs": outs, "hist": hist}


def prefix_match(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def make_generators(target, drafter, a, graphs: bool) -> dict:
    """One bs=1 generator per mode, shared by the tasks (so each is captured / compiled once)."""
    k = a.k or drafter.config.num_drafts
    max_len = _round_up(a.prompt_tokens + a.max_tokens + k + 1, 64)
    return {"AR": StaticGenerator(target, None, max_len=max_len, graphs=graphs, compile=a.compile),
            "DSpark": StaticGenerator(target, drafter, k, max_len=max_len, graphs=graphs, compile=a.compile)}


@torch.no_grad()
def kernel_profile(gens: dict, prompt: list[int], steps: int = 3, top: int = 30) -> str:
    """GPU kernels of one decode step per mode (the step as captured, run un-graphed under torch.profiler after a
    short generate): launches and kernel time per step, and the top kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    lines = []
    for mode, gen in gens.items():
        gen.generate(prompt, 8)
        set_static_moe(gen.target, gen.moe_tokens)
        try:
            gen.run()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    gen.run()
                torch.cuda.synchronize()
        finally:
            set_static_moe(gen.target, 0)
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.device_time for e in evs) / steps
        by = {}
        for e in evs:
            n, t = by.get(e.name, (0, 0.0))
            by[e.name] = (n + 1, t + e.device_time)
        lines += [f"\n{mode}: {len(evs) / steps:.0f} kernels per step, {total / 1e3:.3f} ms of kernel time per step",
                  "", "| kernel | per step | µs per step |", "|---|--:|--:|"]
        for name, (n, t) in sorted(by.items(), key=lambda x: -x[1][1])[:top]:
            lines.append(f"| `{name[:90]}` | {n / steps:.0f} | {t / steps:.1f} |")
    return "\n".join(lines)


def run_task(name, prompts, gens, drafter, a) -> dict:
    k = a.k or drafter.config.num_drafts
    res = {}
    for mode, gen in gens.items():
        gen.generate(prompts[0], min(a.max_tokens, 8))  # warm-up: graph capture, allocator, kernel autotune
        res[mode] = timed(gen, prompts, a.max_tokens)
    agree = []
    engine = Engine(gens["AR"].target, drafter, num_speculative_tokens=k)
    for p, static in zip(prompts[: a.agree], res["DSpark"]["outs"]):
        ref = engine.generate([p], SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True))[0]
        agree.append(prefix_match(ref.token_ids, static))
    lossless = sum(x == y for x, y in zip(res["AR"]["outs"], res["DSpark"]["outs"]))
    return {"task": f"{name} ({KINDS.get(name, name)})", "n": len(prompts), "ar": res["AR"], "ds": res["DSpark"],
            "agree": agree, "lossless": lossless, "k": k}


def table(rows: list[dict], max_tokens: int) -> str:
    lines = ["| task | prompts | k | AR tok/s | DSpark tok/s | speedup | τ | AR ms/step | DSpark ms/step | "
             "prefill ms | static DSpark == static AR | engine agreement (matched prefix) |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in rows:
        ar, ds = r["ar"], r["ds"]
        agree = ", ".join(f"{m}/{max_tokens}" for m in r["agree"]) or "-"
        lines.append(f"| {r['task']} | {r['n']} | {r['k']} | {ar['tok_s']:.1f} | {ds['tok_s']:.1f} | "
                     f"{ds['tok_s'] / ar['tok_s']:.2f}x | {ds['tau']:.2f} | {ar['ms_step']:.2f} | {ds['ms_step']:.2f} | "
                     f"{ar['prefill_ms']:.1f} | {r['lossless']}/{r['n']} | {agree} |")
    lines += ["", "Accepted drafts per DSpark step (share of steps, 0..k):", "",
              "| task | " + " | ".join(str(i) for i in range(rows[0]["k"] + 1)) + " |",
              "|---|" + "--:|" * (rows[0]["k"] + 1)]
    for r in rows:
        h = r["ds"]["hist"]
        n = max(sum(h.values()), 1)
        lines.append(f"| {r['task']} | " + " | ".join(f"{h.get(i, 0) / n:.0%}" for i in range(r["k"] + 1)) + " |")
    return "\n".join(lines)


def throughput(prompts, target, drafter, k: int, batches: list[int], max_tokens: int, graphs: bool,
               compile: bool = False) -> str:
    """B equal-length prompts (the task's prompts cut to the shortest, repeated) decoded together: generated tokens
    after the prefill / decode wall time, AR and DSpark, per batch size."""
    P = min(len(p) for p in prompts)
    lines = ["| batch | AR tok/s | DSpark tok/s | DSpark / AR | DSpark τ |", "|--:|--:|--:|--:|--:|"]
    for B in batches:
        ids = [prompts[i % len(prompts)][-P:] for i in range(B)]
        res = {}
        for mode, d in (("AR", None), ("DSpark", drafter)):
            gen = StaticGenerator(target, d, k if d is not None else None, max_len=_round_up(P + max_tokens + k + 1, 64),
                                  batch_size=B, graphs=graphs, compile=compile)
            gen.generate(ids, min(max_tokens, 8))  # warm-up / capture
            out = gen.generate(ids, max_tokens)
            acc = [a for row in out.accepted_per_step for a in row]
            res[mode] = (sum(len(t) - 1 for t in out.token_ids) / out.decode_s,
                         1 + sum(acc) / len(acc) if acc else 1.0)
        (ar, _), (ds, tau) = res["AR"], res["DSpark"]
        lines.append(f"| {B} | {ar:.0f} | {ds:.0f} | {ds / ar:.2f}x | {tau:.2f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def versions() -> str:
    parts = [f"torch {torch.__version__}", f"python {platform.python_version()}"]
    for mod in ("triton", "fla"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001 - optional
            parts.append(f"{mod} -")
    return ", ".join(parts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--tasks", default="humaneval,creative")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per task (evenly spread over the task)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=256, help="keep the last N prompt tokens")
    ap.add_argument("--k", type=int, default=0, help="drafts per step (default: the drafter's num_drafts)")
    ap.add_argument("--agree", type=int, default=2, help="prompts checked against the eager engine")
    ap.add_argument("--chat", action="store_true", help="chat template for chat tasks (creative)")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--dtype", default="bfloat16", help="on CUDA (CPU always runs float32)")
    ap.add_argument("--no-graphs", action="store_true", help="eager static steps on CUDA too")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode steps (StaticGenerator)")
    ap.add_argument("--compile-batches", action="store_true", help="also for the throughput-vs-batch rows")
    ap.add_argument("--profile", action="store_true", help="GPU kernels per step (torch.profiler), per mode")
    ap.add_argument("--batches", default="", help="also throughput vs batch size, e.g. 1,4,16,64 (first task)")
    ap.add_argument("--append", metavar="FILE", help="append a dated section (command, GPU, versions, table)")
    a = ap.parse_args(argv)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    dtype = getattr(torch, a.dtype) if dev.type == "cuda" else torch.float32
    graphs = dev.type == "cuda" and not a.no_graphs
    target = load_target(a.target, device=dev, dtype=dtype)
    drafter = load_drafter(a.drafter, target)
    tok = target.tokenizer
    if tok is None:
        raise SystemExit(f"--target {a.target}: no tokenizer files in the target dir")
    rows, gens = [], make_generators(target, drafter, a, graphs)
    for name in a.tasks.split(","):
        prompts = encode(build_task(name), tok, a.prompts, a.prompt_tokens, a.chat)
        rows.append(run_task(name, prompts, gens, drafter, a))
        print(table(rows[-1:], a.max_tokens), flush=True)  # each task as it ends (a timeout keeps what is done)
    out = table(rows, a.max_tokens)
    if a.profile and dev.type == "cuda":
        out += "\n" + kernel_profile(gens, prompts[0])
        print(out[out.index("\nAR: "):], flush=True)
    if a.batches:
        first = encode(build_task(a.tasks.split(",")[0]), tok, max(a.prompts, 8), a.prompt_tokens, a.chat)
        k = a.k or drafter.config.num_drafts
        out += (f"\n\nThroughput vs batch ({a.tasks.split(',')[0]} prompts cut to one length, {a.max_tokens} tokens "
                f"per row):\n\n" + throughput(first, target, drafter, k, [int(b) for b in a.batches.split(",")],
                                                 a.max_tokens, graphs, a.compile and a.compile_batches))
    print(out)
    if a.append:
        gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
        cmd = "python3 bench/pair_decode.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
        head = (f"\n## Static decode path, AR vs DSpark at bs=1 on {gpu} ({datetime.date.today()})\n\n"
                f"`{cmd}` — {versions()}; {str(dtype).replace('torch.', '')}, "
                f"{'CUDA graphs' if graphs else 'no CUDA graphs'}{', torch.compile' if a.compile else ''}, greedy, {a.max_tokens} tokens per prompt, "
                f"prompts cut to the last {a.prompt_tokens} tokens.\n\n")
        with open(a.append, "a") as f:
            f.write(head + out + "\n")


if __name__ == "__main__":
    main()
