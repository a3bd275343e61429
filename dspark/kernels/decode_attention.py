"""One Qwen3 attention decode step after the fused [q|k|v] projection, in one launch:
per-head q/k RMSNorm, NeoX RoPE at the row's position, the new [k|v] row written into the static cache, and
softmax attention of each query head over keys 0..pos (GQA).

Shapes: B rows (one new token each), H query heads, Hkv kv heads (G = H / Hkv), D head dim, L = max_len.
  qkv     [B, (H + 2*Hkv) * D]   the fused projection output of the new token ([q heads | k heads | v heads])
  store   [B, L, 2*Hkv*D]        the layer's StaticCache rows ([k heads | v heads] per position)
  lengths [B] int                committed length = the new token's position pos; keys 0..pos-1 come from `store`,
                                 key pos is the new one (kept in registers, and written to store[b, pos])
  q_w, k_w [D]                   q_norm / k_norm weights;  inv_freq [D/2] fp32 (rope_cos_sin's)
  -> o [B, H*D] in qkv's dtype (the o_proj input layout)
Grid (B, H): the program of head h recomputes its group's k/v row (cheap: D values) and the first head of a group
writes it. Reads of the cache stop at pos-1, so no program waits for another's write.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.kernels import interpreting, next_pow2, tl, triton, use_triton
from dspark.kernels.rms_norm import rms_norm
from dspark.kernels.rope import apply_rope_neox, rope_cos_sin


def rope_inv_freq(dim: int, theta: float, device=None) -> torch.Tensor:
    """The inverse frequencies rope_cos_sin uses: [dim/2] fp32."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))


def decode_attention_ref(qkv, store, lengths, q_w, k_w, theta: float, H: int, Hkv: int, eps: float):
    """Torch reference, the Qwen3Attention module ops (writes store[b, lengths[b]]) -> o [B, H*D]."""
    B, L = store.shape[:2]
    D = q_w.shape[0]
    q, k, v = qkv.view(B, 1, H + 2 * Hkv, D).split([H, Hkv, Hkv], dim=2)
    cos, sin = rope_cos_sin(lengths.view(B, 1), D, theta, dtype=qkv.dtype)  # [B, 1, D]
    q = apply_rope_neox(rms_norm(q, q_w, eps).transpose(1, 2), cos, sin)  # [B, H, 1, D]
    k = apply_rope_neox(rms_norm(k, k_w, eps).transpose(1, 2), cos, sin)  # [B, Hkv, 1, D]
    rows = torch.arange(B, device=store.device)
    store[rows, lengths.long()] = torch.cat([k.reshape(B, -1), v.reshape(B, -1)], -1).to(store.dtype)
    kv = store.view(B, L, 2, Hkv, D)
    mask = (torch.arange(L, device=store.device)[None] <= lengths.view(B, 1))[:, None, None]  # [B, 1, 1, L]
    o = F.scaled_dot_product_attention(q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), attn_mask=mask,
                                       enable_gqa=True)
    return o.reshape(B, H * D)


@triton.jit
def _norm_rope(ptr, w_ptr, dh, HALF: tl.constexpr, c, s, eps):
    """Load one head [D] as two halves, RMSNorm (fp32, round, * w, round), rotate-half RoPE (fp32, round)."""
    dt = ptr.dtype.element_ty
    lo = tl.load(ptr + dh).to(tl.float32)
    hi = tl.load(ptr + HALF + dh).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(lo * lo, 0) + tl.sum(hi * hi, 0)) / (2 * HALF) + eps)
    lo = ((lo * rstd).to(dt).to(tl.float32) * tl.load(w_ptr + dh).to(tl.float32)).to(dt).to(tl.float32)
    hi = ((hi * rstd).to(dt).to(tl.float32) * tl.load(w_ptr + HALF + dh).to(tl.float32)).to(dt).to(tl.float32)
    return (lo * c - hi * s).to(dt).to(tl.float32), (hi * c + lo * s).to(dt).to(tl.float32)


