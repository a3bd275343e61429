"""Autoregressive bs=1 decode of a K3-shape hybrid (random bf16 weights) against the HBM floor (the K3 companion of
bench/ar_floor.py).

Usage:  python3 bench/k3_floor.py [--append [FILE]]   H200, about 2 minutes
        python bench/k3_floor.py --tiny               CPU check of this script (tiny fp32 model, no claims)
Shape (K3's layer pattern at 4096 wide): 24 layers, KDA:MLA 3:1 (NoPE MLA at 4, 8, ..., 24), 32 KDA heads of 128,
Attention Residuals in blocks of 6, a dense first layer, then LatentMoE with 64 experts top-4 + 1 shared expert
(latent 2048, expert width 1024), SiTU-GLU, vocab 163840. The static path of dspark/static_spec.py
(StaticGenerator without a drafter): the whole step (forward, greedy argmax, cache commit) in one CUDA graph, with
the kernels the K3 layers dispatch on CUDA (fused KDA decode, AttnRes mix) and again with DSPARK_KERNELS=0 (the torch
modules); eager static steps for scale. Timed: the decode wall time per token of `generate` (one host read per
step), median of 3 runs of --tokens tokens after a warm-up run (graph capture).
Floor = bytes one token must read: every weight except the embedding table (one row) and the routed experts a token
does not use (top-k of num_experts per MoE layer), / the measured copy bandwidth. The KDA recurrent state (read +
written each step, fp32) and the MLA latent cache are reported apart, not in the floor. No "transformers.generate"
line: transformers has no K3 (Kimi Linear) model of its own (the hub's trust_remote_code modeling cannot be fetched
here, and its license keeps it out of this repo).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ar_floor import build_on, copy_bandwidth  # noqa: E402  (bench/ is sys.path[0] for a script)

from dspark.models.k3.config import K3TextConfig  # noqa: E402
from dspark.models.k3.model import K3ForCausalLM  # noqa: E402
from dspark.static_spec import StaticGenerator  # noqa: E402

L = 24
K3_SHAPE = dict(
    vocab_size=163840, hidden_size=4096, intermediate_size=11264, num_hidden_layers=L, num_attention_heads=32,
    rms_norm_eps=1e-5, hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
    max_position_embeddings=4096, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, mla_use_nope=True, mla_use_output_gate=True,
    linear_attn_config={"kda_layers": [i for i in range(1, L + 1) if i % 4], "full_attn_layers": list(range(4, L + 1, 4)),
                        "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                        "use_full_rank_gate": True},
    attn_res_block_size=6, num_experts=64, num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=1024,
    routed_expert_hidden_size=2048, latent_moe_use_norm=True, moe_router_activation_func="sigmoid",
    first_k_dense_replace=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY = {**K3_SHAPE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "attn_res_block_size": 2, "num_experts": 8, "num_experts_per_token": 2,
        "moe_intermediate_size": 32, "routed_expert_hidden_size": 32,
        "linear_attn_config": {**K3_SHAPE["linear_attn_config"], "kda_layers": [1, 2, 3], "full_attn_layers": [4],
                               "num_heads": 2, "head_dim": 16}}


def build(shape: dict, device: str, dtype) -> K3ForCausalLM:
    model = build_on(lambda: K3ForCausalLM(K3TextConfig.from_dict(shape)), device, dtype)
    with torch.no_grad():  # random init: small weights keep the bf16 stream finite over 24 layers
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0, 0.02)
    return model


def floor_bytes(model) -> tuple[int, int, int]:
    """(weight bytes one token reads, KDA state bytes read + written per step, total parameter bytes)."""
    c = model.config
    total = read = 0
    for name, p in model.named_parameters():
        b = p.numel() * p.element_size()
        total += b
        if name == "model.embed_tokens.weight":
            read += p.shape[1] * p.element_size()
        elif ".experts." in name:
            read += b * c.num_experts_per_token / c.num_experts  # the top-k routed experts of num_experts
        else:
            read += b
    _, kda = model.cache_layout()
    state = sum(2 * H * K * V * 4 for H, K, V, _, _ in kda.values())
    return int(read), state, total


def time_generate(gen: StaticGenerator, prompt: list[int], tokens: int, runs: int) -> float:
    """ms per decoded token: median over runs of generate's decode wall time / decoded tokens."""
    gen.generate(prompt, min(tokens, 8))  # warm-up: graph capture, allocator, Triton compiles
    return statistics.median(1e3 * (o.decode_s / (tokens - 1)) for o in (gen.generate(prompt, tokens)
                                                                         for _ in range(runs)))


