"""Multi-head Latent Attention (docs/k3-model.md, "MLA").

The K3 target uses NoPE MLA (no rotary at all; k_pe is still computed, cached and used unrotated) with a sigmoid
output gate. The DSpark drafter reuses this module with interleaved RoPE (`rope_theta`) and its own masks through
the pieces `queries`, `latent_rows`, `attend`, `output`.

Per token cache row = [c_kv normed (kv_lora) | k_pe (rope)], one "head". Attention over many rows for few queries
(decode, verify, a draft block) absorbs kv_b_proj into the queries and the output instead of expanding every row
through it: scores q_nope·(W_k c) = (q_nope W_k)·c, output Σ p W_v c = W_v Σ p c, so the heads share the latent rows
as one multi-query head; longer query runs (prefill, training) expand the rows (`_expanded`, the readable form).
"""
from __future__ import annotations

import torch
from torch import nn

from dspark.kernels.rope import Rope, rope_interleaved
from dspark.models.layers import RMSNorm, attention

# On a GPU the absorbed form pays once B rows x H heads give its attention enough parallel work (its keys are the
# latent rows themselves, read per row and head; the expanded form spreads over the B L rows' expansion). H100, bf16,
# inside a CUDA graph (bench/RESULTS.md "MLA attention over cached rows"): 1.25-38x faster from 96 (k3-mini, 16 rows)
# and 512 (K3, 8 rows); 0.19-0.97x at 6 and 24 (k3-mini, 1 and 4 rows); level (0.92-1.09x) at 64 (K3, one row).
ABSORB_MIN_HEAD_ROWS_CUDA = 64


class MLAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rms_norm_eps: float = 1e-6,
                 use_output_gate: bool = False, rope_theta: float | None = None, causal: bool = True,
                 layer_idx: int = 0):
        super().__init__()
        self.num_heads, self.kv_lora_rank, self.layer_idx = num_heads, kv_lora_rank, layer_idx
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope_theta, self.causal, self.use_output_gate = rope_theta, causal, use_output_gate
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
        qk_head = qk_nope_head_dim + qk_rope_head_dim
        self.q_lora_rank = q_lora_rank
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk_head, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=rms_norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk_head, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=rms_norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, num_heads * v_head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)

    # ---- pieces ---------------------------------------------------------------------------------------------
    def _rotate(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, h, rope] -> [B, h, T, rope]; interleaved-pair RoPE when rope_theta is set, identity (NoPE)
        otherwise."""
        if self.rope_theta is None or self.rope == 0:
            return x.transpose(1, 2)
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        return rope_interleaved(x, Rope(positions, self.rope, self.rope_theta))

    def queries(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, hidden] -> q [B, H, T, nope+rope] (rope part rotated if RoPE is on)."""
        B, T, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, self.num_heads, self.nope + self.rope)
        return torch.cat([q[..., :self.nope].transpose(1, 2), self._rotate(q[..., self.nope:], positions)], -1)

    def latent_rows(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, hidden] -> cache rows [B, T, kv_lora + rope] = [RMSNorm(c_kv) | k_pe (rotated if RoPE)]."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], -1)
        k_pe = self._rotate(k_pe[:, :, None], positions)[:, 0]
        return torch.cat([self.kv_a_layernorm(c_kv), k_pe], -1)

    def absorbs(self, B: int, T: int, L: int, cuda: bool) -> bool:
        """Whether T queries over L latent rows (B rows) take the absorbed form: where it costs fewer multiply-adds
        (T below kv_lora (nope + v) / (2 kv_lora + rope): 120 for K3's shape), and on a GPU only from
        ABSORB_MIN_HEAD_ROWS_CUDA rows x heads (below, its attention leaves the GPU idle; L does not decide it)."""
        r = self.kv_lora_rank
        fewer = T * (2 * r + self.rope) < r * (self.nope + self.v_dim)
        return fewer and (not cuda or B * self.num_heads >= ABSORB_MIN_HEAD_ROWS_CUDA)

    def attend(self, q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None = None,
               is_causal: bool = False) -> torch.Tensor:
        """q [B, H, T, nope+rope], rows [B, L, kv_lora+rope], mask [B, 1, T, L] bool (True = may attend) or
        additive (0 / -inf), or a flex BlockMask
        -> [B, T, H*v]. Absorbed where `absorbs` says so (a dense mask, not causal), else expanded."""
        dense = mask is None or isinstance(mask, torch.Tensor)
        if dense and not is_causal and self.absorbs(rows.shape[0], q.shape[2], rows.shape[1], rows.is_cuda):
            return self._absorbed(q, rows, mask)
        return self._expanded(q, rows, mask, is_causal)

    def _absorbed(self, q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """attend with kv_b_proj folded into the queries and the output: one head of H*T queries over the rows."""
        B, H, T, _ = q.shape
        L, r = rows.shape[1], self.kv_lora_rank
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, r)  # per head [W_k (nope rows) | W_v (v rows)]
        q_lat = torch.einsum("bhtn,hnr->bhtr", q[..., :self.nope], w[:, :self.nope])  # one bmm over the heads
        q_all = torch.cat([q_lat, q[..., self.nope:]], -1).reshape(B, 1, H * T, r + self.rope)
        if mask is not None:  # [B' or 1, 1, T or 1, L] -> [B', 1, H*T, L]: every head's queries see the same keys
            mask = mask.expand(mask.shape[0], H, T, L).reshape(mask.shape[0], 1, H * T, L)
        o = attention(q_all, rows[:, None], rows[:, None, :, :r], mask, scale=self.scale)  # [B, 1, H*T, r]
        o = torch.einsum("bhtr,hvr->bhtv", o.view(B, H, T, r), w[:, self.nope:])
        return o.transpose(1, 2).reshape(B, T, H * self.v_dim)

    def _expanded(self, q: torch.Tensor, rows: torch.Tensor, mask, is_causal: bool) -> torch.Tensor:
        """attend with every latent row expanded through kv_b_proj into per-head keys and values."""
        B, L, _ = rows.shape
        c_kv, k_pe = rows.split([self.kv_lora_rank, self.rope], -1)
        kv = self.kv_b_proj(c_kv).view(B, L, self.num_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)  # [B,H,L,nope], [B,H,L,v]
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, self.num_heads, -1, -1)], -1)  # k_pe shared by heads
        o = attention(q, k, v, mask, scale=self.scale, is_causal=is_causal)
        return o.transpose(1, 2).reshape(B, q.shape[2], self.num_heads * self.v_dim)

    def output(self, attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.use_output_gate:
            attn = attn * torch.sigmoid(self.g_proj(x))
        return self.o_proj(attn)

    # ---- target path ----------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]. batch None: full sequence (causal unless self.causal is False);
        with a ForwardBatch the latent rows go through batch.cache.attn_append and masks come from the batch."""
        B, T, _ = x.shape
        if batch is None:
            q, rows = self.queries(x), self.latent_rows(x)
            return self.output(self.attend(q, rows, is_causal=self.causal), x)
        positions = batch.positions(T).to(x.device)
        q, rows = self.queries(x, positions), self.latent_rows(x, positions)
        if batch.cache is not None:
            rows = batch.cache.attn_append(self.layer_idx, rows).to(x.dtype)  # [B, L, C]
        mask = batch.key_mask(T, rows.shape[1], q.dtype).to(x.device)
        return self.output(self.attend(q, rows, mask), x)
