"""PagedCache: the engine's cache manager for one target model.

It owns a `BlockPool` with KV storage [num_blocks, block_size, C] per attention layer (C = per-token row width:
GQA [k|v] flattened, MLA latent), a `KDAStatePool` with one slot per running request, a `BlockTable` per request
and optionally a `PrefixCache`. Per step: `b = cache.batch(rids, num_new, record)`, `model(ids, batch=b)`,
`cache.commit(n_keep)` — exactly the semantics of `DenseCache` (tests/test_cache.py drives both side by side).

Prefix caching (engine flow): `add_request(rid)`; `n = match_prefix(rid, prompt)`; prefill prompt[n:] in chunks
that end at `checkpoint_positions(rid, len(prompt))` (and wherever else it likes); after each prefill chunk's
commit call `after_prefill(rid, prompt, num_computed)`; `free_request(rid)` on finish, cancel or error.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from dspark.cache.batch import ForwardBatch
from dspark.cache.blocks import BlockPool, BlockTable, OutOfBlocks, prefix_hashes
from dspark.cache.device_view import DeviceView
from dspark.cache.prefix import PrefixCache, PrefixCacheConfig, PrefixMatch
from dspark.cache.state import KDAStatePool, LayerShape
from dspark.kernels.view_indices import pool_rows


class _Request:
    def __init__(self, table: BlockTable, slot: int | None):
        self.table, self.slot = table, slot
        self.prefix: PrefixMatch | None = None


class PagedView:
    """CacheView over the requests of one batch, rows in the order given to `PagedCache.batch`."""

    def __init__(self, cache: PagedCache, reqs: list[_Request], batch: ForwardBatch):
        self.cache, self.reqs, self.fb = cache, reqs, batch
        self.slots = [r.slot for r in reqs]
        width = max([len(r.table.blocks) for r in reqs] + [1])
        table = torch.zeros(len(reqs), width, dtype=torch.long)  # [B, max blocks]; padding -> block 0
        for i, r in enumerate(reqs):
            table[i, : len(r.table.blocks)] = torch.tensor(r.table.blocks, dtype=torch.long)
        self.table = table.to(cache.device)

    def _rows(self, pos: torch.Tensor) -> torch.Tensor:  # pos [B, *] token positions -> flat storage rows
        return pool_rows(self.table, self.cache.block_size, pos)

    def attn_write(self, layer: int, new: torch.Tensor) -> None:
        """new [B, T, C]: the valid rows into the pool."""
        fb, store = self.fb, self.cache.kv[layer]
        flat = store.view(-1, store.shape[-1])
        valid = fb.valid(new.shape[1])
        flat[self._rows(fb.positions(new.shape[1]))[valid]] = new[valid].to(flat.dtype)

    def attn_append(self, layer: int, new: torch.Tensor) -> torch.Tensor:
        """new [B, T, C] -> [B, L, C]: every row 0..num_cached+num_new−1 per request, zero right padding."""
        fb, store = self.fb, self.cache.kv[layer]
        B, T, C = new.shape
        flat = store.view(-1, store.shape[-1])
        self.attn_write(layer, new)
        lengths = fb.num_cached + fb.num_new
        L = int(lengths.max()) if B else 0
        lengths = lengths.to(flat.device)
        pos = torch.arange(L, device=flat.device)[None].expand(B, L)
        out = flat[self._rows(pos)]  # [B, L, C]
        return out.masked_fill((pos >= lengths[:, None])[..., None], 0)

    def attn_pages(self, layer: int) -> None:
        return None  # rows go through attn_append (a prefill writes its valid rows only)

    def kda_read(self, layer: int):
        return self.cache.state.read(layer, self.slots)

    def kda_pools(self, layer: int) -> None:
        return None  # a prefill's slots start from "no state yet" (kda_read), which the pools do not say

    def kda_write(self, layer: int, states: torch.Tensor, conv: torch.Tensor) -> None:
        if self.fb.record:
            self.cache.state.write_pending(layer, self.slots, states, conv)
        else:
            self.cache.state.write_final(layer, self.slots, states, conv)


class PagedCache:
    def __init__(self, attn_layers: dict[int, int], kda_layers: dict[int, LayerShape], num_blocks: int,
                 block_size: int = 16, max_requests: int = 64, dtype: torch.dtype = torch.float32, device="cpu",
                 prefix_cache: PrefixCacheConfig | None = None):
        """attn_layers: {layer: C}; kda_layers: {layer: (H, K, V, conv_channels, W)}."""
        self.attn_layers, self.kda_layers = dict(attn_layers), dict(kda_layers)
        self.device = torch.device(device)
        self.block_size, self.max_requests = block_size, max_requests
        self.pool = BlockPool(num_blocks, block_size)
        self.scratch_block = num_blocks  # one block past the pool's: where the padding rows of a step write
        self.kv = {ly: torch.zeros(num_blocks + 1, block_size, C, dtype=dtype, device=device)
                   for ly, C in self.attn_layers.items()}  # layer -> [num_blocks + 1, block_size, C]
        self.state = KDAStatePool(max_requests, self.kda_layers, device=device)
        self.kv_bytes_per_block = sum(t[0].nbytes for t in self.kv.values())
        self.scratch_slot = self.state.scratch_slot
        self.prefix = None
        if prefix_cache is not None:
            self.prefix = PrefixCache(self.pool, self.kv_bytes_per_block, bool(self.kda_layers), prefix_cache)
        self.reqs: dict[Hashable, _Request] = {}
        self._batch: tuple[ForwardBatch, list[_Request]] | None = None

    # --- requests ---
    def add_request(self, rid: Hashable) -> None:
        if rid in self.reqs:
            raise ValueError(f"PagedCache: request {rid!r} already added")
        if len(self.reqs) >= self.max_requests:
            raise RuntimeError(f"PagedCache: max_requests={self.max_requests} reached; let the request wait")
        self.reqs[rid] = _Request(BlockTable(self.pool), self.state.allocate() if self.kda_layers else None)

    def free_request(self, rid: Hashable) -> None:
        """Release the request's blocks (cached ones stay with the prefix cache) and state slot. Idempotent."""
        r = self.reqs.pop(rid, None)
        if r is None:
            return
        r.table.release()
        if r.slot is not None:
            self.state.free(r.slot)

    def num_tokens(self, rid: Hashable) -> int:
        return self.reqs[rid].table.num_tokens

    @property
    def bytes_held(self) -> int:
        """KV blocks in use (by requests or the prefix cache) + request state slots + prefix-cache checkpoints."""
        ckpt = self.prefix.checkpoint_bytes if self.prefix is not None else 0
        return self.pool.num_used * self.kv_bytes_per_block + self.state.bytes_held + ckpt

    # --- one forward ---
    def batch(self, rids: Sequence[Hashable], num_new, record: bool = False) -> ForwardBatch:
        """Reserve blocks for num_cached + num_new tokens per request (all-or-nothing: OutOfBlocks leaves
        everything unchanged) and return the ForwardBatch whose cache is a view over exactly these rows."""
        if len(set(rids)) != len(rids):
            raise ValueError("PagedCache.batch: duplicate request ids")
        reqs = [self.reqs[rid] for rid in rids]
        num_new = torch.as_tensor(num_new, dtype=torch.long).expand(len(reqs)).clone()
        num_cached = torch.tensor([r.table.num_tokens for r in reqs], dtype=torch.long)
        need = [r.table.blocks_needed(int(c + n)) for r, c, n in zip(reqs, num_cached, num_new)]
        fresh = self.pool.allocate(sum(need))
        for r, k in zip(reqs, need):
            r.table.blocks += fresh[:k]
            fresh = fresh[k:]
        fb = ForwardBatch(num_cached, num_new, None, record, self.device)
        fb.cache = PagedView(self, reqs, fb)
        self._batch = (fb, reqs)
        return fb

    def commit(self, n_keep=None) -> None:
        """Keep n_keep[b] of the last batch's new tokens per row (default all); see DenseCache.commit."""
        if self._batch is None:
            raise ValueError("PagedCache.commit: no batch to commit")
        fb, reqs = self._batch
        n_keep = fb.num_new if n_keep is None else torch.as_tensor(n_keep, dtype=torch.long).expand(len(reqs))
        if bool((n_keep > fb.num_new).any() or (n_keep < 0).any()):
            raise ValueError("commit: n_keep must lie in 0..num_new for every row")
        if self.kda_layers and not fb.record and not torch.equal(n_keep, fb.num_new):
            raise ValueError("commit: a forward with record=False cannot roll back recurrent state")
        alive = {id(x) for x in self.reqs.values()}
        live = [id(r) in alive for r in reqs]  # skip requests freed (cancelled) mid-forward
        self.state.commit(fb.cache.slots, n_keep, live)
        for r, k, ok in zip(reqs, n_keep.tolist(), live):
            r.table.num_tokens += k if ok else 0
        self._batch = None

    # --- a device-side step (dspark.runner) ---
    def reserve(self, rids: Sequence[Hashable], num_tokens: Sequence[int]) -> list[_Request]:
        """Blocks for num_tokens[b] tokens per request (all-or-nothing: OutOfBlocks changes nothing)."""
        reqs = [self.reqs[rid] for rid in rids]
        need = [r.table.blocks_needed(n) for r, n in zip(reqs, num_tokens)]
        if not any(need):  # the common step: every row's blocks already hold it
            return reqs
        fresh = self.pool.allocate(sum(need))
        for r, k in zip(reqs, need):
            if k:
                r.table.blocks += fresh[:k]
                fresh = fresh[k:]
        return reqs

    def step_rows(self, rids: Sequence[Hashable], T: int | Sequence[int]
                  ) -> tuple[list[int], list[list[int]], list[int]]:
        """Reserve room for T more tokens per request (an int, or one count per request) -> (num_cached, block-table
        rows (unpadded: the runner pads them to its step's width with the scratch block), KDA slots), what a
        DeviceView of these rows reads."""
        counts = [T] * len(rids) if isinstance(T, int) else list(T)
        reqs = self.reserve(rids, [self.reqs[rid].table.num_tokens + t for rid, t in zip(rids, counts)])
        tables = [list(r.table.blocks) for r in reqs]
        slots = [self.scratch_slot if r.slot is None else r.slot for r in reqs]
        return [r.table.num_tokens for r in reqs], tables, slots

    def device_view(self, num_cached, num_new, table, slots, T: int, record: bool) -> DeviceView:
        return DeviceView(self.kv, self.state.S, self.state.conv, self.block_size, num_cached, num_new, table, slots,
                          T, record)

    def advance(self, rids: Sequence[Hashable], n_keep: Sequence[int], prefill: bool = False) -> None:
        """After a device-side step: the rows' committed lengths (its KDA commit happened on the device). After a
        prefill the rows' KDA states count as written (what PagedView and export read)."""
        for rid, n in zip(rids, n_keep):
            r = self.reqs.get(rid)
            if r is not None:  # cancelled mid-step
                r.table.num_tokens += n
                if prefill and r.slot is not None:
                    for written in self.state.written.values():
                        written[r.slot] = True

    # --- prefix caching ---
    def match_prefix(self, rid: Hashable, prompt_ids: Sequence[int], salt: int | None = None) -> int:
        """Attach the longest cached prefix of the same salt to a fresh request (its prompt blocks are offered under
        that salt too: blocks.prefix_hashes); returns its length (prefill the rest)."""
        r = self.reqs[rid]
        if self.prefix is None:
            return 0
        if r.table.num_tokens or r.table.blocks:
            raise ValueError(f"match_prefix: request {rid!r} already holds tokens")
        m = self.prefix.match(prompt_ids, salt)
        r.prefix = m
        if m.num_tokens:
            self.pool.incref(m.blocks)
            r.table.blocks, r.table.num_tokens = list(m.blocks), m.num_tokens
            if m.state is not None:
                self.state.import_(r.slot, m.state)
        return m.num_tokens

    def checkpoint_positions(self, rid: Hashable, prompt_len: int) -> list[int]:
        """Prompt positions (token counts) where a prefill chunk must end so that a KDA checkpoint can be taken."""
        r = self.reqs[rid]
        if self.prefix is None:
            return []
        junction = r.prefix.junction if r.prefix is not None else 0
        return self.prefix.checkpoint_positions(prompt_len, r.table.num_tokens, junction)

    def after_prefill(self, rid: Hashable, prompt_ids: Sequence[int], num_computed: int) -> None:
        """Offer the request's full prompt blocks (and its KDA state if num_computed is a checkpoint position)."""
        if self.prefix is None:
            return
        r = self.reqs[rid]
        m = r.prefix
        hashes = m.hashes if m is not None else prefix_hashes(prompt_ids, self.block_size)
        want = num_computed in self.prefix.checkpoint_positions(len(prompt_ids), 0, m.junction if m else 0)
        take = (lambda: self.state.export(r.slot)) if want and r.slot is not None else None
        self.prefix.insert(hashes, r.table.blocks, min(num_computed, len(prompt_ids)), take, self.state.bytes_per_slot)

    def _token_rows(self, r: _Request, n: int) -> torch.Tensor:  # [n]: flat storage row of tokens 0..n-1
        pos = torch.arange(n)
        bs = self.block_size
        return torch.tensor(r.table.blocks, dtype=torch.long)[pos // bs] * bs + pos % bs

    # --- prefill -> decode handoff (single-machine disaggregation) ---
    def export_request(self, rid: Hashable) -> dict:
        """{'num_tokens', 'attn': {layer: [n, C]}, 'kda': {layer: (S, conv, written)}}: detached CPU copies."""
        r = self.reqs[rid]
        n = r.table.num_tokens
        rows = self._token_rows(r, n)
        attn = {ly: t.view(-1, t.shape[-1])[rows].detach().cpu().clone() for ly, t in self.kv.items()}
        kda = self.state.export(r.slot) if r.slot is not None else {}
        return {"num_tokens": n, "attn": attn, "kda": kda}

    def import_request(self, rid: Hashable, exported: dict) -> None:
        """Admit a request whose cache was computed elsewhere (another PagedCache with the same layer layout)."""
        if set(exported["attn"]) != set(self.kv) or set(exported["kda"]) != set(self.kda_layers):
            raise ValueError("import_request: the exported request has a different layer layout")
        n = int(exported["num_tokens"])
        self.add_request(rid)
        r = self.reqs[rid]
        try:
            r.table.ensure(n)
        except OutOfBlocks:
            self.free_request(rid)
            raise
        rows = self._token_rows(r, n)
        for ly, t in self.kv.items():
            t.view(-1, t.shape[-1])[rows] = exported["attn"][ly].to(t.device, t.dtype)
        if r.slot is not None:
            self.state.import_(r.slot, exported["kda"])
        r.table.num_tokens = n
