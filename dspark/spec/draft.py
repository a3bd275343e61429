"""Drafting at inference: the drafter's context cache, the parallel block pass, and sequential Markov sampling.

Per request the drafter keeps the K/V rows of its context (one row per target position whose aux features it has
seen) in its own paged cache. A draft step: append the rows of the newly committed target positions, run the block
[anchor, mask x (N-1)] at positions p0.. (p0 = target cache length) against them, then sample left to right:
logits_j = U_j + markov(prev), prev_0 = anchor, prev_j = draft_{j-1}.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from dspark.cache.paged import PagedCache
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
            x = torch.stack([torch.multinomial(p[b], 1, generator=None if generators is None else generators[b])[0]
                             for b in range(B)])
            probs.append(p)
        else:
            x = logits.argmax(-1)
        ids.append(x)
        conf.append(None if c is None else torch.sigmoid(c))
        prev = x
    return Proposal(torch.stack(ids, 1), torch.stack(probs, 1) if sample else None,
                    None if conf[0] is None else torch.stack(conf, 1))


class DraftRunner:
    """The drafter's side of the engine: its context cache and one draft step for a batch of requests."""

    def __init__(self, drafter: DSparkDrafter, num_blocks: int, block_size: int = 16, max_requests: int = 64):
        self.drafter = drafter
        cfg = drafter.config
        row = 2 * cfg.num_key_value_heads * cfg.head_dim
        p = next(drafter.parameters())
        self.cache = PagedCache({i: row for i in range(cfg.num_hidden_layers)}, {}, num_blocks, block_size,
                                max_requests, dtype=p.dtype, device=p.device)

    def add_request(self, rid: Hashable) -> None:
        self.cache.add_request(rid)

    def free_request(self, rid: Hashable) -> None:
        self.cache.free_request(rid)

    @torch.no_grad()
    def propose(self, rids: Sequence[Hashable], new_aux: list[torch.Tensor], anchors: torch.Tensor,
                temperature: torch.Tensor, sample: bool = False, top_k: int = 0, generators=None) -> Proposal:
        """new_aux[b]: [n_b, n*Ht] aux features of request b's positions not yet in its context;
        anchors [B]: the last committed token (position p0 = context length after the append)."""
        d = self.drafter
        B, N = len(rids), d.config.block_size
        n_new = torch.tensor([a.shape[0] for a in new_aux])
        T = max(1, int(n_new.max()))
        aux = torch.zeros(B, T, new_aux[0].shape[-1], dtype=new_aux[0].dtype, device=anchors.device)
        for b, a in enumerate(new_aux):
            aux[b, : a.shape[0]] = a
        fb = self.cache.batch(rids, n_new)
        pos = fb.positions(T)
        ctx_rows = [fb.cache.attn_append(i, rows) for i, rows in enumerate(d.context_rows(d.context(aux), pos))]
        self.cache.commit()
        ctx_len = fb.num_cached + fb.num_new  # [B] = p0
        L = ctx_rows[0].shape[1]
        mask = torch.cat([(torch.arange(L)[None] < ctx_len[:, None])[:, None, :].expand(B, N, L),
                          torch.ones(B, N, N, dtype=torch.bool)], dim=-1)[:, None].to(anchors.device)
        q_pos = ctx_len[:, None].to(anchors.device) + torch.arange(N, device=anchors.device)
        h = d.backbone(d.block_tokens(anchors), q_pos, ctx_rows, mask)[:, d.draft_slots()]
        return sample_markov(d, h, anchors, temperature, sample, top_k, generators)
