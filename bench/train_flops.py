"""FLOPs of one drafter training step (frozen target forward + drafter forward and backward), counted by
torch.utils.flop_counter on the plain torch path, and the MFU that a measured step rate gives.

    python bench/train_flops.py recipes/k3-mini.yaml --target-recipe recipes/targets/k3-mini.yaml \
        --steps-per-s 6.71 --gpus 1 --steps-per-s 8.33 --gpus 2

Random weights (FLOPs do not depend on them), the recipe's shapes: global batch optim.batch_size x data.seq_len tokens,
anchors_per_seq blocks per row. Counted on a few rows and scaled to the global batch (every term is linear in the rows).
The dense SDPA mask is counted, so the attention term includes the tiles a flex BlockMask skips (an upper bound for
the flex path); the KDA layers are counted through the torch chunked form. MFU = FLOPs/step x steps/s / (GPUs x peak).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark.config import load_recipe  # noqa: E402
from dspark.models.drafter import DSparkDrafter  # noqa: E402
from train.drafter import block_targets, drafter_config, sample_anchors  # noqa: E402
from train.losses import LossWeights, drafter_loss  # noqa: E402
from train.target import build_target  # noqa: E402


def count(drafter_recipe: str, target_recipe: str, rows: int) -> dict:
    from transformers import AutoTokenizer

    dr, tr = load_recipe(drafter_recipe), load_recipe(target_recipe)
    tok = AutoTokenizer.from_pretrained(tr.data.tokenizer_dir)
    torch.manual_seed(0)
    return step_flops(dr, build_target(tr.arch, tr.model, tok), tok, rows)


def step_flops(dr, target, tok, rows: int) -> dict:
    """FLOPs of one step of drafter recipe `dr` on `target` (its tokenizer `tok`), counted on `rows` rows and scaled
    to the global batch -> {target_fwd, drafter_fwd_bwd, tokens, target_params, drafter_params}."""
    target = target.eval().requires_grad_(False)
    cfg = drafter_config(dr, target, tok)
    drafter = DSparkDrafter(cfg, target.model.embed_tokens.weight, target.lm_head.weight)
    T, D = dr.data.seq_len, cfg.num_drafts
    x = torch.randint(10, len(tok), (rows, T))
    anchors = sample_anchors(torch.ones(rows, T, dtype=torch.bool), dr.anchors_per_seq, D, torch.Generator().manual_seed(0))
    w = LossWeights.from_recipe(dr.loss)
    with FlopCounterMode(display=False) as fc_target:
        with torch.no_grad():
            logits, aux = target(x, aux_layer_ids=cfg.target_layer_ids)
    with FlopCounterMode(display=False) as fc_drafter:
        lab, tl = block_targets(logits, x, anchors, D, dr.data.labels, with_logits=w.needs_target_logits)
        loss, *_ = drafter_loss(drafter, drafter(aux, x, anchors), x.gather(1, anchors), lab, tl, w)
        loss.backward()
    scale = dr.optim.batch_size / rows
    return {"target_fwd": fc_target.get_total_flops() * scale, "drafter_fwd_bwd": fc_drafter.get_total_flops() * scale,
            "tokens": dr.optim.batch_size * T, "target_params": sum(p.numel() for p in target.parameters()),
            "drafter_params": sum(p.numel() for p in drafter.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter_recipe")
    ap.add_argument("--target-recipe", required=True)
    ap.add_argument("--rows", type=int, default=2, help="rows counted (scaled to the global batch)")
    ap.add_argument("--steps-per-s", type=float, action="append", default=[])
    ap.add_argument("--gpus", type=int, action="append", default=[])
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU; H200 dense bf16 datasheet")
    a = ap.parse_args()
    c = count(a.drafter_recipe, a.target_recipe, a.rows)
    total = c["target_fwd"] + c["drafter_fwd_bwd"]
    print(f"target {c['target_params'] / 1e6:.1f}M params, drafter {c['drafter_params'] / 1e6:.1f}M trainable; "
          f"{c['tokens']} tokens per step")
    print(f"FLOPs per step: target forward {c['target_fwd'] / 1e12:.2f} T, drafter forward+backward "
          f"{c['drafter_fwd_bwd'] / 1e12:.2f} T, total {total / 1e12:.2f} T ({total / c['tokens'] / 1e6:.1f} MFLOP/token)")
    if a.steps_per_s:
        print(f"\n| GPUs | steps/s | tokens/s | achieved TFLOP/s | MFU (peak {a.peak_tflops:.0f} TFLOP/s per GPU) |")
        print("|--:|--:|--:|--:|--:|")
        for rate, n in zip(a.steps_per_s, a.gpus or [1] * len(a.steps_per_s)):
            tf = total * rate / 1e12
            print(f"| {n} | {rate:.2f} | {rate * c['tokens'] / 1e3:.0f}k | {tf:.1f} | {tf / (n * a.peak_tflops):.1%} |")


if __name__ == "__main__":
    main()
