"""The fused kernels of a sampled speculative step (dspark/kernels/counter_uniform.py, rejection_verify.py): each
against its torch reference (the uniforms bit for bit), the verifier's reference against verify_sampled's general
form, a step's output distribution against the target's (chi-square), and the engine with them on and off.

CPU: the kernels run under TRITON_INTERPRET=1 in a subprocess (triton reads the variable when a kernel is decorated,
as in tests/test_kernels.py). CUDA (skipped without a GPU): the k3-mini / quickstart vocabularies in bf16.
"""
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dspark.kernels.rejection_verify import rejection_verify_ref
from dspark.kernels.temperature_softmax import temperature_softmax_ref
from dspark.spec.draft import markov_drafts, sample_markov
from dspark.spec.sampling import RowSampling
from dspark.spec.verify import verify_sampled
from tests.interp import interpreter_checks

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CHI2_5DOF_P1E4 = 25.7  # chi-square with 5 degrees of freedom: p = 1e-4


def _verify_inputs(g, B=8, K=3, V=300, dtype=torch.float32, onehot=False, device="cpu"):
    """Target logits with drafts that are often accepted: q near p (drafts sampled from it, or its argmax)."""
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    t = torch.tensor([0.7, 0.0, 1.0, 0.3, 0.7, 0.0, 1.5, 0.7] * (B // 8 + 1))[:B]
    near = logits[:, :K] + torch.randn(B, K, V, generator=g) * 0.3
    q = temperature_softmax_ref(near, t[:, None].expand(B, K))
    drafts = near.argmax(-1) if onehot else torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    n = torch.full((B,), K)
    n[3 % B] = K - 1
    n[4 % B] = 0
    if B > 6 and K > 1:
        drafts[6, 1] = -1  # a placeholder: always rejected, the block ends before it
    u = torch.rand(B, K + 1, generator=g)
    to = lambda x: x.to(device)
    return to(logits.to(dtype)), to(t), to(drafts), to(n), None if onehot else to(q), to(u)


def _draw(U, w1, w2, anchors, t, u):
    """Sampled Markov drafts and their distributions through sample_markov's torch loop (a drafter shim around U, w1,
    w2) -> (ids [B, D], q [B, D, V])."""
    prop = sample_markov(_shim(U, w1, w2), U.new_zeros(*U.shape[:2], 1), anchors, RowSampling(t), u)
    return prop.draft_ids, prop.draft_probs


def _uniform_cases(device="cpu"):
    """(seed, counter, n): int64 extremes, per-row counters past 2^32, scalar counters small and large, a row of
    several programs."""
    s = torch.tensor([0, 1, -5, 2 ** 62, -(2 ** 63), 123456789012345], dtype=torch.long, device=device)
    c = torch.tensor([0, 7, 2 ** 40, 5, 99, 2 ** 50], dtype=torch.long, device=device)
    return [(s, c, 9), (s, 3, 1), (s, 2 ** 45, 17), (s[:2], c[:2], 2500)]


def _shim(U, w1, w2):
    """A drafter around base logits U [B, D, V] and a Markov head w1, w2 [V, r] (what sample_markov and markov_drafts
    read of one)."""
    def markov(prev):
        m = F.embedding(prev, w1)
        return F.linear(m, w2).float(), m
    head = SimpleNamespace(markov_w1=SimpleNamespace(weight=w1), markov_w2=SimpleNamespace(weight=w2))
    return SimpleNamespace(base_logits=lambda h: U, markov=markov, confidence=lambda h, m: None, markov_head=head,
                           config=SimpleNamespace(logit_scale=1.0))


def _draw_gumbel(U, w1, w2, anchors, t, _u):
    """Sampled Markov drafts by Gumbel-max from each row's counter-based uniforms (markov_drafts: the Markov kernel on
    CUDA or under the interpreter, else its reference); row b has seed b, all at position 5 -> (ids, q)."""
    B = U.shape[0]
    seed, pos = torch.arange(B, device=U.device) * 7919 - 3, torch.full((B,), 5, device=U.device)
    prop = markov_drafts(_shim(U, w1, w2), U.new_zeros(*U.shape[:2], 1), anchors, t, seed, pos)
    return prop.draft_ids, prop.draft_probs


def _first_token_chi2(verify, V=6, B=2000, device="cpu", draw=None) -> float:
    """B independent rows of one step (same target and drafter, own uniforms; drafts sampled from the drafter's
    distributions by draw: the torch loop's inverse CDF by default): the first emitted token (the first draft if
    accepted, else the resample) against the target's distribution p_0 at T = 0.8."""
    g = torch.Generator().manual_seed(7)
    K, t = 2, torch.full((B,), 0.8)
    logits = (torch.randn(1, K + 1, V, generator=g) * 1.5).expand(B, -1, -1).contiguous()
    U = (torch.randn(1, K, V, generator=g)).expand(B, -1, -1).contiguous()
    w1, w2 = torch.randn(V, 4, generator=g) * 0.5, torch.randn(V, 4, generator=g) * 0.5
    anchors = torch.zeros(B, dtype=torch.long)
    ud, uv = torch.rand(B, K, generator=g), torch.rand(B, K + 1, generator=g)
    to = lambda x: x.to(device)
    ids, q = (draw or _draw)(to(U), to(w1), to(w2), to(anchors), to(t), to(ud))
    a, nxt = verify(to(logits), to(t), ids, to(torch.full((B,), K)), q, to(uv))
    first = torch.where(a >= 1, ids[:, 0], nxt).cpu()
    p0 = temperature_softmax_ref(logits[0, 0], torch.tensor(0.8)).double()
    seen, want = torch.bincount(first, minlength=V).double(), p0 * B
    return ((seen - want) ** 2 / want).sum().item()


# ------------------------------------------------------------------------------------------ interpreter (subprocess)
def _interp_checks() -> dict:
    """Run with TRITON_INTERPRET=1: {name: [error, tolerance]}."""
    from dspark.kernels import interpreting
    from dspark.kernels.counter_uniform import counter_uniform_ref, counter_uniform_triton
    from dspark.kernels.rejection_verify import rejection_verify_triton

    assert interpreting()
    g = torch.Generator().manual_seed(0)
    res = {"counter_uniform": [float(sum((counter_uniform_triton(*c) != counter_uniform_ref(*c)).sum().item()
                                         for c in _uniform_cases())), 0.0]}
    for name, kw, block in (("verify_q", {}, 128), ("verify_onehot", {"onehot": True}, 128),
                            ("verify_bf16", {"dtype": torch.bfloat16}, 256), ("verify_k1", {"K": 1}, 1024)):
        x, t, d, n, q, u = _verify_inputs(g, **kw)
        a, nxt = rejection_verify_triton(x, t, d, n, q, u, block=block)
        ar, nr = rejection_verify_ref(x, t, d, n, q, u)
        res[name] = [float((a != ar).sum() + (nxt != nr).sum()), 0.0]
        res[name + "_accepts"] = [float(ar.sum() == 0), 0.0]  # the case exercises acceptances
    # drafts as a view of [anchor | drafts] (rows of stride K + 1), as the Markov kernel hands them over
    x, t, d, n, q, u = _verify_inputs(g)
    a, nxt = rejection_verify_triton(x, t, torch.cat([d[:, :1] * 0 - 5, d], 1)[:, 1:], n, q, u)
    ar, nr = rejection_verify_ref(x, t, d, n, q, u)
    res["verify_strided_drafts"] = [float((a != ar).sum() + (nxt != nr).sum()), 0.0]
    # 300 rows (the interpreter runs each row's program in turn: ~0.15 s a row); the reference takes 2000 below and
    # the compiled kernel 20000 on CUDA, and the cases above compare the kernel with the reference pick for pick
    res["pair_first_token_chi2"] = [_first_token_chi2(lambda *a: rejection_verify_triton(*a, block=16), B=300),
                                    CHI2_5DOF_P1E4]
    res["pair_gumbel_first_token_chi2"] = [_first_token_chi2(lambda *a: rejection_verify_triton(*a, block=16), B=300,
                                                             draw=_draw_gumbel), CHI2_5DOF_P1E4]
    res.update(_engine_checks())
    return res


def _engine_checks() -> dict:
    """Seeded T = 0.7 requests through the engine (the tiny Qwen3 target, a drafter with a live Markov head) with the
    kernels on (the uniforms, the Markov drafts, the verifier and the pack all called) and off (the torch path): the
    same tokens."""
    import dspark.kernels.counter_uniform as cu
    import dspark.kernels.greedy_verify as gv
    import dspark.kernels.markov_sample as ms
    import dspark.kernels.rejection_verify as rv
    from dspark.engine import Engine
    from dspark.request import SamplingParams
    from tests.targets import make_target
    from tests.test_engine import make_drafter
    from tests.test_runner import live_markov

    calls = {}
    for mod, name in ((cu, "counter_uniform_triton"), (rv, "rejection_verify_triton"), (ms, "markov_sample_triton"),
                      (gv, "pack_step_triton")):
        fn = getattr(mod, name)

        def wrapper(*a, _fn=fn, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)
        setattr(mod, name, wrapper)
    target = make_target("qwen3")
    drafter = live_markov(make_drafter(target))
    prompts = [list(range(5, 16)), list(range(40, 45)), list(range(90, 98))]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=tt, seed=s)
              for tt, s in ((0.7, 1), (1.0, 2), (0.0, None))]
    outs = {}
    for flag in ("0", "1"):
        os.environ["DSPARK_KERNELS"] = flag
        outs[flag] = [o.token_ids for o in Engine(target, drafter, max_batch_size=4).generate(prompts, params)]
        assert flag == "1" or not calls
    os.environ.pop("DSPARK_KERNELS")
    return {"engine_sampled_tokens": [float(outs["0"] != outs["1"]), 0.0],
            "engine_fused_kernels_called": [float(len(calls) != 4), 0.0]}


