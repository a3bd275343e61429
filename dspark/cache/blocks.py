"""Blocks: a fixed pool of KV blocks with reference counts, chained block hashes, and per-request block tables.

A block holds `block_size` token rows of every attention layer (the storage itself lives in `paged.py`).
Owners of a block each hold one reference: the request whose table lists it, and the prefix cache while the block
is cached. A block returns to the free list when its last reference goes. Allocation is all-or-nothing: when the
pool cannot serve a request it raises `OutOfBlocks` before changing anything, so the scheduler can make the
request wait (or refuse it) and retry later.
"""
from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence
from typing import Protocol

try:
    import xxhash

    def _digest(data: bytes) -> int:
        return xxhash.xxh64_intdigest(data)
except ImportError:  # pragma: no cover - xxhash ships with datasets in our venv
    def _digest(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def chain_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """Hash of a full block given the hash of the block before it (None for the first block): equal hashes mean
    equal whole prefixes, not just equal blocks."""
    head = (-1 if parent is None else parent).to_bytes(8, "little", signed=True)
    body = b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids)
    return _digest(head + body) & 0x7FFF_FFFF_FFFF_FFFF


def prefix_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int | None = None,
                  salt: int | None = None) -> list[int]:
    """Chained hashes of the first `num_blocks` full blocks of token_ids (default: all full blocks). salt (a negative
    int: real hashes are not) stands before the first block, so that blocks computed differently (vLLM's cache_salt)
    never share a hash with unsalted ones."""
    n = len(token_ids) // block_size if num_blocks is None else num_blocks
    out, h = [], salt
    for i in range(n):
        h = chain_hash(h, token_ids[i * block_size: (i + 1) * block_size])
        out.append(h)
    return out


class OutOfBlocks(RuntimeError):
    """The pool cannot serve an allocation; nothing was allocated."""

    def __init__(self, needed: int, free: int, evictable: int = 0):
        self.needed, self.free, self.evictable = needed, free, evictable
        super().__init__(f"out of KV blocks: needed {needed}, free {free}, evictable cached {evictable}; "
                         "let the request wait for running ones to finish, or raise num_blocks")


class Evictor(Protocol):
    """Something that holds references to otherwise idle blocks and can let go of them (the prefix cache)."""

    def num_evictable(self) -> int: ...

    def evict(self, n: int) -> int: ...


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"BlockPool: num_blocks={num_blocks} and block_size={block_size} must be > 0")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictor: Evictor | None = None

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def can_allocate(self, n: int) -> bool:
        spare = self.evictor.num_evictable() if self.evictor is not None and n > self.num_free else 0
        return n <= self.num_free + spare

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with refcount 1, evicting idle cached blocks if needed; OutOfBlocks changes nothing."""
        if n > self.num_free:
            spare = self.evictor.num_evictable() if self.evictor is not None else 0
            if n > self.num_free + spare:
                raise OutOfBlocks(n, self.num_free, spare)
            self.evictor.evict(n - self.num_free)
        out = [self.free_ids.popleft() for _ in range(n)]
        for b in out:
            self.ref_counts[b] = 1
        return out

    def incref(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"incref on free block {b}")
            self.ref_counts[b] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference per listed block; a block with none left returns to the free list."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_ids.append(b)


class BlockTable:
    """One request's blocks: token position p lives in block blocks[p // block_size], row p % block_size."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.num_tokens = 0  # committed tokens

    def blocks_needed(self, n_tokens: int) -> int:
        return max(0, -(-n_tokens // self.pool.block_size) - len(self.blocks))

    def ensure(self, n_tokens: int) -> None:
        """Make room for n_tokens tokens (all-or-nothing)."""
        self.blocks += self.pool.allocate(self.blocks_needed(n_tokens))

    def release(self) -> None:
        self.pool.free(self.blocks)
        self.blocks, self.num_tokens = [], 0
