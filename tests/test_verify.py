"""Verification: greedy cases by hand; rejection and block verification preserve the target distribution (χ²,
with a broken verifier as the power check); adaptive verification lengths."""
import math

import pytest
import torch

from dspark.spec.verify import choose_verify_lengths, process_logits, verify_block, verify_greedy, verify_rejection

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
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[[0.0, 0.0, 1.0, 0.0, 0.0]]])  # [1, 1, V]
    for q in (None, torch.zeros(1, 0, V)):
        acc, nxt = verifier(torch.zeros(1, 0, dtype=torch.long), q, p, torch.tensor([0]), g)
        assert acc.tolist() == [0] and nxt.tolist() == [2]
    acc, nxt = verify_greedy(torch.zeros(1, 0, dtype=torch.long), p, torch.tensor([0]))
    assert acc.tolist() == [0] and nxt.tolist() == [2]


def test_process_logits():
    lg = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]] * 3)
    p = process_logits(lg, torch.tensor([0.0, 1.0, 1.0]), top_k=0, top_p=1.0)
    assert p[0].tolist() == [0, 1, 0, 0, 0]
    assert torch.allclose(p[1], lg[1].softmax(-1))
    pk = process_logits(lg, 1.0, top_k=2)
    assert (pk[0] > 0).tolist() == [False, True, True, False, False]
    pp = process_logits(lg, 1.0, top_p=0.6)  # the top token alone has ~0.63 mass
    assert (pp[0] > 0).tolist() == [False, True, False, False, False]
    assert torch.allclose(pp.sum(-1), torch.ones(3))


# --- distribution tests: target p and drafter q are fixed autoregressive tables over prefixes of depth <= K ---
def _tables(seed, scale):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*([V] * d), V, generator=g) * scale).softmax(-1) for d in range(K + 1)]


P, Q = _tables(1, 1.0), _tables(2, 1.5)


def _dist(tables, prefix):  # prefix [N, d] -> [N, V]
    t = tables[prefix.shape[1]]
    return t[tuple(prefix.T)] if prefix.shape[1] else t.expand(prefix.shape[0], V)


def _one_step(verifier, seed, probabilistic=True, num_drafts=None, n=N, m=2):
    """One verification step on n independent rows; returns the first m emitted tokens [n, m] (tokens past what
    the step emits are drawn from the target, as any lossless next step would)."""
    N = n
    g = torch.Generator().manual_seed(seed)
    drafts = torch.zeros(N, 0, dtype=torch.long)
    qs = []
    for _ in range(K):
        q = _dist(Q, drafts)
        qs.append(q)
        x = torch.multinomial(q, 1, generator=g) if probabilistic else q.argmax(-1, keepdim=True)
        drafts = torch.cat([drafts, x], 1)
    p = torch.stack([_dist(P, drafts[:, :i]) for i in range(K + 1)], 1)  # [N, K+1, V]
    q = torch.stack(qs, 1) if probabilistic else None
    nd = torch.full((N,), K) if num_drafts is None else num_drafts
    acc, nxt = verifier(drafts, q, p, nd, g)
    out = torch.cat([drafts, torch.zeros(N, 1, dtype=torch.long)], 1)
    out[torch.arange(N), acc] = nxt
    for j in range(1, m):
        nxt = torch.multinomial(_dist(P, out[:, :j]), 1, generator=g)[:, 0]
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


def _accept_always(drafts, q, p, nd, g):
    return nd.clone(), torch.multinomial(p[torch.arange(len(nd)), nd], 1, generator=g)[:, 0]


def _residual_from_p(drafts, q, p, nd, g):  # a plausible bug: after a rejection resample from p, not max(p-q, 0)
    B = len(nd)
    ratio = p[:, :K].gather(-1, drafts[..., None])[..., 0] / q.gather(-1, drafts[..., None])[..., 0]
    acc = (torch.rand(B, K, generator=g) < ratio).long().cumprod(1).sum(1).minimum(nd)
    return acc, torch.multinomial(p[torch.arange(B), acc], 1, generator=g)[:, 0]


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
    g = torch.Generator().manual_seed(0)
    drafts = torch.full((N, K), -1)
    p = torch.stack([P[0].expand(N, V)] * (K + 1), 1)
    q = torch.full((N, K, V), 1.0 / V)
    for verifier in (verify_rejection, verify_block):
        acc, nxt = verifier(drafts, q, p, torch.full((N,), K), g)
        assert acc.eq(0).all()
        assert _chi2_pvalue(torch.bincount(nxt, minlength=V).double(), P[0].double()) > 1e-3


def test_block_accepts_at_least_as_much_as_tokenwise():
    acc = {}
    for verifier in (verify_rejection, verify_block):
        g = torch.Generator().manual_seed(3)
        drafts = torch.multinomial(Q[0], N * K, replacement=True, generator=g).view(N, K)
        q = Q[0].expand(N, K, V)
        p = P[0].expand(N, K + 1, V)
        acc[verifier.__name__] = verifier(drafts, q, p, torch.full((N,), K), g)[0].float().mean().item()
    print("mean accepted (iid draft/target):", acc)
    assert acc["verify_block"] > acc["verify_rejection"] + 0.01


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


def test_chi2_helper_matches_known_quantile():
    # chi2(dof=4) 0.999 quantile is 18.467
    p = float(torch.special.gammaincc(torch.tensor(2.0, dtype=torch.float64), torch.tensor(18.467 / 2)))
    assert math.isclose(p, 1e-3, rel_tol=1e-3)
