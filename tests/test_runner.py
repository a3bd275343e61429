"""The model runner's device step (dspark/runner.py) on CPU fp32, and with CUDA graphs where a GPU is present: no
host reads inside a step (meta device), seeded sampling independent of the batch a request runs in, greedy rows
unaffected by sampled neighbours, the per-step choice of k, graphs equal to the eager step, and the drafter
trainer's regeneration through the engine."""
import gc
import os
import statistics
import subprocess
import sys
import weakref
from collections import deque

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
    ACCEPT_WINDOW,
    CONTEXT_EVERY,
    DRAFT_GAIN,
    MIN_CYCLES,
    PROBE_EVERY,
    PROBE_MAX,
    REFRESH_STEPS,
    REPICK_EVERY,
    STALE_STEPS,
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


def test_k_per_step_follows_measured_step_times(targets, prompts):
    """num_speculative_tokens=None: the engine drafts the k with the most expected tokens per millisecond of its
    graph. When drafting makes a step cheaper it drafts the whole block (free drafting is not enough: this random
    drafter's acceptance is below DRAFT_GAIN's margin); when a draft costs more than any acceptance can return
    it decodes plainly once its first steps (the whole block, to measure acceptance) are done; a pinned k is kept
    whatever the times. The output stays the target's greedy."""
    target = targets["qwen3"]
    refs = [reference_greedy(target, p, N_NEW) for p in prompts]
    for spec_cost in (-0.5, 40.0):  # step time with k drafts: 1 + spec_cost * k / 4 ms
        # each step read before the next is chosen (with overlap, on CUDA, a choice sees the steps one step late)
        engine = Engine(target, make_drafter(target), overlap=False)
        # the policy reads graph replay times (None without graphs: the whole block); here they are given, and the
        # host time it would learn between graph steps on CUDA stays 0 (its own test below)
        engine.runner.step_ms = lambda key, c=spec_cost: 1.0 + c * key.k / 4
        engine.policy.step_started = lambda *a: None
        outs = engine.generate(prompts, SamplingParams(max_tokens=N_NEW, ignore_eos=True))
        assert [o.token_ids for o in outs] == refs
        drafted = [[n > 0 for n in o.num_drafts_per_step] for o in outs]
        per_k = engine.metrics()["decode_steps_per_k"]  # [k=0 .. 4]
        if spec_cost < 0:
            assert {key.k for key in engine.runner.steps} == {4}
            assert per_k[4] == sum(per_k) > 0
        else:  # three rows reach 8 first-position verifies in three steps; every later step is plain
            assert {key.k for key in engine.runner.steps} == {0, 4}
            assert all(sum(d) <= 3 and not any(d[3:]) for d in drafted)
            assert per_k[4] == 3 and per_k[0] == sum(per_k) - 3 > 0
    pinned = Engine(target, make_drafter(target), num_speculative_tokens=2)
    pinned.runner.step_ms = lambda key: 1.0 + 40.0 * key.k
    pinned.generate(prompts[:1], SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    assert {key.k for key in pinned.runner.steps} == {2}


def test_k_policy_probes_less_often_while_probes_confirm_plain_decoding(targets):
    """Where drafting does not pay, the policy still drafts once after PROBE_EVERY plain steps to refresh its
    statistics; each probe that leaves the choice at plain decoding doubles that interval (up to PROBE_MAX), and a
    probe after which drafting pays brings it back to PROBE_EVERY."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target))
    engine.runner.step_ms = lambda key: 0.2 + 0.3 * key.k
    p, k = engine.policy, engine.k
    drafted = []
    for step in range(4000):
        if p.choose(1, 100, "sample") > 0:
            p.record(k, 0, "sampled")  # every draft rejected
            drafted.append(step)
    assert drafted[:8] == list(range(8))  # the first statistics
    gaps = [b - a for a, b in zip(drafted[7:], drafted[8:])]
    want = [min(PROBE_EVERY << i, PROBE_MAX) + 1 for i in range(len(gaps))]
    assert gaps == want and len(gaps) >= 5 and p.probe_every["sampled"] == PROBE_MAX
    assert p.probe_every["greedy"] == PROBE_EVERY  # the groups keep their own
    # statistics under which drafting pays: at its next choice the policy drafts, and the interval is back to short
    p.accepted["sampled"], p.reached["sampled"] = [1000] * k, [1000] * k
    engine.runner.step_ms = lambda key: 0.2 + 0.01 * key.k
    picks = [p.choose(1, 100, "sample") for _ in range(40)]
    assert p.probe_every["sampled"] == PROBE_EVERY and all(x > 0 for x in picks[-20:])


def test_sampled_requests_keep_no_drafter_context_while_plain_decoding_is_their_choice(targets, prompts):
    """Once probes keep plain decoding the sampled rows' choice (their interval has grown past PROBE_EVERY), a
    sampled request admitted keeps no drafter context, except one in CONTEXT_EVERY per request running:
    it never drafts, and a plain step none of whose rows keeps it is the AR engine's step (key.context False: no
    stash). Greedy requests, and every request under a pinned k, keep it; so do sampled ones once drafting is their
    choice again. A seeded sampled request under the policy keeps none either: its text is the AR engine's for its
    seed."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target), max_batch_size=16)
    p = engine.policy
    assert p.context_for(sampled=True) and p.context_for(sampled=False)
    p.probe_every["sampled"] = 2 * PROBE_EVERY  # probes have found plain decoding best for sampled rows
    assert [p.context_for(sampled=True) for _ in range(2 * CONTEXT_EVERY)] == ([False] * (CONTEXT_EVERY - 1)
                                                                             + [True]) * 2
    # with 4 requests running, one in 4 x CONTEXT_EVERY: about one step in CONTEXT_EVERY carries such a row
    assert [p.context_for(sampled=True, running=4) for _ in range(8 * CONTEXT_EVERY)] == (
        [False] * (4 * CONTEXT_EVERY - 1) + [True]) * 2
    assert p.context_for(sampled=False) and p.probe_every["greedy"] == PROBE_EVERY
    pinned = Engine(target, make_drafter(target), num_speculative_tokens=2).policy
    pinned.probe_every["sampled"] = 2 * PROBE_EVERY
    assert pinned.context_for(sampled=True)

    sampled = SamplingParams(max_tokens=N_NEW, temperature=0.9, ignore_eos=True)
    greedy = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    reqs = [engine.add_request(prompts[i % 3], sampled) for i in range(CONTEXT_EVERY)]
    reqs.append(engine.add_request(prompts[0], greedy))
    # admitted in one step, the i-th with i + 1 running: the first is the one in CONTEXT_EVERY x 1 running, the other
    # sampled ones count 1 .. CONTEXT_EVERY - 1 again, fewer than CONTEXT_EVERY x their running
    p.sampled_without = CONTEXT_EVERY - 1
    while engine.has_work():
        engine.step()
    assert [r.context for r in reqs] == [True] + [False] * (CONTEXT_EVERY - 1) + [True]
    assert all(not any(r.num_drafts_per_step) for r in reqs[1:-1])  # on the CPU the others draft
    assert all(any(r.num_drafts_per_step) for r in (reqs[0], reqs[-1]))
    # steps whose rows all keep no context (the interval set again: a choice to draft, as the CPU's, resets it):
    # plain, the AR step's key, no context flush
    engine.runner.steps.clear()
    p.probe_every["sampled"], p.sampled_without = 2 * PROBE_EVERY, 0
    flushes = engine.counters["context_flushes"]
    engine.generate(prompts, sampled)
    assert {(key.k, key.context) for key in engine.runner.steps} == {(0, False)}
    assert engine.counters["context_flushes"] == flushes
    seeded = SamplingParams(max_tokens=N_NEW, temperature=0.9, top_k=20, seed=3)
    fresh = Engine(target, make_drafter(target))
    assert ([o.token_ids for o in fresh.generate(prompts, seeded)]
            == [o.token_ids for o in Engine(target).generate(prompts, seeded)])
    assert {(key.k, key.context) for key in fresh.runner.steps} == {(0, False)}
    assert fresh.runner.key_for(2, 3, 40, "sample", False).context  # a drafting step always writes it


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


