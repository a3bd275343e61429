"""Data parallel training: 2 gloo processes (torchrun, the same code path accelerate uses on GPUs) give the same
result as 1 process with the same global batch. The processes run on the CPU (recipe device: cpu), also where GPUs
are visible."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from dspark.data.corpus import build_corpus
from dspark.data.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    corpus = build_corpus(root / "corpus", sources=["python_stdlib"], max_bytes_per_source=1_500_000)
    import datasets

    texts = datasets.load_from_disk(str(corpus))["train"]["text"]
    train_tokenizer(texts, 512, root / "tok")
    return root


def _recipe(root: Path, **over) -> Path:
    r = {"kind": "target", "arch": "qwen3", "output_dir": str(root / "x"), "max_steps": 3, "device": "cpu",
         "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                   "intermediate_size": 128},
         "data": {"corpus_dir": str(root / "corpus"), "sources": ["python_stdlib"], "max_bytes_per_source": 1_500_000,
                  "tokenizer_dir": str(root / "tok"), "vocab_size": 512, "seq_len": 64, "holdout_tokens": 512},
         "optim": {"batch_size": 8, "warmup_steps": 1},
         "log": {"wandb_mode": "disabled", "eval_every": 3, "save_every": 100}}
    r.update(over)
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def _launch(nproc: int) -> list[str]:
    """The command that starts nproc gloo processes (torchrun), or one plain process."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] \
        if nproc > 1 else [sys.executable]