@torch.no_grad()
def run(args) -> tuple[list[str], list[str]]:
    cuda = not args.tiny
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = build(TINY if args.tiny else K3_SHAPE, dev, dtype)
    read, state, total = floor_bytes(model)
    bw = copy_bandwidth() if cuda else None
    floor_ms = read / bw * 1e3 if cuda else None
    lines = [f"model: K3 shape {'(tiny)' if args.tiny else ''}, {total / 2 / 1e9 if cuda else total / 4 / 1e6:.2f}"
             f"{'B' if cuda else 'M'} params, {str(dtype).replace('torch.', '')}, random"]
    if cuda:
        lines.append(f"copy bandwidth {bw / 1e12:.2f} TB/s; weights read per token {read / 1e9:.3f} GB -> floor "
                     f"{floor_ms:.3f} ms/token ({1e3 / floor_ms:.0f} tok/s); KDA state read + written per step "
                     f"{state / 1e6:.1f} MB (not in the floor; {state / bw * 1e3:.3f} ms at that bandwidth)")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, model.config.vocab_size, (args.prompt_len,), generator=g).tolist()
    max_len = -(-(args.prompt_len + args.tokens + 1) // 64) * 64
    rows = []
    paths = [("eager static steps", False, "1")]
    if cuda:
        paths += [("CUDA graph, torch modules (DSPARK_KERNELS=0)", True, "0"),
                  ("CUDA graph, K3 kernels (fused KDA decode, AttnRes mix)", True, "1")]
    outs = {}
    for name, graphs, kernels in paths:
        os.environ["DSPARK_KERNELS"] = kernels  # read when a step runs / is captured
        gen = StaticGenerator(model, None, max_len=max_len, graphs=graphs)
        rows.append((name, time_generate(gen, prompt, args.tokens, 1 if not graphs else args.runs)))
        outs[name] = gen.generate(prompt, 16).token_ids[0]
        del gen
    os.environ.pop("DSPARK_KERNELS")
    table = ["| path | ms/token | tok/s | of floor |", "|---|--:|--:|--:|"]
    for name, ms in rows:
        table.append(f"| {name} | {ms:.3f} | {1e3 / ms:.1f} | {f'{floor_ms / ms:.1%}' if cuda else '—'} |")
    ref = outs[rows[0][0]]
    lines.append("greedy, first 16 tokens equal to the eager static path: " + "; ".join(
        f"{n} {sum(a == b for a, b in zip(o, ref))}/16" for n, o in outs.items() if n != rows[0][0]))
    return table, lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--append", nargs="?", const="bench/RESULTS.md", default=None, metavar="FILE")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if args.tiny:
        args.tokens = 8
    elif not torch.cuda.is_available():
        sys.exit("k3_floor: needs a CUDA GPU (or --tiny for the CPU check of the script)")
    device = torch.cuda.get_device_name() if not args.tiny else "CPU"
    machine = f"{device}, torch {torch.__version__}, bs=1, prompt {args.prompt_len} tokens, {args.tokens} new tokens"
    print(machine, flush=True)
    table, lines = run(args)
    print("\n".join(table + [""] + lines))
    if args.append and not args.tiny:
        section = [f"\n## AR decode vs the HBM floor, K3 shape ({datetime.date.today().isoformat()})", "",
                   f"`python3 {' '.join(sys.argv)}`", "", f"Machine: {machine}.", "", *table, "",
                   *(f"- {x}" for x in lines)]
        with open(args.append, "a") as f:
            f.write("\n".join(section) + "\n")


if __name__ == "__main__":
    main()
