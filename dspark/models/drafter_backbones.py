"""The drafter backbones behind `DSparkDrafter` (see drafter.py for the interface they implement), as mixins that
drafter.py combines with the backbone-independent part (so this module never imports drafter.py).

- `Qwen3Backbone` (backbone "qwen3", vLLM `Qwen3DSparkModel` / `DFlashDraftModel`): fc + hidden_norm, Qwen3
  decoder layers whose context rows are [k_norm(k_proj(ctx)) + NeoX RoPE | v_proj(ctx)] (the k | v rows of
  the merged qkv_proj), final `norm`.
- `K3Backbone` (backbone "k3", vLLM `K3DSparkModel`, docs/vllm-contract.md): context_proj + context_norm, MLA
  layers (interleaved RoPE on q_pe/k_pe, no output gate, non-causal) + dense gate/up/down MLP, `final_norm`.
  A context row is the MLA latent [kv_a_layernorm(kv_c) | RoPE(k_pe)] of kv_a_proj_with_mqa(ctx), i.e. the
  compressed cache vLLM stores: row_width = kv_lora_rank + qk_rope_head_dim.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark.kernels.paged_attention import Pages, attention_fits, paged_attention
from dspark.kernels.rope import qk_norm_rope_, sink_write
from dspark.models.drafter_config import DrafterConfig
from dspark.models.k3.mla import MLAttention
from dspark.models.layers import GatedMLP, RMSNorm, Rope, attention
from dspark.models.qwen3 import Qwen3Attention


# --------------------------------------------------------------------------- qwen3
class DraftAttention(Qwen3Attention):
    """Qwen3 attention (same weights/names) used the DFlash way: K/V of the context + of the block itself."""

    def kv_rows(self, h: torch.Tensor, rope: Rope, sink: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """h: [B, L, H] -> cache rows [B, L, 2*n_kv*head_dim] = [k (normed, roped) | v]: at inference the k / v GEMM's
        output itself, its k turned in place (out of place under autograd, as q_and_rows); with a sink also written
        there (in the same launch on CUDA)."""
        kv = self.qkv_proj.forward_parts(h, "k_proj", "v_proj")
        if torch.is_grad_enabled():
            rows = self.kv_rows_of(*kv.chunk(2, -1), rope)
            if sink is not None:
                sink_write(sink, rows)
            return rows
        B, L, _ = kv.shape
        qk_norm_rope_(kv.view(B, L, 2 * self.n_kv, self.head_dim), 0, None, self.k_norm.weight, self.k_norm.eps, rope,
                      n_v=self.n_kv, sink=sink)
        return kv

    def attend(self, x, rope: Rope, ctx_rows: torch.Tensor | Pages, mask: torch.Tensor) -> torch.Tensor:
        """x: [B, Q, H] queries; ctx_rows: [B, L, C], or Pages (the rows in place in the cache's pool, lim [B, 1] the
        context's length); mask: [B, 1, Q or 1, L + Q] over [context ; block], bool or additive."""
        B, Q, _ = x.shape
        q, block = self.q_and_rows(x, rope)  # one GEMM for the block's queries and its own k / v rows
        if isinstance(ctx_rows, Pages):
            if attention_fits(q, ctx_rows.pool, block):  # one kernel: context in place, then the block, no mask
                o = paged_attention(q, ctx_rows.pool, ctx_rows.rows, ctx_rows.lim, block)  # [B, Q, H, D]
                return self.o_proj(o.reshape(B, Q, -1))
            ctx_rows = ctx_rows.gathered()
        rows = torch.cat([ctx_rows.to(x.dtype), block], dim=1)
        k, v = rows.view(B, rows.shape[1], 2, self.n_kv, self.head_dim).permute(2, 0, 3, 1, 4)
        o = attention(q, k, v, mask, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, -1))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, idx: int):
        super().__init__()
        qcfg = cfg.as_qwen3()
        self.self_attn = DraftAttention(qcfg, idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope: Rope, ctx_rows, mask, pending=None):
        """x + pending: the residual stream before this layer (pending: the layer before's MLP output, or None) ->
        (the stream after this layer's attention, its MLP output to add): each residual add runs in the norm after
        it (RMSNorm.add)."""
        x, n = (x, self.input_layernorm(x)) if pending is None else self.input_layernorm.add(x, pending)
        x, n = self.post_attention_layernorm.add(x, self.self_attn.attend(n, rope, ctx_rows, mask))
        return x, self.mlp(n)


