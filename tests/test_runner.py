"""The model runner's device step (dspark/runner.py) on CPU fp32, and with CUDA graphs where a GPU is present: no
host reads inside a step (meta device), seeded sampling independent of the batch a request runs in, greedy rows
unaffected by sampled neighbours, the drafter's context stashed by plain steps and flushed before drafting, graphs
equal to the eager step, and the drafter trainer's regeneration through the engine (the k policy: test_policy.py)."""
import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch
from torch._dynamo.utils import counters

import dspark.prefill_runner as prefill_mod
from dspark.engine import Engine
from dspark.kernels import HAS_TRITON, interpreting
from dspark.models.drafter import DrafterConfig, DSparkDrafter
from dspark.models.k3.config import k3_tiny_config
from dspark.models.k3.model import K3ForCausalLM
from dspark.models.k3.moe import LatentMoE, set_static_moe
from dspark.policy import (
    PROBE_EVERY,
)
from dspark.request import SamplingParams
from dspark.runner import MODES
from dspark.step_buffers import PrefillBuffers
from tests.targets import make_target
from tests.test_drafter_k3 import make_k3_drafter
from tests.test_engine import make_drafter, reference_greedy

V = 300
N_NEW = 20
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def k3_drafter(target):
    return make_k3_drafter(target).to(next(target.parameters()).device)


PAIRS = {"qwen3": ("qwen3", make_drafter), "k3": ("k3", k3_drafter), "k3+qwen3-drafter": ("k3", make_drafter)}


