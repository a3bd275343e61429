"""Drafter losses: decayed CE on what the target says, distillation, teacher-forced Markov, confidence BCE."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossWeights:
    ce: float = 1.0
    distill: float = 0.0  # TV distance to the target's distribution at the aligned position
    confidence: float = 0.1
    decay_gamma: float | None = None  # w_d = exp(-d / gamma); None = block_size (DFlash: 7 for 16, 4 for 8)


def drafter_loss(drafter, h: torch.Tensor, anchor_tokens: torch.Tensor, labels: torch.Tensor,
                 target_logits: torch.Tensor | None, w: LossWeights) -> tuple[torch.Tensor, dict]:
    """h: [B, A, D, H] draft hidden states; anchor_tokens: [B, A]; labels: [B, A, D] (token each draft should
    be, -100 = ignore); target_logits: [B, A, D, V] at the aligned positions (for distillation) or None.

    The Markov head is teacher-forced: prev_0 = anchor, prev_d = labels[d-1] (what an accepted draft is).
    Returns the loss and metrics, incl. the greedy accepted length per block under that teacher forcing, which
    equals the real greedy accepted length: while every earlier draft is correct, the drafter's own previous
    draft is the label."""
    B, A, D, _ = h.shape
    prev = torch.cat([anchor_tokens[..., None], labels[..., :-1].clamp(min=0)], dim=-1)  # [B, A, D]
    bias, m = drafter.markov(prev)
    logits = drafter.base_logits(h) + bias  # [B, A, D, V] fp32
    valid = labels >= 0
    gamma = w.decay_gamma or float(drafter.config.block_size)
    pos_w = torch.exp(-torch.arange(D, device=h.device, dtype=torch.float32) / gamma)
    wgt = pos_w * valid  # [B, A, D]
    denom = wgt.sum().clamp(min=1.0)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten().clamp(min=0), reduction="none").view(B, A, D)
    loss = w.ce * (ce * wgt).sum() / denom
    metrics = {"ce": float((ce.detach() * wgt).sum() / denom)}
    if w.distill and target_logits is not None:
        tv = 0.5 * (logits.softmax(-1) - target_logits.float().softmax(-1)).abs().sum(-1)  # [B, A, D]
        loss = loss + w.distill * (tv * wgt).sum() / denom
        metrics["tv"] = float((tv.detach() * wgt).sum() / denom)
    correct = (logits.argmax(-1) == labels) & valid  # [B, A, D]
    conf = drafter.confidence(h.detach(), None if m is None else m.detach())
    if conf is not None and w.confidence:
        bce = F.binary_cross_entropy_with_logits(conf, correct.float(), reduction="none")
        loss = loss + w.confidence * (bce * valid).sum() / valid.sum().clamp(min=1)
        metrics["conf_bce"] = float((bce.detach() * valid).sum() / valid.sum().clamp(min=1))
    accepted = correct.long().cumprod(-1).sum(-1).float()  # [B, A]
    metrics["tau"] = float(1 + accepted.mean())
    metrics.update({f"acc{d}": float(correct[..., d].sum() / valid[..., d].sum().clamp(min=1)) for d in range(D)})
    return loss, metrics
