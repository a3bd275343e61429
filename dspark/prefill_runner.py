"""The model runner's prefill side: a prompt chunk's forward, the drafter's context flush, and the CUDA graph capture
both sides and the decode steps share (dspark/runner.py's ModelRunner builds on it).

A prefill chunk goes through a DeviceView like a decode step: on CUDA each request's chunk is one graph replay, keyed by
its padded width (a power of two >= PREFILL_MIN) and the context it sees, while the forward is graph-safe (no MoE host
reads), for up to PREFILL_GRAPH_ROWS requests a step; otherwise, and on CPU, the chunks of a step run eagerly,
batched into forwards of up to PREFILL_BATCH_TOKENS tokens. The first token is sampled on the device from the last
chunk's last logits. A context flush turns the positions a plain step stashed into the drafter's context rows (a
captured graph per row, keyed like a prefill, for a few rows; one captured graph of them all for more, their count
bucketed; eagerly on CPU and for the widest) before a request drafts again.
"""
from __future__ import annotations

import gc
import warnings

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dspark.cache.paged import PagedCache
from dspark.device import queued_copy
from dspark.models.k3.moe import moe_graph_safe
from dspark.spec.draft import DraftRunner
from dspark.spec.sampling import RowSampling, counter_uniform, process_logits, sample_from
from dspark.step_buffers import PREFILL_COLS, PrefillBuffers, PrefillKey, pow2_at_least

PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
COUNTER_STRIDE = 64  # uniforms a request may draw per position: 2k + 1 per step (k <= 31), the prefill's last one
MIN_CONTEXT = 128  # the smallest context bucket (positions a step sees)
PREFILL_MIN = 64  # the narrowest prefill graph (prefill widths are powers of two from here)
FLUSH_MIN = 16  # the narrowest context-flush graph (its widths are powers of two from here)
# a step's prefills replay one graph per request up to this many requests (a server's burst of arrivals), else run
# batched (a regeneration's waves of hundreds): an eager forward's first shape may autotune kernels for seconds
PREFILL_GRAPH_ROWS = 64
PREFILL_BATCH_TOKENS = 16384  # padded tokens per batched eager prefill forward (its logits: this many x vocab)
# a context flush replays one captured graph per row up to this many rows, else one graph of all its rows (their
# count, new tokens and table width bucketed to powers of two): each row's graph costs the host a copy and a replay,
# on an H200 host tens of microseconds each (the k3-mini server's flushes at 16 rows took 1.7 ms of host time), and
# the batched forward run eagerly some 1 ms of launches (the quickstart server's at 16 rows on an H100)
FLUSH_GRAPH_ROWS = 4
# a flush of more rows and more new tokens per row than this runs eagerly even with graphs: a graph's activations
# stay in the graph pool (rows x tokens x the target's aux features), and such flushes (after hundreds of plain steps)
# are rare
FLUSH_BATCH_GRAPH_TOKENS = 256


