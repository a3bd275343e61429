"""DeviceView: the CacheView of a decode / verify step over the paged pool, built from device tensors only.

A step of B rows (a batch-size bucket: rows past the live ones are padding) and T new tokens per row reads
    num_cached [B]  tokens already in the cache (the first new token's position)
    num_new    [B]  valid new tokens (the rest of the row is padding: no recurrent-state change)
    table      [B, W] block ids (W = L / block_size; entries past a row's blocks and padding rows -> the scratch block)
    slots      [B]  KDA state slots (padding rows -> the scratch slot)
and sees the first L positions of every row (L: a static context bucket >= max(num_cached) + T). Rows are written
in place at the block-table slots: by the layer's own kernel where it takes them (attn_pages' sink: the Qwen3
layers' norm-RoPE launch), else index_copy_. They are read in place by paged attention (attn_pages:
dspark/kernels/paged_attention.py), else with one fixed-size gather [B, L, C] per layer under the key mask (the
indices of both, and the mask: dspark/kernels/view_indices.py); KDA state is read and written through the slot
indices. No host reads and no data-dependent shapes, so one CUDA graph captures a whole step; on CPU the same code
runs eagerly.
"""
from __future__ import annotations

import torch

from dspark.kernels.kda_commit import kda_commit
from dspark.kernels.paged_attention import Pages
from dspark.kernels.view_indices import additive_key_mask, key_visible, view_indices


class DeviceView:
    def __init__(self, kv: dict[int, torch.Tensor], kda_S: dict[int, torch.Tensor], kda_conv: dict[int, torch.Tensor],
                 block_size: int, num_cached: torch.Tensor, num_new: torch.Tensor, table: torch.Tensor,
                 slots: torch.Tensor, T: int, record: bool):
        self.kv, self.S, self.conv = kv, kda_S, kda_conv
        self.bs, self.record = block_size, record
        self.num_cached, self.num_new, self.table, self.slots = num_cached, num_new, table, slots
        self.device = table.device
        # positions [B, T], valid new tokens [B, T], the new tokens' flat pool rows [B*T], those of positions
        # 0..L-1 [B, L] and the keys each new token sees [B, T] (= pos + 1): one kernel on CUDA
        # (dspark/kernels/view_indices.py)
        self._pos, self._valid, self._dest, self._gather, self._lim = view_indices(num_cached, num_new, table,
                                                                                   block_size, T)
        self._mask: torch.Tensor | None = None  # [B, 1, T, L] bool, built when asked
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._additive: dict[torch.dtype, torch.Tensor] = {}  # key masks in additive form, one per dtype per step

    def mark_width_dynamic(self) -> None:
        """For a torch.compile'd forward: the context width (the table's W blocks, the gather's L positions) is a
        dynamic dimension from the first compile. Dynamo compiles the frame that resumes after a graph break with
        these sizes static first, and would recompile it at the second context bucket."""
        for t in (self.table, self._gather):
            torch._dynamo.maybe_mark_dynamic(t, 1)

    @property
    def cache(self) -> DeviceView:
        """A ForwardBatch whose cache is itself (a property, not an attribute: no reference cycle, so a step's view
        and the KDA states it holds are freed as soon as the step ends, without waiting for the garbage collector)."""
        return self

    @property
    def T(self) -> int:
        return self._pos.shape[1]

    @property
    def L(self) -> int:
        return self.table.shape[1] * self.bs

    # --- the ForwardBatch side ---
    def positions(self, T: int) -> torch.Tensor:
        self._check(T)
        return self._pos

    def valid(self, T: int) -> torch.Tensor:
        self._check(T)
        return self._valid

    def key_mask(self, T: int, L: int, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        self._check(T)
        if L != self.L:
            raise ValueError(f"key_mask: the step sees L={self.L} positions, got {L}")
        if dtype == torch.bool:
            if self._mask is None:
                self._mask = key_visible(self._pos, L)
            return self._mask
        if dtype not in self._additive:  # built once per step, shared by the step's attention layers
            self._additive[dtype] = additive_key_mask(self._pos, L, dtype)
        return self._additive[dtype]

    def _check(self, T: int) -> None:
        if T != self.T:
            raise ValueError(f"DeviceView: planned for T={self.T} new tokens, the forward has T={T}")

    # --- the CacheView side ---
    def attn_write(self, layer: int, new: torch.Tensor) -> None:
        """new [B, T, C]: every row (valid or padding) goes to its slot; padding lands past the committed length
        (overwritten later) or in the scratch block."""
        flat = self._flat(layer)
        flat.index_copy_(0, self._dest, new.reshape(-1, new.shape[-1]).to(flat.dtype))

    def attn_pages(self, layer: int) -> Pages:
        """The layer's rows in place: the pool's rows, those of positions 0..L-1 per row, what each new token sees
        (keys up to its position) and where each new token's row goes (what attn_write writes)."""
        return Pages(self._flat(layer), self._gather, self._lim, self._dest)

    def attn_read(self, layer: int) -> torch.Tensor:
        """-> [B, T, C]: the rows at the new tokens' positions (what attn_write would overwrite)."""
        return self._flat(layer)[self._dest].view(*self._pos.shape, -1)

    def attn_rows(self, layer: int) -> torch.Tensor:
        """-> [B, L, C]: positions 0..L-1 of every row (the key mask hides what lies past a query's position)."""
        return self._flat(layer)[self._gather]

    def _flat(self, layer: int) -> torch.Tensor:
        """The layer's pool as rows [P, C] (a view)."""
        return self.kv[layer].view(-1, self.kv[layer].shape[-1])

    def attn_append(self, layer: int, new: torch.Tensor) -> torch.Tensor:
        self.attn_write(layer, new)
        return self.attn_rows(layer)

    def kda_read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.S[layer].index_select(0, self.slots), self.conv[layer].index_select(0, self.slots)

    def kda_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's state and window pools and the rows' slots, for a kernel that reads (and, without recording,
        writes) them in place."""
        return self.S[layer], self.conv[layer], self.slots

    def kda_write(self, layer: int, states: torch.Tensor, conv: torch.Tensor) -> None:
        """record=False: final S [B, H, K, V] and window [B, W-1, C]; record=True: S after each position
        [B, T, H, K, V] and the extended window [B, W-1+T, C], kept until commit."""
        if self.record:
            self._pending[layer] = (states, conv)
        else:
            self.S[layer].index_copy_(0, self.slots, states.float())
            self.conv[layer].index_copy_(0, self.slots, conv.to(self.conv[layer].dtype))

    def commit_accepted(self, accepted: torch.Tensor) -> None:
        """After a verify forward: keep the state after each row's anchor and its accepted drafts [B]. A step with
        no recurrent state to keep (a Qwen3 target) launches nothing."""
        if self._pending:
            self.commit(accepted + 1)

    def commit(self, n_keep: torch.Tensor) -> None:
        """After a record=True forward: keep the recurrent state after n_keep [B] (device) new tokens per row."""
        for layer, (states, ext) in self._pending.items():  # one launch per layer on CUDA
            kda_commit(states, ext, n_keep, self.S[layer], self.conv[layer], self.slots)
        self._pending.clear()
