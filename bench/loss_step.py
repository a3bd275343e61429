"""Time of the drafter loss (train.losses.drafter_loss: the LM head, the Markov head, every term over the vocabulary,
the confidence head) forward and backward, at a recipe's sizes.

    python bench/loss_step.py recipes/quickstart.yaml --vocab 4096 --hidden 256 [--device cuda --dtype bfloat16]
        [--rows N] [--iters 12]

Rows (optim.batch_size unless --rows), anchors per row (anchors_per_seq), drafts per block (drafter.block_size, less
the anchor in dflash mode), the Markov rank and the loss weights come from the recipe; the vocabulary and the hidden
size are the target's (--vocab, --hidden); the draft layers, which the loss does not run, are minimal. Random weights,
hidden states and target logits. Reported: the median over
--iters calls after two warm-up calls, and on CUDA the peak memory of one call.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark.config import load_recipe  # noqa: E402
from dspark.models.drafter import DrafterConfig, DSparkDrafter  # noqa: E402
from train.losses import LossWeights, drafter_loss  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("recipe")
    p.add_argument("--vocab", type=int, required=True, help="the target's vocabulary size")
    p.add_argument("--hidden", type=int, required=True, help="the target's hidden size")
    p.add_argument("--rows", type=int, default=None, help="default: the recipe's optim.batch_size")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    r = load_recipe(a.recipe)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    d = r.drafter
    cfg = DrafterConfig(vocab_size=a.vocab, hidden_size=a.hidden, target_hidden_size=a.hidden, target_layer_ids=[0, 1],
                        num_target_layers=2, mask_token_id=1, block_size=d.block_size, mode=d.mode,
                        num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=16,
                        intermediate_size=16,  # the draft layers: the loss does not run them
                        markov_rank=d.markov_rank if d.mode == "dspark" else 0,
                        enable_confidence_head=d.enable_confidence_head)
    emb, head = torch.randn(a.vocab, a.hidden) * 0.02, torch.randn(a.vocab, a.hidden) * 0.02
    drafter = DSparkDrafter(cfg, emb, head).to(dev, dtype)
    B, A, D = a.rows or r.optim.batch_size, r.anchors_per_seq, cfg.num_drafts
    h0 = torch.randn(B, A, D, a.hidden, device=dev, dtype=dtype)
    anchors = torch.randint(2, a.vocab, (B, A), device=dev)
    target_logits = torch.randn(B, A, D, a.vocab, device=dev, dtype=dtype) * 3
    labels = target_logits.argmax(-1)
    w = LossWeights.from_recipe(r.loss)
    cuda = dev.type == "cuda"
    times = []
    for _ in range(a.iters + 2):
        h = h0.clone().requires_grad_(True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype, enabled=dtype != torch.float32):
            loss = drafter_loss(drafter, h, anchors, labels, target_logits, w)[0]
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if cuda else ""
    print(f"{a.recipe}: {B} rows x {A} blocks x {D} drafts, vocab {a.vocab}: loss forward + backward "
          f"{statistics.median(times[2:]) * 1e3:.1f} ms (median of {a.iters}){peak}, loss {loss.item():.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
