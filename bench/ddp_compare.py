"""Data-parallel drafter training vs one GPU with the same global batch: loss curves side by side and throughput.

    python3 bench/ddp_compare.py RUN_1GPU RUN_NGPU [--every 50] [--skip 20]

Reads each run's train_log.jsonl (one line per step: the global-batch loss averaged over processes, seconds since
the start of training) and final_metrics.json; prints a Markdown table of the loss at every `--every` steps, the
largest and mean relative difference over the common steps, and steps/s after `--skip` warm-up steps (compile)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(run: Path) -> tuple[dict[int, dict], dict]:
    log = {}
    for line in (run / "train_log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        log[rec["step"]] = rec
    metrics = json.loads((run / "final_metrics.json").read_text()) if (run / "final_metrics.json").is_file() else {}
    return log, metrics


def steps_per_s(log: dict[int, dict], skip: int) -> float:
    steps = sorted(s for s in log if s > skip)
    if len(steps) < 2:
        return float("nan")
    return (steps[-1] - steps[0]) / (log[steps[-1]]["seconds"] - log[steps[0]]["seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("one", type=Path)
    ap.add_argument("many", type=Path)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--skip", type=int, default=20)
    a = ap.parse_args()
    (l1, m1), (ln, mn) = load(a.one), load(a.many)
    common = sorted(set(l1) & set(ln))
    if not common:
        raise SystemExit("no common steps between the two runs")
    rel = [abs(l1[s]["loss"] - ln[s]["loss"]) / abs(l1[s]["loss"]) for s in common]
    n = mn.get("num_processes", "N")
    print(f"| step | loss, 1 GPU | loss, {n} GPUs | rel. diff |\n|--:|--:|--:|--:|")
    for s in [s for s in common if s % a.every == 0 or s == 1 or s == common[-1]]:
        print(f"| {s} | {l1[s]['loss']:.4f} | {ln[s]['loss']:.4f} | {abs(l1[s]['loss'] - ln[s]['loss']) / abs(l1[s]['loss']):.2%} |")
    early = rel[: min(10, len(rel))]
    print(f"\ncommon steps 1..{common[-1]}: relative loss difference max {max(rel):.2%}, mean {sum(rel) / len(rel):.2%} "
          f"(first 10 steps: max {max(early):.2%})")
    r1, rn = steps_per_s(l1, a.skip), steps_per_s(ln, a.skip)
    print(f"steps/s after step {a.skip}: 1 GPU {r1:.2f}, {n} GPUs {rn:.2f} -> speedup {rn / r1:.2f}x "
          f"(scaling efficiency {rn / r1 / (n if isinstance(n, int) else 1):.0%})")
    for name, m in (("1 GPU", m1), (f"{n} GPUs", mn)):
        if m:
            fin = m.get("final", {})
            print(f"{name}: {m.get('steps')} steps in {m.get('train_minutes', 0):.2f} min, block_mask "
                  f"{m.get('block_mask')}, final holdout " + " ".join(f"{k}={v:.4f}" for k, v in fin.items()
                                                                    if isinstance(v, float)))


if __name__ == "__main__":
    main()
