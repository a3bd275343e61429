"""speculators' DSpark checkpoints (written by speculators' own classes) in our drafter: the same logits, Markov bias
and confidence as speculators' model on the same target features, exact conversion both ways, lossless decoding in
our engine, and a clear error for every mode our drafter cannot reproduce."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from speculators.config import SpeculatorsConfig, VerifierConfig  # a dev dependency (the Makefile installs it)
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import Qwen3Config

from bench.peer_speculators import parse_args, speculators_args, table
from bench.speculators_parity import max_diffs
from dspark.checkpoint import convert, export_drafter, load_drafter, load_target, main
from dspark.engine import Engine
from dspark.models.drafter import DrafterConfig, DSparkDrafter
from dspark.models.qwen3 import Qwen3ForCausalLM, qwen3_config
from dspark.request import SamplingParams
from tests.targets import add_tokenizer
from tests.test_engine import reference_greedy

VOCAB, HIDDEN, LAYERS, BLOCK = 300, 64, 4, 4
AUX_HF = [1, 3]  # speculators' ids (HF hidden_states indices) = our after-layer ids [0, 2] + 1


def speculator(target_dir, attn="sdpa", **over) -> DSparkDraftModel:
    """A tiny DSpark speculator built by speculators' own config and model classes, every weight random (norms too,
    so a swapped or skipped norm shows), the embedding and LM head loaded from the target dir as speculators does."""
    tl = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, layer_types=["full_attention"] * 2,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    tl._attn_implementation = attn
    fields = dict(draft_vocab_size=VOCAB, block_size=BLOCK, aux_hidden_state_layer_ids=AUX_HF, mask_token_id=2,
                  markov_rank=8, sample_from_anchor=True, enable_confidence_head=True,
                  confidence_head_with_markov=True)
    fields.update(over)
    cfg = DSparkSpeculatorConfig(
        transformer_layer_config=tl, **fields,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK)],
            verifier=VerifierConfig.from_pretrained(str(target_dir))))
    torch.manual_seed(7)
    model = DSparkDraftModel(cfg)
    model.load_verifier_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(target dir, speculators DSpark dir written by save_pretrained, the in-memory speculator)."""
    root = tmp_path_factory.mktemp("spec")
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(qwen3_config(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4,
                                           num_kv_heads=2, head_dim=16, intermediate_size=96,
                                           max_position_embeddings=512))
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # sharper greedy continuations
    target.save_pretrained(root / "target")
    add_tokenizer(root / "target", VOCAB)  # `<|mask|>` is id 2
    model = speculator(root / "target")
    model.save_pretrained(str(root / "spec"))
    return root / "target", root / "spec", model


def compare(target_dir, spec_dir, model, dtype=torch.float32, seed=0):
    """-> max abs diffs (logits, confidence logits, Markov bias) between speculators' model and ours on one random
    sequence of 32 tokens, in `dtype` (the passes bench/speculators_parity.py runs on trained checkpoints)."""
    target = load_target(target_dir)
    drafter = load_drafter(spec_dir, target, dtype=dtype)
    x = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(seed))
    d = max_diffs(model.to(dtype), drafter, target, x, dtype)
    return d["logits"], d["confidence"], d["markov_bias"]


def test_speculators_checkpoint_gives_speculators_logits_fp32(dirs):
    target_dir, spec_dir, model = dirs
    logits, conf, bias = compare(target_dir, spec_dir, model)
    assert bias < 1e-6 and logits < 1e-4 and conf < 1e-5, (logits, conf, bias)


def test_speculators_checkpoint_gives_speculators_logits_bf16(dirs):
    """bf16 on both sides: the two implementations round differently (e.g. our fused RMSNorm), so only close."""
    target_dir, spec_dir, model = dirs
    logits, conf, bias = compare(target_dir, spec_dir, speculator(target_dir), dtype=torch.bfloat16)
    assert logits < 0.25 and conf < 0.05 and bias < 0.02, (logits, conf, bias)


