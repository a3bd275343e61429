"""Rotary position embeddings: the torch definitions the models use, and norm_rope, the per-head RMSNorm + NeoX
RoPE of Qwen3's q / k (and the Qwen3 drafter's) in one kernel.
NeoX style (rotate-half; Qwen3 and the Qwen3 drafter) and GPT-J style (interleaved pairs; DeepSeek / K3 MLA).

Rope carries a forward's positions instead of cos / sin tables: the kernel computes the angles itself (the same fp32
product as rope_cos_sin), so a decode step on CUDA builds no tables; the torch path makes them once per forward.
norm_rope rounds where the torch path rounds (the normed value, cos / sin, both products and their sum, each to the
activation dtype). In fp32 the two agree to 5e-7; in bf16 on an H200 a quarter (no rotation) to two fifths (positions
up to 32k) of the elements differ from the torch path in their last bit (both the norm and the rotation contribute;
which rounding differs is not pinned down), within 2e-2 of the largest |value| (test_cuda_norm_rope). The engine's
AR and speculative steps run the same kernel, so greedy speculation stays equal to greedy AR.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark.kernels import next_pow2, tl, triton, use_triton
from dspark.kernels.rms_norm import rms_norm_layer

_INV_FREQ: dict[tuple, torch.Tensor] = {}  # (dim, theta, device) -> [dim]: the frequencies, each half twice


def inv_freq(dim: int, theta: float, device) -> torch.Tensor:
    """[dim] fp32: 1 / theta^(2i/dim) for i < dim/2, then the same again (rotate-half layout). Cached per device, so
    a step computes cos/sin in four kernels; never cached while a CUDA graph is being captured (a tensor computed
    there holds nothing until the graph replays)."""
    if torch.compiler.is_compiling():  # traced: computed in the graph, which fuses it
        return _inv_freq(dim, theta, device)
    key = (dim, float(theta), str(device))
    f = _INV_FREQ.get(key)
    if f is None:
        f = _inv_freq(dim, theta, device)
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            _INV_FREQ[key] = f
    return f


def _inv_freq(dim: int, theta: float, device) -> torch.Tensor:
    half = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    return torch.cat([half, half])


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype=torch.float32):
    """cos/sin tables for rotary embeddings. positions: [..., T] -> cos, sin: [..., T, dim]."""
    emb = positions.float()[..., None] * inv_freq(dim, theta, positions.device)  # [..., T, dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style (rotate-half) RoPE. x: [B, H, T, D]; cos/sin: [B, T, D] or [T, D]."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J-style (interleaved pairs, is_neox_style=False) RoPE, as DeepSeek MLA uses.
    x: [B, H, T, D]; cos/sin as from rope_cos_sin (the first D/2 columns are used)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return out.flatten(-2)


@dataclass
class Rope:
    """A forward's rotary positions: positions [B, T] or [T] (int), head dim, theta. cos_sin(dtype) builds the tables
    once per dtype (the torch path); norm_rope's kernel reads the positions."""

    positions: torch.Tensor
    dim: int
    theta: float
    _tables: dict = field(default_factory=dict, repr=False)

    def cos_sin(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._tables:
            self._tables[dtype] = rope_cos_sin(self.positions, self.dim, self.theta, dtype)
        return self._tables[dtype]


def norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, rope: Rope) -> torch.Tensor:
    """RMSNorm over each head (weight [D], as an RMSNorm module computes it) then NeoX RoPE.
    x [B, T, H, D] -> [B, H, T, D]."""
    cos, sin = rope.cos_sin(x.dtype)
    return apply_rope_neox(rms_norm_layer(x, weight, eps).transpose(1, 2), cos, sin)


