"""The drafter: training pass == inference pass, vLLM export layouts, loading checks and their errors."""
import json

import pytest
import torch
from safetensors.torch import load_file

from dspark.checkpoint import export_drafter, load_drafter
from dspark.spec.draft import sample_markov
from tests.targets import add_tokenizer, device_of, make_target, propose_after_prefix
from tests.test_engine import make_drafter
from train.losses import LossWeights, drafter_loss


@pytest.fixture(scope="module")
def target():
    t = make_target("qwen3", vocab=300)
    t.tokenizer = None
    return t


@pytest.mark.parametrize("mode", ["dspark", "dflash"])
def test_block_sparse_training_pass_equals_inference_pass(target, mode):
    """All anchors of a sequence in one masked pass give exactly what the engine's incremental draft step gives."""
    d = make_drafter(target, block_size=4, mode=mode)
    torch.nn.init.normal_(d.markov_head.markov_w2.weight, std=0.5) if d.markov_head is not None else None
    dev = device_of(target)
    x = torch.randint(2, 300, (1, 40)).to(dev)
    with torch.no_grad():
        _, aux = target(x, aux_layer_ids=d.config.target_layer_ids)
        anchors = torch.tensor([[5, 17, 30]], device=dev)
        h_train = d.train_forward(aux, x, anchors)  # [1, 3, D, H]
        for i, a in enumerate(anchors[0].tolist()):
            _, prop = propose_after_prefix(d, aux, x, a)  # greedy Markov drafts: the Triton kernel on CUDA
            ref = sample_markov(d, h_train[:, i], x[0, a:a + 1])
            assert torch.equal(prop.draft_ids, ref.draft_ids)
            if mode == "dspark":  # the confidences come from the torch loop
                _, prop = propose_after_prefix(d, aux, x, a, confidence=True)
                assert torch.equal(prop.draft_ids, ref.draft_ids)
                assert torch.allclose(prop.confidence, ref.confidence, atol=1e-5)


def test_loss_tau_counts_greedy_acceptance(target):
    d = make_drafter(target, block_size=3)
    h = torch.randn(2, 5, 3, 64, device=device_of(target))
    anchors = torch.randint(0, 300, (2, 5), device=h.device)
    with torch.no_grad():
        logits = d.base_logits(h)  # markov_w2 starts at zero: logits are the base logits
    labels = logits.argmax(-1).clone()
    labels[0, :, 1] = (labels[0, :, 1] + 1) % 300  # row 0: second draft always wrong -> 1 accepted
    _, m, accepted = drafter_loss(d, h, anchors, labels, None, LossWeights())
    assert accepted[0].tolist() == [1] * 5 and accepted[1].tolist() == [3] * 5
    m = {k: float(v) for k, v in m.items()}
    assert m["tau"] == pytest.approx(1 + (5 * 1 + 5 * 3) / 10)
    assert m["acc0"] == 1.0 and m["acc1"] == 0.5


@pytest.mark.parametrize("layout", ["dspark", "dflash"])
def test_export_layout_matches_vllm_contract(target, tmp_path, layout):
    d = make_drafter(target, mode=layout)
    out = export_drafter(d, tmp_path / "d", layout=layout)
    cfg = json.loads((out / "config.json").read_text())
    names = set(load_file(str(out / "model.safetensors")))
    assert cfg["model_type"] == "qwen3" and cfg["block_size"] == 4 and cfg["num_target_layers"] == 3
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_norm.weight", "layers.0.mlp.down_proj.weight"} <= names
    assert not any(n.startswith(("model.", "embed_tokens", "lm_head")) for n in names)
    assert load_file(str(out / "model.safetensors"))["fc.weight"].shape == (64, 2 * 64)
    if layout == "dspark":
        assert cfg["architectures"] == ["Qwen3DSparkModel"]
        assert cfg["target_layer_ids"] == [0, 2] and cfg["mask_token_id"] == 1 and cfg["markov_rank"] == 8
        assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                "confidence_head.proj.weight", "confidence_head.proj.bias"} <= names
    else:
        assert cfg["architectures"] == ["DFlashDraftModel"]
        assert cfg["dflash_config"] == {"mask_token_id": 1, "target_layer_ids": [0, 2]}
        assert not any(n.startswith(("markov", "confidence")) for n in names)
    loaded = load_drafter(out, target)
    x = torch.randint(2, 300, (1, 12)).to(device_of(target))
    with torch.no_grad():
        _, aux = target(x, aux_layer_ids=[0, 2])
        anchors = torch.tensor([[4, 7]], device=x.device)
        assert torch.equal(loaded.train_forward(aux, x, anchors), d.train_forward(aux, x, anchors))


