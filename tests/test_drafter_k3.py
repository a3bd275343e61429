"""The k3 (MLA, `K3DSparkModel`) drafter backbone: the context rows, training pass == inference pass, the export
layout (docs/vllm-contract.md), load round trip, mismatch errors, train-side config and lossless engine decoding."""
import json

import pytest
import torch
from safetensors.torch import load_file

from dspark.checkpoint import export_drafter, load_drafter
from dspark.config import DrafterRecipe
from dspark.engine import Engine
from dspark.models.drafter import DrafterConfig, DSparkDrafter
from dspark.request import SamplingParams
from dspark.spec.draft import sample_markov
from tests.targets import device_of, make_target, propose_after_prefix
from tests.test_engine import reference_greedy
from train.drafter import drafter_config

V = 300
LAYER_IDS = [1, 3]


def make_k3_drafter(target, block_size=4, markov_rank=8, seed=1, **overrides):
    """A small k3-backbone drafter on a K3 target (MLA dims = the tiny target's), on the target's device."""
    torch.manual_seed(seed)
    c = target.config
    kw = dict(vocab_size=V, hidden_size=c.hidden_size, target_hidden_size=c.hidden_size,
              target_layer_ids=list(LAYER_IDS), num_target_layers=len(LAYER_IDS), mask_token_id=1,
              block_size=block_size, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
              rope_theta=50000.0, markov_rank=markov_rank, enable_confidence_head=True, backbone="k3",
              q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
              qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim)
    kw.update(overrides)
    d = DSparkDrafter(DrafterConfig(**kw), target.model.embed_tokens.weight, target.lm_head.weight)
    return d.to(device_of(target)).eval()