@triton.jit
def _norm_rope_kernel(X, W, W2, POS, INV_FREQ, OUT, T, H, H1, sxb, sxt, sxh, sob, sot, soh, spb, spt, eps,
                      SINK, DEST, s_sink, HV, D: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr,
                      INTERLEAVED: tl.constexpr, IN_PLACE: tl.constexpr, TO_SINK: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    pid = tl.program_id(0)  # one token: all its heads
    b, t = pid // T, pid % T
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, D)[None, :]
    if INTERLEAVED:  # pairs (2i, 2i + 1), frequency i
        dr = d ^ 1
        fi = d // 2
        first = d % 2 == 0
    else:  # NeoX: column d and its rotate-half partner, frequency d mod D/2 (the table repeats it)
        dr = (d + D // 2) % D
        fi = d
        first = d < D // 2
    m = h < H
    xt = X + b * sxb + t * sxt
    xp = xt + h * sxh
    x = tl.load(xp + d, mask=m, other=0.0).to(tl.float32)
    xr = tl.load(xp + dr, mask=m, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    if NORM:  # fp32 statistics, the weight applied in fp32 (W on heads < H1, W2 after), one rounding to the dtype
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        first_w = h < H1
        w = tl.where(first_w, tl.load(W + d).to(tl.float32), tl.load(W2 + d).to(tl.float32))
        wr = tl.where(first_w, tl.load(W + dr).to(tl.float32), tl.load(W2 + dr).to(tl.float32))
        x = (x * rstd * w).to(dt).to(tl.float32)
        xr = (xr * rstd * wr).to(dt).to(tl.float32)
    ang = tl.load(POS + b * spb + t * spt).to(tl.float32) * tl.load(INV_FREQ + fi)  # [1, D]: rope_cos_sin's product
    # reduced to [-pi, pi] first (Cody-Waite, 2 pi in three parts; k * 6.28125 is exact for k < 2^16): Triton's
    # cos / sin are the GPU's approximate instructions, accurate only near zero, and angles reach pos * 1 rad
    k = tl.floor(ang * 0.15915494309189535 + 0.5)
    r = ang - k * 6.28125
    r = r - k * 1.9353071795864769e-3
    r = r - k * 1.0253131677e-11  # 2 pi - 6.28125 - fp32(1.9353071795864769e-3)
    c = tl.cos(r).to(dt).to(tl.float32)
    s = tl.sin(r).to(dt).to(tl.float32)
    rot = tl.where(first, -xr, xr)
    out = (x * c).to(dt).to(tl.float32) + (rot * s).to(dt).to(tl.float32)
    if IN_PLACE:  # OUT is X: each element is also its rotate-half partner's input, read by another thread
        tl.debug_barrier()  # every thread of the program has loaded its inputs before any thread stores
    tl.store(OUT + b * sob + t * sot + h * soh + d, out.to(dt), mask=m)  # each program owns its token
    if TO_SINK:  # the token's cache row [k heads | v heads] (the HV heads after the H in X) at row DEST[token]
        row = SINK + tl.load(DEST + pid).to(tl.int64) * s_sink
        tl.store(row + (h - H1) * D + d, out.to(dt), mask=m & (h >= H1))
        hv = tl.arange(0, BLOCK_V)[:, None]
        vm = hv < HV
        tl.store(row + (HV + hv) * D + d, tl.load(xt + (H + hv) * sxh + d, mask=vm, other=0.0), mask=vm)


def norm_rope_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float, rope: Rope,
                     interleaved: bool = False) -> torch.Tensor:
    """x [B, T, H, D] (any strides, D contiguous; D a power of two) -> [B, H, T, D] (a transposed view of a contiguous
    [B, T, H, D]). weight None: RoPE only. interleaved: GPT-J pairs (MLA's RoPE) instead of NeoX halves."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, out, weight, weight, x.shape[2], eps, rope, interleaved)
    return out.transpose(1, 2)


def _launch(x, out, w1, w2, h1: int, eps: float, rope: Rope, interleaved: bool = False, n_v: int = 0,
            sink: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """x [B, T, H + n_v, D]: heads [0, H) are turned; with a sink (rows [P, C], dest [B * T]) each token's heads
    [h1, H + n_v) (k then v) also go to its row dest[token]."""
    B, T, H, D = x.shape
    H -= n_v
    pos = rope.positions
    spb, spt = (pos.stride(0), pos.stride(1)) if pos.dim() == 2 else (0, pos.stride(0))
    w1 = w1 if w1 is not None else x
    rows, dest = sink if sink is not None else (x, pos)
    _norm_rope_kernel[(B * T,)](x, w1, w2 if w2 is not None else w1, pos, inv_freq(D, rope.theta, x.device), out,
                                T, H, h1, *x.stride()[:3], *out.stride()[:3], spb, spt, float(eps), rows, dest,
                                rows.stride(0), n_v, D=D, BLOCK_H=next_pow2(H), NORM=w1 is not x,
                                INTERLEAVED=interleaved, IN_PLACE=out.data_ptr() == x.data_ptr(),
                                TO_SINK=sink is not None, BLOCK_V=next_pow2(max(n_v, 1)))


def norm_rope_fits(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether the kernel serves this call: inference (no autograd, not traced by torch.compile, whose fusion does
    the same), x's dtype that of the weight (if any), D a power of two with unit stride, on CUDA (or the
    interpreter)."""
    D = x.shape[-1]
    return (not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and (weight is None or x.dtype == weight.dtype)
            and D >= 2 and D & (D - 1) == 0 and x.stride(-1) == 1 and use_triton(x))


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, rope: Rope) -> torch.Tensor:
    """RMSNorm per head + NeoX RoPE, x [B, T, H, D] -> [B, H, T, D]: the kernel where it fits, else the reference."""
    if norm_rope_fits(x, weight):
        return norm_rope_triton(x, weight, eps, rope)
    return norm_rope_ref(x, weight, eps, rope)


