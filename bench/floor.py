"""Plain autoregressive decoding at bs=1 through `dspark.Engine` against the HBM floor, on random bf16 weights of a
real model shape (nothing to train first).

    python3 bench/floor.py --shape qwen3-8b [--tokens 128] [--hf]     H200
    python3 bench/floor.py --shape k3                                 H200 (13.3B K3-shape hybrid, 64 experts top-4)
    python3 bench/floor.py --shape k3-mini --compile both             H200 (recipes/targets/k3-mini.yaml's shape)
    python3 bench/floor.py --shape qwen3-tiny                         CPU check of the script, no claims

Timed: ms per token of the engine's decode steps (CUDA graphs of the whole step, one host read per step), median of
--runs runs after a warm-up run; --compile on / both: with torch.compile of the step / each way. Floor = bytes one
token must read (every weight but the embedding table, of which one row; for K3 only the top-k of the routed
experts) / the measured device copy bandwidth. --hf also times transformers' `generate` on the same Qwen3 weights.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark import Engine, SamplingParams  # noqa: E402
from dspark.checkpoint_io import checkpoint_state  # noqa: E402
from dspark.models.k3.config import K3TextConfig  # noqa: E402
from dspark.models.k3.model import K3ForCausalLM  # noqa: E402
from dspark.models.qwen3 import Qwen3ForCausalLM, qwen3_config  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                intermediate_size=12288, max_position_embeddings=40960, rope_theta=1e6)
K3_MINI = Path(__file__).resolve().parents[1] / "recipes/targets/k3-mini.yaml"
L = 24
K3 = dict(
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
SHAPES = {"qwen3-8b": ("qwen3", QWEN3_8B),
          "qwen3-tiny": ("qwen3", {**QWEN3_8B, "vocab_size": 512, "hidden_size": 64, "num_layers": 3, "num_heads": 4,
                                   "num_kv_heads": 2, "head_dim": 16, "intermediate_size": 96,
                                   "max_position_embeddings": 512}),
          "k3": ("k3", K3),
          "k3-mini": ("k3", {**yaml.safe_load(K3_MINI.read_text())["model"], "vocab_size": 8192,
                             "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})}


def build(kind: str, shape: dict, device: str, dtype):
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = (Qwen3ForCausalLM(qwen3_config(**shape)) if kind == "qwen3"
                     else K3ForCausalLM(K3TextConfig.from_dict(shape))).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():  # small weights keep a random bf16 stream finite through the layers
        for name, p in model.named_parameters():
            if (p.dim() == 2 or name.endswith(("w13_weight", "w2_weight"))) and "embed" not in name:  # + experts
                p.normal_(0, 0.02)
    return model


def read_bytes(model) -> int:
    """Weight bytes one token reads."""
    c = model.config
    n = 0
    for name, p in model.named_parameters():
        b = p.numel() * p.element_size()
        if name == "model.embed_tokens.weight":
            b = p.shape[1] * p.element_size()
        elif ".experts." in name:
            b = b * c.num_experts_per_token / c.num_experts
        n += b
    return int(n)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """bytes/s of a large device-to-device copy, counting bytes read + written (median of 20)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return 2 * nbytes / (statistics.median(times[3:]) * 1e-3)


def engine_ms_per_token(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Decode ms per token: the engine steps after the prefill step, wall time."""
    req = engine.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    engine.step()  # prefill + first token
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    return 1e3 * (time.perf_counter() - t0) / (tokens - 1), req.output_ids


@torch.no_grad()
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--compile", choices=("on", "off", "both"), default="off",
                    help="torch.compile of the engine's step (on a GPU; both: each way, same weights)")
    ap.add_argument("--hf", action="store_true", help="also transformers' generate (Qwen3 shapes)")
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    kind, shape = SHAPES[a.shape]
    model = build(kind, shape, dev, dtype)
    prompt = torch.randint(3, model.config.vocab_size, (a.prompt_len,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    res = {"shape": a.shape, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "params": sum(p.numel() for p in model.parameters()),
           "command": "python3 bench/floor.py " + " ".join(argv or sys.argv[1:])}
    ways = {"on": [True], "off": [False], "both": [False, True]}[a.compile]
    tokens = {}  # compiled -> the engine's tokens
    for compiled in ways:
        engine = Engine(model, None, max_batch_size=1, max_model_len=a.prompt_len + a.tokens + 1, compile=compiled)
        t0 = time.perf_counter()
        engine_ms_per_token(engine, prompt, min(a.tokens, 16))  # warm-up: compile, graph capture, autotuning
        warm_s = time.perf_counter() - t0
        runs = [engine_ms_per_token(engine, prompt, a.tokens) for _ in range(a.runs)]
        tokens[compiled] = runs[0][1]
        tag = "" if compiled == ways[-1] else "_eager"  # the last way is the headline figure
        res.update({f"engine_ms_per_token{tag}": statistics.median(r[0] for r in runs), f"warmup_s{tag}": warm_s,
                    f"compiled{tag}": engine.runner.compiled})
    if len(ways) == 2:
        res["same_tokens_eager"] = sum(x == y for x, y in zip(tokens[False], tokens[True]))
    ms = res["engine_ms_per_token"]
    if cuda:
        bw, read = copy_bandwidth(), read_bytes(model)
        res.update(copy_bandwidth_tb_s=bw / 1e12, read_gb=read / 1e9, floor_ms=read / bw * 1e3,
                   of_floor=read / bw * 1e3 / ms)
    if a.hf and kind == "qwen3":
        from transformers import Qwen3ForCausalLM as HFQwen3

        hf = HFQwen3(model.config).to(dev, dtype).eval()
        hf.load_state_dict(checkpoint_state(model))
        ids = torch.tensor([prompt], device=dev)
        hf.generate(ids, max_new_tokens=8, do_sample=False)
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False)
        res["hf_generate_ms_per_token"] = 1e3 * (time.perf_counter() - t0) / a.tokens
        res["hf_same_tokens"] = sum(x == y for x, y in zip(out[0, a.prompt_len:].tolist(), tokens[ways[-1]]))
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
