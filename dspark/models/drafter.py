"""The DSpark drafter (DFlash backbone + Markov head + confidence head), in vLLM's `Qwen3DSparkModel` layout.

One parallel pass drafts a whole block. Target hidden states after `target_layer_ids` (concatenated) become a
context: ctx = hidden_norm(fc(aux)); every draft layer turns ctx into its own K/V (k_norm(k_proj(ctx)) + RoPE,
v_proj(ctx)) and the query block attends to it and, non-causally, to itself.

Query layouts (vLLM §4.2):
- dspark (anchor-as-first, `sample_from_anchor`): N queries [anchor, mask x (N-1)] at positions p0..p0+N-1;
  query j predicts the token at p0+j+1, so a block gives N drafts.
- dflash (1+N fill-in): the same block, but query j >= 1 predicts the token at its own position p0+j, so a block
  of N gives N-1 drafts and query 0 is not sampled.

Embedding and LM head are the target's, frozen (non-persistent buffers: never trained, never saved).
Markov head: logits_j = U_j + markov_w2 @ markov_w1[prev_j], prev_0 = anchor, prev_j = draft j-1.
Confidence head: c_j = sigmoid(proj(h_j)) (or proj([h_j | m_j])), the conditional acceptance of draft j.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.layers import GatedMLP, RMSNorm, apply_rope_neox, rope_cos_sin
from dspark.models.qwen3 import Qwen3Attention


@dataclass
class DrafterConfig:
    vocab_size: int
    hidden_size: int  # = the target's hidden size (shared embedding / LM head)
    target_hidden_size: int
    target_layer_ids: list[int]  # 0-based "after layer i" of the target
    num_target_layers: int  # the target's depth (Qwen3 DSpark / DFlash convention)
    mask_token_id: int
    block_size: int = 4
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    mode: str = "dspark"  # dspark | dflash
    markov_rank: int = 32  # 0 = no Markov head
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def num_drafts(self) -> int:
        return self.block_size if self.mode == "dspark" else self.block_size - 1

    def validate(self) -> None:
        if self.mode not in ("dspark", "dflash"):
            raise ValueError(f"mode: expected 'dspark' or 'dflash', got {self.mode!r}")
        if self.mode == "dflash" and (self.markov_rank or self.enable_confidence_head):
            raise ValueError("mode: the dflash layout has no Markov or confidence head; set markov_rank=0 and "
                             "enable_confidence_head=false")
        if self.block_size < (1 if self.mode == "dspark" else 2):
            raise ValueError(f"block_size: too small for mode {self.mode!r}: {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids: expected a non-empty list")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids: {bad} out of range for a target of {self.num_target_layers} layers "
                             f"(valid 0..{self.num_target_layers - 1})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id: {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")

    def as_qwen3(self):
        from transformers import Qwen3Config

        return Qwen3Config(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, attention_bias=self.attention_bias)

    def to_dict(self) -> dict:
        return asdict(self)


class DraftAttention(Qwen3Attention):
    """Qwen3 attention (same weights/names) used the DFlash way: K/V of the context + of the block itself."""

    def kv_rows(self, h: torch.Tensor, cos, sin) -> torch.Tensor:
        """h: [B, L, H] -> cache rows [B, L, 2*n_kv*head_dim] = [k (normed, roped) | v]."""
        B, L, _ = h.shape
        k = self.k_norm(self.k_proj(h).view(B, L, self.n_kv, self.head_dim)).transpose(1, 2)
        k = apply_rope_neox(k, cos, sin)
        v = self.v_proj(h).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        return torch.cat([k.transpose(1, 2).flatten(2), v.transpose(1, 2).flatten(2)], dim=-1)

    def attend(self, x, cos, sin, ctx_rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x: [B, Q, H] queries; ctx_rows: [B, L, C]; mask: [B, 1, Q, L + Q] bool over [context ; block]."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope_neox(q, cos, sin)
        rows = torch.cat([ctx_rows.to(x.dtype), self.kv_rows(x, cos, sin)], dim=1)
        k, v = rows.view(B, rows.shape[1], 2, self.n_kv, self.head_dim).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, -1))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, idx: int):
        super().__init__()
        qcfg = cfg.as_qwen3()
        self.self_attn = DraftAttention(qcfg, idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_rows, mask):
        x = x + self.self_attn.attend(self.input_layernorm(x), cos, sin, ctx_rows, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)  # [V, r]
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)  # weight [V, r]
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # starts as the plain parallel drafter

    def forward(self, prev: torch.Tensor):  # prev: [...] -> (bias [..., V], m [..., r])
        m = self.markov_w1(prev)
        return self.markov_w2(m), m


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=True)

    def forward(self, h):  # [..., dim] -> [...] logits (sigmoid = conditional acceptance)
        return self.proj(h.float()).squeeze(-1)


class DSparkDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        cfg.validate()
        self.config = cfg
        n_aux = len(cfg.target_layer_ids)
        self.fc = nn.Linear(cfg.target_hidden_size * n_aux, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank) if cfg.markov_rank else None
        conf_dim = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(conf_dim) if cfg.enable_confidence_head else None
        for m in self.modules():
            if isinstance(m, nn.Linear) and m not in (self.markov_head and self.markov_head.markov_w2,):
                nn.init.normal_(m.weight, std=0.02)
        if self.confidence_head is not None:
            nn.init.zeros_(self.confidence_head.proj.bias)
        self.set_target_weights(embed_weight, lm_head_weight)

    def set_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        if embed_weight.shape != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"target embedding {tuple(embed_weight.shape)} does not match the drafter "
                             f"(vocab_size={self.config.vocab_size}, hidden_size={self.config.hidden_size})")
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)

    # ---------------------------------------------------------------- pieces
    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux: [B, L, n*target_hidden] -> ctx [B, L, H]."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_rows(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Per draft layer, the K/V rows of the context tokens at `positions` ([B, L] or [L])."""
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, ctx.dtype)
        return [layer.self_attn.kv_rows(ctx, cos, sin) for layer in self.layers]

    def backbone(self, tokens, positions, ctx_rows: list[torch.Tensor], mask) -> torch.Tensor:
        """tokens/positions: [B, Q]; returns the post-norm draft hidden states [B, Q, H]."""
        x = F.embedding(tokens, self.embed_weight).to(self.fc.weight.dtype)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer, rows in zip(self.layers, ctx_rows):
            x = layer(x, cos, sin, rows, mask)
        return self.norm(x)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.lm_head_weight.to(h.dtype)).float()

    def markov(self, prev: torch.Tensor):
        """-> (logit bias [..., V] fp32 or 0, m [..., r] or None)."""
        if self.markov_head is None:
            return 0.0, None
        bias, m = self.markov_head(prev)
        return bias.float(), m

    def confidence(self, h: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        if self.config.confidence_head_with_markov:
            h = torch.cat([h, m.to(h.dtype)], dim=-1)
        return self.confidence_head(h)

    # ---------------------------------------------------------------- block layout helpers
    def block_tokens(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors: [...] -> [..., N] = [anchor, mask x (N-1)]."""
        N = self.config.block_size
        blk = torch.full((*anchors.shape, N), self.config.mask_token_id, dtype=torch.long, device=anchors.device)
        blk[..., 0] = anchors
        return blk

    def draft_slots(self) -> slice:
        """Which block queries are sampled: all N (dspark) or 1..N-1 (dflash)."""
        return slice(0, None) if self.config.mode == "dspark" else slice(1, None)

    # ---------------------------------------------------------------- training: many blocks per sequence
    def train_forward(self, aux: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """All anchors' blocks of each sequence in one pass with a block-sparse mask.

        aux: [B, T, n*Ht] target features; input_ids: [B, T]; anchors: [B, A] positions (>= 1).
        Block a sees the context at positions < anchors[a] and, non-causally, its own N queries only.
        Returns the post-norm hidden states of the sampled queries: [B, A, D, H], D = num_drafts.
        """
        B, T = input_ids.shape
        A, N = anchors.shape[1], self.config.block_size
        dev = input_ids.device
        ctx_rows = self.context_rows(self.context(aux), torch.arange(T, device=dev))
        blocks = self.block_tokens(input_ids.gather(1, anchors))  # [B, A, N]
        pos = anchors[..., None] + torch.arange(N, device=dev)  # [B, A, N]
        q_anchor = anchors.repeat_interleave(N, dim=1)  # [B, A*N]
        ctx_vis = torch.arange(T, device=dev)[None, None, :] < q_anchor[:, :, None]  # [B, A*N, T]
        blk = torch.arange(A, device=dev).repeat_interleave(N)
        blk_vis = (blk[:, None] == blk[None, :]).expand(B, -1, -1)  # [B, A*N, A*N]
        mask = torch.cat([ctx_vis, blk_vis], dim=-1)[:, None]
        h = self.backbone(blocks.flatten(1), pos.flatten(1), ctx_rows, mask)
        return h.view(B, A, N, -1)[:, :, self.draft_slots()]
