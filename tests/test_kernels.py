"""dspark.kernels: every Triton kernel against its torch reference, and each reference against the model code.

CPU: the Triton kernels run under TRITON_INTERPRET=1 at small shapes. triton 3.9 reads that variable when a kernel is
*decorated* (module import), so the interpreter checks run in one subprocess with the variable set
(`_interp_checks`, results as JSON), whatever this process has imported already. The dispatchers' CPU fallback
(= the reference) and reference-vs-model checks run in-process. CUDA (skipped without a GPU): compiled kernels at
K3 shapes in bf16. Whole file: ~15-25 s on 2 CPU cores.
"""
import os

import pytest
import torch

from tests.interp import interpreter_checks

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _kda_inputs(B, T, H, D, W=4, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    P = H * D
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(device)
    return dict(qkv=r(B, T, 3 * P).to(dtype), f=r(B, T, P).to(dtype), beta=r(B, T, H).to(dtype),
                gate=r(B, T, P).to(dtype), conv_w=r(3 * P, W, sc=0.5), window=r(B, W - 1, 3 * P).to(dtype),
                A_log=r(H, sc=0.5), dt_bias=r(P), o_norm_w=(torch.rand(D, generator=g) + 0.5).to(device).to(dtype),
                state=r(B, H, D, D, sc=0.3))


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


def _icdf_cases(g, device="cpu"):
    """(name, w, u, kernel kwargs) for inverse_cdf: half the weights zero, an all-zero row, one row positive only in
    its last columns, u = 0 and u at its largest (u * total rounds up to total: the last positive column); bf16 weights;
    [B, k, V] leading dims; a row whose only weights are one column or two far apart."""
    w = torch.rand(37, 5000, generator=g)
    w[torch.rand(37, 5000, generator=g) < 0.5] = 0
    w[3], w[5, :-7] = 0, 0
    u = torch.rand(37, generator=g)
    u[0], u[1], u[5] = 0.0, 1 - 2 ** -24, 1 - 2 ** -24
    sparse = torch.zeros(4, 1000)
    sparse[0, 999], sparse[1, 0], sparse[2, 500], sparse[3, [10, 900]] = 1.0, 2.0, 1e-30, 1.0
    cases = [("fp32", w, u, dict(slice_cols=2048, block=1024)), ("small_slices", w, u, dict(slice_cols=512, block=128)),
             ("bf16", w.bfloat16(), u, {}), ("bkv", torch.rand(2, 3, 300, generator=g) ** 8,
                                             torch.rand(2, 3, generator=g), dict(slice_cols=64, block=32)),
             ("sparse", sparse, torch.tensor([0.5, 0.99999, 0.3, 0.5]), dict(slice_cols=256, block=64))]
    return [(n, w.to(device), u.to(device), kw) for n, w, u, kw in cases]


def _softmax_cases(g):
    """(name, logits, t, kernel kwargs) for temperature_softmax: per-row t (sampled, greedy, below the floor), a row of
    ties, rows that are -inf past column 100 or up to column 2100 (a whole slice of -inf), a tied max far apart
    (the first is the greedy pick); bf16 logits; [B, k, V] leading dims."""
    x = torch.randn(6, 5000, generator=g) * 4
    x[1], x[2, 100:], x[3, :2100] = x[1].max(), float("-inf"), float("-inf")
    x[4, 7] = x[4, 4000] = x[4].max() + 1
    t = torch.tensor([0.7, 0.0, 1.0, 0.5, 0.0, 1e-7])
    return [("fp32", x, t, {}), ("small_slices", x, t, dict(slice_cols=512, block=128)), ("bf16", x.bfloat16(), t, {}),
            ("bkv", torch.randn(2, 3, 300, generator=g), torch.tensor([[0.0, 1.0, 0.7], [2.0, 0.3, 0.0]]),
             dict(slice_cols=64, block=32))]


def _icdf_invalid(w, u, ids) -> int:
    """Picks that are not the inverse CDF's up to fp32 rounding (float64 sums): a zero-weight column, a column whose
    cumulative window misses u * total by more than 1e-5 of the total, or not 0 on a row without weight."""
    w64, ids, u = w.double().reshape(-1, w.shape[-1]).cpu(), ids.reshape(-1, 1).cpu(), u.reshape(-1).double().cpu()
    cdf = w64.cumsum(-1)
    total, hi, wi = cdf[:, -1], cdf.gather(1, ids)[:, 0], w64.gather(1, ids)[:, 0]
    t, slack = u * total, 1e-5 * total
    ok = torch.where(total == 0, ids[:, 0] == 0, (wi > 0) & (hi - wi <= t + slack) & (hi >= t - slack))
    return int((~ok).sum())


def _kda_slots_checks(device="cpu", dtype=torch.float32, H=2, D=16) -> dict:
    """kda_decode_slots (the kernel where dispatched) against its definition: three rows at pool rows 4, 1 and the
    scratch row 5, the last one padding (length 0); after a step without recording every pool row is the
    definition's (the untouched ones as they were), with recording the pools are left as they were. name ->
    [max error over outputs and pools, relative to each tensor's largest value where that exceeds 1, tolerance]."""
    from dspark.kernels.kda_decode import kda_decode_slots, kda_decode_slots_ref

    res = {}
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: about two roundings of its 8-bit mantissa
    rel = lambda a, b: _err(a, b) / max(1.0, b.float().abs().max().item())  # noqa: E731
    for name, T, lens, record in (("final_t1", 1, [1, 1, 0], False), ("final_t3_lengths", 3, [3, 2, 0], False),
                                  ("allstates_t9", 9, [9, 4, 0], True)):
        inp = _kda_inputs(B=3, T=T, H=H, D=D, dtype=dtype, device=device, seed=T)
        g = torch.Generator().manual_seed(11)
        pools = [(torch.randn(6, H, D, D, generator=g) * 0.3).to(device),
                 torch.randn(6, 3, 3 * H * D, generator=g).to(device, dtype)]  # state fp32, window in qkv's dtype
        args = [inp[k] for k in ("qkv", "f", "beta", "gate", "conv_w")]
        norm = [inp[k] for k in ("A_log", "dt_bias", "o_norm_w")]
        slots, lengths = torch.tensor([4, 1, 5], device=device), torch.tensor(lens, device=device)
        outs = []
        for fn in (kda_decode_slots_ref, kda_decode_slots):
            S_pool, win_pool = (t.clone() for t in pools)
            out, S, ext = fn(*args, win_pool, *norm, S_pool, lower_bound=-5.0, return_all_states=record,
                             lengths=lengths, slots=slots)
            outs.append((out, ext, S if record else S_pool, win_pool))
        err = max(rel(b, a) for a, b in zip(*outs))
        if record:  # the pools as they were
            err = max(err, rel(outs[1][3], pools[1]), rel(S_pool, pools[0]))
        res[f"kda_slots_{name}"] = [err, tol]
    return res


def _kda_tuned_on_rows_checks(H=2, D=16) -> dict:
    """A step over pools where the autotuner picks the config (CUDA; here a stand-in that records each launch and
    runs one config): its first launch of a key times copies of the step's rows, not the pool (restored after each
    trial, the pool's copy would be the timing), the launch on the pool follows; a second step of the key launches
    once; the pools end as the definition leaves them. -> name -> [error, tolerance]."""
    import dspark.kernels.kda_decode as kd

    states = []

    class Autotuner:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                states.append(args[8])
                kd._kda_decode_kernel[grid({"BV": 16})](*args, **meta, BV=16, MERGED=True, num_stages=1, num_warps=4)
            return launch

    saved = kd._kda_tuned, kd.autotuning, set(kd._TUNED_ON_ROWS)
    kd._kda_tuned, kd.autotuning = Autotuner(), lambda: True
    kd._TUNED_ON_ROWS.clear()
    try:
        inp = _kda_inputs(B=3, T=1, H=H, D=D, seed=5)
        g = torch.Generator().manual_seed(12)
        pools = [torch.randn(6, H, D, D, generator=g) * 0.3, torch.randn(6, 3, 3 * H * D, generator=g)]
        args = [inp[k] for k in ("qkv", "f", "beta", "gate", "conv_w")]
        norm = [inp[k] for k in ("A_log", "dt_bias", "o_norm_w")]
        slots, err, launches = torch.tensor([4, 1, 5]), 0.0, []
        ref_pools = [t.clone() for t in pools]
        for _ in range(2):  # two steps of the same key, each after the definition's
            ref_out = kd.kda_decode_slots_ref(*args, ref_pools[1], *norm, ref_pools[0], slots=slots)[0]
            n = len(states)
            out = kd.kda_decode_slots(*args, pools[1], *norm, pools[0], slots)[0]
            launches.append([tuple(s.shape) for s in states[n:]])
            err = max(err, _err(out, ref_out), _err(pools[0], ref_pools[0]), _err(pools[1], ref_pools[1]))
    finally:
        kd._kda_tuned, kd.autotuning = saved[:2]
        kd._TUNED_ON_ROWS.clear()
        kd._TUNED_ON_ROWS.update(saved[2])
    want = [[(3, H, D, D), (6, H, D, D)], [(6, H, D, D)]]
    return {"kda_slots_tuned_on_rows": [err, 1e-5], "kda_slots_tuned_on_rows_launches": [float(launches != want), 0]}


def _kda_commit_checks(device="cpu", dtype=torch.float32, H=2, D=16) -> dict:
    """kda_commit (the kernel where dispatched) and its definition against the cache's rollback
    (committed_kda_state, then the rows written back): rows keeping all 9, 3, none and 1 of their new tokens at pool
    rows 2, 0, 4 and the scratch row 5; the other pool rows untouched. -> name -> [max abs error, tolerance]."""
    from dspark.kernels.kda_commit import committed_kda_state, kda_commit, kda_commit_ref

    g = torch.Generator().manual_seed(3)
    B, T, W1, C = 4, 9, 3, 3 * H * D
    states = torch.randn(B, T, H, D, D, generator=g).to(device)
    ext = torch.randn(B, W1 + T, C, generator=g).to(device, dtype)
    pools = [torch.randn(6, H, D, D, generator=g).to(device), torch.randn(6, W1, C, generator=g).to(device, dtype)]
    n_keep, slots = torch.tensor([9, 3, 0, 1], device=device), torch.tensor([2, 0, 4, 5], device=device)
    ext[:, :W1] = pools[1][slots]  # as a step extends each row's window
    want = [t.clone() for t in pools]
    S, win = committed_kda_state(states, ext, n_keep, want[0][slots])
    want[0][slots], want[1][slots] = S, win.to(dtype)
    res = {}
    for name, fn in (("kda_commit_ref", kda_commit_ref), ("kda_commit", kda_commit)):
        got = [t.clone() for t in pools]
        fn(states, ext, n_keep, *got, slots)
        res[name] = [max(_err(a, b) for a, b in zip(want, got)), 0.0]
    return res


# ------------------------------------------------------------------------------------------ interpreter (subprocess)
def _interp_checks() -> dict:
    """Runs with TRITON_INTERPRET=1: name -> [max abs error, tolerance]."""
    from dspark.kernels import interpreting
    from dspark.kernels.argmax import argmax
    from dspark.kernels.attn_res import attn_res_mix_ref, attn_res_mix_triton
    from dspark.kernels.chain_inputs import chain_inputs_triton
    from dspark.kernels.draft_block import draft_block_triton
    from dspark.kernels.greedy_verify import greedy_step_ref, greedy_step_triton, pack_step_ref, pack_step_triton
    from dspark.kernels.inverse_cdf import inverse_cdf_ref, inverse_cdf_triton
    from dspark.kernels.kda_decode import kda_decode_ref, kda_decode_triton
    from dspark.kernels.markov_sample import draft_noise_ref, markov_sample_ref, markov_sample_triton
    from dspark.kernels.mxfp4_matmul import (
        mxfp4_grouped_matmul_ref,
        mxfp4_grouped_matmul_triton,
        mxfp4_matmul_ref,
        mxfp4_matmul_triton,
        quantize_mxfp4,
    )
    from dspark.kernels.paged_attention import attention_ref, attention_triton
    from dspark.kernels.temperature_softmax import temperature_softmax_ref, temperature_softmax_triton
    from dspark.kernels.view_indices import (
        additive_key_mask_ref,
        additive_key_mask_triton,
        view_indices_ref,
        view_indices_triton,
    )

    assert interpreting()
    res = {}
    # KDA: fp32, tolerance 1e-5 on out / state / ext
    cases = {"kda_softplus_final": dict(lower_bound=None, return_all_states=False, lengths=None),
             "kda_lb_allstates_lengths": dict(lower_bound=-5.0, return_all_states=True, lengths=torch.tensor([3, 1])),
             "kda_lb_nostate": dict(lower_bound=-5.0, return_all_states=False, lengths=None, state=None),
             "kda_verify_t9": dict(lower_bound=-5.0, return_all_states=True, lengths=torch.tensor([9, 4]), T=9),
             "kda_t17_softplus": dict(lower_bound=None, return_all_states=False, lengths=None, T=17),
             # the state split over value-column programs (D/BV = 4 and 2 programs per head)
             "kda_vsplit4_verify_t9": dict(lower_bound=-5.0, return_all_states=True, lengths=torch.tensor([9, 5]),
                                           T=9, block_v=4),
             "kda_vsplit2_softplus": dict(lower_bound=None, return_all_states=False, lengths=None, T=3, block_v=8),
             # o reduced from the updated state (the autotuner's other reduction order)
             "kda_unmerged_verify_t9": dict(lower_bound=-5.0, return_all_states=True, lengths=torch.tensor([9, 5]),
                                            T=9, block_v=4, merged=False),
             # kda_config's picks at the K3 head dim over few heads: 16 columns merged (T = 4), 8 on 2 warps (T = 9)
             "kda_rule_d128_t4": dict(lower_bound=-5.0, return_all_states=False, lengths=None, T=4, D=128, B=1, H=1),
             "kda_rule_d128_verify_t9": dict(lower_bound=-5.0, return_all_states=True, lengths=torch.tensor([7]), T=9,
                                             D=128, B=1, H=1)}
    g_junk = torch.Generator().manual_seed(7)
    for name, kw in cases.items():
        kw = dict(kw)
        inp = _kda_inputs(B=kw.pop("B", 2), T=kw.pop("T", 3), H=kw.pop("H", 2), D=kw.pop("D", 16))
        inp.update(kw)
        opts = {k: inp.pop(k) for k in ("block_v", "merged") if k in inp}
        ref, out = kda_decode_ref(**inp), kda_decode_triton(**inp, **opts)
        res[name] = [max(_err(a, b) for a, b in zip(ref, out)), 1e-5]
    # qkv / f / beta / gate as column slices of one wide projection output (the KDA layer's fused input GEMM), read
    # in place through their row strides; 3 junk columns after each slice
    for T in (1, 9):
        inp = dict(_kda_inputs(B=2, T=T, H=2, D=16), lower_bound=-5.0, return_all_states=True,
                   lengths=torch.tensor([T, max(T - 3, 1)]))
        parts = [inp[k] for k in ("qkv", "f", "beta", "gate")]
        wide = torch.cat([torch.cat([x, torch.randn(2, T, 3, generator=g_junk)], -1) for x in parts], -1)
        at, views = 0, {}
        for k, x in zip(("qkv", "f", "beta", "gate"), parts):
            views[k], at = wide[..., at: at + x.shape[-1]], at + x.shape[-1] + 3
        assert not views["qkv"].is_contiguous()
        res[f"kda_strided_slices_t{T}"] = [max(_err(a, b) for a, b in zip(kda_decode_ref(**inp),
                                                                          kda_decode_triton(**{**inp, **views}))), 1e-5]
    res.update(_kda_slots_checks())  # the pools read and written in place, through the dispatcher
    res.update(_kda_commit_checks())
    res.update(_kda_tuned_on_rows_checks())
    # AttnRes: fp32, 1e-5; d = 80 with 32-wide chunks (a ragged tail), strided sources + prefix, output norm
    g = torch.Generator().manual_seed(1)
    v = torch.randn(3, 9, 80, generator=g) * torch.rand(1, 9, 1, generator=g) * 3
    nw, q, ow, pre = torch.rand(80, generator=g) + .5, torch.randn(80, generator=g) * .3, torch.rand(80) + .5, \
        torch.randn(3, 80, generator=g)
    for name, kw in {"attnres_plain": dict(sources=v), "attnres_outnorm": dict(sources=v, out_w=ow),
                     "attnres_view_prefix": dict(sources=v[:, :5], prefix=pre, out_w=ow)}.items():
        res[name] = [_err(attn_res_mix_ref(norm_w=nw, query=q, **kw),
                          attn_res_mix_triton(norm_w=nw, query=q, block_d=32, **kw)), 1e-5]
    # MXFP4: K = 96 (tail inside a 64-wide K block), fp32 1e-4; bf16 activations: 1 bf16 ulp of |y|max (rel 1e-2)
    p, s = quantize_mxfp4(torch.randn(48, 96, generator=g))
    x = torch.randn(5, 96, generator=g)
    res["mxfp4_fp32"] = [_err(mxfp4_matmul_ref(x, p, s), mxfp4_matmul_triton(x, p, s, block=(16, 16, 64))), 1e-4]
    yb = mxfp4_matmul_ref(x.bfloat16(), p, s)
    res["mxfp4_bf16"] = [_err(yb, mxfp4_matmul_triton(x.bfloat16(), p, s, block=(16, 16, 64))),
                         1e-2 * yb.float().abs().max().item()]
    pw = [quantize_mxfp4(torch.randn(48, 96, generator=g)) for _ in range(3)]
    P, S = torch.stack([a for a, _ in pw]), torch.stack([b for _, b in pw])
    offs, xg = torch.tensor([0, 7, 7, 20]), torch.randn(20, 96, generator=g)  # expert 1 empty
    res["mxfp4_grouped"] = [_err(mxfp4_grouped_matmul_ref(xg, P, S, offs),
                                 mxfp4_grouped_matmul_triton(xg, P, S, offs, block=(16, 16, 64))), 1e-4]
    # Markov: ids exact (error = number of mismatches, tolerance 0), logits 1e-5 (checked as a second entry)
    B, D, V, R = 3, 4, 300, 16
    U, w1, w2 = torch.randn(B, D, V, generator=g), torch.randn(V, R, generator=g), torch.randn(V, R, generator=g) * .5
    anc = torch.randint(0, V, (B,), generator=g)
    temp, noise = torch.tensor([0.0, 1.0, 0.7]), torch.rand(B, D, V, generator=g).clamp(1e-6, 1 - 1e-6)
    sd, pos = torch.tensor([5, -(2 ** 63), 2 ** 62 + 7]), torch.tensor([0, 17, 100000])  # int64 extremes
    cn = draft_noise_ref(sd, pos, D, V)
    for name, kw, tkw in [("markov_greedy_1launch", {}, dict(one_launch=True, programs=1)),
                          ("markov_greedy_steps_3prog", {}, dict(one_launch=False, programs=3)),
                          # the default V-chunk (256 on the CPU: wider than a program's slice of 100)
                          ("markov_greedy_default_chunk", {}, dict(one_launch=False, programs=3, block_v=None)),
                          ("markov_gumbel_steps_3prog", dict(temperature=temp, noise=noise),
                           dict(one_launch=False, programs=3)),
                          # the counter-based uniforms drawn in the kernel, against their torch definition
                          ("markov_counter_noise_1launch", dict(temperature=temp, noise=cn),
                           dict(one_launch=True, programs=1, noise=None, seed=sd, position=pos)),
                          ("markov_counter_noise_steps_3prog", dict(temperature=temp, noise=cn),
                           dict(one_launch=False, programs=3, noise=None, seed=sd, position=pos))]:
        ri, rl = markov_sample_ref(U, w1, w2, anc, **kw)
        ki, kl = markov_sample_triton(U, w1, w2, anc, **(dict(block_v=64) | kw | tkw))
        res[name] = [float((ri != ki).sum()), 0.0]
        res[name + "_logit"] = [_err(rl, kl), 1e-5]
    res.update(_decode_checks(g))
    seed = int(torch.randint(0, 1 << 30, (1,), generator=g))
    res["chain_inputs"] = [float((_chain_case("cpu", seed, chain_inputs_triton) != _chain_case("cpu", seed,
                                                                                             None)).sum()), 0.0]
    res.update(_norm_rope_checks(g))
    res.update(_glu_route_checks(g))
    res["greedy_step"] = [float(sum(int((greedy_step_triton(*c) != greedy_step_ref(*c)).sum())
                                    for c in _greedy_cases("cpu", seed))), 0.0]
    # n + 1 as a column of a wider int buffer (a step's num_new), the kernel taking the 1 off: the rows of n
    res["greedy_step_minus"] = [float(sum(int((greedy_step_triton(d, top, _column(n + 1), minus=1)
                                                != greedy_step_ref(d, top, n)).sum())
                                          for d, top, n in _greedy_cases("cpu", seed))), 0.0]
    res["pack_step"] = [float(sum(int((pack_step_triton(*c) != pack_step_ref(*c)).sum())
                                  for c in _pack_cases("cpu", seed))), 0.0]
    res.update(_add_rms_norm_checks(g))
    res["view_indices"] = [float(sum(not torch.equal(x, y) for c in _view_cases("cpu", seed)
                                     for x, y in zip(view_indices_triton(*c), view_indices_ref(*c)))), 0.0]
    res["additive_key_mask"] = [float(sum(not torch.equal(additive_key_mask_triton(p, L, dt),
                                                          additive_key_mask_ref(p, L, dt))
                                          for p, L in _mask_cases("cpu", seed) for dt in (torch.float32, torch.bfloat16))),
                                0.0]
    res["paged_attention"] = [max(_err(attention_triton(*c), attention_ref(*c)) for c in _attention_cases("cpu", seed)),
                              1e-5]
    res["draft_block"] = [float(_draft_block_mismatches(_draft_block_cases("cpu", seed), draft_block_triton)), 0.0]
    for name, x, t, kw in _softmax_cases(g):
        out, ref = temperature_softmax_triton(x, t, **kw), temperature_softmax_ref(x, t)
        res[f"temperature_softmax_{name}"] = [_err(out, ref) + float(out.shape != ref.shape), 1e-6]
    for name, w, u, kw in _icdf_cases(g):  # every pick valid; these cases pick what the torch definition picks
        ids = inverse_cdf_triton(w, u, **kw)
        res[f"inverse_cdf_{name}"] = [_icdf_invalid(w, u, ids) + float(ids.shape != u.shape)
                                      + float((ids != inverse_cdf_ref(w, u)).sum()), 0.0]
    for name, x, kw in _argmax_cases(g):  # picks: number of mismatches, tolerance 0
        res[f"argmax_{name}"] = [_argmax_mismatches(x, kw), 0.0]
    # the dispatcher: the kernel's pick for fp32; fp64 to the reference (in fp32, 1 and 1 + 1e-12 would tie)
    x = _argmax_ties(torch.float32)
    res["argmax_dispatch"] = [float((argmax(x) != x.argmax(-1)).sum())
                              + float(argmax(torch.tensor([1.0, 1.0 + 1e-12], dtype=torch.float64)) != 1), 0.0]
    return res


def _glu_route_checks(g) -> dict:
    """The gated-MLP activation (fp32: gate / up as the halves of a merged projection, a ragged block tail; relative to
    the largest output), the MoE router (ids exact, weights 1e-6; sigmoid / softmax, with and without
    renormalisation, E = 6 not a power of two, a ragged hidden tail) and the experts' weighted sum (dense: every
    expert's output on every token, read through a transposed view; gathered: one row per (token, slot); fp32, and
    into bf16 within one ulp: the two sum in different orders)."""
    from dspark.kernels.glu import glu_ref, glu_triton
    from dspark.kernels.moe_combine import moe_combine_ref, moe_combine_triton
    from dspark.kernels.moe_route import moe_route_ref, moe_route_triton

    res = {}
    gate, up = (torch.randn(2, 3, 2 * 40, generator=g) * 4).chunk(2, -1)
    for name, act, b1, b2 in (("glu_silu", "silu", None, None), ("glu_situ", "situ", 4.0, 25.0),
                              ("glu_situ_no_up_clamp", "situ", None, None)):
        ref = glu_ref(gate, up, act, b1, b2)
        out = glu_triton(gate, up, act, b1, b2, block=16)
        res[name] = [_err(ref, out) + float(out.shape != ref.shape), 1e-6 * ref.abs().max().item()]
    x, w, bias = torch.randn(7, 72, generator=g), torch.randn(6, 72, generator=g) * .2, torch.randn(6, generator=g) * .1
    for act in ("sigmoid", "softmax"):
        for renorm in (True, False):
            ri, rw, _, _ = moe_route_ref(x, w, bias, 3, act, renorm, 2.5)
            ki, kw = moe_route_triton(x, w, bias, 3, act, renorm, 2.5, block_h=16)
            name = f"moe_route_{act}{'_renorm' if renorm else ''}"
            res[name] = [float((ri != ki).sum()), 0.0]
            res[name + "_logit"] = [_err(rw, kw), 1e-6]
    y = torch.randn(7, 6, 40, generator=g).transpose(0, 1)  # [E, N, R]: strides (40, 240, 1)
    idx = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(7)])
    wt = torch.rand(7, 3, generator=g)
    ref = moe_combine_ref(y, wt, idx)
    res["moe_combine_dense"] = [_err(ref, moe_combine_triton(y, wt, idx, block=16)), 1e-6 * ref.abs().max().item()]
    yg = torch.randn(7, 3, 40, generator=g)
    ref = moe_combine_ref(yg, wt)
    res["moe_combine_gathered"] = [_err(ref, moe_combine_triton(yg, wt, block=16)), 1e-6 * ref.abs().max().item()]
    out = moe_combine_triton(yg, wt, dtype=torch.bfloat16, block=16)
    res["moe_combine_gathered_bf16"] = [_err(moe_combine_ref(yg, wt, dtype=torch.bfloat16), out)
                                        + float(out.dtype != torch.bfloat16), 2 ** -7 * ref.abs().max().item()]
    return res


