"""Device-side sampling: the counter RNG (exact splitmix64, uniform, independent along counters and seeds,
batch-independent), the per-row sampling rule against a float64 reference, and inverse-CDF sampling.
DSPARK_TEST_DEVICE=cuda runs them on a GPU, where the RNG must match the same pure-Python reference bit for bit."""
import math
import os

import pytest
import torch

from dspark.spec.sampling import counter_uniform, process_logits, request_seed, sample_from, sample_rows

DEV = os.environ.get("DSPARK_TEST_DEVICE", "cpu")
M64 = (1 << 64) - 1


def _ref_uniform(seed: int, counter: int) -> float:
    """splitmix64 in Python integers (exact mod 2^64): the definition counter_uniform implements."""
    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)
    z = mix((mix(seed & M64) + (counter & M64) * 0x9E3779B97F4A7C15) & M64)
    return (z >> 40) / 2 ** 24


def _chi2_pvalue(counts, probs):
    exp = probs * counts.sum()
    assert exp.min() >= 5, "cells too small for the chi-square approximation"
    stat = ((counts - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((counts.numel() - 1) / 2.0, dtype=torch.float64),
                                         stat.double() / 2))


def _ks_pvalue(x):
    """One-sample Kolmogorov-Smirnov against U(0, 1) (asymptotic Kolmogorov distribution)."""
    x = x.double().sort().values
    n = x.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = float(torch.maximum(i / n - x, x - (i - 1) / n).max())
    lam = d * (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n))
    return min(1.0, max(0.0, 2 * sum((-1) ** (j - 1) * math.exp(-2 * j * j * lam * lam) for j in range(1, 101))))


# --- counter_uniform ---
def test_counter_uniform_is_splitmix64_bit_for_bit():
    seeds = [0, 1, -1, 7, 2 ** 62 + 3, -(2 ** 63), 123456789]
    counters = [0, 1, 63, 2 ** 40 + 5, 2 ** 62]
    s = torch.tensor([a for a in seeds for _ in counters], device=DEV)
    c = torch.tensor([b for _ in seeds for b in counters], device=DEV)
    u = counter_uniform(s, c, 3).cpu()
    ref = torch.tensor([[_ref_uniform(a, b + j) for j in range(3)] for a in seeds for b in counters])
    assert torch.equal(u, ref.float())
    assert u.dtype == torch.float32 and (u >= 0).all() and (u < 1).all()


def test_counter_uniform_is_uniform_along_counters_and_seeds():
    n = 100_000
    stream = counter_uniform(torch.tensor([42], device=DEV), 0, n)[0].cpu()  # one seed, counters 0..n-1
    across = counter_uniform(torch.arange(n, device=DEV), 5, 1)[:, 0].cpu()  # seeds 0..n-1, one counter
    for x in (stream, across):
        assert _ks_pvalue(x) > 1e-3
        assert _chi2_pvalue(torch.histc(x.double(), 256, 0, 1), torch.full((256,), 1 / 256, dtype=torch.float64)) > 1e-3
    # the tests have power: a mildly skewed sample fails both
    skew = stream.double() ** 1.03
    assert _ks_pvalue(skew) < 1e-6
    assert _chi2_pvalue(torch.histc(skew, 256, 0, 1), torch.full((256,), 1 / 256, dtype=torch.float64)) < 1e-6


def test_counter_uniform_adjacent_counters_and_seeds_independent():
    n = 100_000
    u = counter_uniform(torch.arange(n, device=DEV) * 3 + 11, 1000, 2).cpu().double()  # [n, 2]: counters c, c+1
    v = counter_uniform(torch.arange(n, device=DEV) * 3 + 12, 1000, 1).cpu().double()[:, 0]  # next seed, same c
    bound = 4.5 / math.sqrt(n)
    for a, b in ((u[:, 0], u[:, 1]), (u[:, 0], v)):
        r = torch.corrcoef(torch.stack([a, b]))[0, 1]
        assert abs(float(r)) < bound, float(r)
        cells = (a * 16).long() * 16 + (b * 16).long()  # joint of the pair on a 16 x 16 grid
        assert _chi2_pvalue(torch.bincount(cells, minlength=256).double(),
                            torch.full((256,), 1 / 256, dtype=torch.float64)) > 1e-3


