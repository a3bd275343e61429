"""train.optim: Muon on merged weights equals torch's Muon on the separate matrices, and which parameters each
optimizer gets."""
import os

import torch

from dspark.config import OptimConfig
from dspark.models.drafter import DrafterConfig, DSparkDrafter
from train.optim import Muon, build_optimizers, cosine_lr, ns_dtype, orthogonalize, orthogonalize_many

DEVICE = os.environ.get("DSPARK_TEST_DEVICE", "cpu")


def test_muon_on_row_blocks_equals_torch_muon_on_the_separate_matrices():
    """A [q; k; v]-like weight of three blocks (one taller than wide, one wider): five steps of ours on the merged
    weight = torch.optim.Muon (match_rms_adamw) on the three matrices, bit for bit (on DSPARK_TEST_DEVICE)."""
    g = torch.Generator().manual_seed(0)
    sizes = [48, 16, 40]
    parts = [torch.nn.Parameter(torch.randn(n, 32, generator=g).to(DEVICE)) for n in sizes]
    merged = torch.nn.Parameter(torch.cat([p.detach() for p in parts]))
    ref = torch.optim.Muon(parts, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    ours = Muon([{"params": [merged], "row_sizes": sizes}], lr=0.02, weight_decay=0.1, momentum=0.95,
                ns_dtype=torch.bfloat16)  # torch's Muon iterates in bf16 everywhere
    for _ in range(5):
        grad = torch.randn(sum(sizes), 32, generator=g).to(DEVICE)
        merged.grad = grad.clone()
        for p, gp in zip(parts, grad.split(sizes)):
            p.grad = gp.clone()
        ref.step()
        ours.step()
    assert torch.equal(torch.cat([p.detach() for p in parts]), merged.detach())
    whole = torch.nn.Parameter(torch.cat([p.detach() for p in parts]))  # one matrix: not the same update
    one = Muon([whole], lr=0.02, weight_decay=0.1, momentum=0.95)
    whole.grad = grad.clone()
    merged.grad = grad.clone()
    before = merged.detach().clone()
    one.step()
    ours.step()
    assert not torch.allclose(whole.detach() - before, merged.detach() - before, atol=1e-4)


def test_matrices_of_one_shape_iterate_together_as_each_alone():
    """Blocks and parameters of one shape up to a transpose ([16, 32] twice in a merged weight, a [32, 16] parameter)
    go through one batched iteration: each result equals orthogonalize of that matrix alone (fp32), and five Muon
    steps equal torch.optim.Muon on the separate matrices up to bf16 rounding (on DSPARK_TEST_DEVICE)."""
    g = torch.Generator().manual_seed(1)
    mats = [torch.randn(16, 32, generator=g), torch.randn(32, 16, generator=g), torch.randn(16, 32, generator=g)]
    batched = orthogonalize_many([m.to(DEVICE) for m in mats], 5, dtype=torch.float32)
    for m, o in zip(mats, batched):
        assert o.shape == m.shape
        torch.testing.assert_close(o, orthogonalize(m.to(DEVICE), 5, dtype=torch.float32), rtol=1e-4, atol=1e-5)
    sizes = [16, 16, 40]
    parts = [torch.nn.Parameter(torch.randn(n, 32, generator=g).to(DEVICE)) for n in sizes]
    tall = torch.nn.Parameter(torch.randn(32, 16, generator=g).to(DEVICE))
    merged = torch.nn.Parameter(torch.cat([p.detach() for p in parts]))
    mine = torch.nn.Parameter(tall.detach().clone())
    ref = torch.optim.Muon(parts + [tall], lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    ours = Muon([{"params": [merged], "row_sizes": sizes}, {"params": [mine]}], lr=0.02, weight_decay=0.1,
                momentum=0.95, ns_dtype=torch.bfloat16)
    start = torch.cat([p.detach() for p in parts]).clone()
    for _ in range(5):
        grad, grad_tall = torch.randn(sum(sizes), 32, generator=g).to(DEVICE), torch.randn(32, 16, generator=g).to(DEVICE)
        merged.grad, mine.grad, tall.grad = grad.clone(), grad_tall.clone(), grad_tall.clone()
        for p, gp in zip(parts, grad.split(sizes)):
            p.grad = gp.clone()
        ref.step()
        ours.step()
    moved = torch.cat([p.detach() for p in parts]) - start
    assert (merged.detach() - start - moved).norm() / moved.norm() < 0.02
    torch.testing.assert_close(mine.detach(), tall.detach(), rtol=0.02, atol=1e-3)


def test_newton_schulz_in_fp32_where_the_cpu_emulates_bf16():
    """On a CPU without native bf16 matmuls the iterations run in fp32 (bf16 is emulated there, ~30x slower); they
    orthogonalize as the bf16 ones do: singular values in Muon's band, the same update up to bf16 rounding."""
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert ns_dtype("cpu") == (torch.bfloat16 if native else torch.float32) and ns_dtype("cuda") == torch.bfloat16
    g = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    o32, o16 = orthogonalize(g, 5, dtype=torch.float32), orthogonalize(g, 5, dtype=torch.bfloat16).float()
    s = torch.linalg.svdvals(o32)
    assert o32.dtype == torch.float32 and 0.5 < s.min() and s.max() < 1.3
    assert (o32 - o16).norm() / o32.norm() < 0.02
    p = torch.nn.Parameter(g.clone())
    p.grad = g.clone()
    Muon([p], lr=0.02).step()  # the default: ns_dtype of the parameter's device
    q = torch.nn.Parameter(g.clone())
    q.grad = g.clone()
    Muon([q], lr=0.02, ns_dtype=ns_dtype("cpu")).step()
    assert torch.equal(p, q)


def drafter():
    cfg = DrafterConfig(vocab_size=300, hidden_size=64, target_hidden_size=64, target_layer_ids=[1, 3],
                        num_target_layers=4, mask_token_id=2, block_size=4, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                        max_position_embeddings=512, markov_rank=8)
    frozen = lambda: torch.nn.Parameter(torch.randn(300, 64), requires_grad=False)  # noqa: E731
    return DSparkDrafter(cfg, frozen(), frozen())


def test_muon_gets_the_hidden_matrices_with_their_blocks_adamw_the_rest():
    model = drafter()
    names = {id(p): n for n, p in model.named_parameters()}
    opts, scheds = build_optimizers(model, OptimConfig(optimizer="muon", lr=1e-3, warmup_steps=4), max_steps=20)
    adamw, muon = opts
    got_muon = sorted(names[id(p)] for g in muon.param_groups for p in g["params"])
    got_adamw = sorted(names[id(p)] for g in adamw.param_groups for p in g["params"])
    hidden = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
    assert got_muon == sorted(["fc.weight"] + [f"layers.{i}.{m}.weight" for i in range(2) for m in hidden])
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert sorted(got_muon + got_adamw) == trainable  # each trainable parameter in exactly one optimizer
    assert {"markov_head.markov_w1.weight", "confidence_head.proj.weight", "norm.weight"} <= set(got_adamw)
    qkv = model.layers[0].self_attn.qkv_proj.weight
    sizes = {id(p): g["row_sizes"] for g in muon.param_groups for p in g["params"]}
    assert sizes[id(qkv)][:3] == [64, 32, 32]  # q (4 heads x 16), k and v (2 x 16)
    assert sizes[id(model.layers[0].mlp.gate_up_proj.weight)][:2] == [96, 96]
    assert [s.get_last_lr()[0] for s in scheds] == [1e-3 * cosine_lr(0, 20, 4, 0.1)] * 2  # one schedule for both


def test_adamw_alone_by_default():
    opts, _ = build_optimizers(drafter(), OptimConfig(), max_steps=10)
    assert len(opts) == 1 and isinstance(opts[0], torch.optim.AdamW)


def test_weight_decay_skips_vectors_unless_decay_vectors():
    """AdamW decays the matrices and leaves the 1-D parameters (norm weights) alone; optim.decay_vectors decays every
    AdamW parameter, as torch's AdamW over all of them (speculators) does."""
    model = drafter()
    names = {id(p): n for n, p in model.named_parameters()}

    def decay_of(oc):
        (adamw, _), _ = build_optimizers(model, oc, max_steps=10)
        return {names[id(p)]: g["weight_decay"] for g in adamw.param_groups for p in g["params"]}

    default = decay_of(OptimConfig(optimizer="muon", weight_decay=0.1))
    assert default["norm.weight"] == 0.0 and default["markov_head.markov_w1.weight"] == 0.1
    every = decay_of(OptimConfig(optimizer="muon", weight_decay=0.1, decay_vectors=True))
    assert every.keys() == default.keys() and set(every.values()) == {0.1}
