"""Drafter loss options: soft targets (loss.kl), the confidence head's target (loss.confidence_target) and gradient
(loss.confidence_grad), the decayed terms' normalisation (loss.decay_norm); the whole loss and its gradients against
each term's own definition; bench/loss_step.py."""
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dspark.config import RecipeError, load_recipe
from tests.targets import make_target
from tests.test_engine import make_drafter
from train.losses import LossWeights, drafter_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import loss_step  # noqa: E402

B, A, D, H, V = 2, 3, 4, 64, 300


@pytest.fixture(scope="module")
def drafter():
    return make_drafter(make_target("qwen3", vocab=V), block_size=D)


def inputs(drafter, seed=0):
    """Hidden states, anchor tokens, the target's logits and its argmax labels at the drafted positions."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, A, D, H, generator=g)
    anchors = torch.randint(2, V, (B, A), generator=g)
    dev = next(drafter.parameters()).device  # DSPARK_TEST_DEVICE's: the inputs are drawn on the CPU, then moved
    h, anchors = h.to(dev), anchors.to(dev)
    target_logits = drafter.base_logits(torch.randn(B, A, D, H, generator=g).to(dev)).detach() * 4.0  # a few likely
    return h, anchors, target_logits.argmax(-1), target_logits


def draft_logits(drafter, h, anchors, labels):
    prev = torch.cat([anchors[..., None], labels[..., :-1]], dim=-1)
    return drafter.base_logits(h) + drafter.markov(prev)[0]


def test_kl_is_the_decayed_kl_to_the_target_distribution(drafter):
    """loss.kl alone: the loss is sum_d w_d KL(p_d || q_d) / sum_d w_d over the valid drafts, w_d = exp(-d/gamma)
    like the CE's; the default weights (kl 0) give the same loss as before the option existed (CE + confidence)."""
    h, anchors, labels, tl = inputs(drafter)
    labels[0, 0, 2] = -100  # an ignored draft counts in neither sum
    loss, m, _ = drafter_loss(drafter, h, anchors, labels, tl, LossWeights(ce=0.0, kl=1.0, confidence=0.0))
    q_log = draft_logits(drafter, h, anchors, labels.clamp(min=0)).log_softmax(-1)
    p_log = tl.log_softmax(-1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)  # [B, A, D]
    w = torch.exp(-torch.arange(D, device=labels.device) / D) * (labels >= 0)
    assert loss.item() == pytest.approx(((kl * w).sum() / w.sum()).item(), rel=1e-5)
    assert m["kl"].item() == pytest.approx(loss.item(), rel=1e-6)
    base, _, _ = drafter_loss(drafter, h, anchors, labels, None, LossWeights())
    with_kl_off, _, _ = drafter_loss(drafter, h, anchors, labels, tl, LossWeights(kl=0.0))
    assert torch.equal(base, with_kl_off)


def test_soft_targets_learn_the_target_distribution_where_ce_learns_its_argmax(drafter):
    """Fitting the draft hidden states by each loss: KL brings q to the target's spread-out distribution p (KL -> 0),
    CE on the argmax sharpens q toward one token and stays far from p (KL > 10x that)."""
    h0, anchors, labels, tl = inputs(drafter)
    p = tl.softmax(-1)

    def fit(w: LossWeights) -> torch.Tensor:
        h = h0.clone().requires_grad_(True)
        opt = torch.optim.Adam([h], lr=0.05)
        for _ in range(300):
            loss, _, _ = drafter_loss(drafter, h, anchors, labels, tl, w)
            opt.zero_grad()
            loss.backward()
            opt.step()
        q_log = draft_logits(drafter, h.detach(), anchors, labels).log_softmax(-1)
        return (p * (p.log() - q_log)).sum(-1).mean()  # KL(p || q) after the fit

    kl_fit, ce_fit = fit(LossWeights(ce=0.0, kl=1.0, confidence=0.0)), fit(LossWeights(ce=1.0, confidence=0.0))
    assert kl_fit < 0.1 < ce_fit and ce_fit > 10 * kl_fit, (kl_fit, ce_fit)


