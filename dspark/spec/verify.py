"""Verification of drafted tokens against the target: greedy, Leviathan rejection sampling, block verification
(Sun et al. 2024), and the adaptive verification budget. Pure torch over batch-first fp32 tensors.

Shapes: B requests, k draft slots, V vocab. `draft_ids [B, k]` (−1 = placeholder, always rejected), `num_drafts [B]`
(row b verifies only its first num_drafts[b] slots), target distributions `[B, k+1, V]` where position i is the
distribution of the token after t0, d1..di (so position num_drafts[b] gives the bonus token).
Every verifier returns `(num_accepted [B] long, next_token [B] long)`: the row emits d1..d_a then next_token.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

PLACEHOLDER = -1


def process_logits(logits: torch.Tensor, temperature=1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] fp32. temperature: float or tensor broadcastable to logits[..., 0]
    (e.g. [B] for logits [B, V], or [B, 1] for [B, T, V]); 0 means greedy (one-hot argmax). top_k 0 and top_p 1
    are off. Apply the same call to target and drafter logits so both describe the same sampling rule."""
    logits = logits.float()
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    t = t.expand(logits.shape[:-1])[..., None]  # [..., 1]
    greedy = t == 0
    x = logits / torch.where(greedy, torch.ones_like(t), t)
    if top_k and top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = x.sort(dim=-1, descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        drop = (cum - srt.softmax(-1)) >= top_p  # keep the smallest prefix whose mass reaches top_p
        x = x.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    probs = x.softmax(-1)
    onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, onehot, probs)


def _effective_drafts(draft_ids: torch.Tensor, num_drafts) -> torch.Tensor:
    """[B]: num_drafts clipped to k and cut at the first placeholder (a placeholder is always rejected, which is
    the same as a block that ends just before it: the target then samples that position itself)."""
    B, k = draft_ids.shape
    n = torch.as_tensor(num_drafts, dtype=torch.long, device=draft_ids.device).expand(B).clamp(0, k)
    slot = torch.arange(k, device=draft_ids.device)[None]
    ok = (draft_ids >= 0) & (slot < n[:, None])  # [B, k]
    return ok.long().cumprod(1).sum(1)


