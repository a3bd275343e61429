"""Autoregressive bs=1 decode of a dense Qwen3-8B-shape model against the HBM floor (issue 8, "AR efficiency").

Usage:  python3 bench/ar_floor.py [--append [FILE]]   H200, about 1-2 minutes; --append adds a dated section to
                                                      bench/RESULTS.md (or FILE, e.g. $OUT/ar_floor.md)
        python bench/ar_floor.py --tiny               CPU check of this script: tiny fp32 model, no graphs, no
                                                      bandwidth claims
Random bf16 weights (normal, std 0.02, initialised on the device). Floor = bytes read per decode step (every
linear weight + lm_head + norms + one embedding row) / the measured device copy bandwidth (a 2 GiB D2D copy, bytes
read + written). Our paths (dspark.static_decode, static cache of max_len keys): eager, eager with fused
projections, one CUDA graph per step, CUDA graph with fused [q|k|v] / [gate|up] (cuBLAS), the same with
torch.compile'd glue, and CUDA graph with the fused decode kernels (five launches per layer: dspark.kernels.decode_gemv
and decode_attention, tiles autotuned on first use); per-step median CUDA-event times
after warm-up (greedy argmax and the length update included). Verify forwards of T=9 / T=17 tokens vs T=1 (graph,
fused). HF `transformers.Qwen3ForCausalLM` with the same weights through `generate(do_sample=False)` (its default
cache and attention), timed end to end (a 32-token prefill included). Greedy checks: the first 32 tokens of each path
vs our eager path (bf16 near-ties can flip a token between kernels that round differently: counts are reported).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import median_ms  # noqa: E402  (bench/timing.py; bench/ is sys.path[0] for a script)

from dspark.models.qwen3 import Qwen3ForCausalLM, qwen3_config  # noqa: E402
from dspark.static_decode import (  # noqa: E402
    GraphDecoder,
    StaticBatch,
    StaticCache,
    forward_static,
    fuse_projections,
    generate_greedy,
)

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                intermediate_size=12288, max_position_embeddings=40960, rope_theta=1e6)
TINY = dict(vocab_size=512, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
            intermediate_size=96, max_position_embeddings=512)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """bytes/s of a large device-to-device copy, counting bytes read + written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = median_ms(partial(dst.copy_, src), 3, 20, cuda=True)
    return 2 * nbytes / (ms * 1e-3)  # the buffers are freed on return


def bytes_per_decode_step(model) -> int:
    """Weights one bs=1 decode step reads: all parameters but the embedding table, plus one embedding row."""
    emb = model.model.embed_tokens.weight
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "model.embed_tokens.weight")
    return rest + emb.shape[1] * emb.element_size()


def build_on(factory, device: str, dtype):
    """factory() (a model constructor) run with seed 0, `dtype` as the default dtype, directly on `device`."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return factory().eval()
    finally:
        torch.set_default_dtype(default)


def build_model(shape: dict, device: str, dtype) -> Qwen3ForCausalLM:
    return build_on(lambda: Qwen3ForCausalLM(qwen3_config(**shape)), device, dtype)


def build_hf(model):
    """transformers' Qwen3ForCausalLM from the same config, loaded with our state_dict (names are 1:1)."""
    from transformers import Qwen3ForCausalLM as HFQwen3

    p = next(model.parameters())
    default = torch.get_default_dtype()
    torch.set_default_dtype(p.dtype)
    try:
        with torch.device(p.device):
            hf = HFQwen3(copy.deepcopy(model.config)).eval()
    finally:
        torch.set_default_dtype(default)
    hf.load_state_dict(model.state_dict())
    return hf


def agreement(tokens: list[int], ref: list[int]) -> str:
    same = sum(a == b for a, b in zip(tokens, ref))
    first = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)
    return f"{same}/{len(ref)}" + ("" if first is None else f" (first differs at token {first})")