def test_k_policy_keeps_a_choice_on_a_modelled_cost_only_until_it_is_measured(targets):
    """A choice is reused for REPICK_EVERY steps of the same batch, context bucket and mode once its kind's cost is
    measured; one made on a modelled cost (a capture's replay, another bucket's host work) only for the
    MIN_CYCLES + 1 steps that measure it, so a kind that runs dearer than modelled is not kept for long."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target), overlap=True)
    p = engine.policy
    p.accepted["sampled"], p.reached["sampled"] = [50] * engine.k, [100] * engine.k  # past the first statistics
    calls = []
    p.pick = lambda *a: calls.append(len(calls)) or 2  # the choice from its estimates

    def picks(n: int) -> int:  # choices made over n steps
        before = len(calls)
        assert all(p.choose(1, 100, "sample") == 2 for _ in range(n))
        return len(calls) - before

    assert picks(4 * (MIN_CYCLES + 1)) == 4  # modelled: chosen anew every MIN_CYCLES + 1 steps
    assert p.view()["step_cost_ms"] == []
    assert p.choices_made == {(1, 2, "sample", "modelled"): 4}  # counted by the basis of the chosen kind's cost
    p.cycle_by_kind[1, 2, "sample"] = deque([0.5] * MIN_CYCLES)
    p.cycle_by_kind[1, 4, "sample"] = deque([0.9] * (MIN_CYCLES - 1))  # too few cycles to be a measured cost
    p.memo.clear()
    assert picks(4 * REPICK_EVERY) == 4  # measured: every REPICK_EVERY steps
    assert p.view()["step_cost_ms"] == [{"rows": 1, "k": 2, "mode": "sample", "ms": 0.5}]
    assert p.choices_made == {(1, 2, "sample", "modelled"): 4, (1, 2, "sample", "measured"): 4}
    assert {"rows": 1, "k": 2, "mode": "sample", "basis": "measured", "n": 4} in p.view()["choices"]


def test_k_policy_counts_one_token_for_each_row_that_keeps_no_drafter_context(targets, prompts):
    """A drafting step's expected tokens count only the rows that keep the drafter's context: at acceptance 0.9 a
    step of 4 rows drafting the block pays for a step that costs 1.8x a plain one, with 1 of the 4 drafting it does
    not, and the policy decodes plainly. Whether drafting pays for the group is still judged as if every row drafted:
    that choice brings the probes' interval back to PROBE_EVERY, so new sampled requests keep the context again. The
    engine passes the rows that keep it."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target))
    p, k = engine.policy, engine.k
    engine.runner.step_ms = lambda key: 1.0 + (0.8 if key.k else 0.0) + 0.01 * key.k
    acc = [round(100 * 0.9 ** (j + 1)) for j in range(k)]
    reach = [100] + acc[:-1]
    assert p.best(4, 100, "sample", acc, reach) == k and p.best(4, 100, "sample", acc, reach, 4) == k
    assert p.best(4, 100, "sample", acc, reach, 1) == 0
    every, one = p.estimates(4, 100, "sample", acc, reach), p.estimates(4, 100, "sample", acc, reach, 1)
    assert one[0]["expected"] == every[0]["expected"] == 1.0
    assert abs((one[k]["expected"] - 1) - (every[k]["expected"] - 1) / 4) < 1e-9 and one[k]["expected"] > 1
    p.accepted["sampled"], p.reached["sampled"] = acc, reach
    p.probe_every["sampled"], p.probed["sampled"] = 2 * PROBE_EVERY, True
    assert not p.context_for(sampled=True)
    assert p.choose(4, 100, "sample", drafting=1) == 0
    assert p.probe_every["sampled"] == PROBE_EVERY and p.context_for(sampled=True)
    engine.runner.step_ms = lambda key: 1.0 + 3.0 * bool(key.k)  # drafting loses even with every row drafting
    p.memo.clear()
    p.probe_every["sampled"], p.probed["sampled"] = 2 * PROBE_EVERY, True
    assert p.choose(4, 100, "sample", drafting=1) == 0 and p.probe_every["sampled"] == 4 * PROBE_EVERY

    seen = []
    p.choose = lambda *a: seen.append(a) or 0
    reqs = [engine.add_request(prompts[i % 3], SamplingParams(max_tokens=8, temperature=0.7)) for i in range(4)]
    for r, keeps in zip(reqs, (True, False, True, False)):
        r.context = keeps
    assert engine._choose_k(reqs) == 0 and seen[-1][2:] == ("sample", 2)
    for r in reqs:
        r.context = False
    assert engine._choose_k(reqs) == 0 and len(seen) == 1  # no row keeps it: plain, no choice made