@pytest.fixture(scope="module")
def target():
    return make_target("k3", vocab=V)


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_context_rows_follow_the_contract_equations(target):
    """docs/vllm-contract.md, "Context rows": ctx = RMSNorm(context_proj(aux); context_norm);
    row = [RMSNorm(kv_c; kv_a_layernorm) | RoPE(k_pe)], RoPE on interleaved pairs (x_2i, x_2i+1) rotated by
    pos * theta^(-2i/rope). Recomputed here by hand."""
    d = make_k3_drafter(target)
    cfg = d.config
    assert d.row_width == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    dev = device_of(target)
    aux = torch.randn(1, 6, cfg.target_hidden_size * len(LAYER_IDS), device=dev)
    pos = torch.tensor([0, 1, 2, 7, 30, 100], device=dev)
    with torch.no_grad():
        ctx = d.context(aux)
        rows = d.context_rows(ctx, pos)
        ref_ctx = _rms(aux @ d.context_proj.weight.T, d.context_norm.weight, cfg.rms_norm_eps)
        assert torch.allclose(ctx, ref_ctx, atol=1e-5)
        assert len(rows) == cfg.num_hidden_layers
        for layer, r in zip(d.layers, rows):
            a = layer.self_attn
            kv = ref_ctx @ a.kv_a_proj_with_mqa.weight.T
            kv_c, k_pe = kv[..., :cfg.kv_lora_rank], kv[..., cfg.kv_lora_rank:]
            R = cfg.qk_rope_head_dim
            freq = cfg.rope_theta ** (-torch.arange(0, R, 2, device=dev).float() / R)  # [R/2]
            rot = torch.polar(torch.ones(len(pos), R // 2, device=dev), pos[:, None].float() * freq)  # [L, R/2]
            k_rot = torch.view_as_real(torch.view_as_complex(k_pe.reshape(1, len(pos), R // 2, 2)) * rot).flatten(-2)
            ref = torch.cat([_rms(kv_c, a.kv_a_layernorm.weight, cfg.rms_norm_eps), k_rot], -1)
            assert r.shape == (1, len(pos), d.row_width)
            assert torch.allclose(r, ref, atol=1e-5)
        # position 0 is unrotated, later positions are rotated (RoPE is on, unlike the NoPE target MLA)
        assert torch.allclose(rows[-1][0, 0, -R:], k_pe[0, 0], atol=1e-5)
        assert not torch.allclose(rows[-1][0, 1:, -R:], k_pe[0, 1:], atol=1e-3)


@pytest.mark.parametrize("opts", [{}, {"hidden_act": "situ", "confidence_head_with_markov": True}])
def test_block_sparse_training_pass_equals_inference_pass(target, opts):
    """All anchors of a sequence in one masked pass give exactly what the DraftRunner's paged-cache step gives."""
    d = make_k3_drafter(target, **opts)
    for name, p in d.named_parameters():  # larger weights than the init: position / context effects show
        if name.endswith("proj.weight") or name.startswith("markov_head"):
            torch.nn.init.normal_(p, std=0.3)
    seen = []  # the inference pass's block hidden states
    d.decode = lambda *a, _dec=d.decode: seen.append(_dec(*a)) or seen[-1]
    x = torch.randint(2, V, (1, 40)).to(device_of(target))
    with torch.no_grad():
        _, aux = target(x, aux_layer_ids=LAYER_IDS)
        anchors = torch.tensor([[5, 17, 30]], device=x.device)
        h_train = d.train_forward(aux, x, anchors)  # [1, 3, N, H]
        assert h_train.shape == (1, 3, 4, 64)
        for i, a in enumerate(anchors[0].tolist()):
            runner, prop = propose_after_prefix(d, aux, x, a, layer_offset=10)  # the Markov kernel on CUDA
            # kv_lora 32 + rope 8 per token and layer; then the stash of plain steps' projected context (hidden 64)
            assert runner.cache_layout() == {10: 40, 11: 40, 12: 64}
            ref = sample_markov(d, h_train[:, i], x[0, a:a + 1])
            assert torch.allclose(seen[-1], h_train[:, i], rtol=1e-4, atol=1e-5)  # (the 0.3-std weights: |h| ~ 10s)
            assert torch.equal(prop.draft_ids, ref.draft_ids)
            _, prop = propose_after_prefix(d, aux, x, a, layer_offset=10, confidence=True)  # the torch loop
            assert torch.equal(prop.draft_ids, ref.draft_ids)
            assert torch.allclose(prop.confidence, ref.confidence, atol=1e-5)
        # the context really matters: a block that sees less context drafts from different hidden states
        h_short = d.train_forward(aux, x, torch.tensor([[4, 17, 30]], device=x.device))
        assert not torch.allclose(h_short[:, 0], h_train[:, 0], atol=1e-4)


def _expected_names(n_layers, confidence=True):
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"] + [
        f"self_attn.{p}.weight" for p in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                          "kv_a_layernorm", "kv_b_proj", "o_proj")]
    names = {"context_proj.weight", "context_norm.weight", "final_norm.weight", "markov_head.markov_w1.weight",
             "markov_head.markov_w2.weight"} | {f"layers.{i}.{p}" for i in range(n_layers) for p in per_layer}
    return names | ({"confidence_head.proj.weight", "confidence_head.proj.bias"} if confidence else set())


@pytest.mark.parametrize("confidence", [True, False])
def test_export_layout_matches_k3_contract(target, tmp_path, confidence):
    d = make_k3_drafter(target, enable_confidence_head=confidence)
    out = export_drafter(d, tmp_path / "d", layout="dspark")
    cfg = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    assert set(w) == _expected_names(2, confidence)  # no model. prefix, no embed_tokens / lm_head, local ids
    assert w["context_proj.weight"].shape == (64, 64 * len(LAYER_IDS))
    assert w["layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape == (32 + 8, 64)
    assert w["layers.0.self_attn.kv_b_proj.weight"].shape == (4 * (16 + 16), 32)
    assert w["layers.0.self_attn.q_b_proj.weight"].shape == (4 * (16 + 8), 32)
    assert w["markov_head.markov_w2.weight"].shape == (V, 8)
    assert cfg["architectures"] == ["K3DSparkModel"] and cfg["model_type"] == "k3_dspark"
    expected = dict(vocab_size=V, draft_vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=16, hidden_act="silu", rope_theta=50000.0, target_hidden_size=64,
                    target_layer_ids=LAYER_IDS, num_target_layers=2, markov_rank=8, block_size=4, mask_token_id=1,
                    sample_from_anchor=True, enable_confidence_head=confidence, confidence_head_with_markov=False,
                    n_routed_experts=0, n_shared_experts=0, num_experts_per_tok=0)
    assert {k: cfg.get(k) for k in expected} == expected
    assert {"rms_norm_eps", "max_position_embeddings"} <= set(cfg)
    assert not cfg.get("mla_use_nope") and not cfg.get("mla_use_output_gate")
    with pytest.raises(ValueError, match="not defined for the k3 backbone"):
        export_drafter(d, tmp_path / "x", layout="dflash")


def test_load_round_trip_reproduces_outputs(target, tmp_path):
    d = make_k3_drafter(target, hidden_act="situ", logit_scale=0.5)
    torch.nn.init.normal_(d.markov_head.markov_w2.weight, std=0.5)
    loaded = load_drafter(export_drafter(d, tmp_path / "d", layout="dspark"), target)
    assert type(loaded) is type(d) and loaded.config == d.config
    x = torch.randint(2, V, (1, 16)).to(device_of(target))
    with torch.no_grad():
        _, aux = target(x, aux_layer_ids=LAYER_IDS)
        anchors = torch.tensor([[3, 9]], device=x.device)
        h, h2 = d.train_forward(aux, x, anchors), loaded.train_forward(aux, x, anchors)
        assert torch.equal(h, h2)
        a, b = (sample_markov(m, hh[:, 1], x[0, 9:10]) for m, hh in ((d, h), (loaded, h2)))
        assert torch.equal(a.draft_ids, b.draft_ids) and torch.equal(a.confidence, b.confidence)
        # logit_scale scales the whole draft logits (base + Markov)
        assert torch.allclose(loaded.base_logits(h2), 0.5 * torch.nn.functional.linear(h2, target.lm_head.weight))


def _edit(path, drop=(), **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    for k in drop:
        cfg.pop(k)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, drop, message", [
    ({"vocab_size": 301, "draft_vocab_size": 301}, (), "vocab_size 301 != target vocab_size 300"),
    ({"draft_vocab_size": 200}, (), "draft_vocab_size 200 != vocab_size 300"),
    ({"hidden_size": 32}, (), "hidden_size 32"),
    ({"target_layer_ids": [1, 4]}, (), r"target_layer_ids \[4\] out of range .*valid 0..3"),
    ({"mask_token_id": None}, (), "no mask token id"),
    ({}, ("q_lora_rank",), "q_lora_rank is required"),
    ({}, ("kv_lora_rank",), "missing field 'kv_lora_rank'"),
    ({"num_target_layers": 4}, (), r"num_target_layers: .*len\(target_layer_ids\) = 2"),
    ({"mla_use_output_gate": True}, (), "mla_use_output_gate must be false"),
    ({"dspark_bonus_anchor": True}, (), "dspark_bonus_anchor must be false"),
    ({"model_type": "deepseek_v3"}, (), "model_type 'deepseek_v3'"),
    ({"qk_rope_head_dim": 4}, (), r"q_b_proj.weight' has shape \(96, 32\), expected \(80, 32\)"),
])
def test_k3_drafter_mismatch_errors(target, tmp_path, changes, drop, message):
    out = export_drafter(make_k3_drafter(target), tmp_path / "d", layout="dspark")
    _edit(out, drop, **changes)
    with pytest.raises(ValueError, match=message):
        load_drafter(out, target)


def test_config_validation():
    base = dict(vocab_size=V, hidden_size=64, target_hidden_size=64, target_layer_ids=[1, 3], num_target_layers=2,
                mask_token_id=1, backbone="k3", q_lora_rank=32)
    DrafterConfig(**base).validate()
    for bad, msg in [({"q_lora_rank": None}, "q_lora_rank: required"), ({"mode": "dflash", "markov_rank": 0,
                      "enable_confidence_head": False}, "dflash is not defined for K3"),
                     ({"hidden_act": "gelu"}, "hidden_act"), ({"backbone": "llama"}, "backbone")]:
        with pytest.raises(ValueError, match=msg):
            DrafterConfig(**{**base, **bad}).validate()


class _Tok:
    mask_token = "<|mask|>"

    def convert_tokens_to_ids(self, t):
        return 5 if t == self.mask_token else None


def test_train_drafter_config_defaults_from_k3_target(target):
    recipe = DrafterRecipe(kind="drafter", output_dir="unused")
    recipe.drafter.num_layers, recipe.drafter.target_layer_ids = 1, [0, 2]
    cfg = drafter_config(recipe, target, _Tok())
    tc = target.config
    assert cfg.backbone == "k3" and cfg.mode == "dspark" and cfg.mask_token_id == 5
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        tc.q_lora_rank, tc.kv_lora_rank, tc.qk_nope_head_dim, tc.qk_rope_head_dim, tc.v_head_dim)
    assert (cfg.num_attention_heads, cfg.intermediate_size, cfg.hidden_act) == (4, tc.intermediate_size, "silu")
    assert cfg.rope_theta == 50000.0 and cfg.num_target_layers == 2 and cfg.target_layer_ids == [0, 2]
    tc.q_lora_rank = None  # a target without q LoRA: the drafter still needs one
    try:
        assert drafter_config(recipe, target, _Tok()).q_lora_rank == tc.hidden_size // 2
    finally:
        tc.q_lora_rank = 32
    DSparkDrafter(cfg, target.model.embed_tokens.weight, target.lm_head.weight)  # builds as configured


def test_speculative_greedy_with_k3_drafter_equals_plain_greedy(target):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in (3, 11, 19)]
    refs = [reference_greedy(target, p, 16) for p in prompts]
    engine = Engine(target, make_k3_drafter(target), max_batch_size=2, prefill_chunk=8)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16))
    assert [o.token_ids for o in outs] == refs
    m = engine.metrics()
    assert m["num_draft_tokens"] > 0  # the drafter really drafted (and was verified) every decode step
    assert engine.cache.pool.num_used == 0


def test_k3_flex_block_mask_equals_dense_mask():
    target = make_target("k3", vocab=V)
    d = make_k3_drafter(target)
    x = torch.randint(2, V, (2, 40)).to(device_of(target))
    with torch.no_grad():
        _, aux = target(x, aux_layer_ids=d.config.target_layer_ids)
    anchors = torch.tensor([[5, 17, 30], [1, 9, 33]], device=x.device)
    with torch.no_grad():  # flex attention has no CPU backward; the CUDA training path compiles it
        assert torch.allclose(d.train_forward(aux, x, anchors, flex=False),
                              d.train_forward(aux, x, anchors, flex=True), atol=1e-5)
