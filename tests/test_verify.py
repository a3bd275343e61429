"""Verification: greedy cases by hand; rejection and block verification preserve the target distribution (χ²,
with a broken verifier as the power check), with every random number from the counter RNG; greedy rows in a mixed
batch reproduce greedy verification exactly; the vectorised verifiers equal a float64 sequential reference;
adaptive verification lengths (host and device forms)."""
import math

import pytest
import torch

from dspark.spec.sampling import counter_uniform, process_logits, sample_from, sample_rows
from dspark.spec.verify import (
    choose_verify_lengths,
    choose_verify_lengths_device,
    verify_block,
    verify_greedy,
    verify_rejection,
)

V, K, N = 5, 3, 20000


def _logits(rows):  # rows of argmax ids -> logits [B, T, V] with that argmax
    ids = torch.tensor(rows)
    return torch.nn.functional.one_hot(ids, V).float() * 3.0 + 0.1 * torch.arange(V).float()


def test_greedy_hand_cases():
    tgt = _logits([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0]])
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [4, 2, 3], [1, 2, 3], [1, -1, 3], [0, 0, 0]])
    nd = torch.tensor([3, 3, 3, 1, 3, 0])
    acc, nxt = verify_greedy(drafts, tgt, nd)
    assert acc.tolist() == [3, 1, 0, 1, 1, 0]  # all / some / none / num_drafts<k / placeholder / no drafts
    assert nxt.tolist() == [4, 2, 1, 2, 2, 0]


@pytest.mark.parametrize("verifier", [verify_rejection, verify_block])
def test_zero_drafts(verifier):
    p = torch.tensor([[[0.0, 0.0, 1.0, 0.0, 0.0]]])  # [1, 1, V]
    for q in (None, torch.zeros(1, 0, V)):
        acc, nxt = verifier(torch.zeros(1, 0, dtype=torch.long), q, p, torch.tensor([0]), torch.tensor([[0.7]]))
        assert acc.tolist() == [0] and nxt.tolist() == [2]
    acc, nxt = verify_greedy(torch.zeros(1, 0, dtype=torch.long), p, torch.tensor([0]))
    assert acc.tolist() == [0] and nxt.tolist() == [2]


# --- distribution tests: target p and drafter q are fixed autoregressive tables over prefixes of depth <= K ---
def _tables(seed, scale):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*([V] * d), V, generator=g) * scale).softmax(-1) for d in range(K + 1)]


P, Q = _tables(1, 1.0), _tables(2, 1.5)


def _dist(tables, prefix):  # prefix [N, d] -> [N, V]
    t = tables[prefix.shape[1]]
    return t[tuple(prefix.T)] if prefix.shape[1] else t.expand(prefix.shape[0], V)


def _one_step(verifier, seed, probabilistic=True, num_drafts=None, n=N, m=2):
    """One verification step on n independent rows (one request each, seeded by its row); returns the first m
    emitted tokens [n, m] (tokens past what the step emits are drawn from the target, as any lossless next step
    would). Counters 0..K-1 draft, K..2K verify, 2K+1.. draw the follow-up tokens."""
    u = counter_uniform(torch.arange(n) + seed * 10 ** 6, 0, 2 * K + m)
    drafts = torch.zeros(n, 0, dtype=torch.long)
    qs = []
    for i in range(K):
        q = _dist(Q, drafts)
        qs.append(q)
        x = sample_from(q, u[:, i]) if probabilistic else q.argmax(-1)
        drafts = torch.cat([drafts, x[:, None]], 1)
    p = torch.stack([_dist(P, drafts[:, :i]) for i in range(K + 1)], 1)  # [n, K+1, V]
    q = torch.stack(qs, 1) if probabilistic else None
    nd = torch.full((n,), K) if num_drafts is None else num_drafts
    acc, nxt = verifier(drafts, q, p, nd, u[:, K:2 * K + 1])
    return _emitted(drafts, acc, nxt, u[:, 2 * K + 1:], m)


def _emitted(drafts, acc, nxt, u_next, m):
    """The first m tokens a row emits: d1..d_acc, next, then target samples (uniforms u_next [n, m-1])."""
    n = drafts.shape[0]
    out = torch.cat([drafts, torch.zeros(n, 1, dtype=torch.long)], 1)
    out[torch.arange(n), acc] = nxt
    for j in range(1, m):
        nxt = sample_from(_dist(P, out[:, :j]), u_next[:, j - 1])
        out[:, j] = torch.where(acc >= j, out[:, j], nxt)
    return out[:, :m]