def test_k_policy_drafts_only_for_a_clear_gain(targets):
    """Drafting is chosen over plain decoding only when it expects DRAFT_GAIN times plain decoding's tokens per ms:
    at acceptance 0.5 on the first position (1.5 tokens per step of one draft), a one-draft step costing 1.4x a
    plain one (gain 1.07) stays plain, one costing 1.25x (gain 1.2) drafts."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target))
    acc, reach = [50, 0, 0, 0], [100, 50, 25, 12]
    for cost, want in ((0.4, 0), (0.25, 1)):
        engine.runner.step_ms = lambda key, c=cost: 1.0 + c * min(key.k, 1) + 10.0 * max(key.k - 1, 0)
        assert engine.policy.best(1, 100, "greedy", acc, reach) == want
        est = engine.policy.estimates(1, 100, "greedy", acc, reach)  # what the choice weighed: modelled costs
        assert abs(est[1]["expected"] - 1.5) < 1e-9 and not any(e["measured"] for e in est.values())
        assert abs(est[1]["rate"] / est[0]["rate"] - 1.5 / (1 + cost) / DRAFT_GAIN) < 0.02
    assert 1.5 / 1.4 < DRAFT_GAIN < 1.5 / 1.25


def test_k_policy_counts_what_its_choices_to_draft_weighed(targets):
    """Each new choice to draft adds what it weighed (plain decoding's cost, the chosen k's, k's expected tokens) to
    its k's sums in the view (/metrics shows them); a reused choice, a plain one and a probe add nothing."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target))
    p = engine.policy
    p.accepted["greedy"], p.reached["greedy"] = [90, 80, 70, 60], [100, 90, 80, 70]
    engine.runner.step_ms = lambda key: 1.0 + 0.1 * key.k  # drafting cheap: a k > 0 pays
    k = p.choose(1, 100, "greedy")
    est = p.estimates(1, 100, "greedy")
    assert k > 0 and p.choose(1, 100, "greedy") == k  # the second call reuses the choice
    want = {"k": k, "n": 1, "plain_ms": est[0]["cost_ms"], "ms": est[k]["cost_ms"], "expected": est[k]["expected"]}
    assert p.view()["weighed"] == [pytest.approx(want)]
    engine.runner.step_ms = lambda key: 1.0 + 10.0 * key.k  # drafting dear: plain at another batch size
    assert p.choose(2, 100, "greedy") == 0
    p.plain_steps["greedy"] = p.probe_every["greedy"]  # a probe is due
    assert p.choose(4, 100, "greedy") == p.k
    assert p.view()["weighed"] == [pytest.approx(want)]


def test_k_policy_measures_plain_decoding_before_weighing_drafting_against_it(targets, monkeypatch):
    """After its first drafting steps the policy has measured only drafting; modelled with their host work (0.42 ms
    a step, more than a plain step's 0.2) plain steps would look dearer than 2 drafts at an acceptance of 0.35, and
    it would draft for good (a choice never made is never measured). So it decodes plainly until plain steps have
    run back to back, and with their measured cost it stays plain."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target), overlap=True)
    p, key = engine.policy, engine.runner.key_for
    replay = {0: 0.23, 1: 0.48, 2: 0.5, 4: 0.55}
    engine.runner.step_ms = lambda key: replay[key.k]
    acc, reach = [35, 12, 4, 1], [100, 35, 12, 4]
    now, waited = [0.0], [0.0]
    monkeypatch.setattr("dspark.policy.time.perf_counter", lambda: now[0])

    def steps(k: int, n: int, cycle: float, host: float) -> None:  # back-to-back steps of k drafts
        for _ in range(n):
            p.step_started(waited[0])
            p.step_replayed(replay[k], key(1, k, 100, "sample"))
            now[0] += cycle / 1e3
            waited[0] += cycle - host

    steps(4, 8, 0.58, 0.42)
    p.step_started(waited[0])
    est = p.estimates(1, 100, "sample", acc, reach)
    assert not est[0]["measured"] and est[2]["rate"] > est[0]["rate"]  # the model alone would draft
    assert p.best(1, 100, "sample", acc, reach) == 0
    steps(0, 16, 0.25, 0.2)
    p.step_started(waited[0])
    assert p.estimates(1, 100, "sample", acc, reach)[0]["measured"] and p.best(1, 100, "sample", acc, reach) == 0
    assert len(p.cycle_by_kind[1, 0, "sample"]) == 15  # the first plain step, read behind a drafting one, left out


def sampled_policy_run(targets, monkeypatch, acceptance: tuple[list[int], list[int]], first_plain_ms: float,
                       steps: int):
    """A policy under overlap at one sampled row (replay 0.13 ms plain, 0.22-0.26 drafting; acceptance: (accepted,
    reached) per position): 8 plain steps whose cycles measure first_plain_ms, then `steps` choices, each step's cycle
    what it takes (0.14 ms plain, 0.27 drafting) -> (policy, key_for, the choices)."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target), overlap=True)
    p, key = engine.policy, engine.runner.key_for
    replay = {0: 0.13, 1: 0.22, 2: 0.24, 4: 0.26}
    engine.runner.step_ms = lambda key: replay[key.k]
    p.accepted["sampled"], p.reached["sampled"] = acceptance
    now = [0.0]
    monkeypatch.setattr("dspark.policy.time.perf_counter", lambda: now[0])

    def step(k: int, cycle_ms: float) -> None:
        p.step_started(0.0)
        p.step_replayed(replay[k], key(1, k, 100, "sample"))
        now[0] += cycle_ms / 1e3

    for _ in range(8):
        step(0, first_plain_ms)
    picks = []
    for _ in range(steps):
        k = p.choose(1, 100, "sample")
        picks.append(k)
        step(k, 0.27 if k else 0.14)
    return p, key, picks


LOW_ACCEPTANCE = ([40, 16, 6, 2], [100, 40, 16, 6])  # 0.4 per position: 4 drafts give 1.65 tokens a step


def test_k_policy_forgets_a_stale_plain_cost_and_measures_it_again(targets, monkeypatch):
    """Plain steps measured at 0.29 ms (a transient: twice what they take) make 4 drafts at an acceptance of 0.4
    look better (1.65 tokens per 0.27 ms against 1.1 x 1 per 0.29), and the policy drafts; with no plain step run,
    that cost would stand for good. After STALE_STEPS steps without a plain one it forgets it, decodes plainly for
    the few steps that measure it again (0.14 ms), and stays plain, where drafting loses (probes aside)."""
    p, key, picks = sampled_policy_run(targets, monkeypatch, LOW_ACCEPTANCE, 0.29, STALE_STEPS + 200)
    assert all(k == 4 for k in picks[:STALE_STEPS - 64])  # drafting on the stale plain cost
    assert sum(k > 0 for k in picks[-100:]) <= 1  # measured again: plain (but for a probe, PROBE_EVERY apart)
    assert p.step_cost(key(1, 0, 100, "sample"), 0.13) == pytest.approx(0.14)
    assert (1, 4, "sample") in p.cycle_by_kind  # drafting's cycles are still recent


def test_k_policy_measures_an_old_plain_cost_again_where_drafting_leads_narrowly(targets, monkeypatch):
    """Plain steps measured at 0.2 ms by a transient (0.14 in truth) make 4 drafts at an acceptance of 0.4 (1.65
    tokens per 0.27 ms) look 1.1 times better than plain decoding: a margin under CLEAR_GAIN, which turns on that one
    estimate. Once it is REFRESH_STEPS steps old the policy forgets it, measures plain steps again and stays plain,
    long before STALE_STEPS. Where drafting leads clearly (an acceptance of 0.9) the old plain cost stands."""
    p, key, picks = sampled_policy_run(targets, monkeypatch, LOW_ACCEPTANCE, 0.2, REFRESH_STEPS + 200)
    assert all(k > 0 for k in picks[:REFRESH_STEPS - 64])  # drafting on the old plain cost
    assert sum(k > 0 for k in picks[-100:]) <= 1  # measured again: plain (but for a probe)
    assert p.step_cost(key(1, 0, 100, "sample"), 0.13) == pytest.approx(0.14)
    high = ([90, 81, 73, 66], [100, 90, 81, 73])
    p, key, picks = sampled_policy_run(targets, monkeypatch, high, 0.2, REFRESH_STEPS + 200)
    assert all(k > 0 for k in picks)
    assert p.step_cost(key(1, 0, 100, "sample"), 0.13) == pytest.approx(0.2)


def test_k_policy_acceptance_follows_recent_traffic(targets):
    """The acceptance estimate is windowed (counts halved every ACCEPT_WINDOW row-steps): after 4000 row-steps that
    accept every draft, 600 that reject them all bring the first position's estimate below 0.3 (over the server's
    lifetime it would still read 0.87), and the policy turns to plain decoding where drafting then costs more."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target))
    p, k = engine.policy, engine.k
    for _ in range(4000):
        p.record(k, k, "sampled")
    p.runner.step_ms = lambda key: 1.0 + 0.5 * key.k
    assert p.best(1, 100, "sample", p.accepted["sampled"], p.reached["sampled"]) > 0
    for _ in range(600):
        p.record(k, 0, "sampled")
    acc, reach = p.accepted["sampled"], p.reached["sampled"]
    assert reach[0] < ACCEPT_WINDOW and acc[0] / reach[0] < 0.3
    assert p.best(1, 100, "sample", acc, reach) == 0
    assert p.reached["greedy"][0] == 0  # the groups keep their own


def test_k_policy_counts_the_host_time_of_a_step(targets, monkeypatch):
    """The host's own work per step (learnt between back-to-back graph steps: the time from one step's start to the
    next less the host's waits for the device in between) is part of every candidate's cost, per kind of step
    (batch bucket, k, mode). Read at once (no overlap) a step costs its replay plus that work: at acceptance 0.5 per
    position, drafting 4 loses when a step is its replay alone and wins when each step also costs 10 ms of host
    work. Pauses longer than a step's work (an idle server) are not learnt. The timed steps' whole time and replay
    are counted per k (what /metrics reports)."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target), overlap=False)  # a GPU defaults to async scheduling
    engine.runner.step_ms = lambda key: 0.2 + 0.3 * key.k
    acc, reach = [50, 25, 12, 6], [100, 50, 25, 12]
    assert not engine.policy.overlap and engine.policy.best(1, 100, "greedy", acc, reach) == 0
    clock = iter([10.0, 10.0152, 10.6, 20.0])  # starts of four decode steps (s)
    monkeypatch.setattr("dspark.policy.time.perf_counter", lambda: next(clock))
    p, key = engine.policy, engine.runner.key_for
    p.step_started(0.0)
    p.step_replayed(0.2, key(1, 4, 100, "greedy"))  # the first step drafted 4 and replayed a 0.2 ms graph
    p.step_started(5.0)  # 15.2 ms later, 5 ms of it waiting for the device: 10.2 ms of host work
    assert p.host_ms == pytest.approx(10.2) and list(p.cycle_by_kind[1, 4, "greedy"]) == [pytest.approx(15.2)]
    p.step_replayed(0.2, key(1, 0, 100, "greedy"))
    p.step_started(5.0)  # 584.8 ms later: a pause, not a step's cost
    assert p.host_ms == pytest.approx(10.2)
    p.step_replayed(None, key(1, 0, 100, "greedy"))  # an eager step: nothing to learn from
    p.step_started(5.0)
    assert p.host_ms == pytest.approx(10.2) and len(p.cycle_by_kind) == 1
    # the per-k counters of the steps timed: only the first (15.2 ms from its start to the next, 0.2 ms replay)
    assert p.cycles == [0, 0, 0, 0, 1] and p.cycle_ms[4] == pytest.approx(15.2) and p.replay_ms[4] == 0.2
    m = engine.metrics()
    assert (m["step_cycles_per_k"], m["step_replay_ms_per_k"][4]) == ([0, 0, 0, 0, 1], 0.2)
    # no plain step has run back to back yet: it decodes plainly until one has; with plain measured at its replay
    # plus the same 10.2 ms of host work, drafting wins
    assert engine.policy.best(1, 100, "greedy", acc, reach) == 0
    p.cycle_by_kind[1, 0, "greedy"] = deque([10.4] * 3)
    assert engine.policy.best(1, 100, "greedy", acc, reach) == 4


def test_k_policy_prices_plain_decoding_from_ar_steps_too(targets, monkeypatch):
    """A plain step none of whose rows keeps the drafter's context (the AR step, no stash) counts for the plain kind
    as a stashing one does: priced from a rare stashing step alone (a slow one here), plain decoding reads dear and
    drafting at a low acceptance would win; with the AR steps' cycles in its median it does not."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target), overlap=False)
    starts = [10.0]
    for ms in (0.6, 0.15, 0.15, 0.15, 0.15):  # a stashing plain step of 0.6 ms, then four AR steps of 0.15 ms
        starts.append(starts[-1] + ms / 1e3)
    clock = iter(starts)
    monkeypatch.setattr("dspark.policy.time.perf_counter", lambda: next(clock))
    p, key = engine.policy, engine.runner.key_for
    engine.runner.step_ms = lambda key: 0.1 + 0.02 * key.k
    p.cycle_by_kind[1, 4, "sample"] = deque([0.3] * 3)  # drafting 4: 0.3 ms a step
    acc, reach = [50, 20, 8, 3], [100, 50, 20, 8]  # 1.82 tokens per step at k = 4: 6.1 per ms
    p.step_started(0.0)
    p.step_replayed(0.1, key(1, 0, 100, "sample"))  # stashes
    p.step_started(0.0)
    assert list(p.cycle_by_kind[1, 0, "sample"]) == [pytest.approx(0.6)]
    p.cycle_by_kind[1, 0, "sample"].extend([0.6, 0.6])  # three stashing cycles: plain at 1.8 per ms loses
    assert p.best(1, 100, "sample", acc, reach) == 4
    for _ in range(4):
        p.step_replayed(0.1, key(1, 0, 100, "sample", context=False))  # AR's step
        p.step_started(0.0)
    assert sorted(p.cycle_by_kind[1, 0, "sample"]) == pytest.approx([0.15] * 4 + [0.6] * 3) and p.cycles[0] == 5
    assert p.best(1, 100, "sample", acc, reach) == 0  # 1 / 0.15 x DRAFT_GAIN = 7.3 per ms


def test_k_policy_weighs_each_kinds_measured_time_with_async_scheduling(targets):
    """With async scheduling host work and device time overlap, so a kind of step takes the larger of the two. Where
    launching a drafting step's bigger graph keeps the host busier than the device (the host-bound sampled steps of a
    server), the policy decodes plainly even at an acceptance under which the replay times alone favour drafting;
    where the host's work hides under the replays, it drafts. After plain steps, drafting also pays their context
    flush, spread over the steps a choice lasts."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target), overlap=True)
    p, key = engine.policy, engine.runner.key_for
    assert p.overlap
    engine.runner.step_ms = lambda key: 1.0 + 0.1 * key.k
    acc, reach = [80, 64, 51, 41], [100, 80, 64, 51]  # 0.8 per position: 3.4 tokens per step at k = 4
    p.last_k = 4
    for host4, want in ((3.5, 0), (1.2, 4)):  # host ms per drafting step (the drafter's graph); plain: 0.5 ms
        # each kind measured at the larger of its replay and its host work, as overlapping steps take
        p.cycle_by_kind = {(1, k, "greedy"): deque([max(1.0 + 0.1 * k, host4 if k else 0.5)] * 3)
                           for k in p.choices}
        assert p.best(1, 100, "greedy", acc, reach) == want
    # cost = max(replay 1.4, host 1.2) = 1.4 ms at k = 4: a 40 ms flush after plain steps spread over 16 steps
    # (2.5 ms each) makes drafting lose; without plain steps before it, it is not paid
    p.flushed(40.0)
    p.last_k = 0
    assert p.best(1, 100, "greedy", acc, reach) == 0
    p.last_k = 4
    assert p.best(1, 100, "greedy", acc, reach) == 4
    assert p.step_cost(key(1, 4, 100, "greedy"), 1.4) == 1.4 and p.step_cost(key(1, 2, 100, "greedy"), 1.2) == 1.2