class Qwen3Backbone:
    """The qwen3 backbone's modules (vLLM names) and interface methods; mixed into a DSparkDrafter."""

    config: DrafterConfig
    reads_pages = True  # decode's ctx_rows may be Pages (its attention reads the cache's pool in place)

    def build_backbone(self, cfg: DrafterConfig) -> None:
        n_aux = len(cfg.target_layer_ids)
        self.fc = nn.Linear(cfg.target_hidden_size * n_aux, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def row_width(self) -> int:
        return 2 * self.config.num_key_value_heads * self.config.head_dim

    @property
    def project_weight(self) -> torch.Tensor:
        return self.fc.weight

    def context_of(self, projected: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(projected)

    def context_rows(self, ctx: torch.Tensor, positions: torch.Tensor, sinks: list | None = None
                     ) -> list[torch.Tensor]:
        """Per draft layer, the K/V rows of the context tokens at `positions` ([B, L] or [L]); sinks (per layer, a
        cache's (pool rows, dest) or None): also written there."""
        rope = Rope(positions, self.config.head_dim, self.config.rope_theta)
        sinks = sinks or [None] * len(self.layers)
        return [layer.self_attn.kv_rows(ctx, rope, sink) for layer, sink in zip(self.layers, sinks)]

    def decode(self, x, positions, ctx_rows: list[torch.Tensor], mask) -> torch.Tensor:
        rope = Rope(positions, self.config.head_dim, self.config.rope_theta)
        pending = None
        for layer, rows in zip(self.layers, ctx_rows):
            x, pending = layer(x, rope, rows, mask, pending)
        return self.norm.add(x, pending)[1]


# --------------------------------------------------------------------------- k3 (MLA)
class K3DraftLayer(nn.Module):
    """K3DSparkDecoderLayer: pre-norm MLA (RoPE on, no output gate) + pre-norm dense gate/up/down MLP."""

    def __init__(self, cfg: DrafterConfig, idx: int):
        super().__init__()
        self.self_attn = MLAttention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.rms_norm_eps, use_output_gate=False,
            rope_theta=cfg.rope_theta, causal=False, layer_idx=idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)  # situ: beta 1, no up clamp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, ctx_rows, mask, pending=None):
        """x [B, Q, H] (+ pending, the layer before's MLP output, or None), positions [B, Q], ctx_rows [B, L,
        kv_lora+rope], mask [B, 1, Q, L+Q] -> (the stream after the attention, the MLP output to add), as
        DraftLayer."""
        attn = self.self_attn
        x, h = (x, self.input_layernorm(x)) if pending is None else self.input_layernorm.add(x, pending)
        rows = torch.cat([ctx_rows.to(h.dtype), attn.latent_rows(h, positions)], dim=1)  # [B, L+Q, C]
        x, n = self.post_attention_layernorm.add(x, attn.output(attn.attend(attn.queries(h, positions), rows, mask), h))
        return x, self.mlp(n)


class K3Backbone:
    """The k3 (MLA) backbone's modules (vLLM names) and interface methods; mixed into a DSparkDrafter."""

    config: DrafterConfig
    reads_pages = False  # decode takes gathered rows

    def build_backbone(self, cfg: DrafterConfig) -> None:
        n_aux = len(cfg.target_layer_ids)
        self.context_proj = nn.Linear(cfg.target_hidden_size * n_aux, cfg.hidden_size, bias=False)
        self.context_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(K3DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def row_width(self) -> int:
        return self.config.kv_lora_rank + self.config.qk_rope_head_dim

    @property
    def project_weight(self) -> torch.Tensor:
        return self.context_proj.weight

    def context_of(self, projected: torch.Tensor) -> torch.Tensor:
        return self.context_norm(projected)

    def context_rows(self, ctx: torch.Tensor, positions: torch.Tensor, sinks: list | None = None
                     ) -> list[torch.Tensor]:
        """Per draft layer, the latent rows [B, L, kv_lora+rope] of the context tokens at `positions`; sinks (per
        layer, a cache's (pool rows, dest) or None): also written there."""
        rows = [layer.self_attn.latent_rows(ctx, positions) for layer in self.layers]
        for r, sink in zip(rows, sinks or []):
            if sink is not None:
                sink_write(sink, r)
        return rows

    def decode(self, x, positions, ctx_rows: list[torch.Tensor], mask) -> torch.Tensor:
        pending = None
        for layer, rows in zip(self.layers, ctx_rows):
            x, pending = layer(x, positions, rows, mask, pending)
        return self.final_norm.add(x, pending)[1]
