"""`python -m train` for drafters: a real run on a local dataset, resume after kill -9, and bad input."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dspark.checkpoint import load_drafter, load_target
from dspark.engine import Engine
from dspark.request import SamplingParams


def recipe(root: Path, out: str, **over) -> Path:
    r = {"kind": "drafter", "output_dir": str(root / out), "target": str(root / "target"), "max_steps": 6,
         "device": "cpu", "drafter": {"block_size": 3, "num_layers": 1, "markov_rank": 8},
         "data": {"dataset": str(root / "data.jsonl"), "seq_len": 96, "regenerate": {"enabled": False},
                  "holdout_sequences": 4},
         "anchors_per_seq": 8, "optim": {"batch_size": 4, "warmup_steps": 2},
         "log": {"wandb_mode": "disabled", "eval_every": 3, "save_every": 2}}
    for k, v in over.items():
        r[k] = v
    p = root / f"{out}.yaml"
    p.write_text(yaml.safe_dump(r))
    return p


def train(path: Path, *extra: str, wait: bool = True):
    """Run `python -m train`; wait=False: the process, its stderr going to path's .stderr file (an unread pipe
    would block a chatty trainer once the pipe's buffer is full)."""
    cmd = [sys.executable, "-m", "train", str(path), *extra]
    if not wait:
        with open(path.with_suffix(".stderr"), "w") as err:
            return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_drafter_run_exports_a_loadable_dspark_drafter(setup):
    res = train(recipe(setup, "run"))
    assert res.returncode == 0, res.stderr[-2000:]
    final = setup / "run" / "final"
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["block_size"] == 3
    metrics = json.loads((setup / "run" / "final_metrics.json").read_text())
    assert metrics["steps"] == 6 and "tau" in metrics["final"] and metrics["final"]["tau"] >= 1.0
    target = load_target(setup / "target")
    drafter = load_drafter(final, target)
    assert drafter.config.mask_token_id == target.tokenizer.convert_tokens_to_ids("<|mask|>")