def _norm_rope_checks(g) -> dict:
    """norm_rope (fp32): q / k heads as strided views of a merged projection, positions per row [B, T] or shared [T],
    with and without the norm."""
    from dspark.kernels.rope import (
        Rope,
        apply_rope_interleaved,
        apply_rope_neox,
        norm_rope_ref,
        norm_rope_triton,
        qk_norm_rope_,
    )

    y = torch.randn(2, 5, 7 * 16, generator=g)  # [q: 4 heads | k: 2 | v: 1] of head dim 16
    q, k = y[..., :64].view(2, 5, 4, 16), y[..., 64:96].view(2, 5, 2, 16)
    w = torch.rand(16, generator=g) + 0.5
    res = {}
    for name, pos in (("rows", torch.randint(0, 3000, (2, 5), generator=g)), ("shared", torch.arange(7, 12))):
        rope = Rope(pos, 16, 10000.0)
        res[f"norm_rope_{name}"] = [max(_err(norm_rope_ref(x, w, 1e-6, rope), norm_rope_triton(x, w, 1e-6, rope))
                                        for x in (q, k)), 1e-5]
    # in place on the merged output: q (weight w) and k (weight wk) heads in one launch, the v head untouched; and
    # the k heads alone of a [k | v] output (the drafter's context rows)
    wk, pos = torch.rand(16, generator=g) + 0.5, torch.randint(0, 3000, (2, 5), generator=g)
    rope = Rope(pos, 16, 10000.0)
    yq = y.clone()
    qk_norm_rope_(yq.view(2, 5, 7, 16)[:, :, :6], 4, w, wk, 1e-6, rope)
    want = torch.cat([norm_rope_ref(q, w, 1e-6, rope).transpose(1, 2).flatten(2),
                      norm_rope_ref(k, wk, 1e-6, rope).transpose(1, 2).flatten(2), y[..., 96:]], -1)
    res["qk_norm_rope_inplace"] = [_err(yq, want), 1e-5]
    kv = y[..., 64:].clone()
    qk_norm_rope_(kv.view(2, 5, 3, 16)[:, :, :2], 0, None, wk, 1e-6, rope)
    res["k_norm_rope_inplace"] = [_err(kv, want[..., 64:]), 1e-5]
    # with a sink: each token's [k | v] row also to its row of a pool (rows out of order, the rest untouched), in the
    # same launch; the merged output [q: 4 heads | k: 2 | v: 2], and the drafter's context rows [k | v]
    y2 = torch.randn(2, 5, 8 * 16, generator=g)
    q2, k2 = y2[..., :64].view(2, 5, 4, 16), y2[..., 64:96].view(2, 5, 2, 16)
    want2 = torch.cat([norm_rope_ref(q2, w, 1e-6, rope).transpose(1, 2).flatten(2),
                       norm_rope_ref(k2, wk, 1e-6, rope).transpose(1, 2).flatten(2), y2[..., 96:]], -1)
    dest = torch.randperm(23, generator=g)[:10]
    for name, x, n_q in (("qk_norm_rope_sink", y2.clone(), 4), ("k_norm_rope_sink", y2[..., 64:].clone(), 0)):
        pool = torch.zeros(23, 64)
        qk_norm_rope_(x.view(2, 5, -1, 16), n_q, w if n_q else None, wk, 1e-6, rope, n_v=2, sink=(pool, dest))
        rest = torch.ones(23, dtype=torch.bool).index_fill_(0, dest, False)
        res[name] = [_err(x, want2 if n_q else want2[..., 64:]) + _err(pool[dest], want2[..., 64:].reshape(10, 64))
                     + float(pool[rest].abs().sum()), 1e-5]
    rope = Rope(torch.arange(5), 16, 1e6)
    res["rope_only"] = [_err(apply_rope_neox(q.transpose(1, 2), *rope.cos_sin(q.dtype)),
                             norm_rope_triton(q, None, 0.0, rope)), 1e-5]
    # MLA's interleaved pairs on a strided slice (the rope part of merged [nope | rope] heads), positions per row
    qm = torch.randn(2, 5, 3, 8 + 16, generator=g)[..., 8:]
    rope_m = Rope(torch.randint(0, 4000, (2, 5), generator=g), 16, 10000.0)
    res["rope_interleaved"] = [_err(apply_rope_interleaved(qm.transpose(1, 2), *rope_m.cos_sin(qm.dtype)),
                                    norm_rope_triton(qm, None, 0.0, rope_m, interleaved=True)), 1e-5]
    return res


