"""bench/snapshot_cost.py: the /metrics snapshot's cost grows with the k policy's view, which it fills to size."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("snapshot_cost", ROOT / "bench" / "snapshot_cost.py")
snapshot_cost = importlib.util.module_from_spec(spec)
spec.loader.exec_module(snapshot_cost)


def run(models, capsys, *flags) -> dict[str, tuple[float, int, str]]:
    target, drafter = models
    assert snapshot_cost.main(["--target", str(target), "--drafter", str(drafter), "--repeats", "5", *flags]) == 0
    out = {}
    for line in capsys.readouterr().out.splitlines():
        name, rest = line.split(": ", 1)
        us = sum(float(x) for x in re.findall(r"([\d.]+) µs", rest))
        out[name] = (us, int(re.search(r"(\d+) bytes", rest).group(1)), rest)
    return out


def test_the_snapshot_carries_the_policy_view_it_was_filled_to(models, capsys):
    small = run(models, capsys, "--choices", "0")
    big = run(models, capsys, "--choices", "120", "--kinds", "7")
    assert "choice counters" not in small["AR"][2]  # no drafter, no policy view
    counters, kinds = map(int, re.search(r"\((\d+) choice counters, (\d+) timed kinds\)", big["DSpark"][2]).groups())
    assert counters >= 120 and kinds == 7  # (the requests before it may have chosen kinds beyond the filled ones)
    # the view's counters cross the pipe: its pickled size grows with them, AR's does not move
    assert big["DSpark"][1] > small["DSpark"][1] + 120 * 10 and big["AR"][1] == small["AR"][1]
    assert all(us > 0 for us, _, _ in (*small.values(), *big.values()))


def test_delivery_times_a_last_events_trip_to_a_reader_in_another_process(models, capsys):
    """--delivery: for each engine, the last event's trip through PipeSink and a real pipe to a reader process, with
    the snapshot built right after it and once it left; one figure per repeat arrives (none lost in the pipe)."""
    target, drafter = models
    assert snapshot_cost.main(["--target", str(target), "--drafter", str(drafter), "--repeats", "5", "--choices", "0",
                               "--delivery"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "last event" in x]
    assert [x.split(" last event")[0] for x in lines] == ["AR", "AR", "DSpark", "DSpark"]
    assert ["right after" in x for x in lines] == [True, False, True, False]
    for x in lines:
        median, p90 = map(float, re.search(r"median ([\d.]+) µs, p90 ([\d.]+) µs", x).groups())
        assert 0 < median <= p90 < 1e6
    us = snapshot_cost.delivery(snapshot_cost.EngineRunner(snapshot_cost.Engine(snapshot_cost.load_target(
        str(target)))), 7, wait=True)
    assert len(us) == 7 and all(u > 0 for u in us)
