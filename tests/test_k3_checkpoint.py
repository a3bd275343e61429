"""Config validation and strict save/load (plain kimi_linear and kimi_k3-wrapped, single file and sharded), through
dspark.checkpoint_io; K3DSparkModel drafter configs in each of vLLM's forms."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.checkpoint import export_drafter, load_drafter, load_target
from dspark.models.k3 import K3ForCausalLM, K3TextConfig
from dspark.models.k3.config import k3_tiny_config
from tests.targets import device_of, make_target
from tests.test_checkpoint import shard
from tests.test_drafter_k3 import make_k3_drafter


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = K3ForCausalLM(k3_tiny_config(**overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.normal_()
    return model


IDS = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("wrapped", [False, True])
def test_save_load_round_trip_exact(tmp_path, wrapped):
    model = _model(wrapped_in_k3=wrapped)
    model.save_pretrained(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    names = list(load_file(str(tmp_path / "ckpt" / "model.safetensors")))
    if wrapped:
        assert cfg["model_type"] == "kimi_k3" and cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
        assert cfg["text_config"]["model_type"] == "kimi_linear"
        assert all(n.startswith("language_model.") for n in names)
        assert "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight" in names
    else:
        assert cfg["model_type"] == "kimi_linear" and cfg["architectures"] == ["KimiLinearForCausalLM"]
        assert {"model.output_attn_res_proj.weight", "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
                "model.layers.0.self_attn.q_conv1d.weight", "model.layers.3.mlp_res_proj.weight",
                "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
                "model.layers.0.mlp.gate_proj.weight", "lm_head.weight"} <= set(names)
    loaded = K3ForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert loaded.config.wrapped_in_k3 == wrapped and loaded.config.to_dict() == model.config.to_dict()
    # every checkpoint tensor (the merged weights' blocks under their HF names; not the zero alignment rows of the
    # KDA in_proj, which the random perturbation above touched too)
    for (k1, v1), (k2, v2) in zip(model.checkpoint_state_dict().items(), loaded.checkpoint_state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2), k1
    with torch.no_grad():
        assert torch.equal(model(IDS), loaded(IDS))
    model.save_pretrained(tmp_path / "ckpt")  # saving over an existing dir works too
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp")]


def _corrupt(tmp_path, edit):
    model = _model()
    model.save_pretrained(tmp_path / "c")
    path = str(tmp_path / "c" / "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return tmp_path / "c"


def test_missing_tensor_is_named(tmp_path):
    d = _corrupt(tmp_path, lambda t: t.pop("model.layers.0.self_attn.dt_bias"))
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.0.self_attn.dt_bias'.*\(32,\)"):
        K3ForCausalLM.from_pretrained(d)


def test_unexpected_tensor_is_named(tmp_path):
    d = _corrupt(tmp_path, lambda t: t.__setitem__("model.layers.0.self_attn.extra.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model.layers.0.self_attn.extra.weight'"):
        K3ForCausalLM.from_pretrained(d)


def test_wrong_shape_is_named(tmp_path):
    d = _corrupt(tmp_path, lambda t: t.__setitem__("model.layers.2.self_attn.kv_b_proj.weight", torch.zeros(5, 32)))
    with pytest.raises(ValueError, match=r"'model.layers.2.self_attn.kv_b_proj.weight'.*\(5, 32\).*\(128, 32\)"):
        K3ForCausalLM.from_pretrained(d)


def test_legacy_a_log_and_conv_shapes_are_accepted(tmp_path):
    def legacy(t):
        t["model.layers.0.self_attn.A_log"] = t["model.layers.0.self_attn.A_log"].view(1, 1, 2, 1)
        t["model.layers.0.self_attn.k_conv1d.weight"] = t["model.layers.0.self_attn.k_conv1d.weight"][:, 0]
    model = _model()
    loaded = K3ForCausalLM.from_pretrained(_corrupt(tmp_path, legacy))
    with torch.no_grad():
        assert torch.equal(model(IDS), loaded(IDS))


def test_layer_lists_must_cover_every_layer():
    lac = dict(k3_tiny_config().linear_attn_config)
    with pytest.raises(ValueError, match=r"linear_attn_config.kda_layers/full_attn_layers.*uncovered=\[3\]"):
        k3_tiny_config(linear_attn_config={**lac, "full_attn_layers": []})
    with pytest.raises(ValueError, match=r"linear_attn_config.kda_layers/full_attn_layers.*duplicated=\[2\]"):
        k3_tiny_config(linear_attn_config={**lac, "full_attn_layers": [2, 3]})
    with pytest.raises(ValueError, match=r"out_of_range=\[5\]"):
        k3_tiny_config(linear_attn_config={**lac, "kda_layers": [1, 2, 4, 5]})


def test_other_config_errors_name_the_field():
    with pytest.raises(ValueError, match="hidden_act"):
        k3_tiny_config(hidden_act="gelu")
    with pytest.raises(ValueError, match="mla_use_nope"):
        k3_tiny_config(mla_use_nope=False)
    with pytest.raises(ValueError, match="gate_lower_bound"):
        k3_tiny_config(linear_attn_config={**k3_tiny_config().linear_attn_config, "gate_lower_bound": 1.0})
    with pytest.raises(ValueError, match="moe_router_activation_func"):
        k3_tiny_config(moe_router_activation_func="relu")


def test_from_dict_accepts_both_layouts():
    text = k3_tiny_config().to_dict()
    plain = K3TextConfig.from_dict(text)
    k3 = K3TextConfig.from_dict({"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
                                 "text_config": text, "quantization_config": {"format": "mxfp4-pack-quantized"},
                                 "vision_config": {}})
    assert not plain.wrapped_in_k3 and k3.wrapped_in_k3
    assert k3.quantization_config == {"format": "mxfp4-pack-quantized"}  # copied down from the top level
    assert plain.to_dict() == text and plain.is_kda_layer(0) and not plain.is_kda_layer(2)
    assert K3TextConfig.from_dict({**text, "some_future_field": 3}).to_dict()["some_future_field"] == 3


# --------------------------------------------------------------------------- the one checkpoint module (K3 side)
def test_sharded_checkpoint_loads_and_a_save_replaces_the_dir_whole(tmp_path):
    """K3 reads the shards of model.safetensors.index.json through dspark.checkpoint_io like every model; saving
    over a sharded dir replaces it whole, so the stale index cannot shadow the new weights."""
    a, b = _model(seed=0), _model(seed=1)
    a.save_pretrained(tmp_path / "c")
    shard(tmp_path / "c", 3)
    with torch.no_grad():
        assert torch.equal(K3ForCausalLM.from_pretrained(tmp_path / "c")(IDS), a(IDS))
        b.save_pretrained(tmp_path / "c")
        assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["config.json", "model.safetensors"]
        assert torch.equal(K3ForCausalLM.from_pretrained(tmp_path / "c")(IDS), b(IDS))


def test_load_target_reads_k3_through_the_shared_strict_check(tmp_path):
    d = _corrupt(tmp_path, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=rf"{d}: missing tensor 'model.norm.weight' \(expected shape \(64,\)\)"):
        load_target(d)


@pytest.fixture(scope="module")
def k3_target():
    return make_target("k3", vocab=300)


@pytest.mark.parametrize("fields", [
    {"eagle_aux_hidden_state_layer_ids": [2, 4], "dspark_noise_token_id": 1},
    {"dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": 1}},
    {"dspark_target_layer_ids": [1, 3], "pard_token": 1},
    {"eagle_config": {"layer_ids": [2, 4]}, "ptd_token_id": 1},
])
def test_k3_dspark_drafter_loads_from_each_vllm_form(k3_target, tmp_path, fields):
    """K3DSparkModel goes through the same resolver: ids [1, 3] (aux ids [2, 4]) and mask 1 in each form."""
    d = make_k3_drafter(k3_target)
    out = export_drafter(d, tmp_path / "d")
    cfg = json.loads((out / "config.json").read_text())
    for k in ("target_layer_ids", "mask_token_id"):
        cfg.pop(k)
    (out / "config.json").write_text(json.dumps({**cfg, **fields}))
    loaded = load_drafter(out, k3_target)
    assert loaded.config == d.config
    x = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(1)).to(device_of(k3_target))
    with torch.no_grad():
        _, aux = k3_target(x, aux_layer_ids=[1, 3])
        anchors = torch.tensor([[3, 7]], device=x.device)
        assert torch.equal(loaded.train_forward(aux, x, anchors), d.train_forward(aux, x, anchors))


def test_aux_layer_ids_follow_one_rule_on_both_targets(k3_target):
    """Unsorted or repeated aux ids are an error on K3 as on Qwen3 (K3 used to sort them silently)."""
    qwen3 = make_target("qwen3", vocab=300)
    ids = IDS.clamp(max=299).to(device_of(k3_target))
    for model in (k3_target, qwen3):
        for bad in ([2, 0], [1, 1]):
            with pytest.raises(ValueError, match=r"aux_layer_ids: .* must be strictly increasing"):
                model(ids, aux_layer_ids=bad)
