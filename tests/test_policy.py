"""The k policy (dspark/policy.py): how many drafts each decode step verifies, from measured acceptance and step
costs; which sampled requests keep the drafter's context. On CPU the step times are set by the tests (no graphs)."""
import os
import statistics
import subprocess
import sys
from collections import deque

import pytest
import torch

from dspark.engine import Engine
from dspark.policy import (
    ACCEPT_WINDOW,
    CONTEXT_EVERY,
    DRAFT_GAIN,
    EARLY_STEPS,
    MIN_CYCLES,
    PROBE_EVERY,
    PROBE_MAX,
    REFRESH_STEPS,
    REPICK_EVERY,
    STALE_STEPS,
    counts_above,
    overrides,
)
from dspark.request import SamplingParams
from tests.targets import make_target
from tests.test_engine import make_drafter, reference_greedy

V = 300
N_NEW = 20


@pytest.fixture(scope="module")
def targets():
    return {"qwen3": make_target("qwen3", vocab=V)}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in (3, 11, 19)]


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
            p.record([k], [0], "sampled")  # every draft rejected
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
    assert p.view()["step_cost_ms"] == [(1, 2, "sample", 0.5)]
    assert p.choices_made == {(1, 2, "sample", "modelled"): 4, (1, 2, "sample", "measured"): 4}
    assert (1, 2, "sample", "measured", 4) in p.view()["choices"]


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
    want = {"k": k, "n": 1, "plain_ms": est[0]["cost_ms"], "ms": est[k]["cost_ms"], "expected": est[k]["expected"],
            "plain_cycles": 1, "plain_min_ms": est[0]["cost_ms"], "plain_age": 0}  # a modelled plain cost: one value
    assert p.view()["weighed"] == [pytest.approx(want)]
    engine.runner.step_ms = lambda key: 1.0 + 10.0 * key.k  # drafting dear: plain at another batch size
    assert p.choose(2, 100, "greedy") == 0
    p.plain_steps["greedy"] = p.probe_every["greedy"]  # a probe is due
    assert p.choose(4, 100, "greedy") == p.k
    assert p.view()["weighed"] == [pytest.approx(want)]


def test_k_policy_counts_the_basis_of_the_plain_cost_its_choices_to_draft_weighed(targets, monkeypatch):
    """Beside the plain cost a choice to draft weighed, its basis: how many cycles its kind had then, the least of
    them and how many decode steps ago the last one ran; /metrics shows their sums, serve_bench their means."""
    p, key, picks = sampled_policy_run(targets, monkeypatch, LOW_ACCEPTANCE, 0.2, 1)  # 8 plain steps of 0.2 ms
    # its first choice drafts on that cost: 6 cycles (the first plain step followed none, the last is in flight), the
    # last of them taken at the start of the step before
    w = p.weighed[picks[0]]
    assert picks[0] > 0 and list(p.weighed) == [picks[0]]
    assert {x: w[x] for x in ("n", "plain_ms", "plain_cycles", "plain_min_ms", "plain_age")} == pytest.approx(
        {"n": 1, "plain_ms": 0.2, "plain_cycles": 6, "plain_min_ms": 0.2, "plain_age": 1})
    p, key, picks = sampled_policy_run(targets, monkeypatch, LOW_ACCEPTANCE, 0.2, 40)
    w = {what: sum(x[what] for x in p.weighed.values()) for what in p.weighed[picks[0]]}
    assert w["n"] > 1 and w["plain_cycles"] == 6 + 7 * (w["n"] - 1)  # then the 8th too; no plain step since
    assert w["plain_min_ms"] == pytest.approx(0.2 * w["n"]) and w["plain_age"] > 2 * REPICK_EVERY  # ageing


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


