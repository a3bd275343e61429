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

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

BACKBONE_NAMES = ("qwen3", "k3")


@dataclass
class DrafterConfig:
    vocab_size: int
    hidden_size: int  # = the target's hidden size (shared embedding / LM head)
    target_hidden_size: int
    target_layer_ids: list[int]  # 0-based "after layer i" of the target
    # qwen3: the target's depth (Qwen3 DSpark / DFlash convention); k3: len(target_layer_ids) (K3DSparkModel)
    num_target_layers: int
    mask_token_id: int
    block_size: int = 4
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4  # qwen3 only
    head_dim: int = 64  # qwen3 only
    intermediate_size: int = 768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # K3DSparkModel's default is 50000 (set explicitly for k3)
    max_position_embeddings: int = 4096
    mode: str = "dspark"  # dspark | dflash
    markov_rank: int = 32  # 0 = no Markov head
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = False
    hidden_act: str = "silu"  # silu | situ (SiTU-GLU with beta = 1)
    attention_bias: bool = False  # qwen3 only
    backbone: str = "qwen3"  # qwen3 (GQA, fc + hidden_norm) | k3 (MLA, context_proj + context_norm)
    # MLA dims, k3 only (docs/k3-model.md, "MLA"); q_lora_rank is required there
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    logit_scale: float = 1.0  # logits = logit_scale * (lm_head(h) + markov bias)
    extra: dict = field(default_factory=dict)

    @property
    def num_drafts(self) -> int:
        return self.block_size if self.mode == "dspark" else self.block_size - 1

    def validate(self) -> None:
        if self.backbone not in BACKBONE_NAMES:
            raise ValueError(f"backbone: expected one of {BACKBONE_NAMES}, got {self.backbone!r}")
        if self.mode not in ("dspark", "dflash"):
            raise ValueError(f"mode: expected 'dspark' or 'dflash', got {self.mode!r}")
        if self.mode == "dflash" and (self.markov_rank or self.enable_confidence_head):
            raise ValueError("mode: the dflash layout has no Markov or confidence head; set markov_rank=0 and "
                             "enable_confidence_head=false")
        if self.block_size < (1 if self.mode == "dspark" else 2):
            raise ValueError(f"block_size: too small for mode {self.mode!r}: {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids: expected a non-empty list")
        if self.backbone == "k3":
            self._validate_k3()
        else:
            bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
            if bad:
                raise ValueError(f"target_layer_ids: {bad} out of range for a target of {self.num_target_layers} "
                                 f"layers (valid 0..{self.num_target_layers - 1})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id: {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")

    def _validate_k3(self) -> None:
        """K3DSparkModel (docs/vllm-contract.md, "Checkpoint layouts"): dspark layout only, q_lora_rank required,
        num_target_layers = #aux."""
        if self.mode != "dspark":
            raise ValueError("mode: the k3 backbone has only the dspark layout (K3DSparkModel); dflash is not "
                             "defined for K3")
        if not self.q_lora_rank or self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank: required (> 0) for the k3 (MLA) backbone, got {self.q_lora_rank!r}")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: RoPE rotates pairs; expected an even size, got {self.qk_rope_head_dim}")
        if self.hidden_act not in ("silu", "situ"):
            raise ValueError(f"hidden_act: expected 'silu' or 'situ', got {self.hidden_act!r}")
        bad = [i for i in self.target_layer_ids if i < 0]
        if bad:
            raise ValueError(f"target_layer_ids: {bad} are negative (0-based 'after layer i')")
        if self.num_target_layers != len(self.target_layer_ids):
            raise ValueError(f"num_target_layers: for the k3 backbone it is the number of aux layers "
                             f"(len(target_layer_ids) = {len(self.target_layer_ids)}), got {self.num_target_layers}")

    def as_qwen3(self):
        from transformers import Qwen3Config

        return Qwen3Config(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, attention_bias=self.attention_bias)

    def to_dict(self) -> dict:
        return asdict(self)


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

    `DSparkDrafter(cfg, embed, lm_head)` builds the subclass of `cfg.backbone` (drafter_backbones.BACKBONES),
    which registers its modules under the vLLM names and implements the backbone interface:
      row_width: int                                  per-token context row width in the paged cache
      context(aux [B, L, n*Ht]) -> ctx [B, L, H]
      context_rows(ctx [B, L, H], positions [B, L] | [L]) -> per draft layer [B, L, row_width]
      decode(x [B, Q, H] embedded block, positions [B, Q], ctx_rows, mask [B, 1, Q, L+Q]) -> post-norm [B, Q, H]
    """

    row_width: int

    def __new__(cls, cfg: DrafterConfig | None = None, *args, **kwargs):
        if cls is DSparkDrafter:
            from dspark.models.drafter_backbones import BACKBONES

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
    def backbone(self, tokens, positions, ctx_rows: list[torch.Tensor], mask) -> torch.Tensor:
        """tokens/positions: [B, Q]; returns the post-norm draft hidden states [B, Q, H]."""
        x = F.embedding(tokens, self.embed_weight).to(self.param_dtype)
        return self.decode(x, positions, ctx_rows, mask)

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
        blocks = self.block_tokens(input_ids.gather(1, anchors))  # [B, A, N]
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
        h = self.backbone(blocks.flatten(1), pos.flatten(1), ctx_rows, mask)
        return h.view(B, A, N, -1)[:, :, self.draft_slots()]


def __getattr__(name: str):  # the backbone classes live in drafter_backbones.py (imported lazily: no cycle)
    if name in ("DraftAttention", "DraftLayer", "Qwen3DSparkDrafter", "K3DraftLayer", "K3DSparkDrafter", "BACKBONES"):
        from dspark.models import drafter_backbones

        return getattr(drafter_backbones, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
