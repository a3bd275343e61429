"""The model runner: tensors in, one device step, one small tensor out (nano-vllm's model_runner).

A decode step of B live rows runs in a batch-size bucket (1, 2, 4, ... up to max_batch_size) with static device
buffers, keyed by (bucket, k drafts per row, block-table width, sampling mode). The step is device ops only:
    draft k tokens (parallel block + Markov loop) -> target forward over [pending, d1..dk] (record=True) with the
    drafter's context rows -> verify (greedy, or Leviathan / block rejection with per-row parameters and counter-based
    uniforms) -> KDA commit of a + 1 tokens -> packed [a, n, emitted tokens]
so on CUDA each key is one CUDA graph, captured at its first use and replayed after; on CPU the same function runs
eagerly. A captured step ends by posting its packed output to its mailbox (step_buffers.Mailbox): the graph copies
it to pinned memory with a count the host reads, so launching a step is its replay alone and reading a finished one
makes no CUDA call (DSPARK_MAILBOX=direct: the kernel writes it in pinned memory, no copy in the graph;
DSPARK_MAILBOX=0: a queued copy and an event per step instead, as an eager step has). Its first
op completes the inputs of rows that continue a row of the step before (chain_inputs, from that step's output kept
in `carry`), so a step can be queued while the one before is still in flight; a step whose rows all continue the
same rows of the step just launched, in the same buffers and blocks, finds its inputs on the device already and
stages nothing. k = 0 is plain decoding: of the drafter's context it writes only the projection of aux per position
(one launch, dspark/kernels/project_rows.py, where the full context write is some 30 kernels), or nothing where no
row keeps the context (StepKey.context False: the AR engine's step); flush_context turns
the stashed positions into context rows (a captured graph per row for a few rows, one batched forward for more)
before a request drafts again.

Prefill, the context flush and graph capture live in dspark/prefill_runner.py (PrefillRunner, which ModelRunner
builds on).

compile=True (opt-in): the target forward and the drafter's parallel pass inside the step go through torch.compile
(dynamic shapes: batch, tokens and context are symbols; the Triton launches stay graph breaks) before the graph
captures them, which fuses the elementwise chains between the GEMMs and kernels. Sizes 1 and the attention's batch
ranges still specialise, so a server's start compiles about a dozen variants. A compile that fails falls back to the
eager forward, with a warning.

Random numbers: a request's uniforms are a pure function of its seed and position (dspark.spec.sampling
.counter_uniform), so seeded requests give the same tokens whatever batch they run in.
"""
from __future__ import annotations

import functools
import os
import time
import warnings

import torch

from dspark.cache.paged import PagedCache
from dspark.kernels.argmax import argmax
from dspark.kernels.greedy_verify import greedy_step, pack_step
from dspark.models.k3.moe import LatentMoE, set_static_moe
from dspark.prefill_runner import COUNTER_STRIDE, MIN_CONTEXT, PrefillRunner
from dspark.spec.draft import DraftRunner
from dspark.spec.sampling import RowSampling, counter_uniform, process_logits, sample_from
from dspark.spec.verify import choose_verify_lengths_device, verify_sampled
from dspark.step_buffers import (
    INT_COLS,
    NI,
    Launched,
    RowInput,
    StepBuffers,
    StepKey,
    buckets,
    chain_inputs,
    pow2_at_least,
)


def without_grad(fn):
    """torch.no_grad() around fn, entered only where grad is on: entering it costs microseconds, a share of a decode
    step's host time, and the engine's loops (generate, the server's engine thread) already run with grad off."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        if torch.is_grad_enabled():
            with torch.no_grad():
                return fn(*a, **kw)
        return fn(*a, **kw)
    return wrapper


# how a captured step hands its output to the host (step_buffers.Mailbox): "1" (default) a mailbox the graph copies
# to pinned memory, "direct" one the publish kernel writes in pinned memory itself, "0" a queued copy and an event
MAILBOXES = {"1": "copy", "direct": "direct", "0": None}
if os.environ.get("DSPARK_MAILBOX", "1") not in MAILBOXES:
    raise ValueError(f"DSPARK_MAILBOX={os.environ['DSPARK_MAILBOX']!r}: expected one of {', '.join(MAILBOXES)}")
MAILBOX = MAILBOXES[os.environ.get("DSPARK_MAILBOX", "1")]
TIME_EVERY = 8  # launches per graph replay timed on the device (events around it: host time on every step)
MODES = ("greedy", "sample", "filter")  # filter: sampled with per-row top-k / top-p (sorts the vocabulary)


def pinned_rows(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous [rows, cols] view at the start of the pinned buffer buf. A copy from the device into it is one
    asynchronous memcpy; into a strided view (buf[:rows, :cols] when cols < buf's width) torch stages the data and
    waits for the device, so the step would no longer overlap the host's work."""
    return buf.view(-1)[: rows * cols].view(rows, cols)