@torch.no_grad()
def run(args) -> tuple[list[str], list[str]]:
    cuda = not args.tiny
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape = TINY if args.tiny else QWEN3_8B
    P, max_len, n_check = args.prompt_len, args.max_len, args.check_tokens
    warm, iters = (5, args.steps) if cuda else (2, 5)
    lines = []
    bw = copy_bandwidth() if cuda else None
    if cuda:
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    model = build_model(shape, dev, dtype)
    fused = fuse_projections(model, kernels=False)  # cuBLAS matmuls + torch glue
    kern = copy.copy(fused)  # the same fused weights; bs=1 one-token steps through the decode kernels
    kern.kernels = True
    if cuda:
        torch.cuda.synchronize()
    n_params = sum(p.numel() for p in model.parameters())
    lines.append(f"model: Qwen3 {'tiny' if args.tiny else '8B'} shape, {n_params / 1e6:.1f}M params, "
                 f"{str(dtype).replace('torch.', '')}, random (built + fused in {time.perf_counter() - t0:.1f} s)")
    wbytes = bytes_per_decode_step(model)
    c = model.config
    kv_bytes = c.num_hidden_layers * max_len * 2 * c.num_key_value_heads * c.head_dim * torch.finfo(dtype).bits // 8
    floor_ms = wbytes / bw * 1e3 if cuda else None
    if cuda:
        lines.append(f"copy bandwidth {bw / 1e12:.2f} TB/s (2 GiB D2D copy, read + written); weights read per token "
                     f"{wbytes / 1e9:.3f} GB -> floor {floor_ms:.3f} ms/token ({1e3 / floor_ms:.0f} tok/s); "
                     f"KV read per step at max_len {max_len}: {kv_bytes / 1e9:.3f} GB (not in the floor)")

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, c.vocab_size, (1, P), generator=g).to(dev)
    cache = StaticCache(model, 1, max_len)
    prefill = StaticBatch(cache, 1, P)
    tok = forward_static(model, prompt, prefill)[:, -1:].argmax(-1)
    prefill.commit()

    def timed(step, T=1, advance=True):  # every block restarts at the prompt's length (same work per step)
        cache.reset(P)
        if advance and P + (warm + iters) * T > max_len:
            raise ValueError(f"max_len: {max_len} too small for {warm + iters} steps of {T} after {P}")
        return median_ms(step, warm, iters, cuda)

    def eager(fwd, T=1):
        b = StaticBatch(cache, 1, T)
        ids = tok.expand(1, T).contiguous()

        def step():
            forward_static(fwd, ids, b).argmax(-1)
            if T == 1:
                b.commit()
        return step

    rows = []  # (path, ms per token or None, note)
    rows.append(("eager (model.forward, static cache)", timed(eager(model)), ""))
    rows.append(("eager, fused projections", timed(eager(fused)), ""))
    verify = {}
    if cuda:
        graph = GraphDecoder(model, cache)
        rows.append(("CUDA graph", timed(lambda: graph.step(tok)), ""))
        graph_fused = GraphDecoder(fused, cache)
        rows.append(("CUDA graph, fused projections (cuBLAS)", timed(lambda: graph_fused.step(tok)), ""))
        for T in (1, 9, 17):
            ids = torch.randint(0, c.vocab_size, (1, T), generator=g).to(dev)
            verify[T] = timed(lambda ids=ids: graph_fused.step(ids, advance=False), T, advance=False)
        del graph, graph_fused
    else:
        for T in (1, 9, 17):
            verify[T] = timed(eager(fused, T), T, advance=False)
    compiled, compiled_name = None, ("CUDA graph" if cuda else "eager") + ", fused, torch.compile'd layer glue"
    if args.compile:
        try:
            t0 = time.perf_counter()
            compiled = fuse_projections(model, compile=True, kernels=False)
            step = GraphDecoder(compiled, cache).step if cuda else None
            ms = timed((lambda: step(tok)) if cuda else eager(compiled))
            rows.append((compiled_name, ms, f"compiled and timed in {time.perf_counter() - t0:.0f} s"))
        except Exception as e:  # an optional row: report why, keep the rest of the run
            compiled = None
            rows.append((compiled_name, None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"))
    kern_name = ("CUDA graph" if cuda else "eager") + ", fused decode kernels"
    if cuda:
        t0 = time.perf_counter()
        graph_kern = GraphDecoder(kern, cache)
        graph_kern.capture(1, 1)  # autotunes the matvec tiles (first use), then captures
        tuned = time.perf_counter() - t0
        rows.append((kern_name, timed(lambda: graph_kern.step(tok)), f"tiles autotuned + captured in {tuned:.0f} s"))
        del graph_kern
    # one step from the same state: the kernel path's logits vs the eager module path (bf16 rounding differs)
    first = {}
    for name, fwd in (("eager", model), ("kernels", kern)):
        cache.reset(P)
        first[name] = forward_static(fwd, tok, StaticBatch(cache, 1, 1))[0, 0].float()
    logit_diff = (first["kernels"] - first["eager"]).abs().max().item() / first["eager"].abs().max().item()

    # greedy: first n_check tokens of every path vs our eager path, and HF generate
    greedy = lambda **kw: generate_greedy(model, prompt, n_check, max_len=max_len, **kw)[0].tolist()
    ref = greedy(graphs=False)
    checks = [("eager, fused projections", greedy(graphs=False, fused=fused))]
    if cuda:
        checks += [("CUDA graph", greedy(graphs=True)), ("CUDA graph, fused projections", greedy(graphs=True, fused=fused))]
    checks.append((kern_name, greedy(graphs=cuda, fused=kern)))
    if compiled is not None:
        checks.append((compiled_name, greedy(graphs=cuda, fused=compiled)))
    checks = [(name, agreement(out, ref)) for name, out in checks]
    del fused, compiled, kern
    hf = build_hf(model)
    kw = dict(attention_mask=torch.ones_like(prompt), do_sample=False, pad_token_id=0)
    hf.generate(prompt, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    hf_out = hf.generate(prompt, max_new_tokens=args.hf_tokens, min_new_tokens=args.hf_tokens, **kw)
    if cuda:
        torch.cuda.synchronize()
    hf_ms = (time.perf_counter() - t0) * 1e3 / args.hf_tokens
    rows.append(("HF transformers generate", hf_ms, f"{args.hf_tokens} tokens end to end"))
    checks.append(("HF transformers generate", agreement(hf_out[0, P:P + n_check].tolist(), ref)))

    table = ["| path | ms/token | tok/s | of floor |", "|---|--:|--:|--:|"]
    for name, ms, note in rows:
        if ms is None:
            table.append(f"| {name} ({note}) | — | — | — |")
            continue
        frac = f"{floor_ms / ms:.1%}" if cuda else "—"
        table.append(f"| {name}{f' ({note})' if note else ''} | {ms:.3f} | {1e3 / ms:.1f} | {frac} |")
    vname = "graph, fused, cuBLAS" if cuda else "eager, fused"
    kern_ms = next((ms for name, ms, _ in rows if name == kern_name and ms), None)
    lines.append(f"verify forward ({vname}): " + ", ".join(
        f"T={T} {ms:.3f} ms ({ms / verify[1]:.2f}x T=1" + (f", {ms / kern_ms:.2f}x the kernel step)" if kern_ms else ")")
        for T, ms in verify.items()))
    lines.append(f"fused decode kernels vs the eager module path, one step from the same cache: max |logit diff| = "
                 f"{logit_diff:.2e} of max |logit|")
    lines.append(f"greedy, first {n_check} tokens equal to our eager path: " +
                 "; ".join(f"{name} {a}" for name, a in checks))
    return table, lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model on CPU: checks the script, no claims")
    ap.add_argument("--append", nargs="?", const="bench/RESULTS.md", default=None, metavar="FILE",
                    help="append a dated markdown section (default bench/RESULTS.md)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256, help="static cache length (every step attends over it)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per path (after 5 warm-up steps)")
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--hf-tokens", type=int, default=64)
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="skip the torch.compile'd variant (an extra row; compiling takes ~0.5-1 min)")
    args = ap.parse_args()
    if args.tiny:
        args.prompt_len, args.max_len, args.check_tokens, args.hf_tokens = 8, 64, 8, 8
    elif not torch.cuda.is_available():
        sys.exit("ar_floor: needs a CUDA GPU (or --tiny for the CPU check of the script)")
    if args.append and args.tiny:
        sys.exit("ar_floor: --append is for the GPU run only (--tiny makes no claims)")
    import transformers

    device = torch.cuda.get_device_name() if not args.tiny else "CPU"
    machine = (f"{device}, torch {torch.__version__}, transformers {transformers.__version__}, bs=1, prompt "
               f"{args.prompt_len} tokens, static cache max_len {args.max_len}")
    print(machine, flush=True)
    table, lines = run(args)
    print("\n".join(table + [""] + lines))
    if args.append:
        cmd = "python3 " + " ".join(sys.argv)
        section = [f"\n## AR decode vs the HBM floor, Qwen3-8B shape ({datetime.date.today().isoformat()})", "",
                   f"`{cmd}`", "", f"Machine: {machine}. Median CUDA-event time per step after warm-up; floor = "
                   "weight bytes read per token / measured copy bandwidth.", "", *table, "", *(f"- {x}" for x in lines)]
        with open(args.append, "a") as f:
            f.write("\n".join(section) + "\n")
        print(f"appended to {args.append}")


if __name__ == "__main__":
    main()
