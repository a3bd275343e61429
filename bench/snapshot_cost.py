"""What a server's /metrics snapshot costs with a drafter's k policy: built on the engine thread, pickled by the
engine process's sending thread, unpickled by the server's reader (medians, µs); and what it costs the request whose
last event it follows (--delivery).

    python bench/snapshot_cost.py --target runs/quickstart/target/final --drafter runs/quickstart/drafter/final \
        [--choices 210] [--kinds 0] [--repeats 200] [--delivery]

The policy's view grows with what it has chosen: a counter per (batch size, k, sampling mode, basis) ever chosen
(after a server's levels at concurrency 1 to 64 some 200) and a cost per timed kind of step. --choices and --kinds
fill it to that size over the engine's own view after a few sampled requests. --delivery times a last event's trip
from the engine thread to a reader in another process (the server's), through the engine process's PipeSink and a
real pipe, its switch interval set as there, when the engine thread builds and publishes the snapshot right after
queueing the event, and when it first waits for the event to leave (PipeSink.wait_sent, as an idle engine does).
"""
from __future__ import annotations

import argparse
import collections
import itertools
import multiprocessing as mp
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark import Engine, SamplingParams, load_drafter, load_target  # noqa: E402
from serve.engine_proc import SWITCH_INTERVAL_S, PipeSink  # noqa: E402
from serve.runner import SENT_WAIT_S, EngineRunner, Event  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64)  # the batch buckets of a server of max_batch_size 64
KS = (0, 1, 2, 4, 8)


def fill(policy, choices: int, kinds: int) -> None:
    """Give the policy `choices` choice counters and `kinds` timed kinds of step (a full window of cycles each)."""
    keys = itertools.product(range(1, 65), KS, ("sample", "greedy"), ("measured", "modelled", "probe"))
    for key in itertools.islice(keys, choices):
        policy.choices_made[key] = policy.choices_made.get(key, 0) + 1
    for kind in itertools.islice(itertools.product(ROWS, KS, ("sample", "greedy")), kinds):
        policy.cycle_by_kind[kind] = collections.deque([0.2] * 16, maxlen=16)
        policy.sampled_at[kind] = policy.steps


def measure(runner: EngineRunner, repeats: int) -> dict[str, float]:
    """Median µs to build, pickle and unpickle the runner's snapshot, and its pickled bytes."""
    times: dict[str, list[float]] = {"build": [], "pickle": [], "unpickle": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        snap = runner._snap()
        t1 = time.perf_counter()
        data = pickle.dumps(snap)
        t2 = time.perf_counter()
        pickle.loads(data)
        t3 = time.perf_counter()
        for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
            times[name].append(1e6 * dt)
    return {**{k: statistics.median(v) for k, v in times.items()}, "bytes": len(data)}


def _reader(conn, times) -> None:
    """The server's side: the receipt time of each events message (perf_counter: the machine's monotonic clock,
    shared by processes), sent back at the end."""
    got = []
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        if msg[0] == "events" and msg[1]:
            got.append(time.perf_counter())
    times.send(got)


def delivery(runner: EngineRunner, repeats: int, wait: bool) -> list[float]:
    """µs from queueing an event to the reader's receipt of it, the snapshot built and published right after (or
    after PipeSink.wait_sent when wait), per repeat."""
    ours, theirs = mp.Pipe()
    times_in, times_out = mp.Pipe(duplex=False)
    reader = mp.Process(target=_reader, args=(theirs, times_out), daemon=True)
    reader.start()
    sink, sent = PipeSink(ours), []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            sink.deliver([("r", Event([1], "", "length", 64, 128))])
            if wait:
                sink.wait_sent(SENT_WAIT_S)
            sink.publish(runner._snap())
            sent.append(t0)
            time.sleep(2e-3)  # the next request comes later: nothing else in flight
        sink.send(("stop",))
        got = times_in.recv()
    finally:
        sys.setswitchinterval(switch)
        sink.close()
        reader.join(10)
    return [1e6 * (t1 - t0) for t0, t1 in zip(sent, got)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--choices", type=int, default=210)
    p.add_argument("--kinds", type=int, default=0)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--delivery", action="store_true", help="also time a last event's trip with the snapshot after it")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    target = load_target(a.target, device="cpu", dtype=torch.float32)
    drafter = load_drafter(a.drafter, target)
    for name, d in (("AR", None), ("DSpark", drafter)):
        engine = Engine(target, d, max_batch_size=4)
        engine.generate([[5, 6, 7, 8] * 16] * 4, SamplingParams(max_tokens=24, temperature=0.7))
        if d is not None:
            fill(engine.policy, a.choices, a.kinds)
        r = measure(EngineRunner(engine), a.repeats)
        view = engine.policy.view() if d is not None else None
        print(f"{name}: build {r['build']:.1f} µs, pickle {r['pickle']:.1f} µs, unpickle {r['unpickle']:.1f} µs, "
              f"{r['bytes']} bytes" + (f" ({len(view['choices'])} choice counters, {len(view['step_cost_ms'])} "
                                       "timed kinds)" if view else ""))
        for wait in (False, True) if a.delivery else ():
            us = sorted(delivery(EngineRunner(engine), a.repeats, wait))
            print(f"{name} last event to the reader, snapshot built {'once it left' if wait else 'right after'}: "
                  f"median {statistics.median(us):.1f} µs, p90 {us[int(0.9 * (len(us) - 1))]:.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
