"""Graph-safe static greedy decoding for any target (Qwen3 or the K3 hybrid), speculative with a DSpark drafter or
plain autoregressive: the static_decode.py design extended with KDA state, drafter context rows and the verify /
commit of a speculative step, all on the device.

    gen = StaticGenerator(target, drafter, max_len=1024, graphs=True)       # drafter=None: plain AR
    out = gen.generate(prompt_ids, max_new_tokens=128)                      # out.token_ids, out.accepted_per_step
    generate_spec_greedy(target, drafter, prompt_ids, 128)                 # one-shot forms of the same
    generate_ar_greedy(target, prompt_ids, 128)

- `HybridCache`: per attention layer (target GQA/MLA layers and the drafter's context layers, offset past the
  target's like the engine's DraftRunner) one [B, max_len, C] row store; per KDA layer the recurrent state
  S [B, H, K, V] fp32 and the conv window [B, W-1, 3P]; lengths [B] on the device.
- `SpecBatch` (a StaticBatch) adds the KDA side of the CacheView: `kda_read` / `kda_write`; with record=True
  (verify) the per-position states are held until `commit(n_keep)` (a device tensor) selects the state after
  position n_keep-1 and rolls the conv window, exactly DenseCache.commit's semantics, with device ops only.
- `SpecStep.run()`: one decode step for `rows` sequences, device ops only (so one CUDA graph captures it):
  speculative: propose k drafts from the static drafter context (greedy Markov loop, argmax on the device) ->
  verify forward of [pending, d1..dk] (record=True) + context rows -> greedy acceptance a -> commit a+1 -> the
  next pending token. AR: forward of [pending] -> argmax -> commit. Returns packed [rows, 1 + T] =
  [a, emitted tokens (-1 padded)], the only tensor the host reads back per step.
- MoE layers run their gathered expert path (moe.set_static_moe) for step-sized forwards: no host sync.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspark.cache.state import committed_kda_state
from dspark.kernels import use_triton
from dspark.kernels.markov_sample import markov_sample
from dspark.models.k3.moe import LatentMoE, set_static_moe
from dspark.spec.draft import DraftRunner, draft_hidden, sample_markov
from dspark.spec.verify import verify_greedy
from dspark.static_decode import StaticBatch, _round_up


class HybridCache:
    """Static cache of a target (+ `extra_attn` {layer: row width}, e.g. the drafter's context layers)."""

    def __init__(self, target, batch_size: int, max_len: int, extra_attn: dict[int, int] | None = None,
                 device=None, dtype=None):
        p = next(target.parameters())
        device, dtype = device or p.device, dtype or p.dtype
        attn, kda = target.cache_layout()
        attn = {**attn, **(extra_attn or {})}
        self.B, self.max_len = batch_size, max_len
        self.kv = {layer: torch.zeros(batch_size, max_len, C, device=device, dtype=dtype) for layer, C in attn.items()}
        # KDA layout (H, K, V, conv channels, conv width)
        self.state = {layer: torch.zeros(batch_size, H, K, V, device=device, dtype=torch.float32)
                      for layer, (H, K, V, _, _) in kda.items()}
        self.conv = {layer: torch.zeros(batch_size, W - 1, C, device=device, dtype=dtype)
                     for layer, (_, _, _, C, W) in kda.items()}
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)

    def reset(self) -> None:
        """Empty every row (in place: captured graphs keep pointing at the same buffers)."""
        self.lengths.zero_()
        for t in (*self.state.values(), *self.conv.values()):
            t.zero_()

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of what a step mutates besides rows past the lengths (lengths, KDA state, conv windows)."""
        return [t.clone() for t in (self.lengths, *self.state.values(), *self.conv.values())]

    def restore(self, snap: list[torch.Tensor]) -> None:
        for t, s in zip((self.lengths, *self.state.values(), *self.conv.values()), snap):
            t.copy_(s)


class SpecBatch(StaticBatch):
    """A StaticBatch over a HybridCache with the KDA side of the CacheView. record=True keeps the per-position
    states of a verify forward until commit(n_keep)."""

    def __init__(self, cache: HybridCache, rows: int, T: int, record: bool = False):
        super().__init__(cache, rows, T)
        self.record = record
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def kda_read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.static_cache
        return c.state[layer][: self.rows], c.conv[layer][: self.rows]

    def kda_write(self, layer: int, states: torch.Tensor, conv: torch.Tensor) -> None:
        """record=False: final S [rows, H, K, V] and window [rows, W-1, C], written in place. record=True:
        S [rows, T, H, K, V] after each position and ext [rows, W-1+T, C], held until commit."""
        if self.record:
            self._pending[layer] = (states, conv)
        else:
            self.static_cache.state[layer][: self.rows].copy_(states)
            self.static_cache.conv[layer][: self.rows].copy_(conv)

    def commit(self, n_keep: torch.Tensor | None = None) -> None:
        """Keep n_keep [rows] (device, 0..T) of the new tokens per row (default all): the KDA state after position
        n_keep-1 (unchanged when 0), the conv window of the last W-1 kept raw inputs, lengths += n_keep."""
        c, rows = self.static_cache, self.rows
        if n_keep is not None and not self.record and c.state:
            raise ValueError("commit: a forward with record=False cannot roll back recurrent state; keep all tokens")
        n = self.num_new if n_keep is None else n_keep
        for layer, (states, ext) in self._pending.items():
            S, conv = committed_kda_state(states, ext, n, c.state[layer][:rows])
            c.state[layer][:rows].copy_(S)
            c.conv[layer][:rows].copy_(conv)
        self._pending.clear()
        c.lengths[:rows] += n


def propose_static(runner: DraftRunner, cache: HybridCache, anchors: torch.Tensor, k: int) -> torch.Tensor:
    """Greedy drafts [rows, k] for anchors [rows] at positions p0 = cache.lengths (device ops only): the engine's
    parallel pass (draft_hidden) over the static context rows, then the greedy Markov loop: on CUDA one launch
    (dspark/kernels/markov_sample.py, the loop's reference is sample_markov), else sample_markov."""
    rows, d = anchors.shape[0], runner.drafter
    ctx_rows = [cache.kv[layer][:rows] for layer in runner.layers]  # [rows, max_len, C] each, masked by p0
    h = draft_hidden(d, anchors, cache.lengths[:rows], ctx_rows)[:, :k]  # [rows, k, H]
    if d.markov_head is not None and use_triton(h):
        w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
        scale = d.config.logit_scale
        return markov_sample(d.base_logits(h), w1, w2 if scale == 1.0 else w2 * scale, anchors)[0]
    return sample_markov(d, h, anchors, None, sample=False).draft_ids


class SpecStep:
    """One greedy decode step of `rows` sequences over a HybridCache, device ops only. Static inputs: `pending`
    [rows] (each row's last emitted token, not yet in the cache) and `n_drafts` [rows] (drafts verified per row,
    <= k). runner None (or k = 0): plain AR."""

    def __init__(self, target, runner: DraftRunner | None, cache: HybridCache, rows: int, k: int):
        dev = cache.lengths.device
        self.target, self.runner, self.cache, self.rows = target, runner, cache, rows
        self.k = k if runner is not None else 0
        self.aux_ids = list(runner.drafter.config.target_layer_ids) if runner is not None else None
        self.pending = torch.zeros(rows, dtype=torch.long, device=dev)
        self.n_drafts = torch.full((rows,), self.k, dtype=torch.long, device=dev)
        self.batch = SpecBatch(cache, rows, self.k + 1, record=self.k > 0)

    def propose(self, anchors: torch.Tensor) -> torch.Tensor:  # [rows] -> [rows, k]
        return propose_static(self.runner, self.cache, anchors, self.k)

    def forward(self, ids: torch.Tensor, batch: SpecBatch) -> torch.Tensor:
        """Target forward (+ drafter context rows of the same positions) -> logits [rows, T, V]."""
        batch.plan()
        if self.runner is None:
            return self.target(ids, batch=batch)
        logits, aux = self.target(ids, batch=batch, aux_layer_ids=self.aux_ids)
        self.runner.write_context(batch, aux)
        return logits

    def run(self) -> torch.Tensor:
        """-> packed [rows, 2 + k]: column 0 = accepted drafts a, then the emitted tokens d1..da, next (-1 after)."""
        if self.k == 0:
            nxt = self.forward(self.pending[:, None], self.batch)[:, -1].argmax(-1)
            self.batch.commit()
            self.pending.copy_(nxt)
            return torch.stack([torch.zeros_like(nxt), nxt], 1)
        drafts = self.propose(self.pending)  # [rows, k]
        logits = self.forward(torch.cat([self.pending[:, None], drafts], 1), self.batch)  # [rows, k+1, V]
        a, nxt = verify_greedy(drafts, logits, self.n_drafts)
        self.batch.commit(a + 1)
        self.pending.copy_(nxt)
        slot = torch.arange(self.k + 1, device=a.device)[None]
        toks = torch.where(slot < a[:, None], torch.cat([drafts, drafts[:, :1]], 1),
                           torch.where(slot == a[:, None], nxt[:, None], torch.full_like(slot, -1)))
        return torch.cat([a[:, None], toks], 1)


class CapturedStep:
    """A SpecStep in one CUDA graph: warm-up on a side stream (its effects on the cache and `pending` undone),
    then capture; `()` replays and returns the graph's static output (valid until the next replay). `run`: the
    step function to capture (default step.run; StaticGenerator passes its torch.compile'd form)."""

    def __init__(self, step: SpecStep, warmup: int = 2, run=None):
        if step.cache.lengths.device.type != "cuda":
            raise ValueError("CapturedStep: needs a HybridCache on a CUDA device")
        self.step = step
        run = run or step.run
        snap, pending = step.cache.snapshot(), step.pending.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                run()
        torch.cuda.current_stream().wait_stream(side)
        step.cache.restore(snap)
        step.pending.copy_(pending)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = run()
        # the graph reads the MoE layers' stacked expert weights: keep them alive even if they are re-stacked
        self.keep = [m._stacked for m in step.target.modules() if isinstance(m, LatentMoE)]

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


@dataclass
class StaticOutput:
    token_ids: list[list[int]]  # per row, max_new_tokens (or up to and including the EOS token)
    accepted_per_step: list[list[int]] = field(default_factory=list)  # per row, per decode step (speculative)
    num_drafts_per_step: list[list[int]] = field(default_factory=list)
    num_steps: int = 0  # decode steps (device steps after the prefill)
    prefill_s: float = 0.0  # wall seconds of the prefill (ends at its host read of the first tokens)
    decode_s: float = 0.0  # wall seconds of the decode steps (ends at the last step's host read)


class StaticGenerator:
    """Greedy generation for `batch_size` equal-length prompts at a time over one HybridCache, reused across
    calls (graphs are captured once, at the first generate). drafter None: AR; else speculative with k drafts.
    compile=True runs the decode step through torch.compile (inductor fuses the element-wise chains of the norms,
    activations, routing and acceptance into a few kernels; the Triton kernels stay as they are), compiled on the
    first generate; with graphs=True the compiled step is what the CUDA graph captures."""

    def __init__(self, target, drafter=None, num_speculative_tokens: int | None = None, max_len: int = 1024,
                 batch_size: int = 1, graphs: bool = False, compile: bool = False):
        attn, kda = target.cache_layout()
        self.target, self.graphs, self.runner, self.k = target, graphs, None, 0
        extra = {}
        if drafter is not None:
            nd = drafter.config.num_drafts
            self.k = nd if num_speculative_tokens is None else num_speculative_tokens
            if not 1 <= self.k <= nd:
                raise ValueError(f"num_speculative_tokens: expected 1..{nd} for this drafter, got {self.k}")
            self.runner = DraftRunner(drafter, layer_offset=1 + max(list(attn) + list(kda)))
            extra = self.runner.cache_layout()
        self.cache = HybridCache(target, batch_size, max_len, extra)
        self.step = SpecStep(target, self.runner, self.cache, batch_size, self.k)
        self.moe_tokens = batch_size * (self.k + 1)  # MoE forwards up to a step's size take the graph-safe path
        self.captured: CapturedStep | None = None
        self.run = self.step.run
        if compile:
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)  # a step per generator
            self.run = torch.compile(self.step.run, dynamic=False)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, P] into the emptied cache -> the first greedy tokens [B] (also the step's pending tokens)."""
        self.cache.reset()
        batch = SpecBatch(self.cache, ids.shape[0], ids.shape[1])
        tok = self.step.forward(ids, batch)[:, -1].argmax(-1)
        batch.commit()
        self.step.pending.copy_(tok)
        return tok

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, eos_token_id: int | None = None) -> StaticOutput:
        """prompt_ids: one list of ids or [B, P] -> StaticOutput (rows stop at max_new_tokens or eos_token_id).
        One host read per step: the packed [a, tokens] of every row."""
        dev = self.cache.lengths.device
        ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=dev)
        ids = ids[None] if ids.dim() == 1 else ids
        B, P = ids.shape
        if B != self.cache.B:
            raise ValueError(f"prompt_ids: expected {self.cache.B} rows (batch_size), got {B}")
        if P + max_new_tokens + self.k + 1 > self.cache.max_len:
            raise ValueError(f"max_len: {P} prompt + {max_new_tokens} new + {self.k + 1} verify tokens exceed "
                             f"max_len={self.cache.max_len}")
        prev_moe = set_static_moe(self.target, self.moe_tokens)
        try:
            t0 = time.perf_counter()
            first = self.prefill(ids).tolist()  # host read: the device is done
            t1 = time.perf_counter()
            if self.graphs and self.captured is None:
                self.captured = CapturedStep(self.step, run=self.run)
            t2 = time.perf_counter()
            out = self._decode(first, max_new_tokens, eos_token_id, self.captured if self.graphs else self.run)
            out.prefill_s, out.decode_s = t1 - t0, time.perf_counter() - t2
            return out
        finally:
            set_static_moe(self.target, prev_moe)

    def _decode(self, first: list[int], max_new: int, eos: int | None, run) -> StaticOutput:
        B, k = len(first), self.k
        out = StaticOutput([[t] for t in first], [[] for _ in first], [[] for _ in first])
        done = [max_new <= 1 or t == eos for t in first]
        n_host = [k] * B
        while not all(done):
            n = [0 if done[b] else max(0, min(k, max_new - len(out.token_ids[b]) - 1)) for b in range(B)]
            if n != n_host:  # only near the end: fewer drafts so no row overshoots max_new_tokens
                self.step.n_drafts.copy_(torch.tensor(n))
                n_host = n
            packed = run().tolist()  # the one host read of the step
            out.num_steps += 1
            for b in range(B):
                if done[b]:
                    continue
                a = packed[b][0]
                toks = packed[b][1: a + 2][: max_new - len(out.token_ids[b])]
                if eos is not None and eos in toks:
                    toks = toks[: toks.index(eos) + 1]
                out.token_ids[b] += toks
                if k:
                    out.accepted_per_step[b].append(a)
                    out.num_drafts_per_step[b].append(n[b])
                done[b] = len(out.token_ids[b]) >= max_new or (eos is not None and toks[-1] == eos)
        self.step.n_drafts.fill_(k)
        return out