def test_k_policy_host_work_is_a_median_a_first_outlier_does_not_stick(targets, monkeypatch):
    """A kind of step's cost is the median of its last cycles: a drafting step that paid one-off costs (40 ms) stops
    counting after two ordinary ones, where a moving average would keep drafting looking host-bound for as many
    probes as it takes to decay; a kind with fewer than three cycles is modelled with the host's median work over all
    steps. Under overlap the first step after a break, or after a step of another kind, counts for no kind: its cycle
    holds the read of the step before it."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target), overlap=True)
    p, key = engine.policy, engine.runner.key_for
    now = [0.0]
    monkeypatch.setattr("dspark.policy.time.perf_counter", lambda: now[0])

    def steps(k: int, works_ms: list[float]) -> None:  # back-to-back steps of k drafts, each this much host work
        for w in works_ms:
            p.step_started(0.0)
            p.step_replayed(0.2, key(1, k, 100, "greedy"))
            now[0] += w / 1e3
        p.step_started(0.0)
        p.step_chain_broken()

    steps(0, [0.5] * 9)
    steps(4, [40.0])
    assert list(p.measured_cycles(key(1, 0, 100, "greedy"))) == pytest.approx([0.5] * 8)  # the first left out
    assert p.step_cost(key(1, 4, 100, "greedy"), 0.2) == pytest.approx(0.5)  # no cycle: the model, host_ms 0.5
    steps(4, [0.6, 40.0, 0.6, 0.7])
    assert p.step_cost(key(1, 4, 100, "greedy"), 0.2) == pytest.approx(0.7)  # median of 40, 0.6, 0.7
    assert p.step_cost(key(1, 0, 100, "greedy"), 0.2) == pytest.approx(0.5) and p.host_ms == pytest.approx(0.5)
    engine.runner.step_ms = lambda key: 0.25 + 0.1 * key.k
    # acceptance 0.6 a position: drafting pays again (k = 2: 1.96 tokens per 0.5 ms; k = 4: 2.3 per 0.7 ms; plain 1
    # per 0.5 ms), where the 40 ms sample alone would have kept it plain
    assert p.best(1, 100, "greedy", [60, 36, 21, 13], [100, 60, 36, 21]) == 2


def test_k_policy_costs_a_kind_by_its_measured_cycles(targets, monkeypatch):
    """Once a kind of step has run back to back three times, its cost is the median of those start-to-start times,
    not the model (the larger of replay and host work under async scheduling): drafting steps whose host work and
    device time fail to overlap (4 ms a step where the model says 1.4) lose to plain steps, which they beat on the
    model alone."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target), overlap=True)
    p, key = engine.policy, engine.runner.key_for
    engine.runner.step_ms = lambda key: 1.0 + 0.1 * key.k  # replay: plain 1.0 ms, k = 4 1.4 ms
    acc, reach = [80, 64, 51, 41], [100, 80, 64, 51]  # 0.8 per position: 3.4 tokens per step at k = 4
    now, waited = [0.0], [0.0]
    monkeypatch.setattr("dspark.policy.time.perf_counter", lambda: now[0])
    for k in (1, 2, 4):  # drafting steps 4 ms apart, 3 ms of each waiting for the device: 1 ms of host work
        for _ in range(4):  # (the first of each k follows another kind: it counts for none)
            p.step_started(waited[0])
            p.step_replayed(1.0 + 0.1 * k, key(1, k, 100, "greedy"))
            now[0] += 4e-3
            waited[0] += 3.0
    p.step_started(waited[0])
    p.last_k = 4
    assert p.host_ms == pytest.approx(1.0)
    assert p.step_cost(key(1, 4, 100, "greedy"), 1.4) == pytest.approx(4.0)
    assert p.best(1, 100, "greedy", acc, reach) == 0  # at most 3.4 / 4.0 against 1.1 x 1 / 1.0 tokens per ms
    p.cycle_by_kind.clear()  # no plain step measured: plain decoding first, to measure it
    assert p.best(1, 100, "greedy", acc, reach) == 0
    p.cycle_by_kind[1, 0, "greedy"] = deque([1.0] * 3)  # plain measured; drafting on the model: max(1.4, 1.0) wins
    assert p.best(1, 100, "greedy", acc, reach) == 4


