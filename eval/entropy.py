"""The target's per-token entropy on generated text, teacher-forced.

For a prompt p and a generated continuation g, one full causal forward of the target over p + g gives, at every
generated position t, the distribution that produced g_t: softmax(logits[len(p) + t - 1]). Its entropy
H_t = -sum_x p(x) log p(x) (nats, over the full vocabulary, at temperature 1 from the raw logits) is the task's
"difficulty" for a drafter; the task entropy is the mean of H_t over all generated tokens.
"""
from __future__ import annotations

import torch

from eval.measure import pooled_ratio_ci95


def entropy_of_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[..., V] logits -> [...] entropies in nats (fp32; 0 * log 0 counts as 0)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)


@torch.no_grad()
def generated_entropies(target, prompt_ids: list[int], generated_ids: list[int], temperature: float = 1.0
                        ) -> list[float]:
    """Per-token entropy of the target's distribution at each generated position (len == len(generated_ids))."""
    if not prompt_ids:
        raise ValueError("prompt_ids: empty; the first generated token needs a prompt position")
    if not generated_ids:
        return []
    device = next(target.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(generated_ids)], dtype=torch.long, device=device)
    out = target(ids)
    logits = out[0] if isinstance(out, tuple) else out  # [1, T, V]
    L = len(prompt_ids)
    return entropy_of_logits(logits[0, L - 1: L - 1 + len(generated_ids)], temperature).tolist()


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def bootstrap_ci(per_prompt: list[list[float]], n_boot: int = 1000, seed: int = 0) -> list[float] | None:
    """95% bootstrap CI of the token-pooled mean entropy, resampling prompts (tokens of a prompt are correlated)."""
    per_prompt = [p for p in per_prompt if p]
    return pooled_ratio_ci95([[sum(p) for p in per_prompt]], [[len(p) for p in per_prompt]], n_boot, seed)
