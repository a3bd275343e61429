"""K3ForCausalLM: the Kimi K3 / Kimi Linear text model (KDA + NoPE MLA, AttnRes, LatentMoE/MXFP4) in plain torch.

forward(input_ids [B, T], batch=None, aux_layer_ids=None, aux_parts=False) -> logits [B, T, V], or (logits,
aux [B, T, n*hidden]); aux_parts: aux as the list of the n layers' [B, T, hidden].
Checkpoints use the exact HF names (docs/k3-model.md, "Checkpoint names"); a kimi_k3-wrapped config puts them
under `language_model.`. In memory the merged projections and the stacked experts are the only copy of their blocks
(checkpoint_state_dict gives the HF names as views).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from dspark.checkpoint_io import check_state, checkpoint_state, read_config, read_weights, save_checkpoint_dir
from dspark.models.layers import GatedMLP, RMSNorm, check_aux_layer_ids

from .attn_res import AttnResStream, attn_res
from .config import K3TextConfig
from .kda import KimiDeltaAttention
from .mla import MLAttention
from .moe import LatentMoE
from .mxfp4 import convert_to_mxfp4

K3_PREFIX = "language_model."
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.")  # multimodal parts of a kimi_k3 checkpoint


class K3DecoderLayer(nn.Module):
    def __init__(self, config: K3TextConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.is_kda = c.is_kda_layer(layer_idx)
        if self.is_kda:
            lac = c.linear_attn_config
            self.self_attn = KimiDeltaAttention(
                c.hidden_size, lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"],
                lac.get("gate_lower_bound"), lac.get("use_full_rank_gate", True), layer_idx)
        else:
            self.self_attn = MLAttention(
                c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
                c.qk_rope_head_dim, c.v_head_dim, c.rms_norm_eps, c.mla_use_output_gate, layer_idx=layer_idx)
        act = (c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta)
        if c.is_moe_layer(layer_idx):
            self.block_sparse_moe = LatentMoE(c)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, *act)
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.attn_res = c.attn_res_block_size is not None
        if self.attn_res:
            self.self_attention_res_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
            self.self_attention_res_proj = nn.Linear(c.hidden_size, 1, bias=False)
            self.mlp_res_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(c.hidden_size, 1, bias=False)
            nn.init.zeros_(self.self_attention_res_proj.weight)
            nn.init.zeros_(self.mlp_res_proj.weight)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)


class K3Model(nn.Module):
    def __init__(self, config: K3TextConfig):
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(K3DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if c.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(c.hidden_size, 1, bias=False)
            nn.init.zeros_(self.output_attn_res_proj.weight)


class K3ForCausalLM(nn.Module):
    def __init__(self, config: K3TextConfig):
        super().__init__()
        self.config = config
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if config.is_mxfp4:
            convert_to_mxfp4(self, quantize=False)

    # ---- forward --------------------------------------------------------------------------------------------
    def hidden_states(self, input_ids: torch.Tensor, batch=None, aux_layer_ids=None):
        """-> (pre-norm final hidden [B, T, d], {layer id: aux hidden [B, T, d]})."""
        ids = check_aux_layer_ids(aux_layer_ids, self.config.num_hidden_layers)
        m, c = self.model, self.config
        h = m.embed_tokens(input_ids)
        aux: dict[int, torch.Tensor] = {}
        if c.attn_res_block_size is not None:
            stream = AttnResStream(h, c.attn_res_block_size, c.num_hidden_layers)
            mlp_out = None
            for i, layer in enumerate(m.layers):
                x = attn_res(stream.pre_attention(i, mlp_out), layer.self_attention_res_norm,
                             layer.self_attention_res_proj)
                attn_out = layer.self_attn(layer.input_layernorm(x), batch)
                x = attn_res(stream.post_attention(i, attn_out), layer.mlp_res_norm, layer.mlp_res_proj)
                mlp_out = layer.ffn(layer.post_attention_layernorm(x))
                if i in ids:
                    aux[i] = stream.aux_after_layer(mlp_out)
            h = attn_res(stream.finish(mlp_out), m.output_attn_res_norm, m.output_attn_res_proj)
        else:  # plain pre-norm residual stream
            for i, layer in enumerate(m.layers):
                h = h + layer.self_attn(layer.input_layernorm(h), batch)
                h = h + layer.ffn(layer.post_attention_layernorm(h))
                if i in ids:
                    aux[i] = h
        return h, aux

    def forward(self, input_ids: torch.Tensor, batch=None, aux_layer_ids: list[int] | None = None,
                aux_parts: bool = False):
        h, aux = self.hidden_states(input_ids, batch, aux_layer_ids)
        logits = self.lm_head(self.model.norm(h))
        if aux_layer_ids is None:
            return logits
        parts = [aux[i] for i in aux_layer_ids]
        return logits, (parts if aux_parts else torch.cat(parts, -1))

    def cache_layout(self) -> tuple[dict[int, int], dict[int, tuple[int, int, int, int, int]]]:
        """MLA layers: the per-token latent row width (kv_lora_rank + qk_rope_head_dim); KDA layers: the state
        shape (H, K, V, conv channels 3P, conv width W)."""
        c = self.config
        lac = c.linear_attn_config
        H, D, W = lac["num_heads"], lac["head_dim"], lac.get("short_conv_kernel_size", 4)
        attn = {i: c.kv_lora_rank + c.qk_rope_head_dim for i in range(c.num_hidden_layers) if not c.is_kda_layer(i)}
        kda = {i: (H, D, D, 3 * H * D, W) for i in range(c.num_hidden_layers) if c.is_kda_layer(i)}
        return attn, kda

    def on_step_end(self) -> None:
        """Quantile Balancing: after each optimizer step, refresh every MoE router bias from the recorded batch."""
        for module in self.modules():
            if isinstance(module, LatentMoE):
                module.update_bias()

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def _prefix(self) -> str:
        return K3_PREFIX if self.config.wrapped_in_k3 else ""

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """HF tensor names -> tensors (tied lm_head omitted); blocks of merged weights are views of them."""
        sd = checkpoint_state(self)
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        p = self._prefix()
        return {p + k: v for k, v in sd.items()}

    def save_pretrained(self, save_dir: str | os.PathLike) -> None:
        """config.json + model.safetensors (HF names), written whole (temp dir + rename)."""
        save_checkpoint_dir(save_dir, self.config.to_config_json(), self.checkpoint_state_dict())

    @classmethod
    def from_pretrained(cls, load_dir: str | os.PathLike, device="cpu", dtype=torch.float32) -> K3ForCausalLM:
        """STRICT: a missing, unexpected or wrong-shape tensor raises ValueError naming it. Reads sharded
        checkpoints (model.safetensors.index.json) too."""
        config = K3TextConfig.from_dict(read_config(load_dir))
        model = cls(config)
        model.load_checkpoint_tensors(read_weights(load_dir), where=str(Path(load_dir)))
        model.to(device=device, dtype=dtype)
        keep_fp32 = [mod.A_log for mod in model.modules() if isinstance(mod, KimiDeltaAttention)]
        keep_fp32 += [mod.dt_bias for mod in model.modules() if isinstance(mod, KimiDeltaAttention)]
        for p in keep_fp32:
            p.data = p.data.float()
        for mod in model.modules():
            if isinstance(mod, LatentMoE):  # router bias stays fp32
                mod.gate.e_score_correction_bias = mod.gate.e_score_correction_bias.float()
        return model.eval()

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor], where: str = "checkpoint") -> None:
        """Copy HF-named tensors into the model, strictly (dspark.checkpoint_io.check_state). Multimodal and MTP
        tensors and rotary caches are skipped; legacy A_log [1, 1, H, 1] and conv [P, W] shapes are reshaped."""
        c, p = self.config, self._prefix()
        expected = self.checkpoint_state_dict()
        L, n_mtp = c.num_hidden_layers, c.num_nextn_predict_layers
        loaded: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name.startswith(IGNORED_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
                continue
            if _is_mtp_tensor(name, p, L, n_mtp):  # the main model skips MTP layers' weights
                continue
            want = expected[name].shape if name in expected else None
            if want is not None and name.endswith(".A_log") and t.dim() == 4 and t.numel() == want.numel():
                t = t.reshape(want)  # legacy [1, 1, H, 1]
            if want is not None and name.endswith("_conv1d.weight") and t.dim() == 2:
                t = t.unsqueeze(1)  # legacy [P, W]
            loaded[name] = t
        check_state(expected, loaded, where)
        with torch.no_grad():
            for name, target in expected.items():
                target.copy_(loaded[name].to(target.dtype))


def _is_mtp_tensor(name: str, prefix: str, num_layers: int, n_mtp: int) -> bool:
    head = prefix + "model.layers."
    if not n_mtp or not name.startswith(head):
        return False
    idx = name[len(head):].split(".", 1)[0]
    return idx.isdigit() and num_layers <= int(idx) < num_layers + n_mtp