def test_aux_ids_are_hf_hidden_state_indices(dirs):
    """speculators' ids count like HF `hidden_states` (j = the output of layer j-1) = our after-layer id + 1; at
    j = num_layers vLLM (which writes speculators' features) captures the last layer before the final norm, which
    is what our target returns after layer num_layers-1 (HF's hidden_states[-1] has the norm applied)."""
    from transformers import Qwen3ForCausalLM as HFQwen3

    target_dir = dirs[0]
    ours = load_target(target_dir)
    hf = HFQwen3.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    x = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = hf(x, output_hidden_states=True).hidden_states
        _, aux = ours(x, aux_layer_ids=list(range(LAYERS)))
    after = aux.view(1, 12, LAYERS, HIDDEN)
    for j in range(1, LAYERS):
        torch.testing.assert_close(hs[j], after[:, :, j - 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(hs[LAYERS], ours.model.norm(after[:, :, LAYERS - 1]), rtol=0, atol=1e-5)
    assert load_drafter(dirs[1], ours).config.target_layer_ids == [j - 1 for j in AUX_HF]


def _state(path):
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("mode", ["dspark", "dflash"])
def test_round_trip_ours_speculators_ours_is_exact(dirs, tmp_path, mode):
    """dspark: anchor-as-first with both heads; dflash: the 1+N block without heads (speculators' DSpark with
    sample_from_anchor false and no heads)."""
    target_dir = dirs[0]
    target = load_target(target_dir)
    heads = dict(markov_rank=8, confidence_head_with_markov=True) if mode == "dspark" else dict(
        mode="dflash", markov_rank=0, enable_confidence_head=False)
    cfg = DrafterConfig(vocab_size=VOCAB, hidden_size=HIDDEN, target_hidden_size=HIDDEN, target_layer_ids=[1, 3],
                        num_target_layers=LAYERS, mask_token_id=2, block_size=BLOCK, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                        max_position_embeddings=512, **heads)
    torch.manual_seed(3)
    drafter = DSparkDrafter(cfg, target.model.embed_tokens.weight, target.lm_head.weight)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))  # the Markov w2 starts at zero: make every tensor count
    export_drafter(drafter, tmp_path / "ours", layout=mode)
    assert convert(tmp_path / "ours", target_dir, tmp_path / "spec") == "speculators"
    assert convert(tmp_path / "spec", target_dir, tmp_path / "back") == mode
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == \
        json.loads((tmp_path / "ours" / "config.json").read_text())
    a, b = _state(tmp_path / "ours"), _state(tmp_path / "back")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # speculators' own loader reads the converted dir: every saved weight is ours, the ids shifted by one
    spec = DSparkDraftModel.from_pretrained(str(tmp_path / "spec"))
    assert spec.config.aux_hidden_state_layer_ids == [2, 4]
    assert spec.config.sample_from_anchor == (mode == "dspark") and (spec.markov_head is None) == (mode == "dflash")
    sd = spec.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in a.items())
    torch.testing.assert_close(sd["embed_tokens.weight"], target.model.embed_tokens.weight, rtol=0, atol=0)


def test_speculators_to_ours_to_speculators_keeps_weights_and_fields(dirs, tmp_path):
    target_dir, spec_dir, _ = dirs
    convert(spec_dir, target_dir, tmp_path / "ours")
    convert(tmp_path / "ours", target_dir, tmp_path / "spec")
    a, b = _state(spec_dir), _state(tmp_path / "spec")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    src, out = (json.loads((d / "config.json").read_text()) for d in (spec_dir, tmp_path / "spec"))
    for k in ("speculators_model_type", "block_size", "aux_hidden_state_layer_ids", "mask_token_id", "markov_rank",
              "markov_head_type", "sample_from_anchor", "enable_confidence_head", "confidence_head_with_markov",
              "draft_vocab_size"):
        assert out[k] == src[k], k
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rms_norm_eps", "rope_parameters", "layer_types"):
        assert out["transformer_layer_config"][k] == src["transformer_layer_config"][k], k


def test_converted_drafter_is_lossless_in_the_engine(dirs, tmp_path):
    """Greedy speculative decoding with the speculators drafter (loaded directly, and converted to our layout)
    emits exactly the target's own greedy continuation."""
    target_dir, spec_dir, _ = dirs
    target = load_target(target_dir)
    convert(spec_dir, target_dir, tmp_path / "ours")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 17)]
    refs = [reference_greedy(target, p, 20) for p in prompts]
    for d in (spec_dir, tmp_path / "ours"):
        drafter = load_drafter(d, target)
        outs = Engine(target, drafter, max_batch_size=3, graphs=False).generate(prompts, SamplingParams(max_tokens=20))
        assert [o.token_ids for o in outs] == refs
        assert all(o.num_steps <= 20 for o in outs)


