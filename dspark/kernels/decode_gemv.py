"""Decode matvec with a decoder layer's glue fused in: the weight-streaming half of a bs=1 decode step.

    y[M, N] = prologue(x)[M, K] @ W[N, K]^T (+ residual[M, N])          one launch, W read once per row of x
      prologue "none"      x
      prologue "rmsnorm"   rms_norm(x) * norm_w          (1/rms over the K inputs, recomputed by every program)
      prologue "silu_mul"  silu(x[:, :K]) * x[:, K:]     (x = the fused [gate|up] output, [M, 2K])
      residual             y = residual + ...            (residual may be y's own storage: h += W @ ..., in place)
Rounding follows the module path (RMSNorm: normalise in fp32, round, scale, round; silu, then mul, each rounded to
x's dtype); products accumulate in fp32 and the residual is added before the one final rounding (like addmm).
grouped_gemv(x [P, K], w [E, N, K], idx [P]): row p against W = w[idx[p]], read in place from the stacked
weights (the MoE experts of a decode / verify step, no gathered copy); the one-row kernel with a per-row base.
M = 1 (the bs=1 decode step), grid (cdiv(N, BLOCK_N),): each program streams its BLOCK_N rows of W in BLOCK_K
chunks and keeps a [BLOCK_N, BLOCK_K] fp32 partial sum, reduced once at the end. More rows: one program row each
(correct, W read once per row: verify steps of several tokens go through cuBLAS instead; a multi-row tl.dot variant
measured 11.6 ms for a 9-token verify of the 8B shape against cuBLAS's 6.3 ms and was dropped, bench/RESULTS.md).
Tiles autotuned per (N, K) on CUDA, L2 flushed between trials.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.kernels import AUTOTUNE_CACHE, HAS_TRITON, interpreting, tl, triton, use_triton
from dspark.kernels.rms_norm import rms_norm

PROLOGUES = {"none": 0, "rmsnorm": 1, "silu_mul": 2}


def decode_gemv_ref(x, w, prologue: str = "none", norm_w=None, eps: float = 1e-6, residual=None):
    """Torch reference, the module path's ops: x [M, K] (or [M, 2K] for silu_mul), w [N, K] -> [M, N] in x.dtype."""
    if prologue == "rmsnorm":
        x = rms_norm(x, norm_w, eps)
    elif prologue == "silu_mul":
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    if residual is None:
        return F.linear(x, w)
    return torch.addmm(residual.reshape(-1, w.shape[0]), x.reshape(-1, w.shape[1]), w.t()).view(residual.shape)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, res_ptr, nw_ptr, idx_ptr, N, K, stride_x, stride_w, stride_e, eps,
                 PROLOGUE: tl.constexpr, RESIDUAL: tl.constexpr, GROUPED: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    pid, row = tl.program_id(0), tl.program_id(1)
    if GROUPED:  # row r multiplies W[idx[r]] of the stacked [E, N, K] weights, read in place
        w_ptr += tl.load(idx_ptr + row).to(tl.int64) * stride_e
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = rn < N
    rk0 = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_x
    dt = x_ptr.dtype.element_ty
    rstd = 0.0
    if PROLOGUE == 1:  # 1 / rms(x): K * 2 bytes per program, from L2 after the first
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            xv = tl.load(x_row + k + rk0, mask=(k + rk0) < K, other=0.0).to(tl.float32)
            ss += xv * xv
        rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        rk = k + rk0
        if EVEN:
            xv = tl.load(x_row + rk).to(tl.float32)
            wv = tl.load(w_rows + rk[None, :])
        else:
            km = rk < K
            xv = tl.load(x_row + rk, mask=km, other=0.0).to(tl.float32)
            wv = tl.load(w_rows + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        if PROLOGUE == 1:
            nw = tl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            xv = ((xv * rstd).to(dt).to(tl.float32) * nw).to(dt).to(tl.float32)
        if PROLOGUE == 2:
            up = tl.load(x_row + K + rk, mask=rk < K, other=0.0).to(tl.float32)
            act = (xv / (1.0 + tl.exp(-xv))).to(dt).to(tl.float32)
            xv = (act * up).to(dt).to(tl.float32)
        acc += wv.to(tl.float32) * xv[None, :]
    y = tl.sum(acc, 1)
    if RESIDUAL:
        y += tl.load(res_ptr + row * N + rn, mask=nm, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + rn, y.to(y_ptr.dtype.element_ty), mask=nm)


def _configs():
    out = []
    for bn, bk, warps, stages in ((4, 1024, 4, 1), (8, 512, 4, 1), (8, 512, 4, 3), (8, 1024, 8, 2), (16, 256, 4, 1),
                                  (16, 256, 4, 3), (16, 512, 8, 1), (16, 512, 8, 3), (32, 256, 8, 1), (32, 256, 8, 3),
                                  (32, 512, 8, 2), (64, 128, 4, 3), (64, 256, 8, 2), (128, 128, 8, 2)):
        out.append(triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages))
    return out