def test_counter_uniform_reproducible_and_batch_independent():
    s = torch.tensor([5, 7, 9, 5], device=DEV)
    c = torch.tensor([10, 0, 3, 12], device=DEV)
    u = counter_uniform(s, c, 4)
    assert torch.equal(u, counter_uniform(s, c, 4))
    # element j is the draw at counter + j: row (5, 10)[2:] is row (5, 12)[:2]
    assert torch.equal(u[0, 2:], u[3, :2])
    for b in range(4):  # alone, and inside a permuted batch, a row draws the same numbers
        assert torch.equal(counter_uniform(s[b:b + 1], c[b:b + 1], 4)[0], u[b])
    perm = torch.tensor([2, 0, 3, 1], device=DEV)
    assert torch.equal(counter_uniform(s[perm], c[perm], 4), u[perm])
    assert torch.equal(counter_uniform(s, 3, 2), counter_uniform(s, torch.full((4,), 3, device=DEV), 2))
    assert not torch.equal(u[0], u[1])


def test_counter_uniform_rejects_bad_dtypes():
    with pytest.raises(TypeError, match="seed must be int64"):
        counter_uniform(torch.tensor([1], dtype=torch.int32), 0, 1)
    with pytest.raises(TypeError, match="counter must be int64"):
        counter_uniform(torch.tensor([1]), torch.tensor([0], dtype=torch.int32), 1)


def test_request_seed():
    assert request_seed(5) == 5 and request_seed(2 ** 64 + 5) == 5 and request_seed(-1) == -1
    assert request_seed(2 ** 63) == -(2 ** 63)
    drawn = {request_seed(None) for _ in range(4)}
    assert len(drawn) == 4 and all(-(2 ** 63) <= s < 2 ** 63 for s in drawn)


# --- process_logits ---
def _ref_probs(logits, t, k, p):
    """One row in float64, written from the definition."""
    x = logits.double()
    V = x.numel()
    if t == 0:
        return torch.nn.functional.one_hot(x.argmax(), V).double()
    x = x / t
    if 0 < k < V:
        x = x.masked_fill(x < x.sort(descending=True).values[k - 1], float("-inf"))
    if p < 1:
        probs = x.softmax(-1)
        order = probs.argsort(descending=True, stable=True)
        keep, mass = [], 0.0
        for i in order.tolist():
            keep.append(i)
            mass += float(probs[i])
            if mass >= p:
                break
        drop = torch.ones(V, dtype=torch.bool)
        drop[keep] = False
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def test_process_logits_per_row_matches_reference():
    g = torch.Generator().manual_seed(0)
    B, V = 8, 50
    logits = torch.randn(B, V, generator=g) * 3
    t = [0.0, 0.7, 1.3, 0.0, 1.0, 2.0, 0.5, 1.0]
    k = [0, 3, 0, 2, 10, 0, 49, 50]
    p = [1.0, 1.0, 0.8, 0.5, 0.9, 0.3, 0.95, 1.0]
    out = process_logits(logits.to(DEV), torch.tensor(t, device=DEV), torch.tensor(k, device=DEV),
                         torch.tensor(p, device=DEV)).cpu()
    assert out.dtype == torch.float32
    for b in range(B):
        assert torch.allclose(out[b].double(), _ref_probs(logits[b], t[b], k[b], p[b]), atol=1e-6), b
        # the scalar form of the same row agrees
        assert torch.allclose(process_logits(logits[b:b + 1].to(DEV), t[b], k[b], p[b]).cpu(), out[b:b + 1])