def live_markov(drafter, seed=3):
    """A Markov head that matters (the factory's markov_w2 starts at zero, i.e. no bias at all)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = drafter.markov_head.markov_w2.weight
        w.copy_(torch.randn(w.shape, generator=g).to(w) * 2.0)
    return drafter


@pytest.fixture(scope="module")
def targets():
    return {kind: make_target(kind, vocab=V) for kind in ("qwen3", "k3")}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in (3, 11, 19)]


def test_step_reads_no_tensor_values_on_the_host():
    """On the meta device any .item() / .tolist() / bool(t) / data-dependent shape raises: the K3 + K3-drafter step
    (draft, verify, accept, KDA commit) runs there for every sampling mode, speculative and plain, and so does the
    prefill forward (with the drafter's context rows); the MoE loop path
    (host-side expert counts, taken with the gathered forms turned off) is the control that does fail."""
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
    for adaptive in (False, True):
        engine = Engine(target, drafter, max_batch_size=4, max_model_len=256, adaptive_verification=adaptive)
        runner = engine.runner
        with torch.no_grad():
            for mode in MODES:
                for k, context in ((0, True), (0, False), (3, True)):
                    st = runner._get(runner.key_for(3, k, 40, mode, context))
                    packed = runner._step_fn(st)
                    assert packed.is_meta and packed.shape == (4, k + 3)
            # the prefill forward: a 50-token chunk after 40 cached tokens, one row
            key = runner.prefill_key(50, 40)
            last = runner._prefill_fn(PrefillBuffers(1, key, torch.device("meta")))
            assert last.is_meta and last.shape == (1, V)
    set_static_moe(target, 0)
    for m in target.modules():  # nor the inference forms' budget: the loop path
        if isinstance(m, LatentMoE):
            m.dense_elements = 0
    with pytest.raises((NotImplementedError, RuntimeError)), torch.no_grad():
        runner._step_fn(runner._get(runner.key_for(3, 3, 40, "greedy")))


@pytest.mark.parametrize("kind", ["qwen3", "k3"])
def test_seeded_sampling_does_not_depend_on_the_batch(targets, prompts, kind):
    """A seeded request draws its random numbers from (seed, position) alone: with the same drafts per step (k
    pinned), the same tokens whether it runs alone or beside other sampled and greedy requests, in a different row
    and batch bucket."""
    target = targets[kind]
    drafter = live_markov(make_drafter(target) if kind == "qwen3" else k3_drafter(target))
    mine = SamplingParams(max_tokens=N_NEW, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    for draft_sample in (False, True):
        alone = Engine(target, drafter, 4, draft_sample=draft_sample).generate([prompts[1]], mine)[0]
        others = [SamplingParams(max_tokens=N_NEW - 5, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=N_NEW, temperature=1.2, top_k=7, seed=5, ignore_eos=True), mine]
        mixed = Engine(target, drafter, 4, draft_sample=draft_sample).generate([prompts[0], prompts[2], prompts[1]],
                                                                               others)
        assert mixed[2].token_ids == alone.token_ids
        assert mixed[0].token_ids == reference_greedy(target, prompts[0], N_NEW - 5)  # greedy beside sampled rows
        assert mixed[1].token_ids != alone.token_ids


@pytest.mark.parametrize("kind", ["qwen3", "k3"])
def test_a_request_that_keeps_no_drafter_context_prefills_the_target_alone(targets, kind, monkeypatch):
    """A sampled request admitted while plain decoding is the sampled rows' choice keeps no drafter context: its
    prefill is the target's forward alone (no drafter context rows written), and its prompt blocks are cached apart
    (scheduler.NO_CONTEXT_SALT): another such request with the same prompt attaches to them, one that keeps the
    context (greedy) prefills the prompt anew, its rows written, and its greedy text is the target's."""
    kind_, make = PAIRS[kind]
    target = targets[kind_]
    engine = Engine(target, make(target), max_batch_size=2, prefix_caching=True)
    written = []
    write = engine.runner.drafts.write_context
    monkeypatch.setattr(engine.runner.drafts, "write_context",
                        lambda batch, aux: (written.append(aux[0].shape[1]), write(batch, aux))[1])
    engine.policy.probe_every["sampled"] = 2 * PROBE_EVERY  # probes have found plain decoding best for sampled rows
    prompt = torch.randint(2, V, (50,), generator=torch.Generator().manual_seed(8)).tolist()
    sampled = SamplingParams(max_tokens=N_NEW, temperature=0.9, ignore_eos=True)
    greedy = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    stats = engine.cache.prefix.stats

    def run(params):
        hit = stats.hit_tokens
        written.clear()
        req = engine.add_request(prompt, params)
        while engine.has_work():
            engine.step()
        return req, stats.hit_tokens - hit

    a, hit = run(sampled)
    assert not a.context and hit == 0 and written == []
    b, hit = run(sampled)
    assert not b.context and hit == 48 and written == []  # three whole blocks of 16 from a's
    c, hit = run(greedy)
    assert c.context and hit == 0 and written[0] >= 50  # its prefill wrote the prompt's context rows
    assert c.output_ids == reference_greedy(target, prompt, N_NEW)
    d, hit = run(greedy)
    assert d.context and hit == 48 and d.output_ids == c.output_ids
    # a server's warm-up captures the prefill of each key with and without the drafter's rows (keys only here)
    for runner in (engine.runner, Engine(target).runner):
        monkeypatch.setattr(runner, "graphs", True)
        one = runner.prefill_keys(64, 256)  # with the drafter's rows (a target alone has none: context False)
        both = runner.prefill_keys(64, 256, (True, False))
        want = one + [k._replace(context=False) for k in one] if runner.drafts is not None else one
        assert sorted(both) == sorted(want) and {k.context for k in one} <= {runner.drafts is not None}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_plain_steps_stash_the_context_and_drafting_flushes_it(targets, prompts, pair, overlap, monkeypatch):
    """A plain step writes only the projection of the drafter's context input per position; before the request
    drafts again the stashed positions become context rows. Under a k schedule of plain runs and drafting steps,
    after every drafting step the drafter's rows of every committed position equal those of one plain forward over
    the sequence, and the output is the target's greedy. With overlap a switch to drafting is queued behind the
    plain step in flight: its flush runs before that step is read and covers the position the step stashes."""
    kind, make = PAIRS[pair]
    target = targets[kind]
    drafter = make(target)
    engine = Engine(target, drafter, max_batch_size=2, prefill_chunk=8, overlap=overlap)
    k = engine.k
    schedule = iter([0, 0, 0, k, 0, k, k, 0, 0, 0, 0, 1] * 10)
    monkeypatch.setattr(engine.policy, "choose", lambda *a: next(schedule))
    flushed, behind = [], []  # per flush: the counts; and (its end, the flight's row's position) when queued behind one
    flush = engine.runner.flush_context

    def spy(starts, counts, *a):
        flushed.append(counts)
        if engine.in_flight is not None:
            behind.append((starts[0] + counts[0], req.num_computed))
        return flush(starts, counts, *a)
    monkeypatch.setattr(engine.runner, "flush_context", spy)
    req = engine.add_request(prompts[2], SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    checked = 0
    while engine.has_work():
        engine.step()
        checked += _context_rows_match(engine, target, drafter, req)
    assert req.output().token_ids == reference_greedy(target, prompts[2], N_NEW)
    assert checked >= 3 and flushed and all(max(n) >= 1 for n in flushed)
    assert engine.metrics()["decode_steps_per_k"][0] > 0
    # with overlap every switch is queued behind the plain step in flight, its flush through that step's position
    assert (len(behind) == len(flushed) and all(end == pos + 1 for end, pos in behind)) if overlap else not behind
    assert bool(engine.runner.flushes) == engine.runner.graphs  # on CUDA each row's flush replays a captured graph


def _context_rows_match(engine, target, drafter, req) -> bool:
    """For a live request whose context is complete (it just drafted): its drafter rows of every committed position
    equal those of one plain forward over its sequence (asserted) -> True; else nothing to check -> False."""
    if req.finish_reason is not None or req.num_context < req.num_computed:
        return False
    n = req.num_computed
    seq = (req.prompt_ids + req.output_ids)[:n]
    with torch.no_grad():
        _, aux = target(torch.tensor([seq], device=engine.device), aux_layer_ids=drafter.config.target_layer_ids)
        want = drafter.context_rows(drafter.context(aux), torch.arange(n, device=engine.device))
    cache = engine.cache
    where = cache._token_rows(cache.reqs[req.id], n)
    for layer, rows in zip(engine.drafts.layers, want):
        got = cache.kv[layer].view(-1, cache.kv[layer].shape[-1])[where]
        torch.testing.assert_close(got, rows[0].to(got.dtype), atol=1e-4, rtol=1e-4)
    return True


class ReplayFn:
    """On the CPU, a captured graph's stand-in: its replay runs the captured function again over the same buffers."""

    def __init__(self, fn):
        self.replay = fn


def replay_flush_graphs_on_cpu(engine, monkeypatch, names=("flush_context",)) -> None:
    """Make the engine runner's methods `names` take their graph path on the CPU (ReplayFn for each capture, which
    runs its function twice, as a capture's warm-up and the capture do)."""
    runner = engine.runner

    def capture(fn, holder, warmup):
        holder.graph = ReplayFn(fn)
        fn()
        return fn()

    def graphed(method):
        def call(*a):
            runner.graphs = True
            try:
                return method(*a)
            finally:
                runner.graphs = False
        return call

    monkeypatch.setattr(runner, "_capture_fn", capture)
    for name in names:
        monkeypatch.setattr(runner, name, graphed(getattr(runner, name)))


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("pair", ["qwen3", "k3"])
def test_a_flush_of_many_rows_runs_as_one_forward(targets, pair, graphs, monkeypatch):
    """A switch to drafting with more rows than FLUSH_GRAPH_ROWS flushes their stashed context in one batched forward
    (with graphs one graph of them all, with fewer rows a graph per row; on the CPU the graphs' replays run their
    function again), its rows and new tokens padded to powers of two: after every drafting step each request's
    drafter rows of every committed position equal those of one plain forward over its sequence, and every output is
    the target's greedy."""
    kind, make = PAIRS[pair]
    target = targets[kind]
    drafter = make(target)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in (5, 9, 3)]
    engine = Engine(target, drafter, max_batch_size=4, prefill_chunk=16, graphs=None if graphs else False)
    if graphs and not engine.runner.graphs:
        replay_flush_graphs_on_cpu(engine, monkeypatch)
    k = engine.k
    schedule = iter([0, 0, 0, k, 0, 0, k, k] * 20)
    monkeypatch.setattr(engine.policy, "choose", lambda *a: next(schedule))
    monkeypatch.setattr(prefill_mod, "FLUSH_GRAPH_ROWS", 2)
    rows, widths = [], []  # the rows and new tokens of each context flush run from Python (eager, or a capture)
    flush = engine.drafts.flush_context
    monkeypatch.setattr(engine.drafts, "flush_context", lambda view: (
        rows.append(view.num_new.shape[0]), widths.append(view.attn_read(engine.drafts.stash_layer).shape[1]),
        flush(view))[-1])
    reqs = [engine.add_request(p, SamplingParams(max_tokens=N_NEW, ignore_eos=True)) for p in prompts]
    checked = 0
    while engine.has_work():
        engine.step()
        checked += sum(_context_rows_match(engine, target, drafter, r) for r in reqs)
    assert [r.output().token_ids for r in reqs] == [reference_greedy(target, p, N_NEW) for p in prompts]
    assert checked >= 6 and max(rows) == 4  # the three rows' switch: one forward, a padding row with them
    assert all(n & (n - 1) == 0 for n in rows)
    assert all(T >= prefill_mod.FLUSH_MIN and T & (T - 1) == 0 for T in widths)
    assert [r for r, _ in engine.runner.batch_flushes] == ([4] * len(engine.runner.batch_flushes))
    assert bool(engine.runner.batch_flushes) == graphs  # with graphs the batch replays its graph


@pytest.mark.parametrize("graphs", [False, True])
def test_warm_flush_runs_each_batched_flush_shape_on_the_scratch_block(targets, graphs, monkeypatch):
    """Engine.warmup's batched flushes (each bucketed shape of more than FLUSH_GRAPH_ROWS rows, so that no request
    pays for its first run: with graphs captured, each run twice for its capture, up to FLUSH_BATCH_GRAPH_TOKENS new
    tokens a row, the wider ones run eagerly; without, run eagerly) cover every row bucket and flush key, and write
    the scratch block only: the context rows of a request in flight stay as they were."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target), max_batch_size=12, max_model_len=48,
                    graphs=None if graphs else False)
    monkeypatch.setattr(prefill_mod, "FLUSH_BATCH_GRAPH_TOKENS", 32)  # of the flush keys' 16, 32 and 64 tokens
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.sync()
    before = {ly: t.clone() for ly, t in engine.cache.kv.items()}
    shapes = []
    flush = engine.drafts.flush_context
    monkeypatch.setattr(engine.drafts, "flush_context", lambda view: (
        shapes.append((view.num_new.shape[0], view.attn_read(engine.drafts.stash_layer).shape[1])), flush(view))[-1])
    if graphs and not engine.runner.graphs:
        replay_flush_graphs_on_cpu(engine, monkeypatch, ("warm_flush",))
    n, keys = engine.runner.warm_flush(12, 48), engine.runner.flush_keys(48)
    captured = [(rows, key) for rows in (8, 16) for key in keys if key.T <= 32] if graphs else []
    assert n == 2 * len(keys) and {key.T for key in keys} == {16, 32, 64}
    assert sorted(engine.runner.batch_flushes) == sorted(captured) and len(shapes) == n + len(captured)
    assert sorted(set(shapes)) == sorted({(rows, key.T) for rows in (8, 16) for key in keys})
    scratch = engine.cache.scratch_block
    for ly, t in engine.cache.kv.items():
        assert torch.equal(t[:scratch], before[ly][:scratch]), ly


@pytest.mark.parametrize("pair", list(PAIRS))
def test_many_prefills_run_batched_by_a_token_budget(targets, pair, monkeypatch):
    """A step that admits more requests than PREFILL_GRAPH_ROWS prefills them in eager forwards of at most
    PREFILL_BATCH_TOKENS padded tokens, chunks sorted by width (right padding changes no row and no recurrent state):
    every request's output is the target's greedy, and the forwards stay within the budget."""
    kind, make = PAIRS[pair]
    target = targets[kind]
    g = torch.Generator().manual_seed(5)
    lens = [3, 17, 5, 12, 9, 20, 4, 15, 7, 11, 6, 18]  # more than PREFILL_GRAPH_ROWS, of mixed widths
    prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in lens]
    engine = Engine(target, make(target), max_batch_size=len(prompts))
    monkeypatch.setattr(prefill_mod, "PREFILL_BATCH_TOKENS", 40)
    monkeypatch.setattr(prefill_mod, "PREFILL_GRAPH_ROWS", 8)  # on CUDA too: 12 requests run batched
    forwards = []
    eager = engine.runner._prefill_eager
    monkeypatch.setattr(engine.runner, "_prefill_eager",
                        lambda rows, *a: (forwards.append((len(rows), a[4])), eager(rows, *a))[1])
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == [reference_greedy(target, p, 6) for p in prompts]
    align = engine.prefill_align
    assert sum(n for n, _ in forwards) == len(prompts) and len(forwards) >= 3
    assert all(n * T <= 40 or n == 1 for n, T in forwards)
    assert [T for _, T in forwards] == sorted(T for _, T in forwards) and max(T for _, T in forwards) == -(-20 // align) * align


@pytest.mark.parametrize("pair", ["qwen3", "k3"])
def test_a_step_outside_no_grad_leaves_the_cache_out_of_autograd(targets, pair):
    """The cache is written in place, so a step run under autograd (a warm-up or capture called without no_grad)
    would chain every forward's graph, saved activations and all, onto the cache tensors for good: on a GPU the
    warm-up of a server's step graphs then ran out of memory. Every runner entry that runs a step is no_grad."""
    kind, make = PAIRS[pair]
    engine = Engine(targets[kind], make(targets[kind]), max_batch_size=2)
    runner = engine.runner
    assert torch.is_grad_enabled()
    for k in (0, engine.k):
        runner._run(runner._get(runner.key_for(2, k, 40, "sample")))
    runner.flush_context([0, 3], [4, 2], [[0, 1, 2], [3]], [engine.cache.scratch_slot] * 2)
    stores = list(engine.cache.kv.values()) + list(engine.cache.state.S.values()) + list(engine.cache.state.conv.values())
    assert stores and not any(t.requires_grad or t.grad_fn is not None for t in stores)


def test_a_dead_engine_is_freed_without_the_garbage_collector(targets):
    """An engine's runner (its graphs, static buffers) and cache sit in no reference cycle: dropping the engine frees
    them at once, not at some later collection, which on a GPU may fall inside another engine's graph capture."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target), max_batch_size=2)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    refs = [weakref.ref(x) for x in (engine, engine.runner, engine.cache, engine.policy, engine.drafts)]
    gc.disable()
    try:
        del engine
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        gc.enable()


def test_regenerate_is_the_engines_greedy(targets):
    """The drafter trainer's regeneration continues every prompt exactly as the engine's greedy decode does, in
    the prompts' order, with prompts of mixed lengths."""
    from train.sequences import regenerate

    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in (5, 11, 5, 8, 11)]
    got = regenerate(targets["k3"], None, prompts, 7, 0.0, batch_size=2, seeds=[0] * len(prompts))
    assert got == [p + reference_greedy(targets["k3"], p, 7) for p in prompts]


