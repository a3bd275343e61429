"""Convert a trained K3 target's routed experts to MXFP4 and report the holdout-loss change.

    python bench/mxfp4_holdout.py --target runs/k3-tiny/final --recipe recipes/targets/k3-tiny.yaml \
        --out runs/k3-tiny-mxfp4 [--rows 64]

Writes the converted checkpoint (experts as `weight_packed` / `weight_scale`, `quantization_config`
mxfp4-pack-quantized), loads it back with `load_target`, and prints holdout loss (nats/token) before, after, and
after the reload, on the recipe's packed holdout rows.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from dspark.checkpoint import load_target
from dspark.config import load_recipe
from dspark.models.k3.moe import LatentMoE
from dspark.models.k3.mxfp4 import convert_to_mxfp4
from train.data import prepare_tokens
from train.target import holdout_loss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--recipe", required=True, help="the target's training recipe (for its holdout rows)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(2)
    rows = prepare_tokens(load_recipe(a.recipe).data).holdout[: a.rows]
    model = load_target(a.target)
    with torch.no_grad():
        before = holdout_loss(model, rows, 8, "cpu")
        n_experts = sum(m.num_experts for m in model.modules() if isinstance(m, LatentMoE))
        convert_to_mxfp4(model)
        after = holdout_loss(model, rows, 8, "cpu")
        model.save_pretrained(a.out)
        if model.tokenizer is not None:
            model.tokenizer.save_pretrained(a.out)
        reloaded = holdout_loss(load_target(a.out), rows, 8, "cpu")
    result = {"target": a.target, "holdout_rows": len(rows), "tokens": int(rows[:, 1:].numel()),
              "routed_expert_matrices": 3 * n_experts, "loss_fp32": before, "loss_mxfp4": after,
              "loss_mxfp4_reloaded": reloaded, "delta": after - before}
    print("| checkpoint | holdout loss (nats/token) |\n|---|--:|")
    print(f"| {a.target} (fp32 experts) | {before:.4f} |\n| MXFP4 experts | {after:.4f} |\n"
          f"| MXFP4, saved + reloaded | {reloaded:.4f} |")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