def test_process_logits_batched_positions_and_broadcast_forms():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 4, 20, generator=g) * 2).to(DEV)  # [B, T, V]
    t, k, p = [0.0, 0.8, 1.5], [0, 5, 0], [1.0, 1.0, 0.7]
    out = process_logits(logits, torch.tensor(t, device=DEV), torch.tensor(k, device=DEV), torch.tensor(p, device=DEV))
    for b in range(3):
        assert torch.allclose(out[b], process_logits(logits[b], t[b], k[b], p[b]), atol=1e-7)
    # [B, 1] temperatures broadcast the same way as [B]
    assert torch.equal(process_logits(logits, torch.tensor(t, device=DEV)[:, None]),
                       process_logits(logits, torch.tensor(t, device=DEV)))
    # bf16 logits, a 1-D row, Python scalars
    one = process_logits(logits[1, 0].bfloat16(), 1.0)
    assert one.dtype == torch.float32 and one.shape == (20,)
    assert torch.allclose(one, logits[1, 0].bfloat16().float().softmax(-1))


def test_process_logits_hand_cases():
    lg = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]] * 3, device=DEV)
    p = process_logits(lg, torch.tensor([0.0, 1.0, 1.0], device=DEV), top_k=0, top_p=1.0)
    assert p[0].tolist() == [0, 1, 0, 0, 0]
    assert torch.allclose(p[1], lg[1].softmax(-1))
    pk = process_logits(lg, 1.0, top_k=2)
    assert (pk[0] > 0).tolist() == [False, True, True, False, False]
    pp = process_logits(lg, 1.0, top_p=0.6)  # the top token alone has ~0.63 mass
    assert (pp[0] > 0).tolist() == [False, True, False, False, False]
    assert torch.allclose(pp.sum(-1), torch.ones(3, device=DEV))
    # per-row k: 0 and >= V are off, 1 is the argmax
    pk = process_logits(lg, 1.0, top_k=torch.tensor([0, 1, 9], device=DEV))
    assert (pk > 0).sum(-1).tolist() == [5, 1, 5]


@pytest.mark.parametrize("top_p", [1e-300, 0.0, 1e-9])
def test_top_p_tiny_keeps_the_argmax(top_p):
    lg = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -2.0, 4.9, 5.0], [0.0, 0.0, 0.0, 0.0]], device=DEV)
    first = torch.nn.functional.one_hot(lg.argmax(-1), 4).float()  # first index among ties: 1, 0, 0
    for tp in (top_p, torch.full((3,), top_p, device=DEV)):
        out = process_logits(lg, 0.9, top_k=0, top_p=tp)
        assert torch.equal(out, first)


def test_extreme_temperatures_and_logits_stay_finite():
    lg = torch.tensor([[0.0, 1.0, -2.0, 0.5],
                       [3e38, -3e38, 1e38, 0.0],
                       [-1e30, -1e30 + 1e24, -1e30, -1e30],
                       [1e-3, 0.0, 2e-3, 1e-3]], device=DEV)
    for t in (1e-40, 1e-30, 1e-6, 1e-5, 1.0, 1e30, 3e38):
        for k, p in ((0, 1.0), (torch.tensor([2, 0, 3, 1], device=DEV), torch.tensor([0.5, 1e-300, 1.0, 0.9],
                                                                                        device=DEV))):
            out = process_logits(lg, torch.full((4,), t, device=DEV), k, p)
            assert torch.isfinite(out).all(), (t, out)
            assert torch.allclose(out.sum(-1), torch.ones(4, device=DEV), atol=1e-6)
            assert (out.gather(-1, lg.argmax(-1, keepdim=True)) > 0).all()  # the argmax always survives
    near_greedy = process_logits(lg, torch.full((4,), 1e-40, device=DEV))  # floored temperature: ~one-hot
    assert torch.allclose(near_greedy, torch.nn.functional.one_hot(lg.argmax(-1), 4).float())


