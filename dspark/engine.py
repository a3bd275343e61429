"""The one decoding loop of the project: admit -> prefill (chunked) -> draft -> verify -> commit or roll back.

    engine = Engine(target, drafter)     # drafter=None: plain autoregressive decoding
    outs = engine.generate(["def add(a, b):"], SamplingParams(max_tokens=64))

Its scheduler (dspark/scheduler.py) admits requests (FCFS under a block budget, continuous batching), keeps their
tokens and stop conditions; the engine prefills them in chunks and hands every decode step to the model runner
(dspark/runner.py), which runs the whole speculative step on the device (a CUDA graph per batch bucket on a GPU) and
returns one small tensor.
Each running request has its committed tokens in the target cache except the last emitted one (the "pending"
token); a step verifies [pending, d1..dk] and commits pending + the accepted drafts.

Drafts per step: `num_speculative_tokens=None` lets the k policy (dspark/policy.py) pick k each step, 0 .. the
drafter's block, by expected emitted tokens per millisecond (measured acceptance against what each kind of step took
start to start, or its replay time and the host's measured work where that kind has not run often enough); on CPU
(no graphs) it drafts the whole block. An int pins k.
Under the policy a sampled request with a seed decodes plainly (its text is then the AR engine's for that seed); with
a pinned k it drafts like the others. Such a request keeps no drafter context, nor does a sampled one admitted while
plain decoding is the sampled rows' choice (KPolicy.context_for): it never drafts, its prefill is the target's alone
(its prompt blocks are cached apart: scheduler.NO_CONTEXT_SALT), and a plain step none of whose rows keeps the
context is the AR engine's step (no stash).

Overlap (on by default with graphs): step() leaves the decode step it launches in flight, and the next call queues
the following step before it reads that one, so the host's work (reading, stop handling, scheduling, a server's
delivery) runs while the device computes. The device completes the queued step's inputs from the one in flight
(runner.chain_inputs: each continuing row's pending token, length and room), so nothing waits for the host; the
host learns the step's result one call later. A row that certainly finishes in flight (no room after it) sits the
next step out; one that stops on EOS or a stop string costs that step a row whose output is dropped. Drafting
after plain steps first turns their stashed context rows into the drafter's (flush_context); after a plain step in
flight that flush is queued behind it too, covering the position it stashes (a plain step emits exactly one token a
row), so a switch to drafting waits for nothing either. A prefill's first tokens, sampled on the device, are read
before the step's decode step is queued, their requests in it; with dspark.policy.FIRST_TOKENS_AFTER_LAUNCH = 1,
after the decode step of the other rows is queued (the device runs on while the host waits), with 2 at the start of
the next call (the host does not wait for the prefill at all); their requests then join the next decode step.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.profiler import record_function
from tqdm.auto import tqdm

from dspark import policy as policy_constants
from dspark.cache.blocks import OutOfBlocks
from dspark.cache.paged import PagedCache
from dspark.cache.prefix import PrefixCacheConfig
from dspark.device import host_copy, queued_copy
from dspark.kernels.argmax import argmax
from dspark.policy import GROUPS, KPolicy, counts_above
from dspark.request import Request, RequestOutput, SamplingParams, Status
from dspark.runner import Launched, ModelRunner, RowInput, without_grad
from dspark.scheduler import Scheduler
from dspark.spec.draft import DraftRunner
from dspark.spec.sampling import RowSampling
from dspark.step_buffers import StepKey


def traced(name: str):
    """A named range for the profiler's trace (bench/step_timeline.py, serve --profile-dir); nothing when no
    profiler runs (a range costs a few microseconds of host time per step even then)."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


PREFILL_ALIGN = 64  # on CUDA an eager prefill's width is a multiple of this: few shapes (graphed ones are powers of 2)
ALLOC_BLOCKS = 4  # a decode step that needs a block takes this many at once: its rows' block tables change (and the
# runner stages them to the device again) every this many blocks, not every block


