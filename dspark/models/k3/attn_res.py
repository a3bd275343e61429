"""Block Attention Residuals (docs/k3-model.md, "Attention Residuals").

The residual stream is replaced by a per-token softmax over depth: sources are the sealed blocks
(blocks[0] = embedding, blocks[k] = sum of the sublayer outputs of layers (k-1)B .. kB-1) plus the live `prefix`
(partial sum of the current block). Each read site has an RMSNorm gain and a pseudo-query (`*_res_proj.weight`
[1, d], zero-initialised, so training starts from a uniform average):
    l_j = < RMSNorm(v_j; w_norm), q >  (no 1/sqrt(d)),   alpha = softmax_j(l) in fp32,   mix = sum_j alpha_j v_j (raw v)
"""
from __future__ import annotations

import math

import torch
from torch import nn

from dspark.kernels import use_triton
from dspark.kernels.attn_res import attn_res_mix, attn_res_mix_ref
from dspark.models.layers import RMSNorm


def attn_res(sources: list[torch.Tensor], res_norm: RMSNorm, res_proj: nn.Linear) -> torch.Tensor:
    """sources: n+1 tensors [B, T, d] (completed blocks then the live prefix) -> mix [B, T, d] in the sources' dtype.
    Inference on CUDA: one kernel per read site; else its torch reference (dspark/kernels/attn_res.py), also under
    torch.compile, which fuses the reference with the ops around it where the kernel would be a graph break."""
    if len(sources) == 1:
        return sources[0]
    B, T, d = sources[-1].shape
    if not torch.is_grad_enabled() and not torch.compiler.is_compiling() and use_triton(sources[-1]):
        blocks = torch.stack(sources[:-1], 2).view(B * T, len(sources) - 1, d)
        return attn_res_mix(blocks, res_norm.weight, res_proj.weight, res_norm.eps,
                            prefix=sources[-1].reshape(B * T, d)).view(B, T, d)
    v = torch.stack(sources, 2).view(B * T, len(sources), d)
    return attn_res_mix_ref(v, res_norm.weight, res_proj.weight, res_norm.eps).view(B, T, d)


def attn_res_naive(sources: list[torch.Tensor], res_norm: RMSNorm, res_proj: nn.Linear) -> torch.Tensor:
    """Token-by-token definition, for tests: same result as attn_res."""
    B, T, d = sources[0].shape
    out = torch.empty(B, T, d)
    q = res_proj.weight.float()[0]
    for b in range(B):
        for t in range(T):
            vs = [s[b, t].float() for s in sources]
            ls = torch.stack([(res_norm(v[None])[0].float() * q).sum() for v in vs])
            a = torch.softmax(ls, 0)
            out[b, t] = sum(a_j * v for a_j, v in zip(a, vs))
    return out


class AttnResStream:
    """Bookkeeping of one forward: `blocks` (sealed snapshots, list of [B,T,d]) and `prefix` [B,T,d].

    Per layer i (0-based), B = block_size, write = (i % B == 0), nprev = ceil(i / B):
      pre_attention(i, mlp_out_{i-1}):  prefix += delta; if write: blocks.append(prefix);
                                        sources = blocks[:nprev] + [prefix]
      post_attention(i, attn_out):      prefix = attn_out if write else prefix + attn_out;
                                        sources = blocks[:nprev + write] + [prefix]
      finish(mlp_out_{L-1}):            prefix += delta; sources = blocks[:nB] + [prefix]
    """

    def __init__(self, embedding: torch.Tensor, block_size: int, num_layers: int):
        self.block_size, self.num_layers = block_size, num_layers
        self.blocks: list[torch.Tensor] = []
        self.prefix = embedding

    def _nprev(self, i: int) -> int:
        return math.ceil(i / self.block_size)

    def pre_attention(self, i: int, delta: torch.Tensor | None) -> list[torch.Tensor]:
        if delta is not None:
            self.prefix = self.prefix + delta
        if i % self.block_size == 0:
            self.blocks.append(self.prefix)  # seal: blocks[i // B]
        return self.blocks[: self._nprev(i)] + [self.prefix]

    def post_attention(self, i: int, attn_out: torch.Tensor) -> list[torch.Tensor]:
        write = i % self.block_size == 0
        self.prefix = attn_out if write else self.prefix + attn_out
        return self.blocks[: self._nprev(i) + int(write)] + [self.prefix]

    def aux_after_layer(self, mlp_out: torch.Tensor) -> torch.Tensor:
        """vLLM's default aux hidden state after layer i: prefix + mlp_out_i (the partial current-block sum)."""
        return self.prefix + mlp_out

    def finish(self, delta: torch.Tensor) -> list[torch.Tensor]:
        self.prefix = self.prefix + delta
        nB = math.ceil(self.num_layers / self.block_size)
        return self.blocks[:nB] + [self.prefix]
