"""The engine end to end on CPU fp32: speculative greedy == autoregressive greedy for every draft quality, prefix
caching changes nothing, no cache leaks, prefill/decode handoff, and plain-forward references."""
from types import SimpleNamespace

import pytest
import torch

from dspark.cache.prefix import PrefixCacheConfig
from dspark.engine import ALLOC_BLOCKS, Engine
from dspark.models.drafter import DrafterConfig, DSparkDrafter
from dspark.request import SamplingParams
from dspark.spec.draft import Proposal
from dspark.spec.sampling import RowSampling
from tests.targets import TARGETS, make_target

V = 300


def make_drafter(target, block_size=4, markov_rank=8, mode="dspark", seed=1):
    torch.manual_seed(seed)
    c = target.config
    cfg = DrafterConfig(vocab_size=V, hidden_size=c.hidden_size, target_hidden_size=c.hidden_size,
                        target_layer_ids=[0, c.num_hidden_layers - 1], num_target_layers=c.num_hidden_layers,
                        mask_token_id=1, block_size=block_size, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=96, mode=mode,
                        markov_rank=markov_rank if mode == "dspark" else 0, enable_confidence_head=mode == "dspark")
    d = DSparkDrafter(cfg, target.model.embed_tokens.weight, target.lm_head.weight)
    return d.to(next(target.parameters()).device).eval()


def reference_greedy(target, prompt, n):
    """Plain full-sequence forwards, no cache: the definition of the target's greedy output."""
    ids = list(prompt)
    dev = next(target.parameters()).device
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(target(torch.tensor([ids], device=dev))[0, -1].argmax()))
    return ids[len(prompt):]


class ScriptedDrafts:
    """Replaces the drafter's proposals: 'oracle' (the target's own greedy continuation: every draft accepted),
    'random', 'adversarial' (never the target's token) or 'partial' (oracle with one wrong token per block)."""

    def __init__(self, runner, engine, refs, quality, seed=0):
        self.runner, self.engine, self.refs, self.quality = runner, engine, refs, quality
        self.g = torch.Generator().manual_seed(seed)

    def write_context(self, batch, aux):
        self.runner.write_context(batch, aux)

    def stash_context(self, batch, aux):
        self.runner.stash_context(batch, aux)

    def flush_context(self, view):
        self.runner.flush_context(view)

    def propose(self, view, anchors, k, sampling=None, u=None, seed=None, confidence=False):
        rows = []
        for req in self.engine.step_requests:  # the rows of the step in flight, in order
            ref = self.refs[req.id]
            done = len(req.output_ids)
            good = (ref[done:done + k] + [0] * k)[:k]
            if self.quality == "oracle":
                row = good
            elif self.quality == "random":
                row = torch.randint(0, V, (k,), generator=self.g).tolist()
            elif self.quality == "adversarial":
                row = [(t + 1) % V for t in good]
            else:
                bad = int(torch.randint(0, k, (1,), generator=self.g))
                row = [(t + 1) % V if i == bad else t for i, t in enumerate(good)]
            rows.append(row)
        rows += [[0] * k] * (anchors.shape[0] - len(rows))  # the bucket's padding rows
        return Proposal(torch.tensor(rows, device=anchors.device), None, None)


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request):
    return make_target(request.param, vocab=V)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in (3, 11, 19, 6, 25)]


@pytest.fixture(scope="module")
def refs(target, prompts):
    return [reference_greedy(target, p, 24) for p in prompts]


def test_ar_engine_matches_plain_forward(target, prompts, refs):
    outs = Engine(target, max_batch_size=3, prefill_chunk=7).generate(prompts, SamplingParams(max_tokens=24))
    assert [o.token_ids for o in outs] == refs


def test_aligned_prefill_equals_plain_forward(target, prompts, refs):
    """Prefill chunks padded to an aligned width (on CUDA: engine.PREFILL_ALIGN), wider here than every chunk, commit
    only their own tokens: AR and speculative greedy output equal the reference, and every block is freed."""
    for drafter in (None, make_drafter(target)):
        engine = Engine(target, drafter, max_batch_size=3, prefill_chunk=7)
        engine.prefill_align = 16
        outs = engine.generate(prompts, SamplingParams(max_tokens=24))
        assert [o.token_ids for o in outs] == refs
        assert engine.cache.pool.num_used == 0


