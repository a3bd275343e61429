"""What a device step is made of: its keys (the graph each one captures), the host values of its rows, its static
device buffers with their host staging, and the column layout of its int buffer (which chain_inputs completes on the
device). dspark/runner.py runs the steps."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dspark.kernels.chain_inputs import chain_inputs as chain_inputs_op
from dspark.kernels.publish import publish

# int columns, then the table. room: tokens the request may still emit; src: the row of the step before this one that
# this row continues (-1: its pending token and length are the host's): chain_inputs
INT_COLS = {"pending": 0, "num_cached": 1, "num_new": 2, "slot": 3, "seed": 4, "top_k": 5, "room": 6, "src": 7}
NI = len(INT_COLS)
CHAIN_COLS = {c: INT_COLS[c] for c in ("pending", "num_cached", "num_new", "room", "src")}  # what chain_inputs reads


def buckets(max_batch_size: int) -> list[int]:
    out = [1]
    while out[-1] < max_batch_size:
        out.append(min(out[-1] * 2, max_batch_size))
    return out


def pow2_at_least(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


class StepKey(NamedTuple):  # a tuple: hashed in C on every step's lookups
    rows: int  # batch bucket
    k: int  # drafts per row (0: plain decoding)
    width: int  # block-table width: the step sees width * block_size positions
    mode: str  # one of MODES
    context: bool = True  # k = 0: whether the step stashes the drafter's context rows (False: the AR step)


class PrefillKey(NamedTuple):
    T: int  # new tokens per row (the chunk, right-padded)
    width: int  # block-table width: the forward sees width * block_size positions
    context: bool = True  # a prefill's: whether it writes the drafter's context rows (False: the target's alone)


PREFILL_COLS = 3  # prefill int columns: num_cached, num_new, slot; then the block table


class PrefillBuffers:
    """The static buffers, graph (if any) and output (each row's last logits [rows, V]) of a prefill forward."""

    def __init__(self, rows: int, key: PrefillKey, device):
        self.key = key
        self.ids = torch.zeros(rows, key.T, dtype=torch.long, device=device)
        self.ints = torch.zeros(rows, PREFILL_COLS + key.width, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None


@dataclass
class RowInput:
    """One live row of a decode step (host values; with src >= 0, pending, num_cached and num_drafts are completed on
    the device from the step in flight: chain_inputs)."""
    pending: int  # the last emitted token (position num_cached)
    num_drafts: int  # drafts to verify, <= k
    seed: int
    temperature: float
    top_k: int
    top_p: float
    room: int = 1 << 30  # tokens the request may still emit
    src: int = -1  # this row's row in the step in flight, or -1


WAIT_LIMIT_S = 120.0  # a decode step not posted after this long: the device or the mailbox's count is out of order
SPIN_LOOKS = 512  # looks at a mailbox's count before each further look yields the GIL


class Mailbox:
    """Where a captured step posts its output for the host (dspark/kernels/publish.py): a two-turn ring of its rows,
    each turn stamped with its post's number, and the count of posts. `direct=False`: ring, stamps and count on the
    device, and their pinned copies, which the graph makes after the post (ring and stamps, then the count).
    `direct=True`: the publish kernel writes the pinned ring, stamps and count itself (no copy in the graph). `posted`
    mirrors the device's count, so the host knows the turn each replay writes and the count that says it is there: no
    event to record, no copy to queue, and no CUDA call to read a finished step. A turn whose stamp is not its post's
    number raises (never stale rows)."""

    def __init__(self, rows: int, cols: int, device, direct: bool = False):
        n = 2 * rows * cols
        self.direct = direct
        self.count = torch.zeros(1, dtype=torch.long, device=device)
        pin = torch.device(device).type == "cuda"
        self.box_host = torch.zeros(n + 2, dtype=torch.long, pin_memory=pin)  # [ring | stamps]: one copy for both
        self.ring_host = self.box_host[:n].view(2, rows, cols)
        self.count_host = torch.zeros(1, dtype=torch.long, pin_memory=pin)
        self.stamps_np, self.count_np = self.box_host[n:].numpy(), self.count_host.numpy()
        self.box = self.box_host if direct else torch.zeros(n + 2, dtype=torch.long, device=device)
        self.ring, self.stamps = self.box[:n].view(2, rows, cols), self.box[n:]
        self.posted = 0

    def post(self, out: torch.Tensor, carry: torch.Tensor) -> None:
        """Device ops (the end of the captured step): out [rows, cols] into carry and the ring, then the copies
        (none when direct)."""
        publish(out, carry, self.ring, self.stamps, self.count, self.count_host if self.direct else None)
        if not self.direct:
            self.box_host.copy_(self.box, non_blocking=True)
            self.count_host.copy_(self.count, non_blocking=True)

    def sync(self) -> None:
        """The host's count from the device's, after posts the host did not count (a capture's runs)."""
        self.posted = int(self.count.item())

    def replayed(self) -> tuple[torch.Tensor, int]:
        """Once per replay: the turn of the host's ring it fills [rows, cols] and the count that says it is there."""
        turn = self.ring_host[self.posted % 2]
        self.posted += 1
        return turn, self.posted

    def wait(self, want: int) -> None:
        """Until the count reaches want (a step read late finds it there at once), then check that want's turn holds
        post want. The first SPIN_LOOKS looks spin (tens of microseconds: a step's end is seen at once, where a
        system call per look would add its own cost), the later ones yield the GIL between looks."""
        count = self.count_np
        looks, deadline = 0, None
        while count[0] < want:
            looks += 1
            if looks > SPIN_LOOKS:
                time.sleep(0)
                if deadline is None:
                    deadline = time.monotonic() + WAIT_LIMIT_S
                elif time.monotonic() > deadline:
                    raise RuntimeError(f"decode step: post {want} not seen after {WAIT_LIMIT_S:.0f} s (the device's "
                                       f"count reads {int(count[0])})")
        stamp = int(self.stamps_np[(want - 1) % 2])
        if stamp != want:
            raise RuntimeError(f"decode step: its output's turn holds post {stamp}, not {want} (the host's count of "
                               "replays is out of step with the device's)")


@dataclass
class Launched:
    """A decode step queued on the device: its output's copy for the host (pinned on CUDA), what says the copy is
    done (an eager step's event, or a captured step's mailbox count), and the timing events around a replay."""
    host: torch.Tensor  # [live, k + 3]
    done: torch.cuda.Event | None
    live: int
    ms: float | None  # the graph's replay time measured at capture (None: it ran eagerly)
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # (before, after) the replay on the stream
    device_ms: float | None = None  # set by the read: the replay's time on the device in this step
    mailbox: Mailbox | None = None  # a captured step's: its output is there once its count reaches `want`
    want: int = 0


def chain_inputs(ints: torch.Tensor, prev: torch.Tensor) -> None:
    """Complete a step's inputs on the device from the step before it (the step's first op, so a step can be queued
    while that one is in flight): every row with a src (ints[:, src] >= 0) continues that row of prev [rows', C] =
    [a, n, t_0 .. t_k', ...]: its pending token is t_a, its length grows by a + 1, its room shrinks by a + 1 and its
    drafts are capped by that room (dspark/kernels/chain_inputs.py). ints [rows, NI + W] in place."""
    chain_inputs_op(ints, prev, **CHAIN_COLS)


class StepBuffers:
    """The static buffers, the CUDA graph (if any) and the output of one StepKey."""

    def __init__(self, key: StepKey, device, mailbox: str | None = None):
        self.key = key
        # a captured step's (CUDA): "copy" or "direct" (Mailbox)
        self.mailbox = Mailbox(key.rows, key.k + 3, device, direct=mailbox == "direct") if mailbox else None
        self.ints = torch.zeros(key.rows, NI + key.width, dtype=torch.long, device=device)
        self.floats = torch.zeros(key.rows, 2, dtype=torch.float32, device=device)  # temperature, top_p
        # host staging (pinned on CUDA), filled in place each step through numpy views; its padding rows are set
        # once. Refilled only after the event `staged` says the last copy out of it ran.
        pin = device.type == "cuda"
        self.ints_host = torch.zeros(self.ints.shape, dtype=torch.long, pin_memory=pin)
        self.floats_host = torch.zeros(self.floats.shape, dtype=torch.float32, pin_memory=pin)
        self.ints_np, self.floats_np = self.ints_host.numpy(), self.floats_host.numpy()
        self.live = 0  # rows filled by the last step: rows past it hold padding
        self.tables: list[list[int]] | None = None  # the rows' blocks as last staged
        self.chained = False  # every row as last staged continues the same row of the step before
        self.hosts: list[torch.Tensor | None] = [None, None]  # the output's pinned copies for the host, per turn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.ms: float | None = None  # replay time, measured at capture
        self.staged: torch.cuda.Event | None = None  # recorded after the last copy out of the host staging buffers