def _one_shot(target, drafter, prompt_ids, max_new_tokens, graphs, num_speculative_tokens, max_len):
    ids = torch.as_tensor(prompt_ids)
    ids = ids[None] if ids.dim() == 1 else ids
    k = 0 if drafter is None else (num_speculative_tokens or drafter.config.num_drafts)
    max_len = max_len or _round_up(ids.shape[1] + max_new_tokens + k + 1, 64)
    gen = StaticGenerator(target, drafter, num_speculative_tokens, max_len, ids.shape[0], graphs)
    return gen.generate(ids, max_new_tokens)


def generate_spec_greedy(target, drafter, prompt_ids, max_new_tokens: int, graphs: bool = False,
                         num_speculative_tokens: int | None = None, max_len: int | None = None) -> StaticOutput:
    """Greedy speculative decoding on the static path (== Engine(target, drafter) greedy, token for token)."""
    return _one_shot(target, drafter, prompt_ids, max_new_tokens, graphs, num_speculative_tokens, max_len)


def generate_ar_greedy(target, prompt_ids, max_new_tokens: int, graphs: bool = False,
                       max_len: int | None = None) -> StaticOutput:
    """Greedy autoregressive decoding on the static path (== Engine(target) greedy)."""
    return _one_shot(target, None, prompt_ids, max_new_tokens, graphs, None, max_len)


