"""Merged weights: [q | k | v], [gate | up], the KDA input projections and convs, and the stacked routed experts are
each one tensor in memory (the only copy), while checkpoints keep the HF / vLLM names. Loads from an HF-layout file,
byte-exact save round trips, logits against plain-torch references built from the separate projections, and the
weights a model holds (every tensor reachable from it) counted against its checkpoint: equal, but for the zero rows
that align a merged GEMM's width to 8 where the checkpoint's widths do not (the tiny K3's KDA in_proj)."""
import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3ForCausalLM as HFQwen3

from dspark import Engine, SamplingParams
from dspark.checkpoint import export_drafter, load_drafter, load_target
from dspark.kernels.kda_decode import causal_conv_silu, kda_gate, kda_recurrent, l2norm
from dspark.models.k3 import K3ForCausalLM
from dspark.models.k3.config import k3_tiny_config
from dspark.models.k3.moe import set_static_moe
from dspark.models.k3.mxfp4 import convert_to_mxfp4
from dspark.models.layers import MergedLinear, glu, rms_norm
from dspark.models.qwen3 import Qwen3ForCausalLM, qwen3_config
from tests.test_drafter_k3 import make_k3_drafter
from tests.test_engine import make_drafter

IDS = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(0))


def _qwen3_cfg(**kw):
    return qwen3_config(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=96, rope_theta=5000.0, **kw)


def _k3(seed=0, **overrides):
    torch.manual_seed(seed)
    model = K3ForCausalLM(k3_tiny_config(vocab_size=300, **overrides)).eval()
    with torch.no_grad():  # larger than the init, so every weight matters in the logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _random_checkpoint(names_shapes: dict, path, seed=0):
    """A safetensors file of random tensors under the given checkpoint names (an HF-layout file made without us)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {k: (torch.randn(s, generator=g) * 0.2).contiguous() for k, s in names_shapes.items()}
    save_file(tensors, str(path))
    return tensors


def _bytes(t):
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def _assert_files_byte_equal(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(_bytes(a[k]), _bytes(b[k])), k


def _held_numel(model: nn.Module, exclude: nn.Module | None = None) -> int:
    """Elements of every distinct storage reachable from `model`: parameters, buffers and any tensor kept in a
    module attribute (a cached copy would show here); storages of `exclude` (a drafter's target) left out."""
    seen, stack, storages = set(), [m.__dict__ for m in model.modules()], {}
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, nn.Module):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            storages[st.data_ptr()] = st.nbytes() // obj.element_size()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    if exclude is not None:
        for t in list(exclude.parameters()) + list(exclude.buffers()):
            storages.pop(t.untyped_storage().data_ptr(), None)
    return sum(storages.values())


def _padding_numel(model: nn.Module) -> int:
    """Elements of the rows that align merged weights (not in the checkpoint; their outputs are never read)."""
    pads = [m for m in model.modules() if isinstance(m, MergedLinear) and m.pad]
    assert all(m.pad < 8 for m in pads)
    return sum(m.pad * m.in_features for m in pads)


