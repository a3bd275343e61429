"""dspark.kernels on one GPU: each Triton kernel against its torch reference at K3 shapes.

Usage (H200):  python bench/gpu_kernels.py [--only kda,attnres,mxfp4,markov,moe,sample,sampled_step,argmax,stash]
               [--iters 50] [--graph]
One row per case: max abs error vs the reference (the fp32 reference where the kernel's inputs are bf16), median
CUDA-event times (after warm-up) of the torch reference and the kernel, the bytes-moved floor (bytes / 4.8 TB/s)
and the fraction of it the kernel reaches (floor / kernel time). --graph times the kernel as 20 calls captured in
one CUDA graph (GPU time per call, as inside the decode graphs; without it the host's launch cost is included).
`kda_sweep`: the k3-mini verify (B=1, H=6, T=9, all states) under every (BV, warps, reduction order) the autotuner
picks from, graph-timed, with contiguous inputs and with qkv / gate / beta as column slices of one fused projection
(as the model passes them since the KDA input GEMMs were fused).
`markov_sweep`: one draft step's Markov loop under each grid size and V-chunk. `moe`: the k3-mini LatentMoE's graph-safe expert path (grouped matvec below N*k = E, every expert once above)
against the loop path, N tokens. `sample`: a sampled token's temperature softmax and inverse-CDF draw against their
torch definitions. `sampled_step`: a sampled step's rejection verification kernel against the torch path. `argmax`:
a greedy step's argmax over the target's logits against torch's. `stash`: a plain step's context stash (project_rows)
against its torch definition. Prints only; bench/RESULTS.md keeps the figures with their commands.
Exits with code 2 and a message without CUDA or triton.
"""
from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graph_ms, median_ms  # noqa: E402  (bench/timing.py)

HBM = 4.8e12  # bytes/s, H200 datasheet
GRAPH = False  # --graph: kernel times from graph_ms


def _row(name, err, ref_fn, ker_fn, nbytes, iters, ref_graph=False):
    """ref_graph: the reference graph-timed too under --graph (a torch path that runs inside the decode graphs)."""
    t_ref = 1e3 * (graph_ms(ref_fn, 20, iters) if GRAPH and ref_graph else median_ms(ref_fn, 5, iters))
    t_ker = 1e3 * (graph_ms(ker_fn, 20, iters) if GRAPH else median_ms(ker_fn, 5, iters))
    floor = nbytes / HBM * 1e6
    print(f"{name:<44} {err:>9.2e} {t_ref:>10.1f} {t_ker:>9.1f} {t_ref / t_ker:>7.1f}x {nbytes / 1e6:>9.2f} "
          f"{floor:>8.2f} {floor / t_ker:>6.1%}", flush=True)


def _err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def _kda_inputs(B, T, H, all_states, D=128, W=4) -> dict:
    """kda_decode's arguments at K3 head size in bf16 (fp32 conv weights, gate parameters and state)."""
    P = H * D
    r = lambda *s: torch.randn(*s, device="cuda")
    return dict(qkv=r(B, T, 3 * P).bfloat16(), f=r(B, T, P).bfloat16(), beta=r(B, T, H).bfloat16(),
                gate=r(B, T, P).bfloat16(), conv_w=r(3 * P, W) * .5, window=r(B, W - 1, 3 * P).bfloat16(),
                A_log=r(H) * .5, dt_bias=r(P), o_norm_w=torch.ones(D, device="cuda").bfloat16(),
                state=r(B, H, D, D) * .3, lower_bound=-5.0, return_all_states=all_states)


