"""The k policy: how many drafts each decode step verifies, 0 (plain decoding) up to the drafter's block.

A step of k drafts emits 1 + sum_i prod_{j<=i} alpha_j tokens per row that keeps the drafter's context (alpha_j: the
measured acceptance of draft position j given all before it, greedy and sampled rows apart, over the recent
row-steps), one per row that keeps none (it verifies no drafts): a batch where few rows draft gains little from a
drafting step that costs what one of all rows drafting does. Its cost is what steps of its kind (batch bucket, k,
sampling mode) took from one start to the next when they ran back to back (with async
scheduling: the next step queued behind it; a switch to drafting flushes the stashed context first): the median of
the kind's last CYCLE_WINDOW such cycles, once it has MIN_CYCLES (a median: a first step's one-off costs, or a
pause inside a step, would otherwise stick to a kind that runs rarely). A kind not timed that often borrows from
the measured kinds of its k and mode at other batch buckets: its replay plus their median excess of cycle over
replay (a drafting step's host work, such as its acceptance bookkeeping, follows k more than the bucket). With none
of those it is modelled: its graph's replay time and the host's own work per step (each cycle less the host's waits
for the device, the median over the last steps of every kind), with async scheduling the larger of the two (they
overlap), else their sum. Measured cycles hold what the model leaves out, such as a step whose host work and device
time fail to overlap. Plain decoding's cycles are those of every plain step, the AR engine's (no row keeps the
drafter's context, no stash) among them: while most sampled requests keep no context those are most plain steps, and
the few that stash, priced alone, make plain decoding read dear and the policy draft where drafting loses.
A kind not run for STALE_STEPS steps forgets its cycles: a cost measured under other traffic (another level of
load, a transient such as the first steps after a burst) would otherwise stand for good against a kind that keeps
running; once plain decoding's cycles are forgotten the policy decodes plainly for the few steps that measure them
again (see below), so a plain cost measured too high cannot keep it drafting where drafting loses. A choice to draft
that would lose to plain decoding at its graph's replay time (the least a plain step can take) turns on the measured
plain cost; such a choice forgets a plain cost older than REFRESH_STEPS steps that way too. While it drafts no plain
step runs to correct that cost (every sampled request keeps the drafter's context then), and one measured high by a
transient (a run's first steps, a slow spell of the host) would otherwise keep it drafting for STALE_STEPS steps.
Where drafting leads even that floor, no plain step is spent on measuring.
Drafting after plain steps also pays the flush of their stashed context rows, spread over the REPICK_EVERY steps a
choice lasts. Plain decoding is measured at the batch bucket before drafting is weighed against it there: modelled
with the host work of the drafting steps that ran first, or borrowed from another bucket's (a level of 16 rows before
one of 1: the host work of 16 rows a step), plain steps would look dearer than they are, and a choice never made is
never measured.
The policy picks the k with the most expected tokens per millisecond, so speculation runs plainly where drafting
does not pay (and while probes keep finding that for sampled rows, most sampled requests keep no drafter context:
their plain steps are then AR's, without the stash; context_for); drafting must beat plain decoding by DRAFT_GAIN (a
prompt's drafter context is still outside these costs, and a marginal estimate is as likely to lose as to win). On
CPU (no graphs, no step times) it drafts the whole block.
DSPARK_POLICY="NAME=VALUE,..." replaces this module's constants (an A/B through the server); an unknown name or a
value that is not a number is a ValueError naming it.
"""
from __future__ import annotations

import os
import statistics
import time
from collections import deque

from dspark.runner import ModelRunner
from dspark.step_buffers import StepKey