def _column(x: torch.Tensor) -> torch.Tensor:
    """x [B] as the middle column of a [B, 3] buffer (row stride 3), as a step reads its int columns."""
    return torch.stack([x * 0 - 7, x, x * 0 - 9], 1)[:, 1]


def _greedy_cases(device, seed, shapes=((1, 4), (5, 3), (3, 0), (70, 7))):
    """(drafts, top, n) cases over a 3-token vocabulary (many matches): placeholders (-1) in a tenth of the slots,
    n from -1 to k + 1."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for B, k in shapes:
        d = torch.randint(0, 3, (B, k), generator=gen)
        d[torch.rand(B, k, generator=gen) < 0.1] = -1
        top, n = torch.randint(0, 3, (B, k + 1), generator=gen), torch.randint(-1, k + 2, (B,), generator=gen)
        cases.append((d.to(device), top.to(device), n.to(device)))
    return cases


def _pack_cases(device, seed, shapes=((1, 4), (5, 3), (70, 7))):
    """(drafts, a, next, n) cases: a sampled verifier's a in 0..k (and n from 0 to k + 1), next any token."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for B, k in shapes:
        d, nxt = torch.randint(0, 50, (B, k), generator=gen), torch.randint(0, 50, (B,), generator=gen)
        a, n = torch.randint(0, k + 1, (B,), generator=gen), torch.randint(0, k + 2, (B,), generator=gen)
        cases.append(tuple(x.to(device) for x in (d, a, nxt, n)))
    return cases


