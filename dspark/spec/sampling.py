"""Sampling on the device: a counter-based RNG, the per-row sampling rule (temperature, top-k, top-p) and
inverse-CDF sampling. No host syncs, no data-dependent shapes, no torch.Generator, so a CUDA graph can capture a
whole speculative step for a batch that mixes greedy and sampled rows, each with its own seed.

Random numbers are a pure function of (seed, counter): `counter_uniform(seed, counter, n)[b, j]` hashes
(seed[b], counter[b] + j). Give each request one seed (`request_seed` at admission) and derive the counter from its
position, e.g. `num_tokens * 64 + slot` with slots 0..63 split between the drafter and the verifier: every number a
request draws is then fixed by its seed and position, whatever else is in the batch, whichever device runs it, and
a step never reuses a number (num_tokens grows by at least one per step).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from dspark.kernels.counter_uniform import counter_uniform as uniform_kernel
from dspark.kernels.counter_uniform import int64_bits
from dspark.kernels.inverse_cdf import inverse_cdf
from dspark.kernels.temperature_softmax import TEMPERATURE_FLOOR, temperature_softmax


def request_seed(seed: int | None) -> int:
    """A request's seed as an int64 (host side, once at admission): any Python int folds mod 2^64; None draws one."""
    return int64_bits(secrets.randbits(64) if seed is None else seed % (1 << 64))


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor | int, n: int) -> torch.Tensor:
    """seed [B] int64, counter [B] int64 (or an int) -> uniforms [B, n] fp32 in [0, 1) on a 2^-24 grid.
    Element [b, j] is splitmix64 keyed by mix(seed[b]) at stream position counter[b] + j: a pure function of that
    pair, bit-identical on every device and independent of the batch it is drawn in (one launch on CUDA:
    dspark/kernels/counter_uniform.py)."""
    if seed.dtype != torch.int64 or seed.ndim != 1:
        raise TypeError(f"counter_uniform: seed must be int64 [B], got {seed.dtype} {list(seed.shape)}")
    if torch.is_tensor(counter) and counter.dtype != torch.int64:
        raise TypeError(f"counter_uniform: counter must be int64, got {counter.dtype}")
    return uniform_kernel(seed, counter, n)


def _per_row(x, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A scalar, a per-row tensor [B] for logits [B, ..., V], or a tensor broadcastable to logits[..., 0]
    -> [..., 1] over logits' leading dims."""
    if not torch.is_tensor(x):  # a fill, not a host-to-device copy: safe inside CUDA graph capture
        return torch.full((*logits.shape[:-1], 1), x, dtype=dtype, device=logits.device)
    t = x.to(dtype=dtype, device=logits.device)
    if t.ndim == 1 and logits.ndim > 2:
        t = t.view(-1, *[1] * (logits.ndim - 2))
    return t.expand(logits.shape[:-1])[..., None]


def _static_off(x, off) -> bool:
    """True when x is a Python number that switches its filter off (a tensor may vary per row: never off)."""
    return not torch.is_tensor(x) and off(x)


def process_logits(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """logits [B, ..., V] -> probs [B, ..., V] fp32, the distribution the request samples from.
    temperature, top_k, top_p: Python numbers or per-row tensors [B] (or broadcastable to logits[..., 0]).
    temperature <= 0: greedy, a one-hot at the argmax (first index on ties); other rows divide by at least
    TEMPERATURE_FLOOR. top_k 0 (or >= V) is off; ties with the k-th value are kept. top_p >= 1 is off; top-p keeps
    the smallest prefix (by probability after top-k) whose mass reaches top_p, and always the most likely token.
    Finite logits never give nan/inf. Sorting is skipped when top_k and top_p are Python numbers that are off; the
    filters drop logits (to -inf) and temperature_softmax (dspark/kernels/temperature_softmax.py) makes the rest
    probabilities. Apply the same call to target and drafter logits so both describe the same sampling rule."""
    V = logits.shape[-1]
    t = _per_row(temperature, logits, torch.float32)  # [..., 1]
    k_off = _static_off(top_k, lambda k: k <= 0 or k >= V)
    p_off = _static_off(top_p, lambda p: p >= 1.0)
    if not (k_off and p_off):
        logits = logits.float()
        x = (logits - logits.amax(-1, keepdim=True)) / torch.where(t <= 0, 1.0, t.clamp(min=TEMPERATURE_FLOOR))
        srt, idx = x.sort(dim=-1, descending=True, stable=True)  # [..., V]; the argmax first, as torch.argmax picks it
        drop = torch.zeros_like(srt, dtype=torch.bool)
        if not k_off:
            k = _per_row(top_k, logits, torch.long)
            kth = srt.gather(-1, (k - 1).clamp(0, V - 1))
            drop |= (srt < kth) & (k > 0) & (k < V)
            srt = srt.masked_fill(drop, float("-inf"))
        if not p_off:
            p = _per_row(top_p, logits, torch.float32)
            ps = srt.softmax(-1)
            before = ps.cumsum(-1) - ps  # mass of the more likely tokens
            rank = torch.arange(V, device=x.device)
            drop |= (before >= p) & (p < 1) & (rank > 0)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter_(-1, idx, drop), float("-inf"))
    return temperature_softmax(logits, t[..., 0])


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [..., V] >= 0 (need not sum to 1), u [...] in [0, 1) -> ids [...] long: the first
    index whose cumulative weight exceeds u * total, never a zero-weight index; a row without any weight gives its
    argmax (index 0). One Triton launch pair on CUDA (dspark/kernels/inverse_cdf.py), else its torch definition."""
    return inverse_cdf(probs, u)


def sample_rows(logits: torch.Tensor, temperature, top_k, top_p, u: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: logits [B, V], per-row temperature/top_k/top_p [B] (or Python numbers), u [B]
    -> (ids [B] long, probs [B, V] fp32). Greedy rows (temperature <= 0) take the argmax and report a one-hot,
    which is the drafter distribution q the verifier needs for them."""
    probs = process_logits(logits, temperature, top_k, top_p)
    greedy = _per_row(temperature, logits, torch.float32)[..., 0] <= 0
    return torch.where(greedy, logits.argmax(-1), sample_from(probs, u)), probs


@dataclass
class RowSampling:
    """Per-row sampling parameters of a batch, on the device: temperature [B] fp32 (0 = greedy); top_k [B] long
    and top_p [B] fp32, or None where no row filters (process_logits then skips the sort)."""
    temperature: torch.Tensor
    top_k: torch.Tensor | int = 0
    top_p: torch.Tensor | float = 1.0

    @property
    def temperature_only(self) -> bool:
        """No row filters (top-k and top-p are numbers that are off): the fused sampled kernels apply."""
        return (not torch.is_tensor(self.top_k) and self.top_k <= 0 and not torch.is_tensor(self.top_p)
                and self.top_p >= 1.0)