@triton.jit
def _decode_attn_kernel(qkv_ptr, kv_ptr, len_ptr, qw_ptr, kw_ptr, freq_ptr, o_ptr, L, eps, scale,
                        H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    D: tl.constexpr = 2 * HALF
    C: tl.constexpr = 2 * HKV * D
    kvh = h // (H // HKV)
    dh = tl.arange(0, HALF)
    pos = tl.minimum(tl.load(len_ptr + b).to(tl.int32), L - 1)  # callers keep pos < L; never write out of bounds
    ang = pos.to(tl.float32) * tl.load(freq_ptr + dh)
    c, s = tl.cos(ang), tl.sin(ang)
    row = qkv_ptr + b * ((H + 2 * HKV) * D)
    q_lo, q_hi = _norm_rope(row + h * D, qw_ptr, dh, HALF, c, s, eps)
    k_lo, k_hi = _norm_rope(row + (H + kvh) * D, kw_ptr, dh, HALF, c, s, eps)
    v_lo = tl.load(row + (H + HKV + kvh) * D + dh).to(tl.float32)
    v_hi = tl.load(row + (H + HKV + kvh) * D + HALF + dh).to(tl.float32)
    base = kv_ptr + b.to(tl.int64) * L * C
    if h % (H // HKV) == 0:  # the group's first head writes the new [k|v] row at slot pos
        new = base + pos * C + kvh * D
        dt = kv_ptr.dtype.element_ty
        tl.store(new + dh, k_lo.to(dt))
        tl.store(new + HALF + dh, k_hi.to(dt))
        tl.store(new + HKV * D + dh, v_lo.to(dt))
        tl.store(new + HKV * D + HALF + dh, v_hi.to(dt))
    m = (tl.sum(q_lo * k_lo, 0) + tl.sum(q_hi * k_hi, 0)) * scale  # the new key's score starts the online softmax
    den = m * 0.0 + 1.0
    acc_lo, acc_hi = v_lo, v_hi
    for start in range(0, pos, BLOCK_L):
        j = start + tl.arange(0, BLOCK_L)
        jm = j < pos
        kp = base + j[:, None] * C + kvh * D + dh[None, :]
        k1 = tl.load(kp, mask=jm[:, None], other=0.0).to(tl.float32)
        k2 = tl.load(kp + HALF, mask=jm[:, None], other=0.0).to(tl.float32)
        sc = (tl.sum(k1 * q_lo[None, :], 1) + tl.sum(k2 * q_hi[None, :], 1)) * scale
        sc = tl.where(jm, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new)
        v1 = tl.load(kp + HKV * D, mask=jm[:, None], other=0.0).to(tl.float32)
        v2 = tl.load(kp + HKV * D + HALF, mask=jm[:, None], other=0.0).to(tl.float32)
        acc_lo = acc_lo * alpha + tl.sum(p[:, None] * v1, 0)
        acc_hi = acc_hi * alpha + tl.sum(p[:, None] * v2, 0)
        den = den * alpha + tl.sum(p, 0)
        m = m_new
    out = o_ptr + b * (H * D) + h * D
    tl.store(out + dh, (acc_lo / den).to(o_ptr.dtype.element_ty))
    tl.store(out + HALF + dh, (acc_hi / den).to(o_ptr.dtype.element_ty))


def decode_attention_triton(qkv, store, lengths, q_w, k_w, inv_freq, H: int, Hkv: int, eps: float,
                            block_l: int | None = None):
    B, L, C = store.shape
    D = q_w.shape[0]
    if qkv.shape != (B, (H + 2 * Hkv) * D) or C != 2 * Hkv * D or D != next_pow2(D) or not store.is_contiguous():
        raise ValueError(f"decode_attention: expected qkv [B, (H+2Hkv)*D] and a contiguous store [B, L, 2*Hkv*D] "
                         f"with D a power of two; got qkv {tuple(qkv.shape)}, store {tuple(store.shape)}, D={D}")
    o = torch.empty(B, H * D, device=qkv.device, dtype=qkv.dtype)
    bl = block_l or (16 if interpreting() else 64)
    _decode_attn_kernel[(B, H)](qkv.contiguous(), store, lengths, q_w, k_w, inv_freq, o, L, eps, D ** -0.5,
                                H=H, HKV=Hkv, HALF=D // 2, BLOCK_L=bl, num_warps=4)
    return o


def decode_attention(qkv, store, lengths, q_w, k_w, inv_freq, theta: float, H: int, Hkv: int, eps: float):
    """Dispatcher: the Triton kernel for CUDA tensors (or under TRITON_INTERPRET=1), else the reference."""
    if use_triton(qkv, store):
        return decode_attention_triton(qkv, store, lengths, q_w, k_w, inv_freq, H, Hkv, eps)
    return decode_attention_ref(qkv, store, lengths, q_w, k_w, theta, H, Hkv, eps)
