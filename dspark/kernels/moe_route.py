"""LatentMoE routing in one pass per token: router scores, biased top-k, the routing weights (docs/k3-model.md, "LatentMoE").

  s = act(x @ W^T) in fp32 (act: sigmoid or softmax over the E experts)          x [N, H], W [E, H]
  selection on s + bias (bias [E] fp32, Quantile Balancing's; group-limited when num_groups > 1)
  w = s at the selected experts, / (sum + 1e-20) when renormalize, * scaling
moe_route_ref also returns s and the Quantile Balancing cutoff (the (k+1)-th biased score) that training records.
Kernel (inference, num_groups = 1): one program per token; [E, BLOCK_H] fp32 partial products of W's rows with x,
reduced once; top-k by k rounds of max (the lowest index among equal scores); writes idx [N, k] int64, w [N, k] fp32.
In eager torch the same is about a dozen kernels per MoE layer (casts, matmul, sigmoid, add, topk, gather, sum, div,
mul), seven layers in a k3-mini step.
"""
from __future__ import annotations

import torch

from dspark.kernels import next_pow2, tl, triton, use_triton


def moe_route_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, activation: str = "sigmoid",
                  renormalize: bool = True, scaling: float = 1.0, num_groups: int = 1, topk_group: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H] -> (idx [N, k], w [N, k] fp32, s [N, E] fp32, cutoff [N]: -inf when k = E). Differentiable in w."""
    logits = x.float() @ weight.float().t()
    s = torch.sigmoid(logits) if activation == "sigmoid" else torch.softmax(logits, -1)
    biased = s + bias
    E = s.shape[-1]
    if num_groups > 1:  # group score = sum of the top-2 biased scores in the group; keep topk_group groups
        N = s.shape[0]
        grouped = biased.view(N, num_groups, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), -1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, group_score.topk(topk_group, -1).indices,
                                                                        True)
        biased = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, -1)
    kk = min(top_k + 1, E)
    top_vals, top_idx = biased.topk(kk, -1)
    idx = top_idx[:, :top_k]
    cutoff = top_vals[:, top_k] if kk > top_k else torch.full_like(top_vals[:, 0], float("-inf"))
    w = s.gather(1, idx)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * scaling, s, cutoff


@triton.jit
def _route_kernel(x_ptr, w_ptr, b_ptr, idx_ptr, wt_ptr, E, H, stride_x, stride_w, scaling,
                  TOP_K: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr, BE: tl.constexpr,
                  BK: tl.constexpr, BLOCK_H: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    re = tl.arange(0, BE)
    em = re < E
    acc = tl.zeros([BE, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        rh = h0 + tl.arange(0, BLOCK_H)
        hm = rh < H
        xv = tl.load(x_ptr + n * stride_x + rh, mask=hm, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + re[:, None] * stride_w + rh[None, :], mask=em[:, None] & hm[None, :], other=0.0)
        acc += wv.to(tl.float32) * xv[None, :]
    logits = tl.sum(acc, 1)  # [BE]
    if SIGMOID:
        s = tl.sigmoid(logits)
    else:
        z = tl.where(em, logits, float("-inf"))
        p = tl.exp(z - tl.max(z, 0))
        s = p / tl.sum(p, 0)
    biased = tl.where(em, s + tl.load(b_ptr + re, mask=em, other=0.0), float("-inf"))
    rk = tl.arange(0, BK)
    picks = tl.zeros([BK], dtype=tl.int64)
    ws = tl.zeros([BK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(biased, 0)
        pick = tl.min(tl.where(biased == best, re, BE), 0)
        picks = tl.where(rk == j, pick, picks)
        ws = tl.where(rk == j, tl.sum(tl.where(re == pick, s, 0.0), 0), ws)
        biased = tl.where(re == pick, float("-inf"), biased)
    if RENORM:
        ws = ws / (tl.sum(ws, 0) + 1e-20)
    km = rk < TOP_K
    tl.store(idx_ptr + n * TOP_K + rk, picks, mask=km)
    tl.store(wt_ptr + n * TOP_K + rk, ws * scaling, mask=km)


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def moe_route_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                     activation: str = "sigmoid", renormalize: bool = True, scaling: float = 1.0,
                     block_h: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (idx [N, k] int64, w [N, k] fp32); num_groups = 1 only."""
    N, H = x.shape
    E = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    idx = torch.empty(N, top_k, dtype=torch.int64, device=x.device)
    w = torch.empty(N, top_k, dtype=torch.float32, device=x.device)
    if N == 0:
        return idx, w
    BE = next_pow2(E)
    BLOCK_H = block_h or max(16, min(256, next_pow2(H), 4096 // BE))
    _route_kernel[(N,)](x, weight, bias, idx, w, E, H, x.stride(0), weight.stride(0), float(scaling),
                        TOP_K=top_k, SIGMOID=activation == "sigmoid", RENORM=renormalize, BE=BE,
                        BK=next_pow2(top_k), BLOCK_H=BLOCK_H, num_warps=4)
    return idx, w


def moe_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, activation: str = "sigmoid",
              renormalize: bool = True, scaling: float = 1.0, num_groups: int = 1, topk_group: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (idx [N, k], w [N, k] fp32): the kernel for inference on CUDA (or under the interpreter) with
    ungrouped selection, else the reference's first two outputs."""
    if (num_groups == 1 and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and use_triton(x, weight)):
        return moe_route_triton(x, weight, bias, top_k, activation, renormalize, scaling)
    return moe_route_ref(x, weight, bias, top_k, activation, renormalize, scaling, num_groups, topk_group)[:2]