def _run_script(tmp_path: Path, name: str, code: str, nproc: int) -> subprocess.CompletedProcess:
    """Run a script of code on nproc processes (the repo on PYTHONPATH); asserts it exits 0."""
    script = tmp_path / name
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run(_launch(nproc) + [str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _run(nproc: int, recipe: Path, out: Path) -> dict:
    cmd = _launch(nproc) + ["-m", "train", str(recipe), f"output_dir={out}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return load_file(str(out / "final" / "model.safetensors"))


def test_two_gloo_processes_equal_one_process_target(data):
    recipe = _recipe(data)
    one = _run(1, recipe, data / "one")
    two = _run(2, recipe, data / "two")
    init = _run(1, _recipe(data, max_steps=1, optim={"batch_size": 8, "warmup_steps": 1, "lr": 1e-12}),
                data / "init")
    moved = max((one[k] - init[k]).abs().max().item() for k in one)
    diff = max((one[k] - two[k]).abs().max().item() for k in one)
    assert moved > 1e-3  # training changed the weights ...
    assert diff < 0.01 * moved  # ... and 2 processes changed them the same way as 1 (fp32 reduction order)


def _drafter_recipe(tmp_path: Path) -> dict:
    """A 3-step drafter recipe on a tiny random Qwen3 target and a local jsonl of real code (no regeneration)."""
    from tests.targets import write_tiny_target_and_data

    target, data_file = write_tiny_target_and_data(tmp_path)
    return {"kind": "drafter", "output_dir": str(tmp_path / "x"), "target": str(target), "max_steps": 3,
            "device": "cpu", "drafter": {"block_size": 3, "num_layers": 1, "markov_rank": 8},
            "data": {"dataset": str(data_file), "seq_len": 96, "regenerate": {"enabled": False},
                     "holdout_sequences": 4},
            "anchors_per_seq": 8, "optim": {"batch_size": 4, "warmup_steps": 1},
            "log": {"wandb_mode": "disabled", "eval_every": 3, "save_every": 100}}


def _assert_two_processes_train_as_one(r: dict, recipe: Path, root: Path) -> None:
    """Recipe r (written at `recipe`) trained on 1 and on 2 processes (-> root/one, root/two) gives the same weights,
    within 1 % of how far training moved them from init (the same recipe at lr 1e-12)."""
    recipe.write_text(yaml.safe_dump(r))
    one, two = _run(1, recipe, root / "one"), _run(2, recipe, root / "two")
    recipe.write_text(yaml.safe_dump({**r, "optim": {**r["optim"], "lr": 1e-12}}))
    init = _run(1, recipe, root / "init")
    moved = max((one[k] - init[k]).abs().max().item() for k in one)
    diff = max((one[k] - two[k]).abs().max().item() for k in one)
    assert moved > 1e-3 and diff < 0.01 * moved


def test_two_gloo_processes_equal_one_process_drafter(tmp_path):
    """The drafter trainer too: rows and anchors are drawn per global batch and sliced per process."""
    r = _drafter_recipe(tmp_path)
    _assert_two_processes_train_as_one(r, tmp_path / "drafter.yaml", tmp_path)
    # the per-step loss curve (train_log.jsonl: the loss of the global batch, averaged over processes) is the same
    curves = [[json.loads(ln) for ln in (tmp_path / n / "train_log.jsonl").read_text().splitlines()] for n in ("one", "two")]
    assert [c["step"] for c in curves[0]] == [c["step"] for c in curves[1]] == [1, 2, 3]
    for a, b in zip(*curves):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, abs(a["loss"]))
    assert len({round(c["loss"], 6) for c in curves[0]}) == 3  # the loss moves: the curve is not a constant
    summary = json.loads((tmp_path / "two" / "final_metrics.json").read_text())
    assert summary["num_processes"] == 2 and summary["block_mask"] == "dense"  # CPU: the SDPA mask
    # the comparison the GPU run reports (bench/ddp_compare.py) reads the same logs
    res = subprocess.run([sys.executable, "bench/ddp_compare.py", str(tmp_path / "one"), str(tmp_path / "two"),
                          "--every", "1", "--skip", "0"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "| 3 |" in res.stdout and "loss, 2 GPUs" in res.stdout and "relative loss difference max" in res.stdout


def test_two_gloo_processes_equal_one_process_with_rejection_anchors(tmp_path):
    """anchors=rejection: each process trains half the blocks, but every process records the decode starts of the
    whole global batch (the accepted lengths are gathered), so the anchors drawn later, and the model, are those of
    one process (8 steps over 36 rows: rows come back with recorded starts)."""
    r = _drafter_recipe(tmp_path)
    r.update(max_steps=8, anchors="rejection", rejection_share=1.0, anchors_per_seq=4)
    _assert_two_processes_train_as_one(r, tmp_path / "drafter.yaml", tmp_path)


def test_processes_regenerate_a_part_each_and_hold_the_same_sequences(tmp_path):
    """Regeneration is split over the data-parallel processes (prompts[rank::world]) and put back in order: 2 gloo
    processes write the same sequences as 1, each continued half of the prompts, and the parts are cleaned up."""
    r = _drafter_recipe(tmp_path)
    r["max_steps"] = 1
    r["data"]["regenerate"] = {"enabled": True, "num_sequences": 6, "prompt_tokens": [8, 12], "new_tokens": 5}
    recipe = tmp_path / "drafter.yaml"
    recipe.write_text(yaml.safe_dump(r))
    runs = {}
    for n in (1, 2):
        res = subprocess.run(_launch(n) + ["-m", "train", str(recipe), f"output_dir={tmp_path / str(n)}"],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        runs[n] = res.stderr
    import torch

    one, two = (torch.load(tmp_path / n / "sequences.pt") for n in ("1", "2"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert one["train"].shape[0] == 6 and one["train_mask"].sum(1).tolist() == [5] * 6  # 5 new tokens each
    assert "process 1 of 2 continued 3 of the 6 train prompts" in runs[2]
    assert "process 0 of 2" not in runs[1] and not list((tmp_path / "2").glob("regenerated-*"))


def test_fsdp_sharded_target_equals_the_whole_target(tmp_path):
    """target_sharding=fsdp: 2 processes each holding half of the frozen target (FSDP2, all-gathered layer by layer)
    train the same drafter as 1 process with the whole target."""
    r = _drafter_recipe(tmp_path)
    recipe = tmp_path / "drafter.yaml"
    recipe.write_text(yaml.safe_dump(r))
    whole = _run(1, recipe, tmp_path / "whole")
    r["target_sharding"] = "fsdp"
    recipe.write_text(yaml.safe_dump(r))
    sharded = _run(2, recipe, tmp_path / "sharded")
    meta = json.loads((tmp_path / "sharded" / "final_metrics.json").read_text())
    assert meta["target_sharding"] == "fsdp" and meta["num_processes"] == 2
    diff = max((whole[k] - sharded[k]).abs().max().item() for k in whole)
    scale = max(v.abs().max().item() for v in whole.values())
    assert diff < 1e-4 * scale
    curves = [[json.loads(ln)["loss"] for ln in (tmp_path / n / "train_log.jsonl").read_text().splitlines()]
              for n in ("whole", "sharded")]
    assert len(curves[0]) == 3 and all(abs(a - b) < 1e-4 * abs(a) for a, b in zip(*curves))


def test_max_minutes_is_one_decision_for_all_processes(tmp_path):
    """Rank 1's clock is past max_minutes and rank 0's is not: both stop (real gloo processes). Deciding apart, rank 0
    would take one more step and wait forever in its gradient all-reduce. The closing barrier is train.sync's, under
    a torch that reports CUDA as a CUDA build does (GPUs or not): accelerate's would put its tensor on cuda:<rank>."""
    code = ("import time\n"
            "from accelerate import Accelerator\n"
            "from train.loop import out_of_time\n"
            "from train.sync import wait_for_everyone\n"
            "acc = Accelerator(cpu=True)\n"
            "start = time.time() - (120 if acc.process_index == 1 else 0)\n"
            "res = f'{out_of_time(1.0, start, acc)} {out_of_time(None, start, acc)}'\n"
            "open(__file__ + f'.{acc.process_index}', 'w').write(res)\n"
            "import torch\n"
            "torch._C._get_accelerator = lambda *a: torch.device('cuda')\n"
            "wait_for_everyone(acc)\n"
            "import torch.distributed as dist\n"
            "dist.destroy_process_group() if dist.is_initialized() else None  # a clean exit, no gloo teardown race\n")
    script = tmp_path / "clock.py"
    _run_script(tmp_path, script.name, code, 2)
    assert [Path(f"{script}.{r}").read_text() for r in (0, 1)] == ["True False", "True False"]
    _run_script(tmp_path, script.name, code, 1)
    assert Path(f"{script}.0").read_text() == "False False"



def test_the_loop_deadline_stops_all_processes_at_the_same_step(tmp_path):
    """Deadline (the loop's max_minutes): rank 1's clock is past max_minutes, rank 0's is not; each step all-reduces
    the flags and reads those of two steps earlier, so both processes stop at the same (third) step."""
    code = ("import time\n"
            "from accelerate import Accelerator\n"
            "from train.loop import Deadline\n"
            "acc = Accelerator(cpu=True)\n"
            "start = time.time() - (120 if acc.process_index == 1 else 0)\n"
            "d = Deadline(1.0, acc)\n"
            "res = [d.passed(None)] + [d.passed(start) for _ in range(4)]\n"
            "open(__file__ + f'.{acc.process_index}', 'w').write(str(res))\n"
            "from train.sync import wait_for_everyone\n"
            "wait_for_everyone(acc)\n"
            "import torch.distributed as dist\n"
            "dist.destroy_process_group() if dist.is_initialized() else None\n")
    script = tmp_path / "deadline.py"
    _run_script(tmp_path, script.name, code, 2)
    want = str([False, False, False, True, True])
    assert [Path(f"{script}.{r}").read_text() for r in (0, 1)] == [want, want]
