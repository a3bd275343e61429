"""A captured decode step's last kernel: its output kept for the next step and posted for the host.

Shapes: out [R, C] int64 (the step's [a, n, t_0 .. t_k] rows); carry [R', C'] int64 with R' >= R, C' >= C (what the
next step's chain_inputs read); ring [2, R, C] and stamps [2] int64; count [1] int64 on the device, the number of
posts so far. With t = count % 2:
    carry[:R, :C] = out    ring[t] = out    stamps[t] = count + 1    count += 1    (count_host = count)
With ring and stamps on the device the graph then copies them (one buffer), then count, to pinned host memory. Given
count_host, ring and stamps are pinned host memory the kernel writes itself, and it stores count_host last, with
release semantics at system scope: no copy in the graph. Either way, once the host sees the count reach a post's
number, that post's rows are in its turn of the ring, stamped with that number, and the next post of the same graph
writes the other turn (runner.read waits on the count instead of an event: no event to record and no copy to queue
per step). One program: R * C is at most a few thousand values, and the count moves after every value is written.
"""
from __future__ import annotations

import torch

from dspark.kernels import tl, triton, use_triton


def publish_ref(out: torch.Tensor, carry: torch.Tensor, ring: torch.Tensor, stamps: torch.Tensor,
                count: torch.Tensor, count_host: torch.Tensor | None = None) -> None:
    """Torch reference, in place on carry, ring, stamps, count and count_host (graph-safe: the turn is read on the
    device)."""
    R, C = out.shape
    carry[:R, :C].copy_(out)
    turn = count % 2
    ring.index_copy_(0, turn.to(ring.device), out[None].to(ring.device))
    stamps.index_copy_(0, turn.to(stamps.device), (count + 1).to(stamps.device))
    count.add_(1)
    if count_host is not None:
        count_host.copy_(count)


@triton.jit
def _publish_kernel(out, carry, ring, stamps, count, count_host, n, C, stride_c, BLOCK: tl.constexpr,
                    BLOCKS: tl.constexpr, HOST_COUNT: tl.constexpr):
    c = tl.load(count)
    dst = ring + (c % 2) * n
    for b in range(BLOCKS):  # a constexpr trip count: one compile per block count (one block up to 1024 values)
        i = b * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        x = tl.load(out + i, mask=m)
        tl.store(carry + (i // C) * stride_c + i % C, x, mask=m)
        tl.store(dst + i, x, mask=m)
    tl.store(stamps + c % 2, c + 1)
    tl.debug_barrier()
    tl.store(count, c + 1)
    if HOST_COUNT:  # the program's writes above are visible to the host before the count that announces them
        tl.atomic_xchg(count_host, c + 1, sem="release", scope="sys")


def publish_triton(out: torch.Tensor, carry: torch.Tensor, ring: torch.Tensor, stamps: torch.Tensor,
                   count: torch.Tensor, count_host: torch.Tensor | None = None) -> None:
    R, C = out.shape
    _publish_kernel[(1,)](out, carry, ring, stamps, count, count if count_host is None else count_host, R * C, C,
                          carry.stride(0), BLOCK=1024, BLOCKS=triton.cdiv(R * C, 1024),
                          HOST_COUNT=count_host is not None)


def publish(out: torch.Tensor, carry: torch.Tensor, ring: torch.Tensor, stamps: torch.Tensor,
            count: torch.Tensor, count_host: torch.Tensor | None = None) -> None:
    """In place (module doc): Triton on CUDA (or under TRITON_INTERPRET=1), else the reference. ring, stamps and
    count_host may be pinned host memory on CUDA (the kernel writes them through their device-mapped addresses)."""
    if (out.is_contiguous() and ring.is_contiguous() and carry.stride(1) == 1
            and use_triton(out, carry, count)):
        publish_triton(out, carry, ring, stamps, count, count_host)
    else:
        publish_ref(out, carry, ring, stamps, count, count_host)
