"""LatentMoE routing and Quantile Balancing."""
import pytest
import torch

from dspark.checkpoint_io import checkpoint_state
from dspark.models.k3.config import k3_tiny_config
from dspark.models.k3.moe import LatentMoE, set_static_moe
from dspark.models.k3.mxfp4 import convert_to_mxfp4
from dspark.models.layers import glu


def _moe(seed=0, **overrides):
    torch.manual_seed(seed)
    return LatentMoE(k3_tiny_config(**overrides))


def test_router_weights_are_unbiased_renormalised_scores():
    moe = _moe(routed_scaling_factor=2.5)
    x = torch.randn(50, 64)
    bias = torch.zeros(8)
    bias[5] = 10.0  # the bias alone forces expert 5 into every top-k ...
    moe.gate.e_score_correction_bias.copy_(bias)
    idx, w, s, cutoff = moe.route(x)
    assert (idx == 5).any(-1).all()
    expected = s.gather(1, idx)
    expected = expected / expected.sum(-1, keepdim=True) * 2.5  # ... but weights use the unbiased scores
    torch.testing.assert_close(w, expected)
    biased = s + bias
    assert torch.equal(cutoff, biased.sort(-1, descending=True).values[:, 2])  # (k+1)-th biased score


def _expert_ref(moe, e, z):
    """Expert e from its checkpoint tensors (w1 = gate, w3 = up, w2 = down) in plain torch."""
    sd = checkpoint_state(moe)
    w1, w2, w3 = (sd[f"experts.{e}.w{i}.weight"] for i in (1, 2, 3))
    ex = moe.experts
    return glu(z @ w1.T, z @ w3.T, ex.act, ex.situ_beta, ex.situ_linear_beta) @ w2.T


def test_forward_equals_dense_reference():
    moe = _moe().eval()
    with torch.no_grad():
        moe.routed_expert_norm.weight.normal_()
        x = torch.randn(2, 7, 64)
        idx, w, _, _ = moe.route(x.reshape(-1, 64))
        z = moe.routed_expert_down_proj(x.reshape(-1, 64))
        u = torch.stack([sum(w[n, j] * _expert_ref(moe, int(idx[n, j]), z[n]) for j in range(2)) for n in range(14)])
        ref = moe.routed_expert_up_proj(moe.routed_expert_norm(u)) + moe.shared_experts(x.reshape(-1, 64))
        torch.testing.assert_close(moe(x).reshape(-1, 64), ref, atol=1e-5, rtol=1e-5)


def test_quantile_balancing_flattens_a_skewed_router():
    moe = _moe(num_experts=16, num_experts_per_token=2)
    g = torch.Generator().manual_seed(1)
    mu = torch.randn(64, generator=g)
    with torch.no_grad():  # skew: experts 0..2 align with the mean token direction (+~4 logits, sigmoid not
        moe.gate.weight[:3] += 0.5 * mu / mu.norm()  # saturated: saturated scores tie and no bias can split them)

    def batch():
        return torch.randn(4096, 64, generator=g) + mu

    def ratio(load):
        return (load.max() / load.float().mean()).item()

    ratios = [ratio(moe.expert_load(batch()))]
    moe.train()
    with torch.no_grad():
        for _ in range(8):
            moe(batch()[None])  # records (scores, cutoffs)
            moe.update_bias()
            ratios.append(ratio(moe.expert_load(batch())))  # measured on a fresh batch
    bias = moe.gate.e_score_correction_bias
    print("Quantile Balancing max/mean expert load:", " -> ".join(f"{r:.2f}" for r in ratios))
    assert ratios[0] > 2.5
    assert ratios[-1] < 1.3 and ratios[-1] < ratios[1] < ratios[0] / 2
    assert abs(bias.mean().item()) < 1e-5 and bias[:3].max() < bias[3:].min()
    assert moe.update_bias() is None  # the records were consumed


@pytest.mark.parametrize("mxfp4", [False, True])
def test_gathered_moe_equals_loop(mxfp4):
    torch.manual_seed(0)
    moe = LatentMoE(k3_tiny_config()).eval()
    if mxfp4:
        convert_to_mxfp4(moe)
    x = torch.randn(3, 5, 64)
    budget, moe.dense_elements = moe.dense_elements, 0  # the reference: the loop path
    with torch.no_grad():
        moe.routed_expert_norm.weight.normal_()
        loop = moe(x)
        assert set_static_moe(moe, 15) == 0
        torch.testing.assert_close(moe(x), loop, atol=1e-6, rtol=1e-5)
        called = []
        moe._experts_loop = lambda *a: called.append(1) or LatentMoE._experts_loop(moe, *a)
        moe(x[:, :4])  # 12 tokens <= 15: gathered
        assert not called
        moe(torch.cat([x, x], 1))  # 30 tokens > 15: the loop path
        assert called
        # inference above static_tokens: every expert on every token while its activations fit the budget (30 tokens
        # here), not with MXFP4 experts (dequantised whole) nor in training
        called.clear()
        moe.dense_elements = 30 * moe.experts.num_experts * 2 * moe.experts.intermediate
        torch.testing.assert_close(moe(torch.cat([x, x], 1)), torch.cat([loop, loop], 1), atol=1e-6, rtol=1e-5)
        assert bool(called) == mxfp4
        moe(torch.cat([x, x, x[:, :1]], 1))  # 33 tokens: over the budget
        with torch.enable_grad():
            moe(torch.cat([x, x], 1))
        assert len(called) == 2 + mxfp4
        moe.dense_elements = budget
        # both graph-safe forms: per-pair gathered weights (N*k < E) and every expert on every token (N*k >= E)
        E, k = moe.num_experts, moe.top_k
        dense = []
        moe._experts_dense = lambda *a: dense.append(1) or LatentMoE._experts_dense(moe, *a)
        for n in (max(1, (E - 1) // k), E):
            dense.clear()
            xs = x.reshape(-1, 64)[:n][None]
            torch.testing.assert_close(moe(xs), loop.reshape(-1, 64)[:n][None], atol=1e-6, rtol=1e-5)
            assert bool(dense) == (n * k >= E)
        assert set_static_moe(moe, 0) == 15 and moe.static_tokens == 0
        assert set_static_moe(moe, 4) == 0
    # the graph-safe path reads the experts' own stacks: the module holds them once, no stacked copy beside them
    held = dict(moe.experts.named_parameters()) | dict(moe.experts.named_buffers())
    names = ["w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale"] if mxfp4 else [
        "w13_weight", "w2_weight"]
    assert sorted(held) == sorted(names) and moe.experts.stored()[0] is held[names[0]]
    assert sum(t.numel() for t in moe.state_dict().values()) == sum(t.numel() for t in checkpoint_state(moe).values())