if HAS_TRITON:
    _even = triton.heuristics({"EVEN": lambda a: a["N"] % a["BLOCK_N"] == 0 and a["K"] % a["BLOCK_K"] == 0})
    _gemv = _even(_gemv_kernel)
    _gemv_tuned = triton.autotune(_configs(), key=["N", "K", "PROLOGUE", "RESIDUAL", "GROUPED"],
                                  restore_value=["y_ptr"], **AUTOTUNE_CACHE)(
        _even(_gemv_kernel))


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def decode_gemv_triton(x, w, prologue: str = "none", norm_w=None, eps: float = 1e-6, residual=None, out=None,
                       block: tuple[int, int] | None = None):
    """Launcher. x [M, K] ([M, 2K] for silu_mul, rows contiguous), w [N, K] (rows contiguous) -> y [M, N].
    out: where to write y (may be `residual` itself); block=(BLOCK_N, BLOCK_K) fixes the tile (else autotuned on
    CUDA, (16, 64) in the interpreter)."""
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue: expected one of {sorted(PROLOGUES)}, got {prologue!r}")
    x2 = x.reshape(-1, x.shape[-1])
    N, K = w.shape
    if x2.shape[-1] != (2 * K if prologue == "silu_mul" else K) or x2.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"decode_gemv: x [M, {2 * K if prologue == 'silu_mul' else K}] and w [N, K] with contiguous "
                         f"rows expected, got x {tuple(x.shape)} and w {tuple(w.shape)}")
    if prologue == "rmsnorm" and (norm_w is None or norm_w.shape != (K,)):
        raise ValueError(f"norm_w: prologue 'rmsnorm' needs a [{K}] weight")
    M = x2.shape[0]
    y = out if out is not None else torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    res = residual if residual is not None else y
    args = (x2, w, y, res, norm_w if norm_w is not None else w, N, K, x2.stride(0), w.stride(0), eps)
    meta = dict(PROLOGUE=PROLOGUES[prologue], RESIDUAL=residual is not None)
    return _launch(args, meta, M, block)


def _launch(args, meta, M: int, block, idx=None, stride_e: int = 0):
    """One program row per x row (idx: per-row expert of stacked [E, N, K] weights), grid (cdiv(N, BLOCK_N), M)."""
    x2, w, y, res, nw, N, K, sx, sw, eps = args
    args = (x2, w, y, res, nw, idx if idx is not None else x2, N, K, sx, sw, stride_e, eps)
    meta = dict(meta, GROUPED=idx is not None)
    if block is None and not interpreting():
        _gemv_tuned[lambda a: (triton.cdiv(N, a["BLOCK_N"]), M)](*args, **meta)
    else:
        bn, bk = block or (16, 64)
        _gemv[(triton.cdiv(N, bn), M)](*args, **meta, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return y


def grouped_gemv_ref(x, w, idx):
    """x [P, K], stacked w [E, N, K], idx [P] -> y[p] = w[idx[p]] @ x[p]  [P, N] (a bmm over gathered copies)."""
    return torch.bmm(w.index_select(0, idx), x[:, :, None])[..., 0]


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def grouped_gemv_triton(x, w, idx, block: tuple[int, int] | None = None):
    """The matvec kernel with W = w[idx[row]] per row, read in place from the stacked weights (no gathered copy)."""
    P, K = x.shape
    E, N, K2 = w.shape
    if K2 != K or x.stride(-1) != 1 or w.stride(-1) != 1 or idx.shape != (P,):
        raise ValueError(f"grouped_gemv: x [P, K], w [E, N, K] with contiguous rows and idx [P] expected, got x "
                         f"{tuple(x.shape)}, w {tuple(w.shape)}, idx {tuple(idx.shape)}")
    y = torch.empty(P, N, device=x.device, dtype=x.dtype)
    args = (x, w, y, y, w, N, K, x.stride(0), w.stride(1), 0.0)
    return _launch(args, dict(PROLOGUE=0, RESIDUAL=False), P, block, idx.contiguous(), w.stride(0))


def grouped_gemv(x, w, idx):
    """Dispatcher: one launch over every (row, expert) pair on CUDA (or under the interpreter), else the reference."""
    return grouped_gemv_triton(x, w, idx) if use_triton(x, w) else grouped_gemv_ref(x, w, idx)


def decode_gemv(x, w, prologue: str = "none", norm_w=None, eps: float = 1e-6, residual=None, out=None):
    """Dispatcher: the Triton kernel for CUDA tensors (or under TRITON_INTERPRET=1), else the reference."""
    if use_triton(x, w):
        return decode_gemv_triton(x, w, prologue, norm_w, eps, residual, out)
    y = decode_gemv_ref(x, w, prologue, norm_w, eps, residual)
    return out.copy_(y) if out is not None else y
