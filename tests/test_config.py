"""Recipes: validated dataclasses, one-line errors naming the field, dotted overrides, --help."""
import subprocess
import sys

import pytest
import yaml

from dspark.config import RecipeError, load_recipe

BASE = {"kind": "target", "output_dir": "/tmp/x", "model": {"hidden_size": 32}}


def write(tmp_path, data):
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_loads_with_defaults_and_overrides(tmp_path):
    r = load_recipe(write(tmp_path, BASE), ["max_steps=7", "optim.lr=0.01", "data.sources=[python_stdlib]",
                                            "resume=true"])
    assert (r.max_steps, r.optim.lr, r.data.sources, r.resume) == (7, 0.01, ["python_stdlib"], True)
    assert r.optim.batch_size == 16 and r.data.seq_len == 256
    assert load_recipe(write(tmp_path, BASE), ["mixed_precision=no"]).mixed_precision == "no"  # YAML's bare no
    assert load_recipe(write(tmp_path, BASE), ["optim.lr=3e-3"]).optim.lr == 0.003  # YAML 1.1: a string
    with pytest.raises(RecipeError, match="optim.lr: expected a number, got '3e-3x'"):
        load_recipe(write(tmp_path, BASE), ["optim.lr=3e-3x"])


def test_unknown_key_lists_valid_fields(tmp_path):
    with pytest.raises(RecipeError, match=r"optim\.lrate: unknown field; valid fields of optim: .*lr"):
        load_recipe(write(tmp_path, {**BASE, "optim": {"lrate": 1}}))
    with pytest.raises(RecipeError, match="max_stepz: unknown field; valid fields: .*max_steps"):
        load_recipe(write(tmp_path, BASE), ["max_stepz=3"])


def test_wrong_type_and_missing_field(tmp_path):
    with pytest.raises(RecipeError, match="max_steps: expected an integer, got 'ten'"):
        load_recipe(write(tmp_path, {**BASE, "max_steps": "ten"}))
    with pytest.raises(RecipeError, match="output_dir: required field is missing"):
        load_recipe(write(tmp_path, {"kind": "target"}))
    with pytest.raises(RecipeError, match="kind: expected one of"):
        load_recipe(write(tmp_path, {"output_dir": "x"}))
    with pytest.raises(RecipeError, match="log.wandb_mode: expected one of"):
        load_recipe(write(tmp_path, BASE), ["log.wandb_mode=sometimes"])
    with pytest.raises(RecipeError, match="expected key=value"):
        load_recipe(write(tmp_path, BASE), ["max_steps"])