def test_k_policy_measures_an_old_plain_cost_again_where_drafting_turns_on_it(targets, monkeypatch):
    """Plain steps measured high by a transient (0.29 or 0.2 ms where they take 0.14) make 4 drafts at an acceptance
    of 0.4 (1.65 tokens per 0.27 ms) look better than plain decoding, and the policy drafts; no plain step then runs
    to correct that cost. The choice would lose to plain steps at their replay time (0.13 ms), so it turns on the
    measured plain cost: once that is REFRESH_STEPS steps old the policy forgets it, measures plain steps again and
    stays plain (but for the probes), long before STALE_STEPS."""
    for first_plain_ms in (0.29, 0.2):
        p, key, picks = sampled_policy_run(targets, monkeypatch, LOW_ACCEPTANCE, first_plain_ms, REFRESH_STEPS + 200)
        assert all(k > 0 for k in picks[:REFRESH_STEPS - 64])  # drafting on the old plain cost
        assert sum(k > 0 for k in picks[-100:]) <= 1  # measured again: plain (but for a probe)
        assert p.step_cost(key(1, 0, 100, "sample"), 0.13) == pytest.approx(0.14)
        assert (1, 4, "sample") in p.cycle_by_kind  # drafting's cycles are still recent


def test_k_policy_spends_no_plain_step_on_a_plain_cost_drafting_leads_anyway(targets, monkeypatch):
    """At an acceptance of 0.9, 4 drafts (4.1 tokens per 0.27 ms) beat plain steps even at their replay time: the
    old plain cost (0.2 ms, 0.14 in truth) is not measured again after REFRESH_STEPS; only after STALE_STEPS steps
    without a plain one is it forgotten, the few plain steps that measure it run, and drafting goes on."""
    high = ([90, 81, 73, 66], [100, 90, 81, 73])
    p, key, picks = sampled_policy_run(targets, monkeypatch, high, 0.2, STALE_STEPS + 200)
    plain = [i for i, k in enumerate(picks) if k == 0]
    assert plain and plain[0] >= STALE_STEPS - 64 and len(plain) <= 2 * MIN_CYCLES
    assert all(k > 0 for k in picks[-100:])
    assert p.step_cost(key(1, 0, 100, "sample"), 0.13) == pytest.approx(0.14)


