"""`python -m train` checks everything before any work and never deletes a run silently: an output_dir holding an
earlier run needs resume=true or overwrite=true, and a resume must keep the recipe the checkpoint was trained with."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from tests.test_train_drafter import recipe as drafter_recipe


def recipe(root: Path, out: str, **over) -> Path:
    """tests/test_train_drafter.py's drafter recipe, smaller: 3 steps, a checkpoint after every step."""
    small = {"max_steps": 3, "anchors_per_seq": 4, "optim": {"batch_size": 2, "warmup_steps": 1},
             "data": {"dataset": str(root / "data.jsonl"), "seq_len": 48, "regenerate": {"enabled": False},
                      "holdout_sequences": 2},
             "log": {"wandb_mode": "disabled", "eval_every": 3, "save_every": 1}}
    return drafter_recipe(root, out, **{**small, **over})


def train(path: Path, *extra: str, env: dict | None = None):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})}  # CPU runs; device=cuda means "no GPU" anywhere
    return subprocess.run([sys.executable, "-m", "train", str(path), *extra], capture_output=True, text=True,
                          timeout=300, env=env)


def one_line_error(res) -> str:
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), last
    return last


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


REGENERATE = {"dataset": "DATA", "seq_len": 48, "regenerate": {"enabled": True, "num_sequences": 4,
                                                                "prompt_tokens": 8, "new_tokens": 4}}


@pytest.mark.parametrize("extra, message", [
    ("output_dir={file}", r"output_dir: .*/a-file exists and is not a directory"),
    ("output_dir={file}/run", r"output_dir: .*/a-file/run cannot be created: .*/a-file is a file"),
    ("optim.batch_size=0", r"optim.batch_size: expected >= 1, got 0"),
    ("log.save_every=0", r"log.save_every: expected >= 1 \(steps\), got 0"),
    ("optim.lr=-1", r"optim.lr: expected a finite number > 0, got -1.0"),
    ("device=cuda", r"device: cuda, but torch sees no CUDA GPU here"),
    ("mixed_precision=fp16", r"mixed_precision: fp16 needs a CUDA GPU"),
])
def test_bad_values_stop_before_any_work(setup, extra, message):
    """With regeneration on, each bad value is one line before the target continues a single prompt."""
    (setup / "a-file").write_text("not a dir")
    data = {**REGENERATE, "dataset": str(setup / "data.jsonl")}
    res = train(recipe(setup, "bad", data=data), extra.format(file=setup / "a-file"))
    assert re.search(message, one_line_error(res))
    assert "regenerate" not in res.stderr and not (setup / "bad").exists()


def test_an_earlier_run_is_never_deleted_without_overwrite(setup):
    path = recipe(setup, "keep")
    assert train(path).returncode == 0
    out = setup / "keep"
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    err = one_line_error(train(path))
    assert "holds an earlier run (checkpoints, final, train_log.jsonl)" in err
    assert "resume=true" in err and "overwrite=true" in err
    assert snapshot(out) == before  # nothing deleted, nothing emptied
    old_final = load_file(str(out / "final" / "model.safetensors"))
    res = train(path, "overwrite=true", "seed=7", "max_steps=2")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "overwrite=true: deleted the earlier run's" in res.stderr
    steps = [json.loads(ln)["step"] for ln in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and (out / "notes.txt").read_text() == "mine"  # the new run only; other files kept
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]
    new_final = load_file(str(out / "final" / "model.safetensors"))
    assert any(not (old_final[k] == new_final[k]).all() for k in old_final)


def test_resume_must_keep_the_recipe_of_the_checkpoint(setup):
    path = recipe(setup, "sched", max_steps=4, log={"wandb_mode": "disabled", "eval_every": 4, "save_every": 2})
    killed = train(path, "max_steps=4")
    assert killed.returncode == 0
    for extra, field in ((("max_steps=6",), "max_steps is 6 but the checkpoint"),
                         (("optim.lr=0.01",), "optim.lr is 0.01 but the checkpoint"),
                         (("drafter.num_layers=2",), "drafter.num_layers is 2 but the checkpoint"),
                         (("drafter.target_layer_ids=[0]",), "drafter.target_layer_ids is [0] but the checkpoint")):
        err = one_line_error(train(path, "resume=true", *extra))
        assert "resume: " + field in err and "overwrite=true" in err, err
    res = train(path, "resume=true", "log.eval_every=1")  # run control may change
    assert res.returncode == 0 and "resumed from" in res.stderr, res.stderr[-2000:]


def test_resume_without_a_checkpoint_does_not_replace_a_finished_run(setup):
    path = recipe(setup, "done", log={"wandb_mode": "disabled", "eval_every": 3, "save_every": 100})
    assert train(path).returncode == 0
    assert not list((setup / "done").glob("checkpoints/step-*"))
    err = one_line_error(train(path, "resume=true"))
    assert "holds an earlier run (final, train_log.jsonl) but no complete checkpoint" in err


def test_the_global_batch_must_split_over_the_processes(setup):
    err = one_line_error(train(recipe(setup, "split"), env={"WORLD_SIZE": "3"}))
    assert "optim.batch_size: 2 does not split over the 3 data-parallel processes" in err


def test_target_model_fields_are_checked_before_the_corpus_is_built(tmp_path):
    r = {"kind": "target", "output_dir": str(tmp_path / "out"), "device": "cpu",
         "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                   "intermediate_size": 64},
         "data": {"corpus_dir": str(tmp_path / "corpus"), "tokenizer_dir": str(tmp_path / "tok")},
         "log": {"wandb_mode": "disabled"}}
    path = tmp_path / "t.yaml"
    for model, message in (({"num_experts": 4}, "model.num_experts: unknown field for arch qwen3; valid fields: "
                                                "hidden_size, num_layers"),
                           ({"intermediate_size": None}, "model: qwen3_config() missing 1 required positional "
                                                         "argument: 'intermediate_size'")):
        m = {k: v for k, v in {**r["model"], **model}.items() if v is not None}
        path.write_text(yaml.safe_dump({**r, "model": m}))
        assert message in one_line_error(train(path))
        assert not (tmp_path / "corpus").exists() and not (tmp_path / "tok").exists()


def test_a_checkpoint_without_a_recorded_recipe_still_fails_in_one_line(setup):
    """A checkpoint that recorded no recipe (written before checkpoints did) cannot be compared; a model that does
    not fit it is still one line naming the checkpoint, not a load_state_dict traceback."""
    path = recipe(setup, "legacy", log={"wandb_mode": "disabled", "eval_every": 3, "save_every": 1})
    assert train(path).returncode == 0
    for state in (setup / "legacy" / "checkpoints").glob("step-*/trainer_state.json"):
        s = json.loads(state.read_text())
        s.pop("recipe")
        state.write_text(json.dumps(s))
    err = one_line_error(train(path, "resume=true", "drafter.num_layers=2"))
    assert "resume: the checkpoint" in err and "does not fit this recipe's model or optimizer" in err