def _edited(spec_dir, tmp_path, edit):
    d = tmp_path / "edited"
    shutil.copytree(spec_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _sliding(cfg):
    cfg["transformer_layer_config"].update(layer_types=["sliding_attention", "full_attention"], sliding_window=64,
                                           use_sliding_window=True)


@pytest.mark.parametrize("edit, message", [
    (_sliding, r"transformer_layer_config.layer_types: draft layers \[0\] are sliding_attention \(sliding_window 64\)"
               r".*causally inside the block"),
    (lambda c: c.update(draft_vocab_size=100), "draft_vocab_size 100 != transformer_layer_config.vocab_size 300"),
    (lambda c: c.update(markov_head_type="gated"), "markov_head_type 'gated'"),
    (lambda c: c.update(aux_hidden_state_layer_ids=[0, 3]), "aux_hidden_state_layer_ids: .* id 0, the embedding"),
    (lambda c: c.update(aux_hidden_state_layer_ids=[1, 5]),
     r"aux_hidden_state_layer_ids \[5\] out of range for the target's 4 layers \(valid 1..4\)"),
    (lambda c: c.update(sample_from_anchor=False), "sample_from_anchor false .* Markov or confidence head"),
    (lambda c: c["transformer_layer_config"].update(model_type="llama"), "transformer_layer_config.model_type 'llama'"),
    (lambda c: c["transformer_layer_config"].update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                                     "factor": 2.0}), "rope_type 'yarn'"),
    (lambda c: c.update(speculators_model_type="eagle3"), "speculators_model_type 'eagle3'"),
    (lambda c: c.pop("mask_token_id"), "mask_token_id: required"),
])
def test_unsupported_modes_are_refused_naming_the_field(dirs, tmp_path, edit, message):
    target_dir, spec_dir, _ = dirs
    bad = _edited(spec_dir, tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load_drafter(bad, load_target(target_dir))
    with pytest.raises(ValueError, match=message):
        convert(bad, target_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_reduced_vocab_tensors_are_refused(dirs, tmp_path):
    from safetensors.torch import save_file

    target_dir, spec_dir, _ = dirs
    bad = _edited(spec_dir, tmp_path, lambda c: None)
    state = _state(bad)
    state["d2t"] = torch.zeros(VOCAB, dtype=torch.long)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensors \['d2t'\] belong to a reduced draft vocabulary"):
        convert(bad, target_dir, tmp_path / "out")


def test_cli_convert(dirs, tmp_path, capsys):
    target_dir, spec_dir, _ = dirs
    out = tmp_path / "ours"
    assert main(["convert", str(spec_dir), "--target", str(target_dir), "--out", str(out)]) == 0
    assert "vLLM Qwen3DSparkModel layout" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    assert main(["convert", str(spec_dir), "--target", str(target_dir), "--out", str(out)]) == 2  # exists
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out") and "--overwrite" in err and "\n" not in err
    assert main(["convert", str(spec_dir), "--target", str(target_dir), "--out", str(out), "--overwrite"]) == 0
    assert main(["check", str(out), "--target", str(target_dir)]) == 0
    assert main(["check", str(spec_dir), "--target", str(target_dir), "--tensor-parallel-size", "2"]) == 0


def test_peer_table_compares_each_of_ours_with_speculators_on_the_same_prompts():
    """bench/peer_speculators.py's table: per task the ratio of each of our drafters' τ to each speculators row's,
    with its paired CI from the prompts' steps (a drafter committing more tokens on every prompt: CI above 1)."""
    pp = lambda committed: {"steps": [10, 12, 9], "committed": committed}  # noqa: E731
    rows = {name: {"tau": {"code": sum(c) / 31}, "per_prompt": {"code": pp(c)}, "tau_overall": sum(c) / 31,
                   "steady_tok_s": 1.0, "e2e_s": 1.0, "peak_alloc_gib": 1.0}
            for name, c in (("ours", [24, 31, 20]), ("speculators-muon", [20, 30, 18]))}
    text = table({"rows": rows, "regenerate_s": 1.0, "export_s": 1.0, "tokens_per_step": 8, "device": "cpu"})
    line = next(x for x in text.splitlines() if x.startswith("- ours ÷ speculators-muon"))
    ratio, lo, hi = (float(v) for v in line.split(": ")[1].replace("[", "").replace("]", "").replace(",", "").split())
    assert ratio == pytest.approx(75 / 68, abs=1e-3) and 1.0 < lo <= ratio <= hi


def test_peer_table_adds_the_mean_of_rows_that_differ_by_seed_alone():
    """Rows named NAME and NAME-sSEED (an --ours-row with seed=SEED, --spec-seeds) get one more table row: their mean
    τ per task and over all; a row of one seed gets none."""
    pp = {"steps": [10], "committed": [20]}
    rows = {name: {"tau": {"code": tau, "prose": tau + 1}, "per_prompt": {"code": pp, "prose": pp},
                   "tau_overall": tau + 0.5, "steady_tok_s": 1.0, "e2e_s": 1.0, "peak_alloc_gib": 1.0}
            for name, tau in (("ours", 2.0), ("ours-s2", 2.5), ("speculators-muon", 2.2))}
    text = table({"rows": rows, "regenerate_s": 1.0, "export_s": 1.0, "tokens_per_step": 8, "device": "cpu"})
    means = [x for x in text.splitlines() if "mean of" in x]
    assert means == ["| ours, mean of 2 seeds | 2.25 | 3.25 | 2.75 |  |  |  |"]


def test_speculators_rows_train_with_their_seed(tmp_path):
    """--spec-seeds: each speculators row's own seed reaches speculators.train (--seed), not the bench's --seed."""
    a = parse_args(["--target", "T", "--out", str(tmp_path), "--seed", "1", "--spec-seeds", "1,2"])
    data = {"max_seq_len": 256, "train_rows": 64, "train_data_ratio": 0.9, "speculators_target_layer_ids": [2, 3]}
    args = speculators_args(a, tmp_path, "speculators-muon-s2", "muon", data, 5, False, 2)
    assert args[args.index("--seed") + 1] == "2" and str(tmp_path / "speculators-muon-s2" / "ckpt") in args
