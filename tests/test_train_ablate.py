"""bench/ablate_drafter.py: rows trained on the same sequences with the same budget, one eval, one table."""
import json
import subprocess
import sys

import pytest
import torch
import yaml


def write_recipe(root):
    r = {"kind": "drafter", "output_dir": str(root / "unused"), "target": str(root / "target"), "max_steps": 2,
         "device": "cpu", "drafter": {"block_size": 3, "num_layers": 1, "markov_rank": 8},
         "data": {"dataset": str(root / "data.jsonl"), "seq_len": 64, "regenerate": {"enabled": False},
                  "holdout_sequences": 4},
         "anchors_per_seq": 4, "optim": {"batch_size": 2, "warmup_steps": 1},
         "log": {"wandb_mode": "disabled", "eval_every": 100, "save_every": 100}}
    p = root / "ablate.yaml"
    p.write_text(yaml.safe_dump(r))
    return p


def ablate(*args):
    return subprocess.run([sys.executable, "bench/ablate_drafter.py", *map(str, args)], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.timeout(900)  # five trainings and their evals, each a process: about 1 min on CPU, over 200 s on CUDA
def test_rows_share_sequences_and_budget_and_land_in_one_table(setup, tmp_path):
    recipe = write_recipe(setup)
    out = tmp_path / "abl"
    res = ablate(recipe, "--target", setup / "target", "--out", out, "--row", "base:", "--row",
                 "kl: loss.ce=0 loss.kl=1.0", "--row", "dflash: drafter.mode=dflash", "--set", "max_steps=3",
                 "--tasks", "humaneval,heldout_prose", "--num-prompts", "1", "--max-tokens", "8", "--threads", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((out / "ablation.json").read_text())
    rows = result["rows"]
    assert list(rows) == ["base", "kl", "dflash"] and result["dflash_row"] == "dflash"
    seqs = [torch.load(out / "rows" / n / "sequences.pt") for n in rows]
    assert all(torch.equal(s["train"], seqs[0]["train"]) for s in seqs[1:])  # the same data for every row
    for name, r in rows.items():
        m = json.loads((out / "rows" / name / "final_metrics.json").read_text())
        assert r["steps"] == m["steps"] == 3 and r["holdout_tau"] == m["final"]["tau"]
        assert r["holdout_tau_walked"] == m["final"]["tau_walked"] and 1 <= r["holdout_tau_walked"] <= 9
        assert set(r["tau"]) == {"humaneval", "heldout_prose"} and r["train_tokens_per_s"] > 0
        assert r["tau_over_holdout"]["humaneval"] == pytest.approx(r["tau"]["humaneval"] / r["holdout_tau"])
    assert rows["dflash"]["mode"] == "dflash" and "over_dflash" in rows["kl"] and "over_dflash" not in rows["dflash"]
    recipe_kl = json.loads((out / "rows" / "kl" / "recipe.json").read_text())
    assert recipe_kl["loss"]["kl"] == 1.0 and recipe_kl["loss"]["ce"] == 0.0 and recipe_kl["max_steps"] == 3
    md = (out / "ablation.md").read_text()
    assert "| kl | `loss.ce=0` `loss.kl=1.0` | 3 |" in md and "τ ÷ τ of the DFlash row (dflash)" in md
    again = ablate(recipe, "--target", setup / "target", "--out", out, "--row", "base:")
    assert again.returncode == 2 and "holds an earlier ablation" in again.stderr.strip().splitlines()[-1]
    before = (out / "rows" / "base" / "final_metrics.json").read_text()
    more = ablate(recipe, "--target", setup / "target", "--out", out, "--resume", "--row", "base:", "--row",
                  "tv: loss.confidence_target=tv", "--row", "longer: max_steps=4", "--row", "passes: data.order=passes",
                  "--set", "max_steps=3",
                  "--tasks", "humaneval", "--num-prompts", "1", "--max-tokens", "8", "--threads", "1")
    assert more.returncode == 0, more.stderr[-3000:]
    assert "base: trained before, kept" in more.stderr and (out / "rows" / "base" / "final_metrics.json").read_text() \
        == before  # kept, not trained again
    rows = json.loads((out / "ablation.json").read_text())["rows"]
    assert list(rows) == ["base", "tv", "longer", "passes"] and rows["longer"]["steps"] == 4 and \
        set(rows["tv"]["tau"]) == {"humaneval"}
    # data.order changes which sequences a step draws, not the sequences: the row starts from the shared ones
    cmd = next(ln for ln in more.stderr.splitlines() if ln.startswith("[ablate] passes:") and "-m train" in ln)
    assert "data.order=passes" in cmd and cmd.endswith("resume=true")  # resume=true: the shared sequences read back
    assert json.loads((out / "rows" / "passes" / "recipe.json").read_text())["data"]["order"] == "passes"


def test_a_bad_row_stops_before_any_training(setup, tmp_path):
    res = ablate(write_recipe(setup), "--target", setup / "target", "--out", tmp_path / "x", "--row",
                 "bad: loss.confidence_target=soft")
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and last.startswith("ablate_drafter: error: row bad: loss.confidence_target"), last
    assert not (tmp_path / "x").exists()
