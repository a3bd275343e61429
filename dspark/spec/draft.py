"""Drafting at inference: the drafter's context rows, the parallel block pass, and sequential Markov sampling.

Per request the drafter keeps the rows of its context (one row per target position and draft layer: [k | v] for the
qwen3 backbone, the MLA latent [kv_c | k_pe] for k3) in the target's paged cache, written right after each target
forward from its aux features; after a plain step only the projection of aux goes to a stash layer, and the rows follow
in one flush before the request drafts again. A draft step runs the block [anchor, mask x (N-1)] at positions p0..
(p0 = the target cache length) against them, then samples left to right:
logits_j = U_j + markov(prev), prev_0 = anchor, prev_j = draft_{j-1}.
Everything here is device ops only (no host reads), so the runner captures it inside its CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dspark.kernels.draft_block import draft_block
from dspark.kernels.markov_sample import markov_sample
from dspark.kernels.paged_attention import Pages
from dspark.kernels.project_rows import project_rows_
from dspark.models.drafter import DSparkDrafter
from dspark.spec.sampling import RowSampling, process_logits, sample_from


@dataclass
class Proposal:
    draft_ids: torch.Tensor  # [B, D] long
    draft_probs: torch.Tensor | None  # [B, D, V] (sampled drafts) or None (argmax drafts: one-hot q)
    confidence: torch.Tensor | None  # [B, D] conditional acceptance probabilities, or None
    tokens: torch.Tensor | None = None  # [B, D + 1] = [anchor | drafts] (draft_ids its view), where drafting wrote it

    def verify_tokens(self, anchors: torch.Tensor) -> torch.Tensor:
        """[B, D + 1] = [anchor | drafts]: the verify forward's tokens."""
        return self.tokens if self.tokens is not None else torch.cat([anchors[:, None], self.draft_ids], 1)


def sample_markov(drafter: DSparkDrafter, h: torch.Tensor, anchors: torch.Tensor, sampling: RowSampling | None = None,
                  u: torch.Tensor | None = None, draft_top_k: int = 0, confidence: bool = True) -> Proposal:
    """The drafting loop in torch, one position after another. h: [B, D, H] post-norm hidden states of the sampled
    queries; anchors: [B]. sampling None: argmax drafts; else each row samples from process_logits under its own
    parameters by inverse CDF with the uniforms u [B, D] (temperature-0 rows still take the argmax). draft_top_k > 0
    evaluates the Markov term only on the top-k base candidates per position (vLLM's dspark_draft_topk); the rest
    are -inf. confidence: the confidence head's acceptances too (where the drafter has one)."""
    D = h.shape[1]
    U = drafter.base_logits(h)  # [B, D, V] fp32, the parallel part
    if draft_top_k:
        kth = U.topk(draft_top_k, dim=-1).values[..., -1:]
        U = U.masked_fill(U < kth, float("-inf"))
    prev, ids, probs, conf = anchors, [], [], []
    for j in range(D):  # the sequential part: one tiny matvec per position
        bias, m = drafter.markov(prev)
        logits = U[:, j] + bias  # [B, V]
        c = drafter.confidence(h[:, j], m) if confidence else None
        if sampling is not None:
            p = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
            x = sample_from(p, u[:, j])
            probs.append(p)
        else:
            x = logits.argmax(-1)
        ids.append(x)
        conf.append(None if c is None else torch.sigmoid(c))
        prev = x
    return Proposal(torch.stack(ids, 1), torch.stack(probs, 1) if sampling is not None else None,
                    None if conf[0] is None else torch.stack(conf, 1))


def markov_drafts(drafter: DSparkDrafter, h: torch.Tensor, anchors: torch.Tensor,
                  temperature: torch.Tensor | None = None, seed: torch.Tensor | None = None,
                  position: torch.Tensor | None = None, confidence: bool = False) -> Proposal:
    """The drafting loop in one Markov kernel launch (dspark/kernels/markov_sample.py), for a drafter with a Markov
    head and rows under a temperature alone (no top-k / top-p). temperature None: argmax drafts. Else row b draws
    by Gumbel-max from the counter-based uniforms of (seed[b], position[b]) (temperature-0 rows take the argmax),
    which samples each draft from process_logits(logits, temperature); that distribution, q [B, D, V], is then
    formed for all positions at once from the drafted prefixes, as are the confidences."""
    d = drafter
    w1, w2, scale = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight, d.config.logit_scale
    U = d.base_logits(h)  # [B, D, V] fp32
    seq = torch.empty(U.shape[0], U.shape[1] + 1, dtype=torch.long, device=U.device)  # [anchor | drafts]
    ids = markov_sample(U, w1, w2 if scale == 1.0 else w2 * scale, anchors, temperature, seed=seed,
                        position=position, out=seq)[0]
    if temperature is None and not confidence:
        return Proposal(ids, None, None, seq)
    bias, m = d.markov(seq[:, :-1])  # each position's prev: [B, D, V], [B, D, r]
    probs = None if temperature is None else process_logits(U + bias, temperature)
    c = d.confidence(h, m) if confidence else None
    return Proposal(ids, probs, None if c is None else torch.sigmoid(c), seq)


