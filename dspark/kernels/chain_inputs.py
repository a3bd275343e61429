"""A decode step's inputs completed from the step before it, on the device: what lets the engine queue a step while
the one before is still in flight (its result unread by the host).

Shapes: ints [R, C] int64, one row per batch row, with columns pending, num_cached, num_new, room and src (their
indices given); prev [R', P] int64, the step before's output rows [a, n, t_0 .. t_k, ...].
For each row with src >= 0 (it continues row src of prev), with a = prev[src, 0] and d = a + 1:
    pending = prev[src, 2 + a]    num_cached += d    num_new = clamp(min(num_new - 1, room - d - 1), 0) + 1
    room -= d
Rows with src < 0 keep their values. The updated row is what its next step continues from, so a step whose rows
continue the same rows of the same buffers needs no new inputs from the host (runner.launch). One launch instead of
some twenty small torch ops: inside a captured step it is device time on every step.
"""
from __future__ import annotations

import torch

from dspark.kernels import next_pow2, tl, triton, use_triton


def chain_inputs_ref(ints: torch.Tensor, prev: torch.Tensor, pending: int, num_cached: int, num_new: int, room: int,
                     src: int) -> None:
    """Torch reference, in place on ints."""
    s = ints[:, src]
    has = s >= 0
    idx = s.clamp(min=0)
    a = prev[:, 0].index_select(0, idx).clamp(0, prev.shape[1] - 3)  # [R]
    tok = prev[:, 2:].index_select(0, idx).gather(1, a[:, None])[:, 0]
    d = torch.where(has, a + 1, 0)
    ints[:, num_cached] += d
    ints[:, pending] = torch.where(has, tok, ints[:, pending])
    drafts = torch.minimum(ints[:, num_new] - 1, ints[:, room] - d - 1).clamp(min=0)
    ints[:, num_new] = torch.where(has, drafts + 1, ints[:, num_new])
    ints[:, room] -= d


@triton.jit
def _chain_inputs_kernel(ints, prev, R, stride_i, stride_p, P, PENDING: tl.constexpr, NUM_CACHED: tl.constexpr,
                         NUM_NEW: tl.constexpr, ROOM: tl.constexpr, SRC: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = ints + r * stride_i
    src = tl.load(row + SRC, mask=r < R, other=-1)
    m = (r < R) & (src >= 0)
    p = prev + tl.maximum(src, 0) * stride_p
    a = tl.minimum(tl.maximum(tl.load(p, mask=m, other=0), 0), P - 3)
    tok = tl.load(p + 2 + a, mask=m, other=0)
    d = a + 1
    tl.store(row + NUM_CACHED, tl.load(row + NUM_CACHED, mask=m, other=0) + d, mask=m)
    tl.store(row + PENDING, tok, mask=m)
    room = tl.load(row + ROOM, mask=m, other=0)
    drafts = tl.minimum(tl.load(row + NUM_NEW, mask=m, other=1) - 1, room - d - 1)
    tl.store(row + NUM_NEW, tl.maximum(drafts, 0) + 1, mask=m)
    tl.store(row + ROOM, room - d, mask=m)


def chain_inputs_triton(ints: torch.Tensor, prev: torch.Tensor, pending: int, num_cached: int, num_new: int,
                        room: int, src: int) -> None:
    R = ints.shape[0]
    block = min(next_pow2(R), 256)
    _chain_inputs_kernel[(triton.cdiv(R, block),)](ints, prev, R, ints.stride(0), prev.stride(0), prev.shape[1],
                                                   pending, num_cached, num_new, room, src, BLOCK=block)


def chain_inputs(ints: torch.Tensor, prev: torch.Tensor, pending: int, num_cached: int, num_new: int, room: int,
                 src: int) -> None:
    """In place on ints (module doc): Triton on CUDA (or under TRITON_INTERPRET=1), else the reference."""
    if ints.stride(1) == 1 and prev.stride(1) == 1 and use_triton(ints, prev):
        chain_inputs_triton(ints, prev, pending, num_cached, num_new, room, src)
    else:
        chain_inputs_ref(ints, prev, pending, num_cached, num_new, room, src)