def _argmax_ties(dtype):
    """[13, 1200] rows of ties and special values (chunks of 64 and slices of 256, five: the merge pads them to eight,
    in the cases that split them): the max (50) at two columns in different slices (100, 700), on either side of a
    chunk boundary (63, 64) and of a slice boundary (255, 256), in one chunk (65, 66) and in the ragged last chunk
    (1198, 1199): the first wins; a row of equal values; a row of -inf; half a row -inf; -0.0 before 0.0 in a row of
    negatives (equal: the first), and after it; a row of -0.0 with one 0.0; NaN at 400 (sign bit set) and 800 beside
    +inf at 5 (torch: the first NaN); -inf but the last column (rows whose keys are negative)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(13, 1200, generator=g)
    for row, cols in ((0, [700, 100]), (1, [64, 63]), (2, [66, 65]), (3, [1199, 1198]), (12, [256, 255])):
        x[row, cols] = 50.0
    x[4] = 1.5
    x[5] = float("-inf")
    x[6, ::2] = float("-inf")
    x[7], x[8] = -x[7].abs() - 1, -x[8].abs() - 1
    x[7, 10], x[7, 500], x[8, 10], x[8, 500] = -0.0, 0.0, 0.0, -0.0
    x[9], x[9, 600] = -0.0, 0.0
    x[10, 400], x[10, 800], x[10, 5] = -float("nan"), float("nan"), float("inf")  # a NaN of either sign
    x[11], x[11, 1199] = float("-inf"), -3.0
    return x.to(dtype)


def _argmax_cases(g, device="cpu"):
    """(name, x, kernel kwargs) for argmax: fp32 / bf16 / fp16 rows of 5000 columns (not a power of two; two chunks
    of the default 4096, or ten slices of 512 in chunks of 128); the ties of _argmax_ties at one chunk, at one slice
    of several chunks and at several slices; [B, k+1, V] views read in place (rows of a padded vocabulary, one
    position's rows: test_argmax_reads_views_in_place_and_falls_back_to_torch) and one copied; one row (a 0-dim
    result), no rows."""
    x = torch.randn(5, 5000, generator=g) * 3
    big = torch.randn(3, 5, 310, generator=g)
    cases = [("fp32", x, {}), ("bf16", x.bfloat16(), {}), ("fp16", x.half(), {}),
             ("slices", x.bfloat16(), dict(slice_cols=512, block=128)),
             ("bkv_padded_view", big[..., :300], dict(slice_cols=64, block=16)),
             ("bkv_position_view", big[:, -1], {}), ("bkv_copied", big[:, 1:4, :300], {}),
             ("one_row", x[0], dict(slice_cols=1024, block=256)), ("no_rows", big[:0], {})]
    for dt in (torch.float32, torch.bfloat16):
        name = str(dt).split(".")[1]
        cases += [(f"ties_{name}", _argmax_ties(dt), {}),
                  (f"ties_{name}_chunks", _argmax_ties(dt), dict(slice_cols=1024, block=64)),
                  (f"ties_{name}_slices", _argmax_ties(dt), dict(slice_cols=256, block=64))]
    return [(n, x.to(device), kw) for n, x, kw in cases]


def _argmax_mismatches(x, kw) -> float:
    """Picks of argmax_triton that differ from torch.argmax's, + 1 for a wrong shape or dtype."""
    from dspark.kernels.argmax import argmax_ref, argmax_triton

    out, ref = argmax_triton(x, **kw), argmax_ref(x)
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return 1.0 + ref.numel()
    return float((out != ref).sum())


def _add_rms_norm_checks(g, device="cpu") -> dict:
    """add_rms_norm: the sum and the norm within fp32 rounding (bf16: a bf16 rounding of the largest value), rows of
    a strided view and a width that is not a power of two."""
    from dspark.kernels.add_rms_norm import add_rms_norm_ref, add_rms_norm_triton

    res = {}
    for name, (shape, H, dtype) in {"add_rms_norm_fp32": ((3, 5), 64, torch.float32),
                                    "add_rms_norm_ragged": ((2, 7), 100, torch.float32),
                                    "add_rms_norm_bf16": ((1, 4), 256, torch.bfloat16)}.items():
        x = torch.randn(*shape, 2 * H, generator=g).to(device, dtype)[..., :H]  # rows of stride 2H
        r = torch.randn(*shape, H, generator=g).to(device, dtype)
        w = (torch.rand(H, generator=g) + 0.5).to(device, dtype)
        with torch.no_grad():
            (s, n), (sr, nr) = add_rms_norm_triton(x, r, w, 1e-6), add_rms_norm_ref(x, r, w, 1e-6)
        tol = 1e-5 if dtype == torch.float32 else 1e-2 * nr.float().abs().max().item()
        res[name] = [max(_err(s, sr), _err(n, nr)), tol]
    return res


def _view_cases(device, seed, shapes=((1, 1, 1), (3, 4, 5), (2, 40, 300), (5, 64, 9))):
    """(num_cached, num_new, table, block size 16, T) cases of B rows, W blocks: cached lengths within the view (a
    prefill's T up to 300 included), num_new from 0 to T."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for B, W, T in shapes:
        table = torch.randint(0, 1000, (B, W), generator=gen)
        nc, nn = torch.randint(0, W * 16 - T + 1, (B,), generator=gen), torch.randint(0, T + 1, (B,), generator=gen)
        cases.append((nc.to(device), nn.to(device), table.to(device), 16, T))
    return cases


def _mask_cases(device, seed):
    """(pos [B, T], L): the positions of _view_cases' steps and their view widths."""
    return [((c[0][:, None] + torch.arange(c[4], device=device)).contiguous(), c[2].shape[1] * 16)
            for c in _view_cases(device, seed)]


def _draft_block_cases(device, seed, shapes=((1, 4, 1, 48), (3, 8, 16, 300), (2, 4, 40, 1100))):
    """(anchors, p0, E [V, H], mask_id, N, L, dtype) cases: B rows, block N, view of L positions (p0 < L), H hidden
    (one beyond a whole inner step of the kernel), an fp32 and a bf16 embedding."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for B, N, L, H in shapes:
        V = 97
        E = torch.randn(V, H, generator=gen)
        anchors, p0 = torch.randint(0, V, (B,), generator=gen), torch.randint(0, L, (B,), generator=gen)
        p0[0] = L - 1
        for e, dt in ((E, torch.float32), (E.bfloat16(), torch.bfloat16)):
            cases.append((anchors.to(device), p0.to(device), e.to(device), V - 2, N, L, dt))
    return cases


def _draft_block_mismatches(cases, op) -> int:
    from dspark.kernels.draft_block import draft_block_ref

    bad = 0
    for c in cases:
        out, ref = op(*c), draft_block_ref(*c)
        bad += sum(x.shape != y.shape or x.stride() != y.stride() or not torch.equal(x, y) for x, y in zip(out, ref))
    return bad


def _attention_cases(device, seed, shapes=((1, 4, 4, 16, 1, 40, 0), (2, 4, 2, 16, 5, 130, 0), (2, 8, 2, 32, 70, 200, 0),
                                           (3, 4, 2, 16, 4, 90, 4), (2, 4, 4, 16, 8, 64, 8)), dtype=torch.float32):
    """(q, pool, rows, lim, extra) cases of B rows, Hq / Hkv heads of dim D, T queries, L positions, NE extra rows:
    q a strided view of a merged [q | k | v] output, each row's positions at random pool rows; without extra rows lim
    is each query's position + 1 (causal, a prefill's 70 queries included), with them one context length per row
    ([B, 1], 0 included) and the extra rows a strided slice."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for B, Hq, Hkv, D, T, L, NE in shapes:
        P = B * L + 7
        pool = torch.randn(P, 2 * Hkv * D, generator=gen)
        rows = torch.stack([torch.randperm(P, generator=gen)[:L] for _ in range(B)])
        q = torch.randn(B, T, Hq + 2 * Hkv, D, generator=gen).transpose(1, 2)[:, :Hq]
        if NE:
            lim = torch.randint(0, L + 1, (B, 1), generator=gen)
            extra = torch.randn(B, NE, 3 * Hkv * D, generator=gen)[..., Hkv * D:]
        else:
            lim, extra = torch.randint(1, L - T + 2, (B, 1), generator=gen) + torch.arange(T), None
        to = lambda x: None if x is None else x.to(device, dtype if x.is_floating_point() else x.dtype)
        cases.append((to(q), to(pool), to(rows), to(lim), to(extra)))
    return cases