def qk_norm_rope_triton(x: torch.Tensor, n_q: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor, eps: float,
                        rope: Rope, n_v: int = 0, sink: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """qk_norm_rope_'s kernel (one launch, in place)."""
    _launch(x, x, q_weight if n_q else k_weight, k_weight, n_q, eps, rope, n_v=n_v, sink=sink)


def sink_write(sink: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor) -> None:
    """rows [B, T, C] -> sink = (pool rows [P, C], dest [B * T]): token i's row to pool row dest[i]."""
    pool, dest = sink
    pool.index_copy_(0, dest, rows.reshape(-1, rows.shape[-1]).to(pool.dtype))


def _sink_fits(sink: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, n_q: int, n_v: int) -> bool:
    pool, dest = sink
    return (pool.dtype == x.dtype and pool.stride(1) == 1 and dest.dtype == torch.long and dest.is_contiguous()
            and x.shape[2] - n_q == 2 * n_v and pool.shape[1] == 2 * n_v * x.shape[3])


def qk_norm_rope_(x: torch.Tensor, n_q: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor, eps: float,
                  rope: Rope, n_v: int = 0, sink: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """In place: x [B, T, n_q + n_k + n_v, D], the q heads [0, n_q), the k heads, then n_v v heads (left as they are)
    of a merged projection's output (a view of it: any strides, D contiguous); the q heads normed with q_weight and
    the k heads with k_weight, per head, then turned by NeoX RoPE. One launch for q and k where the kernel fits; their
    [k | v] cache rows are then a slice of the projection's output, with no copy. sink (pool rows [P, C], dest
    [B * T]; n_k = n_v): each token's cache row [k | v] also goes to pool row dest[token], in the same launch where
    the kernel fits. Inference only (autograd would need the values it overwrites)."""
    H = x.shape[2] - n_v
    if norm_rope_fits(x, k_weight) and (sink is None or _sink_fits(sink, x, n_q, n_v)):
        qk_norm_rope_triton(x, n_q, q_weight, k_weight, eps, rope, n_v, sink)
        return
    if n_q:
        x[:, :, :n_q] = norm_rope_ref(x[:, :, :n_q], q_weight, eps, rope).transpose(1, 2)
    x[:, :, n_q:H] = norm_rope_ref(x[:, :, n_q:H], k_weight, eps, rope).transpose(1, 2)
    if sink is not None:
        sink_write(sink, x[:, :, n_q:].flatten(2))


def rope_interleaved(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """GPT-J-style RoPE (MLA's), x [B, T, H, D] -> [B, H, T, D]: one kernel where it fits (the cos / sin tables and
    the rotation are about a dozen kernels per call in torch), else apply_rope_interleaved."""
    if norm_rope_fits(x, None):
        return norm_rope_triton(x, None, 0.0, rope, interleaved=True)
    cos, sin = rope.cos_sin(x.dtype)
    return apply_rope_interleaved(x.transpose(1, 2), cos, sin)
