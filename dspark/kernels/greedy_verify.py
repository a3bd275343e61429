"""Greedy verification and the step's packed output in one launch: what a greedy decode step does after the target's
argmax (some twenty small torch ops otherwise, each a kernel of every captured step). The same kernel packs a
sampled step's output from its verifier's accepted counts and next tokens (pack_step: seven torch ops otherwise).

Shapes: drafts [B, k] int64 (-1 = placeholder, always rejected), top [B, k+1] int64 (the target's argmax after t0,
d1..di), n [B] int64 (drafts the row may verify). Row b accepts the longest prefix of drafts equal to top within its
effective drafts (n clipped to [0, k], cut at the first placeholder): a = that length, next = top[b, a]. The packed
row is [a, n, t_0 .. t_k] with t_j = d_{j+1} for j < a, next at j = a, -1 after (what ModelRunner.read returns).
"""
from __future__ import annotations

import torch

from dspark.kernels import next_pow2, tl, triton, use_triton


def effective_drafts(draft_ids: torch.Tensor, num_drafts) -> torch.Tensor:
    """[B]: num_drafts (an int or [B]) clipped to [0, k] and cut at the first placeholder (a placeholder is always
    rejected, which is the same as a block that ends just before it: the target then samples that position)."""
    B, k = draft_ids.shape
    n = (num_drafts.to(dtype=torch.long, device=draft_ids.device).expand(B) if torch.is_tensor(num_drafts)
         else torch.full((B,), num_drafts, dtype=torch.long, device=draft_ids.device)).clamp(0, k)
    slot = torch.arange(k, device=draft_ids.device)[None]
    ok = (draft_ids >= 0) & (slot < n[:, None])  # [B, k]
    return ok.long().cumprod(1).sum(1)


def accept_greedy(draft_ids: torch.Tensor, top: torch.Tensor, num_drafts) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (a [B] accepted drafts, next [B] the token after them)."""
    n = effective_drafts(draft_ids, num_drafts)
    k = draft_ids.shape[1]
    match = (draft_ids == top[:, :k]) & (torch.arange(k, device=n.device)[None] < n[:, None])
    a = match.long().cumprod(1).sum(1)
    return a, top.gather(1, a[:, None])[:, 0]


def pack_step_ref(drafts: torch.Tensor, a: torch.Tensor, nxt: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """[B, k+3] = [a, n, t_0 .. t_k] (module doc) from a [B] accepted drafts and nxt [B] the token after them."""
    k = drafts.shape[1]
    slot = torch.arange(k + 1, device=a.device)[None]
    toks = torch.where(slot < a[:, None], torch.cat([drafts, nxt[:, None]], 1),  # (slot k is never < a)
                       torch.where(slot == a[:, None], nxt[:, None], torch.full_like(slot, -1)))
    return torch.cat([a[:, None], n[:, None], toks], 1)


def greedy_step_ref(drafts: torch.Tensor, top: torch.Tensor, n: torch.Tensor, minus: int = 0) -> torch.Tensor:
    """Torch reference: the packed rows [B, k+3], for n - minus drafts a row may verify."""
    n = n - minus if minus else n
    a, nxt = accept_greedy(drafts, top, n)
    return pack_step_ref(drafts, a, nxt, n)


@triton.jit
def _greedy_step_kernel(DRAFTS, TOP, N, A, NXT, OUT, B, K, sd, st, so, sn, MINUS, GIVEN: tl.constexpr,
                        BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)[:, None]  # [BB, 1]
    j = tl.arange(0, BLOCK_K)[None, :]  # [1, BK]: draft slots 0..K-1, then the bonus slot K
    rows = b < B
    n = tl.load(N + b * sn, mask=rows, other=0) - MINUS  # [BB, 1]
    d = tl.load(DRAFTS + b * sd + j, mask=rows & (j < K), other=-1)
    if GIVEN:  # pack_step: a and next come from a sampled step's verifier
        a = tl.load(A + b, mask=rows, other=0)
        nxt = tl.load(NXT + b, mask=rows, other=0)
    else:
        top = tl.load(TOP + b * st + j, mask=rows & (j <= K), other=-1)
        # slot j is accepted when every slot up to it is a real draft within n that matches: a = the first failing
        # slot
        ok = (d >= 0) & (j < n) & (d == top) & (j < K)
        a = tl.min(tl.where(ok, BLOCK_K, j), axis=1)[:, None]  # [BB, 1]; K when every draft matches
        a = tl.minimum(a, K)
        nxt = tl.sum(tl.where(j == a, top, 0), axis=1)[:, None]
    toks = tl.where(j < a, d, tl.where(j == a, nxt, -1))
    out = OUT + b * so
    tl.store(out, a, mask=rows)
    tl.store(out + 1, n, mask=rows)
    tl.store(out + 2 + j, toks, mask=rows & (j <= K))


def _launch(drafts: torch.Tensor, top: torch.Tensor | None, n: torch.Tensor, a: torch.Tensor | None = None,
            nxt: torch.Tensor | None = None, minus: int = 0) -> torch.Tensor:
    B, K = drafts.shape
    out = torch.empty(B, K + 3, dtype=torch.long, device=n.device)
    block_b = min(next_pow2(B), 64)
    given = top is None
    top = n if given else top  # a dummy pointer, never read
    d = drafts if K else top  # k = 0: likewise
    a, nxt = (a, nxt) if given else (n, n)
    _greedy_step_kernel[(triton.cdiv(B, block_b),)](d, top, n, a, nxt, out, B, K, d.stride(0), top.stride(0),
                                                    out.stride(0), n.stride(0), minus, GIVEN=given, BLOCK_B=block_b,
                                                    BLOCK_K=next_pow2(K + 1))
    return out


def greedy_step_triton(drafts: torch.Tensor, top: torch.Tensor, n: torch.Tensor, minus: int = 0) -> torch.Tensor:
    return _launch(drafts, top, n, minus=minus)


def pack_step_triton(drafts: torch.Tensor, a: torch.Tensor, nxt: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return _launch(drafts, None, n, a, nxt)


def greedy_step(drafts: torch.Tensor, top: torch.Tensor, n: torch.Tensor, minus: int = 0) -> torch.Tensor:
    """The packed rows [B, k+3] (module doc) for n - minus drafts a row may verify (minus: a step's num_new - 1
    taken in the kernel, not as a kernel of its own): Triton on CUDA (or under TRITON_INTERPRET=1), else the
    reference."""
    if (drafts.shape[1] == 0 or drafts.stride(1) == 1) and top.stride(1) == 1 and use_triton(drafts, top, n):
        return greedy_step_triton(drafts, top, n, minus)
    return greedy_step_ref(drafts, top, n, minus)


def pack_step(drafts: torch.Tensor, a: torch.Tensor, nxt: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """A sampled step's packed rows [B, k+3] from its verifier's a and next [B]: Triton on CUDA (or under
    TRITON_INTERPRET=1), else the reference."""
    if drafts.shape[1] and drafts.stride(1) == 1 and all(x.stride(0) == 1 for x in (a, nxt, n)) \
            and use_triton(drafts, a, nxt, n):
        return pack_step_triton(drafts, a, nxt, n)
    return pack_step_ref(drafts, a, nxt, n)