def test_errors(targets):
    target = targets["k3"]
    drafter = k3_drafter(target)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(target, drafter, num_speculative_tokens=9)
    if not next(target.parameters()).is_cuda:
        with pytest.raises(ValueError, match="CUDA"):
            Engine(target, drafter, graphs=True)
    engine = Engine(target, drafter, max_batch_size=2)
    with pytest.raises(ValueError, match="max_batch_size=2"):
        engine.runner.key_for(3, 4, 40, "greedy")


@cuda
@pytest.mark.parametrize("pair", list(PAIRS))
def test_cuda_graph_step_equals_eager(prompts, pair):
    """One CUDA graph per step key and per prefill key gives the eager engine's tokens and accepted counts, greedy and
    seeded-sampled; prompts longer than the prefill chunk take graphs whose chunk follows cached tokens."""
    kind, make = PAIRS[pair]
    target = make_target(kind, vocab=V).cuda()
    drafter = live_markov(make(target)).cuda()
    params = [SamplingParams(max_tokens=N_NEW, ignore_eos=True),
              SamplingParams(max_tokens=N_NEW, temperature=0.7, top_k=20, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=N_NEW, temperature=1.0, seed=4, ignore_eos=True)]
    for d in (None, drafter):
        k = None if d is None else 3
        eager = Engine(target, d, num_speculative_tokens=k, graphs=False).generate(prompts, params)
        engine = Engine(target, d, num_speculative_tokens=k, graphs=True, prefill_chunk=8)
        graphed = engine.generate(prompts, params)
        assert engine.runner.steps and all(st.graph is not None for st in engine.runner.steps.values())
        assert engine.runner.prefills and all(p.graph is not None for p in engine.runner.prefills.values())
        assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
        assert [o.accepted_per_step for o in graphed] == [o.accepted_per_step for o in eager]


