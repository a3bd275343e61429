"""dspark.static_decode on CPU fp32 (tiny Qwen3): the static cache, the fused-projection forward and greedy generation
against the engine and plain full forwards; graph safety checked on the meta device (a host read of any tensor
value fails there); CUDA graphs against the eager path when a GPU is present (skipped otherwise)."""
import shutil

import pytest
import torch

from dspark.cache.batch import DenseCache
from dspark.engine import Engine
from dspark.models.qwen3 import Qwen3ForCausalLM, qwen3_config
from dspark.request import SamplingParams
from dspark.static_decode import (
    GraphDecoder,
    StaticBatch,
    StaticCache,
    forward_static,
    fuse_projections,
    generate_greedy,
)
from tests.targets import make_target

V = 300
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3", vocab=V)


@pytest.fixture(scope="module")
def fused(target):
    return fuse_projections(target)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)  # seed 1: none of the three continuations is stuck on one token
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in (3, 11, 19)]


def dev(model):
    return next(model.parameters()).device


def full_forward_greedy(target, prompt, n):
    """No cache at all: argmax of a full causal forward over everything so far, n times."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(target(torch.tensor([ids], device=dev(target)))[0, -1].argmax()))
    return ids[len(prompt):]


def test_static_greedy_equals_engine_and_full_forward(target, fused, prompts):
    n = 20
    engine_outs = Engine(target).generate(prompts, SamplingParams(max_tokens=n, temperature=0.0))
    for prompt, out in zip(prompts, engine_outs):
        ref = full_forward_greedy(target, prompt, n)
        assert len(set(ref)) > 2  # a continuation that actually moves, so equality means something
        assert out.token_ids == ref
        assert generate_greedy(target, prompt, n, graphs=False)[0].tolist() == ref
        assert generate_greedy(target, prompt, n, graphs=False, fused=fused)[0].tolist() == ref


def test_batched_rows_are_independent(target, fused):
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(2, V, (3, 9), generator=g).to(dev(target))
    refs = [full_forward_greedy(target, p.tolist(), 12) for p in prompts]
    assert generate_greedy(target, prompts, 12, graphs=False).tolist() == refs
    assert generate_greedy(target, prompts, 12, graphs=False, fused=fused).tolist() == refs


@pytest.mark.parametrize("path", ["model", "fused"])
def test_verify_forward_and_rollback_match_full_forward(target, fused, path):
    """A k+1 = 5 token verify forward gives the full forward's logits at those positions; after keeping only a
    prefix (per row), the rejected junk rows in the cache are masked / overwritten: the next verify is exact again."""
    fwd = target if path == "model" else fused
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(2, V, (2, 40), generator=g).to(dev(target))
    with torch.no_grad():
        full = target(seq)
        P, T = 13, 5
        cache = StaticCache(target, 2, 64)
        prefill = StaticBatch(cache, 2, P)
        assert torch.allclose(forward_static(fwd, seq[:, :P], prefill), full[:, :P], atol=1e-5)
        prefill.commit()
        drafts = seq[:, P:P + T].clone()
        drafts[0, 2:] = (drafts[0, 2:] + 7) % V  # row 0: 2 right tokens then junk; row 1: 1 right token
        drafts[1, 1:] = (drafts[1, 1:] + 3) % V
        verify = StaticBatch(cache, 2, T)
        logits = forward_static(fwd, drafts, verify)
        assert torch.allclose(logits[0, :2], full[0, P:P + 2], atol=1e-5)  # the positions before any junk input
        assert torch.allclose(logits[1, :1], full[1, P:P + 1], atol=1e-5)
        assert not torch.allclose(logits[0, 2:], full[0, P + 2:P + T], atol=1e-3)  # the junk did change the rest
        verify.commit(torch.tensor([2, 1], device=dev(target)))
        assert cache.lengths.tolist() == [P + 2, P + 1]
        nxt = torch.stack([seq[0, P + 2:P + 2 + T], seq[1, P + 1:P + 1 + T]])
        logits = forward_static(fwd, nxt, verify)
    assert torch.allclose(logits[0], full[0, P + 2:P + 2 + T], atol=1e-5)
    assert torch.allclose(logits[1], full[1, P + 1:P + 1 + T], atol=1e-5)


def test_fused_projections_same_logits_and_names_untouched(target):
    names = {k: v.clone() for k, v in target.state_dict().items()}
    fused = fuse_projections(target)
    c = target.config
    assert fused.w_qkv[0].shape == ((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size)
    assert fused.w_gate_up[0].shape == (2 * c.intermediate_size, c.hidden_size)
    after = target.state_dict()
    assert set(after) == set(names) and all(torch.equal(after[k], v) for k, v in names.items())
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, V, (1, 24), generator=g).to(dev(target))
    caches = {name: StaticCache(target, 1, 64) for name in ("model", "fused")}
    with torch.no_grad():
        full = target(ids)
        for name, fwd in (("model", target), ("fused", fused)):  # prefill 16, then 8 single-token decode steps
            b = StaticBatch(caches[name], 1, 16)
            assert torch.allclose(forward_static(fwd, ids[:, :16], b), full[:, :16], atol=1e-5)
            b.commit()
            step = StaticBatch(caches[name], 1, 1)
            for t in range(16, 24):
                assert torch.allclose(forward_static(fwd, ids[:, t:t + 1], step)[:, 0], full[:, t], atol=1e-5)
                step.commit()
    # a fused copy is a snapshot: changing the model's q weights afterwards changes the model, not the copy
    with torch.no_grad():
        target.model.layers[0].self_attn.q_proj.weight.add_(1.0)
        assert not torch.equal(fused.w_qkv[0][: c.num_attention_heads * c.head_dim],
                               target.model.layers[0].self_attn.q_proj.weight)
        target.model.layers[0].self_attn.q_proj.weight.sub_(1.0)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None, reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_fused_layer_same_logits(target, fused):
    """torch.compile'd layer glue (the GPU benchmark's extra variant) computes the same function: prefill + decode."""
    compiled = fuse_projections(target, compile=True)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(2, V, (1, 14), generator=g).to(dev(target))
    with torch.no_grad():
        full = target(ids)
        cache = StaticCache(target, 1, 64)
        b = StaticBatch(cache, 1, 10)
        assert torch.allclose(forward_static(compiled, ids[:, :10], b), full[:, :10], atol=1e-5)
        b.commit()
        step = StaticBatch(cache, 1, 1)
        for t in range(10, 14):
            assert torch.allclose(forward_static(compiled, ids[:, t:t + 1], step)[:, 0], full[:, t], atol=1e-5)
            step.commit()


def test_static_step_reads_no_tensor_values_on_the_host():
    """On the meta device tensors have no values: any .item() / int(t) / bool(t) / data-dependent shape raises.
    The static prefill, decode and verify forwards (model and fused) run there; the DenseCache path does not."""
    cfg = qwen3_config(vocab_size=V, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=96)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg).eval()
    cache = StaticCache(model, 2, 64)
    with torch.no_grad():
        for fwd in (model, fuse_projections(model)):
            for T in (7, 1, 5):
                b = StaticBatch(cache, 2, T)
                logits = forward_static(fwd, torch.zeros(2, T, dtype=torch.long, device="meta"), b)
                b.commit()
                assert logits.shape == (2, T, V) and logits.is_meta
        dense = DenseCache(2, 64)
        with pytest.raises((NotImplementedError, RuntimeError)):  # the control: the engine-side cache does read values
            model(torch.zeros(2, 5, dtype=torch.long, device="meta"), batch=dense.batch([5, 5], device="meta"))


def test_static_cache_errors(target):
    cache = StaticCache(target, 2, 64)
    with pytest.raises(ValueError, match="rows"):
        StaticBatch(cache, 3, 1)
    b = StaticBatch(cache, 1, 4)
    with pytest.raises(ValueError, match="planned for T=4"):
        b.positions(5)
    with pytest.raises(ValueError, match="max_len=64"):
        b.key_mask(4, 32)
    with pytest.raises(ValueError, match="exceed max_len"):
        generate_greedy(target, [5] * 30, 40, graphs=False, max_len=64)
    with pytest.raises(ValueError, match="KDA"):
        StaticCache(make_target("k3", vocab=V), 1, 64)
    with pytest.raises(ValueError, match="CUDA"):
        GraphDecoder(target, StaticCache(target, 1, 64, device="cpu"))


@cuda
def test_graph_decoder_matches_eager_on_cuda(prompts):
    model = make_target("qwen3", vocab=V).cuda()
    fused = fuse_projections(model)
    prompt = prompts[1]
    eager = generate_greedy(model, prompt, 16, graphs=False).tolist()
    assert eager[0] == full_forward_greedy(model, prompt, 16)
    assert generate_greedy(model, prompt, 16, graphs=True).tolist() == eager
    assert generate_greedy(model, prompt, 16, graphs=True, fused=fused).tolist() == eager
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(2, V, (2, 30), generator=g).cuda()
    with torch.no_grad():
        full = model(seq)
        cache = StaticCache(model, 2, 64)
        pre = StaticBatch(cache, 2, 10)
        forward_static(model, seq[:, :10], pre)
        pre.commit()
        torch.cuda.set_sync_debug_mode("error")  # an eager static step must not synchronise with the host
        try:
            step = StaticBatch(cache, 2, 1)
            forward_static(fused, seq[:, 10:11], step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        dec = GraphDecoder(fused, cache, buckets=(1, 2))
        logits, tokens = dec.step(seq[:, 10:15], advance=False)  # verify T=5, both rows
        assert torch.allclose(logits, full[:, 10:15], atol=1e-4)
        assert torch.equal(tokens, full[:, 10:15].argmax(-1))
        assert cache.lengths.tolist() == [10, 10]
        logits, _ = dec.step(seq[:1, 10:11])  # one row: the bucket of 1, then lengths advance on the device
        assert torch.allclose(logits[0, 0], full[0, 10], atol=1e-4)
        assert cache.lengths.tolist() == [11, 10] and set(dec.graphs) == {(2, 5), (1, 1)}
