"""Where training blocks start (anchors): uniform random loss positions, or drawn toward decode starts.

A greedy decode does not start its blocks at random positions: the first one at the end of the prompt, each next one
at a + accepted(a) + 1, right after the draft the target rejected, where the text is harder for the drafter than at a
random position (bench/tau_gap.py: τ at the anchors a decode visits is below τ at uniform anchors).

`anchors: rejection` (DecodeStarts) keeps, per train row, the positions where the blocks of that row ended the last
time the row was trained: each block's a + accepted + 1 under the drafter of that step, read from the training pass
itself (no extra forward). The next time the row is drawn, `rejection_share` of its anchors are drawn among those
positions and the rest uniformly. An anchor drawn at such a start yields the next start of the same walk, so over
passes the anchors follow a decode's walks (with uniform restarts) under a drafter one pass old; the first pass is
uniform. The positions live on the training device and are updated there (no host sync), identically on every
data-parallel process (the accepted lengths are gathered), and are saved with the checkpoints.
"""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto `device` without making the host wait for the device (pinned copy on CUDA)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def valid_anchors(loss_mask: torch.Tensor, drafts: int) -> torch.Tensor:
    """loss_mask: [B, T] (True where a token is a training label) -> [B, T] bool: anchors a in [1, T-1-drafts] whose
    first label a+1 is in the mask. ValueError when a row has none."""
    T = loss_mask.shape[1]
    pos = torch.arange(T, device=loss_mask.device)
    ok = loss_mask.roll(-1, dims=1) & (pos >= 1) & (pos <= T - 1 - drafts)
    if not bool(ok.any(1).all()):
        raise ValueError("data: a sequence has no position to anchor a block (too short or no loss tokens)")
    return ok


def _top(scores: torch.Tensor, ok: torch.Tensor, num: int) -> torch.Tensor:
    """The `num` highest-scoring positions per row; an invalid pick (a row with fewer valid anchors) repeats the
    row's first pick."""
    idx = scores.topk(min(num, scores.shape[1]), dim=1).indices
    valid = ok.gather(1, idx)
    first = idx[:, :1].expand_as(idx)
    return torch.where(valid, idx, first)[:, :num]


def sample_anchors(loss_mask: torch.Tensor, num: int, drafts: int, generator: torch.Generator) -> torch.Tensor:
    """`num` uniform anchors per row of loss_mask [B, T] (valid_anchors), without replacement (rows with fewer valid
    anchors repeat some). -> [B, num]"""
    ok = valid_anchors(loss_mask, drafts)
    scores = torch.rand(ok.shape, generator=generator) + ok.float() * 2  # valid first, random among them
    return _top(scores, ok, num)


def every_anchor(loss_mask: torch.Tensor, drafts: int) -> torch.Tensor:
    """Every valid anchor of each row of loss_mask [B, T], in position order -> [B, A] (A: the most any row has; a
    row with fewer repeats its first)."""
    ok = valid_anchors(loss_mask, drafts)
    T = ok.shape[1]
    return _top(ok.float() * 2 * T - torch.arange(T, dtype=torch.float), ok, int(ok.sum(1).max()))


def decode_walk(accepted: dict[int, int], start: int) -> list[tuple[int, int]]:
    """(anchor, accepted drafts) of the blocks a greedy decode visits from `start`: a, then a + accepted(a) + 1, while
    a is a key of `accepted` (anchor -> its block's accepted drafts)."""
    out, a = [], start
    while a in accepted:
        out.append((a, accepted[a]))
        a += accepted[a] + 1
    return out


def walked_accepted(anchors: torch.Tensor, accepted: torch.Tensor) -> list[int]:
    """The accepted drafts of the blocks a greedy decode visits, every row's walk in turn. anchors: [B, A] from
    every_anchor; accepted: [B, A] each block's accepted drafts. A walk starts one past the row's first anchor (the
    prompt's last token: the prefill emits the next one)."""
    return [n for row, acc in zip(anchors.tolist(), accepted.tolist())
            for _, n in decode_walk(dict(zip(row, acc)), row[0] + 1)]


def accepted_in_chunks(prepare, accepted_of, rows: torch.Tensor, anchors: torch.Tensor, rows_per_call: int,
                       anchors_per_call: int) -> torch.Tensor:
    """Each block's accepted drafts over anchors [B, A] of rows [B, T] -> [B, A] on the host: prepare(rows [b, T])
    once per rows_per_call rows (the target's forward), then accepted_of(prepared, anchors [b, a]) -> [b, a] for at
    most anchors_per_call anchors a call (every anchor of a holdout row at once would hold the drafter's activations
    and logits for all of them: a training step's many times over)."""
    R, W = rows_per_call, anchors_per_call
    out = []
    for i in range(0, len(rows), R):
        ready, a = prepare(rows[i:i + R]), anchors[i:i + R]
        out.append(torch.cat([accepted_of(ready, a[:, j:j + W]).cpu() for j in range(0, a.shape[1], W)], 1))
    return torch.cat(out)


class DecodeStarts:
    """anchors=rejection (module doc): per train row, the positions where its blocks ended when it was last trained."""

    def __init__(self, num_rows: int, seq_len: int, share: float, device: torch.device):
        self.share = share
        self.starts = torch.zeros(num_rows, seq_len, dtype=torch.bool, device=device)  # [N, T]

    def sample(self, idx: torch.Tensor, loss_mask: torch.Tensor, num: int, drafts: int,
               generator: torch.Generator) -> torch.Tensor:
        """idx: [B] train rows (host); loss_mask: [B, T] their masks (host). -> [B, num] anchors on the device:
        round(share * num) of them among the row's recorded starts (fewer when it has fewer), the rest uniform."""
        ok = valid_anchors(loss_mask, drafts)
        r_uniform, r_start = torch.rand(ok.shape, generator=generator), torch.rand(ok.shape, generator=generator)
        dev = self.starts.device
        ok, r_uniform, r_start, idx = (to_device(t, dev) for t in (ok, r_uniform, r_start, idx))
        starts = self.starts[idx] & ok  # [B, T]
        k = min(round(self.share * num), ok.shape[1])
        top = torch.where(starts, r_start, -1.0).topk(k, dim=1)  # k random recorded starts (score -1: none left)
        picked = torch.zeros_like(ok).scatter_(1, top.indices, top.values >= 0)
        return _top(r_uniform + 2 * ok.float() + 2 * picked.float(), ok, num)

    def update(self, idx: torch.Tensor, anchors: torch.Tensor, accepted: torch.Tensor) -> None:
        """idx: [B] rows just trained; anchors, accepted: [B, A] their blocks and accepted drafts (the global batch):
        the rows' starts become each block's a + accepted + 1 (the last position stands for 'past the end': it is
        never a valid anchor)."""
        idx = to_device(idx, self.starts.device)
        ends = (anchors + accepted + 1).clamp(max=self.starts.shape[1] - 1)
        self.starts[idx] = False
        self.starts[idx[:, None].expand_as(ends), ends] = True

    def state_dict(self) -> dict:
        return {"starts": self.starts}

    def load_state_dict(self, state: dict) -> None:
        self.starts.copy_(state["starts"])