def _chi2_pvalue(counts, probs):
    exp = probs * counts.sum()
    assert exp.min() >= 5, "cells too small for the chi-square approximation"
    stat = ((counts - exp) ** 2 / exp).sum()
    dof = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat.double() / 2))


def _pvalues(tokens):
    first = torch.bincount(tokens[:, 0], minlength=V).double()
    joint = torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V).double()
    p_joint = (P[0][:, None] * P[1]).flatten().double()
    return _chi2_pvalue(first, P[0].double()), _chi2_pvalue(joint, p_joint)


def _accept_always(drafts, q, p, nd, u):
    return nd.clone(), sample_from(p[torch.arange(len(nd)), nd], u[:, K])


def _residual_from_p(drafts, q, p, nd, u):  # a plausible bug: after a rejection resample from p, not max(p-q, 0)
    B = len(nd)
    ratio = p[:, :K].gather(-1, drafts[..., None])[..., 0] / q.gather(-1, drafts[..., None])[..., 0]
    acc = (u[:, :K] < ratio).long().cumprod(1).sum(1).minimum(nd)
    return acc, sample_from(p[torch.arange(B), acc], u[:, K])


@pytest.mark.parametrize("verifier", [verify_rejection, verify_block])
@pytest.mark.parametrize("probabilistic", [True, False])
def test_lossless(verifier, probabilistic):
    nd = torch.arange(N) % (K + 1)  # rows verify 0..K drafts
    for seed, num_drafts in [(10, None), (11, nd)]:
        p1, p2 = _pvalues(_one_step(verifier, seed, probabilistic, num_drafts))
        assert p1 > 1e-3 and p2 > 1e-3, (verifier.__name__, probabilistic, p1, p2)


@pytest.mark.parametrize("verifier", [verify_rejection, verify_block])
def test_lossless_three_tokens(verifier):
    """Joint of the first three emitted tokens (125 cells): exercises h_i and the residual past the first slot."""
    tok = _one_step(verifier, 13, n=100_000, m=3)
    counts = torch.bincount((tok[:, 0] * V + tok[:, 1]) * V + tok[:, 2], minlength=V ** 3).double()
    probs = (P[0][:, None, None] * P[1][:, :, None] * P[2]).flatten().double()
    assert _chi2_pvalue(counts, probs) > 1e-3


@pytest.mark.parametrize("broken", [_accept_always, _residual_from_p])
def test_broken_verifier_fails(broken):
    p1, p2 = _pvalues(_one_step(broken, 12))
    assert min(p1, p2) < 1e-6


def test_placeholder_rejected_and_lossless():
    drafts = torch.full((N, K), -1)
    p = torch.stack([P[0].expand(N, V)] * (K + 1), 1)
    q = torch.full((N, K, V), 1.0 / V)
    u = counter_uniform(torch.arange(N), 0, K + 1)
    for verifier in (verify_rejection, verify_block):
        acc, nxt = verifier(drafts, q, p, torch.full((N,), K), u)
        assert acc.eq(0).all()
        assert _chi2_pvalue(torch.bincount(nxt, minlength=V).double(), P[0].double()) > 1e-3


def test_block_accepts_at_least_as_much_as_tokenwise():
    acc = {}
    u = counter_uniform(torch.arange(N) + 3 * 10 ** 6, 0, 2 * K + 1)
    drafts = sample_from(Q[0].expand(N, K, V), u[:, :K])
    for verifier in (verify_rejection, verify_block):
        q = Q[0].expand(N, K, V)
        p = P[0].expand(N, K + 1, V)
        acc[verifier.__name__] = verifier(drafts, q, p, torch.full((N,), K), u[:, K:])[0].float().mean().item()
    print("mean accepted (iid draft/target):", acc)
    assert acc["verify_block"] > acc["verify_rejection"] + 0.01


