"""LatentMoE routing and Quantile Balancing."""
import torch

from dspark.models.k3.config import k3_tiny_config
from dspark.models.k3.moe import LatentMoE


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


def test_forward_equals_dense_reference():
    moe = _moe().eval()
    with torch.no_grad():
        moe.routed_expert_norm.weight.normal_()
        x = torch.randn(2, 7, 64)
        idx, w, _, _ = moe.route(x.reshape(-1, 64))
        z = moe.routed_expert_down_proj(x.reshape(-1, 64))
        u = torch.stack([sum(w[n, j] * moe.experts[int(idx[n, j])](z[n]) for j in range(2)) for n in range(14)])
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
