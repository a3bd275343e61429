"""Cache: block pool accounting, PagedCache == DenseCache, export/import, KDA snapshot commit, prefix caching."""
import random

import pytest
import torch

from dspark.cache.batch import DenseCache
from dspark.cache.blocks import BlockPool, BlockTable, OutOfBlocks, chain_hash, prefix_hashes
from dspark.cache.paged import PagedCache
from dspark.cache.prefix import PrefixCacheConfig
from dspark.cache.state import KDAStatePool

ATTN = {0: 6, 2: 4}  # layer -> C
KDA = {1: (2, 3, 3, 5, 4)}  # layer -> (H, K, V, C, W)


# --- block pool ---
def test_block_pool_refcounts_and_out_of_blocks():
    pool = BlockPool(6, 4)
    a = pool.allocate(4)
    assert pool.num_free == 2 and all(pool.ref_counts[b] == 1 for b in a)
    pool.incref(a[:2])
    pool.free(a)
    assert pool.num_free == 4 and [pool.ref_counts[b] for b in a] == [1, 1, 0, 0]
    before = (list(pool.free_ids), list(pool.ref_counts))
    with pytest.raises(OutOfBlocks, match="needed 5, free 4"):
        pool.allocate(5)
    assert (list(pool.free_ids), list(pool.ref_counts)) == before
    pool.free(a[:2])
    assert pool.num_free == 6
    with pytest.raises(ValueError):
        pool.free(a[:1])
    t = BlockTable(pool)
    t.ensure(9)
    assert len(t.blocks) == 3
    t.ensure(12)
    assert len(t.blocks) == 3
    with pytest.raises(OutOfBlocks):
        t.ensure(100)
    assert len(t.blocks) == 3 and pool.num_free == 3
    t.release()
    assert pool.num_free == 6


def test_chained_hashes():
    a, b = list(range(8)), list(range(8, 16))
    assert prefix_hashes(a + b, 8) == [chain_hash(None, a), chain_hash(chain_hash(None, a), b)]
    assert prefix_hashes(b + b, 8)[1] != prefix_hashes(a + b, 8)[1]  # same block, different prefix
    assert len(prefix_hashes(a + b + [1, 2], 8)) == 2
    salted = prefix_hashes(a + b, 8, salt=-2)  # blocks computed differently (the drafter's rows left out) stand apart
    assert salted[0] == chain_hash(-2, a) and not set(salted) & set(prefix_hashes(a + b, 8))


def test_paged_batch_is_atomic_and_leak_free():
    c = PagedCache(ATTN, KDA, num_blocks=5, block_size=4, max_requests=4)
    for rid in "abc":
        c.add_request(rid)
    c.batch(["a", "b"], [8, 4])
    c.commit()
    state = (c.pool.num_free, [list(c.reqs[r].table.blocks) for r in "abc"])
    with pytest.raises(OutOfBlocks, match="needed 3, free 2"):
        c.batch(["a", "b", "c"], [1, 4, 4])  # a needs 1, b 1, c 1 -> 3 > 2
    assert (c.pool.num_free, [list(c.reqs[r].table.blocks) for r in "abc"]) == state
    b = c.batch(["a", "c"], [2, 3], record=True)
    b.cache.kda_write(1, torch.ones(2, 3, 2, 3, 3), torch.ones(2, 6, 5))
    c.free_request("c")  # cancelled mid-forward
    c.free_request("c")  # idempotent
    c.add_request("d")  # may reuse c's state slot
    c.commit([1, 2])
    assert c.num_tokens("a") == 9 and c.num_tokens("d") == 0
    assert c.state.read(1, [c.reqs["d"].slot]) == (None, None)  # nothing of c leaks into d
    c.free_request("d")
    c.free_request("a")
    c.free_request("b")
    assert c.pool.num_free == 5 and c.state.num_free == 4 and c.bytes_held == 0


# --- PagedCache == DenseCache ---
def _norm(x, shape):
    return torch.zeros(shape) if x is None else x