@pytest.fixture(scope="module")
def interp():
    pytest.importorskip("triton")
    return interpreter_checks("tests.test_sampled_kernels")


INTERP_CASES = ["counter_uniform", "verify_q", "verify_onehot", "verify_bf16", "verify_k1", "verify_strided_drafts", "pair_first_token_chi2",
                "pair_gumbel_first_token_chi2", "engine_sampled_tokens", "engine_fused_kernels_called"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU box tests the compiled kernels (test_cuda_*)")
@pytest.mark.parametrize("name", INTERP_CASES)
def test_triton_interpreter_matches_reference(interp, name):
    for key in (name, name + "_q", name + "_accepts"):
        if key in interp:
            err, tol = interp[key]
            assert err <= tol, f"{key}: {err} > {tol}"


# ------------------------------------------------------------------------------------------ references vs the torch path
@pytest.mark.parametrize("onehot", [False, True])
def test_verify_reference_equals_the_general_rejection_path(onehot):
    """rejection_verify_ref = process_logits + verify_rejection on sampled rows, verify_greedy on greedy ones (what
    verify_sampled runs where the kernel does not: on this CPU)."""
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, t, d, n, q, u = _verify_inputs(g, onehot=onehot)
        a, nxt = verify_sampled(d, q, x, RowSampling(t), n, u)
        ar, nr = rejection_verify_ref(x, t, d, n, q, u)
        assert torch.equal(a, ar) and torch.equal(nxt, nr)
        assert ar.sum() > 0


def test_reference_pair_keeps_the_target_distribution():
    """The reference verifier: the first emitted token follows the target's distribution (chi-square, p > 1e-4), with
    drafts from the torch loop and from Gumbel-max (markov_drafts)."""
    assert _first_token_chi2(rejection_verify_ref) < CHI2_5DOF_P1E4
    assert _first_token_chi2(rejection_verify_ref, draw=_draw_gumbel) < CHI2_5DOF_P1E4


def _gumbel_case(B=4000, V=6, D=3):
    g = torch.Generator().manual_seed(3)
    U = (torch.randn(1, D, V, generator=g) * 1.5).expand(B, -1, -1).contiguous()
    w1, w2 = torch.randn(V, 4, generator=g) * 0.5, torch.randn(V, 4, generator=g) * 0.5
    return U, w1, w2, torch.full((B,), 2), torch.full((B,), 0.8)


def test_gumbel_drafts_follow_the_distributions_they_report():
    """markov_drafts: over rows with their own seeds, the first draft follows q[:, 0] and the second, among rows whose
    first draft is the most common one, follows that prefix's q[:, 1] (chi-square, p > 1e-4); q is process_logits
    of each position's logits given the drafted prefix, as the torch loop forms it."""
    U, w1, w2, anchors, t = _gumbel_case()
    ids, q = _draw_gumbel(U, w1, w2, anchors, t, None)
    for j in range(U.shape[1]):
        prev = anchors if j == 0 else ids[:, j - 1]
        want = temperature_softmax_ref(U[:, j] + F.linear(F.embedding(prev, w1), w2), t)
        assert torch.allclose(q[:, j], want, atol=1e-6)
    V = U.shape[-1]

    def chi2(x, p):
        seen, want = torch.bincount(x, minlength=V).double(), p.double() * len(x)
        return ((seen - want) ** 2 / want).sum().item()
    assert chi2(ids[:, 0], q[0, 0]) < CHI2_5DOF_P1E4
    top = ids[:, 0].mode().values
    rows = ids[:, 0] == top
    assert chi2(ids[rows, 1], q[rows][0, 1]) < CHI2_5DOF_P1E4


def test_gumbel_drafts_depend_on_the_rows_seed_and_position_alone():
    """A row drafts the same tokens alone or in any batch; another seed or position draws other tokens."""
    U, w1, w2, anchors, t = _gumbel_case(B=64, V=50, D=4)
    U = U + torch.randn(U.shape, generator=torch.Generator().manual_seed(4))  # rows differ
    seed, pos = torch.arange(64) * 31 + 1, torch.arange(64) + 100
    shim = _shim(U, w1, w2)
    h = U.new_zeros(64, 4, 1)
    ids = markov_drafts(shim, h, anchors, t, seed, pos).draft_ids
    for b in (0, 17, 63):
        alone = markov_drafts(_shim(U[b:b + 1], w1, w2), h[b:b + 1], anchors[b:b + 1], t[b:b + 1], seed[b:b + 1],
                              pos[b:b + 1]).draft_ids
        assert torch.equal(alone[0], ids[b])
    assert not torch.equal(markov_drafts(shim, h, anchors, t, seed + 1, pos).draft_ids, ids)
    assert not torch.equal(markov_drafts(shim, h, anchors, t, seed, pos + 1).draft_ids, ids)


# ------------------------------------------------------------------------------------------ CUDA
@cuda
@pytest.mark.parametrize("B,K,V", [(1, 4, 4096), (16, 4, 8192), (64, 8, 8192)])
def test_cuda_rejection_verify(B, K, V):
    """The compiled kernel at the quickstart / k3-mini vocabularies, bf16 logits: the same accepted counts and next
    tokens as the reference (up to fp32 rounding at a cumulative boundary: >= 98 % of rows)."""
    from dspark.kernels.rejection_verify import rejection_verify_triton

    g = torch.Generator().manual_seed(B)
    x, t, d, n, q, u = _verify_inputs(g, B=B, K=K, V=V, dtype=torch.bfloat16, device="cuda")
    a, nxt = rejection_verify_triton(x, t, d, n, q, u)
    ar, nr = rejection_verify_ref(x, t, d, n, q, u)
    assert (a == ar).float().mean().item() >= 0.98 and (nxt == nr).float().mean().item() >= 0.98


@cuda
def test_cuda_counter_uniform_bit_for_bit():
    from dspark.kernels.counter_uniform import counter_uniform_ref, counter_uniform_triton

    for case in _uniform_cases("cuda"):
        assert torch.equal(counter_uniform_triton(*case), counter_uniform_ref(*case))


@cuda
def test_cuda_pair_keeps_the_target_distribution():
    from dspark.kernels.rejection_verify import rejection_verify_triton

    assert _first_token_chi2(rejection_verify_triton, B=20000, device="cuda") < CHI2_5DOF_P1E4
