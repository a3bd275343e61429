"""Verification of drafted tokens against the target: greedy, Leviathan rejection sampling, block verification
(Sun et al. 2024), and the adaptive verification budget. Pure torch over batch-first fp32 tensors.

Shapes: B requests, k draft slots, V vocab. `draft_ids [B, k]` (−1 = placeholder, always rejected), `num_drafts [B]`
(row b verifies only its first num_drafts[b] slots), target distributions `[B, k+1, V]` where position i is the
distribution of the token after t0, d1..di (so position num_drafts[b] gives the bonus token).
Every verifier returns `(num_accepted [B] long, next_token [B] long)`: the row emits d1..d_a then next_token.
The sampled verifiers take uniforms `u [B, k+1]` (from `counter_uniform`): u[:, :k] decide acceptance, u[:, k]
draws the next token. They run on the device without host syncs, so one CUDA graph can hold them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from dspark.kernels.greedy_verify import accept_greedy, effective_drafts
from dspark.kernels.rejection_verify import fused_verify_fits, rejection_verify
from dspark.spec.sampling import RowSampling, process_logits, sample_from

__all__ = ["PLACEHOLDER", "choose_verify_lengths", "choose_verify_lengths_device", "process_logits", "verify_block",
           "verify_greedy", "verify_rejection", "verify_sampled"]

PLACEHOLDER = -1


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


def _uniforms(u, B: int, k: int, device) -> torch.Tensor:
    """u [B, k+1] checked."""
    if tuple(u.shape) != (B, k + 1):
        raise ValueError(f"u: expected uniforms [B, k+1] = [{B}, {k + 1}], got {list(u.shape)}")
    return u


def _sample(weights: torch.Tensor, fallback: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [B, V] >= 0 (unnormalised); rows with zero mass sample from fallback [B, V]. u [B]."""
    empty = weights.sum(-1, keepdim=True) <= 0
    return sample_from(torch.where(empty, fallback, weights), u)


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor, num_drafts):
    """Accept the longest prefix with draft == target argmax; next token = target argmax after it."""
    return accept_greedy(draft_ids, target_logits.argmax(-1), num_drafts)


def verify_rejection(draft_ids, draft_probs, target_probs, num_drafts, u: torch.Tensor):
    """Leviathan et al.: accept d_i when u_i · q(d_i) < p(d_i) (probability min(1, p/q)) until the first
    rejection, which resamples from norm(max(p − q, 0)); if every draft is accepted, the bonus comes from p at
    position n. u [B, k+1]: u[:, i] decides slot i, u[:, k] draws the next token."""
    B, k = draft_ids.shape
    V = target_probs.shape[-1]
    n = effective_drafts(draft_ids, num_drafts)
    p = target_probs.float()
    q = _draft_dists(draft_ids, draft_probs, V)
    u = _uniforms(u, B, k, p.device)
    px, qx = _gather(p[:, :k], draft_ids), _gather(q, draft_ids)
    ok = (u[:, :k] * qx < px) & (torch.arange(k, device=p.device)[None] < n[:, None])
    acc = ok.long().cumprod(1).sum(1)  # [B]
    rows = torch.arange(B, device=p.device)
    p_a = p[rows, acc]  # [B, V]
    return acc, _sample((p_a - _q_at(q, acc, n)).clamp(min=0), p_a, u[:, k])


