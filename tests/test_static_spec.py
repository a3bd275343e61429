"""dspark.static_spec on CPU fp32 (tiny Qwen3 and K3 targets): the static AR and speculative paths against the eager
engine token for token (with the same per-step accepted counts), the device-side KDA commit against DenseCache's,
rollback under scripted drafts, the gathered MoE path against the loop path, graph safety on the meta device, and
CUDA graphs against the eager static path when a GPU is present (skipped otherwise)."""
import pytest
import torch

from dspark.cache.batch import DenseCache
from dspark.engine import Engine
from dspark.models.drafter import DrafterConfig, DSparkDrafter
from dspark.models.k3.config import k3_tiny_config
from dspark.models.k3.model import K3ForCausalLM
from dspark.models.k3.moe import LatentMoE, set_static_moe
from dspark.models.k3.mxfp4 import convert_to_mxfp4
from dspark.request import SamplingParams
from dspark.static_spec import HybridCache, SpecBatch, StaticGenerator, generate_ar_greedy, generate_spec_greedy
from tests.targets import make_target
from tests.test_drafter_k3 import make_k3_drafter
from tests.test_engine import make_drafter

V = 300
N_NEW = 24
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PAIRS = {"qwen3": ("qwen3", make_drafter), "k3": ("k3", make_k3_drafter), "k3+qwen3-drafter": ("k3", make_drafter)}


@pytest.fixture(scope="module")
def targets():
    return {kind: make_target(kind, vocab=V) for kind in ("qwen3", "k3")}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)  # seed 1: no continuation stuck on one token, for either target
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in (3, 11, 19)]


