"""Stable LatentMoE with a sigmoid noaux_tc router and Quantile Balancing (docs/k3-model.md, "LatentMoE").

    (idx, p) = Router(x)                                      # full-width x, fp32
    u = sum_{e in TopK} p_e * E_e(W_down x)                   # experts run in the latent width R
    y = W_up RMSNorm_R(u) + SharedMLP(x)
Names: `block_sparse_moe.{gate, routed_expert_down_proj, routed_expert_norm, routed_expert_up_proj, experts.{e}.w1/w2/w3,
shared_experts.{gate,up,down}_proj}` in the checkpoint; in memory the routed experts are two stacked weights
(dspark/models/k3/experts.py, the only copy, float or MXFP4).

Two ways to run the routed experts, same function:
- loop (default): sort the (token, slot) pairs by expert and run each active expert once; the active set is read on
  the host (`bincount(...).tolist()`), so it cannot be captured in a CUDA graph.
- gathered (`set_static_moe(model, max_tokens)`: forwards of N <= max_tokens tokens): every (token, slot) pair
  gathers its expert's weights from the stacks (index_select: N*k*3*I*R elements per forward, MXFP4 ones dequantised)
  and runs one bmm per projection; device ops only (graph-safe), so meant for decode / verify sizes. Once N*k >= E,
  every expert runs on every token instead (weighted by the routing, 0 where not picked): each expert's weights read
  once, no gather. Float inference on CUDA below that: a grouped matvec (kernels/decode_gemv.py grouped_gemv) reads
  each pair's expert rows in place from the stacks.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark.kernels import use_triton
from dspark.kernels.decode_gemv import grouped_gemv
from dspark.kernels.moe_combine import moe_combine
from dspark.kernels.moe_route import moe_route, moe_route_ref
from dspark.models.layers import GatedMLP, RMSNorm

from .config import K3TextConfig
from .experts import RoutedExperts

DENSE_MAX_ELEMENTS = 1 << 27  # the dense path's [N, E, 2I] activations in inference (k3-mini: prefills to 10k tokens)


class MoEGate(nn.Module):
    """Router: weight [E, hidden]; e_score_correction_bias [E] fp32 buffer (set by Quantile Balancing, no grad)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))


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
        self.experts = RoutedExperts(E, R, c.moe_intermediate_size, *act)
        self.shared_experts = (GatedMLP(H, c.moe_intermediate_size * c.num_shared_experts, *act)
                               if c.num_shared_experts else None)
        # Quantile Balancing records: (scores [N, E], cutoffs [N]) per training forward since the last update
        self._qb_records: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.static_tokens = 0  # forwards of N <= static_tokens tokens take the gathered (graph-safe) path
        # inference forwards (a prefill) take it too while every expert on every token stays small: no host read of
        # the expert counts (the loop path's, one per layer) and one matmul pair instead of a loop over experts
        self.dense_elements = DENSE_MAX_ELEMENTS

    # ---- routing --------------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (topk_idx [N, k], topk_weight [N, k] fp32, scores s [N, E], cutoff alpha [N]).
        Selection on s + bias (group-limited if num_expert_group > 1), weights = unbiased s renormalised * scale.
        alpha = the (k+1)-th biased score (Quantile Balancing cutoff; -inf when k = E)."""
        return moe_route_ref(x, *self._router())

    def _router(self) -> tuple:
        """The routing arguments of moe_route / moe_route_ref after x."""
        return (self.gate.weight, self.gate.e_score_correction_bias, self.top_k, self.router_activation,
                self.renormalize, self.scaling, self.num_groups, self.topk_group)

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
        if self.training:
            idx, w, s, cutoff = self.route(x)
            if torch.isfinite(cutoff).all():
                self._qb_records.append((s.detach(), cutoff.detach()))
        else:  # inference: one kernel on CUDA
            idx, w = moe_route(x, *self._router())
        z = self.routed_expert_down_proj(x) if self.latent else x  # [N, R]
        out = (self._experts_gathered(z, idx, w) if self._graph_safe(x.shape[0]) else self._experts_loop(z, idx, w))
        y = out.to(x.dtype)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        if self.latent:
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(shape)

    def _graph_safe(self, n: int) -> bool:
        """The gathered path for n tokens: up to static_tokens (the captured steps), and in inference while every
        expert on every token holds at most dense_elements activations (n * E * 2I; MXFP4 experts would be
        dequantised whole, so they keep the loop)."""
        ex = self.experts
        return n <= self.static_tokens or (not torch.is_grad_enabled() and not ex.mxfp4
                                           and n * ex.num_experts * 2 * ex.intermediate <= self.dense_elements)

    def _experts_loop(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """z [N, R], idx / w [N, k] -> sum_j w_j E_idx_j(z) [N, R] fp32, one matmul chain per active expert."""
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
            y = self.experts.expert(e, z[tok])
            out.index_add_(0, tok, y.float() * weight_of[start:start + n, None])
            start += n
        return out

    def stack_experts(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """([w1 | w3] [E, 2I, R], w2 [E, R, I]) of the routed experts: the parameters themselves (a per-call copy
        only for another dtype, or dequantised MXFP4 ones)."""
        return self.experts.stacks(dtype)

    def _experts_gathered(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Same as _experts_loop with device ops only, the sum in z's dtype (accumulated in fp32): per (token, slot)
        pair its expert's weights, one bmm each; when there are at least as many pairs as experts, every expert once
        on every token instead (_experts_dense)."""
        N, k = idx.shape
        ex = self.experts
        if N * k >= self.num_experts:
            return self._experts_dense(z, idx, w)
        flat = idx.reshape(-1)  # [N*k]
        if not ex.mxfp4 and not torch.is_grad_enabled() and use_triton(z, ex.w13_weight):  # read in place
            w13, w2 = ex.stacks()
            zk = z.to(w13.dtype).repeat_interleave(k, 0)  # [N*k, R], row j = token j // k
            a = ex.glu(grouped_gemv(zk, w13, flat)).contiguous()  # [N*k, I]
            return moe_combine(grouped_gemv(a, w2, flat).view(N, k, -1), w, dtype=z.dtype)
        w13, w2 = ex.stacks(self.gate.weight.dtype, flat)  # [N*k, 2I, R], [N*k, R, I]
        zk = z.to(w13.dtype)[:, None].expand(N, k, z.shape[-1]).reshape(N * k, -1, 1)  # [N*k, R, 1]
        a = ex.glu(torch.bmm(w13, zk)[..., 0])  # [N*k, I]
        y = torch.bmm(w2, a[:, :, None])[..., 0]  # [N*k, R]
        return moe_combine(y.view(N, k, -1), w, dtype=z.dtype)

    def _experts_dense(self, z, idx, w) -> torch.Tensor:
        """All E experts on all N tokens, summed with the routing weights (0 for the experts a token did not pick):
        reads each expert once, where the gathered path would read N*k experts' weights (a verify step of 9 tokens,
        top-2 of 16, reads 18). Two plain matmuls: [w1 | w3] of every expert as one [E*2I, R] weight, then one bmm
        over experts (cuBLAS picks its regular kernels: no broadcast or transposed-input batch).
        z [N, R] -> [N, R] in z's dtype (the weighted sum accumulated in fp32)."""
        w13, w2 = self.experts.stacks(self.gate.weight.dtype)
        E, N, R = w13.shape[0], z.shape[0], z.shape[-1]
        h = torch.nn.functional.linear(z.to(w13.dtype), w13.view(-1, R)).view(N, E, -1)  # [N, E, 2I]
        a = self.experts.glu(h).transpose(0, 1)  # [E, N, I]
        y = torch.bmm(a, w2.transpose(1, 2))  # [E, N, R]
        return moe_combine(y, w, idx, dtype=z.dtype)

    def expert_load(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens routed to each expert for x [.., hidden] with the current bias -> [E] (diagnostics / tests)."""
        with torch.no_grad():
            idx = self.route(x.reshape(-1, x.shape[-1]))[0]
        return torch.bincount(idx.reshape(-1), minlength=self.num_experts)


def moe_graph_safe(model: nn.Module, num_tokens: int) -> bool:
    """Whether a forward of num_tokens tokens (batch rows x new tokens) takes only graph-safe expert paths in every
    LatentMoE of `model` (no host reads: it can be captured in a CUDA graph). True for a model without one."""
    return all(m._graph_safe(num_tokens) for m in model.modules() if isinstance(m, LatentMoE))


def set_static_moe(model: nn.Module, max_tokens: int) -> int:
    """Route forwards of up to max_tokens tokens (per MoE call: batch rows x new tokens) of every LatentMoE in
    `model` through the gathered, graph-safe expert path (which reads the expert stacks in place); 0 turns it off.
    Returns the previous setting."""
    prev = 0
    for m in model.modules():
        if isinstance(m, LatentMoE):
            prev = m.static_tokens
            m.static_tokens = max_tokens
    return prev