def _dense(x: torch.Tensor, own: bool) -> torch.Tensor:
    """x contiguous; own: in memory of its own, strides set by its shape alone (a view of one row is contiguous too,
    with its parent's strides)."""
    return x.clone(memory_format=torch.contiguous_format) if own else x.contiguous()


class ModelRunner(PrefillRunner):
    def __init__(self, target, drafts: DraftRunner | None, cache: PagedCache, max_batch_size: int, max_k: int,
                 rejection: str = "standard", draft_sample: bool = False, adaptive: bool = False,
                 graphs: bool | None = None, compile: bool = False):
        super().__init__(target, drafts, cache, graphs)
        self.compiled = False
        # the step's compiled target forward (None: self.forward). Not a stored bound method when uncompiled: that
        # would put the runner in a reference cycle, and a dead engine's graphs would wait for the garbage collector
        self._compiled_forward = None
        if compile:
            self._compile()
        self.buckets = buckets(max_batch_size)
        self.rejection, self.draft_sample, self.adaptive = rejection, draft_sample, adaptive
        self.steps: dict[StepKey, StepBuffers] = {}
        self.mailbox = MAILBOX if self.graphs else None  # captured steps post their output (step_buffers.Mailbox)
        # key_for's last key per rows, k, mode, context
        self._keys: dict[tuple[int, int, str, bool], tuple[int, int, StepKey]] = {}
        # MoE forwards up to the largest step's size take the gathered, graph-safe expert path; the setting lives on
        # the model, so an engine never lowers what another engine on the same target needs
        moes = [m for m in target.modules() if isinstance(m, LatentMoE)]
        set_static_moe(target, max([max_batch_size * (max_k + 1)] + [m.static_tokens for m in moes]))
        self.max_k = max_k
        # the last step's output [a, n, t_0 .. t_k], which the next step's chain_inputs read (outside the graphs'
        # memory pool: a prefill's replay may reuse that memory in between)
        self.carry = torch.zeros(self.buckets[-1], max_k + 3, dtype=torch.long, device=self.device)
        # (pinned buffer, copy-done event) for the host's copies of two eager steps' outputs (CUDA), in turns
        self._outs: list[tuple | None] = [None, None]
        self._timer: tuple | None = None  # the events around a timed replay (one step in TIME_EVERY: read before reuse)
        self._flip = 0
        self._launches = 0  # graph replays are timed on the device every TIME_EVERY launches
        self._last: StepBuffers | None = None  # the buffers of the last launched step
        self.inputs_kept = 0  # launches whose inputs were already on the device (no staging, no copy)
        # host seconds spent waiting for the device: in decode steps' reads, and before refilling a step's staging
        self.wait_s, self.launch_wait_s = 0.0, 0.0

    # ------------------------------------------------------------------ compile
    def _compile(self) -> None:
        dyn = torch._dynamo.config  # room for the variants (module doc) beside other compiled code
        for name, n in (("recompile_limit", 64), ("cache_size_limit", 64), ("accumulated_recompile_limit", 1024),
                        ("accumulated_cache_size_limit", 1024)):
            if hasattr(dyn, name):
                setattr(dyn, name, max(getattr(dyn, name), n))
        self._compiled_forward = torch.compile(self.forward, dynamic=True)
        if self.drafts is not None:
            self.drafts.compile()
        self.compiled = True

    def _uncompile(self, err: Exception) -> None:
        warnings.warn(f"torch.compile failed in the decode step ({type(err).__name__}: {err}); running it eagerly",
                      RuntimeWarning, stacklevel=3)
        self._compiled_forward, self.compiled = None, False
        if self.drafts is not None:
            self.drafts.uncompile()

    @torch.no_grad()  # the cache is written in place: under autograd it would keep every forward's graph alive
    def _run(self, st: StepBuffers) -> torch.Tensor:
        """The step function; a compiled one that raises is retried eagerly (and compilation is turned off)."""
        try:
            return self._step_fn(st)
        except Exception as err:  # noqa: BLE001 - dynamo / inductor errors have no common base across versions
            if not self.compiled:
                raise
            self._uncompile(err)
            st.ints.copy_(st.ints_host)  # as launched: chain_inputs changed it in place
            return self._step_fn(st)

    # ------------------------------------------------------------------ the step (device ops only)
    def _step_fn(self, st: StepBuffers) -> torch.Tensor:
        """chain_inputs, the step, and its output kept in `carry` for the next step."""
        chain_inputs(st.ints, self.carry)
        out = self._step_body(st)
        if st.mailbox is None:
            self.carry[:out.shape[0], :out.shape[1]].copy_(out)
        else:  # a captured step: kept in carry and posted for the host in one kernel (then its copies)
            st.mailbox.post(out, self.carry)
        return out

    def _step_body(self, st: StepBuffers) -> torch.Tensor:
        key, ints, k = st.key, st.ints, st.key.k
        forward = self._compiled_forward or self.forward
        # columns as contiguous vectors: the Triton kernels (KDA step, Markov loop) index them as dense arrays. A
        # compiled forward gets the columns and the table as tensors of their own: torch.compile guards on strides,
        # and a slice of the int buffer has a row stride that varies with the width (a recompile per context bucket)
        own = self._compiled_forward is not None
        pending, num_cached, num_new, slots = (_dense(ints[:, INT_COLS[c]], own)
                                               for c in ("pending", "num_cached", "num_new", "slot"))
        table = _dense(ints[:, NI:], own) if own else ints[:, NI:]
        view = self.cache.device_view(num_cached, num_new, table, slots, k + 1, k > 0)
        if own:
            view.mark_width_dynamic()
        sampling = None
        if key.mode != "greedy":
            filt = key.mode == "filter"
            sampling = RowSampling(st.floats[:, 0], ints[:, INT_COLS["top_k"]] if filt else 0,
                                   st.floats[:, 1] if filt else 1.0)
        # a step's uniforms: [next token | k draft samples | k acceptances]; the next token's comes first, so a row
        # that verifies no drafts draws exactly what a plain (k = 0) step draws. (A drafter with a Markov head draws
        # its drafts from counters of their own: dspark.spec.draft.markov_drafts.)
        seed = None if sampling is None else _dense(ints[:, INT_COLS["seed"]], own)
        u = None if sampling is None else counter_uniform(seed, num_cached * COUNTER_STRIDE, 2 * k + 1)
        if k == 0:  # the drafter's context stashed, or (no row keeps it) the AR engine's forward
            logits = forward(pending[:, None], view, True, key.context)  # [B, 1, V]
            if sampling is None:  # [0, n, t_0]; n = num_new - 1 = 0
                return greedy_step(pending[:, None][:, :0], argmax(logits), num_new, minus=1)
            nxt = sample_from(process_logits(logits[:, 0], sampling.temperature, sampling.top_k, sampling.top_p),
                              u[:, 0])
            return greedy_step(pending[:, None][:, :0], nxt[:, None], num_new, minus=1)  # [0, 0, t_0]
        prop = self.drafts.propose(view, pending, k, sampling if self.draft_sample else None,
                                   None if u is None else u[:, 1:k + 1], seed=seed, confidence=self.adaptive)
        # drafts the host lets each row verify: num_new - 1 (a greedy step's kernel takes the 1 off itself)
        n, minus = (num_new, 1) if sampling is None and not self.adaptive else (num_new - 1, 0)
        if self.adaptive:
            n = torch.minimum(n, choose_verify_lengths_device(prop.confidence))
        drafts = prop.draft_ids
        logits = forward(prop.verify_tokens(pending), view)  # [B, k+1, V]
        if sampling is None:
            out = greedy_step(drafts, argmax(logits), n, minus)  # [B, k+3] = [a, n, t_0 .. t_k]
            view.commit_accepted(out[:, 0])
            return out
        a, nxt = verify_sampled(drafts, prop.draft_probs, logits, sampling, n, torch.cat([u[:, k + 1:], u[:, :1]], 1),
                                self.rejection)
        view.commit_accepted(a)
        return pack_step(drafts, a, nxt, n)

    # ------------------------------------------------------------------ host side
    def key_for(self, num_rows: int, k: int, max_len: int, mode: str, context: bool = True) -> StepKey:
        """The step key of num_rows rows whose longest sees max_len positions (cached + k + 1); context=False: a
        plain step that stashes no drafter context (no row keeps it). Each (rows, k, mode, context) keeps its last
        key and the range of max_len it covers: a step at a time, the key rarely changes."""
        context = context or k > 0 or self.drafts is None
        hit = self._keys.get((num_rows, k, mode, context))
        if hit is not None and hit[0] < max_len <= hit[1]:
            return hit[2]
        rows = next((b for b in self.buckets if b >= num_rows), None)
        if rows is None:
            raise ValueError(f"decode: {num_rows} rows exceed max_batch_size={self.buckets[-1]}")
        bs = self.cache.block_size
        if self.graphs:  # few context buckets: each is a graph to capture
            least = max(MIN_CONTEXT, bs)
            hi = pow2_at_least(max_len, least)
            lo = hi // 2 if hi > least else 0
        else:
            hi = -(-max_len // bs) * bs
            lo = hi - bs
        key = StepKey(rows, k, -(-hi // bs), mode, context)
        self._keys[(num_rows, k, mode, context)] = (lo, hi, key)
        return key

    def _get(self, key: StepKey) -> StepBuffers:
        st = self.steps.get(key)
        if st is None:
            st = self.steps[key] = StepBuffers(key, self.device, mailbox=self.mailbox)
            st.ints_np[:] = self._pad_row(key.width)
            st.floats_np[:] = (0.0, 1.0)
            if self.graphs:
                self._capture(st)
        return st

    def _pad_row(self, width: int) -> list[int]:
        """A padding row's ints: one valid token at position 0, writes to the scratch block and slot only."""
        return [0, 0, 1, self.cache.scratch_slot, 0, 0, 1, -1] + [self.cache.scratch_block] * width

    @torch.no_grad()
    def _capture(self, st: StepBuffers, warmup: int = 2, timed: int = 3) -> None:
        carry = self.carry.clone()  # a step may be in flight: the next one reads its output, which these runs overwrite
        st.ints.copy_(st.ints_host)  # padding rows only
        st.floats.copy_(st.floats_host)
        try:
            self._run(st)  # a compiled step that fails falls back to eager here, before the capture
            st.out = self._capture_fn(lambda: self._step_fn(st), st, warmup - 1)
        except Exception as err:  # noqa: BLE001 - the CUDA runtime's refusals have no common type
            if st.mailbox is None:
                raise
            warnings.warn(f"decode step graph {st.key} failed to run or capture with its mailbox "
                          f"({type(err).__name__}: {err}); captured steps copy their output and record an event "
                          "instead", RuntimeWarning, stacklevel=3)
            self.mailbox, st.mailbox = None, None
            self._run(st)
            st.out = self._capture_fn(lambda: self._step_fn(st), st, warmup - 1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(timed):
            start.record()
            st.graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        st.ms = best
        if st.mailbox is not None:
            st.mailbox.sync()  # the runs above posted too
        self.carry.copy_(carry)

    def step_ms(self, key: StepKey) -> float | None:
        """The replay time of a key's graph (captured now if needed); None without graphs."""
        return self._get(key).ms if self.graphs else None

    @without_grad
    def launch(self, rows: list[RowInput], tables: list[list[int]], num_cached: list[int], slots: list[int],
               key: StepKey) -> Launched:
        """Queue one step for the live rows (tables: each row's blocks, padded here with the scratch block to
        key.width); on CPU it runs now. Rows with a src continue that row of the step launched before this one
        (chain_inputs), which may still be in flight. read() returns its result."""
        st = self._get(key)
        chained = all(r.src == b for b, r in enumerate(rows))  # each row continues the same row of the last step
        if self._continues(st, rows, tables, chained):
            self.inputs_kept += 1
        else:
            self._stage(st, rows, tables, num_cached, slots, chained)
        self._last = st
        B = len(rows)
        if not self.cuda:
            return Launched(self._run(st), None, B, st.ms)
        self._launches += 1
        if st.graph is not None:
            timing = self._timing() if self._launches % TIME_EVERY == 0 else None
            if timing is not None:
                timing[0].record()
            st.graph.replay()
            if timing is not None:
                timing[1].record()
            if st.mailbox is not None:  # the graph posted its output (step_buffers.Mailbox)
                host, want = st.mailbox.replayed()
                return Launched(host, None, B, st.ms, timing, mailbox=st.mailbox, want=want)
            out = st.out
        else:
            out, timing = self._run(st), None
        # else the output's copy for the host goes to one of two pinned buffers (a step's read while the next one's
        # fills), and an event says when it is there
        self._flip ^= 1
        if self._outs[self._flip] is None:
            self._outs[self._flip] = (torch.empty(self.buckets[-1] * (self.max_k + 3), dtype=torch.long,
                                                  pin_memory=True), torch.cuda.Event())
        buf, done = self._outs[self._flip]
        host = st.hosts[self._flip]
        if host is None:  # the whole bucket's rows [rows, k + 3]: one copy into a view made once
            host = st.hosts[self._flip] = pinned_rows(buf, *out.shape)
        host.copy_(out, non_blocking=True)
        done.record()
        return Launched(host, done, B, st.ms, timing)

    def _timing(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        if self._timer is None:
            self._timer = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        return self._timer

    def _continues(self, st: StepBuffers, rows: list[RowInput], tables: list[list[int]], chained: bool) -> bool:
        """Whether the step's device inputs are already in place: it runs the buffers of the step launched just
        before it, each row continuing the same row of that step (chained; chain_inputs completes them on the
        device), as staged, with the same blocks. An eager compiled step is left out: its retry restores the staged
        inputs."""
        return (chained and st is self._last and st.chained and st.live == len(rows) and st.tables == tables
                and (st.graph is not None or not self.compiled))

    def _stage(self, st: StepBuffers, rows: list[RowInput], tables: list[list[int]], num_cached: list[int],
               slots: list[int], chained: bool) -> None:
        """The rows' host values into st's staging buffers, and their copy to the device queued."""
        B, W, ints, flo = len(rows), st.key.width, st.ints_np, st.floats_np
        if st.staged is not None:  # the last copy out of this staging buffer has run (with a step in flight it may not)
            t0 = time.perf_counter()
            st.staged.synchronize()
            self.launch_wait_s += time.perf_counter() - t0
        # whole-array numpy writes: a per-row loop of small writes costs milliseconds of host time at 512 rows
        ints[:B, :NI] = [(r.pending, c, r.num_drafts + 1, s, r.seed, r.top_k, r.room, r.src)
                         for r, c, s in zip(rows, num_cached, slots)]
        ints[:B, NI:] = self.cache.scratch_block
        for b, t in enumerate(tables):
            n = min(len(t), W)
            ints[b, NI:NI + n] = t[:n]
        flo[:B] = [(r.temperature, r.top_p) for r in rows]
        if st.live > B:  # rows the last step used and this one does not: back to padding
            ints[B:st.live] = self._pad_row(W)
            flo[B:st.live] = (0.0, 1.0)
        st.live, st.tables = B, tables
        st.chained = chained
        st.ints.copy_(st.ints_host, non_blocking=True)
        st.floats.copy_(st.floats_host, non_blocking=True)
        if self.cuda:
            st.staged = st.staged or torch.cuda.Event()
            st.staged.record()

    def read(self, step: Launched) -> list[list[int]]:
        """Wait for a launched step -> per row [a, n, t_0 .. t_k]: a accepted drafts, n verified, then the emitted
        tokens (a drafts and the next token; -1 after). Sets step.device_ms for a replayed graph."""
        t0 = time.perf_counter()
        if step.done is not None:
            step.done.synchronize()
        elif step.mailbox is not None:
            step.mailbox.wait(step.want)
        self.wait_s += time.perf_counter() - t0
        if step.timing is not None:
            step.timing[1].synchronize()  # recorded after the graph's last copy: at most a moment later
            step.device_ms = step.timing[0].elapsed_time(step.timing[1])
        host = step.host if step.live == step.host.shape[0] else step.host[:step.live]
        return host.tolist()
