"""The engine's overlap on CPU fp32: a decode step left in flight, the next one queued before it is read, its inputs
completed on the device (dspark.runner.chain_inputs). Against an engine that reads every step at once: the same
tokens, accepted counts and finish reasons (AR and speculative, greedy and seeded-sampled, rows ending on length, on
a stop token and by abort, requests joining mid-run, plain and drafting steps mixed), the target's greedy, a cache
left empty, and steps that really were overlapped."""
import asyncio
import time

import pytest
import torch

import dspark.policy
from dspark.device import host_copy
from dspark.engine import Engine
from dspark.request import SamplingParams
from dspark.runner import INT_COLS, NI, chain_inputs, pinned_rows
from serve.runner import EngineRunner
from tests.targets import make_target
from tests.test_drafter_k3 import make_k3_drafter
from tests.test_engine import make_drafter, reference_greedy
from tests.test_runner import live_markov

V = 300


@pytest.fixture(scope="module", params=["qwen3", "k3"])
def pair(request):
    target = make_target(request.param, vocab=V)
    drafter = make_drafter(target) if request.param == "qwen3" else make_k3_drafter(target)
    return target, live_markov(drafter)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in (4, 13, 7, 21, 9)]


def run(engine, prompts, params, arrive_at=(0, 0, 0, 3, 7), abort=None):
    """Requests added at the step numbers arrive_at; abort=(step, index) cancels one; -> outputs in prompt order."""
    reqs, step = [None] * len(prompts), 0
    while step <= max(arrive_at) or engine.has_work():
        for i, at in enumerate(arrive_at):
            if at == step:
                reqs[i] = engine.add_request(prompts[i], params[i], request_id=f"r{i}")
        if abort is not None and step == abort[0]:
            engine.abort(reqs[abort[1]].id)
        engine.step()
        step += 1
    assert engine.in_flight is None and engine.cache.pool.num_used == 0
    return [r.output() for r in reqs]


def same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]


def test_chain_inputs_continue_the_rows_of_the_step_in_flight():
    """Rows with a src take t_a of that row as their pending token, grow by a + 1, cap their drafts by the room
    left and keep that room; rows without one and padding rows keep the host's values."""
    prev = torch.tensor([[2, 3, 11, 12, 13, -1], [0, 3, 21, -1, -1, -1], [3, 3, 31, 32, 33, 34]])  # [a, n, t0..t3]
    ints = torch.zeros(4, NI + 2, dtype=torch.long)
    cols = ("pending", "num_cached", "num_new", "room", "src")
    host = [(5, 10, 4, 50, 2), (6, 20, 4, 3, 0), (7, 30, 2, 9, -1), (0, 0, 1, 1, -1)]  # the last: padding
    for b, row in enumerate(host):
        for c, v in zip(cols, row):
            ints[b, INT_COLS[c]] = v
    before = ints.clone()
    chain_inputs(ints, prev)
    got = [[int(ints[b, INT_COLS[c]]) for c in ("pending", "num_cached", "num_new")] for b in range(4)]
    # row 0 continues row 2 (a = 3): t_3, 10 + 4, room 50 - 4 leaves its 3 drafts; row 1 continues row 0 (a = 2):
    # t_2, 20 + 3, room 3 - 3 = 0 leaves no draft; row 2 has no src; row 3 is padding
    assert got == [[34, 14, 4], [13, 23, 1], [7, 30, 2], [0, 0, 1]]
    assert ints[:, INT_COLS["room"]].tolist() == [46, 0, 9, 1]
    seed = INT_COLS["seed"]
    assert torch.equal(ints[:, seed], before[:, seed]) and torch.equal(ints[:, NI:], before[:, NI:])


