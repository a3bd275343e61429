"""Bad checkpoints give one clear error naming what is wrong; saving is atomic."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.checkpoint import load_target, save_hf_dir
from dspark.models.qwen3 import Qwen3ForCausalLM, qwen3_config


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
        save_hf_dir(tmp_path / "out", {"a": 1}, Boom())
    assert list(tmp_path.iterdir()) == []
    save_hf_dir(tmp_path / "out", {"a": 1}, {"w": torch.ones(2)})
    save_hf_dir(tmp_path / "out", {"a": 2}, {"w": torch.zeros(2)})  # overwrite in place
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"a": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