def _chain_case(device, seed, op, rows=37, width=5):
    """chain_inputs on one random case: ints [rows, 8 + width] (src -1 for a third of the rows, room from 1), prev
    [23, 9] (a <= 6 accepted drafts); -> ints after op (None: the reference)."""
    from dspark.kernels.chain_inputs import chain_inputs_ref

    gen = torch.Generator().manual_seed(seed)
    ints = torch.randint(0, 1000, (rows, 8 + width), generator=gen)
    ints[:, 2] = torch.randint(1, 8, (rows,), generator=gen)  # num_new
    ints[:, 6] = torch.randint(1, 12, (rows,), generator=gen)  # room
    ints[:, 7] = torch.where(torch.rand(rows, generator=gen) < 1 / 3, -1, torch.randint(0, 23, (rows,), generator=gen))
    prev = torch.randint(0, 1000, (23, 9), generator=gen)
    prev[:, 0] = torch.randint(0, 7, (23,), generator=gen)
    ints, prev = ints.to(device), prev.to(device)
    (op or chain_inputs_ref)(ints, prev, pending=0, num_cached=1, num_new=2, room=6, src=7)
    return ints.cpu()


def _decode_checks(g) -> dict:
    """The bs=1 decode kernels (fp32, interpreter): matvec prologues / in-place residual with ragged N and K."""
    from dspark.kernels.decode_gemv import decode_gemv_ref, decode_gemv_triton, grouped_gemv_ref, grouped_gemv_triton

    res = {}
    x, w, nw = torch.randn(2, 96, generator=g), torch.randn(40, 96, generator=g) * .1, torch.rand(96, generator=g) + .5
    for xs in (x[:1], x):  # one row (the decode step) and two (one program row each)
        res["gemv_plain"] = [max(res.get("gemv_plain", [0])[0], _err(decode_gemv_ref(xs, w),
                                                                     decode_gemv_triton(xs, w, block=(16, 64)))), 1e-5]
        res["gemv_rmsnorm"] = [max(res.get("gemv_rmsnorm", [0])[0], _err(
            decode_gemv_ref(xs, w, "rmsnorm", nw, 1e-6), decode_gemv_triton(xs, w, "rmsnorm", nw, 1e-6, block=(16, 64)))),
            1e-5]
    gu, h = torch.randn(17, 192, generator=g), torch.randn(17, 40, generator=g)  # a 17-token verify's rows
    ref = decode_gemv_ref(gu, w, "silu_mul", residual=h)
    out = decode_gemv_triton(gu, w, "silu_mul", residual=h, out=h, block=(16, 64))
    res["gemv_17rows_silu_mul_residual_inplace"] = [_err(ref, h) + (0.0 if out.data_ptr() == h.data_ptr() else 1.0),
                                                    1e-5]
    gu, h = torch.randn(2, 192, generator=g), torch.randn(2, 40, generator=g)
    ref = decode_gemv_ref(gu, w, "silu_mul", residual=h)
    out = decode_gemv_triton(gu, w, "silu_mul", residual=h, out=h, block=(16, 64))  # h += W @ (silu(g) * u)
    res["gemv_silu_mul_residual_inplace"] = [_err(ref, h) + (0.0 if out.data_ptr() == h.data_ptr() else 1.0), 1e-5]
    ws, xs, idx = torch.randn(5, 40, 72, generator=g) * .1, torch.randn(6, 72, generator=g), torch.tensor([4, 0, 4, 2, 1, 3])
    res["grouped_gemv"] = [_err(grouped_gemv_ref(xs, ws, idx), grouped_gemv_triton(xs, ws, idx, block=(16, 64))), 1e-5]
    res.update(_engine_pair_checks())
    return res


def _engine_pair_checks() -> dict:
    """The tiny K3 and Qwen3 targets with their drafters through the engine with the kernels the models dispatch on
    CUDA (K3: KDA decode/verify, AttnRes mix, grouped expert matvec; Qwen3: q / k norm + RoPE, paged attention; both:
    draft block, Markov loop, argmax, greedy verify; here under the interpreter) vs DSPARK_KERNELS=0 (the torch
    modules): same tokens, same accepted drafts per step, i.e. the kernel wiring in the layers is right."""
    import dspark.kernels.argmax as am
    import dspark.kernels.attn_res as ar
    import dspark.kernels.decode_gemv as dg
    import dspark.kernels.draft_block as db
    import dspark.kernels.glu as gl
    import dspark.kernels.greedy_verify as gv
    import dspark.kernels.kda_decode as kd
    import dspark.kernels.markov_sample as ms
    import dspark.kernels.moe_combine as mc
    import dspark.kernels.moe_route as mr
    import dspark.kernels.paged_attention as pa
    import dspark.kernels.rope as rp
    from tests.targets import make_target
    from tests.test_drafter_k3 import make_k3_drafter
    from tests.test_engine import make_drafter
    from tests.test_runner import live_markov

    calls = {}

    def counted(mod, name):
        fn = getattr(mod, name)

        def wrapper(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **k)
        setattr(mod, name, wrapper)

    for mod, name in ((kd, "kda_decode_triton"), (ar, "attn_res_mix_triton"), (ms, "markov_sample_triton"),
                      (dg, "grouped_gemv_triton"), (rp, "norm_rope_triton"), (rp, "qk_norm_rope_triton"),
                      (gv, "greedy_step_triton"), (pa, "attention_triton"), (db, "draft_block_triton"),
                      (gl, "glu_triton"), (mr, "moe_route_triton"), (mc, "moe_combine_triton"),
                      (am, "argmax_triton")):
        counted(mod, name)
    res = {}
    # K3: the grouped expert matvec serves AR steps (1 token x top-2 of 8 experts < 8 pairs; a verify runs every
    # expert once). Qwen3 drafter head dim 16: the norm + RoPE kernel's power-of-two case
    expect = {"k3": {"kda_decode_triton", "attn_res_mix_triton", "grouped_gemv_triton", "glu_triton",
                     "moe_route_triton", "moe_combine_triton",
                     "norm_rope_triton"},  # the K3 drafter's MLA RoPE
              # q and k of target and drafter in place, their attention over the pool in place
              "qwen3": {"qk_norm_rope_triton", "glu_triton", "attention_triton"}}
    for kind, make in (("k3", make_k3_drafter), ("qwen3", make_drafter)):
        target = make_target(kind)
        drafter = live_markov(make(target))
        calls.clear()
        res.update(_engine_pair(kind, target, drafter, calls))
        missing = (expect[kind] | {"markov_sample_triton", "greedy_step_triton", "draft_block_triton",
                                   "argmax_triton"}) - set(calls)
        assert not missing, f"{kind}: kernels not called: {missing}"
    return res


def _engine_pair(kind, target, drafter, calls: dict) -> dict:
    """One target + drafter through the engine with DSPARK_KERNELS=0 and =1: the three pair metrics (calls: the
    counted kernel launches, none with DSPARK_KERNELS=0)."""
    from dspark.engine import Engine
    from dspark.request import SamplingParams

    outs, ar_outs, batched = {}, {}, {}
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [list(range(5, 16)), list(range(40, 45)), list(range(90, 98))]
    for flag in ("0", "1"):
        os.environ["DSPARK_KERNELS"] = flag
        outs[flag] = Engine(target, drafter, max_batch_size=1).generate(prompts[:1], params)[0]
        ar_outs[flag] = Engine(target, None, max_batch_size=1).generate(prompts[:1], params)[0].token_ids
        # three rows of different lengths in a bucket of 4 (one padding row), AR and speculative
        batched[flag] = [[o.token_ids for o in Engine(target, d, max_batch_size=4).generate(prompts, params)]
                         for d in (None, drafter)]
        assert flag == "1" or not calls
    os.environ.pop("DSPARK_KERNELS")
    ref, ker = outs["0"], outs["1"]
    assert sum(ref.accepted_per_step) > 0  # drafts accepted: the per-position states and context rows are used
    return {f"{kind}_engine_pair_tokens": [float(sum(a != b for a, b in zip(ref.token_ids, ker.token_ids))
                                                 + (ar_outs["0"] != ar_outs["1"])), 0.0],
            f"{kind}_engine_pair_accepted": [float(ref.accepted_per_step != ker.accepted_per_step), 0.0],
            f"{kind}_engine_batch_tokens": [float(batched["0"] != batched["1"]), 0.0]}


@pytest.fixture(scope="module")
def interp():
    pytest.importorskip("triton")
    return interpreter_checks("tests.test_kernels")


ARGMAX_CASES = ["fp32", "bf16", "fp16", "slices", "bkv_padded_view", "bkv_position_view", "bkv_copied", "one_row",
                "no_rows", *(f"ties_{d}{s}" for d in ("float32", "bfloat16") for s in ("", "_chunks", "_slices"))]