PROBE_EVERY = 64  # plain steps after which the policy drafts once more, to refresh its acceptance statistics ...
PROBE_MAX = 1024  # ... an interval that doubles, up to this, each time such a probe leaves the choice at plain decoding
REPICK_EVERY = 16  # steps a k choice is reused for the same batch size, context bucket and mode
HOST_PAUSE_MS = 100.0  # a longer gap between two decode steps is a pause (a stalled client loop), not step cost
CYCLE_WINDOW = 16  # a kind of step's cost: the median of its last this many cycles ...
MIN_CYCLES = 3  # ... once it has this many (before, the model: replay and the host's work per step) ...
EARLY_STEPS = 4  # a run's first this many timed steps also count apart (early_cycles): a kind measured in short runs,
# as plain decoding is between drafting steps, against its long runs
STALE_STEPS = 1024  # ... sampled within this many decode steps (of any kind): an older kind's cycles are forgotten
REFRESH_STEPS = 256  # a choice to draft that turns on the plain cost measures it again once it is this many steps old
FLUSH_EMA = 0.05  # weight of each new sample in the context flush's moving average
ACCEPT_WINDOW = 512  # row-steps at the first position after which a group's acceptance counts are halved: the
# estimate follows the traffic of the last few hundred row-steps (a prose burst after code), not the server's lifetime
FIRST_TOKENS_AFTER_LAUNCH = 0  # 1: the engine reads a prefill's first tokens after it queues the other rows' decode
# step, not before (dspark/engine.py's module doc): the host's wait for them then leaves the device a step to run; 2:
# at the start of the next step() (the host does not wait for the prefill)
DRAFT_GAIN = 1.1  # a k > 0 is chosen over plain decoding only when it expects this many times its tokens per ms
# while plain decoding is the sampled rows' choice, one sampled request in this many per request running keeps the
# drafter's context (the others decode as the AR engine does): about one step in this many then carries such a row at
# any batch size (its plain steps stash the context, dearer than AR's), and those steps carry the probes that find
# where drafting pays again
CONTEXT_EVERY = 8
GROUPS = ("greedy", "sampled")
# what a choice to draft weighed (KPolicy.weighed): how many, plain decoding's cost and the chosen k's (ms), k's
# expected tokens per row; the plain cost's cycles (a modelled one counts as one of its value), their least (ms), their
# age (decode steps since the last)
WEIGHED = ("n", "plain_ms", "ms", "expected", "plain_cycles", "plain_min_ms", "plain_age")


def overrides(spec: str) -> dict[str, float | int]:
    """DSPARK_POLICY's "NAME=VALUE,..." -> {name: value} (each name one of this module's numeric constants, each
    value of its type)."""
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, text = item.partition("=")
        name = name.strip()
        old = globals().get(name)
        if not name.isupper() or type(old) not in (int, float):
            raise ValueError(f"DSPARK_POLICY: {name!r} is not one of dspark.policy's numeric constants")
        try:
            out[name] = type(old)(text.strip())
        except ValueError:
            raise ValueError(f"DSPARK_POLICY: {name}={text!r}: expected {type(old).__name__}") from None
    return out


globals().update(overrides(os.environ.get("DSPARK_POLICY", "")))


def counts_above(values: list[int], size: int) -> list[int]:
    """For each i < size, how many of values (>= 0) exceed i (per draft position, the rows that got past it)."""
    out, n = [0] * size, len(values)
    for i in range(size):
        n -= values.count(i)
        out[i] = n
    return out