def live_markov(drafter, seed=3):
    """A Markov head that matters (the factory's markov_w2 starts at zero, i.e. no bias at all)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = drafter.markov_head.markov_w2.weight
        w.copy_(torch.randn(w.shape, generator=g) * 2.0)
    return drafter


def engine_greedy(target, drafter, prompts, n=N_NEW):
    return Engine(target, drafter).generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))


@pytest.mark.parametrize("kind", ["qwen3", "k3"])
def test_static_ar_equals_engine(targets, prompts, kind):
    target = targets[kind]
    for prompt, ref in zip(prompts, engine_greedy(target, None, prompts)):
        assert len(set(ref.token_ids)) > 2  # a continuation that moves
        out = generate_ar_greedy(target, prompt, N_NEW)
        assert out.token_ids == [ref.token_ids] and out.num_steps == N_NEW - 1


@pytest.mark.parametrize("pair", ["qwen3", "k3"])  # k3 + a qwen3-backbone drafter: test_batched_rows_equal_engine
def test_static_speculative_equals_engine_with_same_acceptance(targets, prompts, pair):
    kind, make = PAIRS[pair]
    target = targets[kind]
    drafter = live_markov(make(target))
    refs = engine_greedy(target, drafter, prompts)
    assert sum(sum(r.accepted_per_step) for r in refs) > 0  # some drafts accepted: the rollback is exercised
    gen = StaticGenerator(target, drafter, max_len=64)  # one generator (cache, step) reused across prompts
    for prompt, ref in zip(prompts, refs):
        out = gen.generate(prompt, N_NEW)
        assert out.token_ids == [ref.token_ids]
        assert out.accepted_per_step == [ref.accepted_per_step]
        assert out.num_drafts_per_step == [ref.num_drafts_per_step]
        assert out.num_steps == ref.num_steps
    out = generate_spec_greedy(target, drafter, prompts[0], N_NEW, num_speculative_tokens=2)
    ref = Engine(target, drafter, num_speculative_tokens=2).generate(
        [prompts[0]], SamplingParams(max_tokens=N_NEW, ignore_eos=True))[0]
    assert out.token_ids == [ref.token_ids] and out.accepted_per_step == [ref.accepted_per_step]


@pytest.mark.parametrize("kind", ["qwen3", "k3"])
def test_batched_rows_equal_engine(targets, kind):
    target = targets[kind]
    drafter = make_drafter(target)
    g = torch.Generator().manual_seed(4)
    prompts = torch.randint(2, V, (2, 9), generator=g).tolist()
    refs = engine_greedy(target, drafter, prompts, 16)
    out = generate_spec_greedy(target, drafter, prompts, 16)
    assert out.token_ids == [r.token_ids for r in refs]
    assert out.accepted_per_step == [r.accepted_per_step for r in refs]
    assert generate_ar_greedy(target, prompts, 16).token_ids == [r.token_ids for r in refs]


@pytest.mark.parametrize("kind", ["qwen3", "k3"])
@pytest.mark.parametrize("quality", ["oracle", "partial", "adversarial"])
def test_scripted_drafts_roll_back_exactly(targets, prompts, kind, quality):
    """Drafts taken on the device from the reference continuation (oracle: all accepted; partial: one wrong token
    per block at a position that moves with the length; adversarial: none): the output stays the reference."""
    target = targets[kind]
    drafter = make_drafter(target)
    k = drafter.config.num_drafts
    prompt = prompts[1]
    ref = engine_greedy(target, None, [prompt], N_NEW + k + 2)[0].token_ids
    gen = StaticGenerator(target, drafter, max_len=64)
    seq = torch.tensor(prompt + ref)  # the token at position p is seq[p]

    def scripted(anchors):  # the pending token sits at position p = lengths: drafts are seq[p+1 .. p+k]
        p = gen.cache.lengths[: anchors.shape[0]]
        d = seq[p[:, None] + 1 + torch.arange(k)]
        if quality == "partial":
            wrong = torch.arange(k)[None] == (p % k)[:, None]
            d = torch.where(wrong, (d + 1) % V, d)
        return (d + 1) % V if quality == "adversarial" else d

    gen.step.propose = scripted
    out = gen.generate(prompt, N_NEW)
    assert out.token_ids == [ref[:N_NEW]]
    acc, nd = out.accepted_per_step[0], out.num_drafts_per_step[0]
    if quality == "oracle":
        assert acc == nd and max(acc) == k
    elif quality == "adversarial":
        assert set(acc) == {0}
    else:
        assert 0 < sum(acc) < sum(nd) and len(set(acc)) > 1


def test_kda_commit_equals_dense_cache(targets):
    """A record=True verify forward, then commit of n_keep = [0, 2, 5] per row: the same KDA states, conv windows
    and lengths as DenseCache.commit, and the next forward gives the same logits."""
    target = targets["k3"]
    g = torch.Generator().manual_seed(2)
    seq = torch.randint(2, V, (3, 20), generator=g)
    n_keep = torch.tensor([0, 2, 5])
    static, dense = HybridCache(target, 3, 64), DenseCache(3, 64)
    with torch.no_grad():
        for T, record, keep in ((9, False, None), (5, True, n_keep), (4, False, None)):
            ids = torch.stack([seq[b, n: n + T] for b, n in enumerate(dense.lengths.tolist())])  # per-row lengths
            sb = SpecBatch(static, 3, T, record=record)
            a = target(ids, batch=sb)
            b = target(ids, batch=dense.batch([T] * 3, record=record))
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            sb.commit(keep)
            dense.commit(keep)
            assert static.lengths.tolist() == dense.lengths.tolist()
            for layer, (S, conv) in dense.kda.items():
                torch.testing.assert_close(static.state[layer], S, atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(static.conv[layer], conv, atol=1e-6, rtol=1e-5)
        assert static.lengths.tolist() == [13, 15, 18]
        with pytest.raises(ValueError, match="record=False"):
            SpecBatch(static, 3, 2).commit(torch.tensor([1, 1, 1]))


@pytest.mark.parametrize("mxfp4", [False, True])
def test_gathered_moe_equals_loop(mxfp4):
    torch.manual_seed(0)
    moe = LatentMoE(k3_tiny_config()).eval()
    if mxfp4:
        convert_to_mxfp4(moe)
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        moe.routed_expert_norm.weight.normal_()
        loop = moe(x)
        assert set_static_moe(moe, 15) == 0 and moe._stacked is not None
        torch.testing.assert_close(moe(x), loop, atol=1e-6, rtol=1e-5)
        called = []
        moe._experts_loop = lambda *a: called.append(1) or LatentMoE._experts_loop(moe, *a)
        moe(x[:, :4])  # 12 tokens <= 15: gathered
        assert not called
        moe(torch.cat([x, x], 1))  # 30 tokens > 15: the loop path
        assert called
        # both graph-safe forms: per-pair gathered weights (N*k < E) and every expert on every token (N*k >= E)
        E, k = moe.num_experts, moe.top_k
        dense = []
        moe._experts_dense = lambda *a: dense.append(1) or LatentMoE._experts_dense(moe, *a)
        for n in (max(1, (E - 1) // k), E):
            dense.clear()
            xs = x.reshape(-1, 64)[:n][None]
            torch.testing.assert_close(moe(xs), loop.reshape(-1, 64)[:n][None], atol=1e-6, rtol=1e-5)
            assert bool(dense) == (n * k >= E)
        stacked = moe._stacked
        assert set_static_moe(moe, 0) == 15 and moe.static_tokens == 0
        assert set_static_moe(moe, 4) == 0 and moe._stacked is stacked  # made once, kept (graphs point at it)


def test_step_reads_no_tensor_values_on_the_host():
    """On the meta device any .item() / .tolist() / bool(t) / data-dependent shape raises: the K3 prefill (static
    MoE), the speculative step (draft, verify, accept, KDA commit) and the AR step run there; the MoE loop path
    (host-side expert counts) is the control that does fail."""
    with torch.device("meta"):
        target = K3ForCausalLM(k3_tiny_config(vocab_size=V)).eval()
        c = target.config
        cfg = DrafterConfig(vocab_size=V, hidden_size=c.hidden_size, target_hidden_size=c.hidden_size,
                            target_layer_ids=[1, 3], num_target_layers=2, mask_token_id=1, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=96, rope_theta=50000.0, markov_rank=8,
                            backbone="k3", q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                            qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                            v_head_dim=c.v_head_dim)
        drafter = DSparkDrafter(cfg, target.model.embed_tokens.weight, target.lm_head.weight).eval()
    ids = torch.zeros(2, 7, dtype=torch.long, device="meta")
    with torch.no_grad():
        for d in (drafter, None):
            gen = StaticGenerator(target, d, max_len=64, batch_size=2)
            set_static_moe(target, 64)
            gen.prefill(ids)
            for _ in range(2):
                packed = gen.step.run()
                assert packed.is_meta and packed.shape == (2, gen.k + 2)
        set_static_moe(target, 0)
        with pytest.raises((NotImplementedError, RuntimeError)):
            gen.prefill(ids)


def test_errors(targets):
    target = targets["k3"]
    drafter = make_k3_drafter(target)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        StaticGenerator(target, drafter, num_speculative_tokens=9)
    gen = StaticGenerator(target, drafter, max_len=32)
    with pytest.raises(ValueError, match="max_len=32"):
        gen.generate([5] * 10, 20)
    with pytest.raises(ValueError, match="rows"):
        gen.generate([[5] * 4] * 2, 4)
    with pytest.raises(ValueError, match="CUDA"):
        StaticGenerator(target, drafter, max_len=32, graphs=True).generate([5, 6], 4)


@cuda
@pytest.mark.parametrize("pair", list(PAIRS))
def test_cuda_graph_step_equals_eager(prompts, pair):
    kind, make = PAIRS[pair]
    target = make_target(kind, vocab=V).cuda()
    drafter = make(target).cuda()
    for d in (None, drafter):
        eager, graphed = (StaticGenerator(target, d, max_len=64, graphs=g) for g in (False, True))
        for prompt in prompts:
            a, b = eager.generate(prompt, N_NEW), graphed.generate(prompt, N_NEW)
            assert b.token_ids == a.token_ids and b.accepted_per_step == a.accepted_per_step
        assert graphed.captured is not None
    # the engine's verify runs the same torch KDA recurrence as the static verify (the AR step may use fla instead)
    ref = engine_greedy(target, drafter, [prompts[1]])[0]
    assert graphed.generate(prompts[1], N_NEW).token_ids == [ref.token_ids]


@cuda
def test_cuda_compiled_graph_step_equals_eager(prompts):
    """StaticGenerator(compile=True, graphs=True) on the K3 pair (fp32): inductor's fused step, captured, gives the
    eager static path's tokens and accepted counts."""
    target = make_target("k3", vocab=V).cuda()
    drafter = live_markov(make_k3_drafter(target)).cuda()
    for d in (None, drafter):
        eager = StaticGenerator(target, d, max_len=64)
        comp = StaticGenerator(target, d, max_len=64, graphs=True, compile=True)
        for prompt in prompts:
            a, b = eager.generate(prompt, N_NEW), comp.generate(prompt, N_NEW)
            assert b.token_ids == a.token_ids and b.accepted_per_step == a.accepted_per_step