def verify_block(draft_ids, draft_probs, target_probs, num_drafts, u: torch.Tensor):
    """Block verification (Sun et al. 2024, Alg. 2), per row with block length γ = n:
      p_0 = 1;  p_i = min(1, p_{i−1} · p(d_i)/q(d_i))                      (clipped running joint ratio)
      ρ_i = Σ_x max(p_i · p(x | d≤i) − q(x | d≤i), 0)                       (residual mass at the next position)
      h_i = ρ_i / (ρ_i + 1 − p_i) for i < γ (1 when the denominator is 0);  h_γ = p_γ
      τ = last i in 1..γ with u_i < h_i (0 if none); emit d1..dτ, then
      Y ~ p(· | d≤γ) if τ = γ, else Y ~ norm(max(p_τ · p(· | d≤τ) − q(· | d≤τ), 0)).
    Lossless: the emitted sequence has exactly the target's distribution, and E[τ] ≥ token-wise verification.
    u [B, k+1]: u[:, i−1] is u_i, u[:, k] draws Y. Vectorised over the k slots (no loop)."""
    B, k = draft_ids.shape
    V = target_probs.shape[-1]
    n = effective_drafts(draft_ids, num_drafts)
    p = target_probs.float()
    q = _draft_dists(draft_ids, draft_probs, V)
    u = _uniforms(u, B, k, p.device)
    ratio = _gather(p[:, :k], draft_ids) / _gather(q, draft_ids).clamp(min=1e-30)  # [B, k]
    # p_i = min over j <= i of Π_{j<l<=i} ratio_l = exp(L_i − max_{j<=i} L_j), L the cumulative log-ratio (L_0 = 0)
    L = torch.cat([ratio.new_zeros(B, 1), ratio.log().cumsum(1)], 1)  # [B, k+1]
    runs = (L - L.cummax(1).values).exp()  # [B, k+1]: p_0 .. p_k
    run = runs[:, 1:]  # [B, k]: p_1 .. p_k
    rho = (run[:, :-1, None] * p[:, 1:k] - q[:, 1:k]).clamp(min=0).sum(-1)  # [B, k−1]: ρ_1 .. ρ_{k−1}
    den = rho + 1 - run[:, :-1]
    h = torch.where(den > 0, rho / den.clamp(min=1e-30), torch.ones_like(rho))
    h = torch.cat([h, run[:, -1:]], 1)  # [B, k]: h_k = p_k
    i = torch.arange(1, k + 1, device=p.device)[None]  # [1, k]
    h = torch.where(i == n[:, None], run, h)  # h_γ = p_γ
    hit = (u[:, :k] < h) & (i <= n[:, None])
    tau = (hit.long() * i).amax(1) if k else n  # [B]; n = 0 when k = 0
    rows = torch.arange(B, device=p.device)
    p_t = p[rows, tau]  # [B, V]
    run_t = runs[rows, tau]  # [B]
    return tau, _sample((run_t[:, None] * p_t - _q_at(q, tau, n)).clamp(min=0), p_t, u[:, k])


def verify_sampled(draft_ids, draft_probs, logits: torch.Tensor, sampling: RowSampling, num_drafts, u: torch.Tensor,
                   rejection: str = "standard"):
    """A batch of sampled rows (greedy ones among them) against the target's logits [B, k+1, V]: the rows' sampling
    rule (process_logits), then `rejection` ("standard": verify_rejection, "block": verify_block) on the sampled
    rows and verify_greedy on the greedy ones. Standard rejection under a temperature alone runs as one kernel
    (dspark/kernels/rejection_verify.py: the same rule, greedy rows included) where it fits."""
    if rejection == "standard" and sampling.temperature_only and fused_verify_fits(logits):
        return rejection_verify(logits, sampling.temperature, draft_ids, num_drafts, draft_probs, u)
    a, nxt = verify_greedy(draft_ids, logits, num_drafts)
    p = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    verify = verify_block if rejection == "block" else verify_rejection
    a_s, nxt_s = verify(draft_ids, draft_probs, p, num_drafts, u)
    greedy = sampling.temperature == 0
    return torch.where(greedy, a, a_s), torch.where(greedy, nxt, nxt_s)


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


def choose_verify_lengths_device(
    confidences: torch.Tensor,
    verify_cost_a: float = 2.0,
    verify_cost_b: float = 0.1,
    draft_cost: float = 1.0,
    extra_tokens: int = 0,
    budget: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """choose_verify_lengths with an affine verify cost a + b · n_tokens and draft_cost the value at R requests,
    in device ops only (no host sync, no loop over the R·k budgets): every budget is scored at once and the
    argmax is the one the host form picks. confidences [R, k] -> num_drafts [R] long, on confidences' device."""
    c = confidences.float().clamp(0, 1)
    R, k = c.shape
    flat = c.cumprod(1).flatten()  # survivals
    order = flat.argsort(descending=True, stable=True)
    if budget is None:
        gain = torch.cat([flat.new_zeros(1), flat[order].cumsum(0)]).double()  # [R*k + 1]
        n_tokens = R + extra_tokens + torch.arange(R * k + 1, dtype=torch.float64, device=c.device)
        # the host form's arithmetic, term for term (float64, then the fp32 score tensor it takes the argmax of)
        score = ((R + gain) / (draft_cost + (verify_cost_a + verify_cost_b * n_tokens))).float()
        budget = score.argmax()
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(R * k, device=c.device))  # slot -> its rank
    return (rank < budget).view(R, k).long().sum(1)
