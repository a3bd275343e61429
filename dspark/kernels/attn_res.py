"""Attention-Residuals depth mix in one pass per token (docs/k3-model.md, "Attention Residuals").

Shapes: N tokens, S candidate sources (S <= 9 for K3: 8 sealed blocks + the live prefix), d hidden.
  sources  [N, S, d]   any strides for N and S (e.g. a view of the [T, nB, d] block cache), d contiguous
  prefix   [N, d]      optional extra last source (the live partial block sum), so blocks need no concatenation
  norm_w [d], query [d] (the *_res_proj.weight squeezed), out_w [d] optional
  l_j = < v_j * rsqrt(mean(v_j^2) + eps) * norm_w, query >      (no 1/sqrt(d))
  alpha = softmax_j(l) in fp32;   mix = sum_j alpha_j v_j  (raw v);   out = mix, or RMSNorm(mix; out_w, out_eps)
Kernel: one program per token; pass 1 streams d in chunks for sum(v^2) and <v, norm_w*q> per source, pass 2 re-streams
(L2-hot) for the weighted sum, pass 3 (only with out_w) rescales the written row by the RMS of the rounded mix.
"""
from __future__ import annotations

import torch

from dspark.kernels import next_pow2, tl, triton, use_triton
from dspark.kernels.rms_norm import rms_norm


def attn_res_mix_ref(sources, norm_w, query, eps=1e-5, out_w=None, out_eps=1e-5, prefix=None):
    """-> [N, d] in the sources' dtype (prefix's dtype when given). Pure torch, differentiable: the K3 model's
    training and CPU path (dspark.models.k3.attn_res.attn_res) and the kernel's reference."""
    base = prefix if prefix is not None else sources
    parts = ([sources] if sources is not None else []) + ([prefix[:, None]] if prefix is not None else [])
    v = (torch.cat(parts, 1) if len(parts) > 1 else parts[0]).float()  # [N, S', d]
    normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()
    alpha = torch.softmax(normed @ query.float().reshape(-1), dim=-1)  # [N, S']
    mix = (alpha[..., None] * v).sum(1).to(base.dtype)
    if out_w is not None:
        mix = rms_norm(mix, out_w, out_eps).to(mix.dtype)
    return mix


@triton.jit
def _load_candidates(src_rows, pre_row, c, cm, from_src, is_pre, HAS_PREFIX: tl.constexpr):
    """Columns c of every candidate [BS, BD] fp32: the strided sources, then (HAS_PREFIX) the prefix row."""
    v = tl.load(src_rows[:, None] + c[None, :], mask=from_src[:, None] & cm[None, :], other=0.0).to(tl.float32)
    if HAS_PREFIX:
        p = tl.load(pre_row + c, mask=cm, other=0.0).to(tl.float32)
        v = tl.where(is_pre[:, None], p[None, :], v)
    return v


@triton.jit
def _attn_res_kernel(src_ptr, pre_ptr, nw_ptr, q_ptr, ow_ptr, out_ptr,
                     S, d, stride_n, stride_s, stride_pn, eps, out_eps,
                     BS: tl.constexpr, BD: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_OUT: tl.constexpr):
    n = tl.program_id(0)
    js = tl.arange(0, BS)
    offs = tl.arange(0, BD)
    from_src = js < S  # candidates: S strided sources, then (HAS_PREFIX) the prefix
    is_pre = js == S
    live = from_src
    if HAS_PREFIX:
        live = from_src | is_pre
    src_rows = src_ptr + n * stride_n + js * stride_s  # [BS]
    pre_row = pre_ptr + n * stride_pn
    # pass 1: sum(v^2) and <v, norm_w * q> per source
    ss = tl.zeros([BS], dtype=tl.float32)
    dot = tl.zeros([BS], dtype=tl.float32)
    for d0 in range(0, d, BD):
        c = d0 + offs
        cm = c < d
        v = _load_candidates(src_rows, pre_row, c, cm, from_src, is_pre, HAS_PREFIX)
        wq = tl.load(nw_ptr + c, mask=cm, other=0.0).to(tl.float32) * tl.load(q_ptr + c, mask=cm, other=0.0).to(tl.float32)
        ss += tl.sum(v * v, 1)
        dot += tl.sum(v * wq[None, :], 1)
    logit = dot * (1.0 / tl.sqrt(ss / d + eps))
    logit = tl.where(live, logit, float("-inf"))
    e = tl.exp(logit - tl.max(logit, 0))
    alpha = e / tl.sum(e, 0)  # [BS]
    # pass 2: weighted sum of the raw sources
    mss = tl.zeros([BD], dtype=tl.float32)
    for d0 in range(0, d, BD):
        c = d0 + offs
        cm = c < d
        v = _load_candidates(src_rows, pre_row, c, cm, from_src, is_pre, HAS_PREFIX)
        mix = tl.sum(alpha[:, None] * v, 0).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + n * d + c, mix, mask=cm)
        m32 = mix.to(tl.float32)
        mss += m32 * m32
    if HAS_OUT:  # pass 3: RMSNorm of the rounded mix (as the model: mix in its dtype, then the norm)
        r = 1.0 / tl.sqrt(tl.sum(mss, 0) / d + out_eps)
        for d0 in range(0, d, BD):
            c = d0 + offs
            cm = c < d
            m = tl.load(out_ptr + n * d + c, mask=cm, other=0.0).to(tl.float32)
            w = tl.load(ow_ptr + c, mask=cm, other=0.0).to(tl.float32)
            tl.store(out_ptr + n * d + c, (m * r * w).to(out_ptr.dtype.element_ty), mask=cm)


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def attn_res_mix_triton(sources, norm_w, query, eps=1e-5, out_w=None, out_eps=1e-5, prefix=None, block_d=None):
    base = prefix if prefix is not None else sources
    N, d = base.shape[0], base.shape[-1]
    S = sources.shape[1] if sources is not None else 0
    if sources is not None and sources.stride(-1) != 1:
        sources = sources.contiguous()
    if prefix is not None and prefix.stride(-1) != 1:
        prefix = prefix.contiguous()
    out = torch.empty(N, d, dtype=base.dtype, device=base.device)
    BS = next_pow2(S + (prefix is not None))
    BD = block_d or min(512 if BS <= 16 else 256, next_pow2(d))
    src = sources if sources is not None else base
    _attn_res_kernel[(N,)](
        src, prefix if prefix is not None else base, norm_w, query.reshape(-1), out_w if out_w is not None else norm_w,
        out, S, d, src.stride(0) if sources is not None else 0, src.stride(1) if sources is not None else 0,
        prefix.stride(0) if prefix is not None else 0, eps, out_eps,
        BS=BS, BD=BD, HAS_PREFIX=prefix is not None, HAS_OUT=out_w is not None, num_warps=4)
    return out


def attn_res_mix(sources, norm_w, query, eps=1e-5, out_w=None, out_eps=1e-5, prefix=None):
    """sources [N, S, d] (or None), prefix [N, d] (or None) -> [N, d]. See module doc."""
    base = prefix if prefix is not None else sources
    fn = attn_res_mix_triton if use_triton(base) else attn_res_mix_ref
    return fn(sources, norm_w, query, eps, out_w, out_eps, prefix)
