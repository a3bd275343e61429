"""Gated-MLP activation in one pass: SwiGLU (silu(gate) * up) and K3's SiTU-GLU.

  silu   silu(gate), rounded to the input dtype, times up, rounded (what torch's two ops give)
  situ   gate' = b1 * tanh(gate / b1) * sigmoid(gate),  up' = b2 * tanh(up / b2) (only when b2 is set),
         out = gate' * up' in fp32, one rounding to the input dtype (docs/k3-model.md, "Activation")
gate, up: [.., I] with the last dim contiguous, e.g. the two halves of a merged [gate | up] projection's output read in
place through their row stride. Kernel: grid (rows, cdiv(I, BLOCK)); out a new contiguous [.., I]. In eager torch the
SiTU chain is about a dozen elementwise kernels per call (15 calls in a k3-mini decode step), here one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.kernels import next_pow2, tl, triton, use_triton

ACTS = {"silu": 0, "situ": 1}


def glu_ref(gate: torch.Tensor, up: torch.Tensor, act: str = "silu",
            situ_beta: float | None = None, situ_linear_beta: float | None = None) -> torch.Tensor:
    """The torch definition (differentiable: training and the CPU path)."""
    if act == "silu":
        return F.silu(gate) * up
    if act == "situ":
        dtype = gate.dtype
        g, u = gate.float(), up.float()
        b1 = 1.0 if situ_beta is None else situ_beta
        g = b1 * torch.tanh(g / b1) * torch.sigmoid(g)
        if situ_linear_beta is not None:
            u = situ_linear_beta * torch.tanh(u / situ_linear_beta)
        return (g * u).to(dtype)
    raise ValueError(f"hidden_act: expected 'silu' or 'situ', got {act!r}")


@triton.jit
def _tanh(x):
    t = tl.exp(-2.0 * tl.abs(x))  # in (0, 1]: no overflow
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _glu_kernel(g_ptr, u_ptr, out_ptr, width, stride_g, stride_u, b1, b2,
                ACT: tl.constexpr, CLAMP_UP: tl.constexpr, BLOCK: tl.constexpr):
    row, pid = tl.program_id(0), tl.program_id(1)
    c = pid * BLOCK + tl.arange(0, BLOCK)
    m = c < width
    row64 = row.to(tl.int64)
    g = tl.load(g_ptr + row64 * stride_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row64 * stride_u + c, mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    if ACT == 0:
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        y = s * u
    else:
        y = b1 * _tanh(g / b1) * tl.sigmoid(g)
        if CLAMP_UP:
            u = b2 * _tanh(u / b2)
        y = y * u
    tl.store(out_ptr + row64 * width + c, y.to(dt), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [.., I] -> [rows, I] with the last dim contiguous: a view where one exists (reshape), else a copy."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def glu_triton(gate: torch.Tensor, up: torch.Tensor, act: str = "silu",
               situ_beta: float | None = None, situ_linear_beta: float | None = None,
               block: int | None = None) -> torch.Tensor:
    if act not in ACTS:
        raise ValueError(f"hidden_act: expected 'silu' or 'situ', got {act!r}")
    g2, u2 = _rows(gate), _rows(up)
    rows, width = g2.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if rows == 0 or width == 0:
        return out
    BLOCK = block or min(1024, next_pow2(width))
    _glu_kernel[(rows, triton.cdiv(width, BLOCK))](
        g2, u2, out, width, g2.stride(0), u2.stride(0), 1.0 if situ_beta is None else float(situ_beta),
        1.0 if situ_linear_beta is None else float(situ_linear_beta),
        ACT=ACTS[act], CLAMP_UP=situ_linear_beta is not None, BLOCK=BLOCK, num_warps=4)
    return out


def glu(gate: torch.Tensor, up: torch.Tensor, act: str = "silu",
        situ_beta: float | None = None, situ_linear_beta: float | None = None) -> torch.Tensor:
    """gate, up [.., I] -> [.., I]: the kernel for inference on CUDA (or under the interpreter), else the reference
    (autograd, torch.compile tracing, the CPU)."""
    if not torch.is_grad_enabled() and not torch.compiler.is_compiling() and use_triton(gate, up):
        return glu_triton(gate, up, act, situ_beta, situ_linear_beta)
    return glu_ref(gate, up, act, situ_beta, situ_linear_beta)