def test_confidence_target_tv_is_one_minus_the_tv_distance(drafter):
    """confidence_target=tv: the head's BCE target is 1 - TV(q, p) (the chance a draft sampled from q is accepted
    against p), not the greedy draft's 0/1 correctness; the default stays 0/1 correctness."""
    h, anchors, labels, tl = inputs(drafter)
    conf = drafter.confidence(h, drafter.markov(torch.cat([anchors[..., None], labels[..., :-1]], -1))[1])
    logits = draft_logits(drafter, h, anchors, labels)
    tv = 0.5 * (logits.softmax(-1) - tl.softmax(-1)).abs().sum(-1)
    correct = (logits.argmax(-1) == labels).float()
    only_conf = dict(ce=0.0, confidence=1.0)
    got_tv, m, _ = drafter_loss(drafter, h, anchors, labels, tl, LossWeights(**only_conf, confidence_target="tv"))
    got_01, _, _ = drafter_loss(drafter, h, anchors, labels, tl, LossWeights(**only_conf))
    assert got_tv.item() == pytest.approx(F.binary_cross_entropy_with_logits(conf, 1 - tv).item(), rel=1e-5)
    assert got_01.item() == pytest.approx(F.binary_cross_entropy_with_logits(conf, correct).item(), rel=1e-5)
    assert 0 < tv.min() and tv.max() < 1 and abs(got_tv.item() - got_01.item()) > 1e-3
    with pytest.raises(ValueError, match="confidence_target=tv read the target's distribution"):
        drafter_loss(drafter, h, anchors, labels, None, LossWeights(confidence_target="tv"))


def test_decay_norm_tokens_divides_the_decayed_sum_by_the_drafted_tokens(drafter):
    """decay_norm=tokens (speculators' normalisation): the same decayed sum over the number of valid drafts instead of
    over the sum of the decay weights, so the loss is the default's times sum(w) / count."""
    h, anchors, labels, tl = inputs(drafter)
    labels[0, 0, 2] = -100
    weights, _, _ = drafter_loss(drafter, h, anchors, labels, tl, LossWeights(kl=1.0, confidence=0.0))
    tokens, _, _ = drafter_loss(drafter, h, anchors, labels, tl, LossWeights(kl=1.0, confidence=0.0,
                                                                            decay_norm="tokens"))
    w = torch.exp(-torch.arange(D, device=labels.device) / D) * (labels >= 0)
    ratio = (w.sum() / (labels >= 0).sum()).item()
    assert ratio < 0.9 and tokens.item() == pytest.approx(weights.item() * ratio, rel=1e-5)


def test_confidence_grad_reaches_the_draft_hidden_states_only_when_asked(drafter):
    """confidence_grad: the confidence BCE's gradient flows into the draft hidden states h (and so the draft layers);
    by default the head learns on detached ones and h gets none of it."""
    h0, anchors, labels, tl = inputs(drafter)
    grads = {}
    for flag in (False, True):
        h = h0.clone().requires_grad_(True)
        loss, _, _ = drafter_loss(drafter, h, anchors, labels, tl, LossWeights(ce=0.0, confidence=1.0,
                                                                            confidence_grad=flag))
        loss.backward()
        grads[flag] = h.grad
    drafter.zero_grad()
    assert grads[False] is None and grads[True].abs().sum() > 0


def test_recipe_loss_fields_are_validated():

    with pytest.raises(RecipeError, match=r"loss.confidence_target: expected one of \['correct', 'tv'\]"):
        load_recipe("recipes/quickstart.yaml", ["loss.confidence_target=soft"])
    with pytest.raises(RecipeError, match=r"loss.decay_norm: expected one of \['weights', 'tokens'\]"):
        load_recipe("recipes/quickstart.yaml", ["loss.decay_norm=count"])
    with pytest.raises(RecipeError, match="loss.kl: expected >= 0.0"):
        load_recipe("recipes/quickstart.yaml", ["loss.kl=-1"])
    r = load_recipe("recipes/quickstart.yaml", ["loss.ce=0", "loss.kl=1.0"])  # KL instead of CE is a recipe
    assert LossWeights.from_recipe(r.loss) == LossWeights(ce=0.0, distill=0.0, confidence=0.1, kl=1.0, decay_gamma=4.0)
    with pytest.raises(RecipeError, match="loss.ce: expected > 0 when distill and kl are 0"):
        load_recipe("recipes/quickstart.yaml", ["loss.ce=0", "loss.kl=0"])