# --- sample_from / sample_rows ---
def test_sample_from_matches_the_distribution():
    probs = torch.tensor([0.0, 0.1, 0.0, 0.35, 0.05, 0.5, 0.0], dtype=torch.float64)
    n = 100_000
    u = counter_uniform(torch.full((n,), 3, device=DEV), torch.arange(n, device=DEV), 1)[:, 0]
    ids = sample_from(probs.float().to(DEV).expand(n, -1), u).cpu()
    counts = torch.bincount(ids, minlength=7).double()
    assert counts[probs == 0].sum() == 0
    nz = probs > 0
    assert _chi2_pvalue(counts[nz], probs[nz]) > 1e-3


def test_sample_from_never_picks_zero_weight_or_out_of_range():
    w = torch.tensor([[0.0, 0.0, 0.3, 0.0, 0.3, 0.4, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-30],
                      [1 / 3, 0.0, 1 / 3, 0.0, 1 / 3, 0.0, 0.0, 0.0],
                      [0.0, 2.0, 0.0, 6.0, 0.0, 0.0, 0.0, 0.0]], device=DEV)  # unnormalised rows are fine
    cdf = w.cumsum(-1) / w.sum(-1, keepdim=True)
    edges = torch.cat([cdf, torch.zeros(4, 1, device=DEV), torch.full((4, 1), 1 - 2 ** -24, device=DEV),
                       cdf - 2 ** -24, (cdf + 2 ** -24).clamp(max=1 - 2 ** -24)], 1)  # exact boundaries and neighbours
    for j in range(edges.shape[1]):
        ids = sample_from(w, edges[:, j].clamp(0, 1 - 2 ** -24))
        assert ((ids >= 0) & (ids < 8)).all()
        assert (w.gather(-1, ids[:, None]) > 0).all(), (j, ids)
    assert sample_from(w, torch.tensor([0.2, 0.5, 0.5, 0.2], device=DEV)).tolist() == [2, 7, 2, 1]
    assert sample_from(w, torch.tensor([0.3, 0.0, 0.7, 0.3], device=DEV)).tolist() == [4, 7, 4, 3]  # [cdf_{i-1}, cdf_i) -> i
    assert sample_from(torch.zeros(2, 5, device=DEV), torch.tensor([0.1, 0.9], device=DEV)).tolist() == [0, 0]
    many = sample_from(w.expand(3, 4, 8), torch.full((3, 4), 0.99, device=DEV))  # leading dims [..., V]
    assert many.shape == (3, 4) and many.tolist() == [[5, 7, 4, 3]] * 3


def test_sample_rows_mixed_greedy_and_sampled():
    g = torch.Generator().manual_seed(4)
    V, n = 6, 60_000
    base = torch.randn(V, generator=g).to(DEV)
    logits = base.expand(n, V).clone()
    t = torch.where(torch.arange(n, device=DEV) % 3 == 0, 0.0, 0.8)
    top_k = torch.full((n,), 4, device=DEV)
    top_p = torch.full((n,), 0.95, device=DEV)
    u = counter_uniform(torch.arange(n, device=DEV), 0, 1)[:, 0]
    ids, probs = sample_rows(logits, t, top_k, top_p, u)
    assert torch.equal(probs, process_logits(logits, t, top_k, top_p))
    greedy = t == 0
    assert (ids[greedy] == base.argmax()).all()
    assert torch.equal(probs[greedy], torch.nn.functional.one_hot(base.argmax(), V).float().expand(int(greedy.sum()), V))
    target = process_logits(base.cpu()[None], 0.8, 4, 0.95)[0].double()
    counts = torch.bincount(ids[~greedy].cpu(), minlength=V).double()
    nz = target > 0
    assert counts[~nz].sum() == 0 and _chi2_pvalue(counts[nz], target[nz] / target[nz].sum()) > 1e-3
