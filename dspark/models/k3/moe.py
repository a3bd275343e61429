"""Stable LatentMoE with a sigmoid noaux_tc router and Quantile Balancing (k3-architecture.md §3, contract §1.6).

    (idx, p) = Router(x)                                      # full-width x, fp32
    u = sum_{e in TopK} p_e * E_e(W_down x)                   # experts run in the latent width R
    y = W_up RMSNorm_R(u) + SharedMLP(x)
Names: `block_sparse_moe.{gate, routed_expert_down_proj, routed_expert_norm, routed_expert_up_proj, experts.{e}.w1/w2/w3,
shared_experts.{gate,up,down}_proj}`.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark.models.layers import GatedMLP, RMSNorm, glu

from .config import K3TextConfig


class Expert(nn.Module):
    """w1 = gate, w3 = up [I, R]; w2 = down [R, I]. The Linears may be swapped for MXFP4Linear."""

    def __init__(self, dim: int, intermediate: int, act: str, situ_beta, situ_linear_beta):
        super().__init__()
        self.w1 = nn.Linear(dim, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, dim, bias=False)
        self.w3 = nn.Linear(dim, intermediate, bias=False)
        self.act, self.situ_beta, self.situ_linear_beta = act, situ_beta, situ_linear_beta

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.w2(glu(self.w1(z), self.w3(z), self.act, self.situ_beta, self.situ_linear_beta))


class MoEGate(nn.Module):
    """Router: weight [E, hidden]; e_score_correction_bias [E] fp32 buffer (set by Quantile Balancing, no grad)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def scores(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """x [N, hidden] -> s [N, E] fp32."""
        logits = x.float() @ self.weight.float().t()
        return torch.sigmoid(logits) if activation == "sigmoid" else torch.softmax(logits, -1)


class LatentMoE(nn.Module):
    def __init__(self, config: K3TextConfig):
        super().__init__()
        c = config
        E, H = c.num_experts, c.hidden_size
        R = c.routed_expert_hidden_size or H
        act = (c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta)
        self.num_experts, self.top_k = E, c.num_experts_per_token
        self.renormalize, self.scaling = c.moe_renormalize, c.routed_scaling_factor
        self.router_activation = c.moe_router_activation_func
        self.num_groups = c.num_expert_group if c.use_grouped_topk else 1
        self.topk_group = c.topk_group
        self.latent = c.routed_expert_hidden_size is not None
        self.gate = MoEGate(H, E)
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(H, R, bias=False)
            self.routed_expert_up_proj = nn.Linear(R, H, bias=False)
        self.routed_expert_norm = RMSNorm(R, eps=c.rms_norm_eps) if (self.latent and c.latent_moe_use_norm) else None
        self.experts = nn.ModuleList(Expert(R, c.moe_intermediate_size, *act) for _ in range(E))
        self.shared_experts = (GatedMLP(H, c.moe_intermediate_size * c.num_shared_experts, *act)
                               if c.num_shared_experts else None)
        # Quantile Balancing records: (scores [N, E], cutoffs [N]) per training forward since the last update
        self._qb_records: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- routing --------------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (topk_idx [N, k], topk_weight [N, k] fp32, scores s [N, E], cutoff alpha [N]).
        Selection on s + bias (group-limited if num_expert_group > 1), weights = unbiased s renormalised * scale.
        alpha = the (k+1)-th biased score (Quantile Balancing cutoff; -inf when k = E)."""
        s = self.gate.scores(x, self.router_activation)
        biased = s + self.gate.e_score_correction_bias
        if self.num_groups > 1:  # group score = sum of the top-2 biased scores in the group; keep topk_group groups
            N = s.shape[0]
            grouped = biased.view(N, self.num_groups, -1)
            group_score = grouped.topk(min(2, grouped.shape[-1]), -1).values.sum(-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
                1, group_score.topk(self.topk_group, -1).indices, True)
            biased = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, -1)
        kk = min(self.top_k + 1, self.num_experts)
        top_vals, top_idx = biased.topk(kk, -1)
        idx = top_idx[:, : self.top_k]
        cutoff = top_vals[:, self.top_k] if kk > self.top_k else torch.full_like(top_vals[:, 0], float("-inf"))
        w = s.gather(1, idx)
        if self.renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling, s, cutoff

    # ---- Quantile Balancing (report Eq. 14) -----------------------------------------------------------------
    @torch.no_grad()
    def update_bias(self) -> torch.Tensor | None:
        """b_hat_j = -quantile_{1-k/n}(s_:,j - alpha),  b = b_hat - mean(b_hat), over the tokens recorded since the
        last call (training forwards). Returns the new bias, or None when nothing was recorded."""
        if not self._qb_records:
            return None
        s = torch.cat([r[0] for r in self._qb_records])  # [m, E]
        alpha = torch.cat([r[1] for r in self._qb_records])  # [m]
        self._qb_records.clear()
        margins = s - alpha[:, None]
        q = 1.0 - self.top_k / self.num_experts
        b_hat = -torch.stack([torch.quantile(margins[:, j], q) for j in range(self.num_experts)])  # chunk by expert
        bias = b_hat - b_hat.mean()
        self.gate.e_score_correction_bias.copy_(bias)
        return bias

    # ---- forward --------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, hidden]
        idx, w, s, cutoff = self.route(x)
        if self.training and torch.isfinite(cutoff).all():
            self._qb_records.append((s.detach(), cutoff.detach()))
        z = self.routed_expert_down_proj(x) if self.latent else x  # [N, R]
        out = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
        flat_idx = idx.reshape(-1)  # [N*k]
        order = flat_idx.argsort(stable=True)  # sort (token, slot) pairs by expert
        counts = torch.bincount(flat_idx, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        weight_of = w.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):  # loop over the active experts only
            if n == 0:
                continue
            tok = token_of[start:start + n]
            y = self.experts[e](z[tok])
            out.index_add_(0, tok, y.float() * weight_of[start:start + n, None])
            start += n
        y = out.to(x.dtype)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        if self.latent:
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(shape)

    def expert_load(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens routed to each expert for x [.., hidden] with the current bias -> [E] (diagnostics / tests)."""
        with torch.no_grad():
            idx = self.route(x.reshape(-1, x.shape[-1]))[0]
        return torch.bincount(idx.reshape(-1), minlength=self.num_experts)