class KPolicy:
    def __init__(self, runner: ModelRunner, k: int, pinned: bool, overlap: bool = False):
        """k: the most drafts a step may verify (0: no drafter); pinned: always k; overlap: the engine queues each
        step before it reads the one before (host work and device time overlap)."""
        self.runner, self.k, self.pinned, self.overlap = runner, k, pinned, overlap
        self.choices = sorted({0, k} | {1 << i for i in range(8) if 1 << i < k}) if k else [0]
        self.reset()

    def reset(self) -> None:
        """Forget the statistics (after a warm-up)."""
        n = max(self.k, 1)
        # per draft position j: row-steps that reached it (all drafts before it accepted) and that accepted it
        self.reached = {g: [0] * n for g in GROUPS}
        self.accepted = {g: [0] * n for g in GROUPS}
        self.plain_steps = {g: 0 for g in GROUPS}  # steps decoded plainly since the last draft
        self.probe_every = {g: PROBE_EVERY for g in GROUPS}
        self.probed = {g: False for g in GROUPS}  # a probe ran and the next choice has not judged it yet
        self.sampled_without = 0  # sampled requests whose prompt came in while plain decoding was their choice
        self.memo: dict[tuple, list[int]] = {}  # (rows, context bucket, mode) -> [k, steps it is still reused]
        # the choices made (each reused up to REPICK_EVERY steps): (rows, k, mode, basis) -> how many, basis "measured"
        # or "modelled" (the chosen kind's cost), or "probe" (the whole block, for the acceptance statistics)
        self.choices_made: dict[tuple[int, int, str, str], int] = {}
        # per k > 0, over the choices to draft k (probes left out): how many, and the sums of what each weighed:
        # plain decoding's cost and k's (ms), k's expected tokens per row (what /metrics shows against the measured);
        # and of the plain cost's basis: its kind's cycles then, the least of them (ms), its age in decode steps
        self.weighed: dict[int, dict[str, float]] = {}
        # over back-to-back graph steps: the host's own work per decode step (ms: scheduling, the launch, reading, the
        # server's loop; its waits for the device left out), the last samples of every kind; and per kind (batch
        # bucket, k, sampling mode) the last times from one step's start to the next (ms)
        self.host_all: deque[float] = deque(maxlen=4 * CYCLE_WINDOW)
        self.cycle_by_kind: dict[tuple[int, int, str], deque[float]] = {}
        self.steps = 0  # decode steps started
        self.sampled_at: dict[tuple[int, int, str], int] = {}  # each kind's last cycle: self.steps then
        self.replay_by_kind: dict[tuple[int, int, str], float] = {}  # each timed kind's replay at capture (ms)
        self.flush_ms: float | None = None  # a context flush's host time (ms), moving average
        self.last_k = 0  # the k of the last choice (a k > 0 after plain steps flushes their context first)
        # the step in progress: (perf_counter at its start, the host's total wait for the device then (ms), its key,
        # its replay ms); key None until it is launched as a graph step
        self.last_step: tuple[float, float, StepKey | None, float | None] | None = None
        self.before: tuple[int, int, str] | None = None  # the kind of the step before the one in progress
        # per k, over back-to-back graph steps: the steps, their whole time from one step's start to the next (ms)
        # and their replay time (ms): what a step of k drafts costs, against what the choice above assumes
        self.cycles, self.cycle_ms, self.replay_ms = [0] * (self.k + 1), [0.0] * (self.k + 1), [0.0] * (self.k + 1)
        # per k, the steps that began a run of their kind after another (under overlap; the cycles above leave them
        # out): how many and their whole time (ms), what a change of kind costs beyond the choice's figures
        self.switches, self.switch_ms = [0] * (self.k + 1), [0.0] * (self.k + 1)
        # per k, of the cycles above those of the first EARLY_STEPS timed steps of a run: how many and their time (ms)
        self.early_cycles, self.early_ms = [0] * (self.k + 1), [0.0] * (self.k + 1)
        self.run = 0  # the last step's place in its run of one kind (1: the first), set as its cycle is taken

    # ------------------------------------------------------------------ the choice
    def choose(self, num_rows: int, longest: int, mode: str, drafting: int | None = None) -> int:
        """Drafts for this step of num_rows rows, `drafting` of them keeping the drafter's context (default all): the
        pinned k, else the best candidate (module doc) at this batch bucket. It drafts
        the whole block until 8 steps have reached the first position, and once after PROBE_EVERY plain steps, so
        the statistics keep coming (a probe costs a drafting step that does not pay and the context rows of every
        position since the last one, so while probes leave the choice at 0 their interval doubles, up to PROBE_MAX,
        and a choice of k > 0 resets it); a choice is reused for REPICK_EVERY steps of the same batch size, context
        bucket and mode, one on a modelled cost only for the steps that measure it (a capture's replay time and
        another bucket's host work can make a kind look cheaper than it runs). Whether drafting pays for the group
        (what resets the probes' interval, and so lets new sampled requests keep the context: context_for) is judged
        as if every row drafted: rows that keep none would otherwise hold it at plain decoding for good."""
        if self.k == 0:
            return 0
        if self.pinned:
            return self.k
        group = "greedy" if mode == "greedy" else "sampled"
        acc, reach = self.accepted[group], self.reached[group]
        if reach[0] < 8 or self.plain_steps[group] >= self.probe_every[group]:
            self.probed[group] = reach[0] >= 8
            self.plain_steps[group] = 0
            self.last_k = self.k
            self._made(num_rows, self.k, mode, "probe")
            return self.k
        drafting = num_rows if drafting is None else drafting
        memo = (num_rows, drafting, longest.bit_length(), mode)
        hit = self.memo.get(memo)
        if hit is None or hit[1] <= 0:
            est = self.estimates(num_rows, longest, mode, acc, reach, drafting)
            k = self.pick(num_rows, longest, mode, est)
            key = self.runner.key_for(num_rows, k, longest + k + 1, mode)
            # a choice on a modelled cost lasts until its kind is measured (then its cost is known), not REPICK_EVERY:
            # MIN_CYCLES steps, one more whose start times the last, and under overlap one more after a switch of k
            # (its first step's cycle holds the step before: step_started)
            measured = self.measured_cycles(key) is not None
            switch = self.overlap and k != self.last_k
            hit = self.memo[memo] = [k, REPICK_EVERY if measured else MIN_CYCLES + 1 + switch]
            self._made(num_rows, k, mode, "measured" if measured else "modelled")
            if k and est is not None:
                self._weighed(k, est, self.plain_kind(num_rows, longest, mode))
            pays = k > 0 or (drafting < num_rows and self.pick(num_rows, longest, mode, est, "rate_all") > 0)
            if pays:  # drafting pays (again), for every row that keeps the context
                self.probe_every[group] = PROBE_EVERY
            elif self.probed[group]:  # a probe, and still plain
                self.probe_every[group] = min(2 * self.probe_every[group], PROBE_MAX)
            self.probed[group] = False
        hit[1] -= 1
        self.plain_steps[group] = self.plain_steps[group] + 1 if hit[0] == 0 else 0
        self.last_k = hit[0]
        return hit[0]

    def context_for(self, sampled: bool, running: int = 1) -> bool:
        """Whether a request being admitted keeps the drafter's context (stashed by its plain steps, so that it
        may draft), `running` requests decoding or prefilling then (itself included). A sampled one does not while
        probes keep finding plain decoding best for sampled rows (their interval has grown past PROBE_EVERY:
        dspark.engine's plain steps then cost what AR's do), except one in CONTEXT_EVERY x running; greedy ones, a
        pinned k, and a drafting choice keep it."""
        if self.k == 0 or self.pinned or not sampled or self.probe_every["sampled"] <= PROBE_EVERY:
            return True
        self.sampled_without += 1
        if self.sampled_without < CONTEXT_EVERY * max(running, 1):
            return False
        self.sampled_without = 0
        return True

    def _weighed(self, k: int, est: dict[int, dict], kind: tuple[int, int, str]) -> None:
        """Add a choice to draft k to k's sums of what it weighed (est: estimates; kind: plain decoding's)."""
        cycles = self.cycle_by_kind.get(kind) or [est[0]["cost_ms"]]
        w = self.weighed.setdefault(k, dict.fromkeys(WEIGHED, 0.0))
        for what, v in (("n", 1), ("plain_ms", est[0]["cost_ms"]), ("ms", est[k]["cost_ms"]),
                        ("expected", est[k]["expected"]), ("plain_cycles", len(cycles)), ("plain_min_ms", min(cycles)),
                        ("plain_age", self.steps - self.sampled_at.get(kind, self.steps))):
            w[what] += v

    def _made(self, num_rows: int, k: int, mode: str, basis: str) -> None:
        key = (num_rows, k, mode, basis)
        self.choices_made[key] = self.choices_made.get(key, 0) + 1

    def step_times(self, num_rows: int, longest: int, mode: str) -> dict[int, float] | None:
        """Each candidate k's graph replay time (ms) for num_rows rows whose longest has `longest` positions cached
        (graphs captured now if needed); None without graphs."""
        r = self.runner
        ms = {k: r.step_ms(r.key_for(num_rows, k, longest + k + 1, mode)) for k in self.choices}
        return None if None in ms.values() else ms

    @property
    def host_ms(self) -> float:
        """The host's work per decode step over the last steps of every kind (ms; median)."""
        return statistics.median(self.host_all) if self.host_all else 0.0

    def measured_cycles(self, key: StepKey) -> deque[float] | None:
        """The last cycles (ms) of the key's kind, once it has MIN_CYCLES of them; else None (its cost is
        modelled)."""
        cycles = self.cycle_by_kind.get((key.rows, key.k, key.mode))
        return cycles if cycles and len(cycles) >= MIN_CYCLES else None

    def measured_kinds(self, k: int | None = None, mode: str | None = None
                       ) -> list[tuple[tuple[int, int, str], deque[float]]]:
        """The kinds (batch bucket, k, mode) with MIN_CYCLES cycles, and their cycles; only those of k drafts in this
        mode when given."""
        return [(kind, c) for kind, c in sorted(self.cycle_by_kind.items())
                if len(c) >= MIN_CYCLES and (k is None or kind[1:] == (k, mode))]

    def excess_ms(self, k: int, mode: str) -> float | None:
        """The median, over the measured kinds of k drafts and this mode (every batch bucket), of their median cycle
        less their replay (ms); None when no such kind is measured."""
        excess = [statistics.median(c) - self.replay_by_kind[kind] for kind, c in self.measured_kinds(k, mode)
                  if kind in self.replay_by_kind]
        return statistics.median(excess) if excess else None

    def step_cost(self, key: StepKey, replay_ms: float) -> float:
        """A step's expected time (ms): its kind's measured cycle, else its replay plus the excess of its k's
        measured kinds, else its replay and the host's work per step (module doc)."""
        cycles = self.measured_cycles(key)
        if cycles is not None:
            return statistics.median(cycles)
        excess = self.excess_ms(key.k, key.mode)
        if excess is not None:
            return replay_ms + excess
        return max(replay_ms, self.host_ms) if self.overlap else replay_ms + self.host_ms

    def best(self, num_rows: int, longest: int, mode: str, acc: list[int], reach: list[int],
             drafting: int | None = None) -> int:
        """The candidate with the most expected tokens per millisecond (estimates); without graphs the whole
        block. Once steps have run, plain decoding is measured before drafting is weighed against it: until plain
        steps of this mode have run back to back at this batch bucket it decodes plainly, since modelling them
        with the drafting steps' host work, or another bucket's, would price them too high, and a choice never
        tried is never measured. drafting: the rows that keep the drafter's context (default all)."""
        return self.pick(num_rows, longest, mode, self.estimates(num_rows, longest, mode, acc, reach, drafting))

    def pick(self, num_rows: int, longest: int, mode: str, est: dict[int, dict] | None, rate: str = "rate") -> int:
        """best's choice from estimates already made; rate "rate_all": as if every row kept the drafter's
        context."""
        if est is None:
            return self.k
        if self.host_all and not est[0]["measured"]:
            return 0
        k = max(est, key=lambda k: (est[k][rate], -k))
        # k's lead turns on the plain cost where it loses to plain steps that take their replay time (DRAFT_GAIN / ms)
        if k and est[k][rate] * est[0]["replay_ms"] < DRAFT_GAIN and self.forget_old_plain(num_rows, longest, mode):
            return 0
        return k

    def plain_kind(self, num_rows: int, longest: int, mode: str) -> tuple[int, int, str]:
        """Plain decoding's kind (batch bucket, 0, mode) for num_rows rows whose longest has `longest` positions
        cached."""
        key = self.runner.key_for(num_rows, 0, longest + 1, mode)
        return key.rows, 0, key.mode

    def forget_old_plain(self, num_rows: int, longest: int, mode: str) -> bool:
        """Forget the plain cost at this batch bucket if it was sampled more than REFRESH_STEPS steps ago (module
        doc) -> whether it was."""
        return bool(self.forget_stale([self.plain_kind(num_rows, longest, mode)], REFRESH_STEPS))

    def estimates(self, num_rows: int, longest: int, mode: str, acc: list[int] | None = None,
                  reach: list[int] | None = None, drafting: int | None = None) -> dict[int, dict] | None:
        """Per candidate k what the choice weighs: expected tokens per row and step (`drafting` of the num_rows rows
        keep the drafter's context, default all; the others emit one), cost (ms: step_cost; a k > 0 after
        plain steps also pays a flush spread over REPICK_EVERY steps), whether that cost was measured, and the rate
        (tokens per ms; plain decoding's counted DRAFT_GAIN times; rate_all: the same were every row to keep the
        context). A position reached fewer than 8 times takes the
        acceptance of the one before it. None without graphs. acc / reach default to the mode's group's counts."""
        times = self.step_times(num_rows, longest, mode)
        if times is None:
            return None
        group = "greedy" if mode == "greedy" else "sampled"
        acc = self.accepted[group] if acc is None else acc
        reach = self.reached[group] if reach is None else reach
        flush = (self.flush_ms or 0.0) / REPICK_EVERY if self.last_k == 0 else 0.0
        alpha = self.acceptance(acc, reach)
        share = 1.0 if drafting is None else drafting / num_rows
        out = {}
        for k, ms in times.items():
            gained, surv = 0.0, 1.0  # expected accepted drafts of a row that keeps the context
            for j in range(k):
                surv *= alpha[j]
                gained += surv
            key = self.runner.key_for(num_rows, k, longest + k + 1, mode)
            cost = self.step_cost(key, ms) + (flush if k else 0.0)
            gain = DRAFT_GAIN if k == 0 else 1.0
            out[k] = {"expected": 1.0 + share * gained, "cost_ms": cost, "replay_ms": ms,
                      "measured": self.measured_cycles(key) is not None,
                      "rate": (1.0 + share * gained) / cost * gain, "rate_all": (1.0 + gained) / cost * gain}
        return out

    def acceptance(self, acc: list[int], reach: list[int]) -> list[float]:
        """Per draft position the estimated acceptance given all before it accepted: (accepted + 1) / (reached + 2);
        a position reached fewer than 8 times takes the one before it."""
        alpha, last = [], 0.5
        for j in range(self.k):
            last = (acc[j] + 1) / (reach[j] + 2) if reach[j] >= 8 or j == 0 else last
            alpha.append(last)
        return alpha

    def view(self) -> dict:
        """What the choice weighs now, for /metrics: each measured kind's cost as (batch bucket, k, sampling mode, the
        median of its last cycles in ms), the acceptance estimates per group, the flush's host ms, the choices made
        so far as (rows, k, mode, basis: see choices_made, n), and per k what its choices to draft weighed (n, and
        the sums of WEIGHED's other figures: see weighed). Tuples: every snapshot of a server carries it, some
        200 choices after a run of levels, and tuples pickle in a third of the time dicts take."""
        return {"step_cost_ms": [(*kind, statistics.median(c)) for kind, c in self.measured_kinds()],
                "acceptance": {g: self.acceptance(self.accepted[g], self.reached[g]) for g in GROUPS},
                "flush_ms": self.flush_ms or 0.0,
                "choices": [(*key, n) for key, n in self.choices_made.items()],  # (in the order first made)
                "weighed": [{"k": k, **w} for k, w in sorted(self.weighed.items())]}

    # ------------------------------------------------------------------ what it learns from
    def record(self, ns: list[int], accs: list[int], group: str) -> None:
        """A step's row-steps that verified drafts: n each, a of them accepted (counts halved every ACCEPT_WINDOW,
        looked at once a step)."""
        acc, reach = self.accepted[group], self.reached[group]
        for i, m in enumerate(counts_above(accs, len(acc))):
            acc[i] += m
        for i, m in enumerate(counts_above([min(n, a + 1) for n, a in zip(ns, accs)], len(reach))):
            reach[i] += m
        if reach[0] >= ACCEPT_WINDOW:
            self.accepted[group], self.reached[group] = [x // 2 for x in acc], [x // 2 for x in reach]

    def step_started(self, waited_ms: float = 0.0, chained: bool = True) -> None:
        """At a decode step's start (waited_ms: the host's running total of waits for the device, ms; chained: it
        was queued behind the last step, or there is no overlap): the last step's host work (the time since it
        began less the waits in between) into the samples of all steps, that time into its kind's cycles and, with
        its replay, into its k's cycle counters. An unchained start under overlap (the step in flight was read
        first) leaves the last step unsampled: that gap holds a wait the next step's kind, not the last one's,
        caused. Under overlap a step's cycle also holds the read of the step before it, so it counts for its kind
        only after a step of the same kind (the first plain step after drafting ones would carry their device
        time); such a first step of a run counts as a switch to its k instead (switches, switch_ms). A plain step
        none of whose rows keeps the drafter's context (the AR step, no stash) counts for the plain kind as one that
        stashes does: where most sampled requests keep no context, most plain steps are AR's, and plain decoding
        priced from the rare stashing steps alone would read dear (module doc)."""
        now, last = time.perf_counter(), self.last_step
        kind = None if last is None or last[2] is None else (last[2].rows, last[2].k, last[2].mode)
        self.run = self.run + 1 if kind is not None and kind == self.before else 1  # the last step's place in its run
        if last is not None and last[3] is not None and (chained or not self.overlap):
            cycle = (now - last[0]) * 1e3
            if cycle < HOST_PAUSE_MS:
                self.host_all.append(max(0.0, cycle - (waited_ms - last[1])))
                k = last[2].k
                if self.before == kind or not self.overlap:
                    self.cycle_by_kind.setdefault(kind, deque(maxlen=CYCLE_WINDOW)).append(cycle)
                    self.sampled_at[kind] = self.steps
                    self.replay_by_kind[kind] = last[3]
                    self.cycles[k] += 1
                    self.cycle_ms[k] += cycle
                    self.replay_ms[k] += last[3]
                    if self.run <= EARLY_STEPS + self.overlap:  # (under overlap a run's first step is a switch)
                        self.early_cycles[k] += 1
                        self.early_ms[k] += cycle
                elif self.before is not None:  # the first of its kind after another: a switch's cost, apart
                    self.switches[k] += 1
                    self.switch_ms[k] += cycle
        self.before = kind
        self.last_step = (now, waited_ms, None, None)
        self.steps += 1
        if self.steps % 64 == 0:  # a look every 64 steps: a kind's cycles outlive STALE_STEPS by at most that
            self.forget_stale()

    def forget_stale(self, kinds=None, steps: int = STALE_STEPS) -> list[tuple[int, int, str]]:
        """Drop the cycles of the kinds (default: every kind) not sampled within `steps` steps (a kind set without a
        sample counts from the first look) -> the kinds dropped."""
        old = [kind for kind in (list(self.cycle_by_kind) if kinds is None else kinds) if kind in self.cycle_by_kind
               and self.steps - self.sampled_at.setdefault(kind, self.steps) > steps]
        for kind in old:
            del self.cycle_by_kind[kind], self.sampled_at[kind]
        return old

    def step_replayed(self, ms: float | None, key: StepKey) -> None:
        """The step just started is `key` and replayed a graph of `ms` (None: it ran eagerly, nothing to learn
        from)."""
        if self.last_step is not None:
            self.last_step = (*self.last_step[:2], key, ms)

    def flushed(self, ms: float) -> None:
        """A context flush took ms of host time (drafting after plain steps pays it)."""
        self.flush_ms = ms if self.flush_ms is None else self.flush_ms + FLUSH_EMA * (ms - self.flush_ms)

    def step_chain_broken(self) -> None:
        """Something other than a decode step ran (a prefill): the next step's gap is not host time."""
        self.last_step = None