class PrefillRunner:
    """Prefill, context flush and graph capture over a target (+ a drafter's DraftRunner) and a PagedCache."""

    def __init__(self, target, drafts: DraftRunner | None, cache: PagedCache, graphs: bool | None = None):
        self.target, self.drafts, self.cache = target, drafts, cache
        self.device = cache.device
        self.cuda = self.device.type == "cuda"
        self.graphs = self.cuda if graphs is None else graphs
        if self.graphs and not self.cuda:
            raise ValueError("graphs: CUDA graphs need the model on a CUDA device")
        self.aux_ids = list(drafts.drafter.config.target_layer_ids) if drafts is not None else None
        self.prefills: dict[PrefillKey, PrefillBuffers] = {}
        self.prefill_failed: set[PrefillKey] = set()
        self.flushes: dict[PrefillKey, PrefillBuffers] = {}  # one row's context flushes, keyed like prefills
        self.flush_failed: set[PrefillKey] = set()
        # context flushes of more than FLUSH_GRAPH_ROWS rows: (rows, key) -> their graph
        self.batch_flushes: dict[tuple[int, PrefillKey], PrefillBuffers] = {}
        self.batch_flush_failed: set[tuple[int, PrefillKey]] = set()
        self.pool = None  # one memory pool for every graph (they never run concurrently)

    # ------------------------------------------------------------------ forward
    def forward(self, ids: torch.Tensor, batch, stash: bool = False, context: bool = True) -> torch.Tensor:
        """Target forward (+ the drafter's context rows of the same positions; stash: only their ctx, the rows
        left to flush_context; context=False: the target's alone) -> logits [B, T, V]."""
        if self.aux_ids is None or not context:
            return self.target(ids, batch=batch)
        logits, aux = self.target(ids, batch=batch, aux_layer_ids=self.aux_ids, aux_parts=stash)
        (self.drafts.stash_context if stash else self.drafts.write_context)(batch, aux)
        return logits

    # ------------------------------------------------------------------ graph capture
    def _capture_fn(self, fn, holder, warmup: int) -> torch.Tensor:
        """Run fn `warmup` times on a side stream (lazy loading, Triton autotuning), then capture it into
        holder.graph (the runner's one memory pool); returns its output tensor."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        holder.graph = torch.cuda.CUDAGraph()
        # no garbage collection inside the capture: a dead engine's graphs (a compiled runner sits in a reference
        # cycle) would be destroyed there, a CUDA call a capture does not permit, and the capture would fail. No
        # gc.collect() per capture either: with the heap of a server (torch, transformers, the web stack) one costs
        # about 0.1 s, a sixth of a capture; Engine.warmup collects once before its captures
        enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(holder.graph, pool=self.pool), torch.no_grad():
                out = fn()
        finally:
            if enabled:
                gc.enable()
        self.pool = holder.graph.pool()
        return out

    # ------------------------------------------------------------------ prefill
    def prefill_key(self, num_tokens: int, num_cached: int, align: int = 1, context: bool = True) -> PrefillKey:
        """The key of a chunk of num_tokens tokens after num_cached cached ones: with graphs a power-of-two width and
        context; else the width rounded up to `align`, the exact context. context=False: without the drafter's
        context rows (a target alone has none)."""
        context = context and self.aux_ids is not None
        if self.graphs:
            return self._graph_key(num_tokens, num_cached, PREFILL_MIN)._replace(context=context)
        T = -(-num_tokens // align) * align
        return PrefillKey(T, -(-(num_cached + T) // self.cache.block_size), context)

    def _graph_key(self, num_tokens: int, num_cached: int, t_min: int) -> PrefillKey:
        """A one-request graph's key (a prefill's, a flush's): a power-of-two width from t_min and context."""
        bs, T = self.cache.block_size, pow2_at_least(num_tokens, t_min)
        return PrefillKey(T, pow2_at_least(num_cached + T, max(MIN_CONTEXT, bs)) // bs)

    def _graph_keys(self, t_min: int, max_tokens: int, max_len: int) -> list[PrefillKey]:
        """Every such key of up to max_tokens new tokens in requests up to max_len tokens."""
        bs, keys = self.cache.block_size, []
        T = t_min
        while T <= pow2_at_least(max_tokens, t_min):
            L = pow2_at_least(T, max(MIN_CONTEXT, bs))
            while L <= pow2_at_least(max_len, max(MIN_CONTEXT, bs)):
                keys.append(PrefillKey(T, L // bs))
                L *= 2
            T *= 2
        return keys

    def prefill_graph_safe(self, key: PrefillKey) -> bool:
        return self.graphs and key not in self.prefill_failed and moe_graph_safe(self.target, key.T)

    @torch.no_grad()
    def prefill(self, chunks: list[list[int]], num_cached: list[int], tables: list[list[int]], slots: list[int],
                align: int = 1, contexts: list[bool] | None = None) -> torch.Tensor:
        """Forward each request's next prompt chunk (its blocks already reserved) -> each row's logits at its chunk's
        last token [n, V]; contexts: per row, whether it writes the drafter's context rows (default: all do). A few
        chunks (up to PREFILL_GRAPH_ROWS) replay their key's graph one request at a time; the rest run eagerly,
        batched: chunks sorted by context and width, in forwards of at most PREFILL_BATCH_TOKENS padded tokens (a
        regeneration admits hundreds of requests at once, and hundreds of replays cost several times one batch)."""
        out: list[torch.Tensor | None] = [None] * len(chunks)
        contexts = contexts or [True] * len(chunks)
        eager = []
        for i, (c, n) in enumerate(zip(chunks, num_cached)):
            pf = (self._prefill_graph_for(len(c), n, align, contexts[i]) if len(chunks) <= PREFILL_GRAPH_ROWS
                  else None)
            if pf is None:
                eager.append(i)
                continue
            self._fill(pf, [c], [n], [tables[i]], [slots[i]])
            pf.graph.replay()
            out[i] = pf.out.clone()  # the pool is shared: the next replay may reuse this memory
        padded = [-(-len(c) // align) * align for c in chunks]  # an eager forward's width: few shapes on CUDA
        groups: list[list[int]] = []  # one context each, widest last: sorted by width, each within the token budget
        for i in sorted(eager, key=lambda i: (contexts[i], padded[i])):
            if not groups or (len(groups[-1]) + 1) * padded[i] > PREFILL_BATCH_TOKENS or \
                    contexts[groups[-1][0]] != contexts[i]:
                groups.append([])
            groups[-1].append(i)
        for group in groups:
            last = self._prefill_eager(group, chunks, num_cached, tables, slots, padded[group[-1]],
                                       contexts[group[0]])
            for j, i in enumerate(group):
                out[i] = last[j: j + 1]
        return torch.cat(out)

    def _prefill_graph_for(self, num_tokens: int, num_cached: int, align: int, context: bool
                           ) -> PrefillBuffers | None:
        """The captured prefill of a chunk's key (captured now if graph-safe), else None."""
        key = self.prefill_key(num_tokens, num_cached, align, context)
        pf = self.prefills.get(key)  # captured: no need to walk the model's modules again
        return pf if pf is not None or not self.prefill_graph_safe(key) else self.prefill_graph(key)

    def _prefill_eager(self, rows: list[int], chunks, num_cached, tables, slots, T: int, context: bool = True
                       ) -> torch.Tensor:
        """One eager forward over the chunks `rows`, right-padded to T tokens (with the drafter's context rows or
        without) -> their last logits [len(rows), V]."""
        width = max(-(-(num_cached[i] + T) // self.cache.block_size) for i in rows)
        pf = PrefillBuffers(len(rows), PrefillKey(T, width, context), self.device)
        self._fill(pf, [chunks[i] for i in rows], [num_cached[i] for i in rows], [tables[i] for i in rows],
                   [slots[i] for i in rows])
        return self._prefill_fn(pf)

    def _row_ints(self, num_cached, num_new, slots, tables, width: int) -> torch.Tensor:
        """Host rows [num_cached, num_new, slot | block table padded with the scratch block to width]
        [n, PREFILL_COLS + width] (what a prefill or a context flush hands its DeviceView)."""
        P = PREFILL_COLS
        ints = torch.full((len(tables), P + width), self.cache.scratch_block, dtype=torch.long)
        ints[:, :P] = torch.tensor(list(zip(num_cached, num_new, slots)), dtype=torch.long).view(-1, P)
        for b, t in enumerate(tables):
            ints[b, P: P + min(len(t), width)] = torch.tensor(t[:width], dtype=torch.long)
        return ints

    def _fill(self, pf: PrefillBuffers, chunks, num_cached, tables, slots) -> None:
        """Host values -> the prefill's device buffers (one copy each); tables padded with the scratch block."""
        ids = torch.zeros(len(chunks), pf.key.T, dtype=torch.long)
        for b, c in enumerate(chunks):
            ids[b, : len(c)] = torch.tensor(c, dtype=torch.long)
        pin = self.device.type == "cuda"
        pf.ids.copy_(ids.pin_memory() if pin else ids, non_blocking=pin)
        self._fill_ints(pf, num_cached, [len(c) for c in chunks], slots, tables)

    def _fill_ints(self, pf: PrefillBuffers, num_cached, num_new, slots, tables) -> None:
        """The rows' ints -> pf.ints, from pinned memory on CUDA (queued: no wait for the device)."""
        ints = self._row_ints(num_cached, num_new, slots, tables, pf.key.width)
        pin = self.device.type == "cuda"
        pf.ints.copy_(ints.pin_memory() if pin else ints, non_blocking=pin)

    def _row_view(self, ints: torch.Tensor, T: int):
        """The DeviceView of rows [num_cached, num_new, slot | block table] (a prefill's or a flush's)."""
        num_cached, num_new, slots = (ints[:, i].contiguous() for i in range(PREFILL_COLS))
        return self.cache.device_view(num_cached, num_new, ints[:, PREFILL_COLS:], slots, T, False)

    def _prefill_fn(self, pf: PrefillBuffers) -> torch.Tensor:
        """The prefill forward (device ops only) -> each row's logits at its last valid token [rows, V]. Without
        cuDNN's attention: it builds an execution graph for every new shape."""
        view = self._row_view(pf.ints, pf.key.T)
        with sdpa_kernel(PREFILL_ATTENTION):
            logits = self.forward(pf.ids, view, context=pf.key.context)  # [rows, T, V]
        last = (view.num_new - 1).clamp(min=0)[:, None, None].expand(-1, 1, logits.shape[-1])
        return logits.gather(1, last)[:, 0]

    def prefill_keys(self, max_chunk: int, max_len: int, contexts: tuple[bool, ...] = (True,)) -> list[PrefillKey]:
        """The graph-safe prefill keys of chunks up to max_chunk tokens in requests up to max_len tokens, with the
        drafter's context rows and / or without (contexts)."""
        keys = [k._replace(context=c) for k in self._graph_keys(PREFILL_MIN, max_chunk, max_len)
                for c in dict.fromkeys(c and self.aux_ids is not None for c in contexts)]
        return [k for k in keys if self.prefill_graph_safe(k)]

    def prefill_graph(self, key: PrefillKey) -> PrefillBuffers | None:
        """The captured prefill of one request for this key (captured at its first use; Engine.warmup captures the
        usual ones before a server takes requests). A capture that fails leaves the key to the eager forward (None),
        with a warning."""
        return self._row_graph(self.prefills, self.prefill_failed, key, self._prefill_fn, "prefill")

    def flush_graph(self, key: PrefillKey, rows: int = 1) -> PrefillBuffers | None:
        """The captured context flush of `rows` requests (1, or a power of two above FLUSH_GRAPH_ROWS) for this key
        (flush_keys), as prefill_graph; None for more rows of more than FLUSH_BATCH_GRAPH_TOKENS new tokens (those
        run eagerly)."""
        if rows == 1:
            return self._row_graph(self.flushes, self.flush_failed, key, self._flush_fn, "context flush")
        if key.T > FLUSH_BATCH_GRAPH_TOKENS:
            return None
        return self._row_graph(self.batch_flushes, self.batch_flush_failed, key, self._flush_fn, "context flush",
                               rows)

    @torch.no_grad()
    def _row_graph(self, store: dict, failed: set, key: PrefillKey, fn, what: str, rows: int = 1
                   ) -> PrefillBuffers | None:
        """The graph of fn over a PrefillBuffers of `rows` requests and this key (in store under key, or with more
        rows under (rows, key)), from store or captured now on scratch rows (the capture waits for the device); None
        where it failed to capture (then, with a warning, that shape runs eagerly)."""
        slot = key if rows == 1 else (rows, key)
        pf = store.get(slot)
        if pf is None and slot not in failed:
            pf = PrefillBuffers(rows, key, self.device)
            pf.ints.fill_(self.cache.scratch_block)
            pf.ints[:, :PREFILL_COLS] = torch.tensor([0, 1, self.cache.scratch_slot])
            try:
                pf.out = self._capture_fn(lambda: fn(pf), pf, warmup=1)
            except Exception as err:  # noqa: BLE001 - a kernel that cannot be captured: the eager forward serves
                warnings.warn(f"{what} graph {slot} failed to capture ({type(err).__name__}: {err}); that shape runs "
                              "eagerly", RuntimeWarning, stacklevel=3)
                failed.add(slot)
                return None
            store[slot] = pf
        return pf

    @staticmethod
    def sample_first(logits: torch.Tensor, sampling: RowSampling, seed: torch.Tensor, position: torch.Tensor
                     ) -> torch.Tensor:
        """The token after a prefill: logits [B, V] -> [B] (greedy rows: the argmax)."""
        u = counter_uniform(seed, position * COUNTER_STRIDE + COUNTER_STRIDE - 1, 1)[:, 0]
        return sample_from(process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p), u)

    # ------------------------------------------------------------------ context flush
    def flush_keys(self, max_len: int) -> list[PrefillKey]:
        """The flush keys of requests up to max_len tokens."""
        return self._graph_keys(FLUSH_MIN, max_len, max_len)

    @torch.no_grad()
    def flush_context(self, starts: list[int], counts: list[int], tables: list[list[int]], slots: list[int]) -> None:
        """The drafter's context rows of positions starts[b] .. starts[b] + counts[b] - 1 from their stashed ctx
        (tables: each row's blocks, unpadded). With graphs, up to FLUSH_GRAPH_ROWS rows each row replays its key's
        captured flush, more replay one graph of them all (rows padded with scratch rows to a power of two, the key of
        the longest flush and the latest start; up to FLUSH_BATCH_GRAPH_TOKENS new tokens a row); else, and for a
        shape without a graph, one eager forward of the context write over those rows. Queued behind a step in flight
        without waiting for it: the row ints go up from pinned memory."""
        if self.graphs and len(starts) > FLUSH_GRAPH_ROWS:
            rows = pow2_at_least(len(starts), 1)
            fl = self.flush_graph(self._graph_key(max(counts), max(starts), FLUSH_MIN), rows)
            if fl is None:
                return self._flush_eager(starts, counts, slots, tables)
            self._fill_ints(fl, *_padded(rows, starts, counts, slots, tables, self.cache.scratch_slot))
            fl.graph.replay()
            return
        eager = []
        for b, (start, count) in enumerate(zip(starts, counts)):
            fl = self.flush_graph(self._graph_key(count, start, FLUSH_MIN)) if self.graphs else None
            if fl is None:
                eager.append(b)
                continue
            self._fill_ints(fl, [start], [count], [slots[b]], [tables[b]])
            fl.graph.replay()
        if eager:
            self._flush_eager([starts[b] for b in eager], [counts[b] for b in eager], [slots[b] for b in eager],
                              [tables[b] for b in eager])

    def _flush_eager(self, starts: list[int], counts: list[int], slots: list[int], tables: list[list[int]]) -> None:
        """One eager forward of the context write over these rows, its shape bucketed: rows, new tokens and table
        width padded to powers of two (padding rows write the scratch block), so that the Triton specialisations the
        first forward of a shape compiles (~0.2 s on an H100) are few and warm_flush compiles them before requests."""
        bs = self.cache.block_size
        T, rows = pow2_at_least(max(counts), FLUSH_MIN), pow2_at_least(len(starts), 1)
        width = pow2_at_least(max(-(-(s + T) // bs) for s in starts), 1)
        ints = self._row_ints(*_padded(rows, starts, counts, slots, tables, self.cache.scratch_slot), width)
        self.drafts.flush_context(self._row_view(queued_copy(ints, self.device), T))

    def warm_flush(self, max_rows: int, max_len: int) -> int:
        """Each flush shape of more than FLUSH_GRAPH_ROWS up to max_rows rows, in requests up to max_len tokens, on
        scratch rows (Engine.warmup: no request pays for their captures or compiles): with graphs captured up to
        FLUSH_BATCH_GRAPH_TOKENS new tokens a row (one that fails to capture, and a wider one, run eagerly once), else
        run once eagerly -> shapes captured or run."""
        bs, keys, shapes = self.cache.block_size, self.flush_keys(max_len), 0
        rows = pow2_at_least(FLUSH_GRAPH_ROWS + 1, 1)
        while rows <= pow2_at_least(max_rows, 1):
            for key in keys:
                start = key.width * bs - key.T  # the table's width is then key.width blocks
                if not self.graphs or self.flush_graph(key, rows) is None:
                    self._flush_eager([start] * rows, [key.T] * rows, [self.cache.scratch_slot] * rows, [[]] * rows)
                shapes += 1
            rows *= 2
        return shapes

    def _flush_fn(self, fl: PrefillBuffers) -> None:
        """The context flush of fl's rows (device ops only: what its graph captures)."""
        self.drafts.flush_context(self._row_view(fl.ints, fl.key.T))


def _padded(rows: int, starts: list[int], counts: list[int], slots: list[int], tables: list[list[int]],
            scratch_slot: int) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """A flush's rows padded to `rows` with scratch rows (one token at position 0 into the scratch slot, no blocks):
    (num_cached, num_new, slots, tables)."""
    pad = rows - len(starts)
    return starts + [0] * pad, counts + [1] * pad, slots + [scratch_slot] * pad, tables + [[]] * pad