def bench_kda(iters):
    import dspark.kernels.kda_decode as kd
    from dspark.kernels.kda_decode import kda_decode_ref, kda_decode_triton
    D, W = 128, 4
    for B in (1, 16):
        for H in (6, 16, 96):  # 6: the k3-mini target's KDA heads
            for T, all_states in ((1, False), (9, True), (17, False)):
                P = H * D
                inp = _kda_inputs(B, T, H, all_states, D, W)
                ref = kda_decode_ref(**inp)
                nbytes = (B * T * (3 * P + 2 * P + H) * 2 + 3 * P * W * 4 + B * (W - 1) * 3 * P * 2 + B * H * D * D * 4
                          + B * T * P * 2 + B * (T + W - 1) * 3 * P * 2 + B * (T if all_states else 1) * H * D * D * 4)
                name = f"B={B} H={H} T={T}{' all-states' if all_states else ''}"
                try:
                    out = kda_decode_triton(**inp)
                except Exception as e:  # noqa: BLE001 - a kernel that does not build here: say so, time the rest
                    print(f"kda {name}: FAILED ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120] if str(e) else ''})", flush=True)
                    continue
                err = max(_err(out[0], ref[0]), _err(out[1], ref[1]))
                if kd.autotuning():  # the autotuned pick of this shape
                    cfg = kd._kda_tuned.best_config
                    bv, w, merged = cfg.kwargs["BV"], cfg.num_warps, cfg.kwargs["MERGED"]
                else:
                    bv, w, merged = kd.kda_config(T, B * H, D)
                pick = f"BV={bv}/{w}w/{'m' if merged else 'u'}"
                _row(f"kda {name} {pick}", err, partial(kda_decode_ref, **inp), partial(kda_decode_triton, **inp),
                     nbytes, iters)


def bench_kda_sweep(iters):
    import dspark.kernels.kda_decode as kd
    B, H, T, P = 1, 6, 9, 6 * 128
    common = dict(_kda_inputs(B, T, H, True), lengths=torch.tensor([T], device="cuda"))
    fused = torch.cat([common.pop(k) for k in ("qkv", "gate", "beta")], -1)  # [q|k|v | gate | b], KDA's in_proj
    layouts = {"contiguous": dict(qkv=fused[..., :3 * P].contiguous(), gate=fused[..., 3 * P:4 * P].contiguous(),
                                  beta=fused[..., 4 * P:].contiguous()),
               "fused slices": dict(qkv=fused[..., :3 * P], gate=fused[..., 3 * P:4 * P], beta=fused[..., 4 * P:])}
    ref = kd.kda_decode_ref(**layouts["contiguous"], **common)
    print(f"kda sweep B={B} H={H} T={T} all states, graph us per call: " + " | ".join(layouts), flush=True)
    for bv, w, merged in kd.CONFIGS:
        cells = []
        for inp in layouts.values():
            fn = partial(kd.kda_decode_triton, **inp, **common, block_v=bv, merged=merged, num_warps=w)
            err = max(_err(a, b) for a, b in zip(fn()[:2], ref[:2]))
            cells.append(f"{1e3 * graph_ms(fn, 20, iters):7.1f} (err {err:.1e})")
        print(f"  BV={bv:<3} {w}w {'merged' if merged else 'unmerged':<8} " + " | ".join(cells), flush=True)


def bench_attnres(iters):
    from dspark.kernels.attn_res import attn_res_mix_ref, attn_res_mix_triton
    d, S = 7168, 9
    for N in (1, 8, 64):
        v = torch.randn(N, S, d, device="cuda").bfloat16()
        nw, q, ow = torch.rand(d, device="cuda") + .5, torch.randn(d, device="cuda") * .02, torch.rand(d, device="cuda")
        for out_w in (None, ow):
            kw = dict(sources=v, norm_w=nw, query=q, out_w=out_w)
            err = _err(attn_res_mix_triton(**kw), attn_res_mix_ref(**kw))
            nbytes = N * S * d * 2 + N * d * 2 + 3 * d * 4
            _row(f"attn_res N={N} S={S} d={d}{' +out_norm' if out_w is not None else ''}", err,
                 partial(attn_res_mix_ref, **kw), partial(attn_res_mix_triton, **kw), nbytes, iters)


