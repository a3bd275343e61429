"""Drafter training speed of a recipe on a random-initialised target: steps/s, tokens/s and MFU, one row per set of
recipe overrides (e.g. the eager step against compile=true), without training a target or regenerating data first.

    python bench/train_speed.py RECIPE.yaml --target-recipe TARGET.yaml --tokenizer DIR --out DIR [--vocab N]
        [--row 'NAME: key=value ...' ...] [--set key=value ...] [--steps 80] [--skip 20] [--sequences 1024]
        [--peak-tflops F] [--flops-only]

A step's time does not depend on the weights or the text, so the target is TARGET.yaml's architecture with random
weights (seed 0), the tokenizer of DIR (it needs a mask token) and an embedding of --vocab rows (default: the
tokenizer's size; e.g. 8192 for the mini recipes with the quickstart's 4096-token tokenizer), and the sequences are
random token ids of the recipe's data.seq_len, every position a loss position after the first. Each row runs
`python -m train RECIPE` on them (resume=true reads the sequences back: no regeneration) for --steps steps with no
holdout evaluation until the end. Reported per row: steps/s and tokens/s (rows x sequence length the target reads per
step) over the steps after --skip (compile and warm-up), the FLOPs of a step (bench/train_flops.py: the frozen
target's forward and the drafter's forward and backward, the dense mask counted) and MFU = FLOPs x steps/s / peak
(--peak-tflops; on an H100 or H200 989 dense bf16 TFLOP/s unless given; none on the CPU).
Writes <out>/speed.json and <out>/speed.md (runs under <out>/rows/NAME).
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ablate_drafter import parse_rows, run_logged, step_rate  # noqa: E402  (bench/ablate_drafter.py)
from train_flops import step_flops  # noqa: E402  (bench/train_flops.py)

from dspark.config import load_recipe  # noqa: E402
from dspark.models.k3.model import K3ForCausalLM  # noqa: E402
from dspark.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from train.target import target_config  # noqa: E402

DEFAULT_ROWS = {"eager": ["compile=false"], "compiled": ["compile=true"]}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, datasheet


def random_target(target_recipe: str, tokenizer_dir: str, vocab: int | None, out: Path):
    """TARGET recipe's model with random weights, saved with the tokenizer in `out` -> (model, tokenizer)."""
    tr = load_recipe(target_recipe)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if tok.mask_token is None:
        raise ValueError(f"--tokenizer {tokenizer_dir}: no mask token (a drafter needs one)")
    special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    cfg = target_config(tr.arch, tr.model, vocab or len(tok), special)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg) if tr.arch == "qwen3" else K3ForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(str(out))
    return model, tok


def random_sequences(recipe, n: int, low: int, high: int) -> dict:
    """Random token rows of the recipe's sequence length, every position after the first a loss position."""
    g = torch.Generator().manual_seed(0)
    T = recipe.data.seq_len
    seqs = {}
    for split, rows in (("train", n), ("holdout", recipe.data.holdout_sequences)):
        seqs[split] = torch.randint(low, high, (rows, T), generator=g)
        mask = torch.ones(rows, T, dtype=torch.bool)
        mask[:, 0] = False
        seqs[f"{split}_mask"] = mask
    return seqs


def peak_tflops(given: float | None) -> float | None:
    if given is not None or not torch.cuda.is_available():
        return given
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--target-recipe", required=True)
    ap.add_argument("--tokenizer", required=True, help="a dir with a tokenizer that has a mask token")
    ap.add_argument("--vocab", type=int, help="the target's vocabulary rows (default: the tokenizer's size)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--row", action="append", default=[], help="'NAME: key=value ...' (default: eager, compiled)")
    ap.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                    help="overrides for every row (e.g. log.profile_steps=3: rows/NAME/profile.txt)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--skip", type=int, default=20, help="steps left out of the rate (compile, warm-up)")
    ap.add_argument("--sequences", type=int, default=1024, help="random train rows")
    ap.add_argument("--peak-tflops", type=float, help="per device (default: 989 on an H100 / H200)")
    ap.add_argument("--train-cmd", default=f"{sys.executable} -m train")
    ap.add_argument("--flops-only", action="store_true", help="count a step's FLOPs, train no row")
    a = ap.parse_args(argv)
    rows = parse_rows(a.row, default=DEFAULT_ROWS)
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    recipe = load_recipe(a.recipe, a.set)
    target, tok = random_target(a.target_recipe, a.tokenizer, a.vocab, out / "target")
    seqs = random_sequences(recipe, a.sequences, 10, len(tok))
    torch.save(seqs, out / "sequences.pt")
    flops = step_flops(recipe, target, tok, rows=2)
    del target
    total = flops["target_fwd"] + flops["drafter_fwd_bwd"]
    peak = peak_tflops(a.peak_tflops)
    print(f"FLOPs per step: target forward {flops['target_fwd'] / 1e12:.3f} T, drafter forward and backward "
          f"{flops['drafter_fwd_bwd'] / 1e12:.3f} T, {flops['tokens']} tokens")
    if a.flops_only:
        return 0
    results = {"recipe": a.recipe, "target_recipe": a.target_recipe, "vocab": a.vocab or len(tok), "set": a.set,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "flops_per_step": total, **flops, "peak_tflops": peak, "rows": {}}
    for name, overrides in rows.items():
        run = out / "rows" / name
        run.mkdir(parents=True)
        shutil.copy(out / "sequences.pt", run / "sequences.pt")
        cmd = [*shlex.split(a.train_cmd), a.recipe, f"target={out / 'target'}", *a.set, *overrides,
               f"output_dir={run}", "resume=true", f"max_steps={a.steps}", "max_minutes=null",
               f"log.eval_every={a.steps}", f"log.save_every={a.steps}", "log.wandb_mode=disabled", "log.keep_best="]
        print(f"[speed] {name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        error = run_logged(cmd, f"{run}.log")
        if error is not None:
            results["rows"][name] = {"overrides": overrides, "error": error}
            continue
        timed = step_rate(run, a.skip)
        if timed is None:
            raise ValueError(f"{run}: no two logged steps from step {a.skip} on; --steps must exceed --skip + 1")
        steps, rate = timed
        tflops = total * rate / 1e12
        results["rows"][name] = {"overrides": overrides, "steps_timed": steps, "steps_per_s": rate,
                                 "tokens_per_s": rate * flops["tokens"], "tflops": tflops,
                                 "mfu": tflops / peak if peak else None}
    (out / "speed.json").write_text(json.dumps(results, indent=1) + "\n")
    md = [f"{a.recipe} on a random {a.target_recipe} target ({results['device']}): {total / 1e12:.3f} TFLOP and "
          f"{flops['tokens']} tokens per step", "",
          "| row | overrides | steps/s | tokens/s | TFLOP/s | MFU |", "|---|---|--:|--:|--:|--:|"]
    for name, r in results["rows"].items():
        if "error" in r:
            md.append(f"| {name} | {' '.join(r['overrides'])} | {r['error']} | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "–"
        md.append(f"| {name} | {' '.join(r['overrides'])} | {r['steps_per_s']:.2f} | {r['tokens_per_s']:,.0f} | "
                  f"{r['tflops']:.2f} | {mfu} |")
    (out / "speed.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 1 if any("error" in r for r in results["rows"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