@pytest.mark.parametrize("quality", ["oracle", "random", "adversarial", "partial", "trained-random-weights"])
def test_speculative_greedy_equals_autoregressive(target, prompts, refs, quality):
    drafter = make_drafter(target)
    scripted = quality != "trained-random-weights"  # drafts made on the host each step: no CUDA graph
    engine = Engine(target, drafter, max_batch_size=4, prefill_chunk=8, graphs=False if scripted else None)
    if scripted:
        reqs = [engine.add_request(p, SamplingParams(max_tokens=24)) for p in prompts]
        engine.runner.drafts = ScriptedDrafts(engine.drafts, engine, {r.id: ref for r, ref in zip(reqs, refs)},
                                              quality)
        while engine.has_work():
            engine.step()
        outs = [r.output() for r in reqs]
    else:
        outs = engine.generate(prompts, SamplingParams(max_tokens=24))
    assert [o.token_ids for o in outs] == refs
    accepted = [a for o in outs for a in o.accepted_per_step]
    k = drafter.config.num_drafts
    if quality == "oracle":  # acceptance of all drafts (the last step may verify fewer: max_tokens)
        assert all(a == n for o in outs for a, n in zip(o.accepted_per_step, o.num_drafts_per_step))
        assert max(accepted) == k
    if quality == "adversarial":  # acceptance of none
        assert set(accepted) == {0}
    if quality == "partial":
        assert 0 < sum(accepted) < sum(n for o in outs for n in o.num_drafts_per_step)
    assert engine.cache.pool.num_used == 0  # every request freed its blocks


def test_dflash_mode_is_lossless_too(target, prompts, refs):
    outs = Engine(target, make_drafter(target, mode="dflash")).generate(prompts, SamplingParams(max_tokens=24))
    assert [o.token_ids for o in outs] == refs


@pytest.mark.parametrize("policy,align", [("interval", 1), ("second_hit", 1), ("interval", 16)])
def test_prefix_cache_on_equals_off_with_eviction_and_no_leak(target, policy, align):
    """align 16: prefill chunks padded to an aligned width, as on CUDA (they end at the cache's checkpoints)."""
    g = torch.Generator().manual_seed(3)
    systems = [torch.randint(2, V, (40,), generator=g).tolist() for _ in range(2)]
    prompts = [systems[s] + torch.randint(2, V, (n,), generator=g).tolist()
               for s, n in zip((0, 0, 0, 1, 1, 1, 0, 0), (5, 9, 3, 12, 7, 5, 8, 4))]
    prompts.append(list(prompts[0]))  # an exact repeat
    params = SamplingParams(max_tokens=10)
    drafter = make_drafter(target)
    off = Engine(target, drafter, max_batch_size=2, prefill_chunk=16).generate(prompts, params)
    cfg = PrefixCacheConfig(policy=policy, retention_interval=16 if policy == "interval" else 0)
    # a pool of 12 blocks for requests of up to 9: the other system prompt's cached blocks must be evicted
    on = Engine(target, drafter, max_batch_size=1, prefill_chunk=16, block_size=8, num_blocks=12,
                prefix_caching=cfg)
    on.prefill_align = align
    outs = on.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in off]
    stats = on.cache.prefix.stats
    assert stats.hit_tokens > 0 and stats.block_evictions > 0
    # no leak: only the prefix cache still holds blocks, and clearing it empties the pool
    assert on.cache.pool.num_used == len(on.cache.prefix.blocks)
    on.cache.prefix.clear()
    assert on.cache.pool.num_used == 0


def test_cancelled_requests_free_their_cache(target, prompts):
    engine = Engine(target, make_drafter(target), max_batch_size=2)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=30)) for p in prompts]
    engine.step()
    engine.step()
    engine.abort(reqs[0].id)  # running
    engine.abort(reqs[4].id)  # still waiting
    assert reqs[0].finish_reason == "abort" and reqs[4].finish_reason == "abort"
    while engine.has_work():
        engine.step()
    assert engine.cache.pool.num_used == 0
    assert all(r.finish_reason == "length" for r in reqs[1:4])


def test_decode_steps_take_blocks_in_chunks_within_the_reservation(target, prompts):
    """A decode step that needs a cache block takes ALLOC_BLOCKS at once (the rows' block tables, which the runner
    stages to the device whenever they change, then change every ALLOC_BLOCKS blocks), never past the blocks the
    request reserved at admission; every block goes back when it finishes. Its text is the AR engine's
    (test_speculative_greedy_equals_autoregressive)."""
    engine = Engine(target, make_drafter(target), block_size=4)
    reqs = [engine.add_request(prompts[0], SamplingParams(max_tokens=60, ignore_eos=True)),
            engine.add_request(prompts[1], SamplingParams(max_tokens=12, ignore_eos=True))]
    held, sizes = {}, {r.id: set() for r in reqs}
    while engine.has_work():
        engine.step()
        held.update((r.id, engine.scheduler.reserved[r.id]) for r in reqs if r.id in engine.scheduler.reserved)
        for r in reqs:
            if r.num_steps and r.id in engine.cache.reqs:  # decoding: its last step reserved
                sizes[r.id].add(len(engine.cache.reqs[r.id].table.blocks))
    assert len(sizes[reqs[0].id]) >= 3 and sizes[reqs[1].id]
    for r in reqs:
        assert all(n % ALLOC_BLOCKS == 0 or n == held[r.id] for n in sizes[r.id]) and max(sizes[r.id]) <= held[r.id]
    assert engine.cache.pool.num_used == 0