@pytest.mark.parametrize("after", [0, 1, 2])
@pytest.mark.parametrize("spec", ["ar", "pinned", "policy"])
def test_overlap_gives_the_tokens_of_reading_every_step(pair, prompts, spec, after, monkeypatch):
    """Greedy rows of different lengths, one ending on a stop token, a seeded sampled row (top-p), requests joining
    at steps 3 and 7 (prefilled while a step is in flight; their first tokens read before or after the next step's
    launch: FIRST_TOKENS_AFTER_LAUNCH): the same outputs as without overlap, greedy rows the target's own, and most
    decode steps queued behind the one before."""
    monkeypatch.setattr(dspark.policy, "FIRST_TOKENS_AFTER_LAUNCH", after)
    target, drafter = pair
    d, k = (None, None) if spec == "ar" else (drafter, 3 if spec == "pinned" else None)
    refs = [reference_greedy(target, p, 16) for p in prompts]
    stop = refs[2][6]
    params = [SamplingParams(max_tokens=16, ignore_eos=True), SamplingParams(max_tokens=9, ignore_eos=True),
              SamplingParams(max_tokens=16, stop_token_ids=[stop], ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=11, ignore_eos=True)]
    want = run(Engine(target, d, k, max_batch_size=4, prefill_chunk=8, overlap=False), prompts, params)
    engine = Engine(target, d, k, max_batch_size=4, prefill_chunk=8, overlap=True)
    got = run(engine, prompts, params)
    same(got, want)
    assert [o.accepted_per_step for o in got] == [o.accepted_per_step for o in want]
    for i in (0, 1, 4):
        assert got[i].token_ids == refs[i][: params[i].max_tokens]
    assert got[2].token_ids == refs[2][: refs[2].index(stop) + 1] and got[2].finish_reason == "stop"
    c = engine.metrics()
    assert c["overlapped_steps"] >= sum(c["decode_steps_per_k"]) // 2
    if d is not None:
        assert c["num_accepted_tokens"] > 0  # the drafts do get accepted (a live Markov head on a random drafter)


@pytest.mark.parametrize("spec", ["ar", "pinned"])
def test_steps_continuing_the_same_rows_keep_their_inputs_on_the_device(pair, prompts, spec):
    """Two rows decoding 40 tokens with overlap: a step whose rows continue the same rows of the step before it, in
    the same buffers and blocks, stages and copies nothing (its inputs are the ones chain_inputs completed on the
    device); a row's new block, a batch that shrinks or a changed step kind stages anew. The tokens and accepted
    counts stay those of reading every step."""
    target, drafter = pair
    d, k = (None, None) if spec == "ar" else (drafter, 3)
    params = [SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=31, ignore_eos=True)]
    want = run(Engine(target, d, k, max_batch_size=2, overlap=False), prompts[:2], params, arrive_at=(0, 0))
    engine = Engine(target, d, k, max_batch_size=2, overlap=True)
    got = run(engine, prompts[:2], params, arrive_at=(0, 0))
    same(got, want)
    assert [o.accepted_per_step for o in got] == [o.accepted_per_step for o in want]
    steps = sum(engine.metrics()["decode_steps_per_k"])
    blocks = sum(-(-(len(p) + n.max_tokens + 4) // 16) for p, n in zip(prompts, params))  # new blocks, at most
    assert steps - blocks - 4 <= engine.runner.inputs_kept < steps


def test_overlap_across_plain_and_drafting_steps(pair, prompts, monkeypatch):
    """Under a k schedule of plain runs and drafting steps (a drafting step after a plain one waits for the read: the
    stashed context rows are flushed first) the greedy rows stay the target's, a seeded sampled row the AR engine's
    for its seed (it decodes plainly under the policy), and an aborted request frees its cache."""
    target, drafter = pair
    engine = Engine(target, drafter, max_batch_size=4, prefill_chunk=8, overlap=True)
    schedule = iter([0, 0, 3, 3, 0, 3, 1, 0, 0, 3] * 20)
    monkeypatch.setattr(engine.policy, "choose", lambda *a: next(schedule))
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=14, temperature=0.9, seed=8, ignore_eos=True),
        SamplingParams(max_tokens=12, ignore_eos=True)]
    got = run(engine, prompts, params, abort=(5, 1))
    ar = run(Engine(target, None, max_batch_size=4, overlap=True), prompts, params, abort=(5, 1))
    for i in (0, 2, 4):
        assert got[i].token_ids == reference_greedy(target, prompts[i], params[i].max_tokens)
    assert got[3].token_ids == ar[3].token_ids
    assert got[1].finish_reason == "abort" and len(got[1].token_ids) < 16
    per_k = engine.metrics()["decode_steps_per_k"]
    assert per_k[0] > 0 and per_k[3] > 0 and engine.metrics()["overlapped_steps"] > 0