INTERP_CASES = ["kda_softplus_final", "kda_lb_allstates_lengths", "kda_lb_nostate", "kda_verify_t9",
                "kda_slots_final_t1", "kda_slots_final_t3_lengths", "kda_slots_allstates_t9", "kda_slots_tuned_on_rows",
                "kda_slots_tuned_on_rows_launches", "kda_commit_ref",
                "kda_commit",
                "kda_t17_softplus", "kda_unmerged_verify_t9", "kda_rule_d128_t4", "kda_rule_d128_verify_t9",
                "kda_strided_slices_t1", "kda_strided_slices_t9",
                "attnres_plain", "attnres_outnorm", "attnres_view_prefix", "mxfp4_fp32", "mxfp4_bf16",
                "mxfp4_grouped", "markov_greedy_1launch", "markov_greedy_steps_3prog", "markov_gumbel_steps_3prog",
                "gemv_plain", "gemv_rmsnorm", "gemv_silu_mul_residual_inplace",
                "gemv_17rows_silu_mul_residual_inplace", "grouped_gemv", "k3_engine_pair_tokens",
                "k3_engine_pair_accepted", "k3_engine_batch_tokens", "chain_inputs", "norm_rope_rows",
                "norm_rope_shared", "qk_norm_rope_inplace", "k_norm_rope_inplace", "qk_norm_rope_sink",
                "k_norm_rope_sink", "rope_only", "rope_interleaved",
                "greedy_step", "greedy_step_minus", "pack_step", "view_indices", "additive_key_mask", "draft_block",
                "paged_attention", "add_rms_norm_fp32",
                "add_rms_norm_ragged", "add_rms_norm_bf16", "glu_silu", "glu_situ", "glu_situ_no_up_clamp",
                "moe_route_sigmoid", "moe_route_sigmoid_renorm", "moe_route_softmax", "moe_route_softmax_renorm",
                "moe_combine_dense", "moe_combine_gathered", "moe_combine_gathered_bf16", "temperature_softmax_fp32",
                "temperature_softmax_small_slices", "temperature_softmax_bf16", "temperature_softmax_bkv",
                "inverse_cdf_fp32", "inverse_cdf_small_slices", "inverse_cdf_bf16", "inverse_cdf_bkv",
                "inverse_cdf_sparse", *(f"argmax_{n}" for n in ARGMAX_CASES), "argmax_dispatch",
                "qwen3_engine_pair_tokens", "qwen3_engine_pair_accepted",
                "qwen3_engine_batch_tokens"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU box tests the compiled kernels (test_cuda_*); the "
                    "interpreter path is the CPU one (its triton 3.6 interpreter also fails on numpy 2.5 scalars)")
@pytest.mark.parametrize("name", INTERP_CASES)
def test_triton_interpreter_matches_reference(interp, name):
    assert name in interp, f"{name}: the interpreter checks gave no result"
    for key in (name, name + "_logit"):
        if key in interp:
            err, tol = interp[key]
            assert err <= tol, f"{key}: max error {err} > {tol}"


# ------------------------------------------------------------------------------------------ references vs the model
def test_kda_kernel_reads_column_slices_in_place():
    """The KDA launcher passes column slices of one [B, T, N] projection output with their row stride (no copy), and
    copies anything else."""
    from dspark.kernels.kda_decode import _rows

    y = torch.randn(3, 9, 40)
    for x in (y[..., 5:21], y[:, -1:, 8:16], y[:1, :, 2:10]):
        got, stride = _rows(x)
        assert got is x and stride == (x.stride(1) if x.shape[1] > 1 else x.stride(0))
    x = y.transpose(0, 1)[..., :8]  # rows not evenly strided across the batch
    got, stride = _rows(x)
    assert got is not x and got.is_contiguous() and stride == 8 and torch.equal(got, x)


def test_kda_config_picks_one_of_the_autotuners_configs():
    """The rule's pick (what launches without DSPARK_KDA_AUTOTUNE) is one of CONFIGS, which the autotuner times, at
    every step shape a server captures: 1..17 tokens, 1..128 rows of 1..96 heads, head dims 16..256."""
    from dspark.kernels.kda_decode import CONFIGS, kda_config

    picks = {kda_config(T, B * H, D) for T in range(1, 18) for B in (1, 2, 4, 16, 64, 128) for H in (1, 6, 32, 96)
             for D in (16, 32, 64, 128, 256)}
    assert picks <= set(CONFIGS), picks - set(CONFIGS)
    assert len(picks) == 5  # each branch is reached
    assert kda_config(9, 384, 128)[0] > kda_config(4, 384, 128)[0]  # a long verify block over many heads: wider


def test_kda_reference_and_fallback_equal_the_layer():
    from dspark.kernels.kda_decode import kda_decode
    from dspark.models.k3.kda import KimiDeltaAttention

    torch.manual_seed(0)
    layer = KimiDeltaAttention(hidden_size=24, num_heads=2, head_dim=8, gate_lower_bound=-5.0)
    with torch.no_grad():
        layer.o_norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(2, 5, 24)
        qkv, gate, f_a, beta = layer.split_in_proj(layer.in_proj(x))
        out, S, ext = kda_decode(qkv, layer.f_b_proj(f_a), beta, gate,
                                 layer.conv_weight(), qkv.new_zeros(2, 3, 48), layer.A_log, layer.dt_bias,
                                 layer.o_norm.weight, None, -5.0)
        assert _err(layer.o_proj(out), layer(x)) <= 1e-5
        assert S.shape == (2, 2, 8, 8) and ext.shape == (2, 8, 48)


def test_attn_res_reference_and_fallback_equal_the_model():
    from dspark.kernels.attn_res import attn_res_mix
    from dspark.models.k3.attn_res import attn_res_naive
    from dspark.models.layers import RMSNorm

    torch.manual_seed(0)
    norm, proj = RMSNorm(32, eps=1e-5), torch.nn.Linear(32, 1, bias=False)
    srcs = [torch.randn(1, 4, 32) * (j + 1) for j in range(5)]
    mix = attn_res_mix(torch.stack([s[0] for s in srcs[:-1]], 1), norm.weight, proj.weight[0], prefix=srcs[-1][0])
    assert _err(mix, attn_res_naive(srcs, norm, proj)[0]) <= 1e-5
    out = attn_res_mix(torch.stack([s[0] for s in srcs], 1), norm.weight, proj.weight[0], out_w=norm.weight)
    assert _err(out, norm(attn_res_naive(srcs, norm, proj)[0])) <= 1e-5


def test_mxfp4_reference_and_fallback_equal_mxfp4_linear():
    from dspark.kernels.mxfp4_matmul import mxfp4_grouped_matmul, mxfp4_matmul
    from dspark.models.k3.mxfp4 import MXFP4Linear

    torch.manual_seed(0)
    lin = MXFP4Linear.from_linear(torch.nn.Linear(64, 40, bias=False))
    x = torch.randn(7, 64)
    y = mxfp4_matmul(x, lin.weight_packed, lin.weight_scale)
    assert _err(y, lin(x)) == 0
    yg = mxfp4_grouped_matmul(x, lin.weight_packed[None].repeat(2, 1, 1), lin.weight_scale[None].repeat(2, 1, 1),
                              torch.tensor([0, 3, 7]))
    assert _err(yg, lin(x)) <= 1e-5  # row subsets: BLAS summation order


def test_glu_and_router_fallbacks_equal_the_model():
    """On the CPU the dispatchers are the references, and the references are what the model trains with: the SiTU
    MLP against the docs' formula, the inference router against LatentMoE.route (the training path)."""
    from dspark.kernels.glu import glu
    from dspark.kernels.moe_route import moe_route
    from dspark.models.k3.config import k3_tiny_config
    from dspark.models.k3.moe import LatentMoE

    torch.manual_seed(0)
    gate, up = torch.randn(5, 24) * 6, torch.randn(5, 24) * 40
    want = 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate) * 25.0 * torch.tanh(up / 25.0)
    with torch.no_grad():
        assert _err(glu(gate, up, "situ", 4.0, 25.0), want) <= 1e-5
        moe = LatentMoE(k3_tiny_config()).eval()
        moe.gate.e_score_correction_bias.normal_(0, 0.05)
        x = torch.randn(9, 64)
        idx, w, _, _ = moe.route(x)
        ki, kw = moe_route(x, moe.gate.weight, moe.gate.e_score_correction_bias, moe.top_k, moe.router_activation,
                           moe.renormalize, moe.scaling)
    assert torch.equal(ki, idx) and _err(kw, w) == 0


