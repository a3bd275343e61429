"""A decode step's cache indices in one launch: what dspark.cache.device_view.DeviceView computes for every step.

  num_cached, num_new [B] int64; table [B, W] int64 block ids; bs the block size; T new tokens per row; L = W * bs
  ->  pos [B, T] = num_cached + t            the new tokens' positions
      valid [B, T] = t < num_new             the real (not padding) new tokens
      dest [B * T]                           each new token's row in the flat pool: table[b, pos // bs] * bs + pos % bs
      gather [B, L]                          the pool rows of positions 0..L-1 (block index clamped to W - 1)
      lim [B, T] = pos + 1                   the keys each new token sees (paged attention's bound)
  additive_key_mask(pos, L, dtype) -> [B, 1, T, L]: 0 where key <= pos, -inf after (what SDPA adds to the scores).

In torch these are some twenty small kernels per step (aranges, integer divisions, gathers, the mask's compare, fill
and masked fill), the same for every model and every k; the kernels make them two. view: grid (B, cdiv(L, BLOCK_L)),
each program a slice of a row's gather indices and of its new-token slots (T <= L); mask: grid (B, T tiles, L tiles).
"""
from __future__ import annotations

import torch

from dspark.kernels import next_pow2, tl, triton, use_triton

BLOCK_L = 512  # key positions per program
BLOCK_T = 16  # the mask's query rows per program


def pool_rows(table: torch.Tensor, bs: int, pos: torch.Tensor) -> torch.Tensor:
    """pos [B, *] token positions -> their flat rows in a paged pool of block size bs under the block table [B, W]
    (block index clamped to the table's width)."""
    blk = (pos // bs).clamp(max=table.shape[1] - 1)
    return table.gather(1, blk) * bs + pos % bs


def view_indices_ref(num_cached: torch.Tensor, num_new: torch.Tensor, table: torch.Tensor, bs: int, T: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch definition -> (pos [B, T], valid [B, T] bool, dest [B * T], gather [B, L], lim [B, T])."""
    L, dev = table.shape[1] * bs, table.device
    t = torch.arange(T, device=dev)
    pos = num_cached[:, None] + t
    keys = torch.arange(L, device=dev)  # L and T come from tensor shapes: symbolic under torch.compile
    return (pos, t[None] < num_new[:, None], pool_rows(table, bs, pos).flatten(),
            pool_rows(table, bs, keys[None].expand(table.shape[0], -1)), pos + 1)


def key_visible(pos: torch.Tensor, L: int) -> torch.Tensor:
    """pos [B, T] -> [B, 1, T, L] bool: query t of row b (at position pos[b, t]) may see key i iff i <= pos[b, t]."""
    return (torch.arange(L, device=pos.device)[None, None, :] <= pos[:, :, None])[:, None]


def additive_key_mask_ref(pos: torch.Tensor, L: int, dtype: torch.dtype) -> torch.Tensor:
    """pos [B, T] -> [B, 1, T, L] in dtype: 0 where key_visible, -inf after (what SDPA adds to the scores; given a
    bool mask SDPA builds this itself on every call)."""
    visible = key_visible(pos, L)
    return torch.full(visible.shape, float("-inf"), dtype=dtype, device=pos.device).masked_fill_(visible, 0.0)


@triton.jit
def _view_kernel(NC, NN, TABLE, POS, VALID, DEST, GATHER, LIM, W, s_tab, T, L, BS: tl.constexpr,
                 BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # key positions here, and new-token slots (T <= L)
    km = i < L
    g = tl.load(TABLE + b * s_tab + tl.minimum(i // BS, W - 1), mask=km, other=0) * BS + i % BS
    tl.store(GATHER + b * L + i, g, mask=km)
    tm = i < T
    pos = tl.load(NC + b) + i
    tl.store(POS + b * T + i, pos, mask=tm)
    tl.store(LIM + b * T + i, pos + 1, mask=tm)
    tl.store(VALID + b * T + i, (i < tl.load(NN + b)).to(tl.int8), mask=tm)
    d = tl.load(TABLE + b * s_tab + tl.minimum(pos // BS, W - 1), mask=tm, other=0) * BS + pos % BS
    tl.store(DEST + b * T + i, d, mask=tm)


@triton.jit
def _mask_kernel(POS, OUT, T, L, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    keys = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    tm = t < T
    pos = tl.load(POS + b * T + t, mask=tm, other=0)
    m = tl.where(keys[None, :] <= pos[:, None], 0.0, float("-inf"))
    tl.store(OUT + (b * T + t[:, None]) * L + keys[None, :], m.to(OUT.dtype.element_ty),
             mask=tm[:, None] & (keys[None, :] < L))


@torch.compiler.disable  # a torch.compile'd caller launches the kernel as it is
def view_indices_triton(num_cached, num_new, table, bs: int, T: int):
    B, W = table.shape
    L, dev = W * bs, table.device
    pos, lim = (torch.empty(B, T, dtype=torch.long, device=dev) for _ in range(2))
    valid = torch.empty(B, T, dtype=torch.bool, device=dev)
    dest = torch.empty(B * T, dtype=torch.long, device=dev)
    gather = torch.empty(B, L, dtype=torch.long, device=dev)
    if T > L:
        raise ValueError(f"view_indices: {T} new tokens in a view of {L} positions")
    block = min(BLOCK_L, next_pow2(L))
    _view_kernel[(B, triton.cdiv(L, block))](num_cached, num_new, table, pos, valid.view(torch.int8), dest, gather,
                                             lim, W, table.stride(0), T, L, BS=bs, BLOCK=block)
    return pos, valid, dest, gather, lim


@torch.compiler.disable
def additive_key_mask_triton(pos: torch.Tensor, L: int, dtype: torch.dtype) -> torch.Tensor:
    B, T = pos.shape
    out = torch.empty(B, 1, T, L, dtype=dtype, device=pos.device)
    block_t, block_l = min(BLOCK_T, next_pow2(T)), min(BLOCK_L, next_pow2(L))
    _mask_kernel[(B, triton.cdiv(T, block_t), triton.cdiv(L, block_l))](pos, out, T, L, BLOCK_T=block_t,
                                                                        BLOCK_L=block_l)
    return out


def _fits(*tensors: torch.Tensor) -> bool:
    return (use_triton(*tensors) and not torch.compiler.is_compiling()
            and all(x.dtype == torch.long for x in tensors))


def view_indices(num_cached, num_new, table, bs: int, T: int):
    """(pos, valid, dest, gather, lim) of a step (module doc): the kernel on CUDA (or under the interpreter) for int64
    inputs (dense vectors, table rows of unit stride), else the torch definition."""
    if (_fits(num_cached, num_new, table) and num_cached.dim() == num_new.dim() == 1 and num_cached.is_contiguous()
            and num_new.is_contiguous() and table.stride(-1) == 1):
        return view_indices_triton(num_cached, num_new, table, bs, T)
    return view_indices_ref(num_cached, num_new, table, bs, T)


def additive_key_mask(pos: torch.Tensor, L: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, T, L] in dtype from pos [B, T] (module doc): the kernel where it fits, else the torch definition."""
    if _fits(pos) and pos.is_contiguous():
        return additive_key_mask_triton(pos, L, dtype)
    return additive_key_mask_ref(pos, L, dtype)