@pytest.mark.parametrize("verifier", [verify_rejection, verify_block])
def test_mixed_greedy_and_sampled_rows(verifier):
    """One batch, per-row temperatures: greedy rows (with argmax or sampled drafts) give exactly verify_greedy's
    result; the sampled rows beside them stay lossless."""
    n = 2 * N
    row = torch.arange(n)
    greedy = row % 2 == 0
    t = torch.where(greedy, 0.0, 1.0)
    t_draft = torch.where(row % 4 == 0, 0.0, 1.0)  # half the greedy rows draft by sampling: still exact
    u = counter_uniform(row + 7 * 10 ** 6, 0, 2 * K + 2)
    drafts, qs = torch.zeros(n, 0, dtype=torch.long), []
    for i in range(K):
        x, q = sample_rows(_dist(Q, drafts).log(), t_draft, 0, 1.0, u[:, i])
        drafts, qs = torch.cat([drafts, x[:, None]], 1), qs + [q]
    logits = torch.stack([_dist(P, drafts[:, :i]) for i in range(K + 1)], 1).log()  # [n, K+1, V]
    p = process_logits(logits, t)  # per-row temperature over [B, T, V]
    nd = row % (K + 1)
    acc, nxt = verifier(drafts, torch.stack(qs, 1), p, nd, u[:, K:2 * K + 1])
    g_acc, g_nxt = verify_greedy(drafts, logits, nd)
    assert torch.equal(acc[greedy], g_acc[greedy]) and torch.equal(nxt[greedy], g_nxt[greedy])
    assert 0 < g_acc[greedy].float().mean() < K  # the greedy rows accept some drafts and reject others
    s = ~greedy & (nd == K)
    p1, p2 = _pvalues(_emitted(drafts[s], acc[s], nxt[s], u[s, 2 * K + 1:], 2))
    assert p1 > 1e-3 and p2 > 1e-3, (p1, p2)


def _ref_verify(block, drafts, q, p, nd, u):
    """The sequential definitions, row by row in float64 (q None = one-hot drafts)."""
    B, k = drafts.shape
    p = p.double()
    q = torch.nn.functional.one_hot(drafts.clamp(min=0), p.shape[-1]).double() if q is None else q.double()
    accs, nxts = [], []
    for b in range(B):
        n = 0
        while n < min(int(nd[b]), k) and drafts[b, n] >= 0:
            n += 1
        d, ub = drafts[b].clamp(min=0), u[b].double()
        if block:
            run, runs, tau = 1.0, [1.0], 0
            for i in range(1, n + 1):
                run = min(1.0, run * float(p[b, i - 1, d[i - 1]]) / max(float(q[b, i - 1, d[i - 1]]), 1e-30))
                runs.append(run)
                if i < n:
                    rho = float((run * p[b, i] - q[b, i]).clamp(min=0).sum())
                    h = rho / (rho + 1 - run) if rho + 1 - run > 0 else 1.0
                else:
                    h = run
                tau = i if ub[i - 1] < h else tau
            a = tau
            w = runs[a] * p[b, a] - (q[b, a] if a < n else 0)
        else:
            a = 0
            while a < n and ub[a] * q[b, a, d[a]] < p[b, a, d[a]]:
                a += 1
            w = p[b, a] - (q[b, a] if a < n else 0)
        w = w.clamp(min=0)
        w = p[b, a] if w.sum() <= 0 else w
        accs.append(a)
        nxts.append(int((w.cumsum(0) > ub[k] * w.sum()).long().argmax()))
    return torch.tensor(accs), torch.tensor(nxts)


@pytest.mark.parametrize("verifier", [verify_rejection, verify_block])
@pytest.mark.parametrize("probabilistic", [True, False])
def test_matches_float64_sequential_reference(verifier, probabilistic):
    n, k = 3000, 4
    g = torch.Generator().manual_seed(5)
    p = (torch.randn(n, k + 1, V, generator=g) * 1.5).softmax(-1)
    q = (torch.randn(n, k, V, generator=g) * 1.5).softmax(-1)
    u = counter_uniform(torch.arange(n) + 5 * 10 ** 6, 0, 2 * k + 1)
    drafts = sample_from(q, u[:, :k]) if probabilistic else p[:, :k].argmax(-1)
    drafts[torch.arange(n) % 7 == 3, 2] = -1  # placeholders cut some rows short
    nd = torch.arange(n) % (k + 2)  # 0..k+1: more than k is clipped
    qq = q if probabilistic else None
    acc, nxt = verifier(drafts, qq, p, nd, u[:, k:])
    r_acc, r_nxt = _ref_verify(verifier is verify_block, drafts, qq, p, nd, u[:, k:])
    assert torch.equal(acc, r_acc) and torch.equal(nxt, r_nxt)


def test_uniforms_shape():
    drafts = torch.tensor([[1, 2], [3, 0]])
    p = torch.full((2, 3, V), 1.0 / V)
    for verifier in (verify_rejection, verify_block):
        with pytest.raises(ValueError, match=r"u: expected uniforms \[B, k\+1\] = \[2, 3\]"):
            verifier(drafts, None, p, 2, torch.rand(2, 2))


