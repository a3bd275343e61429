"""KDA state slots: per request, per KDA layer, the recurrent state S [H, K, V] (fp32) and the conv window
[W−1, C] of the last raw conv inputs.

Verification uses the per-position snapshot scheme of vLLM's default KDA path (docs/k3-model.md, "KDA state under
verification"): a record=True forward over t0, d1..dk hands over the state after every position and the extended
conv window; `commit(n_keep)` keeps the snapshot after t0, d1..d_a (n_keep = a + 1) and drops the rest, so rejected
drafts leave no trace.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.kernels.kda_commit import committed_kda_state

LayerShape = tuple[int, int, int, int, int]  # (H, K, V, conv_channels, W)


class KDAStatePool:
    def __init__(self, max_requests: int, layers: dict[int, LayerShape], device="cpu",
                 conv_dtype: torch.dtype = torch.float32):
        self.max_requests, self.layers = max_requests, dict(layers)
        self.scratch_slot = max_requests  # one row more than the slots: where the padding rows of a step write
        self.S: dict[int, torch.Tensor] = {}  # layer -> [max_requests + 1, H, K, V] fp32
        self.conv: dict[int, torch.Tensor] = {}  # layer -> [max_requests + 1, W-1, C]
        for layer, (H, K, V, C, W) in self.layers.items():
            self.S[layer] = torch.zeros(max_requests + 1, H, K, V, dtype=torch.float32, device=device)
            self.conv[layer] = torch.zeros(max_requests + 1, W - 1, C, dtype=conv_dtype, device=device)
        # written[layer][slot]: a state was written since allocation (else the layer reads as "start from zero")
        self.written = {layer: torch.zeros(max_requests, dtype=torch.bool) for layer in self.layers}
        self.free_slots = list(range(max_requests))[::-1]
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # --- slots ---
    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self) -> int:
        """A zeroed slot (a fresh request starts from the zero state)."""
        if not self.free_slots:
            raise RuntimeError(f"KDAStatePool: all {self.max_requests} request slots are in use")
        slot = self.free_slots.pop()
        for layer in self.layers:
            self.S[layer][slot].zero_()
            self.conv[layer][slot].zero_()
            self.written[layer][slot] = False
        return slot

    def free(self, slot: int) -> None:
        if slot in self.free_slots:
            raise ValueError(f"KDAStatePool: slot {slot} freed twice")
        self.free_slots.append(slot)

    @property
    def bytes_per_slot(self) -> int:
        return sum(self.S[ly][0].nbytes + self.conv[ly][0].nbytes for ly in self.layers)

    @property
    def bytes_held(self) -> int:
        return (self.max_requests - self.num_free) * self.bytes_per_slot

    # --- the forward's side ---
    def read(self, layer: int, slots: Sequence[int]):
        """-> (S [B, H, K, V], conv [B, W−1, C]), or (None, None) when no slot of the batch has state yet."""
        idx = torch.as_tensor(slots, dtype=torch.long)
        if not bool(self.written[layer][idx].any()):
            return None, None
        return self.S[layer][idx], self.conv[layer][idx]

    def write_final(self, layer: int, slots: Sequence[int], states: torch.Tensor, conv: torch.Tensor) -> None:
        """states [B, H, K, V], conv [B, W−1, C]: the state after each row's new tokens."""
        idx = torch.as_tensor(slots, dtype=torch.long)
        self.S[layer][idx] = states.float()
        self.conv[layer][idx] = conv.to(self.conv[layer].dtype)
        self.written[layer][idx] = True

    def write_pending(self, layer: int, slots: Sequence[int], states: torch.Tensor, conv: torch.Tensor) -> None:
        """states [B, T, H, K, V] after each position; conv [B, W−1+T, C] = old window + this forward's inputs."""
        self._pending[layer] = (torch.as_tensor(slots, dtype=torch.long), states, conv)

    def commit(self, slots: Sequence[int], n_keep: torch.Tensor, live=None) -> None:
        """slots and n_keep [B] as in write_pending: keep the snapshot after n_keep new tokens (0 keeps the old
        state). live [B] bool (optional): rows to commit; others (requests cancelled mid-forward) are skipped."""
        n_keep = torch.as_tensor(n_keep, dtype=torch.long)
        live = torch.ones(len(n_keep), dtype=torch.bool) if live is None else torch.as_tensor(live, dtype=torch.bool)
        for layer, (idx, states, conv_ext) in self._pending.items():
            if idx.tolist() != list(slots):
                raise ValueError("KDAStatePool.commit: slots differ from the pending forward's slots")
            rows = torch.arange(len(idx))[live]
            idx = idx[live]
            S, win = committed_kda_state(states[rows], conv_ext[rows], n_keep[live], self.S[layer][idx])
            self.S[layer][idx] = S
            self.conv[layer][idx] = win.to(self.conv[layer].dtype)
            self.written[layer][idx] = True
        self._pending.clear()

    # --- one request's state, for prefill -> decode handoff and prefix checkpoints ---
    def export(self, slot: int) -> dict[int, tuple[torch.Tensor, torch.Tensor, bool]]:
        """{layer: (S [H,K,V], conv [W−1,C], written)} as detached CPU copies."""
        return {ly: (self.S[ly][slot].detach().cpu().clone(), self.conv[ly][slot].detach().cpu().clone(),
                    bool(self.written[ly][slot])) for ly in self.layers}

    def import_(self, slot: int, data: dict[int, tuple[torch.Tensor, torch.Tensor, bool]]) -> None:
        if set(data) != set(self.layers):
            raise ValueError(f"KDA state import: layers {sorted(data)} != pool layers {sorted(self.layers)}")
        for ly, (S, conv, written) in data.items():
            self.S[ly][slot] = S.to(self.S[ly].device, torch.float32)
            self.conv[ly][slot] = conv.to(self.conv[ly].device, self.conv[ly].dtype)
            self.written[ly][slot] = written
