"""Qwen3 dense GQA target: one readable file, HF `Qwen3ForCausalLM` weights. In memory [q | k | v] and [gate | up]
are one merged weight each (qkv_proj, gate_up_proj); the checkpoint keeps HF's names (dspark.checkpoint_io).

forward(input_ids, batch=None, aux_layer_ids=None, aux_parts=False):
- batch=None: full causal forward (training, teacher forcing);
- batch=ForwardBatch: prefill / decode / verify against a cache (see dspark.cache.batch);
- aux_layer_ids: 0-based "after layer i" ids (vLLM's `target_layer_ids`); returns (logits, aux) with the
  hidden states (hidden + residual, before the final norm) after each listed layer concatenated on the last dim
  (aux_parts: as a list, one tensor per layer, not concatenated).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config

from dspark.cache.batch import ForwardBatch
from dspark.checkpoint_io import checkpoint_state, load_state_strict, read_config, save_checkpoint_dir
from dspark.kernels.paged_attention import attention_fits, paged_attention
from dspark.kernels.rope import qk_norm_rope_, sink_write
from dspark.models.layers import (
    GatedMLP,
    MergedLinear,
    RMSNorm,
    Rope,
    check_aux_layer_ids,
)


def rope_theta_of(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0) or 10000.0))


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        q, kv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q_proj": q, "k_proj": kv, "v_proj": kv}, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def q_and_rows(self, x: torch.Tensor, rope: Rope, sink: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> (q [B, H, T, D] normed and roped, rows [B, T, 2 * n_kv * D] = [k | v] per token, k
        normed and roped: the cache row). One GEMM; at inference q and k are then normed and roped in place in its
        output (one launch on CUDA), so both are views of it and the rows need no copy. sink (a cache's pool rows and
        each token's row in them, Pages.sink): the rows are also written there, in the same launch. Under
        autograd (training), which needs the values that would be overwritten, out of place."""
        B, T, _ = x.shape
        if torch.is_grad_enabled():
            q, k, v = self.qkv_proj.split(self.qkv_proj(x))
            rows = self.kv_rows_of(k, v, rope)
            if sink is not None:
                sink_write(sink, rows)
            return self.q_norm.rope(q.reshape(B, T, self.n_heads, self.head_dim), rope), rows
        H, D = self.n_heads + 2 * self.n_kv, self.head_dim
        y = self.qkv_proj(x)[..., : H * D]
        heads = y.view(B, T, H, D)
        qk_norm_rope_(heads, self.n_heads, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, rope,
                      n_v=self.n_kv, sink=sink)
        return heads[:, :, : self.n_heads].transpose(1, 2), y[..., self.n_heads * D:]

    def kv_rows_of(self, k: torch.Tensor, v: torch.Tensor, rope: Rope) -> torch.Tensor:
        """k, v [B, T, n_kv * D] projections -> rows [B, T, 2 * n_kv * D] = [k (normed, roped) | v] (out of place)."""
        B, T, _ = k.shape
        k = self.k_norm.rope(k.reshape(B, T, self.n_kv, self.head_dim), rope)  # [B, n_kv, T, D]
        return torch.cat([k.transpose(1, 2).flatten(2), v.reshape(B, T, -1)], dim=-1)

    def forward(self, x, rope: Rope, batch: ForwardBatch | None):
        B, T, _ = x.shape
        cache = batch.cache if batch is not None else None
        pages = cache.attn_pages(self.layer_idx) if cache is not None else None
        q, rows = self.q_and_rows(x, rope, None if pages is None else pages.sink)
        if pages is not None:  # written: every row is read in place, these among them
            if attention_fits(q, pages.pool):  # one kernel: no gathered rows, no mask
                return self.o_proj(paged_attention(q, pages.pool, pages.rows, pages.lim).reshape(B, T, -1))
            rows = pages.gathered()  # [B, L, C]
        elif cache is not None:
            rows = cache.attn_append(self.layer_idx, rows)  # [B, L, C]: the cached rows, then these
        L = rows.shape[1]
        k, v = rows.view(B, L, 2, self.n_kv, self.head_dim).permute(2, 0, 3, 1, 4).to(q.dtype)
        mask, causal = (None, True) if batch is None else (batch.key_mask(T, L, q.dtype), False)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, rope: Rope, batch, pending: torch.Tensor | None = None):
        """The residual stream before this layer is h + pending (pending: the layer before's MLP output, not added
        yet, or None): each residual add runs in the norm after it (RMSNorm.add, one kernel on CUDA at inference)
        -> (the stream before this layer, the stream after its attention, its MLP output to add)."""
        x, n = (h, self.input_layernorm(h)) if pending is None else self.input_layernorm.add(h, pending)
        mid, n = self.post_attention_layernorm.add(x, self.self_attn(n, rope, batch))
        return x, mid, self.mlp(n)


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    model_type = "qwen3"

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act: Qwen3 expects 'silu', got {cfg.hidden_act!r}")
        self.config = cfg
        self.model = Qwen3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope_theta = rope_theta_of(cfg)
        self.apply(self._init_weights)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def cache_layout(self) -> tuple[dict[int, int], dict]:
        """Per-token cache row width of every attention layer ([k|v] over kv heads); Qwen3 has no KDA layers."""
        c = self.config
        return {i: 2 * c.num_key_value_heads * c.head_dim for i in range(c.num_hidden_layers)}, {}

    def embed(self, input_ids):
        return self.model.embed_tokens(input_ids)

    def logits(self, hidden_prenorm):
        return self.lm_head(self.model.norm(hidden_prenorm))

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch | None = None,
                aux_layer_ids: list[int] | None = None, aux_parts: bool = False):
        B, T = input_ids.shape
        ids = check_aux_layer_ids(aux_layer_ids, self.num_layers)
        pos = batch.positions(T) if batch is not None else torch.arange(T, device=input_ids.device)
        rope = Rope(pos, self.config.head_dim, self.rope_theta)
        h, pending = self.embed(input_ids), None
        aux = []
        for i, layer in enumerate(self.model.layers):
            stream, h, pending = layer(h, rope, batch, pending)  # stream: the hidden states after layer i - 1
            if i - 1 in ids:
                aux.append(stream)
        h, n = self.model.norm.add(h, pending)  # the last layer's residual add and the final norm
        if self.num_layers - 1 in ids:
            aux.append(h)
        logits = self.lm_head(n)
        if aux_layer_ids is None:
            return logits
        return logits, (aux if aux_parts else torch.cat(aux, dim=-1))

    # --- checkpoints (HF layout) ---
    def save_pretrained(self, out_dir: str | Path) -> None:
        """config.json + model.safetensors (HF names; a tied lm_head omitted), written whole (temp dir + rename)."""
        cfg = json.loads(self.config.to_json_string())
        cfg["architectures"] = ["Qwen3ForCausalLM"]
        cfg["rope_theta"] = self.rope_theta  # older loaders read the top-level key
        state = {k: v for k, v in checkpoint_state(self).items()
                 if not (self.config.tie_word_embeddings and k == "lm_head.weight")}
        save_checkpoint_dir(out_dir, cfg, state)

    @classmethod
    def from_pretrained(cls, path: str | Path, device="cpu", dtype=torch.float32) -> Qwen3ForCausalLM:
        """STRICT: a missing, unexpected or wrong-shape tensor raises ValueError naming it."""
        cfg = Qwen3Config(**read_config(path))
        with torch.device("meta"):
            model = cls(cfg)
        state = load_state_strict(path, model, ignore={"lm_head.weight"} if cfg.tie_word_embeddings else set())
        model.load_state_dict(state, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.to(device=device, dtype=dtype).eval()


def qwen3_config(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate_size: int, max_position_embeddings: int = 4096,
                 rope_theta: float = 10000.0, tie_word_embeddings: bool = False, **special) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                       num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                       intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
                       rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                       tie_word_embeddings=tie_word_embeddings, **special)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


__all__ = ["Qwen3ForCausalLM", "qwen3_config", "check_aux_layer_ids", "num_params"]
