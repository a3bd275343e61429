"""A plain decode step's stash of the drafter's context input in one launch: the projection of the target's aux
hidden states, written at their tokens' cache rows (torch: the cat of the aux parts, the GEMM, the row copy).

  parts: n tensors [M, K_i] (the hidden states after each aux layer), weight [N, sum K_i], pool [P, N], dest [M]
  ->  pool[dest[m]] = cat(parts)[m] @ weight^T            (parts cast to the weight's dtype, as the drafter's fc does)

Products accumulate in fp32 with one rounding, to the pool's dtype, at the end (fp32 weights, and any dtype under
TRITON_INTERPRET=1, whose tl.dot mis-handles bf16 operands, multiply in fp32). Grid (cdiv(M, BLOCK_M),
cdiv(N, BLOCK_N)): each program a tile of rows and outputs, reading the parts in place (a tuple of pointers) over
their K in BLOCK_K chunks. For decode-sized M (<= MAX_ROWS) and up to MAX_PARTS parts; otherwise the torch definition.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.kernels import as_rows, interpreting, tl, triton, use_triton

MAX_PARTS = 8  # aux layers one launch reads (each compiles its own unrolled loop; k3-mini's drafter reads 5)
MAX_ROWS = 64  # rows of a decode step's stash; more (a prefill's) go through cuBLAS and a copy


def project_rows_ref(parts: list[torch.Tensor], weight: torch.Tensor, pool: torch.Tensor, dest: torch.Tensor) -> None:
    x = torch.cat([p.reshape(-1, p.shape[-1]) for p in parts], -1).to(weight.dtype)
    pool.index_copy_(0, dest, F.linear(x, weight).to(pool.dtype))


@triton.jit
def _part(acc, A, sa, W, sw, col0, K, rm, rn, mm, nm, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [BM, BN] += A[rm, :K] @ W[rn, col0 : col0 + K]^T."""
    rk0 = tl.arange(0, BLOCK_K)
    wt = W.dtype.element_ty
    for k in range(0, K, BLOCK_K):
        rk = k + rk0
        km = rk < K
        a = tl.load(A + rm[:, None] * sa + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0).to(wt)
        w = tl.load(W + rn[None, :] * sw + (col0 + rk)[:, None], mask=nm[None, :] & km[:, None], other=0.0)
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _project_rows_kernel(A, SA, KA, W, sw, P, sp, D, M, N, PARTS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """A, SA, KA: tuples of the parts' pointers, row strides and widths (part i: weight columns from KA[0..i-1])."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, nm = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    col0 = 0
    for i in tl.static_range(PARTS):
        acc = _part(acc, A[i], SA[i], W, sw, col0, KA[i], rm, rn, mm, nm, BLOCK_K, DOT_F32)
        col0 += KA[i]
    dest = tl.load(D + rm, mask=mm, other=0)
    tl.store(P + dest[:, None] * sp + rn[None, :], acc.to(P.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@torch.compiler.disable
def project_rows_triton(parts: list[torch.Tensor], weight: torch.Tensor, pool: torch.Tensor, dest: torch.Tensor
                        ) -> None:
    rows = [as_rows(p)[1] for p in parts]
    M, N = rows[0].shape[0], weight.shape[0]
    if M == 0:
        return
    # few rows: narrow output tiles, so that more programs stream the weight (a decode step at batch 1 reads all of it)
    block_m, block_n = (16, 16) if M <= 16 else (32, 32) if M <= 32 else (64, 32)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _project_rows_kernel[grid](tuple(rows), tuple(r.stride(0) for r in rows), tuple(r.shape[1] for r in rows), weight,
                               weight.stride(0), pool, pool.stride(0), dest, M, N, PARTS=len(rows), BLOCK_M=block_m,
                               BLOCK_N=block_n, BLOCK_K=64,
                               DOT_F32=weight.dtype == torch.float32 or interpreting(), num_warps=4)


def project_rows_(parts: list[torch.Tensor], weight: torch.Tensor, pool: torch.Tensor, dest: torch.Tensor) -> None:
    """pool[dest] = cat(parts) @ weight^T, in place: one kernel on CUDA (or under the interpreter) for up to
    MAX_PARTS parts of up to MAX_ROWS rows with unit column strides, a pool of unit column stride and int64 dest;
    else the torch definition."""
    M = parts[0].numel() // parts[0].shape[-1]
    if (not torch.is_grad_enabled() and len(parts) <= MAX_PARTS and M <= MAX_ROWS and pool.stride(-1) == 1
            and weight.stride(-1) == 1 and dest.dtype == torch.long and dest.is_contiguous()
            and sum(p.shape[-1] for p in parts) == weight.shape[1] and pool.shape[1] == weight.shape[0]
            and use_triton(weight, pool, dest, *parts)):
        project_rows_triton(parts, weight, pool, dest)
    else:
        project_rows_ref(parts, weight, pool, dest)
