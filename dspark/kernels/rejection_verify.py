"""Rejection verification (Leviathan et al.) of a sampled speculative step in one launch, for rows whose sampling
rule is a temperature alone (no top-k / top-p); temperature-0 rows are verified greedily by the same rule.

  logits [B, K+1, V] the target's (any float dtype), t [B] fp32 (<= 0: greedy), drafts [B, K] long (-1: a
  placeholder, always rejected), n [B] long (drafts each row may verify), q [B, K, V] fp32 the drafter's
  distributions (None: argmax drafts, q one-hot), u [B, K+1] (u[:, :K] accept, u[:, K] draws the next token)
  ->  (a [B] long: drafts accepted, next [B] long: the token after them)

p_i = temperature_softmax(logits_i, t) (a one-hot at the first argmax where t <= 0); draft i is accepted when
u_i * q_i(d_i) < p_i(d_i), up to the first rejection; the next token is drawn by inverse CDF from max(p_a - q_a, 0)
(p_a itself when that has no mass, or when every draft was accepted). On a greedy row p is one-hot, so this accepts
exactly the drafts equal to the argmax and returns the argmax after them, as greedy verification does.

In torch that is some 40 kernels (the softmax of K+1 positions, the drafter's one-hots, gathers, the acceptance scan,
the residual and its draw). Kernel: one program per row: K+1 online-softmax passes over V (max, sum of
exp((x - max) / t), first argmax), the acceptance loop on scalars, then two passes over the residual at position a
(its mass, then the inverse-CDF scan). A row's passes are serial, so the fused form is for vocabularies up to
MAX_VOCAB (the dispatcher falls back to the reference above it).
"""
from __future__ import annotations

import torch

from dspark.kernels import next_pow2, tl, triton, use_triton
from dspark.kernels.inverse_cdf import inverse_cdf_ref
from dspark.kernels.temperature_softmax import TEMPERATURE_FLOOR, temperature_softmax_ref

BLOCK = 1024  # columns per chunk
MAX_VOCAB = 65536  # above this a row's serial passes cost more than the torch kernels' grid-wide ones