def test_a_steps_host_copy_is_one_contiguous_block_of_the_pinned_buffer():
    """Fewer drafts than the buffer's width (a plain step in a drafting engine) still get a contiguous view at the
    buffer's start: copying the device's output into a strided view would stage it and wait for the device."""
    buf = torch.arange(8 * 7).view(8, 7)
    for rows, cols in ((1, 3), (5, 3), (8, 7), (3, 5)):
        view = pinned_rows(buf, rows, cols)
        assert view.shape == (rows, cols) and view.is_contiguous() and view.data_ptr() == buf.data_ptr()
        assert view.flatten().tolist() == list(range(rows * cols))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_launch_does_not_wait_for_the_device(pair):
    """With the stream held busy for a second, queueing a plain step and a drafting step of several rows returns at
    once: the launch waits for nothing the device does (the read does)."""
    target, drafter = pair
    target, drafter = target.cuda(), drafter.cuda()
    engine = Engine(target, drafter, max_batch_size=4, graphs=True, overlap=True)
    n = engine.warmup(max_len=64)
    took = [s for s, _ in engine.slowest_captures]  # what the server prints after its warmup
    assert 0 < len(took) <= min(8, n) and took == sorted(took, reverse=True)
    reqs = [engine.add_request([3, 4, 5, 6 + i], SamplingParams(max_tokens=32, ignore_eos=True)) for i in range(3)]
    while any(r.status.value != "decode" for r in reqs):
        engine.step()
    engine.sync()
    for k in (engine.k, 0):  # drafting first: after a plain step it would flush the stashed context rows eagerly
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of device time queued ahead of the step
        t0 = time.perf_counter()
        flight = engine._launch(reqs, k)
        launched_s = time.perf_counter() - t0
        assert launched_s < 0.25, f"k={k}: the launch waited {launched_s:.3f} s for the device"
        step = flight.step  # its output is there once its event fired (eager) or its mailbox count reached `want`
        assert not (step.done.query() if step.done is not None else step.mailbox.count_np[0] >= step.want)
        engine._read(flight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampled_first_tokens_queue_behind_the_device():
    """The sampled first token's per-row parameters reach the device as queued copies: with the stream held busy for
    a second, drawing the tokens (temperature, top-k, top-p rows) returns at once, and the tokens they give are the
    ones drawn on an idle stream."""
    engine = Engine(make_target("qwen3", device="cuda"), None, max_batch_size=2)
    rows = [engine.add_request([3, 4, 5], SamplingParams(max_tokens=4, temperature=0.8, top_k=20, seed=1)),
            engine.add_request([6, 7], SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, seed=2))]
    last = torch.randn(2, engine.target.config.vocab_size, device="cuda")
    want = engine._first_tokens(rows, last).tolist()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time queued ahead
    t0 = time.perf_counter()
    tokens = engine._first_tokens(rows, last)
    queued_s = time.perf_counter() - t0
    assert queued_s < 0.25, f"the sampled first tokens waited {queued_s:.3f} s for the device"
    assert tokens.tolist() == want


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("after", [0, 1, 2])
def test_a_prefill_ends_after_the_other_rows_step_is_queued(pair, prompts, overlap, after, monkeypatch):
    """FIRST_TOKENS_AFTER_LAUNCH, a request whose prefill ends while others decode: with 1 the step that emits its
    first token queues the others' decode step without it (its first token is read after that launch), and it joins
    the next one; with 2 that step emits nothing of it, the next one emits its first token first and launches it; with
    0 it is in the step of its first token. A request that prefills alone decodes in the step of its first token, or
    with 2 in the next. Every text stays the target's greedy."""
    monkeypatch.setattr(dspark.policy, "FIRST_TOKENS_AFTER_LAUNCH", after)
    target, drafter = pair
    engine = Engine(target, drafter, max_batch_size=4, overlap=overlap)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    a = engine.add_request(prompts[0], params)
    assert [t for _, ts in engine.step() for t in ts] == a.output_ids  # its first token (+ its step's, read at once)
    assert engine.step_requests == ([] if after == 2 else [a])  # alone: its decode step launched in the same call
    while len(a.output_ids) < 3:
        engine.step()
    b = engine.add_request(prompts[1], params)
    emitted = engine.step()
    assert [t for r, ts in emitted if r is b for t in ts] == b.output_ids
    assert engine.step_requests == ([a] if after else [a, b])
    if after == 2:  # nothing of it yet: its first token comes first in the next call, which launches it
        assert b.output_ids == []
        emitted = engine.step()
        assert [t for r, ts in emitted if r is b for t in ts] == b.output_ids and b.output_ids
    else:
        assert len(b.output_ids) == 1 or not (after or overlap)  # read at once, its step in this call gave it more
        engine.step()
    assert engine.step_requests == [a, b]
    while engine.has_work():
        engine.step()
    assert [a.output_ids, b.output_ids] == [reference_greedy(target, p, 12) for p in prompts[:2]]