def reference_loss(drafter, h, anchors, labels, tl, w: LossWeights) -> torch.Tensor:
    """Every term from its own definition: F.cross_entropy, softmax / log-softmax per term, as written in the docs."""
    logits = draft_logits(drafter, h, anchors, labels.clamp(min=0))
    valid = labels >= 0
    wgt = torch.exp(-torch.arange(D, device=h.device) / (w.decay_gamma or D)) * valid
    denom = (wgt.sum() if w.decay_norm == "weights" else valid.sum()).clamp(min=1.0)
    loss = w.ce * (F.cross_entropy(logits.flatten(0, 2), labels.flatten().clamp(min=0), reduction="none")
                   .view(B, A, D) * wgt).sum() / denom
    p, q = tl.softmax(-1), logits.softmax(-1)
    tv = 0.5 * (q - p).abs().sum(-1)
    loss = loss + w.distill * (tv * wgt).sum() / denom
    kl = (p * (tl.log_softmax(-1) - logits.log_softmax(-1))).sum(-1)
    loss = loss + w.kl * (kl * wgt).sum() / denom
    correct = (logits.argmax(-1) == labels) & valid
    m = drafter.markov(torch.cat([anchors[..., None], labels[..., :-1].clamp(min=0)], -1))[1]
    conf = drafter.confidence(h, m) if w.confidence_grad else drafter.confidence(h.detach(), m.detach())
    goal = 1 - tv.detach() if w.confidence_target == "tv" else correct.float()
    bce = F.binary_cross_entropy_with_logits(conf, goal, reduction="none")
    return loss + w.confidence * (bce * valid).sum() / valid.sum()


@pytest.mark.parametrize("w", [LossWeights(), LossWeights(kl=1.0), LossWeights(ce=0.0, kl=1.0),
                               LossWeights(kl=1.0, distill=0.5, confidence=1.0, confidence_target="tv",
                                           confidence_grad=True),
                               LossWeights(kl=0.5, decay_gamma=2.0, decay_norm="tokens")],
                         ids=["ce", "ce+kl", "kl", "all+tv", "kl-tokens"])
def test_the_loss_and_its_gradients_equal_each_terms_definition(drafter, w):
    """One log-softmax shared by the CE and the KL, probabilities only for the terms that read them: the same loss and
    the same gradients (draft hidden states and every drafter weight) as each term computed on its own."""
    h, anchors, labels, tl = inputs(drafter, seed=3)
    labels[1, 2, 1] = -100
    params = [p for p in drafter.parameters() if p.requires_grad]
    grads = []
    for fn in (lambda x: drafter_loss(drafter, x, anchors, labels, tl, w)[0],
               lambda x: reference_loss(drafter, x, anchors, labels, tl, w)):
        x = h.clone().requires_grad_(True)
        loss = fn(x)
        grads.append([loss.detach(), *torch.autograd.grad(loss, [x, *params], allow_unused=True)])
    (got, *g_got), (want, *g_want) = grads
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    for a, b in zip(g_got, g_want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_bench_loss_step_times_a_recipes_loss(capsys):
    dev = os.environ.get("DSPARK_TEST_DEVICE", "cpu")
    assert loss_step.main(["recipes/quickstart.yaml", "--vocab", "512", "--hidden", "32", "--rows", "2",
                           "--iters", "1", "--device", dev]) == 0
    out = capsys.readouterr().out
    r = load_recipe("recipes/quickstart.yaml")  # the recipe's anchors and drafts per block
    want = f"2 rows x {r.anchors_per_seq} blocks x {r.drafter.block_size} drafts, vocab 512: loss forward + backward"
    assert want in out, out
