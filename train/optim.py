"""The optimizers and the learning-rate schedule of the training loop.

adamw: one AdamW over every trainable parameter (no weight decay on vectors and KDA's A_log / dt_bias).
muon: Muon over the 2D weight matrices of the hidden layers (both sides > 1; the Markov head's vocabulary factors
left out, as in Keller Jordan's Muon and speculators' DSpark trainer), AdamW over the rest. Both follow the same
warmup + cosine schedule. Muon's step is scaled to AdamW's update RMS (`match_rms_adamw`), so one lr serves both
groups unless optim.muon_lr says otherwise.

`Muon` is torch.optim.Muon's update (Nesterov momentum, 5 Newton-Schulz steps in bf16, or fp32 on a CPU without
native bf16 matmuls; decoupled weight decay) applied to each row block of a merged weight on its own: our q|k|v and
gate|up projections are one weight each (MergedLinear), and orthogonalizing the stack is not what Muon does to the
separate matrices of other trainers.
"""
from __future__ import annotations

import functools
import math

import torch

from dspark.models.layers import MergedLinear

ADAMW_ONLY = ("embed_tokens", "lm_head", "markov_w1", "markov_w2")  # 2D, yet vocabulary-sized: AdamW
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic iteration)


def cosine_lr(step: int, max_steps: int, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, max_steps - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


@functools.cache
def ns_dtype(device_type: str) -> torch.dtype:
    """The Newton-Schulz iterations' dtype: bf16, as torch's Muon, except on a CPU without native bf16 matmuls
    (oneDNN's check: AVX-512 BF16 or AMX), which emulates them about 30x slower than fp32 (an AVX2 machine: 170 against
    5.4 ms for one iteration at [256, 1024]); fp32 there."""
    if device_type != "cpu":
        return torch.bfloat16
    try:
        return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    except (AttributeError, RuntimeError):  # a torch build without the check: torch's own choice
        return torch.bfloat16


def orthogonalize(g: torch.Tensor, steps: int, eps: float = 1e-7, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[A, B] -> about U V^T of g's SVD (singular values pushed into ~[0.5, 1.5]), in `dtype` (None:
    ns_dtype of g's device)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype or ns_dtype(g.device.type))
    tall = g.size(0) > g.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalize_many(gs: list[torch.Tensor], steps: int, eps: float = 1e-7, dtype: torch.dtype | None = None,
                       out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """orthogonalize of each of several matrices whose shapes are equal up to a transpose, in one batched iteration
    (a step's ops once for all of them, not once per matrix: the optimizer step of a small model is bound by its op
    launches), cast to out_dtype (None: the iteration's). One matrix takes orthogonalize itself."""
    if len(gs) == 1:
        return [orthogonalize(gs[0], steps, eps, dtype).to(out_dtype or gs[0].dtype)]
    a, b, c = NS_COEFFICIENTS
    tall = [g.size(0) > g.size(1) for g in gs]
    x = torch.stack([g.T if t else g for g, t in zip(gs, tall)]).to(dtype or ns_dtype(gs[0].device.type))
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # [G, m, n], m <= n
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return [o.T if t else o for o, t in zip(x.to(out_dtype or x.dtype).unbind(0), tall)]


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon (adjust_lr_fn="match_rms_adamw"). A param group with `row_sizes` (summing to each of its
    parameters' rows) has every block of rows orthogonalized and scaled as a matrix of its own; in other groups each
    parameter is one matrix. The matrices of one shape (over all groups of the same hyperparameters) iterate
    together, and the momentum, decay and update run as foreach ops: a step's launches grow with the number of
    shapes, not of matrices."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 ns_steps: int = 5, ns_dtype: torch.dtype | None = None):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps,
                                      row_sizes=None))
        self.ns_dtype = ns_dtype  # None: train.optim.ns_dtype of each parameter's device

    @torch.no_grad()
    def step(self, closure=None):
        batches: dict[tuple, list] = {}  # (lr, weight_decay, momentum, ns_steps) -> [(param, row_sizes)]
        for group in self.param_groups:
            key = (group["lr"], group["weight_decay"], group["momentum"], group["ns_steps"])
            batches.setdefault(key, []).extend((p, group["row_sizes"]) for p in group["params"] if p.grad is not None)
        for (lr, wd, mom, ns_steps), items in batches.items():
            params = [p for p, _ in items]
            grads = [p.grad for p in params]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            torch._foreach_lerp_(bufs, grads, 1 - mom)
            updates = torch._foreach_lerp(grads, bufs, mom)  # Nesterov
            torch._foreach_mul_(params, 1 - lr * wd)
            shapes: dict[tuple, list] = {}  # (short side, long side, dtype) -> [(rows of p, update rows)]
            for (p, sizes), u in zip(items, updates):
                for rows, ub in zip(p.split(sizes or [p.shape[0]]), u.split(sizes or [p.shape[0]])):
                    shapes.setdefault((min(ub.shape), max(ub.shape), ub.dtype), []).append((rows, ub))
            for (_, wide, dtype), blocks in shapes.items():  # rows: views of p, updated in place
                ortho = orthogonalize_many([ub for _, ub in blocks], ns_steps, dtype=self.ns_dtype, out_dtype=dtype)
                torch._foreach_add_([r for r, _ in blocks], ortho, alpha=-lr * 0.2 * math.sqrt(wide))


def no_decay(name: str, p: torch.Tensor) -> bool:
    return p.dim() < 2 or name.endswith(("A_log", "dt_bias"))


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    return p.dim() == 2 and min(p.shape) > 1 and not any(h in name for h in ADAMW_ONLY)


def build_optimizers(model: torch.nn.Module, oc, max_steps: int):
    """-> ([optimizer, ...], [LambdaLR, ...]): AdamW first (its lr is the one logged), then Muon when oc.optimizer
    is "muon"."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [p for n, p in named if oc.optimizer == "muon" and is_muon_matrix(n, p)]
    ids = {id(p) for p in muon}
    rest = [(n, p) for n, p in named if id(p) not in ids]
    decayed = lambda n, p: oc.decay_vectors or not no_decay(n, p)  # noqa: E731
    groups = [{"params": [p for n, p in rest if decayed(n, p)], "weight_decay": oc.weight_decay},
              {"params": [p for n, p in rest if not decayed(n, p)], "weight_decay": 0.0}]
    # fused: one kernel per step and dtype, where the default (foreach on CUDA, a loop on the CPU) launches ~10 per
    # group or per parameter
    opts = [torch.optim.AdamW([g for g in groups if g["params"]], lr=oc.lr, betas=tuple(oc.betas), fused=True)]
    if muon:  # a group per merged weight (its blocks), one for the other matrices
        merged = [m for m in model.modules() if isinstance(m, MergedLinear) and id(m.weight) in ids]
        blocked = [{"params": [m.weight], "row_sizes": m.row_sizes} for m in merged]
        whole = [p for p in muon if all(p is not m.weight for m in merged)]
        opts.append(Muon(blocked + ([{"params": whole}] if whole else []), lr=oc.muon_lr or oc.lr,
                         weight_decay=oc.weight_decay, momentum=oc.muon_momentum, ns_steps=oc.muon_ns_steps))
    schedule = lambda s: cosine_lr(s, max_steps, oc.warmup_steps, oc.min_lr_ratio)  # noqa: E731
    return opts, [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in opts]
