"""The one decoding loop of the project: admit -> prefill (chunked) -> draft -> verify -> commit or roll back.

    engine = Engine(target, drafter, num_speculative_tokens=4)     # drafter=None: plain autoregressive decoding
    outs = engine.generate(["def add(a, b):"], SamplingParams(max_tokens=64))

Each running request has its committed tokens in the target cache except the last emitted one (the "pending"
token). A speculative step feeds [pending, d1..dk] to the target with per-position recurrent snapshots
(record=True), verifies, and commits pending + the accepted drafts; the next pending token is the bonus/correction.
The drafter's context rows are written into the same paged cache right after every target forward.
"""
from __future__ import annotations

import collections
import math
from collections.abc import Iterable

import torch

from dspark.cache.blocks import OutOfBlocks
from dspark.cache.paged import PagedCache
from dspark.cache.prefix import PrefixCacheConfig
from dspark.request import Request, RequestOutput, SamplingParams, Status
from dspark.spec.draft import DraftRunner
from dspark.spec.verify import choose_verify_lengths, process_logits, verify_block, verify_greedy, verify_rejection


class Engine:
    def __init__(self, target, drafter=None, num_speculative_tokens: int | None = None, tokenizer=None,
                 max_batch_size: int = 32, max_model_len: int | None = None, num_blocks: int | None = None,
                 block_size: int = 16, prefill_chunk: int = 512, adaptive_verification: bool = False,
                 draft_sample: bool = False, draft_top_k: int = 0, rejection: str = "standard",
                 prefix_caching: bool | PrefixCacheConfig = False):
        self.target, self.drafter = target, drafter
        self.tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
        self.device = next(target.parameters()).device
        self.max_model_len = max_model_len or target.config.max_position_embeddings
        self.max_batch_size, self.block_size, self.prefill_chunk = max_batch_size, block_size, prefill_chunk
        self.k = 0
        if drafter is not None:
            self.k = drafter.config.num_drafts if num_speculative_tokens is None else num_speculative_tokens
            if not 1 <= self.k <= drafter.config.num_drafts:
                raise ValueError(f"num_speculative_tokens: expected 1..{drafter.config.num_drafts} for this drafter "
                                 f"(block_size={drafter.config.block_size}, mode={drafter.config.mode}), got {self.k}")
            if adaptive_verification and drafter.confidence_head is None:
                raise ValueError("adaptive_verification needs a drafter with a confidence head")
        if rejection not in ("standard", "block"):
            raise ValueError(f"rejection: expected 'standard' or 'block', got {rejection!r}")
        self.adaptive, self.draft_sample, self.draft_top_k, self.rejection = (
            adaptive_verification, draft_sample, draft_top_k, rejection)
        if num_blocks is None:  # default budget: every batch slot can hold min(max_model_len, 2048) tokens
            num_blocks = max_batch_size * math.ceil((min(self.max_model_len, 2048) + self.k + 1) / block_size)
        attn, kda = target.cache_layout()
        self.drafts = None
        if drafter is not None:  # the drafter's context rows live in the same blocks (shared prefix caching)
            self.drafts = DraftRunner(drafter, layer_offset=1 + max(list(attn) + list(kda)))
            attn = {**attn, **self.drafts.cache_layout()}
        dtype = next(target.parameters()).dtype
        self.prefix_caching = prefix_caching
        self.cache = PagedCache(attn, kda, num_blocks, block_size, max_batch_size, dtype=dtype, device=self.device,
                                prefix_cache=PrefixCacheConfig() if prefix_caching is True else prefix_caching or None)
        self.aux_ids = list(drafter.config.target_layer_ids) if drafter is not None else None
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.reserved: dict[str, int] = {}
        self.counters = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                         "num_accepted_tokens_per_pos": [0] * max(self.k, 1), "prompt_tokens": 0,
                         "generation_tokens": 0, "target_forwards": 0}
        self.eos_id = getattr(target.config, "eos_token_id", None)

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
        req = Request(ids, params, request_id, text)
        need = len(ids) + params.max_tokens + self.k + 1
        if need > self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens + max_tokens {params.max_tokens} exceed the context "
                             f"length {self.max_model_len}")
        if self._blocks_for(req) > self.cache.pool.num_blocks:
            raise ValueError(f"prompt: needs {self._blocks_for(req)} cache blocks, the pool has "
                             f"{self.cache.pool.num_blocks}")
        self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone): frees its cache at once."""
        for req in list(self.waiting):
            if req.id == request_id:
                self.waiting.remove(req)
                req.status, req.finish_reason = Status.FINISHED, "abort"
        for req in list(self.running):
            if req.id == request_id:
                self._finish(req, "abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_for(self, req: Request) -> int:
        return math.ceil((len(req.prompt_ids) + req.params.max_tokens + self.k + 1) / self.block_size)

    def _admit(self) -> None:
        """FCFS admission while a batch slot and the worst-case blocks of the request are free."""
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            need = self._blocks_for(req)
            if sum(self.reserved.values()) + need > self.cache.pool.num_blocks:
                return  # waits until a running request frees its blocks
            self.waiting.popleft()
            self.cache.add_request(req.id)
            req.num_computed = self.cache.match_prefix(req.id, req.prompt_ids)
            self.reserved[req.id] = need
            req.status = Status.PREFILL
            self.running.append(req)

    def _finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = Status.FINISHED, reason
        self.cache.free_request(req.id)
        self.reserved.pop(req.id, None)
        if req in self.running:
            self.running.remove(req)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> list[tuple[Request, list[int]]]:
        """One scheduler step. Returns (request, newly emitted token ids) for every request that emitted."""
        self._admit()
        emitted: list[tuple[Request, list[int]]] = []
        prefill = [r for r in self.running if r.status is Status.PREFILL]
        decode = [r for r in self.running if r.status is Status.DECODE]
        try:
            if prefill:
                emitted += self._prefill(prefill)
            if decode:
                emitted += self._decode(decode)
        except Exception:
            for r in prefill + decode:  # never leave a half-updated request holding cache
                if r.status is not Status.FINISHED:
                    self._finish(r, "error")
            raise
        return emitted

    def _forward(self, reqs: list[Request], tokens: list[list[int]], record: bool):
        T = max(len(t) for t in tokens)
        ids = torch.zeros(len(reqs), T, dtype=torch.long)
        for b, t in enumerate(tokens):
            ids[b, : len(t)] = torch.tensor(t)
        fb = self.cache.batch([r.id for r in reqs], [len(t) for t in tokens], record=record)
        self.counters["target_forwards"] += 1
        if self.aux_ids is None:
            return self.target(ids.to(self.device), batch=fb)
        logits, aux = self.target(ids.to(self.device), batch=fb, aux_layer_ids=self.aux_ids)
        self.drafts.write_context(fb, aux)
        return logits

    def _chunk_end(self, r: Request) -> int:
        """Prefill up to the chunk size, stopping at the next prefix-cache checkpoint position."""
        end = min(len(r.prompt_ids), r.num_computed + self.prefill_chunk)
        stops = [p for p in self.cache.checkpoint_positions(r.id, len(r.prompt_ids)) if r.num_computed < p < end]
        return min(stops, default=end)

    def _prefill(self, reqs: list[Request]):
        chunks = [r.prompt_ids[r.num_computed: self._chunk_end(r)] for r in reqs]
        logits = self._forward(reqs, chunks, record=False)
        last = torch.stack([logits[b, len(c) - 1] for b, c in enumerate(chunks)]).float().cpu()  # sampling on CPU
        self.cache.commit()
        emitted = []
        for b, (r, chunk) in enumerate(zip(reqs, chunks)):
            r.num_computed += len(chunk)
            self.cache.after_prefill(r.id, r.prompt_ids, r.num_computed)
            if r.num_computed == len(r.prompt_ids):
                self.counters["prompt_tokens"] += len(r.prompt_ids)
                probs = process_logits(last[b], r.params.temperature, r.params.top_k, r.params.top_p)
                tok = int(torch.multinomial(probs, 1, generator=r.generator)[0])
                r.status = Status.DECODE
                emitted.append((r, self._emit(r, [tok])))
        return emitted

    def _decode(self, reqs: list[Request]):
        B = len(reqs)
        anchors = torch.tensor([r.last_token for r in reqs], device=self.device)
        drafts = torch.zeros(B, 0, dtype=torch.long)
        n_drafts = torch.zeros(B, dtype=torch.long)
        draft_probs = None
        if self.drafts is not None:
            temps = torch.tensor([r.params.temperature for r in reqs], device=self.device)
            prop = self.drafts.propose(self.cache, [r.id for r in reqs], anchors, temps, sample=self.draft_sample, top_k=self.draft_top_k,
                                       generators=[r.generator for r in reqs])
            drafts = prop.draft_ids[:, : self.k].cpu()
            draft_probs = None if prop.draft_probs is None else prop.draft_probs[:, : self.k].cpu()
            budget = [min(self.k, r.params.max_tokens - len(r.output_ids) - 1) for r in reqs]
            n_drafts = torch.tensor([max(0, b) for b in budget])
            if self.adaptive:
                n_drafts = torch.minimum(n_drafts, choose_verify_lengths(prop.confidence[:, : self.k].float().cpu()))
        tokens = [[r.last_token] + drafts[b, : n_drafts[b]].tolist() for b, r in enumerate(reqs)]
        logits = self._forward(reqs, tokens, record=True)  # [B, 1 + max n_drafts, V] on the model's device
        results: list = [None] * B
        greedy = [b for b, r in enumerate(reqs) if r.params.temperature == 0]
        if greedy:  # all greedy rows in one vectorised call, on the device: only the counts come back
            g = torch.tensor(greedy)
            width = logits.shape[1] - 1  # the forward is as wide as the longest verified row
            a, nxt = verify_greedy(drafts[g, :width].to(logits.device), logits[g.to(logits.device)],
                                   n_drafts[g].to(logits.device))
            for i, b in enumerate(greedy):
                results[b] = (int(n_drafts[b]), int(a[i]), int(nxt[i]))
        for b, r in enumerate(reqs):  # sampled rows: per-request CPU generators, so their logits go to the host
            if results[b] is None:
                n = int(n_drafts[b])
                dp = None if draft_probs is None else draft_probs[b: b + 1, :n]
                results[b] = (n, *self._verify(r, drafts[b: b + 1, :n], dp, logits[b: b + 1, : n + 1].float().cpu()))
        self.cache.commit(torch.tensor([a + 1 for _, a, _ in results]))
        emitted = []
        for b, (r, (n, a, nxt)) in enumerate(zip(reqs, results)):
            r.num_computed += a + 1
            r.num_steps += 1
            if self.drafts is not None:
                r.accepted_per_step.append(a)
                r.num_drafts_per_step.append(n)
                self._count(n, a)
            emitted.append((r, self._emit(r, drafts[b, :a].tolist() + [nxt])))
        return emitted

    def _verify(self, r: Request, drafts, draft_probs, logits) -> tuple[int, int]:
        """One sampled request: (accepted drafts, next token) under its own sampling parameters."""
        p = r.params
        n = torch.tensor([drafts.shape[1]])
        probs = process_logits(logits, p.temperature, p.top_k, p.top_p)
        fn = verify_block if self.rejection == "block" else verify_rejection
        a, nxt = fn(drafts, draft_probs, probs, n, r.generator)
        return int(a[0]), int(nxt[0])

    def _count(self, n: int, a: int) -> None:
        if n == 0:
            return
        c = self.counters
        c["num_drafts"] += 1
        c["num_draft_tokens"] += n
        c["num_accepted_tokens"] += a
        for i in range(a):
            c["num_accepted_tokens_per_pos"][i] += 1

    def _emit(self, r: Request, toks: list[int]) -> list[int]:
        """Append tokens, apply max_tokens / EOS / stop strings; finish the request when done."""
        toks = toks[: r.params.max_tokens - len(r.output_ids)]
        reason = None
        stops = set(r.params.stop_token_ids) | ({self.eos_id} if not r.params.ignore_eos and self.eos_id is not None
                                                  else set())
        hit = next((i for i, t in enumerate(toks) if t in stops), None)
        if hit is not None:
            toks, reason = toks[: hit + 1], "stop"
        r.output_ids += toks
        self.counters["generation_tokens"] += len(toks)
        if self.tokenizer is not None:
            r.text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
            for s in r.params.stop:
                at = r.text.find(s)
                if at >= 0:
                    r.text, reason = r.text[:at], "stop"
        if reason is None and len(r.output_ids) >= r.params.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(r, reason)
        return toks

    # ------------------------------------------------------------------ prefill/decode handoff
    def export_prefilled(self, request_id: str) -> dict:
        """After a request's prefill (it has emitted its first token): its tokens, sampling state and cache
        (paged KV rows incl. the drafter context + the per-request KDA state), detached; the request leaves this
        engine. The single-machine form of prefill/decode disaggregation."""
        req = next((r for r in self.running if r.id == request_id), None)
        if req is None or req.status is not Status.DECODE or req.finish_reason is not None:
            raise ValueError(f"export_prefilled: request {request_id!r} is not running with its prefill done")
        handoff = {"request_id": req.id, "prompt_ids": req.prompt_ids, "output_ids": list(req.output_ids),
                   "params": req.params, "text": req.text,
                   "rng": None if req.generator is None else req.generator.get_state(),
                   "cache": self.cache.export_request(req.id)}
        self._finish(req, "exported")
        return handoff

    def import_prefilled(self, handoff: dict) -> Request:
        """Continue a request prefilled by another engine (same target, drafter and layout)."""
        req = Request(handoff["prompt_ids"], handoff["params"], handoff["request_id"])
        req.output_ids, req.text = list(handoff["output_ids"]), handoff["text"]
        if handoff["rng"] is not None:
            req.generator.set_state(handoff["rng"])
        need = self._blocks_for(req)
        if sum(self.reserved.values()) + need > self.cache.pool.num_blocks or len(self.running) >= self.max_batch_size:
            raise OutOfBlocks(need, self.cache.pool.num_free)
        self.cache.import_request(req.id, handoff["cache"])
        req.num_computed = handoff["cache"]["num_tokens"]
        req.status = Status.DECODE
        self.reserved[req.id] = need
        self.running.append(req)
        return req

    # ------------------------------------------------------------------ convenience
    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(reqs), desc="generate", dynamic_ncols=True)
        while self.has_work():
            done_before = sum(r.status is Status.FINISHED for r in reqs)
            self.step()
            if bar is not None:
                bar.update(sum(r.status is Status.FINISHED for r in reqs) - done_before)
        if bar is not None:
            bar.close()
        return [r.output() for r in reqs]

    def metrics(self) -> dict:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.counters.items()}


__all__ = ["Engine", "SamplingParams", "OutOfBlocks"]
