"""The requests' side of the engine (nano-vllm's scheduler): the waiting queue, FCFS admission while a batch slot and
a request's worst-case cache blocks are free, the running batch, stop conditions and finishing. The engine
(dspark/engine.py) prefills and decodes what runs here."""
from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable

from dspark.cache.blocks import OutOfBlocks
from dspark.cache.paged import PagedCache
from dspark.request import Request, Status

# the prefix-cache salt of prompt blocks prefilled without the drafter's context rows: a request that keeps the
# context never attaches to them (their drafter rows were never written)
NO_CONTEXT_SALT = -2


class Scheduler:
    def __init__(self, cache: PagedCache, max_batch_size: int, max_model_len: int, step_room: int,
                 eos_id: int | None, counters: dict):
        """step_room: tokens a request reserves beyond prompt + max_tokens (a verify step's k + 1); counters: the
        engine's, whose generation_tokens this counts."""
        self.cache, self.max_batch_size, self.max_model_len = cache, max_batch_size, max_model_len
        self.step_room, self.eos_id, self.counters = step_room, eos_id, counters
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.reserved: dict[str, int] = {}  # request id -> cache blocks held for its worst case

    def blocks_for(self, req: Request) -> int:
        return math.ceil((len(req.prompt_ids) + req.params.max_tokens + self.step_room) / self.cache.block_size)

    def add(self, req: Request) -> None:
        """Queue a request; ValueError (naming the prompt) when it can never fit the context or the pool."""
        ids, params = req.prompt_ids, req.params
        if len(ids) + params.max_tokens + self.step_room > self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens + max_tokens {params.max_tokens} exceed the context "
                             f"length {self.max_model_len}")
        if self.blocks_for(req) > self.cache.pool.num_blocks:
            raise ValueError(f"prompt: needs {self.blocks_for(req)} cache blocks, the pool has "
                             f"{self.cache.pool.num_blocks}")
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone): frees its cache at once."""
        for req in list(self.waiting):
            if req.id == request_id:
                self.waiting.remove(req)
                req.status, req.finish_reason = Status.FINISHED, "abort"
        for req in list(self.running):
            if req.id == request_id:
                self.finish(req, "abort")

    def admit(self, keeps_context: Callable[[Request], bool] | None = None) -> None:
        """FCFS admission while a batch slot and the worst-case blocks of the request are free. keeps_context:
        whether a request, once running, keeps the drafter's context (Request.context; None: every one does)."""
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            need = self.blocks_for(req)
            if sum(self.reserved.values()) + need > self.cache.pool.num_blocks:
                return  # waits until a running request frees its blocks
            self.waiting.popleft()
            self.cache.add_request(req.id)
            self.running.append(req)
            req.context = keeps_context is None or keeps_context(req)
            req.num_computed = req.num_context = self.cache.match_prefix(
                req.id, req.prompt_ids, None if req.context else NO_CONTEXT_SALT)
            self.reserved[req.id] = need
            req.status, req.admitted = Status.PREFILL, time.perf_counter()

    def room_for(self, req: Request) -> int:
        """The blocks a request joining the running batch directly (an imported one) reserves; OutOfBlocks when
        neither they nor a batch slot are free."""
        need = self.blocks_for(req)
        if sum(self.reserved.values()) + need > self.cache.pool.num_blocks or len(self.running) >= self.max_batch_size:
            raise OutOfBlocks(need, self.cache.pool.num_free)
        return need

    def run(self, req: Request, need: int) -> None:
        """A request joins the running batch holding `need` blocks (room_for)."""
        self.reserved[req.id] = need
        self.running.append(req)

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = Status.FINISHED, reason
        self.cache.free_request(req.id)
        self.reserved.pop(req.id, None)
        if req in self.running:
            self.running.remove(req)

    def emit(self, r: Request, toks: list[int]) -> list[int]:
        """Append tokens, apply max_tokens / EOS / stop strings; finish the request when done."""
        toks = toks[: r.params.max_tokens - len(r.output_ids)]
        reason = None
        stops = r.params.stop_token_ids
        eos = None if r.params.ignore_eos else self.eos_id
        hit = (next((i for i, t in enumerate(toks) if t == eos or t in stops), None)
               if eos is not None or stops else None)
        if hit is not None:
            toks, reason = toks[: hit + 1], "stop"
        r.output_ids += toks
        self.counters["generation_tokens"] += len(toks)
        if r.params.stop and r.tokenizer is not None:  # the text is decoded only when a stop string needs it
            text = r.text
            for stop in r.params.stop:
                at = text.find(stop)
                if at >= 0:
                    r.text, reason, text = text[:at], "stop", text[:at]
        if reason is None and len(r.output_ids) >= r.params.max_tokens:
            reason = "length"
        if reason is not None:
            self.finish(r, reason)
        return toks
