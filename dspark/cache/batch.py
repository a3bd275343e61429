"""The joint between the models and the cache: what one forward pass over a batch of requests sees.

Every target model takes `forward(input_ids, batch=None, aux_layer_ids=None, aux_parts=False)` (aux_parts: the aux
hidden states as a list per layer instead of their concatenation):
- `batch=None`: a plain full-sequence causal forward (training, teacher forcing, tests).
- `batch=ForwardBatch(...)`: row b holds `num_new[b]` new tokens (right-padded to T) that follow
  `num_cached[b]` tokens already in `batch.cache`. Prefill, single-token decode and the k+1-token verify
  forward are all this one call with different `num_new`.

`batch.cache` is a per-batch view that implements `CacheView` below. The layers call it by global layer
index; they never know whether the storage behind it is contiguous (`DenseCache`) or paged
(`dspark.cache.blocks`). After every forward the caller commits: `commit(n_keep)` per row. A forward with
`record=True` (verify) keeps the KDA state after every new position, so n_keep = accepted drafts + 1 rolls the
recurrent state back exactly; attention rows past the kept length are simply overwritten later. A forward
with `record=False` (prefill, decode) must keep all `num_new` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dspark.kernels.kda_commit import committed_kda_state
from dspark.kernels.paged_attention import Pages
from dspark.kernels.view_indices import additive_key_mask, key_visible


class CacheView(Protocol):
    def attn_append(self, layer: int, new: torch.Tensor) -> torch.Tensor:
        """new: [B, T, C] per-token cache rows (GQA: [k|v] flattened; MLA: [c_kv|k_pe]).
        Writes the first num_new[b] rows of each request after its num_cached[b] cached rows and returns
        every row 0..num_cached+num_new-1 per request, right-padded: [B, L, C], L = max(num_cached+num_new)."""

    def attn_pages(self, layer: int) -> Pages | None:
        """The layer's rows in place (dspark.kernels.paged_attention.Pages), or None. Where given, a layer writes this
        forward's rows itself (Pages.sink: the write fused into the kernel that makes them) and reads every row in
        place instead of calling attn_append."""

    def kda_read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (S [B, H, K, V] fp32 recurrent state, conv window [B, W-1, C] of the last raw conv inputs)."""

    def kda_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(state pool [N, H, K, V] fp32, conv window pool [N, W-1, C], the rows' slots [B]) to read and write in
        place (dspark.kernels.kda_decode.kda_decode_slots), or None (then kda_read / kda_write)."""

    def kda_write(self, layer: int, states: torch.Tensor, conv: torch.Tensor) -> None:
        """record=False: final states [B, H, K, V] and final window conv [B, W-1, C] (per row, after its
        num_new valid tokens). record=True: states [B, T, H, K, V] after each position and
        conv [B, W-1+T, C] = old window followed by this forward's raw conv inputs."""


@dataclass
class ForwardBatch:
    num_cached: torch.Tensor  # [B] long (CPU bookkeeping): tokens already in the cache per request
    num_new: torch.Tensor  # [B] long (CPU): valid new tokens per request (rest of the row is padding)
    cache: CacheView | None = None
    record: bool = False  # keep per-position recurrent states for a later commit (verify)
    device: torch.device | str = "cpu"  # where the model runs: positions / valid / key_mask are built there

    def positions(self, T: int) -> torch.Tensor:  # [B, T] on self.device
        start = self.num_cached.to(self.device)
        return start[:, None] + torch.arange(T, device=self.device)[None]

    def valid(self, T: int) -> torch.Tensor:  # [B, T] bool on self.device
        return torch.arange(T, device=self.device)[None] < self.num_new.to(self.device)[:, None]

    def key_mask(self, T: int, L: int, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """[B, 1, T, L]: query j of row b (position num_cached+j) may see key i iff i <= its position; bool, or
        additive (0 / -inf) in a float dtype."""
        pos = self.positions(T)  # [B, T]
        return key_visible(pos, L) if dtype == torch.bool else additive_key_mask(pos, L, dtype)


class DenseCache:
    """Contiguous per-request cache for a fixed set of B sequences (tests, simple generation).
    Attention rows: {layer: [B, max_len, C]}; KDA: {layer: (S [B,H,K,V], conv window [B,W-1,C])}.
    Usage: `b = cache.batch(num_new, record)`, `model(ids, batch=b)`, `cache.commit(n_keep)`."""

    def __init__(self, batch_size: int, max_len: int):
        self.B, self.max_len = batch_size, max_len
        self.lengths = torch.zeros(batch_size, dtype=torch.long)
        self.attn: dict[int, torch.Tensor] = {}
        self.kda: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._batch: ForwardBatch | None = None

    # --- the caller's side ---
    def batch(self, num_new, record: bool = False, device="cpu") -> ForwardBatch:
        num_new = torch.as_tensor(num_new, dtype=torch.long)
        need = int((self.lengths + num_new).max())
        if need > self.max_len:
            raise ValueError(f"DenseCache: {need} tokens exceed max_len={self.max_len}")
        self._batch = ForwardBatch(self.lengths.clone(), num_new, self, record, device)
        return self._batch

    def commit(self, n_keep=None) -> None:
        """After a forward: keep n_keep[b] of its new tokens (default all). Only a record=True forward may
        keep fewer than num_new (its per-position KDA states make the rollback exact)."""
        b = self._batch
        n_keep = b.num_new if n_keep is None else torch.as_tensor(n_keep, dtype=torch.long)
        if bool((n_keep > b.num_new).any() or (n_keep < 0).any()):
            raise ValueError("commit: n_keep must lie in 0..num_new for every row")
        if self.kda and not b.record and not torch.equal(n_keep, b.num_new):
            raise ValueError("commit: a forward with record=False cannot roll back recurrent state")
        for layer, (states, conv_ext) in self._pending.items():
            self.kda[layer] = committed_kda_state(states, conv_ext, n_keep, self.kda.get(layer, (None, None))[0])
        self._pending.clear()
        self.lengths = self.lengths + n_keep

    # --- the model's side (CacheView) ---
    def attn_append(self, layer: int, new: torch.Tensor) -> torch.Tensor:
        b = self._batch
        B, T, C = new.shape
        if layer not in self.attn:
            self.attn[layer] = new.new_zeros(self.B, self.max_len, C)
        store = self.attn[layer]
        valid = b.valid(T)
        rows = torch.arange(B, device=valid.device)[:, None].expand(B, T)
        store[rows[valid], b.positions(T)[valid]] = new[valid].to(store.dtype)
        return store[:, : int((b.num_cached + b.num_new).max())]

    def attn_pages(self, layer: int) -> None:
        return None  # rows go through attn_append

    def kda_read(self, layer: int):
        """(None, None) before the first write: the layer starts from a zero state and a zero window."""
        return self.kda.get(layer, (None, None))

    def kda_pools(self, layer: int) -> None:
        return None  # per-request tensors, no pools: kda_read / kda_write

    def kda_write(self, layer: int, states: torch.Tensor, conv: torch.Tensor) -> None:
        """record=False: states [B,H,K,V] and conv [B,W-1,C] are final. record=True: states [B,T,H,K,V] after
        each position and conv [B,W-1+T,C] (old window + new raw inputs), kept until commit(n_keep)."""
        if self._batch.record:
            self._pending[layer] = (states, conv)
        else:
            self.kda[layer] = (states, conv)