def sampling_mode(params: list[SamplingParams]) -> str:
    """The runner's sampling mode for these rows: greedy (all greedy), sample, or filter (a sampled row uses top-k or
    top-p: the vocabulary gets sorted)."""
    sampled = [p for p in params if p.temperature > 0]
    if not sampled:
        return "greedy"
    return "filter" if any(p.top_k or p.top_p < 1 for p in sampled) else "sample"


@dataclass
class FirstTokens:
    """The first tokens of the requests whose prefill just ended."""
    rows: list[Request]
    tokens: torch.Tensor  # [n]: a queued copy on the host, there once `done` fired; done None: read as it is
    done: torch.cuda.Event | None


@dataclass
class InFlight:
    """A launched decode step: its rows (requests, in order), the drafts it verifies, the runner's handle."""
    reqs: list[Request]
    k: int
    step: Launched


class Engine:
    def __init__(self, target, drafter=None, num_speculative_tokens: int | None = None, tokenizer=None,
                 max_batch_size: int = 32, max_model_len: int | None = None, num_blocks: int | None = None,
                 block_size: int = 16, prefill_chunk: int = 512, adaptive_verification: bool = False,
                 draft_sample: bool = True, draft_top_k: int = 0, rejection: str = "standard",
                 prefix_caching: bool | PrefixCacheConfig = False, graphs: bool | None = None,
                 compile: bool = False, overlap: bool | None = None):
        self.target, self.drafter = target, drafter
        self.tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
        self.device = next(target.parameters()).device
        self.max_model_len = max_model_len or target.config.max_position_embeddings
        self.max_batch_size, self.block_size, self.prefill_chunk = max_batch_size, block_size, prefill_chunk
        self.prefill_align = PREFILL_ALIGN if self.device.type == "cuda" else 1
        self.k, self.pinned_k = 0, 0  # k: the most drafts a step may verify (what requests reserve room for)
        if drafter is not None:
            self.k = drafter.config.num_drafts
            self.pinned_k = num_speculative_tokens
            if num_speculative_tokens is not None and not 1 <= num_speculative_tokens <= self.k:
                raise ValueError(f"num_speculative_tokens: expected 1..{self.k} for this drafter "
                                 f"(block_size={drafter.config.block_size}, mode={drafter.config.mode}), "
                                 f"got {num_speculative_tokens}")
            self.k = num_speculative_tokens or self.k
            if adaptive_verification and drafter.confidence_head is None:
                raise ValueError("adaptive_verification needs a drafter with a confidence head")
        if rejection not in ("standard", "block"):
            raise ValueError(f"rejection: expected 'standard' or 'block', got {rejection!r}")
        if num_blocks is None:  # default budget: every batch slot can hold min(max_model_len, 2048) tokens
            num_blocks = max_batch_size * math.ceil((min(self.max_model_len, 2048) + self.k + 1) / block_size)
        attn, kda = target.cache_layout()
        self.drafts = None
        if drafter is not None:  # the drafter's context rows live in the same blocks (shared prefix caching)
            self.drafts = DraftRunner(drafter, layer_offset=1 + max(list(attn) + list(kda)), draft_top_k=draft_top_k)
            attn = {**attn, **self.drafts.cache_layout()}
        dtype = next(target.parameters()).dtype
        self.prefix_caching = prefix_caching
        self.cache = PagedCache(attn, kda, num_blocks, block_size, max_batch_size, dtype=dtype, device=self.device,
                                prefix_cache=PrefixCacheConfig() if prefix_caching is True else prefix_caching or None)
        self.runner = ModelRunner(target, self.drafts, self.cache, max_batch_size, self.k, rejection, draft_sample,
                                  adaptive_verification, graphs, compile)
        self.step_requests: list[Request] = []  # the rows of the last launched device step, in order
        # overlap (default: with graphs): a decode step stays in flight when step() returns, and the next step is
        # queued before this one is read whenever its inputs can be completed on the device (module doc)
        self.overlap = self.runner.graphs if overlap is None else overlap
        self.policy = KPolicy(self.runner, self.k, self.pinned_k is not None, self.overlap)
        self.in_flight: InFlight | None = None
        self._resolved: list[tuple[Request, list[int]]] = []  # tokens read outside step(), returned by the next one
        self._next_call: FirstTokens | None = None  # a prefill's first tokens the next step() reads first
        self.slowest_captures: list[tuple[float, StepKey]] = []  # warmup's 8 longest step captures: (seconds, key)
        self.counters = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                         "num_accepted_tokens_per_pos": [0] * max(self.k, 1), "prompt_tokens": 0,
                         "generation_tokens": 0, "target_forwards": 0,
                         "decode_steps_per_k": [0] * (self.k + 1),  # device steps by the drafts they verified
                         "tokens_per_k": [0] * (self.k + 1),  # tokens those steps committed (accepted drafts + 1)
                         "overlapped_steps": 0,  # decode steps queued while the one before was still in flight
                         # drafting after plain steps: the flushes of their stashed context rows, their host
                         # seconds, and of them the ones queued behind a plain step in flight
                         "context_flushes": 0, "context_flush_s": 0.0, "context_flushes_queued": 0,
                         # graph steps by k: how many were timed on the device (events around every 8th replay) and
                         # their time there (ms), against the replay time measured at capture that the policy uses
                         "device_steps_per_k": [0] * (self.k + 1), "device_ms_per_k": [0.0] * (self.k + 1),
                         "step_s": 0.0,  # host seconds inside step() (its waits for the device included)
                         # over the requests that emitted their first token: added -> admitted (queue) and
                         # admitted -> first token (prefill), seconds; their sum is the time to first token
                         "first_tokens": 0, "queue_s": 0.0, "prefill_s": 0.0}
        eos = getattr(target.config, "eos_token_id", None)
        self.scheduler = Scheduler(self.cache, max_batch_size, self.max_model_len, self.k + 1,
                                   eos if isinstance(eos, int) else None, self.counters)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: a string prompt needs a tokenizer (pass token ids or tokenizer=...)")
            ids, text = self.tokenizer.encode(prompt, add_special_tokens=False), prompt
        else:
            ids, text = list(prompt), None
        req = Request(ids, params, request_id, text, self.tokenizer)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone): frees its cache at once."""
        self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or self.in_flight or self._resolved or self._next_call)

    # ------------------------------------------------------------------ the step
    @without_grad
    def step(self) -> list[tuple[Request, list[int]]]:
        """One scheduler step. Returns (request, newly emitted token ids) for every request that emitted. With
        overlap, the decode step it launches is read by the next call (its tokens come back then)."""
        t0 = time.perf_counter()
        sched = self.scheduler
        sched.admit(self._keeps_context)
        emitted, self._resolved = self._resolved, []
        first, when = None, policy_constants.FIRST_TOKENS_AFTER_LAUNCH
        try:
            emitted += self._emit_next_call()
            prefill = [r for r in sched.running if r.status is Status.PREFILL]
            if prefill:  # a step in flight runs on: the prefill's rows are others'
                self.policy.step_chain_broken()
                with traced("engine.prefill"):
                    first = self._prefill(prefill, queued=when != 0)
                if first is not None and when != 1:
                    if when == 0:  # now: their requests decode in this call's step
                        emitted += self._emit_first(first)
                    else:  # the next call's (when == 2)
                        self._next_call = first
                    first = None
            flight, launched = self.in_flight, None
            if flight is not None:
                launched = self._launch_chained(flight, [r for r in sched.running if r.status is Status.DECODE])
                self.in_flight = None
                emitted = self._read(flight) + emitted
            if launched is None:
                launched = self._launch_decoding()
            if first is not None:  # read once this call's decode step is queued: the device runs on meanwhile
                emitted += self._emit_first(first)
                if launched is None:  # no other row decodes: theirs is the step
                    launched = self._launch_decoding()
            if launched is not None and not self.overlap:
                emitted += self._read(launched)
            else:
                self.in_flight = launched
        except Exception:
            self.in_flight, self._next_call = None, None
            for r in list(sched.running):  # never leave a half-updated request holding cache
                sched.finish(r, "error")
            raise
        finally:
            self.counters["step_s"] += time.perf_counter() - t0
        return emitted

    def _launch_decoding(self) -> InFlight | None:
        """A step of every decoding request (None: there is none)."""
        decode = [r for r in self.scheduler.running if r.status is Status.DECODE]
        return self._launch(decode, self._choose_k(decode)) if decode else None

    def _chunk_end(self, r: Request) -> int:
        """Prefill up to the chunk size, stopping at the next prefix-cache checkpoint position."""
        end = min(len(r.prompt_ids), r.num_computed + self.prefill_chunk)
        stops = [p for p in self.cache.checkpoint_positions(r.id, len(r.prompt_ids)) if r.num_computed < p < end]
        return min(stops, default=end)

    def _prefill(self, reqs: list[Request], queued: bool = False) -> FirstTokens | None:
        """Every prefilling request's next chunk through the runner (on CUDA a graph per request for a few of them,
        else batched eager forwards); the requests whose prompt is done sample their first token on the device
        (queued: its copy for the host queued, to be read after more work is queued; _emit_first reads it)."""
        chunks = [r.prompt_ids[r.num_computed: self._chunk_end(r)] for r in reqs]
        rids, lens = [r.id for r in reqs], [len(c) for c in chunks]
        num_cached, tables, slots = self.cache.step_rows(rids, lens)
        self.counters["target_forwards"] += 1
        last = self.runner.prefill(chunks, num_cached, tables, slots, self.prefill_align,
                                   [r.context for r in reqs])  # [n, V]
        self.cache.advance(rids, lens, prefill=True)
        done = []
        for b, (r, chunk) in enumerate(zip(reqs, chunks)):
            r.num_computed += len(chunk)
            r.num_context = r.num_computed
            self.cache.after_prefill(r.id, r.prompt_ids, r.num_computed)
            if r.num_computed == len(r.prompt_ids):
                done.append(b)
        if not done:
            return None
        rows = [reqs[b] for b in done]
        last = last[done] if len(done) < len(reqs) else last
        tokens = self._first_tokens(rows, last)  # [n] on the device
        return FirstTokens(rows, *(host_copy(tokens) if queued else (tokens, None)))

    def _emit_next_call(self) -> list[tuple[Request, list[int]]]:
        """The first tokens a prefill in the last call left to this one (FIRST_TOKENS_AFTER_LAUNCH = 2), emitted."""
        first, self._next_call = self._next_call, None
        return [] if first is None else self._emit_first(first)

    def _emit_first(self, first: FirstTokens) -> list[tuple[Request, list[int]]]:
        """Wait for the prefill's first tokens and emit them (their requests then decode; one aborted meanwhile
        emits nothing)."""
        if first.done is not None:
            first.done.synchronize()
        emitted, now, c = [], time.perf_counter(), self.counters
        for r, tok in zip(first.rows, first.tokens.tolist()):
            if r.status is Status.FINISHED:
                continue
            c["prompt_tokens"] += len(r.prompt_ids)
            c["first_tokens"] += 1
            c["queue_s"] += r.admitted - r.arrival
            c["prefill_s"] += now - r.admitted
            r.status = Status.DECODE
            emitted.append((r, self.scheduler.emit(r, [tok])))
        return emitted

    def _first_tokens(self, rows: list[Request], last: torch.Tensor) -> torch.Tensor:
        """The token after each row's prompt from its last logits [n, V] -> [n]: the argmax when every row is
        greedy (what sampling gives a greedy row, without its per-row tensors and kernels: the prefill's host time
        is part of the time to first token), else sampled on the device, the rows' parameters in two queued copies
        (the sampling's launches queue behind the prefill, not after it)."""
        ps = [r.params for r in rows]
        mode = sampling_mode(ps)
        if mode == "greedy":
            return argmax(last)
        floats = queued_copy(torch.tensor([[p.temperature for p in ps], [p.top_p for p in ps]], dtype=torch.float32),
                             self.device)
        ints = queued_copy(torch.tensor([[p.top_k for p in ps], [r.seed for r in rows],
                                         [len(r.prompt_ids) for r in rows]], dtype=torch.long), self.device)
        filt = mode == "filter"  # else no sort over the vocabulary
        sampling = RowSampling(floats[0], ints[0] if filt else 0, floats[1] if filt else 1.0)
        return self.runner.sample_first(last, sampling, ints[1], ints[2])

    def _choose_k(self, reqs: list[Request], ahead: int = 0) -> int:
        """The step's drafts: the policy's (module doc), or 0 when no row keeps the drafter's context. ahead: tokens
        the step in flight may still add to each row."""
        drafting = sum(r.context for r in reqs)
        if not drafting:
            return 0
        return self.policy.choose(len(reqs), max(r.num_computed for r in reqs) + ahead,
                                  sampling_mode([r.params for r in reqs]), drafting)

    def _keeps_context(self, req: Request) -> bool:
        """Whether a request being admitted keeps the drafter's context (and may draft): not a seeded sampled one
        under the policy (it decodes plainly: module doc), nor, under the policy, a sampled one while drafting does
        not pay for sampled rows (KPolicy.context_for). Without it its prefill writes no drafter context rows and its
        plain steps are the AR engine's."""
        p = req.params
        if self.drafts is None:
            return True
        if self.pinned_k is None and p.seed is not None and p.temperature > 0:
            return False
        return self.policy.context_for(p.temperature > 0, len(self.scheduler.running))

    def _launch_chained(self, flight: InFlight, decode: list[Request]) -> InFlight | None:
        """The next step queued before `flight` is read, its rows continuing flight's on the device, when its
        inputs do not need the host to know flight's result. The rows that certainly finish in flight (no room
        after it) sit it out. Not launched (None) when each row left may finish in flight (its room is within what
        flight may emit: a step wasted on a finished request costs more than waiting for the read). Drafting after
        a plain flight first flushes the stashed context rows, the position flight stashes included."""
        if not self.overlap:
            return None
        rows = {id(r): b for b, r in enumerate(flight.reqs)}
        room = {id(r): r.params.max_tokens - len(r.output_ids) for r in decode}
        reqs = [r for r in decode if id(r) not in rows or room[id(r)] > 1]
        if all(id(r) in rows and room[id(r)] <= flight.k + 1 for r in reqs):
            return None
        k = self._choose_k(reqs, flight.k + 1)
        if k > 0 and flight.k == 0:
            self._flush_context(reqs, {id(r) for r in reqs if id(r) in rows})
        return self._launch(reqs, k, flight, [rows.get(id(r), -1) for r in reqs])

    def _launch(self, reqs: list[Request], k: int, chain: InFlight | None = None, src: list[int] | None = None
                ) -> InFlight:
        """Queue one device step for these rows (the runner's graph for their batch bucket). chain: the step in
        flight, src: each row's row in it (-1: none); such rows may grow by up to chain.k + 1 tokens before this
        step starts."""
        with traced("engine.launch"):
            return self._queue_step(reqs, k, chain, src)

    def _queue_step(self, reqs: list[Request], k: int, chain: InFlight | None, src: list[int] | None) -> InFlight:
        if k > 0 and chain is None:
            self._flush_context(reqs)
        self.policy.step_started(1e3 * (self.runner.wait_s + self.runner.launch_wait_s), chain is not None)
        ps = [r.params for r in reqs]
        mode = sampling_mode(ps)
        src = src or [-1] * len(reqs)
        ahead = [0 if s < 0 else chain.k + 1 for s in src]
        rids = [r.id for r in reqs]
        # room for this step after what the step in flight may add (whole chunks of ALLOC_BLOCKS blocks), within each
        # request's reservation
        held = self.scheduler.reserved  # request id -> the blocks it reserved at admission
        chunk = ALLOC_BLOCKS * self.block_size
        counts = []
        for r, a in zip(reqs, ahead):
            n = self.cache.num_tokens(r.id)
            counts.append(min(-(-(n + a + k + 1) // chunk) * chunk, held[r.id] * self.block_size) - n)
        num_cached, tables, slots = self.cache.step_rows(rids, counts)
        key = self.runner.key_for(len(reqs), k, max(c + a for c, a in zip(num_cached, ahead)) + k + 1, mode,
                                  k > 0 or any(r.context for r in reqs))
        rows = []
        for r, p, s in zip(reqs, ps, src):
            room = p.max_tokens - len(r.output_ids)
            rows.append(RowInput(r.last_token, max(0, min(k, room - 1)) if r.context else 0, r.seed, p.temperature,
                                 p.top_k, p.top_p, room, s))
        self.counters["target_forwards"] += 1
        self.counters["decode_steps_per_k"][k] += 1
        self.counters["overlapped_steps"] += chain is not None
        self.step_requests = reqs
        launched = self.runner.launch(rows, tables, num_cached, slots, key)
        self.policy.step_replayed(launched.ms, key)
        return InFlight(reqs, k, launched)

    def _read(self, flight: InFlight) -> list[tuple[Request, list[int]]]:
        """Wait for a launched step and commit its result: each row's accepted drafts and next token (rows whose
        request finished meanwhile, by a stop or an abort, are dropped)."""
        with traced("engine.read"):
            outs = self.runner.read(flight.step)
        if flight.step.device_ms is not None:
            self.counters["device_steps_per_k"][flight.k] += 1
            self.counters["device_ms_per_k"][flight.k] += flight.step.device_ms
        live = [(r, o) for r, o in zip(flight.reqs, outs) if r.status is not Status.FINISHED]
        self.cache.advance([r.id for r, _ in live], [o[0] + 1 for _, o in live])
        emitted, committed = [], 0
        per_step = self.drafts is not None  # the rows' per-step draft counts (a plain step verifies none: no stats)
        drafted = per_step and flight.k > 0
        verified = ([], []), ([], [])  # per group (GROUPS): the drafts each row verified, and the accepted ones
        for r, o in live:
            a, n = o[0], o[1]
            committed += a + 1
            r.num_computed += a + 1
            r.num_steps += 1
            if per_step:
                r.accepted_per_step.append(a)
                r.num_drafts_per_step.append(n)
            if drafted:
                r.num_context = r.num_computed
                if n:
                    ns, accs = verified[r.params.temperature > 0]
                    ns.append(n)
                    accs.append(a)
            emitted.append((r, self.scheduler.emit(r, o[2: a + 3])))
        self.counters["tokens_per_k"][flight.k] += committed
        for group, (ns, accs) in zip(GROUPS, verified):
            if ns:
                self._count(ns, accs, group)
        return emitted

    def sync(self) -> None:
        """Read the step in flight and first tokens left to the next call, if any (their tokens come back from the
        next step())."""
        self._resolved += self._emit_next_call()
        if self.in_flight is not None:
            flight, self.in_flight = self.in_flight, None
            self._resolved += self._read(flight)

    def _flush_context(self, reqs: list[Request], in_flight: set[int] = frozenset()) -> None:
        """Before a drafting step: the drafter's context rows of the positions plain steps only stashed. in_flight:
        ids of the rows a plain step in flight continues (queued behind it, the flush also covers the one position it
        stashes; their blocks were reserved at its launch)."""
        end = {id(r): r.num_computed + (id(r) in in_flight) for r in reqs}
        lag = [r for r in reqs if r.context and r.num_context < end[id(r)]]
        if not lag:
            return
        _, tables, slots = self.cache.step_rows([r.id for r in lag], 0)
        t0 = time.perf_counter()
        with traced("engine.flush_context"):
            self.runner.flush_context([r.num_context for r in lag], [end[id(r)] - r.num_context for r in lag],
                                      tables, slots)
        for r in lag:
            r.num_context = end[id(r)]
        dt, c = time.perf_counter() - t0, self.counters
        c["context_flushes"] += 1
        c["context_flush_s"] += dt
        c["context_flushes_queued"] += bool(in_flight)
        self.policy.flushed(1e3 * dt)
        self.policy.step_chain_broken()  # a flush ran: the gap to the next step is not a step's host work

    @torch.no_grad()  # what the forwards run under (the MoE's inference paths; no autograd on the cache)
    def warmup(self, max_len: int | None = None, modes: tuple[str, ...] = ("greedy",), progress: bool = False) -> int:
        """Capture now every graph a run up to max_len tokens per request (default max_model_len) may use: the
        prefill of each chunk width and context bucket (with a drafter, under the policy with a sampling mode listed,
        also without the drafter's context rows), the context flush of each such width from FLUSH_MIN (with a
        drafter: a graph per row, and one per bucketed batch of rows), and the decode step of each
        batch bucket, each k the engine may pick, each context bucket, each sampling mode listed. A server calls it
        before it takes requests, so no request pays for a capture. Returns the number of graphs (a flush shape that
        failed to capture counted, run eagerly once instead); 0 without graphs."""
        if not self.runner.graphs:
            return 0
        max_len = max_len or self.max_model_len
        gc.collect()  # once; then the heap is frozen, so the collections the captures' eager runs trigger scan little
        gc.freeze()
        try:
            # under the policy, sampled requests may keep no drafter context: their prefills are the target's alone
            contexts = (True, False) if self.pinned_k is None and any(m != "greedy" for m in modes) else (True,)
            prefills = [key for key in self.runner.prefill_keys(self.prefill_chunk, max_len, contexts)
                        if self.runner.prefill_graph(key) is not None]
            flushes = 0
            if self.drafts is not None:  # drafting after plain steps flushes their stashed context rows
                prefills += [key for key in self.runner.flush_keys(max_len) if self.runner.flush_graph(key) is not None]
                flushes = self.runner.warm_flush(self.max_batch_size, max_len)
            self._warm_prefill()
            ks = [self.k] if self.pinned_k is not None or self.drafts is None else self.policy.choices
            # with a drafter, plain steps of rows that keep no context are keys of their own (the AR step)
            keys = {self.runner.key_for(rows, k, n, mode, context) for rows in self.runner.buckets for k in ks
                    for mode in modes for context in ((True, False) if k == 0 else (True,))
                    for n in sorted({min(1 << i, max_len + k + 1)
                                     for i in range(7, max(8, (max_len + k).bit_length() + 1))})}
            order, took = sorted(keys, key=lambda x: (x.mode, x.rows, x.k, x.width)), []
            for key in (bar := tqdm(order, desc="step graphs", disable=not progress)):
                t0 = time.perf_counter()
                self.runner.step_ms(key)  # its first run also compiles and autotunes the kernels of new shapes
                took.append((time.perf_counter() - t0, key))
                bar.set_postfix(gib=f"{torch.cuda.memory_allocated(self.device) / 2**30:.1f}", refresh=False)
        finally:
            gc.unfreeze()
        self.slowest_captures = sorted(took, key=lambda x: -x[0])[:8]
        return len(keys) + len(prefills) + flushes

    def _warm_prefill(self) -> None:
        """Short requests end to end, their statistics then forgotten: the first prefill on a device loads its
        kernels (CUDA's lazy module loading, library handles) and each new kind of shape compiles Triton
        specialisations (a full chunk alone; two rows of one aligned block), one-off costs no request should pay."""
        saved = copy.deepcopy(self.counters)  # restored in place: the scheduler counts into the same dict
        n = max(1, min(self.prefill_chunk, self.max_model_len - self.k - 3))
        for prompts in ([[0] * n], [[0] * min(n, self.prefill_align)] * 2):
            self.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
        self.counters.clear()
        self.counters.update(saved)
        self.policy.reset()

    def step_times(self, num_rows: int, longest: int, mode: str) -> dict[int, float] | None:
        """What the k policy weighs: each candidate k's replay time (ms); None without graphs."""
        return self.policy.step_times(num_rows, longest, mode)

    def _count(self, ns: list[int], accs: list[int], group: str) -> None:
        """A step's rows that verified drafts (n each, a of them accepted) into the counters and the k policy."""
        c = self.counters
        c["num_drafts"] += len(ns)
        c["num_draft_tokens"] += sum(ns)
        c["num_accepted_tokens"] += sum(accs)
        per_pos = c["num_accepted_tokens_per_pos"]
        for i, m in enumerate(counts_above(accs, len(per_pos))):
            per_pos[i] += m
        self.policy.record(ns, accs, group)

    # ------------------------------------------------------------------ prefill/decode handoff
    def export_prefilled(self, request_id: str) -> dict:
        """After a request's prefill (it has emitted its first token): its tokens, sampling state and cache
        (paged KV rows incl. the drafter context + the per-request KDA state), detached; the request leaves this
        engine. The single-machine form of prefill/decode disaggregation."""
        self.sync()  # the request's cache holds what the step in flight writes only once that step is read
        req = next((r for r in self.scheduler.running if r.id == request_id), None)
        if req is None or req.status is not Status.DECODE or req.finish_reason is not None:
            raise ValueError(f"export_prefilled: request {request_id!r} is not running with its prefill done")
        if self.drafts is not None:
            self._flush_context([req])  # the exported rows are whole: the importer drafts on them
        handoff = {"request_id": req.id, "prompt_ids": req.prompt_ids, "output_ids": list(req.output_ids),
                   "params": req.params, "seed": req.seed, "context": req.context,
                   "cache": self.cache.export_request(req.id)}
        self.scheduler.finish(req, "exported")
        return handoff

    def import_prefilled(self, handoff: dict) -> Request:
        """Continue a request prefilled by another engine (same target, drafter and layout)."""
        req = Request(handoff["prompt_ids"], handoff["params"], handoff["request_id"], tokenizer=self.tokenizer,
                      seed=handoff["seed"])
        req.output_ids = list(handoff["output_ids"])
        req.context = handoff["context"]
        need = self.scheduler.room_for(req)
        self.cache.import_request(req.id, handoff["cache"])
        req.num_computed = req.num_context = handoff["cache"]["num_tokens"]
        req.status = Status.DECODE
        self.scheduler.run(req, need)
        return req

    # ------------------------------------------------------------------ convenience
    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        bar = tqdm(total=len(reqs), desc="generate", dynamic_ncols=True, disable=not progress)
        # the objects alive now (model, engine, requests) sit out the garbage collector's full passes while this
        # runs: at hundreds of rows those passes otherwise cost milliseconds of host time per step (vLLM's gc.freeze)
        gc.freeze()
        try:
            with torch.no_grad():  # once here, not per step
                while self.has_work():  # a request finishes in a step where it emits: O(batch), not O(requests)
                    bar.update(sum(r.status is Status.FINISHED for r, _ in self.step()))
        finally:
            gc.unfreeze()
            bar.close()
        return [r.output() for r in reqs]

    def metrics(self) -> dict:
        """The counters, the host's waits for the device (in reads, before refilling a step's inputs; seconds),
        host_ms (the host's own work per decode step, its waits left out: what the k policy weighs against the
        replay times), per k the back-to-back graph steps the policy timed: how many, their whole time and their
        replay time (ms), of those the first timed steps of each run apart (early), and what the policy weighs now
        (KPolicy.view)."""
        p = self.policy
        return {**{k: (list(v) if isinstance(v, list) else v) for k, v in self.counters.items()},
                "read_wait_s": self.runner.wait_s, "launch_wait_s": self.runner.launch_wait_s,
                "host_ms": p.host_ms, "step_cycles_per_k": list(p.cycles), "step_cycle_ms_per_k": list(p.cycle_ms),
                "step_replay_ms_per_k": list(p.replay_ms), "step_switches_per_k": list(p.switches),
                "step_switch_ms_per_k": list(p.switch_ms), "step_early_cycles_per_k": list(p.early_cycles),
                "step_early_cycle_ms_per_k": list(p.early_ms), "policy": p.view() if self.drafts is not None else None}


__all__ = ["Engine", "SamplingParams", "OutOfBlocks"]
