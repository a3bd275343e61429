"""The KDA verify of T = 2..32 tokens in chunk form: matmuls instead of a serial loop of reductions.

Same inputs, outputs and padding rules as dspark/kernels/kda_decode.py (its `_kda_tiles` prologue, its gated-norm
launch; `kda_decode_triton(..., chunk=True)` launches this kernel). Per head, with G_t the cumulative log decay over
the tokens (per key channel, G_0 = 0) and Γ_t = exp(G_t):
    S_t = diag(Γ_t) (S_0 + Σ_{i≤t} β_i (k_i / Γ_i) u_i^T)                                   (the recurrence, unrolled)
    u_t = v_t - S_0^T (Γ_t k_t) - Σ_{i<t} A_ti u_i,   A_ti = β_i Σ_c k_t[c] k_i[c] e^{G_t[c] - G_i[c]}
    so U = (I + A)^{-1} (V - (K ⊙ Γ) S_0),   with (I + A)^{-1} = (I - A)(I + A²)(I + A⁴)… (A strictly lower, A^BT = 0)
    O = (Q ⊙ Γ) S_0 + (mask_{i≤t} (Q ⊙ e^{G - R}) (K ⊙ e^{R - G})^T ⊙ β) U
The exponent differences are taken against a reference R = half the chunk's total log decay (per channel), so each
factor stays within exp(±|G_T| / 2). The states after each token (for the verify's rollback) then follow by an
element-wise update S_t = Γ-step ⊙ S_{t-1} + β_t k_t u_t^T, with no reduction on that serial path.
Dots run in fp32 ("ieee"; PREC "tf32x3" trades exactness for tensor cores). BT >= 16 and BV >= 16 (tl.dot's minimum).
"""
from __future__ import annotations

import inspect

from dspark.kernels import HAS_TRITON, tl, triton
from dspark.kernels.kda_decode import _kda_tiles, _state_slice


@triton.jit
def _kda_chunk_kernel(qkv_ptr, f_ptr, beta_ptr, convw_ptr, win_ptr, alog_ptr, dtb_ptr,
                      s_in_ptr, s_out_ptr, o_ptr, ext_ptr, len_ptr,
                      T, H, P, NH, SQ, SF, SB, lower_bound, scale,
                      D: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                      W: tl.constexpr, USE_LB: tl.constexpr, HAS_STATE: tl.constexpr, ALL_STATES: tl.constexpr,
                      HAS_LEN: tl.constexpr, LOG_BT: tl.constexpr, PREC: tl.constexpr):
    """Program (b, h, j): value columns j*BV.. of head h, all T tokens at once (see the module doc)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    Q, K, V, G, beta = _kda_tiles(qkv_ptr, f_ptr, beta_ptr, convw_ptr, win_ptr, alog_ptr, dtb_ptr, ext_ptr, len_ptr,
                                  b, h, j, T, H, P, SQ, SF, SB, lower_bound, scale, D, BD, BV, BT, BE, W, USE_LB,
                                  HAS_LEN)
    S0, sidx, smask = _state_slice(s_in_ptr, b, h, j, H, D, BD, BV, HAS_STATE)  # [BD, BV]
    vo = j * BV + tl.arange(0, BV)
    vm = vo < D
    tt = tl.arange(0, BT)
    ti = tt[:, None]
    ii = tt[None, :]
    Gc = tl.cumsum(G, 0)  # [BT, BD] G_t (<= 0; constant over padding rows)
    R = 0.5 * tl.min(Gc, 0)  # [BD] half the chunk's decay
    up = tl.exp(Gc - R[None, :])  # e^{G_t - R} <= e^{-R}
    down = tl.exp(R[None, :] - Gc)  # e^{R - G_i}
    Km = K * down
    A = tl.dot(K * up, tl.trans(Km), input_precision=PREC) * beta[None, :]  # [BT, BT]
    A = tl.where(ti > ii, A, 0.0)
    eye = tl.where(ti == ii, 1.0, 0.0)
    inv = eye - A
    Ap = A
    for _ in tl.static_range(LOG_BT - 1):  # inv = (I - A)(I + A^2)(I + A^4)...
        Ap = tl.dot(Ap, Ap, input_precision=PREC)
        inv = tl.dot(inv, eye + Ap, input_precision=PREC)
    Gam = tl.exp(Gc)
    U = tl.dot(inv, V - tl.dot(K * Gam, S0, input_precision=PREC), input_precision=PREC)  # [BT, BV]
    Bo = tl.where(ti >= ii, tl.dot(Q * up, tl.trans(Km), input_precision=PREC) * beta[None, :], 0.0)
    Ot = tl.dot(Q * Gam, S0, input_precision=PREC) + tl.dot(Bo, U, input_precision=PREC)  # [BT, BV]
    tl.store(o_ptr + (b * T + ti) * P + h * D + vo[None, :], Ot, mask=(ti < T) & vm[None, :])
    # states: S_t = e^{g_t} S_{t-1} + beta_t k_t u_t^T (rows picked by masked sums: independent of S)
    S = S0
    decay = tl.exp(G)
    Kb = K * beta[:, None]
    for t in range(0, T):
        sel = ti == t
        e = tl.sum(tl.where(sel, decay, 0.0), 0)
        k = tl.sum(tl.where(sel, Kb, 0.0), 0)
        u = tl.sum(tl.where(sel, U, 0.0), 0)
        S = S * e[:, None] + k[:, None] * u[None, :]
        if ALL_STATES:
            tl.store(s_out_ptr + ((b * T + t) * H + h) * D * D + sidx, S, mask=smask)
    if not ALL_STATES:
        tl.store(s_out_ptr + (b * H + h) * D * D + sidx, S, mask=smask)


# (BV value columns, warps), autotuned per (T, B*H, D, all states) like the loop kernel's
_CONFIGS = ((16, 2), (16, 4), (32, 2), (32, 4), (64, 4), (128, 8))

if HAS_TRITON:
    _CACHE = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    _kda_chunk_tuned = triton.autotune([triton.Config({"BV": bv}, num_warps=w, num_stages=1) for bv, w in _CONFIGS],
                                       key=["T", "NH", "D", "ALL_STATES"], restore_value=["s_out_ptr"],
                                       **_CACHE)(_kda_chunk_kernel)