@dataclass
class StaticRequestOutput:  # the RequestOutput fields `python -m eval` reads
    token_ids: list[int]
    accepted_per_step: list[int]
    num_drafts_per_step: list[int]
    num_steps: int


class StaticEngine:
    """`Engine.generate(prompts, params)` over a bs=1 StaticGenerator (`python -m eval --engine static`): greedy
    requests one at a time, max_tokens and EOS (unless ignore_eos) honoured; graphs captured at the first request."""

    def __init__(self, target, drafter=None, num_speculative_tokens: int | None = None, max_len: int = 1024,
                 graphs: bool = False):
        self.gen = StaticGenerator(target, drafter, num_speculative_tokens, max_len, 1, graphs)
        eos = getattr(target.config, "eos_token_id", None)
        self.eos = eos if isinstance(eos, int) else None

    def generate(self, prompts, params) -> list[StaticRequestOutput]:
        params = params if isinstance(params, list) else [params] * len(prompts)
        outs = []
        for ids, p in zip(prompts, params):
            if p.temperature != 0:
                raise ValueError("StaticEngine: greedy only (temperature 0)")
            o = self.gen.generate(list(ids), p.max_tokens, None if p.ignore_eos else self.eos)
            acc = o.accepted_per_step[0] if o.accepted_per_step else []
            drafted = o.num_drafts_per_step[0] if o.num_drafts_per_step else []
            outs.append(StaticRequestOutput(o.token_ids[0], acc, drafted, o.num_steps))
        return outs


__all__ = ["HybridCache", "SpecBatch", "propose_static", "SpecStep", "CapturedStep", "StaticOutput",
           "StaticGenerator", "StaticEngine", "generate_spec_greedy", "generate_ar_greedy"]
