"""Counter-based uniforms (dspark.spec.sampling's RNG) in one launch.

  seed [B] int64, counter [B] int64 (or an int), n  ->  u [B, n] fp32 in [0, 1) on a 2^-24 grid
  u[b, j] = top 24 bits of splitmix64(mix(seed[b]) + (counter[b] + j) * GOLDEN) * 2^-24

In torch the two splitmix64 finalisers are some 25 elementwise int64 kernels (shifts, masks, xors, products), and
every sampled step draws its uniforms once. Kernel: grid (rows, cdiv(n, BLOCK)), the same integer arithmetic on uint64
(products wrap mod 2^64, shifts are logical), so the bits equal the torch definition's on every device.
"""
from __future__ import annotations

import torch

from dspark.kernels import next_pow2, tl, triton, use_triton

BLOCK = 1024  # uniforms per program (a row's n in cdiv(n, BLOCK) programs)

GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's stream increment
M1, M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finaliser multipliers


def int64_bits(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 bits; int64 products wrap mod 2^64 on CPU and CUDA alike."""
    z = (z ^ _shr(z, 30)) * int64_bits(M1)
    z = (z ^ _shr(z, 27)) * int64_bits(M2)
    return z ^ _shr(z, 31)


def counter_uniform_ref(seed: torch.Tensor, counter: torch.Tensor | int, n: int) -> torch.Tensor:
    """The torch definition: seed [B] int64, counter [B] int64 or an int -> [B, n] fp32."""
    pos = torch.arange(n, device=seed.device) + (counter.reshape(-1, 1) if torch.is_tensor(counter) else counter)
    z = _mix64(_mix64(seed)[:, None] + pos * int64_bits(GOLDEN))
    return _shr(z, 40).float() * 2.0 ** -24  # the top 24 bits: exact in fp32


@triton.jit
def _mix(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _uniform_kernel(seed_ptr, ctr_ptr, out_ptr, ctr0, n, SCALAR: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    s = _mix(tl.load(seed_ptr + b).to(tl.uint64, bitcast=True))
    if SCALAR:
        c = ctr0 + j.to(tl.int64)
    else:
        c = tl.load(ctr_ptr + b) + j.to(tl.int64)
    z = _mix(s + c.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15)
    tl.store(out_ptr + b * n + j, (z >> 40).to(tl.float32) * (2.0 ** -24), mask=j < n)


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def counter_uniform_triton(seed: torch.Tensor, counter: torch.Tensor | int, n: int) -> torch.Tensor:
    B = seed.shape[0]
    out = torch.empty(B, n, dtype=torch.float32, device=seed.device)
    if B == 0 or n == 0:
        return out
    scalar = not torch.is_tensor(counter)
    ctr = seed if scalar else counter.reshape(-1).contiguous()
    block = min(BLOCK, max(16, next_pow2(n)))
    _uniform_kernel[(B, triton.cdiv(n, block))](seed.contiguous(), ctr, out, int(counter) if scalar else 0, n,
                                                SCALAR=scalar, BLOCK=block, num_warps=1 if block <= 128 else 4)
    return out


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor | int, n: int) -> torch.Tensor:
    """The kernel on CUDA (or under the interpreter), else the reference."""
    if use_triton(seed) and not torch.compiler.is_compiling():
        return counter_uniform_triton(seed, counter, n)
    return counter_uniform_ref(seed, counter, n)