def test_sampled_step_reads_no_tensor_data_on_the_host():
    """The whole sampled step on the meta device (shapes only): any .item(), int(tensor), boolean-mask indexing or
    other data-dependent shape would raise here, so nothing in it syncs with the host."""
    B, k, V_, d = 4, 3, 11, "meta"
    seed = torch.empty(B, dtype=torch.long, device=d)
    u = counter_uniform(seed, seed * 64, 2 * k + 1)
    t, top_k, top_p = torch.empty(B, device=d), torch.empty(B, dtype=torch.long, device=d), torch.empty(B, device=d)
    ids, q = sample_rows(torch.empty(B, V_, device=d), t, top_k, top_p, u[:, 0])
    assert ids.shape == (B,) and q.shape == (B, V_)
    p = process_logits(torch.empty(B, k + 1, V_, device=d), t, top_k, top_p)
    drafts, nd = torch.empty(B, k, dtype=torch.long, device=d), torch.empty(B, dtype=torch.long, device=d)
    for verifier in (verify_rejection, verify_block):
        for q in (torch.empty(B, k, V_, device=d), None):
            acc, nxt = verifier(drafts, q, p, nd, u[:, k:])
            assert acc.shape == nxt.shape == (B,)
    assert choose_verify_lengths_device(torch.empty(B, k, device=d)).shape == (B,)


def test_adaptive_prefix_and_confidence():
    c = torch.tensor([[0.95, 0.95, 0.9, 0.9, 0.9, 0.9],
                      [0.5, 0.3, 0.9, 0.9, 0.9, 0.9],
                      [0.8, 0.8, 0.8, 0.1, 0.9, 0.9],
                      [0.05, 0.9, 0.9, 0.9, 0.9, 0.9]])
    n = choose_verify_lengths(c)
    print("adaptive num_drafts:", n.tolist())
    assert n[0] > n[2] > n[1] >= n[3] and n[0] >= 4 and n[3] <= 1
    assert n[2] <= 3  # the 0.1 step ends the useful prefix
    # fixed budget: exactly that many slots, a prefix per row, most confident first
    nb = choose_verify_lengths(c, budget=5)
    assert int(nb.sum()) == 5 and nb.tolist() == [4, 0, 1, 0]
    # cheap verification -> verify more; expensive -> fewer
    cheap = choose_verify_lengths(c, verify_cost=lambda t: 1.0 + 0.001 * t)
    dear = choose_verify_lengths(c, verify_cost=lambda t: 1.0 + 0.5 * t)
    assert int(cheap.sum()) > int(dear.sum())
    # equal survivals (c = 1): the budget is still honoured exactly
    assert int(choose_verify_lengths(torch.ones(2, 4), budget=3).sum()) == 3


def test_adaptive_device_form_equals_host_form():
    g = torch.Generator().manual_seed(6)
    cases = [torch.rand(R, k, generator=g) for R, k in ((1, 4), (4, 6), (16, 8), (64, 8), (3, 1))]
    cases += [torch.ones(2, 4), (torch.rand(8, 5, generator=g) * 4).round() / 4, torch.zeros(3, 3), torch.rand(3, 0)]
    costs = [(2.0, 0.1, 1.0, 0), (1.0, 0.001, 1.0, 0), (1.0, 0.5, 0.3, 7), (0.4, 0.05, 2.0, 32)]
    for c in cases:
        for a, b, d, extra in costs:
            host = choose_verify_lengths(c, draft_cost=lambda r, d=d: d, verify_cost=lambda t, a=a, b=b: a + b * t,
                                         extra_tokens=extra)
            dev = choose_verify_lengths_device(c, a, b, d, extra)
            assert torch.equal(host, dev), (c, a, b, d, extra, host, dev)
        for budget in (0, 3, c.numel()):
            assert torch.equal(choose_verify_lengths(c, budget=budget),
                               choose_verify_lengths_device(c, budget=torch.tensor(budget)))
    c = torch.tensor([[0.95, 0.95, 0.9], [0.5, 0.3, 0.9]])
    assert choose_verify_lengths_device(c, budget=4).tolist() == [3, 1]


def test_chi2_helper_matches_known_quantile():
    # chi2(dof=4) 0.999 quantile is 18.467
    p = float(torch.special.gammaincc(torch.tensor(2.0, dtype=torch.float64), torch.tensor(18.467 / 2)))
    assert math.isclose(p, 1e-3, rel_tol=1e-3)