def test_a_request_aborted_before_its_first_token_is_read_emits_nothing(pair, prompts, monkeypatch):
    """FIRST_TOKENS_AFTER_LAUNCH = 2: a request aborted after its prefill, its first token not yet read, emits
    nothing and frees its cache; the request beside it decodes on to the target's greedy."""
    monkeypatch.setattr(dspark.policy, "FIRST_TOKENS_AFTER_LAUNCH", 2)
    target, drafter = pair
    engine = Engine(target, drafter, max_batch_size=4, overlap=True)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    a, b = (engine.add_request(p, params) for p in prompts[:2])
    assert engine.step() == [] and engine.has_work()
    engine.abort(b.id)
    emitted = []
    while engine.has_work():
        emitted += engine.step()
    assert all(r is a for r, _ in emitted) and b.output_ids == [] and b.finish_reason == "abort"
    assert a.output_ids == reference_greedy(target, prompts[0], 10) and engine.cache.pool.num_used == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_queued_host_copy_does_not_wait_for_the_device():
    """host_copy with the stream held busy for a second returns at once; once its event fired the copy holds the
    tensor's values (what the engine's first tokens read after the decode step's launch rely on)."""
    t = torch.arange(7, device="cuda") * 3
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time queued ahead
    t0 = time.perf_counter()
    host, done = host_copy(t)
    queued_s = time.perf_counter() - t0
    assert queued_s < 0.25, f"the copy waited {queued_s:.3f} s for the device"
    assert host.device.type == "cpu" and host.is_pinned() and not done.query()
    done.synchronize()
    assert host.tolist() == [3 * i for i in range(7)]


def test_handoff_reads_the_step_in_flight(pair, prompts):
    """export_prefilled with a step in flight reads it first: the moved requests continue to the target's greedy."""
    target, drafter = pair
    src = Engine(target, drafter, max_batch_size=4, overlap=True)
    dst = Engine(target, drafter, max_batch_size=4, overlap=True)
    reqs = [src.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts[:3]]
    while any(not r.output_ids for r in reqs):
        src.step()
    assert src.in_flight is not None
    moved = [dst.import_prefilled(src.export_prefilled(r.id)) for r in reqs]
    assert src.cache.pool.num_used == 0
    while dst.has_work():
        dst.step()
    assert [r.output_ids for r in moved] == [reference_greedy(target, p, 12) for p in prompts[:3]]


@pytest.mark.parametrize("after", [0, 1, 2])
def test_served_streams_carry_the_overlapped_tokens(pair, prompts, after, monkeypatch):
    """The server's engine thread over an overlapping engine (first tokens read before or after the decode launch:
    FIRST_TOKENS_AFTER_LAUNCH): each stream's events add up to the request's tokens, the same as reading every step,
    and end with the finish reason."""
    monkeypatch.setattr(dspark.policy, "FIRST_TOKENS_AFTER_LAUNCH", after)
    target, drafter = pair
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 5, 9)]
    want = Engine(target, drafter, max_batch_size=4, overlap=False).generate(prompts[:3], params)

    async def stream(runner, i):
        _, events = await runner.submit(prompts[i], params[i], f"s{i}")
        toks = []
        while True:
            ev = await events.get()
            toks += ev.token_ids
            if ev.finish_reason is not None:
                return toks, ev.finish_reason

    async def main():
        runner = EngineRunner(Engine(target, drafter, max_batch_size=4, overlap=True)).start()
        try:
            return await asyncio.gather(*(stream(runner, i) for i in range(3)))
        finally:
            runner.stop()

    got = asyncio.run(main())
    assert [t for t, _ in got] == [o.token_ids for o in want] and all(r == "length" for _, r in got)