def test_prefill_decode_handoff_equals_one_engine(target, prompts, refs):
    drafter = make_drafter(target)
    prefill_engine = Engine(target, drafter, max_batch_size=4)
    decode_engine = Engine(target, drafter, max_batch_size=4)
    reqs = [prefill_engine.add_request(p, SamplingParams(max_tokens=24)) for p in prompts[:3]]
    while any(not r.output_ids for r in reqs):
        prefill_engine.step()
    handoffs = [prefill_engine.export_prefilled(r.id) for r in reqs]
    assert prefill_engine.cache.pool.num_used == 0
    moved = [decode_engine.import_prefilled(h) for h in handoffs]
    while decode_engine.has_work():
        decode_engine.step()
    assert [r.output_ids for r in moved] == refs[:3]


def test_stop_token_ids_end_the_request(target, prompts, refs):
    stop = refs[1][5]
    out = Engine(target, make_drafter(target)).generate([prompts[1]], SamplingParams(max_tokens=24,
                                                                                    stop_token_ids=[stop]))[0]
    assert out.token_ids == refs[1][: refs[1].index(stop) + 1] and out.finish_reason == "stop"


def test_first_token_of_greedy_rows_is_what_sampling_gives_them(target):
    """A prefill whose rows are all greedy takes the argmax of their last logits, not the sampling path: the same
    token the sampling path gives a greedy row (ties to the first index), checked on logits with ties; a batch with
    one sampled row still samples, and its greedy rows keep their argmax."""
    engine = Engine(target, make_drafter(target))
    g = torch.Generator().manual_seed(3)
    last = torch.randint(0, 4, (6, V), generator=g).float().to(engine.device)  # many ties at the max
    greedy = [SimpleNamespace(params=SamplingParams(max_tokens=4), seed=n, prompt_ids=[1] * (n + 2))
              for n in range(6)]
    sampled = SimpleNamespace(params=SamplingParams(max_tokens=4, temperature=0.8, seed=5), seed=5,
                              prompt_ids=[1, 2, 3])
    fast = engine._first_tokens(greedy, last)
    zeros = torch.zeros(6, device=engine.device)
    ref = engine.runner.sample_first(last, RowSampling(zeros), zeros.long(), torch.arange(6, device=engine.device))
    assert fast.tolist() == ref.tolist() == last.argmax(-1).tolist()
    mixed = engine._first_tokens(greedy[:5] + [sampled], last)
    assert mixed[:5].tolist() == ref[:5].tolist()
    assert 0 <= int(mixed[5]) < V


def test_sampling_params_are_respected(target, prompts):
    engine = Engine(target, make_drafter(target))
    a = engine.generate(prompts[:2], SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=7))
    b = Engine(target, make_drafter(target)).generate(prompts[:2], SamplingParams(max_tokens=12, temperature=0.9,
                                                                                 top_k=20, seed=7))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]  # seeded: reproducible
    assert all(len(o.token_ids) == 12 for o in a)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(prompts[0], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="context length"):
        engine.add_request(list(range(2, 10)) * 1000, SamplingParams(max_tokens=4))


def test_seeded_text_does_not_depend_on_the_k_policy(target, prompts):
    """Under the k policy (on a GPU its k follows step times) a seeded sampled request decodes plainly: its text is
    the AR engine's for that seed whatever k the policy picks, here made to pick 1, 0 or the whole block. Unseeded
    sampled rows in the same steps draft as the policy says; a pinned k drafts seeded rows too."""
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=7)
    unseeded = SamplingParams(max_tokens=12, temperature=0.9, top_k=20)
    ar = [o.token_ids for o in Engine(target).generate(prompts[:2], params)]
    for picked in (1, 0, 4):
        engine = Engine(target, make_drafter(target))
        engine.policy.choose = lambda *a, picked=picked: picked
        outs = engine.generate(prompts[:3], [params, params, unseeded])
        assert [o.token_ids for o in outs[:2]] == ar
        assert all(not any(o.num_drafts_per_step) for o in outs[:2])
        assert max(outs[2].num_drafts_per_step) == picked
    pinned = Engine(target, make_drafter(target), num_speculative_tokens=2).generate(prompts[:1], params)[0]
    assert max(pinned.num_drafts_per_step) == 2


def test_counters_match_per_request_logs(target, prompts):
    engine = Engine(target, make_drafter(target))
    outs = engine.generate(prompts, SamplingParams(max_tokens=16))
    m = engine.metrics()
    assert m["num_accepted_tokens"] == sum(sum(o.accepted_per_step) for o in outs)
    assert m["num_draft_tokens"] == sum(sum(o.num_drafts_per_step) for o in outs)
    assert m["num_drafts"] == sum(sum(1 for n in o.num_drafts_per_step if n) for o in outs)
    assert sum(m["num_accepted_tokens_per_pos"]) == m["num_accepted_tokens"]