def test_k_policy_costs_an_untimed_bucket_by_its_ks_measured_excess(targets, monkeypatch):
    """A kind of step not yet timed at this batch bucket takes its replay plus the median excess (cycle less replay)
    of the measured kinds of its k and mode at other buckets, before the model (the larger of replay and host work):
    drafting steps whose host work a bucket of one row showed to be 0.4 ms above their replay cost that much at two
    rows too, and the policy stays plain there, where the model alone would draft. Another mode's excess is not
    borrowed."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target), overlap=True)
    p, key = engine.policy, engine.runner.key_for
    engine.runner.step_ms = lambda key: 0.5 + 0.05 * key.k * key.rows  # replay ms
    acc, reach = [60, 36, 21, 13], [100, 60, 36, 21]  # 0.6 per position
    now, waited = [0.0], [0.0]
    monkeypatch.setattr("dspark.policy.time.perf_counter", lambda: now[0])
    for k, cycle in ((0, 0.5), (1, 0.95), (2, 1.0), (4, 1.1)):  # one row, back to back: replay + 0.4 when drafting
        for _ in range(4):  # (the first of each k follows another kind: it counts for none)
            p.step_started(waited[0])
            p.step_replayed(0.5 + 0.05 * k, key(1, k, 100, "sample"))
            now[0] += cycle / 1e3
            waited[0] += cycle - 0.1  # 0.1 ms of host work a step
    p.step_started(waited[0])
    p.last_k = 4
    assert p.excess_ms(2, "sample") == pytest.approx(0.4) and p.excess_ms(2, "greedy") is None
    two = key(2, 2, 100, "sample")
    assert p.measured_cycles(two) is None and p.step_cost(two, 0.7) == pytest.approx(1.1)
    assert p.best(2, 100, "sample", acc, reach) == 0  # k = 2: 1.96 tokens per 1.1 ms against 1.1 x 1 / 0.5
    est = p.estimates(2, 100, "greedy", acc, reach)  # greedy kinds: none measured, the model
    assert est[2]["cost_ms"] == pytest.approx(0.7) and p.best(2, 100, "greedy", acc, reach) == 0  # plain first
    p.cycle_by_kind[1, 0, "greedy"] = deque([0.5] * 3)  # greedy plain measured at one row: the model drafts
    assert p.best(2, 100, "greedy", acc, reach) > 0


def test_k_policy_charges_a_switch_to_drafting_not_to_the_plain_step_before_it(targets, monkeypatch):
    """Under async scheduling a drafting step that is not queued behind the plain step in flight (it read that step
    first) leaves the gap unsampled: it is the switch's cost, not a plain step's. Were it sampled, a plain kind
    sampled mostly next to switches would look dearer than drafting at an acceptance where drafting loses, and the
    policy would keep drafting. Without overlap every gap counts."""
    target = targets["qwen3"]
    acc, reach = [40, 16, 6, 2], [100, 40, 16, 6]  # 0.4 per position: 1.6 tokens per step at k = 4
    for overlap in (True, False):
        engine = Engine(target, make_drafter(target), overlap=overlap)
        p, key = engine.policy, engine.runner.key_for
        engine.runner.step_ms = lambda key: 0.3 + 0.15 * key.k  # replay: plain 0.3 ms, k = 4 0.9 ms
        now, waited = [0.0], [0.0]
        monkeypatch.setattr("dspark.policy.time.perf_counter", lambda now=now: now[0])
        for _ in range(4):  # a plain step queued behind a drafting one, then a switch 3 ms later
            p.step_started(waited[0])
            p.step_replayed(0.3, key(1, 0, 100, "sampled"))
            now[0] += 3e-3
            p.step_started(waited[0], chained=False)
            p.step_replayed(0.9, key(1, 4, 100, "sampled"))
            now[0] += 0.9e-3  # 0.2 ms of host work, 0.7 waiting for the device
            waited[0] += 0.7
        plain = p.measured_cycles(key(1, 0, 100, "sampled"))
        if overlap:
            assert plain is None  # never sampled: its cost is modelled, max(replay 0.3, host work)
            assert p.best(1, 100, "sampled", acc, reach) == 0
        else:
            assert statistics.median(plain) == pytest.approx(3.0)
            assert p.best(1, 100, "sampled", acc, reach) == 4  # 1.6 / 0.9 against 1.1 / 3.0 tokens per ms


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
