"""Drafter losses: decayed CE on what the target says, distillation (TV) and soft targets (KL) to the target's
distribution, teacher-forced Markov, confidence BCE (against 0/1 correctness or 1 - TV)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F


@dataclass
class LossWeights:
    ce: float = 1.0
    distill: float = 0.0  # TV distance to the target's distribution at the aligned position
    confidence: float = 0.1
    decay_gamma: float | None = None  # w_d = exp(-d / gamma); None = block_size (DFlash: 7 for 16, 4 for 8)
    kl: float = 0.0  # KL(p_target || q_draft) at the aligned position
    confidence_target: str = "correct"  # "correct": 0/1 greedy correctness; "tv": 1 - TV(q_draft, p_target)
    decay_norm: str = "weights"  # the decayed terms over the sum of the decay weights, or over the token count
    confidence_grad: bool = False  # the confidence BCE's gradient reaches the draft layers

    @classmethod
    def from_recipe(cls, loss) -> LossWeights:
        """From a recipe's LossConfig."""
        return cls(**{f.name: getattr(loss, f.name) for f in fields(cls)})

    @property
    def needs_target_logits(self) -> bool:
        """Whether a term reads the target's distribution (not only its argmax)."""
        return bool(self.distill or self.kl or (self.confidence and self.confidence_target == "tv"))


def drafter_loss(drafter, h: torch.Tensor, anchor_tokens: torch.Tensor, labels: torch.Tensor,
                 target_logits: torch.Tensor | None, w: LossWeights) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """h: [B, A, D, H] draft hidden states; anchor_tokens: [B, A]; labels: [B, A, D] (token each draft should
    be, -100 = ignore); target_logits: [B, A, D, V] at the aligned positions (for the terms that read the target's
    distribution: w.needs_target_logits) or None.

    The Markov head is teacher-forced: prev_0 = anchor, prev_d = labels[d-1] (what an accepted draft is).
    Returns (loss, metrics, accepted): metrics are 0-d tensors (read them once per step, not one sync each), incl.
    tau, the greedy accepted length per block under that teacher forcing, which equals the real greedy accepted
    length: while every earlier draft is correct, the drafter's own previous draft is the label. accepted: [B, A]
    the accepted drafts of each block (a greedy decode from anchor a starts its next block at a + accepted + 1)."""
    B, A, D, _ = h.shape
    if w.needs_target_logits and target_logits is None:
        raise ValueError("loss: distill, kl and confidence_target=tv read the target's distribution; "
                         "drafter_loss got no target_logits")
    prev = torch.cat([anchor_tokens[..., None], labels[..., :-1].clamp(min=0)], dim=-1)  # [B, A, D]
    bias, m = drafter.markov(prev)
    logits = drafter.base_logits(h) + bias  # [B, A, D, V] fp32
    valid = labels >= 0
    gamma = w.decay_gamma or float(drafter.config.block_size)
    pos_w = torch.exp(-torch.arange(D, device=h.device, dtype=torch.float32) / gamma)
    wgt = pos_w * valid  # [B, A, D]
    denom = (wgt.sum() if w.decay_norm == "weights" else valid.sum()).clamp(min=1.0)

    def decayed(x):  # [B, A, D] -> the position-decayed mean over the valid drafts
        return (x * wgt).sum() / denom

    loss = logits.new_zeros(())
    # one log-softmax over the vocabulary serves the CE and the KL, and the probabilities are formed only where a
    # term reads them: each [B, A, D, V] fp32 tensor is 1.6 GB at the k3-mini recipe's sizes
    q_log = logits.log_softmax(-1)  # [B, A, D, V]
    ce = -q_log.gather(-1, labels.clamp(min=0)[..., None])[..., 0]  # [B, A, D]
    if w.ce:
        loss = loss + w.ce * decayed(ce)
    metrics = {"ce": decayed(ce.detach())}  # also without the term: comparable between recipes
    p_log = target_logits.float().log_softmax(-1) if w.needs_target_logits else None
    tv = None
    if w.distill or (w.confidence and w.confidence_target == "tv"):
        # sum_v min(p, q) = 1 - TV(q, p): the acceptance probability of a draft sampled from q
        q = q_log.exp() if w.distill else q_log.detach().exp()
        tv = 0.5 * (q - p_log.exp()).abs().sum(-1)  # [B, A, D]
    if w.distill:
        loss = loss + w.distill * decayed(tv)
        metrics["tv"] = decayed(tv.detach())
    if w.kl:
        kl = F.kl_div(q_log, p_log, log_target=True, reduction="none").sum(-1)  # sum_v p (log p - log q): [B, A, D]
        loss = loss + w.kl * decayed(kl)
        metrics["kl"] = decayed(kl.detach())
    correct = (logits.argmax(-1) == labels) & valid  # [B, A, D]
    hc, mc = (h, m) if w.confidence_grad else (h.detach(), None if m is None else m.detach())
    conf = drafter.confidence(hc, mc)
    if conf is not None and w.confidence:
        if w.confidence_target == "tv":
            goal = 1 - tv.detach()
        else:
            goal = correct.float()
        bce = F.binary_cross_entropy_with_logits(conf, goal, reduction="none")
        loss = loss + w.confidence * (bce * valid).sum() / valid.sum().clamp(min=1)
        metrics["conf_bce"] = (bce.detach() * valid).sum() / valid.sum().clamp(min=1)
    accepted = correct.long().cumprod(-1).sum(-1)  # [B, A]
    metrics["tau"] = 1 + accepted.float().mean()
    per_draft = correct.sum((0, 1)) / valid.sum((0, 1)).clamp(min=1)  # [D]
    metrics.update({f"acc{d}": per_draft[d] for d in range(D)})
    return loss, metrics, accepted