def test_k_policy_acceptance_follows_recent_traffic(targets):
    """The acceptance estimate is windowed (counts halved every ACCEPT_WINDOW row-steps): after 4000 row-steps that
    accept every draft, 600 that reject them all bring the first position's estimate below 0.3 (over the server's
    lifetime it would still read 0.87), and the policy turns to plain decoding where drafting then costs more."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target))
    p, k = engine.policy, engine.k
    for _ in range(4000):
        p.record([k], [k], "sampled")
    p.runner.step_ms = lambda key: 1.0 + 0.5 * key.k
    assert p.best(1, 100, "sample", p.accepted["sampled"], p.reached["sampled"]) > 0
    for _ in range(600):
        p.record([k], [0], "sampled")
    acc, reach = p.accepted["sampled"], p.reached["sampled"]
    assert reach[0] < ACCEPT_WINDOW and acc[0] / reach[0] < 0.3
    assert p.best(1, 100, "sample", acc, reach) == 0
    assert p.reached["greedy"][0] == 0  # the groups keep their own


def test_a_steps_rows_record_what_they_record_one_at_a_time(targets):
    """record() takes a step's rows at once: per draft position, the rows that reached it (all drafts before it
    accepted, and it verified) and accepted it, as recording them one by one gives (below ACCEPT_WINDOW)."""
    assert counts_above([0, 2, 9, 1], 4) == [3, 2, 1, 1] and counts_above([], 2) == [0, 0]
    target = targets["qwen3"]
    batched, single = (Engine(target, make_drafter(target)).policy for _ in range(2))
    k = batched.k
    g = torch.Generator().manual_seed(4)
    for _ in range(20):
        ns = torch.randint(1, k + 1, (5,), generator=g).tolist()
        accs = [int(torch.randint(0, n + 1, (1,), generator=g)) for n in ns]
        batched.record(ns, accs, "greedy")
        for n, a in zip(ns, accs):
            single.record([n], [a], "greedy")
    assert batched.accepted == single.accepted and batched.reached == single.reached
    acc, reach = batched.accepted["greedy"], batched.reached["greedy"]
    assert reach[0] == 100 and all(x >= y for x, y in zip(reach, acc)) and acc[0] > 0


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
    p.cycle_by_kind[2, 0, "sample"] = deque([0.5] * 3)  # plain measured at two rows
    assert p.best(2, 100, "sample", acc, reach) == 0  # k = 2: 1.96 tokens per 1.1 ms against 1.1 x 1 / 0.5
    est = p.estimates(2, 100, "greedy", acc, reach)  # greedy kinds: none measured, the model
    assert est[2]["cost_ms"] == pytest.approx(0.7) and p.best(2, 100, "greedy", acc, reach) == 0  # plain first
    p.cycle_by_kind[2, 0, "greedy"] = deque([0.5] * 3)  # greedy plain measured at two rows: the model drafts
    assert p.best(2, 100, "greedy", acc, reach) > 0


def test_k_policy_measures_plain_decoding_at_each_batch_bucket(targets, monkeypatch):
    """After a level of 16 rows (plain steps 0.45 ms start to start, 0.25 above their replay) a level of one row
    would borrow that excess for its plain steps too (0.13 + 0.25 ms) and draft 4 at an acceptance of 0.4 (1.65
    tokens per 0.26 + 0.25 ms). So it decodes plainly at the new bucket until its plain steps are measured there
    (0.14 ms), and then stays plain (but for the probes)."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target), overlap=True)
    p, key = engine.policy, engine.runner.key_for
    replay = {(16, 0): 0.2, (16, 4): 0.35, (1, 0): 0.13, (1, 1): 0.22, (1, 2): 0.24, (1, 4): 0.26}
    engine.runner.step_ms = lambda key: replay.get((key.rows, key.k), 0.5)
    p.accepted["sampled"], p.reached["sampled"] = LOW_ACCEPTANCE
    now = [0.0]
    monkeypatch.setattr("dspark.policy.time.perf_counter", lambda: now[0])

    def step(rows: int, k: int, cycle_ms: float) -> None:
        p.step_started(0.0)
        p.step_replayed(replay[rows, k], key(rows, k, 100, "sample"))
        now[0] += cycle_ms / 1e3

    for k, cycle in ((0, 0.45), (4, 0.6)):
        for _ in range(8):
            step(16, k, cycle)
    p.step_started(0.0)
    p.last_step = None  # a prefill: the next step starts a new chain
    est = p.estimates(1, 100, "sample")
    assert not est[0]["measured"] and est[0]["cost_ms"] == pytest.approx(0.38)
    assert est[4]["rate"] > est[0]["rate"]  # borrowed from 16 rows, plain decoding would lose
    picks = []
    for _ in range(200):
        k = p.choose(1, 100, "sample")
        picks.append(k)
        step(1, k, 0.27 if k else 0.14)
    assert picks[:MIN_CYCLES + 1] == [0] * (MIN_CYCLES + 1) and sum(picks) > 0  # plain first; probes drafted
    assert not p.weighed and all(b == "probe" for _, k, _, b in p.choices_made if k)  # no choice to draft
    assert p.step_cost(key(1, 0, 100, "sample"), 0.13) == pytest.approx(0.14)


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