# --------------------------------------------------------------------------------------------- qwen3
def qwen3_ref_logits(sd: dict, cfg, ids: torch.Tensor) -> torch.Tensor:
    """Qwen3 in plain torch from the HF-named tensors: separate q/k/v and gate/up projections."""
    H, Hkv, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    B, T = ids.shape

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    inv = 1.0 / 5000.0 ** (torch.arange(0, D, 2).float() / D)
    ang = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # [T, D]

    def rope(x):  # NeoX halves
        return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin

    causal = torch.ones(T, T, dtype=torch.bool).tril()
    h = sd["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        x = norm(h, sd[p + "input_layernorm.weight"])
        q = norm((x @ sd[p + "self_attn.q_proj.weight"].T).view(B, T, H, D), sd[p + "self_attn.q_norm.weight"])
        k = norm((x @ sd[p + "self_attn.k_proj.weight"].T).view(B, T, Hkv, D), sd[p + "self_attn.k_norm.weight"])
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(B, T, Hkv, D)
        q, k, v = rope(q.transpose(1, 2)), rope(k.transpose(1, 2)), v.transpose(1, 2)
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        att = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~causal, float("-inf")).softmax(-1)
        h = h + (att @ v).transpose(1, 2).reshape(B, T, H * D) @ sd[p + "self_attn.o_proj.weight"].T
        x = norm(h, sd[p + "post_attention_layernorm.weight"])
        a = F.silu(x @ sd[p + "mlp.gate_proj.weight"].T) * (x @ sd[p + "mlp.up_proj.weight"].T)
        h = h + a @ sd[p + "mlp.down_proj.weight"].T
    return norm(h, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


@pytest.fixture(scope="module")
def hf_qwen3_dir(tmp_path_factory):
    """A Qwen3 checkpoint written by transformers itself (the HF layout)."""
    torch.manual_seed(3)
    hf = HFQwen3(_qwen3_cfg())
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("hf") / "q3"
    hf.save_pretrained(str(path))
    return path


def test_qwen3_hf_file_loads_into_merged_weights(hf_qwen3_dir):
    file = load_file(str(hf_qwen3_dir / "model.safetensors"))
    model = load_target(hf_qwen3_dir)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([file[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
        gate_up = torch.cat([file[p + "mlp.gate_proj.weight"], file[p + "mlp.up_proj.weight"]])
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
        assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    with torch.no_grad():  # fp32: the merged GEMMs against the separate projections in plain torch
        torch.testing.assert_close(model(IDS), qwen3_ref_logits(file, model.config, IDS), atol=2e-5, rtol=1e-5)


def test_qwen3_save_writes_the_hf_tensors_byte_exact(hf_qwen3_dir, tmp_path):
    file = load_file(str(hf_qwen3_dir / "model.safetensors"))
    model = load_target(hf_qwen3_dir)
    model.save_pretrained(tmp_path / "out")
    _assert_files_byte_equal(load_file(str(tmp_path / "out" / "model.safetensors")), file)
    # and transformers reads our file back to the same logits
    hf = HFQwen3.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, model(IDS), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_holds_each_weight_once(tmp_path, tied):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(_qwen3_cfg(tie_word_embeddings=tied)).eval()
    model.save_pretrained(tmp_path / "t")
    file = load_file(str(tmp_path / "t" / "model.safetensors"))
    Engine(model, make_drafter(model), max_batch_size=2).generate(  # the engine's step paths have run
        [IDS[0].tolist()], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert _padding_numel(model) == 0 and _held_numel(model) == sum(t.numel() for t in file.values())


# --------------------------------------------------------------------------------------------- K3
def test_k3_hf_file_loads_into_merged_weights_and_saves_byte_exact(tmp_path):
    model = _k3()
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "config.json").write_text(json.dumps(model.config.to_config_json()))
    names = {k: tuple(v.shape) for k, v in model.checkpoint_state_dict().items()}
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.mlp.up_proj.weight" in names
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in names
    file = _random_checkpoint(names, tmp_path / "k" / "model.safetensors")
    loaded = K3ForCausalLM.from_pretrained(tmp_path / "k")
    kda = loaded.model.layers[0].self_attn
    p = "model.layers.0.self_attn."
    in_names = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")
    rows = torch.cat([file[p + f"{n}.weight"] for n in in_names])
    assert torch.equal(kda.in_proj.weight[:len(rows)], rows) and not kda.in_proj.weight[len(rows):].any()
    assert torch.equal(kda.qkv_conv1d.weight, torch.cat([file[p + f"{n}_conv1d.weight"] for n in "qkv"]))
    moe = loaded.model.layers[1].block_sparse_moe
    p = "model.layers.1.block_sparse_moe."
    E = moe.num_experts
    w13 = torch.stack([torch.cat([file[p + f"experts.{e}.w1.weight"], file[p + f"experts.{e}.w3.weight"]])
                       for e in range(E)])
    assert torch.equal(moe.experts.w13_weight, w13)
    assert torch.equal(moe.experts.w2_weight, torch.stack([file[p + f"experts.{e}.w2.weight"] for e in range(E)]))
    assert torch.equal(moe.shared_experts.gate_up_proj.weight, torch.cat(
        [file[p + "shared_experts.gate_proj.weight"], file[p + "shared_experts.up_proj.weight"]]))
    loaded.save_pretrained(tmp_path / "out")
    _assert_files_byte_equal(load_file(str(tmp_path / "out" / "model.safetensors")), file)


class RefKDA(nn.Module):
    """A KDA layer from its separate checkpoint tensors: q/k/v projections and convs one by one (the definitions in
    dspark.kernels.kda_decode)."""

    def __init__(self, layer, sd, p):
        super().__init__()
        self.layer, self.sd, self.p = layer, sd, p

    def forward(self, x, batch=None):
        sd, p, lay = self.sd, self.p, self.layer
        B, T, _ = x.shape
        H, D, W = lay.num_heads, lay.head_dim, lay.conv_size
        qkv = [causal_conv_silu(x.new_zeros(B, W - 1, H * D), x @ sd[p + f"{n}_proj.weight"].T,
                                sd[p + f"{n}_conv1d.weight"][:, 0])[0].view(B, T, H, D) for n in "qkv"]
        q, k, v = l2norm(qkv[0]), l2norm(qkv[1]), qkv[2]
        f = (x @ sd[p + "f_a_proj.weight"].T) @ sd[p + "f_b_proj.weight"].T
        g = kda_gate(f.view(B, T, H, D), sd[p + "A_log"], sd[p + "dt_bias"], lay.gate_lower_bound)
        o, _ = kda_recurrent(q, k, v, g, torch.sigmoid(x @ sd[p + "b_proj.weight"].T))
        o = rms_norm(o, sd[p + "o_norm.weight"], 1e-5) * torch.sigmoid((x @ sd[p + "g_proj.weight"].T).view(B, T, H, D))
        return o.reshape(B, T, H * D) @ sd[p + "o_proj.weight"].T


def _ref_mlp(x, sd, p, c):
    a = glu(x @ sd[p + "gate_proj.weight"].T, x @ sd[p + "up_proj.weight"].T, c.hidden_act,
            c.activation_situ_beta, c.activation_situ_linear_beta)
    return a @ sd[p + "down_proj.weight"].T


class RefMLP(nn.Module):
    def __init__(self, sd, p, c):
        super().__init__()
        self.sd, self.p, self.c = sd, p, c

    def forward(self, x):
        return _ref_mlp(x, self.sd, self.p, self.c)


class RefMoE(nn.Module):
    """The LatentMoE's routing (unchanged) with every routed expert from its own w1 / w2 / w3 tensors."""

    def __init__(self, moe, sd, p, c):
        super().__init__()
        self.moe, self.sd, self.p, self.c = moe, sd, p, c

    def forward(self, x):
        sd, p, c = self.sd, self.p, self.c
        xs = x.reshape(-1, x.shape[-1])
        idx, w, _, _ = self.moe.route(xs)
        z = xs @ sd[p + "routed_expert_down_proj.weight"].T
        u = torch.stack([sum(w[n, j] * _ref_mlp(z[n], sd, p + f"experts.{int(idx[n, j])}.", c)
                             for j in range(idx.shape[1])) for n in range(len(xs))])
        u = rms_norm(u, sd[p + "routed_expert_norm.weight"], c.rms_norm_eps) @ sd[p + "routed_expert_up_proj.weight"].T
        return (u + _ref_mlp(xs, sd, p + "shared_experts.", c)).reshape(x.shape)


def _rename_experts(sd, p):  # the reference MLP helper reads gate/up/down names
    for k in [k for k in sd if k.startswith(p + "experts.")]:
        for w, n in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            if k.endswith(f".{w}.weight"):
                sd[k[: -len(f"{w}.weight")] + f"{n}.weight"] = sd[k]


def test_k3_logits_equal_a_reference_from_the_separate_projections():
    model = _k3()
    c = model.config
    sd = {k: v.detach().clone() for k, v in model.checkpoint_state_dict().items()}
    ref = copy.deepcopy(model)
    for i, layer in enumerate(ref.model.layers):
        p = f"model.layers.{i}."
        if layer.is_kda:
            layer.self_attn = RefKDA(layer.self_attn, sd, p + "self_attn.")
        if hasattr(layer, "block_sparse_moe"):
            _rename_experts(sd, p + "block_sparse_moe.")
            layer.block_sparse_moe = RefMoE(layer.block_sparse_moe, sd, p + "block_sparse_moe.", c)
        else:
            layer.mlp = RefMLP(sd, p + "mlp.", c)
    with torch.no_grad():
        got, want = model(IDS), ref(IDS)
        torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max().item(), rtol=1e-5)
        set_static_moe(model, 64)  # the graph-safe expert path reads the same stacks
        torch.testing.assert_close(model(IDS), want, atol=2e-5 * want.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("mxfp4", [False, True])
def test_k3_holds_each_weight_once(tmp_path, mxfp4):
    model = _k3()
    if mxfp4:
        convert_to_mxfp4(model)
    model.save_pretrained(tmp_path / "t")
    file = load_file(str(tmp_path / "t" / "model.safetensors"))
    drafter = make_k3_drafter(model)
    Engine(model, drafter, max_batch_size=2).generate(  # graph-safe MoE path set, KDA cached steps run
        [IDS[0].tolist()], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    # the tiny KDA layers' in_proj is 4*32 + 16 + 2 = 146 wide: 6 zero rows align it to 152
    assert _padding_numel(model) == 3 * 6 * 64
    assert _held_numel(model) == sum(t.numel() for t in file.values()) + _padding_numel(model)
    export_drafter(drafter, tmp_path / "d")
    dfile = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert _held_numel(drafter, exclude=model) == sum(t.numel() for t in dfile.values())


# --------------------------------------------------------------------------------------------- training, drafters
def test_training_updates_the_merged_weights_and_saves_them(tmp_path):
    """Gradients reach every block of the merged tensors; after an optimizer step the checkpoint holds the new
    values (the HF names are views of the trained tensors) and reloads to the same logits."""
    model = _k3().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.checkpoint_state_dict().items()}
    logits = model(IDS)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), IDS[:, 1:].flatten()).backward()
    kda, moe = model.model.layers[0].self_attn, model.model.layers[1].block_sparse_moe
    for rows in kda.in_proj.parts:
        assert kda.in_proj.weight.grad[kda.in_proj.part_rows(rows)].abs().sum() > 0, rows
    assert kda.in_proj.pad and not kda.in_proj.weight.grad[-kda.in_proj.pad:].any()  # alignment rows: unused
    used = moe.experts.w13_weight.grad.flatten(1).abs().sum(1) > 0  # the experts some token was routed to
    assert used.any() and torch.equal(used, moe.experts.w2_weight.grad.flatten(1).abs().sum(1) > 0)
    opt.step()
    after = model.eval().checkpoint_state_dict()
    k = "model.layers.0.self_attn.k_proj.weight"
    assert not torch.equal(after[k], before[k])
    model.save_pretrained(tmp_path / "m")
    with torch.no_grad():
        assert torch.equal(K3ForCausalLM.from_pretrained(tmp_path / "m")(IDS), model(IDS))


def test_qwen3_drafter_exports_vllm_names_and_reloads(tmp_path):
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(_qwen3_cfg()).eval()
    drafter = make_drafter(target)
    out = export_drafter(drafter, tmp_path / "d")
    file = load_file(str(out / "model.safetensors"))
    attn = drafter.layers[0].self_attn
    assert torch.equal(torch.cat([file[f"layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]), attn.qkv_proj.weight)
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in file)
    loaded = load_drafter(out, target)
    assert torch.equal(loaded.layers[0].mlp.gate_up_proj.weight, drafter.layers[0].mlp.gate_up_proj.weight)
    assert _held_numel(loaded, exclude=target) == sum(t.numel() for t in file.values())
