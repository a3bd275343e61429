"""Prefix cache for a hybrid (attention + KDA) target.

KV: every full prompt block is registered under its chained hash (`blocks.chain_hash`) and shared, ref-counted,
by later requests with the same prefix. KDA: a recurrent state cannot be rolled back or recomputed from KV, so a
prefix is usable only where a state checkpoint was taken. A hit is the longest block-aligned prefix (shorter than
the prompt, so at least one token is computed) for which all KV blocks AND a KDA checkpoint exist; a model without
KDA layers needs KV alone.

Retention policies (docs/k3-model.md, "Prefix caching with KDA state"; Marconi):
- `interval`: checkpoint at the prompt boundary floor((len−1)/bs)·bs and every `retention_interval` tokens.
- `second_hit`: speculative insertion. Every prompt leaves token-only entries (its prefix hashes). A state is
  admitted only at a branch point: the longest block-aligned prefix this prompt shares with an earlier one. So the
  first sighting stores no state, the second stores it at the junction, and the third onwards hits.
Checkpoints land where a forward ends, so the engine cuts prefill chunks at `checkpoint_positions`.
Eviction: LRU over cached blocks that no running request references (and their checkpoints), on demand from the
block pool; checkpoints also by LRU under `max_checkpoint_bytes`.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dspark.cache.blocks import BlockPool, prefix_hashes

POLICIES = ("interval", "second_hit")


@dataclass
class PrefixCacheConfig:
    policy: str = "interval"  # "interval" | "second_hit"
    retention_interval: int = 0  # interval policy: extra checkpoint every N tokens (multiple of block_size); 0 = off
    max_checkpoint_bytes: int | None = None  # LRU budget for KDA checkpoints; None = bounded by KV blocks only
    max_seen_prefixes: int = 1 << 16  # second_hit: token-only entries kept (LRU)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"PrefixCacheConfig.policy={self.policy!r}: expected one of {POLICIES}")
        if self.retention_interval < 0:
            raise ValueError(f"PrefixCacheConfig.retention_interval={self.retention_interval}: expected >= 0")


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0  # tokens of all looked-up prompts
    hit_tokens: int = 0  # prefill tokens saved
    blocks_cached: int = 0  # KV blocks registered
    checkpoints_stored: int = 0
    block_evictions: int = 0
    checkpoint_evictions: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.prompt_tokens)


@dataclass
class PrefixMatch:
    num_tokens: int  # cached prefix length (block-aligned); the engine prefills from here
    blocks: list[int]  # KV blocks covering it
    state: dict | None  # KDA checkpoint at num_tokens (None when the model has no KDA layers or no hit)
    hashes: list[int] = field(default_factory=list)  # chained hashes of every full block of the prompt
    junction: int = 0  # second_hit: block-aligned length shared with an earlier prompt


@dataclass
class _Checkpoint:
    num_tokens: int
    state: dict  # {layer: (S [H,K,V], conv [W-1,C], written)}
    nbytes: int
    chain: frozenset  # hashes of the blocks it sits on: evicting any of them makes it unreachable


class PrefixCache:
    def __init__(self, pool: BlockPool, kv_bytes_per_block: int, has_state: bool, config: PrefixCacheConfig):
        bs = pool.block_size
        if config.retention_interval % bs:
            raise ValueError(f"PrefixCacheConfig.retention_interval={config.retention_interval}: "
                             f"must be a multiple of block_size={bs}")
        self.pool, self.bs, self.kv_bytes_per_block = pool, bs, kv_bytes_per_block
        self.has_state, self.config = has_state, config
        self.blocks: OrderedDict[int, int] = OrderedDict()  # hash -> block id; front = least recently used
        self.ckpts: OrderedDict[int, _Checkpoint] = OrderedDict()  # prefix hash -> state after that prefix
        self.seen: OrderedDict[int, None] = OrderedDict()  # second_hit token-only entries
        self.stats = PrefixStats()
        pool.evictor = self

    @property
    def checkpoint_bytes(self) -> int:
        return sum(c.nbytes for c in self.ckpts.values())

    @property
    def bytes_held(self) -> int:
        return len(self.blocks) * self.kv_bytes_per_block + self.checkpoint_bytes

    # --- lookup ---
    def match(self, prompt_ids: Sequence[int], salt: int | None = None) -> PrefixMatch:
        """Longest usable cached prefix of the prompt (< len(prompt_ids)) among blocks of the same salt
        (blocks.prefix_hashes); touches what it uses."""
        hashes = prefix_hashes(prompt_ids, self.bs, salt=salt)
        limit = max(0, (len(prompt_ids) - 1) // self.bs)  # leave >= 1 token to compute
        m = 0
        while m < limit and hashes[m] in self.blocks:
            m += 1
        n_blocks = m
        if self.has_state:
            n_blocks = next((i for i in range(m, 0, -1) if hashes[i - 1] in self.ckpts), 0)
        junction = 0
        if self.config.policy == "second_hit":
            junction = next((i for i in range(limit, 0, -1) if hashes[i - 1] in self.seen), 0) * self.bs
            for h in hashes[:limit]:
                self.seen[h] = None
                self.seen.move_to_end(h)
            while len(self.seen) > self.config.max_seen_prefixes:
                self.seen.popitem(last=False)
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(prompt_ids)
        state = None
        if n_blocks:
            self.stats.hits += 1
            self.stats.hit_tokens += n_blocks * self.bs
            if self.has_state:
                self.ckpts.move_to_end(hashes[n_blocks - 1])
                state = self.ckpts[hashes[n_blocks - 1]].state
            for h in reversed(hashes[:n_blocks]):  # deepest first, so parents end up most recent
                self.blocks.move_to_end(h)
        return PrefixMatch(n_blocks * self.bs, [self.blocks[h] for h in hashes[:n_blocks]], state, hashes, junction)

    def checkpoint_positions(self, prompt_len: int, num_cached: int, junction: int = 0) -> list[int]:
        """Token counts in (num_cached, prompt_len) at which a prefill chunk should end so its KDA state is kept."""
        if not self.has_state:
            return []
        if self.config.policy == "second_hit":
            pos = {junction}
        else:
            pos = {(prompt_len - 1) // self.bs * self.bs}
            step = self.config.retention_interval
            if step:
                pos |= set(range(step, prompt_len, step))
        return sorted(p for p in pos if num_cached < p < prompt_len)

    # --- insertion ---
    def insert(self, hashes: Sequence[int], blocks: Sequence[int], num_computed: int,
               take_state: Callable[[], dict] | None = None, state_bytes: int = 0) -> None:
        """Register the full blocks among the first num_computed tokens (blocks[i] holds block i) and, if
        take_state is given, the KDA state after num_computed tokens (a block-aligned checkpoint position)."""
        n = min(num_computed // self.bs, len(hashes), len(blocks))
        for i in range(n):
            h = hashes[i]
            if h not in self.blocks:
                self.pool.incref([blocks[i]])
                self.blocks[h] = blocks[i]
                self.stats.blocks_cached += 1
        for h in reversed(hashes[:n]):
            self.blocks.move_to_end(h)
        at_block = num_computed % self.bs == 0 and 0 < num_computed // self.bs <= n
        if take_state is not None and self.has_state and at_block:
            h = hashes[num_computed // self.bs - 1]
            if h not in self.ckpts:
                self.ckpts[h] = _Checkpoint(num_computed, take_state(), state_bytes, frozenset(hashes[:n]))
                self.stats.checkpoints_stored += 1
            self.ckpts.move_to_end(h)
            self._trim_checkpoints()

    def _trim_checkpoints(self) -> None:
        cap = self.config.max_checkpoint_bytes
        while cap is not None and self.ckpts and self.checkpoint_bytes > cap:
            self.ckpts.popitem(last=False)
            self.stats.checkpoint_evictions += 1

    # --- eviction (the block pool's Evictor) ---
    def num_evictable(self) -> int:
        return sum(1 for b in self.blocks.values() if self.pool.ref_counts[b] == 1)

    def evict(self, n: int) -> int:
        """Release up to n least recently used cached blocks that no request holds; drops their checkpoints."""
        victims = [h for h, b in self.blocks.items() if self.pool.ref_counts[b] == 1][:n]
        for h in victims:
            self.pool.free([self.blocks.pop(h)])
            self.stats.block_evictions += 1
        gone = set(victims)
        for h in [h for h, c in self.ckpts.items() if not gone.isdisjoint(c.chain)]:
            del self.ckpts[h]
            self.stats.checkpoint_evictions += 1
        return len(victims)

    def clear(self) -> None:
        """Drop every cached block and checkpoint (running requests keep their own references)."""
        self.pool.free(list(self.blocks.values()))
        self.blocks.clear()
        self.ckpts.clear()
        self.seen.clear()
