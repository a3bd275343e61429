"""How a captured decode step hands its output to the host (dspark.step_buffers.Mailbox, dspark/kernels/publish.py):
the publish kernel against its reference (under the Triton interpreter, and on CUDA), the two turns of the ring on
CPU, and on CUDA a captured graph whose replays the host reads from the mailbox alone, two in flight at a time; the
engine's greedy speculation through it (and through the fallback when it fails to capture); and the CUDA calls a
chained AR step costs the host with it and without it."""
import pytest
import torch

from dspark.kernels.publish import publish_ref
from dspark.step_buffers import Mailbox
from tests.interp import interpreter_checks

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _publish_case(device, seed: int, op, rows: int, cols: int, posts: int = 3, direct: bool = False):
    """`posts` random outputs [rows, cols] through op (None: the reference) into a wider carry, a ring, its stamps
    and a count that starts at seed % 5 (direct: ring, stamps and a host count in pinned host memory, as
    Mailbox(direct=True) has them) -> (carry, ring, stamps, count, host count) on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    pin = direct and device == "cuda"
    host = "cpu" if direct else device
    carry = torch.randint(-9, 9, (rows + 3, cols + 4), generator=gen).to(device)
    ring = torch.zeros(2, rows, cols, dtype=torch.long, device=host, pin_memory=pin)
    stamps = torch.zeros(2, dtype=torch.long, device=host, pin_memory=pin)
    count = torch.full((1,), seed % 5, dtype=torch.long, device=device)
    count_host = torch.full((1,), -1, dtype=torch.long, pin_memory=pin) if direct else None
    for _ in range(posts):
        out = torch.randint(0, 1 << 40, (rows, cols), generator=gen).to(device)
        (op or publish_ref)(out, carry, ring, stamps, count, count_host)
    if device == "cuda":
        torch.cuda.synchronize()
    return carry.cpu(), ring.cpu(), stamps.cpu(), count.cpu(), (count if count_host is None else count_host).cpu()


def _interp_checks() -> dict:
    """Runs with TRITON_INTERPRET=1: name -> [mismatched values, tolerance]."""
    from dspark.kernels.publish import publish_triton

    res = {}
    for seed, rows, cols in ((0, 1, 3), (1, 37, 11), (2, 100, 11)):  # the last: more than one 1024-value block
        for direct in (False, True):
            got = _publish_case("cpu", seed, publish_triton, rows, cols, direct=direct)
            want = _publish_case("cpu", seed, None, rows, cols)
            res[f"publish_{rows}x{cols}{'_direct' * direct}"] = [
                float(sum(int((a != b).sum()) for a, b in zip(got, want))), 0.0]
    return res


def test_publish_kernel_interpreted():
    res = interpreter_checks("tests.test_mailbox")
    assert set(res) == {f"publish_{s}{d}" for s in ("1x3", "37x11", "100x11") for d in ("", "_direct")}
    for name, (err, tol) in res.items():
        assert err <= tol, name


def test_publish_reference_turns():
    """Post n lands in turn (count before it) % 2, the carry holds the last post, the count counts posts."""
    carry, ring = torch.zeros(4, 6, dtype=torch.long), torch.zeros(2, 2, 3, dtype=torch.long)
    stamps, count = torch.zeros(2, dtype=torch.long), torch.tensor([7])
    outs = [torch.arange(6).view(2, 3) + 10 * i for i in range(3)]
    for o in outs:
        publish_ref(o, carry, ring, stamps, count)
    assert int(count) == 10 and torch.equal(carry[:2, :3], outs[2]) and not carry[2:].any() and not carry[:, 3:].any()
    assert torch.equal(ring[1], outs[2]) and torch.equal(ring[0], outs[1])  # posts at counts 7, 8, 9 -> turns 1, 0, 1
    assert stamps.tolist() == [9, 10]  # each turn stamped with its post's number (the count after it)


@pytest.mark.parametrize("direct", [False, True])
def test_mailbox_turns_on_cpu(direct):
    """The host's mirror of the count: each replay's turn holds that post's rows and stays intact after the next
    post (two steps in flight); sync() takes the device's count after posts the host did not count. Direct: the
    post writes the host's ring and count itself."""
    mb, carry = Mailbox(2, 3, "cpu", direct=direct), torch.zeros(2, 3, dtype=torch.long)
    assert (mb.ring.data_ptr() == mb.ring_host.data_ptr()) == direct
    mb.post(torch.full((2, 3), -1), carry)  # an uncounted post (a capture's warm-up)
    mb.sync()
    assert mb.posted == 1
    seen = []
    for i in range(4):
        out = torch.arange(6).view(2, 3) + 100 * i
        mb.post(out, carry)
        turn, want = mb.replayed()
        mb.wait(want)  # posted already: returns at once
        assert want == i + 2 and torch.equal(turn, out) and torch.equal(carry, out)
        if seen:
            assert torch.equal(seen[-1][0], seen[-1][1])  # the step before's turn: untouched by this post
        seen.append((turn, out))


def test_mailbox_out_of_step_raises():
    """A host count behind the device's reads a turn stamped with another post: an error, never stale rows; a post
    never seen fails after the wait limit with the device's count."""
    import dspark.step_buffers as sb

    mb, carry = Mailbox(1, 3, "cpu"), torch.zeros(1, 3, dtype=torch.long)
    for _ in range(3):
        mb.post(torch.ones(1, 3, dtype=torch.long), carry)  # the host counted none of them
    _, want = mb.replayed()
    with pytest.raises(RuntimeError, match="holds post 3, not 1"):
        mb.wait(want)
    mb.sync()
    _, want = mb.replayed()  # a replay that never ran
    limit, sb.WAIT_LIMIT_S = sb.WAIT_LIMIT_S, 0.05
    try:
        with pytest.raises(RuntimeError, match="post 4 not seen after"):
            mb.wait(want)
    finally:
        sb.WAIT_LIMIT_S = limit