def test_paged_matches_dense_random():
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    B, max_len = 3, 80
    dense = DenseCache(B, max_len)
    paged = PagedCache(ATTN, KDA, num_blocks=3 * 80 // 4, block_size=4, max_requests=B)
    rids = ["r0", "r1", "r2"]
    for r in rids:
        paged.add_request(r)
    H, K, Vd, C, W = KDA[1]
    for step in range(40):
        record = step > 2 and rng.random() < 0.5
        num_new = torch.tensor([rng.randint(0, 5) for _ in range(B)])
        if int((dense.lengths + num_new).max()) > max_len:
            break
        T = int(num_new.max()) + rng.randint(0, 2)  # extra right padding
        perm = rng.sample(range(B), B)  # paged rows in a different order
        db = dense.batch(num_new, record)
        pb = paged.batch([rids[i] for i in perm], num_new[perm], record)
        assert torch.equal(pb.num_cached, db.num_cached[perm])
        for layer, Cl in ATTN.items():
            new = torch.randn(B, T, Cl, generator=g)
            d_out, p_out = dense.attn_append(layer, new), pb.cache.attn_append(layer, new[perm])
            L = int((db.num_cached + num_new).max())
            assert p_out.shape == (B, L, Cl) and d_out.shape[1] == L
            keep = (torch.arange(L)[None] < (db.num_cached + num_new)[:, None])[..., None]
            assert torch.equal((d_out * keep)[perm], p_out)
        dS, dc = dense.kda_read(1)
        pS, pc = pb.cache.kda_read(1)
        assert (dS is None) == (pS is None)
        assert torch.equal(_norm(dS, (B, H, K, Vd))[perm], _norm(pS, (B, H, K, Vd)))
        assert torch.equal(_norm(dc, (B, W - 1, C))[perm], _norm(pc, (B, W - 1, C)))
        if record:
            states, conv = torch.randn(B, T, H, K, Vd, generator=g), torch.randn(B, W - 1 + T, C, generator=g)
            n_keep = torch.tensor([rng.randint(min(1, n), n) if rng.random() < 0.8 else 0 for n in num_new.tolist()])
        else:
            states, conv = torch.randn(B, H, K, Vd, generator=g), torch.randn(B, W - 1, C, generator=g)
            n_keep = num_new
        dense.kda_write(1, states, conv)
        pb.cache.kda_write(1, states[perm], conv[perm])
        dense.commit(n_keep)
        paged.commit(n_keep[perm])
        assert [paged.num_tokens(rids[i]) for i in range(B)] == dense.lengths.tolist()
    assert step > 10
    # a record=False forward cannot keep fewer tokens, in both
    pb = paged.batch(rids, [2, 2, 2])
    with pytest.raises(ValueError):
        paged.commit([1, 2, 2])


def test_state_snapshot_commit():
    pool = KDAStatePool(2, {5: (1, 2, 2, 3, 3)})
    s = pool.allocate()
    assert pool.read(5, [s]) == (None, None)
    S0, c0 = torch.ones(1, 1, 2, 2), torch.arange(6.0).view(1, 2, 3)
    pool.write_final(5, [s], S0, c0)
    states = torch.arange(4.0)[None, :, None, None, None].expand(1, 4, 1, 2, 2)  # state after t0, d1, d2, d3
    ext = torch.arange(18.0).view(1, 6, 3)  # old window (2 rows) + 4 new inputs
    pool.write_pending(5, [s], states, ext)
    pool.commit([s], torch.tensor([2]))  # t0 and d1 kept
    S, conv = pool.read(5, [s])
    assert torch.equal(S, torch.ones(1, 1, 2, 2)) and torch.equal(conv, ext[:, 2:4])
    pool.write_pending(5, [s], states, ext)
    pool.commit([s], torch.tensor([0]))  # nothing kept: the old state stays
    assert torch.equal(pool.read(5, [s])[0], torch.ones(1, 1, 2, 2))
    data = pool.export(s)
    pool.free(s)
    s2 = pool.allocate()
    assert pool.read(5, [s2]) == (None, None)
    pool.import_(s2, data)
    assert torch.equal(pool.read(5, [s2])[0], torch.ones(1, 1, 2, 2))
    assert pool.bytes_held == pool.bytes_per_slot == (4 + 6) * 4


def test_export_import_round_trip():
    g = torch.Generator().manual_seed(1)
    src = PagedCache(ATTN, KDA, num_blocks=16, block_size=4, max_requests=2)
    dst = PagedCache(ATTN, KDA, num_blocks=16, block_size=4, max_requests=2)
    src.add_request("p")
    b = src.batch(["p"], [11])
    rows = {ly: b.cache.attn_append(ly, torch.randn(1, 11, C, generator=g)) for ly, C in ATTN.items()}
    S, conv = torch.randn(1, 2, 3, 3, generator=g), torch.randn(1, 3, 5, generator=g)
    b.cache.kda_write(1, S, conv)
    src.commit()
    ex = src.export_request("p")
    src.free_request("p")
    dst.add_request("other")  # the destination's blocks are laid out differently
    dst.batch(["other"], [5])
    dst.commit()
    dst.import_request("p", ex)
    b2 = dst.batch(["p"], [1])
    for ly, C in ATTN.items():
        out = b2.cache.attn_append(ly, torch.zeros(1, 1, C))
        assert torch.equal(out[:, :11], rows[ly])
    S2, conv2 = b2.cache.kda_read(1)
    assert torch.equal(S2, S) and torch.equal(conv2, conv)
    small = PagedCache(ATTN, KDA, num_blocks=2, block_size=4, max_requests=2)
    with pytest.raises(OutOfBlocks):
        small.import_request("p", ex)
    assert small.reqs == {} and small.pool.num_free == 2


# --- prefix caching over a toy hybrid model (layer 0 attention, layer 1 KDA-like recurrence) ---
class ToyHybrid:
    d, W = 4, 3
    attn, kda = {0: 4}, {1: (1, 4, 4, 4, 3)}

    def __init__(self, vocab=40):
        g = torch.Generator().manual_seed(0)
        self.emb = torch.randn(vocab, self.d, generator=g)
        self.wk, self.wv = torch.randn(self.d, self.d, generator=g), torch.randn(self.d, self.d, generator=g)

    def __call__(self, ids, batch):  # ids [B, T] -> [B, T, d]
        B, T = ids.shape
        x = self.emb[ids]
        rows = batch.cache.attn_append(0, x)  # [B, L, d]
        mask = batch.key_mask(T, rows.shape[1])[:, 0]
        x = x + (x @ rows.transpose(1, 2)).masked_fill(~mask, float("-inf")).softmax(-1) @ rows
        S, conv = batch.cache.kda_read(1)
        S = torch.zeros(B, 1, self.d, self.d) if S is None else S
        ext = torch.cat([torch.zeros(B, self.W - 1, self.d) if conv is None else conv, x], 1)
        valid, ys, states = batch.valid(T), [], []
        for t in range(T):
            u = ext[:, t: t + self.W].sum(1)
            k, v = torch.tanh(u @ self.wk), u @ self.wv
            S = torch.where(valid[:, t, None, None, None], 0.9 * S + k[:, None, :, None] * v[:, None, None, :], S)
            states.append(S)
            ys.append(torch.einsum("bhkv,bk->bv", S, k))
        if batch.record:
            batch.cache.kda_write(1, torch.stack(states, 1), ext)
        else:
            idx = batch.num_new[:, None] + torch.arange(self.W - 1)[None]
            batch.cache.kda_write(1, S, ext[torch.arange(B)[:, None], idx])
        return x + torch.stack(ys, 1)


def _prefill(model, cache, rid, prompt):
    """What the engine does: match, then prefill in chunks cut at the checkpoint positions. -> last output [d]."""
    cache.add_request(rid)
    done = cache.match_prefix(rid, prompt)
    cuts = cache.checkpoint_positions(rid, len(prompt)) + [len(prompt)]
    for end in cuts:
        ids = torch.tensor([prompt[done:end]])
        out = model(ids, cache.batch([rid], [end - done]))
        cache.commit()
        done = end
        cache.after_prefill(rid, prompt, done)
    return out[0, -1]


def _reference(model, prompt):
    dc = DenseCache(1, len(prompt))
    return model(torch.tensor([prompt]), dc.batch([len(prompt)]))[0, -1]


def _workload(seed=0, n=12):
    rng = random.Random(seed)
    system = [rng.randrange(40) for _ in range(40)]
    prompts = [system + [rng.randrange(40) for _ in range(rng.randint(3, 20))] for _ in range(n)]
    return prompts + [prompts[0], prompts[1]]  # two exact repeats


@pytest.mark.parametrize("policy,interval", [("interval", 16), ("interval", 0), ("second_hit", 0)])
def test_prefix_cache_hits_and_exactness(policy, interval):
    model = ToyHybrid()
    cache = PagedCache(model.attn, model.kda, num_blocks=64, block_size=8, max_requests=4,
                       prefix_cache=PrefixCacheConfig(policy, interval))
    prompts = _workload()
    hits = []
    for i, p in enumerate(prompts):
        out = _prefill(model, cache, f"r{i}", p)
        hits.append(cache.reqs[f"r{i}"].prefix.num_tokens)
        if i == 0 and policy == "second_hit":
            assert cache.prefix.stats.checkpoints_stored == 0  # first sighting: tokens only
        assert torch.allclose(out, _reference(model, p), atol=1e-5), i
        cache.free_request(f"r{i}")
    st = cache.prefix.stats
    print(f"\n{policy}(interval={interval}): hits per request {hits}; {st}; token hit rate {st.token_hit_rate:.3f}; "
          f"bytes held {cache.prefix.bytes_held}")
    assert hits[0] == 0
    if policy == "interval" and interval == 16:
        assert min(hits[1:12]) >= 32  # the interval checkpoint inside the 40-token system prompt
    if policy == "interval" and interval == 0:
        # only prompt-end states exist: a hit needs an earlier prompt whose boundary lies inside the shared prefix
        ends = [(len(q) - 1) // 8 * 8 for q in prompts]
        assert hits[1] == 0 and all(h == 0 or h in ends[:i] for i, h in enumerate(hits))
    if policy == "second_hit":
        assert hits[1] == 0 and hits[2:12] == [40] * 10  # state admitted at the junction by the 2nd request
        assert st.checkpoints_stored <= 3
    assert hits[12] == hits[13] == (len(prompts[0]) - 1) // 8 * 8 or policy == "second_hit"
    assert st.hit_tokens == sum(hits) and st.lookups == len(prompts)
    # no leak: only the cache holds blocks, each exactly once; clearing it empties the pool
    assert cache.pool.num_used == len(cache.prefix.blocks)
    assert all(cache.pool.ref_counts[b] == 1 for b in cache.prefix.blocks.values())
    assert cache.state.num_free == 4
    cache.prefix.clear()
    assert cache.pool.num_free == 64 and cache.bytes_held == 0


def test_prefix_cache_without_kda_is_kv_only():
    model = ToyHybrid()
    cache = PagedCache(model.attn, {}, num_blocks=32, block_size=8, prefix_cache=PrefixCacheConfig("second_hit"))
    p = list(range(30))
    cache.add_request("a")
    assert cache.match_prefix("a", p) == 0 and cache.checkpoint_positions("a", 30) == []
    cache.batch(["a"], [30])
    cache.commit()
    cache.after_prefill("a", p, 30)
    cache.add_request("b")
    assert cache.match_prefix("b", p[:20] + [99] * 10) == 16
    assert cache.pool.ref_counts[cache.reqs["b"].table.blocks[0]] == 3  # a, b and the cache


def test_prefix_cache_eviction_under_pressure():
    model = ToyHybrid()
    # 12 blocks of 8 tokens: at most ~2 prompts' worth, so cached blocks must be evicted to admit new requests
    cache = PagedCache(model.attn, model.kda, num_blocks=12, block_size=8, max_requests=2,
                       prefix_cache=PrefixCacheConfig("interval", 16, max_checkpoint_bytes=3 * 160))
    rng = random.Random(1)
    prompts = [[rng.randrange(40) for _ in range(rng.randint(20, 44))] for _ in range(10)]
    prompts += [prompts[-1][:30] + [1, 2, 3]]  # shares a recent prefix: still hits after the evictions
    for i, p in enumerate(prompts):
        out = _prefill(model, cache, i, p)
        assert torch.allclose(out, _reference(model, p), atol=1e-5)
        cache.free_request(i)
        assert cache.prefix.checkpoint_bytes <= 3 * 160
    st = cache.prefix.stats
    print(f"\neviction: {st}; bytes held {cache.prefix.bytes_held}")
    assert st.block_evictions > 0 and st.checkpoint_evictions > 0
    assert cache.reqs == {} and st.hits >= 1 and st.hit_tokens >= 16
    # a running request's blocks are never evicted: hold one, then a too-large request fails cleanly
    cache.add_request("hold")
    cache.batch(["hold"], [40])
    cache.commit()
    held = list(cache.reqs["hold"].table.blocks)
    cache.add_request("big")
    with pytest.raises(OutOfBlocks):
        cache.batch(["big"], [80])
    assert cache.reqs["hold"].table.blocks == held and cache.reqs["big"].table.blocks == []
    cache.free_request("hold")
    cache.free_request("big")
    cache.prefix.clear()
    assert cache.pool.num_free == 12