def test_compiled_step_compiles_once_for_every_context_bucket(targets, monkeypatch):
    """torch.compile guards on its inputs' strides: the step hands its forward the block table and the row columns as
    dense tensors of their own (a slice of the step's int buffer has a row stride that grows with the block-table
    width), so the steps of one batch bucket and k share their compiled frames at every context bucket. Dynamo's
    eager backend here: its guards, not the code generator, decide what recompiles."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))
    target = targets["k3"]
    engine = Engine(target, k3_drafter(target), num_speculative_tokens=2, max_batch_size=2, max_model_len=600,
                    compile=True)
    r, frames = engine.runner, []
    for n in (128, 256, 512):
        key = r.key_for(2, 2, n, "greedy")
        r._run(r._get(key))
        frames.append(counters["stats"]["unique_graphs"])
    assert len({r.key_for(2, 2, n, "greedy").width for n in (128, 256, 512)}) == 3
    assert frames[0] == frames[1] == frames[2] and r.compiled, frames


@pytest.mark.skipif(not HAS_TRITON or interpreting() or os.environ.get("DSPARK_TEST_DEVICE", "cpu") != "cpu",
                    reason="needs triton; runs the test above interpreted, on the CPU (a CUDA run: the test above)")
def test_compiled_step_compiles_once_for_every_context_bucket_with_kernels():
    """The same under TRITON_INTERPRET=1, in a process of its own (triton reads it at import): the step then
    launches the Triton kernels the GPU runs, each a graph break whose resume frame dynamo compiles anew. A CUDA run
    of the suite leaves it to the test above, which compiles the real kernels (dynamo of torch 2.11 fails to trace
    the interpreter's launches)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    test = f"{__file__}::test_compiled_step_compiles_once_for_every_context_bucket"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:]


@pytest.mark.timeout(1200)  # on CUDA inductor compiles Triton code for each of the step's shapes: minutes
def test_compiled_step_equals_eager(targets, prompts):
    """torch.compile of the step's target forward and drafter pass (dynamic shapes; Triton launches as graph breaks)
    gives the eager step's tokens and accepted counts: the K3 pair, plain and speculative, greedy and seeded-sampled
    rows in one batch, then one row alone. On CUDA (DSPARK_TEST_DEVICE=cuda) the compiled step is also captured."""
    target = targets["k3"]
    drafter = live_markov(k3_drafter(target))
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True)]
    for d in (None, drafter):
        k = None if d is None else 3
        eager = Engine(target, d, num_speculative_tokens=k, graphs=False)
        compiled = Engine(target, d, num_speculative_tokens=k, compile=True)
        for batch, ps in ((prompts, params), (prompts[:1], params[:1])):
            want, got = eager.generate(batch, ps), compiled.generate(batch, ps)
            assert [o.token_ids for o in got] == [o.token_ids for o in want]
            assert [o.accepted_per_step for o in got] == [o.accepted_per_step for o in want]
        assert compiled.runner.compiled  # no fallback to the eager forward happened
