"""The KDA verify of T = 2..32 tokens in chunk form: matmuls instead of a serial loop of reductions.

`_chunk_u_o` is the body of `_kda_decode_kernel` (dspark/kernels/kda_decode.py) when CHUNK: same inputs, outputs and
padding rules, launched by `kda_decode_triton(..., chunk=True)`. Per head, with G_t the cumulative log decay over
the tokens (per key channel, G_0 = 0) and Γ_t = exp(G_t):
    S_t = diag(Γ_t) (S_0 + Σ_{i≤t} β_i (k_i / Γ_i) u_i^T)                                   (the recurrence, unrolled)
    u_t = v_t - S_0^T (Γ_t k_t) - Σ_{i<t} A_ti u_i,   A_ti = β_i Σ_c k_t[c] k_i[c] e^{G_t[c] - G_i[c]}
    so U = (I + A)^{-1} (V - (K ⊙ Γ) S_0),   with (I + A)^{-1} = (I - A)(I + A²)(I + A⁴)… (A strictly lower, A^BT = 0)
    O = (Q ⊙ Γ) S_0 + (mask_{i≤t} (Q ⊙ e^{G - R}) (K ⊙ e^{R - G})^T ⊙ β) U
The exponent differences are taken against a reference R = half the chunk's total log decay (per channel), so each
factor stays within exp(±|G_T| / 2). The states after each token (for the verify's rollback) then follow by an
element-wise update S_t = Γ-step ⊙ S_{t-1} + β_t k_t u_t^T (the kernel's token loop), with no reduction on that
serial path. Dots run in exact fp32 ("ieee"). BT >= 16 and BV >= 16 (tl.dot's minimum).
"""
from __future__ import annotations

from dspark.kernels import tl, triton


@triton.jit
def _chunk_u_o(Q, K, V, G, beta, S0, BT: tl.constexpr, LOG_BT: tl.constexpr):
    """Q, K [BT, BD], V [BT, BV], log decay G [BT, BD], beta [BT], S0 [BD, BV] -> (U [BT, BV], O [BT, BV])."""
    tt = tl.arange(0, BT)
    ti = tt[:, None]
    ii = tt[None, :]
    Gc = tl.cumsum(G, 0)  # [BT, BD] G_t (<= 0; constant over padding rows)
    R = 0.5 * tl.min(Gc, 0)  # [BD] half the chunk's decay
    up = tl.exp(Gc - R[None, :])  # e^{G_t - R} <= e^{-R}
    Km = K * tl.exp(R[None, :] - Gc)  # k_i e^{R - G_i}
    A = tl.dot(K * up, tl.trans(Km), input_precision="ieee") * beta[None, :]  # [BT, BT]
    A = tl.where(ti > ii, A, 0.0)
    eye = tl.where(ti == ii, 1.0, 0.0)
    inv = eye - A
    Ap = A
    for _ in tl.static_range(LOG_BT - 1):  # inv = (I - A)(I + A^2)(I + A^4)...
        Ap = tl.dot(Ap, Ap, input_precision="ieee")
        inv = tl.dot(inv, eye + Ap, input_precision="ieee")
    Gam = tl.exp(Gc)
    U = tl.dot(inv, V - tl.dot(K * Gam, S0, input_precision="ieee"), input_precision="ieee")  # [BT, BV]
    Bo = tl.where(ti >= ii, tl.dot(Q * up, tl.trans(Km), input_precision="ieee") * beta[None, :], 0.0)
    Ot = tl.dot(Q * Gam, S0, input_precision="ieee") + tl.dot(Bo, U, input_precision="ieee")  # [BT, BV]
    return U, Ot