@cuda
@pytest.mark.parametrize("direct", [False, True])
def test_cuda_publish_kernel(direct):
    from dspark.kernels.publish import publish_triton

    for seed, rows, cols in ((0, 1, 3), (1, 512, 11)):
        got = _publish_case("cuda", seed, publish_triton, rows, cols, direct=direct)
        want = _publish_case("cpu", seed, None, rows, cols)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@cuda
@pytest.mark.parametrize("direct", [False, True])
def test_cuda_mailbox_in_a_graph(direct):
    """A captured step (x + its input, posted) replayed with new inputs, each launched before the one before it is
    read, as the engine's overlap does: every read through the mailbox's count alone gives that replay's rows (direct:
    the kernel writes them in pinned memory, no copy in the graph)."""
    rows, cols = 3, 5
    mb, carry = Mailbox(rows, cols, "cuda", direct=direct), torch.zeros(4, 8, dtype=torch.long, device="cuda")
    inp = torch.zeros(rows, cols, dtype=torch.long, device="cuda")
    base = torch.arange(rows * cols, device="cuda").view(rows, cols)

    def step():
        mb.post(base + inp, carry)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up (Triton's compile): a post the host did not count
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    mb.sync()
    pending = None
    for i in range(1, 9):
        inp.fill_(1000 * i)  # queued before the replay, after the last one on the stream
        graph.replay()
        launched = (i, *mb.replayed())
        if pending is not None:  # read the step before, this one in flight
            j, turn, want = pending
            mb.wait(want)
            assert torch.equal(turn, (base + 1000 * j).cpu())
        pending = launched
    j, turn, want = pending
    mb.wait(want)
    assert torch.equal(turn, (base + 1000 * j).cpu()) and torch.equal(carry[:rows, :cols].cpu(), turn)


@cuda
@pytest.mark.parametrize("mailbox", ["copy", "direct", None])
def test_cuda_engine_greedy_through_the_mailbox(mailbox, monkeypatch):
    """Greedy speculation through captured steps equals the target's plain greedy, reading each step from its
    mailbox (the graph's copy, or the kernel's direct writes), or (a mailbox that fails to capture) through the copy
    and event after a warning."""
    import dspark.runner as runner_mod
    from dspark.engine import Engine
    from dspark.request import SamplingParams
    from dspark.step_buffers import Mailbox as MB
    from tests.targets import make_target
    from tests.test_engine import make_drafter, reference_greedy

    target = make_target("qwen3", device="cuda")
    monkeypatch.setattr(runner_mod, "MAILBOX", mailbox or "copy")
    if not mailbox:
        monkeypatch.setattr(MB, "post", _refusing(MB.post))
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    engine = Engine(target, make_drafter(target), max_model_len=128)
    if mailbox:
        outs = engine.generate(prompts, SamplingParams(max_tokens=24))
    else:
        with pytest.warns(RuntimeWarning, match="failed to run or capture with its mailbox"):
            outs = engine.generate(prompts, SamplingParams(max_tokens=24))
    assert [o.token_ids for o in outs] == [reference_greedy(target, p, 24) for p in prompts]
    steps = engine.runner.steps.values()
    assert steps and all((st.mailbox is not None) == bool(mailbox) and st.graph is not None for st in steps)
    assert all(st.mailbox.direct == (mailbox == "direct") for st in steps if st.mailbox is not None)


def _refusing(post):
    """Mailbox.post that raises inside a stream capture (as a runtime that cannot capture its copies would)."""
    def refusing(self, out, carry):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("no copies in this capture")
        post(self, out, carry)
    return refusing


@cuda
@pytest.mark.parametrize("mailbox", ["copy", "direct", None])
def test_cuda_chained_ar_steps_make_one_cuda_call(mailbox, monkeypatch):
    """At one row, AR steps that continue the step before (async scheduling, inputs kept on the device) cost the host
    one CUDA call each with the mailbox: the graph's launch; the timing events of every TIME_EVERY-th step and a new
    block's staging aside, no copy is queued and no event is waited on. Without it (DSPARK_MAILBOX=0's path) every
    step queues its output's copy and waits on its event."""
    import dspark.runner as runner_mod
    from dspark.engine import Engine
    from dspark.request import SamplingParams
    from tests.targets import make_target

    monkeypatch.setattr(runner_mod, "MAILBOX", mailbox)
    engine = Engine(make_target("qwen3", device="cuda"), None, max_model_len=512)
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=300, ignore_eos=True))
    for _ in range(40):  # prefill, the first captures, steps up to a steady state
        engine.step()
    n = 64
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            engine.step()
    calls = {e.key: e.count for e in prof.key_averages()}
    while engine.has_work():
        engine.step()
    blocks = n // engine.cache.block_size + 2  # a new block's rows are staged: two copies, an event and its wait
    assert calls.get("cudaGraphLaunch", 0) == n
    if mailbox:
        assert calls.get("cudaMemcpyAsync", 0) <= 2 * blocks
        # the timing reads, and a staging buffer's last copy awaited before it is refilled
        assert calls.get("cudaEventSynchronize", 0) <= n // runner_mod.TIME_EVERY + blocks
    else:
        assert calls.get("cudaMemcpyAsync", 0) >= n and calls.get("cudaEventSynchronize", 0) >= n