def _gather(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # probs [B,k,V], ids [B,k] -> [B,k]
    return probs.gather(-1, ids.clamp(min=0)[..., None])[..., 0]


def _draft_dists(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, V: int) -> torch.Tensor:
    """q [B, k, V]: the drafter's distributions; None means it proposed deterministically (one-hot)."""
    if draft_probs is not None:
        return draft_probs.float()
    q = torch.zeros(*draft_ids.shape, V, device=draft_ids.device)
    return q.scatter_(-1, draft_ids.clamp(min=0)[..., None], 1.0)


def _q_at(q: torch.Tensor, idx: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """q [B, k, V] at slot idx [B] -> [B, V]; zeros where idx >= n (no draft was proposed there)."""
    B, k, V = q.shape
    if k == 0:
        return q.new_zeros(B, V)
    out = q[torch.arange(B, device=q.device), idx.clamp(max=k - 1)]
    return torch.where((idx < n)[:, None], out, torch.zeros_like(out))


def _sample(weights: torch.Tensor, fallback: torch.Tensor, generator=None) -> torch.Tensor:
    """weights [B, V] >= 0 (unnormalised); rows with zero mass sample from fallback [B, V]."""
    empty = weights.sum(-1, keepdim=True) <= 0
    w = torch.where(empty, fallback, weights)
    return torch.multinomial(w, 1, generator=generator)[:, 0]


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor, num_drafts):
    """Accept the longest prefix with draft == target argmax; next token = target argmax after it."""
    n = _effective_drafts(draft_ids, num_drafts)
    top = target_logits.argmax(-1)  # [B, k+1]
    k = draft_ids.shape[1]
    match = (draft_ids == top[:, :k]) & (torch.arange(k, device=n.device)[None] < n[:, None])
    acc = match.long().cumprod(1).sum(1)
    return acc, top.gather(1, acc[:, None])[:, 0]


def verify_rejection(draft_ids, draft_probs, target_probs, num_drafts, generator=None):
    """Leviathan et al.: accept d_i with probability min(1, p(d_i)/q(d_i)) until the first rejection, which
    resamples from norm(max(p − q, 0)); if every draft is accepted, the bonus comes from p at position n."""
    B, k = draft_ids.shape
    V = target_probs.shape[-1]
    n = _effective_drafts(draft_ids, num_drafts)
    p = target_probs.float()
    q = _draft_dists(draft_ids, draft_probs, V)
    px, qx = _gather(p[:, :k], draft_ids), _gather(q, draft_ids)
    u = torch.rand(B, k, generator=generator, device=p.device)
    ok = (u * qx < px) & (torch.arange(k, device=p.device)[None] < n[:, None])
    acc = ok.long().cumprod(1).sum(1)  # [B]
    rows = torch.arange(B, device=p.device)
    p_a = p[rows, acc]  # [B, V]
    return acc, _sample((p_a - _q_at(q, acc, n)).clamp(min=0), p_a, generator)


def verify_block(draft_ids, draft_probs, target_probs, num_drafts, generator=None):
    """Block verification (Sun et al. 2024, Alg. 2), per row with block length γ = n:
      p_0 = 1;  p_i = min(1, p_{i−1} · p(d_i)/q(d_i))                      (clipped running joint ratio)
      ρ_i = Σ_x max(p_i · p(x | d≤i) − q(x | d≤i), 0)                       (residual mass at the next position)
      h_i = ρ_i / (ρ_i + 1 − p_i) for i < γ (1 when the denominator is 0);  h_γ = p_γ
      τ = last i in 1..γ with u_i ≤ h_i (0 if none); emit d1..dτ, then
      Y ~ p(· | d≤γ) if τ = γ, else Y ~ norm(max(p_τ · p(· | d≤τ) − q(· | d≤τ), 0)).
    Lossless: the emitted sequence has exactly the target's distribution, and E[τ] ≥ token-wise verification."""
    B, k = draft_ids.shape
    V = target_probs.shape[-1]
    n = _effective_drafts(draft_ids, num_drafts)
    p = target_probs.float()
    q = _draft_dists(draft_ids, draft_probs, V)
    ratio = _gather(p[:, :k], draft_ids) / _gather(q, draft_ids).clamp(min=1e-30)  # [B, k]
    u = torch.rand(B, k, generator=generator, device=p.device)
    run = torch.ones(B, device=p.device)  # p_{i}
    runs = [run]
    tau = torch.zeros(B, dtype=torch.long, device=p.device)
    for i in range(1, k + 1):
        run = torch.minimum(run * ratio[:, i - 1], torch.ones_like(run))
        runs.append(run)
        if i < k:
            rho = (run[:, None] * p[:, i] - q[:, i]).clamp(min=0).sum(-1)
            den = rho + 1 - run
            h = torch.where(den > 0, rho / den.clamp(min=1e-30), torch.ones_like(rho))
        else:
            h = run
        h = torch.where(n == i, run, h)
        hit = (u[:, i - 1] <= h) & (i <= n)
        tau = torch.where(hit, torch.full_like(tau, i), tau)
    rows = torch.arange(B, device=p.device)
    p_t = p[rows, tau]  # [B, V]
    run_t = torch.stack(runs, 1)[rows, tau]  # [B]
    return tau, _sample((run_t[:, None] * p_t - _q_at(q, tau, n)).clamp(min=0), p_t, generator)


def choose_verify_lengths(
    confidences: torch.Tensor,
    budget: int | None = None,
    draft_cost: Callable[[int], float] = lambda n_reqs: 1.0,
    verify_cost: Callable[[int], float] = lambda n_tokens: 2.0 + 0.1 * n_tokens,
    extra_tokens: int = 0,
) -> torch.Tensor:
    """Adaptive verification. confidences [B, k]: c_i = P(draft i accepted | 1..i−1 accepted).
    Survival s_{b,i} = Π_{j≤i} c_{b,j}; the global budget (drafts verified in total) is `budget` if given, else
    B* = argmax_B (n_reqs + Σ top-B survivals) / (draft_cost(n_reqs) + verify_cost(n_reqs + extra_tokens + B)),
    i.e. expected emitted tokens per unit time (each request verifies t0 plus its drafts; `extra_tokens` counts
    other tokens in the same forward, e.g. prefill chunks). The top-B (request, step) slots by survival are
    admitted; survival falls along a row, so each row gets a prefix. Returns num_drafts [B] long."""
    c = confidences.float().clamp(0, 1)
    R, k = c.shape
    s = c.cumprod(1)  # [R, k]
    flat = s.flatten()
    order = flat.argsort(descending=True, stable=True)
    if budget is None:
        gain = torch.cat([flat.new_zeros(1), flat[order].cumsum(0)])  # [R*k + 1]: Σ top-B survivals
        d = float(draft_cost(R))
        score = torch.tensor([(R + float(gain[b])) / (d + float(verify_cost(R + extra_tokens + b)))
                              for b in range(R * k + 1)])
        budget = int(score.argmax())
    admitted = torch.zeros(R * k, dtype=torch.bool)
    admitted[order[: max(0, min(int(budget), R * k))]] = True
    return admitted.view(R, k).long().sum(1)  # ties inside a row have equal survival, so a count is a prefix