def test_regenerate_static_equals_engine_greedy(targets):
    """The drafter trainer's fast regeneration (static path, batch_size rows per call, a short last chunk padded)
    continues every prompt exactly as the engine's greedy decode does."""
    from train.drafter import regenerate_static

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, V, (9,), generator=g).tolist() for _ in range(3)]
    for kind in ("qwen3", "k3"):
        got = regenerate_static(targets[kind], prompts, 12, batch_size=2, graphs=False)
        ref = engine_greedy(targets[kind], None, prompts, n=12)
        assert got == [p + r.token_ids for p, r in zip(prompts, ref)]


def test_regenerate_by_length_keeps_order_and_equals_engine_greedy(targets):
    """Prompts of mixed lengths (the k3-mini recipe's prompt_tokens list): one static generator per length, and the
    continuations come back in the prompts' order, each equal to the engine's greedy decode."""
    from train.drafter import regenerate_by_length

    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in (5, 11, 5, 8, 11)]
    got = regenerate_by_length(targets["k3"], prompts, 7, batch_size=2, graphs=False)
    ref = engine_greedy(targets["k3"], None, prompts, n=7)
    assert [len(s) for s in got] == [n + 7 for n in (5, 11, 5, 8, 11)]
    assert got == [p + r.token_ids for p, r in zip(prompts, ref)]