def _edit(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, message", [
    ({"vocab_size": 301}, "vocab_size 301 != target vocab_size 300"),
    ({"target_layer_ids": [0, 3]}, r"target_layer_ids:? \[3\] out of range .*valid 0..2"),
    ({"mask_token_id": None}, "no mask token id"),
    ({"architectures": ["LlamaForCausalLM"]}, "is not a drafter"),
    ({"hidden_size": 32}, "hidden_size 32"),
])
def test_drafter_target_mismatch_errors(target, tmp_path, changes, message):
    out = export_drafter(make_drafter(target), tmp_path / "d", layout="dspark")
    _edit(out, **changes)
    with pytest.raises(ValueError, match=message):
        load_drafter(out, target)


def test_check_cli(target, tmp_path, capsys):
    from dspark.checkpoint import main

    target.save_pretrained(tmp_path / "t")
    add_tokenizer(tmp_path / "t")  # its mask token is id 2
    export_drafter(make_drafter(target), tmp_path / "d", layout="dspark")
    _edit(tmp_path / "d", mask_token_id=2)
    assert main(["check", str(tmp_path / "d"), "--target", str(tmp_path / "t")]) == 0
    assert "ok: dspark drafter" in capsys.readouterr().out
    # the tensor-parallel contract (4 heads, 2 kv heads, intermediate 96): TP 2 and 4 shard (kv heads replicated
    # at 4), TP 8 does not
    for tp, rc in ((2, 0), (4, 0), (8, 2)):
        assert main(["check", str(tmp_path / "d"), "--target", str(tmp_path / "t"), "--tensor-parallel-size", str(tp)]) == rc
    out = capsys.readouterr()
    assert "shards at tensor_parallel_size 4" in out.out
    assert "num_attention_heads 4 is not divisible by 8" in out.err and "draft_tensor_parallel_size 1" in out.err
    _edit(tmp_path / "d", target_layer_ids=[7])
    assert main(["check", str(tmp_path / "d"), "--target", str(tmp_path / "t")]) == 2
    assert "out of range" in capsys.readouterr().err


def test_tensor_parallel_problems():
    from dspark.checkpoint import tensor_parallel_problems

    gqa = {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 12288}
    assert tensor_parallel_problems(gqa, 8) == [] and tensor_parallel_problems(gqa, 16) == []  # kv replicated x2
    assert tensor_parallel_problems({**gqa, "num_key_value_heads": 6}, 4) == [
        "num_key_value_heads 6 neither divides nor is divisible by 4"]
    mla = {"num_attention_heads": 6, "intermediate_size": 2048, "kv_lora_rank": 256, "num_key_value_heads": 6}
    assert tensor_parallel_problems(mla, 2) == []  # the MLA latent is replicated: kv heads do not matter
    assert tensor_parallel_problems(mla, 4) == ["num_attention_heads 6 is not divisible by 4"]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        tensor_parallel_problems(gqa, 0)


@pytest.mark.parametrize("mode", ["dspark", "dflash"])
def test_flex_block_mask_equals_dense_mask(target, mode):
    """The block-sparse training pass: flex attention's BlockMask (the CUDA path; eager on CPU) == dense SDPA mask."""
    d = make_drafter(target, block_size=4, mode=mode)
    x = torch.randint(2, 300, (2, 40)).to(device_of(target))
    with torch.no_grad():
        _, aux = target(x, aux_layer_ids=d.config.target_layer_ids)
    anchors = torch.tensor([[5, 17, 30], [1, 9, 33]], device=x.device)
    with torch.no_grad():  # flex attention has no CPU backward; the CUDA training path compiles it
        dense = d.train_forward(aux, x, anchors, flex=False)
        flex = d.train_forward(aux, x, anchors, flex=True)
    assert torch.allclose(dense, flex, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen3", "k3"])
def test_bf16_pair_drafts_with_the_confidence_head(kind):
    """Served in bf16 (as on a GPU), the whole draft step runs: the confidence head takes bf16 hidden states (a fp32
    cast here once broke every bf16 DSpark engine step) and the adaptive verification budget comes from it."""
    from dspark import Engine, SamplingParams
    from tests.test_drafter_k3 import make_k3_drafter

    t = make_target(kind, vocab=300).to(torch.bfloat16)
    d = (make_drafter(t) if kind == "qwen3" else make_k3_drafter(t)).to(torch.bfloat16)
    assert d.confidence_head is not None
    # one batch slot and the whole block pinned: on a GPU each step key is a capture (and new KDA kernel shapes a
    # Triton compile), and this test is about the confidence head, not the k policy
    engine = Engine(t, d, adaptive_verification=True, max_batch_size=1, num_speculative_tokens=d.config.num_drafts)
    out = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and out.num_steps >= 1
    h = torch.randn(2, d.config.hidden_size, dtype=torch.bfloat16, device=device_of(t))
    c = d.confidence(h, None)
    assert c.dtype == torch.float32 and c.shape == (2,)