def bench_mxfp4(iters):
    from dspark.kernels.mxfp4_matmul import (
        mxfp4_grouped_matmul_ref,
        mxfp4_grouped_matmul_triton,
        mxfp4_matmul_ref,
        mxfp4_matmul_triton,
        quantize_mxfp4,
    )
    for N, K in ((3072, 3584), (3584, 3072)):
        p, s = quantize_mxfp4(torch.randn(N, K, device="cuda") * .02)
        for M in (1, 16, 64):
            x = torch.randn(M, K, device="cuda").bfloat16()
            err = _err(mxfp4_matmul_triton(x, p, s), mxfp4_matmul_ref(x.float(), p, s))
            nbytes = N * K // 2 + N * K // 32 + M * K * 2 + M * N * 2
            _row(f"mxfp4 {N}x{K} M={M}", err, partial(mxfp4_matmul_ref, x, p, s),
                 partial(mxfp4_matmul_triton, x, p, s), nbytes, iters)
    # grouped: 64 tokens x top-16 over 128 experts (8 rows each), w1 shape
    E, N, K, M = 128, 3072, 3584, 1024
    p, s = quantize_mxfp4(torch.randn(N, K, device="cuda") * .02)
    P, S = p[None].expand(E, -1, -1).contiguous(), s[None].expand(E, -1, -1).contiguous()
    x, offs = torch.randn(M, K, device="cuda").bfloat16(), torch.arange(0, M + 1, M // E, device="cuda")
    err = _err(mxfp4_grouped_matmul_triton(x, P, S, offs), mxfp4_grouped_matmul_ref(x.float(), P, S, offs))
    nbytes = E * (N * K // 2 + N * K // 32) + M * K * 2 + M * N * 2
    _row(f"mxfp4 grouped E={E} {N}x{K} rows={M}", err, partial(mxfp4_grouped_matmul_ref, x, P, S, offs),
         partial(mxfp4_grouped_matmul_triton, x, P, S, offs), nbytes, iters)


def bench_markov(iters):
    from dspark.kernels.markov_sample import markov_sample_ref, markov_sample_triton
    V, D, R = 163840, 8, 64
    w1, w2 = torch.randn(V, R, device="cuda").bfloat16(), (torch.randn(V, R, device="cuda") * .1).bfloat16()
    for B in (1, 8, 64):
        U = torch.randn(B, D, V, device="cuda") * 3
        anc = torch.randint(0, V, (B,), device="cuda")
        ri, rl = markov_sample_ref(U, w1, w2, anc)
        nbytes = B * D * V * 4 + V * R * 2 + B * D * (R * 2 + 16)
        for one in (True, False):
            ki, kl = markov_sample_triton(U, w1, w2, anc, one_launch=one)
            err = max(_err(kl, rl), float((ki != ri).sum()))  # ids mismatches count as error
            _row(f"markov B={B} D={D} V={V} r={R} {'1 launch' if one else f'{D + 1} launches'}", err,
                 partial(markov_sample_ref, U, w1, w2, anc),
                 partial(markov_sample_triton, U, w1, w2, anc, one_launch=one), nbytes, iters)


def bench_markov_sweep(iters):
    """One draft step's Markov loop at B = 1, D = 8, graph-timed, under each grid size (programs) and V-chunk (BV):
    the quickstart drafter's shape (V 4096, rank 32) and K3's (V 163840, rank 64). Ids must equal the reference's
    in every row."""
    from dspark.kernels.markov_sample import markov_sample_ref, markov_sample_triton
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for V, R in ((4096, 32), (163840, 64)):
        w1, w2 = torch.randn(V, R, device="cuda").bfloat16(), (torch.randn(V, R, device="cuda") * .1).bfloat16()
        U = torch.randn(1, 8, V, device="cuda") * 3
        anc = torch.randint(0, V, (1,), device="cuda")
        ri, rl = markov_sample_ref(U, w1, w2, anc)
        for bv in (64, 128, 256, 512):
            for g in sorted({1, 4, 8, 16, 32, 64, sms}):
                if g > -(-V // bv):
                    continue
                fn = partial(markov_sample_triton, U, w1, w2, anc, programs=g, block_v=bv)
                ki, kl = fn()
                err = max(_err(kl, rl), float((ki != ri).sum()))
                t = 1e3 * graph_ms(fn, 20, iters)
                print(f"markov_sweep V={V} r={R} BV={bv} programs={g} err={err:.2e} us={t:.2f}", flush=True)


def bench_moe(iters):
    """The k3-mini target's LatentMoE (16 experts top-2, latent 256, expert width 384), bf16: the routed experts of
    N tokens through the graph-safe path (what the decode graphs run) vs the loop path as reference."""
    import yaml

    from dspark.models.k3.config import K3TextConfig
    from dspark.models.k3.moe import LatentMoE

    fields = yaml.safe_load(open(Path(__file__).resolve().parents[1] / "recipes/targets/k3-mini.yaml"))["model"]
    moe = LatentMoE(K3TextConfig(vocab_size=8192, **fields)).cuda().bfloat16().eval()
    R, E, k = moe.experts.dim, moe.num_experts, moe.top_k
    expert_bytes = sum(p[0].numel() * p.element_size() for p in moe.experts.parameters())
    with torch.no_grad():
        for N in (1, 4, 9, 36, 144, 576):
            z = torch.randn(N, R, device="cuda").bfloat16()
            idx = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(N)])
            w = torch.rand(N, k, device="cuda")
            ref = partial(moe._experts_loop, z, idx, w)
            ker = partial(moe._experts_gathered, z, idx, w)
            nbytes = min(N * k, E) * expert_bytes + N * R * 2 * 2
            path = "every expert once" if N * k >= E else "grouped matvec"
            _row(f"moe k3-mini N={N} ({path})", _err(ker(), ref()), ref, ker, nbytes, iters)


def bench_sample(iters):
    """A sampled token's two steps against the torch definitions the engine ran before them (both graph-timed under
    --graph: both run inside the decode graphs): the temperature softmax of the logits and one draw by inverse CDF.
    K3's vocabulary and the quickstart's; 1 row (an AR step), 9 (a k = 8 step's positions of one row) and 64."""
    from dspark.kernels.inverse_cdf import inverse_cdf_ref, inverse_cdf_triton
    from dspark.kernels.temperature_softmax import temperature_softmax_ref, temperature_softmax_triton

    for V in (163840, 8192):
        for R in (1, 9, 64):
            x, t = (torch.randn(R, V, device="cuda") * 3).bfloat16(), torch.full((R,), 0.7, device="cuda")
            w = temperature_softmax_ref(x, t)
            _row(f"temperature_softmax R={R} V={V}", _err(temperature_softmax_triton(x, t), w),
                 partial(temperature_softmax_ref, x, t), partial(temperature_softmax_triton, x, t), R * V * (2 * 2 + 4),
                 iters, ref_graph=True)
            u = torch.rand(R, device="cuda")
            err = float((inverse_cdf_triton(w, u) != inverse_cdf_ref(w, u)).sum())  # picks that differ
            _row(f"inverse_cdf R={R} V={V}", err, partial(inverse_cdf_ref, w, u), partial(inverse_cdf_triton, w, u),
                 R * V * 4 * 2, iters, ref_graph=True)


def bench_argmax(iters):
    """A greedy step's argmax over the target's logits (both graph-timed under --graph: both run inside the decode
    graphs): bf16 logits [B, T, V] of 1 and 9 positions, the quickstart's vocabulary (4096) and K3's (163840)."""
    from dspark.kernels.argmax import argmax_ref, argmax_triton

    for V in (4096, 163840):
        for B, T in ((1, 1), (1, 9), (64, 9)):
            x = (torch.randn(B, T, V, device="cuda") * 3).bfloat16()
            err = float((argmax_triton(x) != argmax_ref(x)).sum())  # picks that differ
            _row(f"argmax B={B} T={T} V={V}", err, partial(argmax_ref, x), partial(argmax_triton, x), x.numel() * 2,
                 iters, ref_graph=True)


def bench_sampled_step(iters):
    """A sampled step's rejection verification, one kernel, against the torch path it replaced (both graph-timed
    under --graph): process_logits, verify_rejection, and verify_greedy for greedy rows. The quickstart's vocabulary
    (block 4) and k3-mini's (block 8), 1, 16 and 64 rows at T = 0.7, bf16 logits, sampled drafts."""
    from dspark.kernels.rejection_verify import rejection_verify_triton
    from dspark.kernels.temperature_softmax import temperature_softmax_triton
    from dspark.spec.sampling import process_logits
    from dspark.spec.verify import verify_greedy, verify_rejection

    def torch_verify(x, t, d, n, q, u):
        a, nxt = verify_greedy(d, x, n)
        a_s, nxt_s = verify_rejection(d, q, process_logits(x, t), n, u)
        return torch.where(t == 0, a, a_s), torch.where(t == 0, nxt, nxt_s)

    for V, K in ((4096, 4), (8192, 8)):
        for B in (1, 16, 64):
            t = torch.full((B,), 0.7, device="cuda")
            q = temperature_softmax_triton(torch.randn(B, K, V, device="cuda") * 3, t[:, None].expand(B, K))
            d = torch.multinomial(q.view(-1, V), 1).view(B, K)
            x = (torch.randn(B, K + 1, V, device="cuda") * 3).bfloat16()
            n, uv = torch.full((B,), K, device="cuda"), torch.rand(B, K + 1, device="cuda")
            a, nxt = rejection_verify_triton(x, t, d, n, q, uv)
            ar, nr = torch_verify(x, t, d, n, q, uv)
            _row(f"rejection_verify B={B} K={K} V={V}", float((a != ar).sum() + (nxt != nr).sum()),
                 partial(torch_verify, x, t, d, n, q, uv), partial(rejection_verify_triton, x, t, d, n, q, uv),
                 B * (K + 1) * V * 2 * 2 + B * K * V * 4, iters, ref_graph=True)


def bench_stash(iters):
    """A plain step's context stash (project_rows: the aux layers' hidden states projected by the drafter's fc and
    written at their cache rows) against its torch definition (both graph-timed under --graph: both run inside the
    plain step's graph), bf16: the quickstart pair's 2 aux layers of 256 -> 256 and k3-mini's 5 of 768 -> 768, at
    M rows."""
    from dspark.kernels.project_rows import project_rows_ref, project_rows_triton

    for parts, K, N in ((2, 256, 256), (5, 768, 768)):
        for M in (1, 16, 64):
            xs = [torch.randn(M, K, device="cuda").bfloat16() for _ in range(parts)]
            w = (torch.randn(N, parts * K, device="cuda") / (parts * K) ** 0.5).bfloat16()
            pool, ref = (torch.zeros(4 * M + 8, N, device="cuda").bfloat16() for _ in range(2))
            dest = torch.randperm(4 * M + 8, device="cuda")[:M]
            project_rows_triton(xs, w, pool, dest)
            project_rows_ref(xs, w, ref, dest)
            _row(f"project_rows {parts}x{K}->{N} M={M}", _err(pool.float(), ref.float()),
                 partial(project_rows_ref, xs, w, ref, dest), partial(project_rows_triton, xs, w, pool, dest),
                 w.numel() * 2 + M * (parts * K + N) * 2, iters, ref_graph=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="kda,attnres,mxfp4,markov,moe,sample,sampled_step,argmax,stash")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--graph", action="store_true", help="kernel times inside a CUDA graph (no launch cost)")
    args = ap.parse_args()
    global GRAPH
    GRAPH = args.graph
    if not torch.cuda.is_available():
        print("bench/gpu_kernels.py needs a CUDA GPU (an H200): none found, nothing measured.", file=sys.stderr)
        return 2
    from dspark.kernels import HAS_TRITON
    if not HAS_TRITON:
        print("bench/gpu_kernels.py needs triton: not importable, nothing measured.", file=sys.stderr)
        return 2
    import triton
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print(f"{'case':<44} {'max_err':>9} {'ref_us':>10} {'ker_us':>9} {'speedup':>8} {'MB':>9} {'floor_us':>8} "
          f"{'of_floor':>6}")
    benches = dict(kda=bench_kda, kda_sweep=bench_kda_sweep, attnres=bench_attnres, mxfp4=bench_mxfp4,
                   markov=bench_markov, markov_sweep=bench_markov_sweep, moe=bench_moe, sample=bench_sample,
                   sampled_step=bench_sampled_step, argmax=bench_argmax, stash=bench_stash)
    for name in args.only.split(","):
        benches[name.strip()](args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