def rejection_verify_ref(logits: torch.Tensor, t: torch.Tensor, drafts: torch.Tensor, n: torch.Tensor,
                         q: torch.Tensor | None, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch definition (dspark.spec.verify.verify_rejection on the temperature softmax)."""
    B, K = drafts.shape
    p = temperature_softmax_ref(logits, t.float()[:, None].expand(B, K + 1))  # [B, K+1, V]
    slot = torch.arange(K, device=drafts.device)[None]
    n_eff = ((drafts >= 0) & (slot < n.clamp(0, K)[:, None])).long().cumprod(1).sum(1)  # [B]
    ids = drafts.clamp(min=0)[..., None]
    px = p[:, :K].gather(-1, ids)[..., 0]
    qx = torch.ones_like(px) if q is None else q.float().gather(-1, ids)[..., 0]
    ok = (u[:, :K] * qx < px) & (slot < n_eff[:, None])
    a = ok.long().cumprod(1).sum(1)  # [B]
    rows = torch.arange(B, device=drafts.device)
    p_a = p[rows, a]  # [B, V]
    at = a.clamp(max=max(K - 1, 0))
    if K == 0:
        q_a = torch.zeros_like(p_a)
    elif q is None:
        q_a = torch.zeros_like(p_a).scatter_(-1, drafts[rows, at].clamp(min=0)[:, None], 1.0)
    else:
        q_a = q.float()[rows, at]
    q_a = torch.where((a < n_eff)[:, None], q_a, torch.zeros_like(q_a))
    w = (p_a - q_a).clamp(min=0)
    w = torch.where(w.sum(-1, keepdim=True) <= 0, p_a, w)
    return a, inverse_cdf_ref(w, u[:, K])


@triton.jit
def _residual(row, qrow, cols, V, q_lim, d_a, arg_a, m_a, s_a, div, greedy, HAS_Q: tl.constexpr):
    """Columns `cols` of the target's p at position a (its max m_a, sum s_a, argmax arg_a; one-hot where greedy) and
    of the residual max(p - q_a, 0) (q_a counted below q_lim: a draft was verified there)."""
    cm = cols < V
    x = tl.load(row + cols, mask=cm, other=-float("inf")).to(tl.float32)
    p = tl.where(greedy, (cols == arg_a).to(tl.float32), tl.exp((x - m_a) / div) / s_a)
    p = tl.where(cm, p, 0.0)
    if HAS_Q:
        qv = tl.load(qrow + cols, mask=cols < q_lim, other=0.0)
    else:
        qv = ((cols == d_a) & (cols < q_lim)).to(tl.float32)
    return p, tl.maximum(p - qv, 0.0)


@triton.jit
def _verify_kernel(x_ptr, t_ptr, d_ptr, n_ptr, q_ptr, u_ptr, a_ptr, nxt_ptr, K, V, s_d,
                   KP: tl.constexpr, BLOCK: tl.constexpr, HAS_Q: tl.constexpr, FLOOR: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + b).to(tl.float32)
    greedy = t <= 0
    div = tl.where(greedy, 1.0, tl.maximum(t, FLOOR))
    ki = tl.arange(0, KP)
    mx = tl.zeros([KP], dtype=tl.float32)
    sm = tl.zeros([KP], dtype=tl.float32)
    am = tl.zeros([KP], dtype=tl.int64)
    # ---- the softmax statistics of each position: max, sum of exp((x - max) / div), first argmax
    for i in range(0, K + 1):
        row = x_ptr + (b * (K + 1) + i) * V
        m_run = tl.full([], -float("inf"), tl.float32)
        s_run = tl.full([], 0.0, tl.float32)
        arg = tl.full([], 0, tl.int64)
        for v0 in range(0, V, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            x = tl.load(row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
            cm = tl.max(x, 0)
            carg = tl.min(tl.where(x == cm, cols, V), 0).to(tl.int64)
            new_m = tl.maximum(m_run, cm)
            s_run = s_run * tl.exp((m_run - new_m) / div) + tl.sum(tl.exp((x - new_m) / div), 0)
            arg = tl.where(cm > m_run, carg, arg)
            m_run = new_m
        mx = tl.where(ki == i, m_run, mx)
        sm = tl.where(ki == i, s_run, sm)
        am = tl.where(ki == i, arg, am)
    # ---- acceptance, up to the first rejection; n_eff: the drafts before the first placeholder, at most n
    nn = tl.minimum(tl.maximum(tl.load(n_ptr + b), 0), K)
    a = nn * 0
    n_eff = nn * 0
    live = nn * 0 + 1
    real = nn * 0 + 1
    for i in range(0, K):
        d = tl.load(d_ptr + b * s_d + i)
        real = real * ((d >= 0) & (i < nn)).to(tl.int64)
        n_eff += real
        dc = tl.maximum(d, 0)
        xd = tl.load(x_ptr + (b * (K + 1) + i) * V + dc).to(tl.float32)
        m_i = tl.sum(tl.where(ki == i, mx, 0.0), 0)
        s_i = tl.sum(tl.where(ki == i, sm, 0.0), 0)
        a_i = tl.sum(tl.where(ki == i, am, 0), 0)
        px = tl.where(greedy, (dc == a_i).to(tl.float32), tl.exp((xd - m_i) / div) / s_i)
        if HAS_Q:
            qx = tl.load(q_ptr + (b * K + i) * V + dc)
        else:
            qx = 1.0
        ok = (tl.load(u_ptr + b * (K + 1) + i) * qx < px) & (real > 0) & (live > 0)
        live = live * ok.to(tl.int64)
        a += live
    # ---- the next token: inverse CDF over w = max(p_a - q_a, 0), or p_a where w has no mass
    m_a = tl.sum(tl.where(ki == a, mx, 0.0), 0)
    s_a = tl.sum(tl.where(ki == a, sm, 0.0), 0)
    arg_a = tl.sum(tl.where(ki == a, am, 0), 0)
    row = x_ptr + (b * (K + 1) + a) * V
    q_live = a < n_eff
    q_lim = tl.where(q_live, V, 0)  # q_a counts only where a draft was verified there
    qrow = q_ptr + (b * K + tl.minimum(a, K - 1)) * V
    d_a = tl.load(d_ptr + b * s_d + tl.minimum(a, K - 1))
    tot_w = tl.full([], 0.0, tl.float32)
    tot_p = tl.full([], 0.0, tl.float32)
    last_w = tl.full([], -1, tl.int32)
    last_p = tl.full([], -1, tl.int32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        p, w = _residual(row, qrow, cols, V, q_lim, d_a, arg_a, m_a, s_a, div, greedy, HAS_Q)
        tot_w += tl.sum(w, 0)
        tot_p += tl.sum(p, 0)
        last_w = tl.maximum(last_w, tl.max(tl.where(w > 0, cols, -1), 0))
        last_p = tl.maximum(last_p, tl.max(tl.where(p > 0, cols, -1), 0))
    use_p = tot_w <= 0
    target = tl.load(u_ptr + b * (K + 1) + K) * tl.where(use_p, tot_p, tot_w)
    run = tl.full([], 0.0, tl.float32)
    pick = tl.full([], V, tl.int32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        p, w = _residual(row, qrow, cols, V, q_lim, d_a, arg_a, m_a, s_a, div, greedy, HAS_Q)
        w = tl.where(use_p, p, w)
        c = run + tl.cumsum(w, 0)
        pick = tl.minimum(pick, tl.min(tl.where((c > target) & (w > 0) & (cols < V), cols, V), 0))
        run += tl.sum(w, 0)
    last = tl.where(use_p, last_p, last_w)
    tl.store(a_ptr + b, a)
    tl.store(nxt_ptr + b, tl.where(pick < V, pick, tl.maximum(last, 0)).to(tl.int64))


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def rejection_verify_triton(logits, t, drafts, n, q, u, block: int = BLOCK):
    B, K = drafts.shape
    V = logits.shape[-1]
    a = torch.empty(B, dtype=torch.long, device=logits.device)
    nxt = torch.empty(B, dtype=torch.long, device=logits.device)
    if B == 0:
        return a, nxt
    if K == 0:
        return rejection_verify_ref(logits, t, drafts, n, q, u)
    x = logits.contiguous()
    qq = q.float().contiguous() if q is not None else x
    d = drafts if drafts.stride(1) == 1 else drafts.contiguous()  # rows of any stride (a view of [anchor | drafts])
    _verify_kernel[(B,)](x, t.float().contiguous(), d, n.long().contiguous(), qq,
                         u.float().contiguous(), a, nxt, K, V, d.stride(0), KP=next_pow2(K + 1), BLOCK=block,
                         HAS_Q=q is not None, FLOOR=TEMPERATURE_FLOOR, num_warps=4)
    return a, nxt


def fused_verify_fits(logits: torch.Tensor) -> bool:
    """Whether rejection_verify runs the kernel for these logits (else the reference)."""
    return logits.shape[-1] <= MAX_VOCAB and not torch.compiler.is_compiling() and use_triton(logits)


def rejection_verify(logits, t, drafts, n, q, u):
    """The kernel on CUDA (or under the interpreter) up to MAX_VOCAB, else the reference."""
    if fused_verify_fits(logits):
        return rejection_verify_triton(logits, t, drafts, n, q, u)
    return rejection_verify_ref(logits, t, drafts, n, q, u)
