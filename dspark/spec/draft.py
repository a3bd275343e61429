"""Drafting at inference: the drafter's context cache, the parallel block pass, and sequential Markov sampling.

Per request the drafter keeps the rows of its context (one row per target position and draft layer: [k | v] for the
qwen3 backbone, the MLA latent [kv_c | k_pe] for k3) in the target's paged cache, written right after each target
forward from its aux features. A draft step runs the block
[anchor, mask x (N-1)] at positions p0.. (p0 = target cache length) against them, then samples left to right:
logits_j = U_j + markov(prev), prev_0 = anchor, prev_j = draft_{j-1}.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from dspark.models.drafter import DSparkDrafter
from dspark.spec.verify import process_logits


@dataclass
class Proposal:
    draft_ids: torch.Tensor  # [B, D] long
    draft_probs: torch.Tensor | None  # [B, D, V] (sampled drafts) or None (argmax drafts: one-hot q)
    confidence: torch.Tensor | None  # [B, D] conditional acceptance probabilities, or None


def sample_markov(drafter: DSparkDrafter, h: torch.Tensor, anchors: torch.Tensor, temperature: torch.Tensor,
                  sample: bool, top_k: int = 0, generators=None) -> Proposal:
    """h: [B, D, H] post-norm hidden states of the sampled queries; anchors: [B]; temperature: [B].
    Greedy rows (temperature 0) or sample=False take the argmax. top_k > 0 evaluates the Markov term only on the
    top-k base candidates per position (vLLM's dspark_draft_topk); the rest are -inf."""
    B, D, _ = h.shape
    U = drafter.base_logits(h)  # [B, D, V] fp32, the parallel part
    if top_k:
        kth = U.topk(top_k, dim=-1).values[..., -1:]
        U = U.masked_fill(U < kth, float("-inf"))
    prev, ids, probs, conf = anchors, [], [], []
    for j in range(D):  # the sequential part: one tiny matvec per position
        bias, m = drafter.markov(prev)
        logits = U[:, j] + bias  # [B, V]
        c = drafter.confidence(h[:, j], m)
        if sample:
            p = process_logits(logits, temperature)
            pc = p.cpu()  # per-request CPU generators (seeded sampling)
            x = torch.stack([torch.multinomial(pc[b], 1, generator=None if generators is None else generators[b])[0]
                             for b in range(B)]).to(p.device)
            probs.append(p)
        else:
            x = logits.argmax(-1)
        ids.append(x)
        conf.append(None if c is None else torch.sigmoid(c))
        prev = x
    return Proposal(torch.stack(ids, 1), torch.stack(probs, 1) if sample else None,
                    None if conf[0] is None else torch.stack(conf, 1))


def draft_hidden(drafter: DSparkDrafter, anchors: torch.Tensor, p0: torch.Tensor, ctx_rows: list[torch.Tensor]
                 ) -> torch.Tensor:
    """The parallel pass (device ops only): the block [anchor, mask x (N-1)] at positions p0.. against each draft
    layer's context rows [B, L, C] (keys < p0 visible, the block non-causal) -> the post-norm hidden states of the
    sampled queries [B, D, H]. anchors, p0: [B] on the drafter's device."""
    B, N, L, dev = anchors.shape[0], drafter.config.block_size, ctx_rows[0].shape[1], anchors.device
    ctx_vis = (torch.arange(L, device=dev)[None] < p0[:, None])[:, None, :].expand(B, N, L)
    mask = torch.cat([ctx_vis, torch.ones(B, N, N, dtype=torch.bool, device=dev)], dim=-1)[:, None]
    q_pos = p0[:, None] + torch.arange(N, device=dev)  # [B, N]
    return drafter.backbone(drafter.block_tokens(anchors), q_pos, ctx_rows, mask)[:, drafter.draft_slots()]


class DraftRunner:
    """The drafter's side of the engine. Its context K/V rows live in the target's paged cache as extra attention
    layers (ids offset past the target's), so they share block tables, prefix caching and export/import."""

    def __init__(self, drafter: DSparkDrafter, layer_offset: int):
        self.drafter = drafter
        cfg = drafter.config
        self.layers = [layer_offset + i for i in range(cfg.num_hidden_layers)]
        self.row_width = drafter.row_width  # qwen3: 2*n_kv*head_dim ([k | v]); k3: kv_lora+rope (MLA latent)

    def cache_layout(self) -> dict[int, int]:
        return {layer: self.row_width for layer in self.layers}

    def write_context(self, batch, aux: torch.Tensor) -> None:
        """After a target forward over `batch`: the context rows of its positions (aux [B, T, n*Ht]). Rows of
        tokens that are later rejected are overwritten by the next forward, exactly like the target's KV."""
        d = self.drafter
        rows = d.context_rows(d.context(aux), batch.positions(aux.shape[1]).to(aux.device))
        for layer, r in zip(self.layers, rows):
            batch.cache.attn_append(layer, r)

    @torch.no_grad()
    def propose(self, cache, rids: Sequence[Hashable], anchors: torch.Tensor, temperature: torch.Tensor,
                sample: bool = False, top_k: int = 0, generators=None) -> Proposal:
        """anchors [B]: each request's last committed token, at position p0 = its cache length."""
        d, B = self.drafter, len(rids)
        fb = cache.batch(rids, 0)  # a read-only view: no new tokens
        empty = torch.zeros(B, 0, self.row_width, dtype=d.param_dtype, device=anchors.device)
        ctx_rows = [fb.cache.attn_append(layer, empty) for layer in self.layers]
        cache.commit()
        h = draft_hidden(d, anchors, fb.num_cached.to(anchors.device), ctx_rows)
        return sample_markov(d, h, anchors, temperature, sample, top_k, generators)