def test_k_policy_counts_a_switch_of_kind_apart_from_the_kinds_cycles(targets, monkeypatch):
    """Under overlap the first step of a run of its kind after another holds the read of the step before it: its
    cycle stays out of its kind's cycles (step_started) and counts, by its k, as a switch (what a change of k costs
    beyond the choice's figures, on /metrics); a step after a prefill (the chain broken) counts as neither."""
    target = targets["qwen3"]
    engine = Engine(target, make_drafter(target), overlap=True)
    p, key = engine.policy, engine.runner.key_for
    now = [0.0]
    monkeypatch.setattr("dspark.policy.time.perf_counter", lambda: now[0])

    def step(k: int, cycle_ms: float) -> None:
        p.step_started(0.0)
        p.step_replayed(0.1, key(1, k, 100, "sample"))
        now[0] += cycle_ms / 1e3

    for k, ms in [(0, 0.14), (0, 0.14), (0, 0.14), (4, 0.5), (4, 0.27), (4, 0.27), (0, 0.3), (0, 0.14)]:
        step(k, ms)
    p.step_chain_broken()  # a prefill: the next step's gap is not a cycle
    step(4, 0.9)
    step(4, 0.27)
    p.step_started(0.0)  # the last step's start times the one before it
    assert p.switches[4] == 1 and p.switch_ms[4] == pytest.approx(0.5)  # the 0.9 ms after the prefill is neither
    assert p.switches[0] == 1 and p.switch_ms[0] == pytest.approx(0.3)
    assert p.cycles[4] == 3 and p.cycle_ms[4] == pytest.approx(0.27 * 3)
    # plain: the second and third steps (the first follows none of its kind; the prefill cut the last one's cycle)
    assert p.cycles[0] == 2 and p.cycle_ms[0] == pytest.approx(0.14 * 2)
    m = engine.metrics()
    assert m["step_switches_per_k"][4] == 1 and m["step_switch_ms_per_k"][0] == pytest.approx(0.3)



def test_k_policy_counts_the_first_timed_steps_of_a_run_apart(targets, monkeypatch):
    """Of a kind's timed cycles, those of the first EARLY_STEPS timed steps of each run of it also count apart
    (early): whether a kind measured in short runs, as plain decoding is between drafting steps, reads dearer than in
    long ones. Under overlap a run's first step is a switch, not timed; without overlap it is the first timed."""
    target = targets["qwen3"]
    for overlap in (True, False):
        engine = Engine(target, make_drafter(target), overlap=overlap)
        p, key = engine.policy, engine.runner.key_for
        now = [0.0]
        monkeypatch.setattr("dspark.policy.time.perf_counter", lambda now=now: now[0])
        for k, ms in [(4, 0.3)] + [(0, 0.2)] * 5 + [(0, 0.1)] * 3:  # a drafting step, then a run of 8 plain ones
            p.step_started(0.0)
            p.step_replayed(0.1, key(1, k, 100, "sample"))
            now[0] += ms / 1e3
        p.step_started(0.0)
        timed = 7 if overlap else 8  # the plain steps timed; their first 4 took 0.2 ms each
        assert p.cycles[0] == timed and p.cycle_ms[0] == pytest.approx(0.2 * (timed - 3) + 0.3)
        assert EARLY_STEPS == 4 and p.early_cycles[0] == 4 and p.early_ms[0] == pytest.approx(0.8)
        assert p.early_cycles[4] == p.cycles[4] == (0 if overlap else 1)
        m = engine.metrics()
        assert m["step_early_cycles_per_k"][0] == 4 and m["step_early_cycle_ms_per_k"][0] == pytest.approx(0.8)

def test_policy_constants_are_replaced_from_dspark_policy_and_a_bad_name_is_named():
    """DSPARK_POLICY="NAME=VALUE,..." sets the module's constants at import (an A/B through the server); a name
    that is not one of them, or a value not of its type, is a ValueError naming it."""
    code = "import dspark.policy as p; print(p.DRAFT_GAIN, p.REPICK_EVERY)"
    env = {**os.environ, "DSPARK_POLICY": "DRAFT_GAIN=1.25, REPICK_EVERY=32"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1.25", "32"]
    assert overrides("") == {} and overrides("DRAFT_GAIN=1.2") == {"DRAFT_GAIN": 1.2}
    for spec, named in [("DRAFT_GAN=1", "'DRAFT_GAN'"), ("REPICK_EVERY=1.5", "REPICK_EVERY='1.5'"),
                        ("GROUPS=1", "'GROUPS'"), ("time=1", "'time'")]:
        with pytest.raises(ValueError, match=named):
            overrides(spec)