def _sample_markov_greedy(U, w1, w2, anchors):
    """Greedy ids through dspark.spec.draft.sample_markov itself (a drafter shim around U, w1, w2)."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from dspark.spec.draft import sample_markov

    def markov(prev):
        m = F.embedding(prev, w1)
        return F.linear(m, w2).float(), m
    shim = SimpleNamespace(base_logits=lambda h: U, markov=markov, confidence=lambda h, m: None)
    B, D, _ = U.shape
    return sample_markov(shim, U.new_zeros(B, D, 1), anchors).draft_ids


def test_markov_reference_and_fallback_equal_sample_markov():
    from dspark.kernels.markov_sample import markov_sample

    torch.manual_seed(0)
    U, w1, w2, anc = torch.randn(4, 6, 500), torch.randn(500, 8), torch.randn(500, 8), torch.randint(0, 500, (4,))
    ids, lg = markov_sample(U, w1, w2, anc)
    assert torch.equal(ids, _sample_markov_greedy(U, w1, w2, anc))
    assert _err(lg, (U + 0).gather(2, ids[..., None])[..., 0] + (w1[torch.cat([anc[:, None], ids[:, :-1]], 1)]
                                                                 * w2[ids]).sum(-1)) <= 1e-5


def test_argmax_reads_views_in_place_and_falls_back_to_torch():
    """The interpreter's [B, k+1, V] view cases read their rows in place through the row stride (padded vocabulary:
    310, one position of five: 1550) and the third is copied; on the CPU the dispatcher gives torch.argmax's picks,
    ties and NaN included."""
    from dspark.kernels import as_rows
    from dspark.kernels.argmax import argmax

    views = {n: x for n, x, _ in _argmax_cases(torch.Generator().manual_seed(0)) if n.startswith("bkv")}
    for name, stride in (("bkv_padded_view", 310), ("bkv_position_view", 1550)):
        rows = as_rows(views[name])[1]
        assert rows.data_ptr() == views[name].data_ptr() and rows.stride() == (stride, 1), name
    assert as_rows(views["bkv_copied"])[1].is_contiguous()
    for dt in (torch.float32, torch.bfloat16):
        x = _argmax_ties(dt)
        assert torch.equal(argmax(x), x.argmax(-1))
        assert argmax(x)[[0, 1, 7, 10]].tolist() == [100, 63, 10, 400]


# ------------------------------------------------------------------------------------------ CUDA, K3 shapes, bf16
@cuda
@pytest.mark.parametrize("T,all_states", [(1, False), (4, True), (9, True), (17, False)])  # each kda_config branch
def test_cuda_kda_decode(T, all_states):
    from dspark.kernels.kda_decode import kda_decode_ref, kda_decode_triton

    inp = _kda_inputs(B=4, T=T, H=32, D=128, dtype=torch.bfloat16, device="cuda")
    inp.update(lower_bound=-5.0, return_all_states=all_states, lengths=torch.tensor([T, 1, T, max(1, T // 2)],
                                                                                     device="cuda"))
    ref, out = kda_decode_ref(**inp), kda_decode_triton(**inp)
    assert _err(out[0], ref[0]) <= 3e-2 * ref[0].float().abs().max().item()  # bf16 output
    # fp32 state; the reference rounds conv/SiLU outputs to bf16, the kernel not (H200: 1.2e-2 .. 1.3e-2 measured)
    assert _err(out[1], ref[1]) <= 2e-2
    assert _err(out[2], ref[2]) == 0


@cuda
def test_cuda_kda_decode_slots():
    checks = {**_kda_slots_checks("cuda", torch.bfloat16, H=32, D=128),
              **_kda_commit_checks("cuda", torch.bfloat16, H=32, D=128)}
    for name, (err, tol) in checks.items():
        assert err <= tol, f"{name}: {err} > {tol}"


@cuda
@pytest.mark.parametrize("N", [1, 64])
def test_cuda_attn_res(N):
    from dspark.kernels.attn_res import attn_res_mix_ref, attn_res_mix_triton

    v = torch.randn(N, 9, 7168, device="cuda").bfloat16()
    nw, q, ow = torch.rand(7168, device="cuda") + .5, torch.randn(7168, device="cuda") * .02, torch.rand(7168, device="cuda")
    for kw in (dict(sources=v), dict(sources=v[:, :8], prefix=v[:, 8].contiguous(), out_w=ow)):
        ref = attn_res_mix_ref(norm_w=nw, query=q, **kw)
        assert _err(attn_res_mix_triton(norm_w=nw, query=q, **kw), ref) <= 2e-2 * ref.float().abs().max().item()


@cuda
@pytest.mark.parametrize("M", [1, 16, 64])
def test_cuda_mxfp4(M):
    from dspark.kernels.mxfp4_matmul import (
        mxfp4_grouped_matmul_ref,
        mxfp4_grouped_matmul_triton,
        mxfp4_matmul_ref,
        mxfp4_matmul_triton,
        quantize_mxfp4,
    )

    for N, K in ((3072, 3584), (3584, 3072)):
        p, s = quantize_mxfp4(torch.randn(N, K, device="cuda") * 0.02)
        x = torch.randn(M, K, device="cuda").bfloat16()
        ref = mxfp4_matmul_ref(x.float(), p, s)
        assert _err(mxfp4_matmul_triton(x, p, s), ref) <= 1e-2 * ref.abs().max().item()
    P, S = torch.stack([p, p.flip(0)]), torch.stack([s, s.flip(0)])
    offs = torch.tensor([0, M // 2, M], device="cuda")
    ref = mxfp4_grouped_matmul_ref(x.float(), P, S, offs)
    assert _err(mxfp4_grouped_matmul_triton(x, P, S, offs), ref) <= 1e-2 * ref.abs().max().item()


@cuda
@pytest.mark.parametrize("B", [1, 64])
def test_cuda_markov(B):
    from dspark.kernels.markov_sample import draft_noise_ref, markov_sample_ref, markov_sample_triton

    V, D, R = 163840, 8, 64
    U = torch.randn(B, D, V, device="cuda") * 3
    w1, w2 = torch.randn(V, R, device="cuda").bfloat16(), (torch.randn(V, R, device="cuda") * 0.1).bfloat16()
    anc = torch.randint(0, V, (B,), device="cuda")
    ri, rl = markov_sample_ref(U, w1, w2, anc)
    for one in (True, False):
        ki, kl = markov_sample_triton(U, w1, w2, anc, one_launch=one)
        assert torch.equal(ki, ri) and _err(kl, rl) <= 1e-3
    temp, noise = torch.rand(B, device="cuda"), torch.rand(B, D, V, device="cuda").clamp(1e-6, 1 - 1e-6)
    ri, _ = markov_sample_ref(U, w1, w2, anc, temp, noise)
    ki, _ = markov_sample_triton(U, w1, w2, anc, temp, noise)
    assert (ki == ri).float().mean() >= 0.99  # Gumbel scores: fp32 near-ties may flip a rare row
    seed = torch.randint(-(2 ** 63), 2 ** 63 - 1, (B,), device="cuda")
    pos = torch.randint(0, 1 << 20, (B,), device="cuda")
    ri, _ = markov_sample_ref(U, w1, w2, anc, temp, draft_noise_ref(seed, pos, D, V))
    ki, _ = markov_sample_triton(U, w1, w2, anc, temp, seed=seed, position=pos)  # the same uniforms, in the kernel
    assert (ki == ri).float().mean() >= 0.99


@cuda
@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("prologue,N,K", [("rmsnorm", 6144, 4096), ("none", 4096, 4096), ("silu_mul", 4096, 12288)])
def test_cuda_decode_gemv(prologue, N, K, M):
    """Qwen3-8B decode shapes in bf16 (M = 1, and 4 rows: one program row each), autotuned tiles: within 1 % of the
    largest output, residual in place."""
    from dspark.kernels.decode_gemv import decode_gemv_ref, decode_gemv_triton

    x = torch.randn(M, 2 * K if prologue == "silu_mul" else K, device="cuda").bfloat16()
    w, nw = (torch.randn(N, K, device="cuda") * 0.02).bfloat16(), (torch.rand(K, device="cuda") + .5).bfloat16()
    h = torch.randn(M, N, device="cuda").bfloat16()
    ref = decode_gemv_ref(x.float(), w.float(), prologue, nw.float(), 1e-6, residual=h.float())
    out = decode_gemv_triton(x, w, prologue, nw, 1e-6, residual=h, out=h)
    assert out.data_ptr() == h.data_ptr() and _err(h, ref) <= 1e-2 * ref.abs().max().item()


@cuda
def test_cuda_grouped_gemv():
    """K3-shape experts in bf16 (64 stacked [2I, R] weights, 4 pairs, repeated experts): within 1 % of the largest
    output of the gathered-copy reference."""
    from dspark.kernels.decode_gemv import grouped_gemv_ref, grouped_gemv_triton

    w = (torch.randn(64, 2 * 1024, 2048, device="cuda") * 0.02).bfloat16()
    x, idx = torch.randn(4, 2048, device="cuda").bfloat16(), torch.tensor([5, 63, 5, 0], device="cuda")
    ref = grouped_gemv_ref(x.float(), w.float(), idx)
    assert _err(grouped_gemv_triton(x, w, idx), ref) <= 1e-2 * ref.abs().max().item()


@cuda
def test_cuda_glu_and_router():
    """k3-mini shapes in bf16: the SiTU-GLU of a 9-token verify's shared expert ([gate | up] halves read in place) and
    the SwiGLU within one bf16 rounding of the torch path; the router's picks equal the reference's wherever its
    scores are not near-tied, weights within 1e-4; the experts' weighted sum within one bf16 ulp."""
    from dspark.kernels.glu import glu_ref, glu_triton
    from dspark.kernels.moe_combine import moe_combine_ref, moe_combine_triton
    from dspark.kernels.moe_route import moe_route_ref, moe_route_triton

    gate, up = (torch.randn(9, 2 * 384, device="cuda") * 4).bfloat16().chunk(2, -1)
    for act, b1, b2 in (("situ", 4.0, 25.0), ("silu", None, None)):
        ref, out = glu_ref(gate, up, act, b1, b2), glu_triton(gate, up, act, b1, b2)
        assert _err(out, ref) <= 1e-2 * ref.float().abs().max().item()
        assert (out != ref).float().mean().item() < 0.05  # most elements bit-equal
    x, w = torch.randn(64, 768, device="cuda").bfloat16(), (torch.randn(16, 768, device="cuda") * 0.05).bfloat16()
    bias = torch.randn(16, device="cuda") * 0.01
    ri, rw, s, _ = moe_route_ref(x, w, bias, 2)
    ki, kw = moe_route_triton(x, w, bias, 2)
    top3 = (s + bias).topk(3, -1).values
    clear = ((top3[:, :-1] - top3[:, 1:]).abs() > 1e-4).all(-1)  # rows whose top-3 biased scores are apart
    assert clear.sum() > 32 and torch.equal(ki[clear], ri[clear])
    assert _err(kw[clear], rw[clear]) <= 1e-4
    y = torch.randn(16, 9, 768, device="cuda").bfloat16()  # a 9-token verify, every expert: [E, N, R]
    idx, wt = ri[:9], rw[:9]
    ref, out = moe_combine_ref(y, wt, idx, torch.bfloat16), moe_combine_triton(y, wt, idx, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and _err(out, ref) <= 2 ** -7 * ref.float().abs().max().item()  # one ulp


@cuda
def test_cuda_chain_inputs():
    """The chain kernel at one row and at a regeneration's batch (512 rows, two programs) equals its reference."""
    from dspark.kernels.chain_inputs import chain_inputs_triton

    for seed, rows in ((0, 1), (1, 512)):
        assert torch.equal(_chain_case("cuda", seed, chain_inputs_triton, rows=rows), _chain_case("cpu", seed, None,
                                                                                                 rows=rows))


@cuda
@pytest.mark.parametrize("T", [1, 9])
def test_cuda_norm_rope(T):
    """Qwen3-8B's q / k heads (32 / 8 x 128) as views of the merged projection, bf16, positions up to 32k: within bf16
    rounding of the torch path (a share of the elements differ in their last bit: dspark/kernels/rope.py)."""
    from dspark.kernels.rope import Rope, norm_rope_ref, norm_rope_triton

    B, D = 4, 128
    y = torch.randn(B, T, (32 + 16) * D, device="cuda").bfloat16()
    w = (torch.rand(D, device="cuda") + 0.5).bfloat16()
    rope = Rope(torch.randint(0, 32768, (B, T), device="cuda"), D, 1e6)
    for x in (y[..., :32 * D].view(B, T, 32, D), y[..., 32 * D: 40 * D].view(B, T, 8, D)):
        ref, out = norm_rope_ref(x, w, 1e-6, rope), norm_rope_triton(x, w, 1e-6, rope)
        assert out.shape == ref.shape
        assert _err(out, ref) <= 2e-2 * ref.float().abs().max().item()


@cuda
@pytest.mark.parametrize("T", [1, 5])
def test_cuda_qk_norm_rope_sink(T):
    """In place on Qwen3-8B's merged [q 32 | k 8 | v 8] x 128 output in bf16 with a sink: q and k within bf16 rounding
    of the torch path, each token's [k | v] row in its pool row bit for bit as it is in place, other rows untouched."""
    from dspark.kernels.rope import Rope, norm_rope_ref, qk_norm_rope_

    B, D = 4, 128
    y = torch.randn(B, T, 48 * D, device="cuda").bfloat16()
    w, wk = ((torch.rand(D, device="cuda") + 0.5).bfloat16() for _ in range(2))
    rope = Rope(torch.randint(0, 32768, (B, T), device="cuda"), D, 1e6)
    pool = torch.zeros(3 * B * T, 16 * D, device="cuda", dtype=torch.bfloat16)
    dest = torch.randperm(3 * B * T, device="cuda")[:B * T]
    x = y.clone()
    qk_norm_rope_(x.view(B, T, 48, D), 32, w, wk, 1e-6, rope, n_v=8, sink=(pool, dest))
    for got, src, wt in ((x[..., :32 * D], y[..., :32 * D], w), (x[..., 32 * D:40 * D], y[..., 32 * D:40 * D], wk)):
        ref = norm_rope_ref(src.view(B, T, -1, D), wt, 1e-6, rope).transpose(1, 2).flatten(2)
        assert _err(got, ref) <= 2e-2 * ref.float().abs().max().item()
    assert torch.equal(x[..., 40 * D:], y[..., 40 * D:])
    assert torch.equal(pool[dest], x[..., 32 * D:].reshape(B * T, -1))
    rest = torch.ones(3 * B * T, dtype=torch.bool, device="cuda").index_fill_(0, dest, False)
    assert not pool[rest].any()


@cuda
@pytest.mark.parametrize("T", [1, 8])
def test_cuda_rope_interleaved(T):
    """The K3 drafter's MLA RoPE (interleaved pairs, rope dim 64, 6 heads as the rope slice of merged [nope | rope]
    heads) in bf16, positions up to 8k: within bf16 rounding of the torch path."""
    from dspark.kernels.rope import Rope, apply_rope_interleaved, norm_rope_triton

    B, H, D = 4, 6, 64
    x = torch.randn(B, T, H, 128 + D, device="cuda").bfloat16()[..., 128:]
    rope = Rope(torch.randint(0, 8192, (B, T), device="cuda"), D, 50000.0)
    ref = apply_rope_interleaved(x.transpose(1, 2), *rope.cos_sin(x.dtype))
    out = norm_rope_triton(x, None, 0.0, rope, interleaved=True)
    assert out.shape == ref.shape
    assert _err(out, ref) <= 2e-2 * ref.float().abs().max().item()


@cuda
def test_cuda_greedy_step():
    """The greedy verify + pack kernel (and its pack of a sampled step) at one row, a batch bucket and a
    regeneration's 512 rows equals its reference."""
    from dspark.kernels.greedy_verify import greedy_step_ref, greedy_step_triton, pack_step_ref, pack_step_triton

    for d, top, n in _greedy_cases("cuda", 5, shapes=((1, 8), (64, 4), (512, 7), (32, 0))):
        assert torch.equal(greedy_step_triton(d, top, n), greedy_step_ref(d, top, n))
        assert torch.equal(greedy_step_triton(d, top, _column(n + 1), minus=1), greedy_step_ref(d, top, n))
    for c in _pack_cases("cuda", 5, shapes=((1, 8), (64, 4), (512, 7))):
        assert torch.equal(pack_step_triton(*c), pack_step_ref(*c))



@cuda
def test_cuda_add_rms_norm():
    """The fused residual add + RMSNorm in fp32 and bf16 against the add and torch's RMSNorm."""
    g = torch.Generator().manual_seed(3)
    for name, (err, tol) in _add_rms_norm_checks(g, "cuda").items():
        assert err <= tol, f"{name}: {err} > {tol}"


@cuda
def test_cuda_view_indices():
    """A step's cache indices and its additive key mask (fp32, bf16) equal their torch definitions."""
    from dspark.kernels.view_indices import (
        additive_key_mask_ref,
        additive_key_mask_triton,
        view_indices_ref,
        view_indices_triton,
    )

    for c in _view_cases("cuda", 5, shapes=((1, 8, 1), (16, 32, 9), (64, 256, 5), (2, 128, 2048))):
        assert all(torch.equal(x, y) for x, y in zip(view_indices_triton(*c), view_indices_ref(*c)))
    for p, L in _mask_cases("cuda", 5):
        for dt in (torch.float32, torch.bfloat16):
            assert torch.equal(additive_key_mask_triton(p, L, dt), additive_key_mask_ref(p, L, dt))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_paged_attention(dtype):
    """Attention over the pool in place against the gathered rows + mask + SDPA: the interpreter's cases, and
    Qwen3-8B's heads (32 / 8 x 128) at 64 rows of a verify step (9 queries) over 2048 positions and a drafter's block
    of 8 over 1000; within bf16 rounding in bf16."""
    from dspark.kernels.paged_attention import attention_ref, attention_triton

    shapes = ((1, 4, 4, 16, 1, 40, 0), (2, 4, 2, 16, 5, 130, 0), (2, 8, 2, 32, 70, 200, 0), (3, 4, 2, 16, 4, 90, 4),
              (64, 32, 8, 128, 9, 2048, 0), (16, 32, 8, 128, 8, 1000, 8))
    for c in _attention_cases("cuda", 5, shapes, dtype):
        out, ref = attention_triton(*c), attention_ref(*c)
        assert out.shape == ref.shape
        tol = 2e-5 if dtype == torch.float32 else 2e-2 * ref.float().abs().max().item()
        assert _err(out, ref) <= tol


@cuda
def test_cuda_draft_block():
    """A draft step's block embeddings, positions and padded additive mask (fp32, bf16) equal their torch
    definitions, values and strides."""
    from dspark.kernels.draft_block import draft_block_triton

    cases = _draft_block_cases("cuda", 5, shapes=((1, 4, 16, 256), (16, 8, 640, 2048), (64, 8, 2048, 4096)))
    assert _draft_block_mismatches(cases, draft_block_triton) == 0


@cuda
def test_cuda_argmax():
    """argmax: the interpreter's cases on the GPU, and a decode step's logits (1 and 9 positions; 1, 16 and 64 rows)
    at the quickstart's vocabulary (4096: one launch) and K3's (163840: twenty slices), bf16 and fp32, with the max
    at the last column and tied at column 7 in one row."""
    from dspark.kernels.argmax import argmax

    for name, x, kw in _argmax_cases(torch.Generator().manual_seed(0), "cuda"):
        assert _argmax_mismatches(x, kw) == 0, name
    torch.manual_seed(0)
    for V, shapes in ((4096, ((1, 1), (1, 9), (64, 9))), (163840, ((1, 1), (1, 9), (16, 9)))):
        for B, T in shapes:
            for dt in (torch.bfloat16, torch.float32):
                x = (torch.randn(B, T, V, device="cuda") * 3).to(dt)
                x[0, -1, V - 1] = x[-1, 0, [7, V - 1]] = 100.0
                assert torch.equal(argmax(x), x.argmax(-1)), (V, B, T, dt)


@cuda
def test_cuda_sampling_kernels():
    """temperature_softmax and inverse_cdf: the interpreter's cases on the GPU; inverse_cdf at K3's vocabulary (163840) at 1, 9 and 64 rows of temperature-0.7 softmaxes and
    of rejection residuals max(p - q, 0), every pick valid and nearly all equal to the torch definition's; and 20000
    draws from one 64-column distribution (a quarter of it zero) with the frequencies it gives (chi-square, p > 1e-4)."""
    from dspark.kernels.inverse_cdf import inverse_cdf_ref, inverse_cdf_triton
    from dspark.kernels.temperature_softmax import temperature_softmax_ref, temperature_softmax_triton
    from dspark.spec.sampling import process_logits

    g = torch.Generator().manual_seed(0)
    for name, x, t, kw in _softmax_cases(g):
        x, t = x.cuda(), t.cuda()
        assert _err(temperature_softmax_triton(x, t, **kw), temperature_softmax_ref(x, t)) <= 1e-6, name
    for name, w, u, kw in _icdf_cases(g, "cuda"):
        ids = inverse_cdf_triton(w, u, **kw)
        assert _icdf_invalid(w, u, ids) == 0 and torch.equal(ids, inverse_cdf_ref(w, u)), name
    for R in (1, 9, 64):
        p = process_logits(torch.randn(R, 163840, device="cuda") * 3, 0.7)
        q = process_logits(torch.randn(R, 163840, device="cuda") * 3, 0.7)
        u = torch.rand(R, device="cuda")
        for w in (p, (p - q).clamp(min=0)):
            ids = inverse_cdf_triton(w, u)
            assert _icdf_invalid(w, u, ids) == 0
            assert (ids != inverse_cdf_ref(w, u)).float().mean().item() <= 0.05
    probs = torch.rand(64, generator=g)
    probs[torch.randperm(64, generator=g)[:16]] = 0
    n = 20000
    ids = inverse_cdf_triton(probs.cuda().expand(n, 64), torch.rand(n, generator=g).cuda())
    seen, want = torch.bincount(ids.cpu(), minlength=64).double(), probs.double() / probs.sum() * n
    assert seen[probs == 0].sum() == 0
    chi2 = ((seen - want)[probs > 0] ** 2 / want[probs > 0]).sum().item()
    assert chi2 < 92.0, chi2  # 47 degrees of freedom: p = 1e-4 at 92