def test_cli_help_and_one_line_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "optim:" in out.stdout and "seq_len" in out.stdout
    bad = write(tmp_path, {**BASE, "colour": "red"})
    out = subprocess.run([sys.executable, "-m", "train", str(bad)], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "colour: unknown field" in out.stderr


def test_every_shipped_recipe_validates():
    """The recipes in recipes/ (CPU quickstart to the real K3) parse and validate as they are shipped."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "recipes"
    paths = sorted(root.glob("*.yaml")) + sorted(root.glob("targets/*.yaml"))
    assert len(paths) >= 7
    kinds = {str(p.relative_to(root)): load_recipe(p).kind for p in paths}
    assert kinds["k3.yaml"] == kinds["k3-mini.yaml"] == "drafter" and kinds["targets/k3-mini.yaml"] == "target"
    assert load_recipe(root / "k3.yaml").target_sharding == "fsdp"
    from train.target import target_config

    for p in sorted(root.glob("targets/*.yaml")):  # the model fields too (checked before the corpus is built)
        r = load_recipe(p)
        assert target_config(r.arch, r.model, r.data.vocab_size).vocab_size == r.data.vocab_size


DRAFTER = {"kind": "drafter", "output_dir": "/tmp/x", "target": "/tmp/t"}


@pytest.mark.parametrize("base, override, message", [
    (BASE, "log.save_every=0", r"log.save_every: expected >= 1 \(steps\), got 0"),
    (BASE, "log.eval_every=0", r"log.eval_every: expected >= 1 \(steps\), got 0"),
    (BASE, "optim.batch_size=0", r"optim.batch_size: expected >= 1, got 0"),
    (BASE, "optim.lr=-1", r"optim.lr: expected a finite number > 0, got -1.0"),
    (BASE, "optim.lr=.nan", r"optim.lr: expected a finite number > 0, got nan"),
    (BASE, "optim.min_lr_ratio=2", r"optim.min_lr_ratio: expected a fraction in \[0, 1\], got 2.0"),
    (BASE, "optim.betas=[0.9]", r"optim.betas: expected two numbers in \[0, 1\), got \[0.9\]"),
    (BASE, "optim.grad_accum=0", r"optim.grad_accum: expected >= 1, got 0"),
    (BASE, "optim.optimizer=sgd", r"optim.optimizer: expected one of \['adamw', 'muon'\], got 'sgd'"),
    (BASE, "optim.muon_lr=0", r"optim.muon_lr: expected a finite number > 0, got 0.0"),
    (BASE, "optim.muon_momentum=1", r"optim.muon_momentum: expected a number in \[0, 1\), got 1.0"),
    (BASE, "optim.muon_ns_steps=0", r"optim.muon_ns_steps: expected >= 1, got 0"),
    (BASE, "optim.optimizer=muon", None),
    (BASE, "data.vocab_size=100", r"data.vocab_size: expected >= 261 \(the 256 byte tokens"),
    (BASE, "data.seq_len=4", r"data.seq_len: expected >= 8, got 4"),
    (BASE, "max_minutes=-1", r"max_minutes: expected >= 0.0 \(0: stop after the first step\), got -1.0"),
    (BASE, "max_minutes=0", None),
    (BASE, "num_threads=0", r"num_threads: expected >= 1, got 0"),
    (BASE, "device=gpu", r"device: expected one of \['auto', 'cpu', 'cuda'\], got 'gpu'"),
    (BASE, "overwrite=true", None),
    (DRAFTER, "drafter.block_size=0", r"drafter.block_size: expected >= 1 in dspark mode, got 0"),
    (DRAFTER, "drafter.mode=dflash", None),
    (DRAFTER, "drafter.target_layer_ids=[2,1]", r"drafter.target_layer_ids: expected strictly increasing"),
    (DRAFTER, "loss.decay_gamma=0", r"loss.decay_gamma: expected a finite number > 0, got 0.0"),
    (DRAFTER, "data.regenerate.new_tokens=0", r"data.regenerate.new_tokens: expected >= 1, got 0"),
    (DRAFTER, "data.regenerate.temperature=-1", r"data.regenerate.temperature: expected >= 0.0 \(0 = greedy\)"),
    (DRAFTER, "data.holdout_sequences=0", r"data.holdout_sequences: expected >= 1, got 0"),
    (DRAFTER, "data.corpus.seq_len=2", r"data.corpus.seq_len: expected >= 8, got 2"),
    (DRAFTER, "target=", r"target: expected the target checkpoint dir, got ''"),
])
def test_every_value_is_validated_at_load_time(tmp_path, base, override, message):
    """Values that used to pass and fail later (after the corpus or the regeneration step) are load-time errors
    naming the full field."""
    if message is None:  # valid on their own
        load_recipe(write(tmp_path, base), [override])
        return
    with pytest.raises(RecipeError, match=message):
        load_recipe(write(tmp_path, base), [override])


def test_mode_dependent_and_combined_checks(tmp_path):
    with pytest.raises(RecipeError, match=r"drafter.block_size: expected >= 2 in dflash mode, got 1"):
        load_recipe(write(tmp_path, DRAFTER), ["drafter.mode=dflash", "drafter.block_size=1"])
    with pytest.raises(RecipeError, match=r"loss.ce: expected > 0 when distill and kl are 0"):
        load_recipe(write(tmp_path, DRAFTER), ["loss.ce=0", "loss.distill=0"])
    with pytest.raises(RecipeError, match=r"resume, overwrite: choose one"):
        load_recipe(write(tmp_path, BASE), ["resume=true", "overwrite=true"])
