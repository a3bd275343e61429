"""KDA: the chunkwise form equals the token loop; the layer's incremental path equals the full pass."""
import pytest
import torch

from dspark.cache.batch import DenseCache
from dspark.models.k3.kda import KimiDeltaAttention, kda_chunked, kda_gate, kda_recurrent, l2norm


def _inputs(B=2, T=150, H=3, K=16, V=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, K, generator=g))
    k = l2norm(torch.randn(B, T, H, K, generator=g))
    v = torch.randn(B, T, H, V, generator=g)
    f = torch.randn(B, T, H, K, generator=g) * 2
    A_log = torch.randn(H, generator=g) * 0.5
    dt_bias = torch.randn(H * K, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    S0 = torch.randn(B, H, K, V, generator=g)
    return q, k, v, f, A_log, dt_bias, beta, S0


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_equals_recurrent(lower_bound, chunk_size):
    q, k, v, f, A_log, dt_bias, beta, S0 = _inputs()
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    assert g.max() <= 0 and (lower_bound is None or g.min() >= lower_bound)
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, S0)
    o, S = kda_chunked(q, k, v, g, beta, S0, chunk_size=chunk_size)  # T=150: not a multiple of the chunk
    assert (o - o_ref).abs().max() <= 1e-5
    assert (S - S_ref).abs().max() <= 1e-5
    # without an initial state as well
    o_ref0, S_ref0 = kda_recurrent(q, k, v, g, beta)
    o0, S0_ = kda_chunked(q, k, v, g, beta, chunk_size=chunk_size)
    assert (o0 - o_ref0).abs().max() <= 1e-5 and (S0_ - S_ref0).abs().max() <= 1e-5


def test_gate_forms_match_equations():
    f = torch.randn(1, 3, 2, 4)
    A_log, dt_bias = torch.randn(2), torch.randn(8)
    z = f + dt_bias.view(2, 4)
    a = A_log.exp().view(2, 1)
    torch.testing.assert_close(kda_gate(f, A_log, dt_bias, None), -a * torch.log1p(torch.exp(z)))
    torch.testing.assert_close(kda_gate(f, A_log, dt_bias, -5.0), -5.0 * torch.sigmoid(a * z))


def test_recurrent_matches_delta_rule_definition():
    """One explicit step of S_t = (I - b k k^T) Diag(alpha) S + b k v^T, o = S^T q * K^-0.5."""
    q, k, v, f, A_log, dt_bias, beta, S0 = _inputs(B=1, T=1, H=1, K=4, V=3)
    g = kda_gate(f, A_log, dt_bias, -5.0)
    o, S = kda_recurrent(q, k, v, g, beta, S0)
    kk, vv, b = k[0, 0, 0], v[0, 0, 0], beta[0, 0, 0]
    S_exp = (torch.eye(4) - b * torch.outer(kk, kk)) @ torch.diag(g[0, 0, 0].exp()) @ S0[0, 0] + b * torch.outer(kk, vv)
    torch.testing.assert_close(S[0, 0], S_exp, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(o[0, 0, 0], S_exp.t() @ q[0, 0, 0] * 4 ** -0.5, atol=1e-6, rtol=1e-5)


def test_all_states_last_equals_final():
    q, k, v, f, A_log, dt_bias, beta, S0 = _inputs(T=7)
    g = kda_gate(f, A_log, dt_bias, None)
    _, S_all = kda_recurrent(q, k, v, g, beta, S0, return_all_states=True)
    _, S = kda_recurrent(q, k, v, g, beta, S0)
    assert S_all.shape == (2, 7, 3, 16, 12)
    assert torch.equal(S_all[:, -1], S)


@pytest.mark.parametrize("full_rank_gate", [True, False])
def test_layer_prefill_then_decode_equals_full(full_rank_gate):
    torch.manual_seed(0)
    layer = KimiDeltaAttention(32, 2, 8, 4, gate_lower_bound=None, use_full_rank_gate=full_rank_gate).eval()
    x = torch.randn(2, 40, 32)
    with torch.no_grad():
        full = layer(x)  # T=40: chunked path
        cache = DenseCache(2, 64)
        outs = [layer(x[:, :21], cache.batch([21, 21]))]
        cache.commit()
        for t in range(21, 40):
            outs.append(layer(x[:, t:t + 1], cache.batch([1, 1])))
            cache.commit()
    assert (torch.cat(outs, 1) - full).abs().max() < 1e-5
    S, conv = cache.kda[0]
    assert S.shape == (2, 2, 8, 8) and S.dtype == torch.float32 and conv.shape == (2, 3, 3 * 16)


def test_padding_leaves_state_untouched():
    torch.manual_seed(0)
    layer = KimiDeltaAttention(32, 2, 8, 4, gate_lower_bound=-5.0).eval()
    x = torch.randn(2, 30, 32)
    with torch.no_grad():
        padded = DenseCache(2, 64)
        layer(x, padded.batch([30, 19]))  # row 1 right-padded after 19 tokens
        padded.commit()
        alone = DenseCache(1, 64)
        layer(x[1:, :19], alone.batch([19]))
        alone.commit()
    assert (padded.kda[0][0][1] - alone.kda[0][0][0]).abs().max() < 1e-5
    assert torch.equal(padded.kda[0][1][1], alone.kda[0][1][0])  # conv window = last 3 raw inputs of row 1


fla_ok = torch.cuda.is_available()
if fla_ok:
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: F401
    except Exception:  # noqa: BLE001
        fla_ok = False


@pytest.mark.skipif(not fla_ok, reason="needs CUDA and fla-core")
def test_fla_kernels_match_reference():
    """fla's kernels, used for bf16 inputs (its chunk form keeps per-chunk states in bf16, so fp32 models take the
    torch forms), against the fp32 reference on the same bf16-rounded inputs: relative error of bf16 size."""
    from dspark.models.k3.kda import fla_available, kda_fla
    q, k, v, f, A_log, dt_bias, beta, S0 = _inputs(B=2, T=200, H=4, K=64, V=64)
    q, k, v, beta = (t.bfloat16() for t in (q, k, v, beta))
    g = kda_gate(f, A_log, dt_bias, -5.0)
    cuda = [t.cuda() for t in (q, k, v, g, beta, S0)]
    assert fla_available(cuda[2]) and not fla_available(cuda[2].float())

    def rel(x, ref):
        return ((x.float().cpu() - ref).norm() / ref.norm()).item()

    o_ref, S_ref = kda_chunked(q.float(), k.float(), v.float(), g, beta.float(), S0)
    o, S = kda_fla(*cuda[:5], cuda[5])
    assert rel(o, o_ref) < 1e-2 and rel(S, S_ref) < 1e-2, (rel(o, o_ref), rel(S, S_ref))
    o1, S1 = kda_fla(*[t[:, :4] for t in cuda[:5]], cuda[5], decode=True)
    o1_ref, S1_ref = kda_recurrent(*(t[:, :4].float() for t in (q, k, v, g, beta)), S0)
    assert rel(o1, o1_ref) < 1e-2 and rel(S1, S1_ref) < 1e-2, (rel(o1, o1_ref), rel(S1, S1_ref))