def test_keep_best_keeps_the_model_of_the_best_holdout_tau(setup):
    """log.keep_best=tau with an evaluation every step: <output_dir>/best holds the model of the evaluation with the
    highest holdout tau (a loadable drafter), and final_metrics.json names that step."""
    res = train(recipe(setup, "best"), "log.keep_best=tau", "log.eval_every=1", "max_steps=5", "optim.lr=3e-3")
    assert res.returncode == 0, res.stderr[-2000:]
    metrics = json.loads((setup / "best" / "final_metrics.json").read_text())
    taus = [h["tau"] for h in metrics["history"]]
    assert len(taus) == 5
    top = max(range(5), key=lambda i: (taus[i], -i))  # the first of equal bests: a later tie does not replace it
    assert metrics["best"] == {"step": top + 1, "tau": taus[top]}
    drafter = load_drafter(setup / "best" / "best", load_target(setup / "target"))
    assert drafter.config.block_size == 3 and not (setup / "best" / ".best.tmp").exists()
    same = top == 4  # best is the final model exactly when the last evaluation was the best
    a = load_file(str(setup / "best" / "best" / "model.safetensors"))
    b = load_file(str(setup / "best" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a) == same


def test_profile_steps_writes_a_step_profile(setup):
    """log.profile_steps=2: the two steps after the first (compile) run under torch.profiler and profile.txt holds
    their wall time and an op table; training goes on to max_steps."""
    res = train(recipe(setup, "prof"), "log.profile_steps=2", "max_steps=4")
    assert res.returncode == 0, res.stderr[-2000:]
    text = (setup / "prof" / "profile.txt").read_text()
    head = text.splitlines()[0]
    assert __import__("re").match(r"\d+\.\d ms per step \(wall, steps 2-3, profiler on\)$", head), head
    assert "Self CPU" in text and "aten::" in text
    assert json.loads((setup / "prof" / "final_metrics.json").read_text())["steps"] == 4


def test_compiled_step_trains_as_the_eager_step(setup):
    """compile=true (torch.compile of the step's forward and backward): the same per-step losses as the eager step
    within fp32 rounding of fused kernels, with Muon, and the same holdout metrics."""
    runs = {}
    for name, flag in (("eager", "false"), ("compiled", "true")):
        res = train(recipe(setup, f"comp-{name}"), f"compile={flag}", "optim.optimizer=muon", "max_steps=4",
                    "log.eval_every=2")
        assert res.returncode == 0, res.stderr[-2000:]
        log = [json.loads(ln) for ln in (setup / f"comp-{name}" / "train_log.jsonl").read_text().splitlines()]
        runs[name] = ([r["loss"] for r in log], json.loads((setup / f"comp-{name}" / "final_metrics.json")
                                                           .read_text())["history"])
    (eager, ev_eager), (compiled, ev_compiled) = runs["eager"], runs["compiled"]
    # it trained: the holdout loss fell from step 2 to step 4 (the same holdout rows; each step's training loss is
    # on its own batch, which can sit above the first one's after 4 steps)
    assert len(eager) == 4 and [h["step"] for h in ev_eager] == [2, 4] and ev_eager[1]["ce"] < ev_eager[0]["ce"]
    assert compiled == pytest.approx(eager, rel=1e-4)
    assert [h["ce"] for h in ev_compiled] == pytest.approx([h["ce"] for h in ev_eager], rel=1e-4)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_after_kill_9_continues_from_the_last_checkpoint(setup, optimizer):
    """Kill -9 after the step-2 checkpoint, resume: the result equals an uninterrupted run, bit for bit (with Muon:
    both optimizers' states and schedules come back)."""
    optim = {"batch_size": 4, "warmup_steps": 2, "optimizer": optimizer}
    ref = train(recipe(setup, f"straight-{optimizer}", optim=optim))
    assert ref.returncode == 0, ref.stderr[-2000:]
    path = recipe(setup, f"killed-{optimizer}", optim=optim)
    proc = train(path, "log.save_every=2", wait=False)
    ckpt = setup / f"killed-{optimizer}" / "checkpoints" / "step-2" / "trainer_state.json"
    deadline = time.time() + 240
    while not ckpt.is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert ckpt.is_file(), f"no checkpoint appeared (exit {proc.poll()}): {path.with_suffix('.stderr').read_text()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (setup / f"killed-{optimizer}" / "final").exists() or proc.returncode != 0
    res = train(path, "resume=true")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resumed from" in res.stderr
    a = load_file(str(setup / f"straight-{optimizer}" / "final" / "model.safetensors"))
    b = load_file(str(setup / f"killed-{optimizer}" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    if optimizer == "muon":  # Muon trained the hidden matrices: not the AdamW run's weights
        if not (setup / "straight-adamw" / "final").is_dir():
            assert train(recipe(setup, "straight-adamw")).returncode == 0
        c = load_file(str(setup / "straight-adamw" / "final" / "model.safetensors"))
        assert not torch.equal(a["layers.0.self_attn.q_proj.weight"], c["layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("over, message", [
    ({"data": {"dataset": "EMPTY", "regenerate": {"enabled": False}}}, "is empty"),
    ({"drafter": {"target_layer_ids": [5]}}, r"target_layer_ids: \[5\] out of range"),
    ({"target": "MISSING"}, "does not exist"),
    ({"target_sharding": "fsdp", "data": "REGENERATE"}, "target_sharding: fsdp cannot regenerate"),
    ({"data": ("REGENERATE", {"prompt_tokens": []})}, r"data.regenerate.prompt_tokens: expected a length >= 1"),
    ({"log": {"wandb_mode": "disabled", "keep_best": "acc"}}, r"log.keep_best: expected one of \['', 'tau'"),
    ({"data": ("REGENERATE", {"prompt_tokens": [8, 96]})}, r"prompt_tokens: 96 leaves no response tokens in "
                                                            r"data.seq_len=96"),
    ({"data": ("REGENERATE", {"code_prompts": 1.5})}, r"data.regenerate.code_prompts: expected a share in \[0, 1\]"),
    ({"data": ("REGENERATE", {"code_prompts": 0.5})}, r"code_prompts: cut from the corpus, so it needs data.dataset "
                                                      r"unset"),
])
def test_bad_input_is_one_clear_line(setup, over, message):
    data = over.get("data")
    if data == "REGENERATE" or isinstance(data, tuple):
        extra = data[1] if isinstance(data, tuple) else {}
        over = {**over, "data": {"dataset": str(setup / "data.jsonl"), "seq_len": 96,
                                 "regenerate": {"enabled": True, **extra}}}
    if over.get("data", {}).get("dataset") == "EMPTY":
        (setup / "empty.jsonl").write_text("")
        over = {"data": {"dataset": str(setup / "empty.jsonl"), "regenerate": {"enabled": False}}}
    if over.get("target") == "MISSING":
        over = {"target": str(setup / "nope")}
    res = train(recipe(setup, "bad", **over))
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and __import__("re").search(message, last), last


def test_prompt_length_list_regenerates_prompts_of_each_length(setup):
    """data.regenerate.prompt_tokens as a list: the prompts take the lengths in turn, the target continues each by
    new_tokens, and the loss mask starts where each prompt ends."""
    path = recipe(setup, "lens", max_steps=1, data={
        "dataset": str(setup / "data.jsonl"), "seq_len": 40, "holdout_sequences": 3,
        "regenerate": {"enabled": True, "num_sequences": 5, "prompt_tokens": [8, 16, 24], "new_tokens": 6}})
    res = train(path)
    assert res.returncode == 0, res.stderr[-2000:]
    seqs = torch.load(setup / "lens" / "sequences.pt")
    for split in ("train", "holdout"):
        mask = seqs[f"{split}_mask"]
        starts = mask.int().argmax(1).tolist()  # first loss token = the prompt's length
        assert starts == [(8, 16, 24)[j % 3] for j in range(len(starts))], (split, starts)
        assert mask.sum(1).tolist() == [6] * len(starts)


def test_prompts_beyond_the_rows_start_at_random_positions():
    """More regeneration prompts than corpus rows: the first pass takes each row's prefix, later passes windows at
    random starts (no prompt repeats); with fewer prompts than rows only prefixes, as before."""
    from train.sequences import pick_prompts

    rows = [(None, None, list(range(1000 * r, 1000 * r + 100))) for r in range(5)]  # 5 rows of 100 tokens
    few = pick_prompts(rows, 3, [10, 20], torch.Generator().manual_seed(0), passes=True)
    assert [len(p) for p in few] == [10, 20, 10] and all(p[0] % 1000 == 0 for p in few)
    assert len({p[0] for p in few}) == 3  # distinct rows
    many = pick_prompts(rows, 12, [10, 20], torch.Generator().manual_seed(0), passes=True)
    assert many[:3] == few  # the first pass is the same draw
    assert [len(p) for p in many] == [10, 20] * 6
    assert sorted(p[0] // 1000 for p in many[:5]) == list(range(5))  # pass 1: every row once, from its start
    later = many[5:]
    assert all(p == list(range(p[0], p[0] + len(p))) for p in later)  # contiguous windows inside one row
    assert any(p[0] % 1000 for p in later) and len({tuple(p) for p in many}) == 12
    assert pick_prompts(rows, 12, [10], torch.Generator().manual_seed(0), passes=False) == \
        pick_prompts(rows, 5, [10], torch.Generator().manual_seed(0), passes=True)  # records: one pass only
    assert pick_prompts([], 3, [10], torch.Generator().manual_seed(0), passes=True) == []  # no rows: no prompts


def test_code_prompts_take_the_lengths_in_turn_and_each_point_once_per_pass():
    """pick_code_prompts: the point's last L tokens, L from the lengths in turn, points too short for their L passed
    over; no point twice before every point was used once."""
    from train.sequences import pick_code_prompts

    points = [list(range(100 * i, 100 * i + n)) for i, n in enumerate([40, 12, 25, 40, 33, 8])]
    got = pick_code_prompts(points, 4, [10, 30], torch.Generator().manual_seed(0))
    assert [len(p) for p in got] == [10, 30, 10, 30]
    assert all(p == points[p[0] // 100][-len(p):] for p in got)  # each is the tail of one point
    assert len({p[0] // 100 for p in got}) == 4
    many = pick_code_prompts(points, 9, [10], torch.Generator().manual_seed(0))
    assert len(many) == 9 and len({p[0] // 100 for p in many[:5]}) == 5  # 5 points reach 10 tokens; then a new pass
    assert pick_code_prompts([[1, 2]], 3, [10], torch.Generator().manual_seed(0)) == []  # none long enough: none


def test_max_minutes_counts_from_the_end_of_the_first_step(setup):
    """max_minutes=0 still takes the first step (the one that compiles and autotunes), then stops: one step."""
    res = train(recipe(setup, "budget"), "max_minutes=0")
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((setup / "budget" / "final_metrics.json").read_text())["steps"] == 1
    assert "max_minutes counts from here" in res.stderr and "max_minutes=0.0 reached at step 1" in res.stderr


def test_target_without_mask_token_is_refused(setup, tmp_path):
    import shutil

    shutil.copytree(setup / "target", tmp_path / "t")
    cfg = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    cfg.pop("mask_token", None)
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "t" / "special_tokens_map.json").unlink(missing_ok=True)
    res = train(recipe(setup, "nomask", target=str(tmp_path / "t")))
    assert res.returncode == 2 and "mask token" in res.stderr.strip().splitlines()[-1]


def test_block_mask_auto_falls_back_to_dense_when_flex_cannot_train():
    """block_mask=auto probes one flex forward + backward first; where that fails (here: flex has no CPU backward,
    on a GPU: a kernel that does not lower) training uses the dense mask, and the probe leaves no gradients."""
    from accelerate import Accelerator

    from tests.targets import make_target
    from tests.test_drafter_k3 import make_k3_drafter
    from train.drafter import _flex_compiles

    target = make_target("k3", vocab=300, device="cpu")  # the CPU, where flex attention has no backward
    d = make_k3_drafter(target).train()
    x = torch.randint(2, 300, (2, 64))
    with torch.no_grad():
        _, aux = target(x, aux_layer_ids=d.config.target_layer_ids)
    anchors = torch.tensor([[3, 10, 20], [5, 9, 30]])
    acc = Accelerator(cpu=True)
    assert not _flex_compiles(lambda: d.train_forward(aux, x, anchors, flex=True).pow(2).mean(), d, acc)
    assert _flex_compiles(lambda: d.train_forward(aux, x, anchors, flex=False).pow(2).mean(), d, acc)
    assert all(p.grad is None for p in d.parameters())


def test_rejection_anchors_resume_with_their_decode_starts(setup):
    """anchors=rejection: the decode starts recorded per row are part of the checkpoint, so training again from the
    step-3 checkpoint gives the model of the run that went straight to the end, bit for bit."""
    path = recipe(setup, "rejection", anchors="rejection", rejection_share=1.0, anchors_per_seq=4)
    res = train(path, "log.save_every=3")
    assert res.returncode == 0, res.stderr[-2000:]
    assert (setup / "rejection" / "checkpoints" / "step-3" / "custom_checkpoint_0.pkl").is_file()
    straight = load_file(str(setup / "rejection" / "final" / "model.safetensors"))
    res = train(path, "log.save_every=3", "resume=true")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resumed from" in res.stderr and "(step 3)" in res.stderr
    again = load_file(str(setup / "rejection" / "final" / "model.safetensors"))
    assert all(torch.equal(straight[k], again[k]) for k in straight)


def test_bf16_runs_the_frozen_target_in_bf16_and_trains(setup):
    """mixed_precision=bf16: the target of the training forward is the target loaded in bf16 (as served: its logits
    close to the fp32 ones), the fp32 one it replaces is left as it was (the drafter's embedding and LM head); a bf16
    run on CPU (the drafter and its loss under bf16 autocast) trains, logs every step once, in order, and its first
    loss is the fp32 run's within bf16 rounding."""
    from dspark.config import load_recipe
    from train.drafter import target_for_training

    target = load_target(setup / "target")
    same = target_for_training(target, load_recipe(recipe(setup, "fp32")), "cpu")
    assert same is target
    bf16 = target_for_training(target, load_recipe(recipe(setup, "bf16", mixed_precision="bf16")), "cpu")
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in bf16.parameters())
    assert all(p.dtype == torch.float32 for p in target.parameters())
    x = torch.randint(5, 300, (2, 24))
    with torch.no_grad():
        ref, got = target(x), bf16(x)
    assert got.dtype == torch.bfloat16 and (got.float() - ref).abs().max() < 0.05 * ref.abs().max()
    res = train(recipe(setup, "bf16", mixed_precision="bf16"), "max_steps=4")
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [json.loads(ln) for ln in (setup / "bf16" / "train_log.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2, 3, 4] and all(ln["loss"] > 0 for ln in lines)
    assert [ln["seconds"] for ln in lines] == sorted(ln["seconds"] for ln in lines)
    assert json.loads((setup / "bf16" / "final_metrics.json").read_text())["final"]["tau"] >= 1.0
    ref = train(recipe(setup, "fp32-ref"), "max_steps=1")
    assert ref.returncode == 0, ref.stderr[-2000:]
    first = json.loads((setup / "fp32-ref" / "train_log.jsonl").read_text().splitlines()[0])["loss"]
    assert lines[0]["loss"] == pytest.approx(first, rel=0.03)


def test_bf16_regenerates_with_the_bf16_target(setup):
    """mixed_precision=bf16: the sequences are regenerated by the target as served (bf16), not the fp32 one kept for
    the drafter's embedding and LM head: the stored continuations are the bf16 target's own."""
    from dspark.config import load_recipe
    from train.drafter import target_for_training
    from train.sequences import regenerate

    regen = {"dataset": str(setup / "data.jsonl"), "seq_len": 64, "holdout_sequences": 3,
             "regenerate": {"enabled": True, "num_sequences": 4, "prompt_tokens": 12, "new_tokens": 6}}
    rec = recipe(setup, "bf16-regen", max_steps=1, mixed_precision="bf16", data=regen)
    res = train(rec)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "regenerate: the target (bfloat16) continues 4 train prompts" in res.stderr
    seqs = torch.load(setup / "bf16-regen" / "sequences.pt")
    prompts = [row[: int(mask.int().argmax())].tolist() for row, mask in zip(seqs["train"], seqs["train_mask"])]
    bf16 = target_for_training(load_target(setup / "target"), load_recipe(rec), "cpu")
    again = regenerate(bf16, bf16.tokenizer, prompts, 6, 0.0, 4, [0] * 4)
    assert [row[: len(a)].tolist() for row, a in zip(seqs["train"], again)] == again


def test_chat_prompts_regenerate_chat_template_turns(setup, tmp_path):
    """data.regenerate.chat_prompts=1: every train prompt is a user turn of the target's chat template, the target
    answers after the assistant header and only its answer is a loss token; the holdout prompts stay plain. A target
    without a chat template is refused in one line before any work."""
    from transformers import AutoTokenizer

    regen = {"dataset": str(setup / "data.jsonl"), "seq_len": 64, "holdout_sequences": 3,
             "regenerate": {"enabled": True, "num_sequences": 4, "prompt_tokens": 12, "new_tokens": 6,
                            "chat_prompts": 1.0}}
    res = train(recipe(setup, "chat", max_steps=1, data=regen))
    assert res.returncode == 0, res.stderr[-2000:]
    tok = AutoTokenizer.from_pretrained(str(setup / "target"))
    seqs = torch.load(setup / "chat" / "sequences.pt")
    for row, mask in zip(seqs["train"], seqs["train_mask"]):
        start = int(mask.int().argmax())
        text = tok.decode(row[:start])
        assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert int(mask.sum()) == 6
    assert not any(tok.decode(r[:12]).startswith("<|im_start|>") for r in seqs["holdout"])
    import shutil

    shutil.copytree(setup / "target", tmp_path / "t")
    cfg = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "t" / "chat_template.jinja").unlink(missing_ok=True)
    res = train(recipe(setup, "nochat", max_steps=1, target=str(tmp_path / "t"), data=regen))
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "data.regenerate.chat_prompts: the target tokenizer" in last, last
    assert not (setup / "nochat").exists() or not any((setup / "nochat").iterdir())


def test_dflash_drafter_on_a_k3_target_trains_with_qwen3_layers(setup, tmp_path):
    """The DFlash baseline of a K3 pair: drafter.backbone=qwen3 (the k3 backbone has only the dspark layout), its
    attention dims from the target's heads (a K3 config has no head_dim); it trains, exports the DFlash layout and
    loads against the K3 target."""
    from transformers import AutoTokenizer

    from dspark.models.k3.config import k3_tiny_config
    from dspark.models.k3.model import K3ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(setup / "target"))
    torch.manual_seed(0)
    target = K3ForCausalLM(k3_tiny_config(vocab_size=len(tok), max_position_embeddings=512,
                                          eos_token_id=tok.eos_token_id))
    target.save_pretrained(tmp_path / "k3")
    tok.save_pretrained(str(tmp_path / "k3"))
    over = {"target": str(tmp_path / "k3"), "output_dir": str(tmp_path / "dflash"), "max_steps": 3,
            "drafter": {"backbone": "qwen3", "mode": "dflash", "block_size": 4, "num_layers": 1}}
    res = train(recipe(setup, "dflash-k3", **over))
    assert res.returncode == 0, res.stderr[-2000:]
    cfg = json.loads((tmp_path / "dflash" / "final" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    k3 = load_target(tmp_path / "k3")
    drafter = load_drafter(tmp_path / "dflash" / "final", k3)
    assert drafter.config.mode == "dflash" and drafter.markov_head is None
    assert drafter.config.head_dim * drafter.config.num_attention_heads == target.config.hidden_size
    prompt, params = tok("def add(a, b):\n    return")["input_ids"], SamplingParams(max_tokens=12, ignore_eos=True)
    ar = Engine(k3).generate([prompt], params)[0].token_ids
    assert Engine(k3, drafter).generate([prompt], params)[0].token_ids == ar  # lossless in the engine
    res = train(recipe(setup, "k3-dflash-bad", **{**over, "drafter": {"backbone": "k3", "mode": "dflash"}}))
    assert res.returncode == 2 and "drafter.backbone=qwen3" in res.stderr.strip().splitlines()[-1], res.stderr[-500:]


def test_tau_walked_with_more_holdout_rows_and_a_wider_batch_than_it_walks(setup, tmp_path):
    """The holdout eval's tau_walked walks the first WALKED_ROWS holdout rows in batches of optim.batch_size: with
    more holdout rows than that and a wider batch, each batch's rows are the walked ones (the run finishes and reports
    a τ within the block)."""
    texts = [json.loads(line)["text"] for line in (setup / "data.jsonl").read_text().splitlines()]
    pieces = [t[i:i + 200] for t in texts for i in range(0, len(t) - 199, 200)]  # enough rows for 20 held out
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in pieces[:400]))
    regen = {"dataset": str(tmp_path / "data.jsonl"), "seq_len": 32, "holdout_sequences": 20,
             "regenerate": {"enabled": True, "num_sequences": 4, "prompt_tokens": 12, "new_tokens": 8}}
    res = train(recipe(setup, "walk", max_steps=2, data=regen), "optim.batch_size=32", "log.eval_every=2")
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(torch.load(setup / "walk" / "sequences.pt")["holdout"]) == 20
    final = json.loads((setup / "walk" / "final_metrics.json").read_text())["final"]
    assert 1.0 <= final["tau_walked"] <= 3.0