def draft_hidden(drafter: DSparkDrafter, anchors: torch.Tensor, p0: torch.Tensor,
                 ctx_rows: list[torch.Tensor] | list[Pages]) -> torch.Tensor:
    """The parallel pass: the block [anchor, mask x (N-1)] at positions p0.. against each draft layer's context rows
    [B, L, C], or their Pages in the cache (keys < p0 visible, the block non-causal) -> the post-norm hidden states
    of the sampled queries [B, D, H]. anchors, p0: [B] on the drafter's device."""
    cfg = drafter.config
    L = ctx_rows[0].rows.shape[1] if isinstance(ctx_rows[0], Pages) else ctx_rows[0].shape[1]
    # x [B, N, H]; q_pos [B, N]; mask [B, 1, 1, L + N] additive over [context ; block], one row for all N queries:
    # the context keys before p0, the whole block (non-causal). One launch on CUDA (dspark/kernels/draft_block.py)
    x, q_pos, mask = draft_block(anchors, p0, drafter.embed_weight, cfg.mask_token_id, cfg.block_size, L,
                                 drafter.param_dtype)
    return drafter.decode(x, q_pos, ctx_rows, mask)[:, drafter.draft_slots()]


class DraftRunner:
    """The drafter's side of the engine. Its context K/V rows live in the target's paged cache as extra attention
    layers (ids offset past the target's), so they share block tables, prefix caching and export/import."""

    def __init__(self, drafter: DSparkDrafter, layer_offset: int, draft_top_k: int = 0):
        self.drafter, self.draft_top_k = drafter, draft_top_k
        cfg = drafter.config
        self.layers = [layer_offset + i for i in range(cfg.num_hidden_layers)]
        self.row_width = drafter.row_width  # qwen3: 2*n_kv*head_dim ([k | v]); k3: kv_lora+rope (MLA latent)
        self.stash_layer = layer_offset + cfg.num_hidden_layers  # ctx [H] per position of a plain step (below)
        self.hidden = draft_hidden  # the parallel pass (torch.compile'd by compile())

    def compile(self) -> None:
        self.hidden = torch.compile(draft_hidden, dynamic=True)

    def uncompile(self) -> None:
        self.hidden = draft_hidden

    def cache_layout(self) -> dict[int, int]:
        return {**{layer: self.row_width for layer in self.layers}, self.stash_layer: self.drafter.config.hidden_size}

    def write_context(self, batch, aux: torch.Tensor) -> None:
        """After a target forward over `batch`: the context rows of its positions (aux [B, T, n*Ht]). Rows of
        tokens that are later rejected are overwritten by the next forward, exactly like the target's KV."""
        self._write_rows(batch, self.drafter.context(aux))

    def _write_rows(self, batch, ctx: torch.Tensor) -> None:
        pages = [batch.cache.attn_pages(layer) for layer in self.layers]
        sinks = [None if p is None else p.sink for p in pages]  # the layers write their rows themselves
        rows = self.drafter.context_rows(ctx, batch.positions(ctx.shape[1]).to(ctx.device), sinks)
        for layer, r, sink in zip(self.layers, rows, sinks):
            if sink is None:
                batch.cache.attn_write(layer, r)

    def stash_context(self, view, parts: list[torch.Tensor]) -> None:
        """After a plain (k = 0) decode step's target forward (view: its DeviceView): only the projection of its aux
        parts (per aux layer [B, T, Ht]; ctx before its norm), one row per position in the stash layer, written by
        one kernel (dspark/kernels/project_rows.py: no cat, no separate copy). The norm and the per-layer rows
        (projections, norms, RoPE: most of the context write's kernels) wait for flush_context, which runs once
        before the request drafts again; the stash holds the projection in the drafter's dtype, so the flushed rows
        equal written ones up to the GEMM's rounding."""
        project_rows_(parts, self.drafter.project_weight, *view.attn_pages(self.stash_layer).sink)

    def flush_context(self, view) -> None:
        """The context rows of the stashed positions a view covers (view.num_cached = the first stashed position,
        num_new = how many; positions past them are written too and lie past the committed length)."""
        d = self.drafter
        self._write_rows(view, d.context_of(view.attn_read(self.stash_layer).to(d.param_dtype)))

    @torch.no_grad()
    def propose(self, view, anchors: torch.Tensor, k: int, sampling: RowSampling | None = None,
                u: torch.Tensor | None = None, seed: torch.Tensor | None = None, confidence: bool = False
                ) -> Proposal:
        """k drafts per row for anchors [B] (each row's last emitted token, at position p0 = view.num_cached),
        against the context rows the view sees. A drafter with a Markov head drafts in one kernel launch
        (markov_drafts: argmax drafts, or Gumbel-max under each row's temperature and seed [B]) unless rows filter
        (top-k / top-p) or draft_top_k is set; those take the torch loop (sample_markov, with the uniforms u)."""
        d = self.drafter
        if d.reads_pages:  # the context read in place: each layer's pool rows, keys before p0
            lim = view.num_cached[:, None]
            ctx_rows = [replace(p, lim=lim) for p in map(view.attn_pages, self.layers)]
        else:
            ctx_rows = [view.attn_rows(layer) for layer in self.layers]
        h = self.hidden(d, anchors, view.num_cached, ctx_rows)[:, :k]  # [B, k, H]
        if d.markov_head is not None and not self.draft_top_k and (sampling is None or sampling.temperature_only):
            return markov_drafts(d, h, anchors, None if sampling is None else sampling.temperature, seed,
                                 view.num_cached, confidence)
        return sample_markov(d, h, anchors, sampling, u, self.draft_top_k, confidence)
