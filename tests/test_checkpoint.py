"""Checkpoints: one clear error naming what is wrong, atomic saves, sharded reads, drafter config.json in each of
vLLM's forms (resolved in vLLM's order), and `python -m dspark.checkpoint check`."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.checkpoint import export_drafter, load_drafter, load_target, main
from dspark.checkpoint_io import read_config, save_checkpoint_dir
from dspark.drafter_json import resolve_mask_token_id, resolve_target_layer_ids
from dspark.engine import Engine
from dspark.models.qwen3 import Qwen3ForCausalLM, qwen3_config
from dspark.request import SamplingParams
from tests.targets import add_tokenizer, device_of, make_target
from tests.test_engine import make_drafter, reference_greedy


@pytest.fixture()
def ckpt(tmp_path):
    cfg = qwen3_config(vocab_size=40, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                       intermediate_size=48)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "ck")
    return tmp_path / "ck"


def test_missing_dir_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_target(tmp_path / "empty")


def test_corrupt_weights(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_target(ckpt)


def test_corrupt_config(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_target(ckpt)


def test_unknown_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        load_target(ckpt)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("model.norm.weight"), "missing tensor 'model.norm.weight'"),
    (lambda s: s.__setitem__("model.extra.weight", torch.zeros(2)), "unexpected tensor 'model.extra.weight'"),
    (lambda s: s.__setitem__("model.norm.weight", torch.zeros(31)), r"'model.norm.weight' has shape \(31,\), expected \(32,\)"),
])
def test_strict_tensor_names_and_shapes(ckpt, edit, message):
    state = load_file(str(ckpt / "model.safetensors"))
    edit(state)
    save_file(state, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        load_target(ckpt)


def test_atomic_save_leaves_nothing_on_failure(tmp_path):
    class Boom(dict):
        def items(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_checkpoint_dir(tmp_path / "out", {"a": 1}, Boom())
    assert list(tmp_path.iterdir()) == []
    save_checkpoint_dir(tmp_path / "out", {"a": 1}, {"w": torch.ones(2)})
    save_checkpoint_dir(tmp_path / "out", {"a": 2}, {"w": torch.zeros(2)})  # overwrite in place
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"a": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --------------------------------------------------------------------------- drafter config.json forms (vLLM's order)
@pytest.fixture(scope="module")
def qwen3_target():
    t = make_target("qwen3", vocab=300)  # 3 layers
    t.tokenizer = None
    return t


def _rewrite(d: Path, drop=(), **changes) -> dict:
    cfg = json.loads((d / "config.json").read_text())
    for k in drop:
        cfg.pop(k, None)
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return cfg


def _same_drafts(a, b, target):
    dev = device_of(target)
    x = torch.randint(3, 300, (1, 14), generator=torch.Generator().manual_seed(0)).to(dev)
    with torch.no_grad():
        _, aux = target(x, aux_layer_ids=a.config.target_layer_ids)
        anchors = torch.tensor([[4, 9]], device=dev)
        return torch.equal(a.train_forward(aux, x, anchors), b.train_forward(aux, x, anchors))


# our after-layer ids [0, 2] (vLLM aux ids [1, 3]) and mask 1, in each place vLLM reads them
ID_FORMS = {
    "target_layer_ids": {"target_layer_ids": [0, 2]},
    "dflash_config.target_layer_ids": {"dflash_config": {"mask_token_id": 1, "target_layer_ids": [0, 2]}},
    "eagle_aux_hidden_state_layer_ids": {"eagle_aux_hidden_state_layer_ids": [1, 3]},
    "dspark_target_layer_ids": {"dspark_target_layer_ids": [0, 2]},
    "dflash_config.layer_ids": {"dflash_config": {"layer_ids": [1, 3]}},
    "eagle_config.layer_ids": {"eagle_config": {"layer_ids": [1, 3]}},
}
MASK_FORMS = ["mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id"]


@pytest.mark.parametrize("layout", ["dspark", "dflash"])
@pytest.mark.parametrize("form", list(ID_FORMS))
def test_every_vllm_config_form_loads_the_same_drafter(qwen3_target, tmp_path, layout, form):
    """An exported drafter whose ids / mask are moved to each field vLLM reads loads as the same drafter (same
    config, same drafts): e.g. a Qwen3DSparkModel with dflash_config {mask_token_id, target_layer_ids}."""
    d = make_drafter(qwen3_target, mode=layout)
    out = export_drafter(d, tmp_path / "d", layout=layout)
    mask_field = MASK_FORMS[list(ID_FORMS).index(form) % len(MASK_FORMS)]
    fields = dict(ID_FORMS[form])
    if "mask_token_id" not in fields.get("dflash_config", {}):
        fields[mask_field] = 1
    _rewrite(out, drop=("target_layer_ids", "mask_token_id", "dflash_config"), **fields)
    loaded = load_drafter(out, qwen3_target)
    assert loaded.config == d.config and _same_drafts(d, loaded, qwen3_target)


def test_the_first_field_vllm_reads_wins(qwen3_target, tmp_path):
    """Several forms at once: the one vLLM reads first is used (a lower-priority field with other ids is ignored)."""
    d = make_drafter(qwen3_target)
    out = export_drafter(d, tmp_path / "d")
    _rewrite(out, target_layer_ids=[0, 1], mask_token_id=7, dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 2]})
    loaded = load_drafter(out, qwen3_target)
    assert loaded.config.target_layer_ids == [0, 2] and loaded.config.mask_token_id == 1
    assert _same_drafts(d, loaded, qwen3_target)


def test_resolution_order_matches_vllm():
    ids = {"eagle_aux_hidden_state_layer_ids": [2, 3], "dflash_config": {"target_layer_ids": [0], "layer_ids": [5]},
           "dspark_target_layer_ids": [4], "target_layer_ids": [6], "eagle_config": {"layer_ids": [9]}}
    order = [("eagle_aux_hidden_state_layer_ids", [1, 2]), ("dflash_config.target_layer_ids", [0]),
             ("dspark_target_layer_ids", [4]), ("target_layer_ids", [6]), ("dflash_config.layer_ids", [4]),
             ("eagle_config.layer_ids", [8])]
    for field, want in order:
        assert resolve_target_layer_ids(ids, "c") == (want, field)
        head, _, tail = field.partition(".")
        if tail:
            ids[head] = {k: v for k, v in ids[head].items() if k != tail}
        else:
            ids[head] = []  # an empty list is skipped like an absent one
    mask = {"dflash_config": {"mask_token_id": 1}, "mask_token_id": 0, "dspark_noise_token_id": 3, "pard_token": 4,
            "ptd_token_id": 5}
    for field, want in [("dflash_config.mask_token_id", 1), ("mask_token_id", 0), ("dspark_noise_token_id", 3),
                        ("pard_token", 4), ("ptd_token_id", 5)]:
        assert resolve_mask_token_id(mask, "c") == (want, field)  # 0 is a mask id, not "absent"
        head, _, tail = field.partition(".")
        mask.pop(head) if not tail else mask[head].pop(tail)


def test_export_writes_the_form_vllm_reads_first(qwen3_target, tmp_path):
    """Each exported id / mask field is the one vLLM resolves to; nothing of higher priority sits beside it."""
    for layout, ids_field, mask_field in [("dspark", "target_layer_ids", "mask_token_id"),
                                          ("dflash", "dflash_config.target_layer_ids", "dflash_config.mask_token_id")]:
        cfg = read_config(export_drafter(make_drafter(qwen3_target, mode=layout), tmp_path / layout, layout=layout))
        assert resolve_target_layer_ids(cfg, "c") == ([0, 2], ids_field)
        assert resolve_mask_token_id(cfg, "c") == (1, mask_field)
        assert "eagle_aux_hidden_state_layer_ids" not in cfg and "dspark_target_layer_ids" not in cfg
        assert cfg.get("sample_from_anchor", False) is (layout == "dspark") and "dspark_bonus_anchor" not in cfg


def test_sample_from_anchor_picks_the_query_layout(qwen3_target, tmp_path):
    """Qwen3DSparkModel with sample_from_anchor false (dspark_bonus_anchor true) and no heads is the 1+N fill-in
    drafter (our dflash mode); DFlashDraftModel with dflash_config.sample_from_anchor true is anchor-as-first."""
    fill_in = make_drafter(qwen3_target, mode="dflash")
    out = export_drafter(fill_in, tmp_path / "a", layout="dflash")
    _rewrite(out, drop=("dflash_config",), architectures=["Qwen3DSparkModel"], target_layer_ids=[0, 2],
             mask_token_id=1, markov_rank=0, sample_from_anchor=False, dspark_bonus_anchor=True)
    loaded = load_drafter(out, qwen3_target)
    assert loaded.config.mode == "dflash" and loaded.config == fill_in.config and _same_drafts(fill_in, loaded,
                                                                                               qwen3_target)
    out = export_drafter(fill_in, tmp_path / "b", layout="dflash")
    _rewrite(out, dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 2], "sample_from_anchor": True})
    loaded = load_drafter(out, qwen3_target)
    assert loaded.config.mode == "dspark" and loaded.config.num_drafts == 4 and loaded.config.markov_rank == 0


@pytest.mark.parametrize("changes, message", [
    ({"dspark_bonus_anchor": True}, r"dspark_bonus_anchor True contradicts sample_from_anchor True"),
    ({"sample_from_anchor": False}, r"sample_from_anchor false \(the 1\+N fill-in block\) with a Markov"),
    ({"sample_from_anchor": "yes"}, r"sample_from_anchor: expected true or false, got 'yes'"),
    ({"draft_vocab_size": 200}, r"draft_vocab_size 200 != vocab_size 300"),
    ({"eagle_aux_hidden_state_layer_ids": [0, 2]}, r"eagle_aux_hidden_state_layer_ids: \[0, 2\] .*aux id 0 is the "
                                                   r"embedding"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 9]}, r"eagle_aux_hidden_state_layer_ids \[9\] out of range .*valid "
                                                   r"1\.\.3"),
    ({"dflash_config": {"target_layer_ids": [2, 0]}}, r"dflash_config.target_layer_ids: \[2, 0\] must be strictly "
                                                      r"increasing"),
    ({"dflash_config": [1]}, r"dflash_config: expected a mapping"),
    ({"mask_token_id": "1"}, r"mask_token_id: expected an integer, got '1'"),
    ({"mask_token_id": None}, r"no mask token id; expected one of dflash_config.mask_token_id, mask_token_id"),
    ({"dflash_config": {"mask_token_id": 300}}, r"dflash_config.mask_token_id 300 is outside the target vocabulary"),
    ({"target_layer_ids": []}, r"no target layer ids; expected one of eagle_aux_hidden_state_layer_ids"),
    ({"use_aux_hidden_state": False}, r"use_aux_hidden_state false"),
])
def test_config_form_errors_name_the_field(qwen3_target, tmp_path, changes, message):
    out = export_drafter(make_drafter(qwen3_target), tmp_path / "d")
    _rewrite(out, **changes)
    with pytest.raises(ValueError, match=message):
        load_drafter(out, qwen3_target)


def test_speculative_greedy_with_a_dflash_config_form_drafter_equals_plain_greedy(qwen3_target, tmp_path):
    """The form the issue met (Qwen3DSparkModel + dflash_config) drives the engine losslessly."""
    out = export_drafter(make_drafter(qwen3_target), tmp_path / "d")
    _rewrite(out, drop=("target_layer_ids", "mask_token_id"),
             dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 2]})
    engine = Engine(qwen3_target, load_drafter(out, qwen3_target), num_speculative_tokens=4)
    prompt = [5, 17, 42, 8, 99, 23]
    got = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].token_ids
    assert got == reference_greedy(qwen3_target, prompt, 12)


# --------------------------------------------------------------------------- sharded reads, `check`
def shard(d: Path, n: int = 2) -> None:
    """Rewrite d/model.safetensors as n shards + model.safetensors.index.json (the HF sharded layout)."""
    state = load_file(str(d / "model.safetensors"))
    names = sorted(state)
    weight_map = {}
    for i in range(n):
        part = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: state[k] for k in names[i::n]}, str(d / part))
        weight_map.update({k: part for k in names[i::n]})
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_target_and_drafter_load_like_single_files(ckpt, qwen3_target, tmp_path):
    ids = torch.randint(0, 40, (1, 7))
    ref = load_target(ckpt)
    shard(ckpt, 3)
    got = load_target(ckpt)
    with torch.no_grad():
        assert torch.equal(ref(ids), got(ids))
    d = make_drafter(qwen3_target)
    out = export_drafter(d, tmp_path / "d")
    shard(out)
    assert _same_drafts(d, load_drafter(out, qwen3_target), qwen3_target)


def test_sharded_read_errors_name_the_file(ckpt):
    shard(ckpt)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002.safetensors: shard listed in "
                                                r"model.safetensors.index.json is missing"):
        load_target(ckpt)
    (ckpt / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: not a safetensors index"):
        load_target(ckpt)


def test_saving_over_a_sharded_dir_replaces_it_whole(ckpt):
    """A save replaces the whole dir: a stale index (and its shards) from an earlier save cannot shadow the new
    weights."""
    shard(ckpt)
    cfg = qwen3_config(vocab_size=40, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                       intermediate_size=48)
    torch.manual_seed(5)
    new = Qwen3ForCausalLM(cfg)
    new.save_pretrained(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "model.safetensors"]
    ids = torch.randint(0, 40, (1, 7))
    with torch.no_grad():
        assert torch.equal(load_target(ckpt)(ids), new(ids))


@pytest.fixture()
def pair(qwen3_target, tmp_path):
    """A saved target (with a tokenizer whose mask is id 2) and a drafter exported for it."""
    qwen3_target.save_pretrained(tmp_path / "t")
    add_tokenizer(tmp_path / "t")
    out = export_drafter(make_drafter(qwen3_target), tmp_path / "d")
    _rewrite(out, mask_token_id=2)
    return tmp_path / "t", out


def test_check_flags_non_finite_weights(pair, capsys):
    t, d = pair
    assert main(["check", str(d), "--target", str(t)]) == 0
    state = load_file(str(d / "model.safetensors"))
    state["layers.0.mlp.up_proj.weight"][3, :2] = torch.tensor([float("nan"), float("inf")])
    save_file(state, str(d / "model.safetensors"))
    capsys.readouterr()
    assert main(["check", str(d), "--target", str(t)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "drafter tensor 'layers.0.mlp.up_proj.weight' has 2 non-finite values" in err


def test_check_flags_a_target_without_tokenizer(pair, capsys):
    t, d = pair
    (t / "tokenizer.json").unlink()
    assert main(["check", str(d), "--target", str(t)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the target has no tokenizer (tokenizer.json)" in err
