"""Attention over the paged pool in place: a step's queries read their keys and values from the pool rows of their
positions, with no gathered copy of the context and no mask tensor.

  q [B, Hq, T, D] (any strides, D contiguous)       the step's queries
  pool [P, C], C = 2 * Hkv * D                      cache rows [k heads | v heads]
  rows [B, L] int64                                 the pool row of each of a row's positions 0..L-1 (view_indices'
                                                    gather)
  lim [B, T] or [B, 1] int64 (any strides)         key i of row b is visible to query t iff i < lim[b, t]: the
                                                    query's position + 1 (causal over the cache), or the context's
                                                    length for every query (the drafter's block)
  extra [B, N, C] (optional)                        rows after the context that every query sees (the drafter's
                                                    block, non-causal)
  -> o [B, T, Hq, D] (the layout o_proj reads; o.transpose(1, 2) is SDPA's [B, Hq, T, D])

attention_ref is the definition: the rows gathered, an additive mask, SDPA. The kernel (flash attention over pages):
grid (B * Hkv, M tiles), M = G * T query rows of one kv head's group (G = Hq / Hkv); each program walks its row's
positions in tiles of BLOCK_N up to the largest key its queries see (so a short context in a long view costs its own
length), then the extra rows, with an online softmax in fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.kernels import next_pow2, tl, triton, use_triton

BLOCK_N = 64  # keys per tile
MAX_BLOCK_M = 64  # query rows per program


@dataclass
class Pages:
    """Where a layer's cached rows lie in a step: pool [P, C], rows [B, L] (each position's pool row), lim [B, T] or
    [B, 1] (what each query sees: keys i < lim) and dest [B * T] (each new token's pool row)."""

    pool: torch.Tensor
    rows: torch.Tensor
    lim: torch.Tensor
    dest: torch.Tensor

    @property
    def sink(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool, dest): where a layer writes the step's new rows itself (qk_norm_rope_'s sink)."""
        return self.pool, self.dest

    def gathered(self) -> torch.Tensor:
        """[B, L, C]: the rows of positions 0..L-1 (one gather: the torch path)."""
        return self.pool[self.rows]


def attention_ref(q: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, lim: torch.Tensor,
                  extra: torch.Tensor | None = None) -> torch.Tensor:
    """The torch definition -> o [B, T, Hq, D]."""
    B, Hq, T, D = q.shape
    L = rows.shape[1]
    kv = pool[rows]  # [B, L, C]
    visible = torch.arange(L, device=q.device)[None, None, :] < lim.expand(B, T)[:, :, None]  # [B, T, L]
    if extra is not None:
        kv = torch.cat([kv, extra.to(kv.dtype)], 1)
        visible = torch.cat([visible, visible.new_ones(B, T, extra.shape[1])], -1)
    Hkv = kv.shape[-1] // (2 * D)
    k, v = kv.view(B, kv.shape[1], 2, Hkv, D).permute(2, 0, 3, 1, 4).to(q.dtype)
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    return o.transpose(1, 2)


@triton.jit
def _tile(q, k, v, visible, m_i, l_i, acc, scale, DOT_F32: tl.constexpr):
    """One tile of keys k, values v [BLOCK_N, D] (visible [BLOCK_M, BLOCK_N]) into the online softmax."""
    if DOT_F32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _paged_attention_kernel(Q, POOL, ROWS, LIM, EXTRA, OUT, T, G, L, NE, HKV, sqb, sqh, sqt, s_pool, s_rows, slb, slt,
                            seb, sen, scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_E: tl.constexpr, HAS_EXTRA: tl.constexpr, DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    b, kvh = (pid // HKV).to(tl.int64), pid % HKV
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows of the group: head kvh * G + m // T, time m % T
    mm = m < G * T
    head, t = kvh * G + m // T, m % T
    d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + head[:, None] * sqh + t[:, None] * sqt + d[None, :], mask=mm[:, None], other=0.0)
    lim = tl.load(LIM + b * slb + t * slt, mask=mm, other=0)
    hi = tl.minimum(tl.max(lim, 0), L)  # the program's last visible key + 1
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_col, v_col = kvh * D, (HKV + kvh) * D
    for n0 in range(0, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < hi
        r = tl.load(ROWS + b * s_rows + n, mask=nm, other=0)
        k = tl.load(POOL + r[:, None] * s_pool + k_col + d[None, :], mask=nm[:, None], other=0.0)
        v = tl.load(POOL + r[:, None] * s_pool + v_col + d[None, :], mask=nm[:, None], other=0.0)
        m_i, l_i, acc = _tile(q, k, v, n[None, :] < lim[:, None], m_i, l_i, acc, scale, DOT_F32)
    if HAS_EXTRA:  # the rows every query sees
        n = tl.arange(0, BLOCK_E)
        nm = n < NE
        e = EXTRA + b * seb + n[:, None] * sen + d[None, :]
        k = tl.load(e + k_col, mask=nm[:, None], other=0.0)
        v = tl.load(e + v_col, mask=nm[:, None], other=0.0)
        m_i, l_i, acc = _tile(q, k, v, (nm[None, :]) & mm[:, None], m_i, l_i, acc, scale, DOT_F32)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    # o [B, T, Hq, D] contiguous
    tl.store(OUT + ((b * T + t[:, None]) * (HKV * G) + head[:, None]) * D + d[None, :], o.to(OUT.dtype.element_ty),
             mask=mm[:, None])


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def attention_triton(q, pool, rows, lim, extra=None):
    B, Hq, T, D = q.shape
    C = pool.shape[1]
    Hkv = C // (2 * D)
    G = Hq // Hkv
    lim = lim.expand(B, T)
    o = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    block_m = max(16, min(MAX_BLOCK_M, next_pow2(G * T)))
    ex = extra if extra is not None else pool
    NE = extra.shape[1] if extra is not None else 0
    _paged_attention_kernel[(B * Hkv, triton.cdiv(G * T, block_m))](
        q, pool, rows, lim, ex, o, T, G, rows.shape[1], NE, Hkv, q.stride(0), q.stride(1), q.stride(2), pool.stride(0),
        rows.stride(0), lim.stride(0), lim.stride(1), ex.stride(0) if extra is not None else 0,
        ex.stride(1) if extra is not None else 0, 1.0 / math.sqrt(D), D=D, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_E=max(16, next_pow2(NE)), HAS_EXTRA=extra is not None, DOT_F32=q.dtype == torch.float32, num_warps=4)
    return o


def attention_fits(q: torch.Tensor, pool: torch.Tensor, extra: torch.Tensor | None = None) -> bool:
    """Whether the kernel serves this call: inference, CUDA (or the interpreter), pool (and extra) in q's dtype with
    unit-stride rows, D a power of two of at least 16, Hq a multiple of the pool's kv heads."""
    B, Hq, T, D = q.shape
    C = pool.shape[1]
    return (use_triton(q, pool) and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and pool.dtype == q.dtype and pool.stride(1) == 1 and q.stride(3) == 1 and D >= 16 and D & (D - 1) == 0
            and C % (2 * D) == 0 and Hq % (C // (2 * D)) == 0
            and (extra is None or (extra.dtype == q.dtype and extra.stride(2) == 1 and extra.shape[1] <= 64)))


def paged_attention(q: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, lim: torch.Tensor,
                    extra: torch.Tensor | None = None) -> torch.Tensor:
    """o [B, T, Hq, D] (module doc): the kernel where it fits, else the torch definition."""
    if attention_fits(q, pool, extra):
        return attention_triton(q, pool, rows, lim, extra)
    return attention_ref(q, pool, rows, lim, extra)
