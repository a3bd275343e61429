"""The DSpark drafter (parallel block backbone + Markov head + confidence head), in vLLM's layouts.

One parallel pass drafts a whole block. Target hidden states after `target_layer_ids` (concatenated) become a
context; every draft layer turns the context into its own cache rows and the query block attends to them and,
non-causally, to itself. Two backbones (drafter_backbones.py), picked by `DrafterConfig.backbone`:
- qwen3 (`Qwen3DSparkModel` / `DFlashDraftModel`): ctx = hidden_norm(fc(aux)); rows = [k_norm(k_proj(ctx)) + RoPE
  | v_proj(ctx)]; Qwen3 decoder layers; final `norm`.
- k3 (`K3DSparkModel`; docs/vllm-contract.md, "Context rows"): ctx = context_norm(context_proj(aux)); rows = the
  MLA latent [kv_a_layernorm(kv_c) | RoPE(k_pe)] of kv_a_proj_with_mqa(ctx); MLA (interleaved RoPE, no output gate)
  + dense gate/up/down MLP layers; `final_norm`; logits x logit_scale.

Query layouts (docs/vllm-contract.md, "Query layouts and positions"):
- dspark (anchor-as-first, `sample_from_anchor`): N queries [anchor, mask x (N-1)] at positions p0..p0+N-1;
  query j predicts the token at p0+j+1, so a block gives N drafts.
- dflash (1+N fill-in): the same block, but query j >= 1 predicts the token at its own position p0+j, so a block
  of N gives N-1 drafts and query 0 is not sampled (qwen3 backbone only).

Embedding and LM head are the target's, frozen (non-persistent buffers: never trained, never saved).
Markov head: logits_j = U_j + markov_w2 @ markov_w1[prev_j], prev_0 = anchor, prev_j = draft j-1.
Confidence head: c_j = sigmoid(proj(h_j)) (or proj([h_j | m_j])), the conditional acceptance of draft j.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.kernels.draft_block import block_embeddings
from dspark.models.drafter_backbones import K3Backbone, Qwen3Backbone
from dspark.models.drafter_config import BACKBONE_NAMES, DrafterConfig


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
        w = self.proj.weight  # fp32 while training (the head's logits in fp32); bf16 when served in bf16
        return self.proj(h.to(w.dtype)).float().squeeze(-1)


class DSparkDrafter(nn.Module):
    """The backbone-independent drafter: heads, frozen target embedding / LM head, block layout, training pass.

    `DSparkDrafter(cfg, embed, lm_head)` builds the subclass of `cfg.backbone` (BACKBONES: this class with a
    drafter_backbones mixin), which registers its modules under the vLLM names and implements the interface:
      row_width: int                                  per-token context row width in the paged cache
      project_weight [H, n*Ht]                        the context projection's weight (fc / context_proj, no bias)
      context_of(projected [B, L, H]) -> ctx [B, L, H]  its norm (hidden_norm / context_norm)
      context_rows(ctx [B, L, H], positions [B, L] | [L], sinks=None) -> per draft layer [B, L, row_width] (sinks:
        per layer a cache's (pool rows, dest) or None, where the rows are also written)
      decode(x [B, Q, H] embedded block, positions [B, Q], ctx_rows, mask [B, 1, Q, L+Q]) -> post-norm [B, Q, H]
    """

    row_width: int

    def __new__(cls, cfg: DrafterConfig | None = None, *args, **kwargs):
        if cls is DSparkDrafter:
            if cfg.backbone not in BACKBONES:
                raise ValueError(f"backbone: expected one of {sorted(BACKBONES)}, got {cfg.backbone!r}")
            cls = BACKBONES[cfg.backbone]
        return super().__new__(cls)

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.build_backbone(cfg)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank) if cfg.markov_rank else None
        conf_dim = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(conf_dim) if cfg.enable_confidence_head else None
        for m in self.modules():
            if isinstance(m, nn.Linear) and m not in (self.markov_head and self.markov_head.markov_w2,):
                nn.init.normal_(m.weight, std=0.02)
        if self.confidence_head is not None:
            nn.init.zeros_(self.confidence_head.proj.bias)
        self.set_target_weights(embed_weight, lm_head_weight)

    def build_backbone(self, cfg: DrafterConfig) -> None:  # registers the backbone modules (vLLM names)
        raise NotImplementedError

    def set_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        if embed_weight.shape != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"target embedding {tuple(embed_weight.shape)} does not match the drafter "
                             f"(vocab_size={self.config.vocab_size}, hidden_size={self.config.hidden_size})")
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype the backbone computes in (that of its first parameter: fc / context_proj)."""
        return next(self.parameters()).dtype

    # ---------------------------------------------------------------- pieces
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux: [B, L, n*target_hidden] -> [B, L, H]: the context projection (ctx before its norm), aux cast to the
        weight's dtype."""
        w = self.project_weight
        return F.linear(aux.to(w.dtype), w)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux: [B, L, n*target_hidden] -> ctx [B, L, H], what the context rows are made from."""
        return self.context_of(self.project(aux))

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        U = F.linear(h, self.lm_head_weight.to(h.dtype)).float()
        return U if self.config.logit_scale == 1.0 else U * self.config.logit_scale

    def markov(self, prev: torch.Tensor):
        """-> (logit bias [..., V] fp32 or 0, m [..., r] or None)."""
        if self.markov_head is None:
            return 0.0, None
        bias, m = self.markov_head(prev)
        bias = bias.float()
        return (bias if self.config.logit_scale == 1.0 else bias * self.config.logit_scale), m

    def confidence(self, h: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        if self.config.confidence_head_with_markov:
            h = torch.cat([h, m.to(h.dtype)], dim=-1)
        return self.confidence_head(h)

    # ---------------------------------------------------------------- block layout helpers
    def block_embeddings(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchor tokens [...] -> their embedded blocks [..., N, H] = [embed(anchor), embed(mask) x (N-1)] in the
        backbone's dtype (the mask rows a view of the embedding's row: no token block is built)."""
        return block_embeddings(anchors, self.embed_weight, self.config.mask_token_id, self.config.block_size,
                                self.param_dtype)

    def draft_slots(self) -> slice:
        """Which block queries are sampled: all N (dspark) or 1..N-1 (dflash)."""
        return slice(0, None) if self.config.mode == "dspark" else slice(1, None)

    # ---------------------------------------------------------------- training: many blocks per sequence
    def forward(self, aux: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                flex: bool = False) -> torch.Tensor:
        """The training forward (what DDP / FSDP wrap): see train_forward."""
        return self.train_forward(aux, input_ids, anchors, flex=flex)

    def train_forward(self, aux: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                      flex: bool = False) -> torch.Tensor:
        """All anchors' blocks of each sequence in one pass with a block-sparse mask: a flex-attention BlockMask
        (flex=True: only the live tiles are computed, compiled on CUDA; the trainer's default there) or a dense
        bool mask for SDPA (flex=False); both compute the same thing (tests on CPU, bench/check_flex_cuda.py on CUDA).

        aux: [B, T, n*Ht] target features; input_ids: [B, T]; anchors: [B, A] positions (>= 1).
        Block a sees the context at positions < anchors[a] and, non-causally, its own N queries only.
        Returns the post-norm hidden states of the sampled queries: [B, A, D, H], D = num_drafts.
        """
        B, T = input_ids.shape
        A, N = anchors.shape[1], self.config.block_size
        dev = input_ids.device
        ctx_rows = self.context_rows(self.context(aux), torch.arange(T, device=dev))
        x = self.block_embeddings(input_ids.gather(1, anchors)).flatten(1, 2)  # [B, A*N, H]
        pos = anchors[..., None] + torch.arange(N, device=dev)  # [B, A, N]
        q_anchor = anchors.repeat_interleave(N, dim=1)  # [B, A*N]
        if flex:
            from torch.nn.attention.flex_attention import create_block_mask

            def visible(b, h, q, kv):  # keys: T context positions, then the A*N block queries
                return torch.where(kv < T, kv < q_anchor[b, q], (kv - T) // N == q // N)

            mask = create_block_mask(visible, B, None, A * N, T + A * N, device=dev)
        else:
            ctx_vis = torch.arange(T, device=dev)[None, None, :] < q_anchor[:, :, None]  # [B, A*N, T]
            blk = torch.arange(A, device=dev).repeat_interleave(N)
            blk_vis = (blk[:, None] == blk[None, :]).expand(B, -1, -1)  # [B, A*N, A*N]
            mask = torch.cat([ctx_vis, blk_vis], dim=-1)[:, None]
        h = self.decode(x, pos.flatten(1), ctx_rows, mask)
        return h.view(B, A, N, -1)[:, :, self.draft_slots()]


class Qwen3DSparkDrafter(Qwen3Backbone, DSparkDrafter):
    """vLLM `Qwen3DSparkModel` / `DFlashDraftModel`."""


class K3DSparkDrafter(K3Backbone, DSparkDrafter):
    """vLLM `K3DSparkModel`."""


BACKBONES: dict[str, type[DSparkDrafter]] = {"qwen3": Qwen3DSparkDrafter, "k3": K3DSparkDrafter}
__all__ = ["BACKBONE_NAMES", "BACKBONES", "DrafterConfig", "DSparkDrafter", "K3DSparkDrafter", "Qwen3DSparkDrafter"]
