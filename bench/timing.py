"""The one timer of the benchmarks: median over `iters` calls after `warm` calls; CUDA events recorded back to back
on the GPU (one synchronisation at the end), perf_counter on the CPU. Returns milliseconds."""
from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, warm: int, iters: int, cuda: bool = True) -> float:
    for _ in range(warm):
        fn()
    if not cuda:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def graph_ms(fn, reps: int = 20, iters: int = 20) -> float:
    """GPU time of one fn() call without its host launch cost: `reps` calls captured back to back in one CUDA graph,
    median over `iters` replays (median_ms), divided by reps. fn must be graph-safe (device work only)."""
    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return median_ms(g.replay, 3, iters) / reps
