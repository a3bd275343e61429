"""MLA attention over cached latent rows: the absorbed form (what decode, verify and a draft block run) against the
expanded one (every row through kv_b_proj), timed per call.

    python bench/mla_attention.py [--device cuda] [--dtype bfloat16] [--shape k3-mini|k3] [--batches 1,64,512]
                                  [--lengths 256,1024] [--queries 1,9] [--graph]

One MLAttention layer of the shape (random weights), B rows of L cached latents, T queries each, every key visible (a
bool mask, as the engine's steps pass); the median of --iters calls after --warmup (bench/timing.py: CUDA events on a
GPU; --graph: 20 calls captured in one CUDA graph, as inside the engine's step graphs, without the host's launches).
Also the max |absorbed - expanded| relative to the output's largest value.
"""
from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graph_ms, median_ms  # noqa: E402  (bench/timing.py)

from dspark.device import resolve_device, resolve_dtype  # noqa: E402
from dspark.models.k3.mla import MLAttention  # noqa: E402

# hidden, heads, q_lora, kv_lora, nope, rope, v
SHAPES = {"k3-mini": (768, 6, 384, 256, 128, 64, 128), "k3": (7168, 64, 1536, 512, 128, 64, 128)}


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on a GPU, float32 on CPU")
    ap.add_argument("--shape", default="k3-mini", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,64,512")
    ap.add_argument("--lengths", default="256,1024")
    ap.add_argument("--queries", default="1,9")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--graph", action="store_true", help="GPU time per call inside a CUDA graph")
    a = ap.parse_args()
    device = torch.device(resolve_device(a.device, "--device"))
    dtype = getattr(torch, resolve_dtype(a.dtype, device.type, "--dtype"))
    hidden, heads, q_lora, kv_lora, nope, rope, v = SHAPES[a.shape]
    m = MLAttention(hidden, heads, q_lora, kv_lora, nope, rope, v).to(device, dtype)
    cuda = device.type == "cuda"
    print(f"MLA attention, {a.shape} shape ({heads} heads, kv_lora {kv_lora}, rope {rope}), {device.type}, {dtype}")
    print("| B | L | T | expanded ms | absorbed ms | expanded ÷ absorbed | max diff ÷ max |out| | attend takes |\n"
          "|--:|--:|--:|--:|--:|--:|--:|---|")
    for B in map(int, a.batches.split(",")):
        for L in map(int, a.lengths.split(",")):
            for T in map(int, a.queries.split(",")):
                q = torch.randn(B, heads, T, nope + rope, device=device, dtype=dtype)
                rows = torch.randn(B, L, kv_lora + rope, device=device, dtype=dtype)
                mask = torch.ones(B, 1, T, L, device=device, dtype=torch.bool)
                forms = partial(m._expanded, q, rows, mask, False), partial(m._absorbed, q, rows, mask)
                if a.graph and cuda:
                    ex, ab = (graph_ms(f, iters=a.iters) for f in forms)
                else:
                    ex, ab = (median_ms(f, a.warmup, a.iters, cuda) for f in forms)
                want = m._expanded(q, rows, mask, False).float()
                diff = (m._absorbed(q, rows, mask).float() - want).abs().max() / want.abs().max()
                form = "absorbed" if m.absorbs(B, T, L, cuda) else "expanded"
                print(f"| {B} | {L} | {T} | {ex:.3f} | {ab:.3f} | {ex / ab:.2f}× | {diff:.1e} | {form} |")


if __name__ == "__main__":
    main()
