"""Ours vs `speculators` 0.9 (vllm-project/speculators): the same DSpark drafter trained by both trainers on the same
target, regenerated sequences and budget, then converted and evaluated with `python -m eval`.

    python3 bench/peer_speculators.py --target TARGET_DIR --out OUT [--steps 2000 --layers 5 --markov-rank 256 ...]

Phases (each a subprocess, timed; OUT/peer.json and OUT/peer.md hold the table):
1. regenerate  our trainer's data path (train.sequences.load_sequences: the target continues corpus prompts) ->
               OUT/ours/sequences.pt; shared by both trainers, so its time is reported apart (--sequences reuses one)
2. ours        python -m train RECIPE (resume=true: it reads those sequences); target features online every step; one
               row per --ours-row 'NAME: key=value ...' (default: "ours" with AdamW, "ours-muon" with Muon,
               train/optim.py)
3. export      python -m train.speculators_data: the same rows + the target's features in speculators' data format
               (speculators trains from features stored on disk: its end-to-end time = export + training)
4. speculators python -m speculators.train --speculator-type dspark, one row per --optimizers (adamw: like ours;
               muon: its default) and --spec-seeds seed, unmodified on a GPU
5. convert     python -m dspark.checkpoint convert (speculators' last checkpoint -> our vLLM layout), and
               bench/speculators_parity.py: that checkpoint in speculators' model and in ours, max abs logit diffs
6. eval        python -m eval on every drafter with the same prompts: tau and alpha per task

Matched: target, rows (speculators packs --batch-size rows of the regenerated length per step: total_seq_len =
batch x row length, max_anchors = batch x --anchors), block size, draft depth and width (the target's heads, head dim,
MLP width), aux layers (speculators' --target-layer-ids = ours + 1), every draft layer full attention and non-causal
(--full-attention-indices all), Markov rank, confidence head (without the Markov input unless --confidence-with-markov),
steps, lr, warmup, cosine to 0, weight decay, grad clip 1.0. Each keeps its own losses (ours: the recipe's, e.g.
decayed CE on the target's argmax + KL to its distribution + confidence BCE on greedy correctness; speculators:
--spec-loss, default kl_div, + confidence BCE on 1 - TV) and its AdamW betas (ours 0.9/0.95, speculators torch's
0.9/0.999); an --ours-row can take either difference away (loss.ce=0, loss.decay_gamma=4, ...).
Figures: steady-state training tokens/s (sequence tokens per step / step time, after the first --warm steps: compile and
warm-up excluded; ours includes the target's forward, speculators reads features from disk), end-to-end wall time per
phase, peak GPU memory of the training process (torch.cuda.max_memory_allocated; ours holds the target as well).

Speculators' losses run eager (inside its compiled forward): its Triton-fused losses do not trace under torch 2.11's
dynamo ("ListVariable ... is already tracked for mutation" on the kernels' autotune configs).
On a machine without a GPU the same run works at toy size (speculators' trainer assumes an accelerator: its process
gets two shims there, the device "cpu" for the local rank and a no-op accelerator synchronize; flex attention ->
sdpa, features in fp32). CPU smoke (about 6 minutes on 2 cores), after `make quickstart`'s target:
    python3 bench/peer_speculators.py --target runs/quickstart/target/final --out /tmp/peer-smoke --steps 12 \
        --layers 1 --block-size 4 --markov-rank 8 --batch-size 4 --anchors 8 --regen-sequences 24 --holdout 8 \
        --prompt-tokens 32 --new-tokens 48 --eval-prompts 2 --eval-max-tokens 24 --eval-tasks humaneval,creative
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.ablate_drafter import parse_rows  # noqa: E402
from eval import measure as M  # noqa: E402

ME = str(Path(__file__).resolve())
OURS_ROWS = {"ours": ["optim.optimizer=adamw"], "ours-muon": ["optim.optimizer=muon"]}


# --------------------------------------------------------------------------- in-process runners (subprocesses)
def peak_memory() -> dict:
    if not torch.cuda.is_available():
        return {"peak_alloc_gib": None, "peak_reserved_gib": None}
    return {"peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


def run_regenerate(result: Path, recipe_argv: list[str]) -> int:
    """Our trainer's data path alone: the recipe's sequences -> <output_dir>/sequences.pt."""
    from dspark.checkpoint import load_target
    from dspark.config import load_recipe
    from train.sequences import load_sequences

    recipe = load_recipe(recipe_argv[0], recipe_argv[1:])
    device = "cuda" if torch.cuda.is_available() and recipe.device != "cpu" else "cpu"
    target = load_target(recipe.target, device=device)  # fp32, as the trainer loads it
    seqs = load_sequences(recipe, target, target.tokenizer)
    result.write_text(json.dumps({"train_rows": len(seqs.train), "row_len": seqs.train.shape[1], **peak_memory()}))
    return 0


def run_ours(result: Path, recipe_argv: list[str]) -> int:
    from train.__main__ import main

    rc = main(recipe_argv)
    result.write_text(json.dumps({"rc": rc, **peak_memory()}))
    return rc


def run_speculators(result: Path, argv: list[str]) -> int:
    """speculators' trainer in this process, its per-step metric records kept (with their arrival time)."""
    import speculators.train.cli as spec_cli
    import speculators.train.trainer as spec_trainer
    from speculators.train.config import TrainConfig

    records: list[dict] = []

    class Keep(logging.Handler):
        def emit(self, record):
            msg = record.msg
            if isinstance(msg, dict) and isinstance(msg.get("train"), dict) and msg.get("profile"):
                records.append({"t": time.perf_counter(), "step": msg.get("global_step"), "profile": msg["profile"],
                                "loss": msg["train"].get("loss")})

    setup = spec_cli.setup_metric_logger

    def setup_and_keep(*args, **kwargs):  # its dictConfig replaces the metric logger's handlers: add ours after
        setup(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(Keep())

    spec_cli.setup_metric_logger = setup_and_keep
    if not torch.cuda.is_available():  # CPU smoke only: speculators' trainer assumes an accelerator
        spec_trainer.get_local_rank = lambda: "cpu"
        torch.accelerator.synchronize = lambda *a, **k: None
    sys.argv = ["speculators.train", *argv]
    spec_cli.main(TrainConfig.resolve())
    result.write_text(json.dumps({"rc": 0, "records": records, **peak_memory()}))
    return 0


# --------------------------------------------------------------------------- figures
def steady_ours(run: Path, tokens_per_step: int, warm: int) -> float | None:
    """tokens/s over the steps after `warm` from train_log.jsonl (seconds since the start of training, per step)."""
    log = [json.loads(ln) for ln in (run / "train_log.jsonl").read_text().splitlines()]
    log = [r for r in log if r["step"] > warm]
    if len(log) < 2:
        return None
    return (log[-1]["step"] - log[0]["step"]) * tokens_per_step / (log[-1]["seconds"] - log[0]["seconds"])


def steady_speculators(records: list[dict], warm: int) -> float | None:
    """tokens/s over the steps after `warm`: each step's tokens (its profile) over the wall time between records."""
    recs = [r for r in records if r["step"] is not None and r["step"] >= warm]
    if len(recs) < 2:
        return None
    tokens = sum(r["profile"]["tokens_per_s"] * r["profile"]["step_ms"] / 1e3 for r in recs[1:])
    return tokens / (recs[-1]["t"] - recs[0]["t"])


class Phases:
    """Runs the bench's subprocesses, each phase's wall seconds kept in OUT/logs/phases.json. With resume, a phase
    recorded there is not run again (its outputs are on disk); one that did not finish starts over, its `clear`
    paths deleted first. A failure stops the bench with the log's tail."""

    def __init__(self, logs: Path, resume: bool):
        self.logs, self.path = logs, logs / "phases.json"
        self.done = json.loads(self.path.read_text()) if resume and self.path.is_file() else {}

    def run(self, name: str, cmd: list[str], clear: tuple[Path, ...] = ()) -> float:
        if name in self.done:
            print(f"{name}: done earlier ({self.done[name]:.0f} s), not run again", flush=True)
            return self.done[name]
        for p in clear:
            shutil.rmtree(p, ignore_errors=True)
        log = self.logs / f"{name}.log"
        t0 = time.perf_counter()
        with open(log, "w") as f:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc:
            tail = "\n".join(log.read_text().splitlines()[-25:])
            raise SystemExit(f"failed (exit {rc}): {' '.join(cmd)}\n--- {log} (tail)\n{tail}")
        self.done[name] = time.perf_counter() - t0
        self.path.write_text(json.dumps(self.done, indent=2) + "\n")
        return self.done[name]


# --------------------------------------------------------------------------- the bench
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="a Qwen3 target dir (HF layout, with its tokenizer)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--overwrite", action="store_true", help="delete --out first when it exists")
    ap.add_argument("--resume", action="store_true", help="go on in an existing --out: phases that finished there "
                    "(OUT/logs/phases.json) are not run again")
    ap.add_argument("--recipe", default="recipes/quickstart.yaml", help="our drafter recipe the overrides start from "
                    "(its data section: the corpus the prompts are cut from)")
    ap.add_argument("--sequences", help="reuse this sequences.pt instead of regenerating")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2, help="draft depth")
    ap.add_argument("--markov-rank", type=int, default=32)
    ap.add_argument("--layer-ids", type=int, nargs="+", help="ours (0-based after-layer); default: our trainer's")
    ap.add_argument("--confidence-with-markov", action="store_true")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=8, help="rows per step (global)")
    ap.add_argument("--anchors", type=int, default=32, help="blocks per row")
    ap.add_argument("--regen-sequences", type=int, default=768)
    ap.add_argument("--holdout", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--ours-row", action="append", default=[],
                    help="'NAME: key=value ...': one of our rows, recipe overrides on top of the matched ones "
                    "(repeatable; default: ours = AdamW, ours-muon = Muon)")
    ap.add_argument("--optimizers", default="adamw,muon", help="speculators rows")
    ap.add_argument("--spec-seeds", default="", help="comma-separated seeds, one speculators row per optimizer and "
                    "seed (default: --seed); a row of another seed than --seed is named NAME-sSEED, as an --ours-row "
                    "with seed=SEED may be, and the table adds each such group's mean")
    ap.add_argument("--spec-loss", default="kl_div", help="speculators' --loss-fn")
    ap.add_argument("--spec-arg", action="append", default=[], help="extra speculators.train argument (repeatable)")
    ap.add_argument("--ours-arg", action="append", default=[], help="extra recipe override key=value (repeatable)")
    ap.add_argument("--num-workers", type=int, default=4, help="speculators' dataloader workers (0 on CPU)")
    ap.add_argument("--warm", type=int, help="steps left out of the steady-state rate (default: 10%% of --steps)")
    ap.add_argument("--parity-rows", type=int, default=4,
                    help="holdout rows on which speculators' model and ours score each speculators checkpoint")
    ap.add_argument("--eval-tasks", default="humaneval,code_holdout,creative,chat")
    ap.add_argument("--eval-prompts", type=int, default=20)
    ap.add_argument("--eval-max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--export-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the target's dtype for speculators' features (stored in bf16 either way; ours are computed "
                    "in the recipe's mixed precision)")
    return ap.parse_args(argv)


def recipe_overrides(a, out: Path, ids: list[int], cuda: bool) -> list[str]:
    return [f"target={a.target}", f"output_dir={out / 'ours'}", "resume=true", "drafter.mode=dspark",
            f"drafter.block_size={a.block_size}", f"drafter.num_layers={a.layers}",
            f"drafter.markov_rank={a.markov_rank}", f"drafter.target_layer_ids={json.dumps(ids)}",
            "drafter.enable_confidence_head=true",
            f"drafter.confidence_head_with_markov={str(a.confidence_with_markov).lower()}",
            f"max_steps={a.steps}", f"optim.lr={a.lr}", f"optim.warmup_steps={a.warmup}", "optim.min_lr_ratio=0.0",
            f"optim.batch_size={a.batch_size}", f"optim.weight_decay={a.weight_decay}", "optim.grad_clip=1.0",
            f"anchors_per_seq={a.anchors}", f"log.eval_every={a.steps}", f"log.save_every={a.steps}",
            "log.wandb_mode=disabled", f"data.regenerate.num_sequences={a.regen_sequences}",
            f"data.regenerate.prompt_tokens={a.prompt_tokens}", f"data.regenerate.new_tokens={a.new_tokens}",
            f"data.seq_len={a.prompt_tokens + a.new_tokens}", f"data.holdout_sequences={a.holdout}",
            f"mixed_precision={'bf16' if cuda else 'no'}", f"seed={a.seed}", *a.ours_arg]


def speculators_args(a, out: Path, name: str, optimizer: str, data: dict, mask_id: int, cuda: bool,
                     seed: int) -> list[str]:
    B, row = a.batch_size, data["max_seq_len"]
    epochs = max(1, math.ceil(a.steps / max(1, data["train_rows"] // B)))
    return ["--speculator-type", "dspark", "--verifier-name-or-path", str(a.target), "--data-path",
            str(out / "data"), "--on-missing", "raise", "--train-data-ratio", str(data["train_data_ratio"]),
            "--save-path", str(out / name / "ckpt"), "--log-dir", str(out / name / "logs"), "--log-freq", "1",
            "--num-layers", str(a.layers), "--draft-arch", "qwen3", "--full-attention-indices",
            *map(str, range(a.layers)), "--target-layer-ids", *map(str, data["speculators_target_layer_ids"]),
            "--mask-token-id", str(mask_id), "--block-size", str(a.block_size), "--markov-rank", str(a.markov_rank),
            "--confidence-head-with-markov" if a.confidence_with_markov else "--no-confidence-head-with-markov",
            "--max-anchors", str(B * a.anchors), "--total-seq-len", str(B * row), "--loss-fn", a.spec_loss,
            "--optimizer", optimizer, "--lr", str(a.lr), "--weight-decay", str(a.weight_decay),
            "--scheduler-type", "cosine", "--scheduler-warmup-steps", str(a.warmup), "--max-steps", str(a.steps),
            "--epochs", str(epochs), "--checkpoint-freq", str(epochs), "--seed", str(seed),
            "--num-workers", str(a.num_workers if cuda else 0),
            "--hidden-states-dtype", "bfloat16" if cuda else "float32",
            "--loss-implementation", "eager", *([] if cuda else ["--draft-attn-impl", "sdpa"]), *a.spec_arg]


def last_checkpoint(ckpt: Path) -> Path:
    epochs = [p for p in ckpt.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit()]
    if not epochs:
        raise SystemExit(f"{ckpt}: speculators wrote no checkpoint")
    return max(epochs, key=lambda p: int(p.name))


def bench(a) -> dict:
    from dspark.checkpoint import target_facts
    from train.drafter import default_layer_ids

    out = Path(a.out).resolve()
    if out.exists() and not a.resume:
        if not a.overwrite:
            raise SystemExit(f"--out {out}: exists; pass --overwrite to replace it, or --resume to go on")
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    target, tcfg = target_facts(a.target)
    tok = target.tokenizer
    if tok is None or tok.mask_token is None:
        raise SystemExit(f"--target {a.target}: needs a tokenizer with a mask token")
    mask_id = tok.convert_tokens_to_ids(tok.mask_token)
    ids = a.layer_ids or default_layer_ids(tcfg["num_hidden_layers"])
    warm = a.warm if a.warm is not None else max(2, a.steps // 10)
    py, logs, res = sys.executable, out / "logs", {"config": vars(a), "layer_ids": ids, "rows": {}}
    phases = Phases(logs, a.resume)
    recipe = [a.recipe, *recipe_overrides(a, out, ids, cuda)]
    if a.sequences:
        (out / "ours").mkdir(exist_ok=True)
        shutil.copy(a.sequences, out / "ours" / "sequences.pt")
        res["regenerate_s"] = None
    else:
        res["regenerate_s"] = phases.run("regen", [py, ME, "_regenerate", str(logs / "regen.json"), *recipe],
                                         clear=(out / "ours",))
    drafters = {}
    for name, overrides in parse_rows(a.ours_row, default=OURS_ROWS).items():
        if name != "ours" and not (out / name / "sequences.pt").is_file():  # OUT/ours holds the shared sequences
            (out / name).mkdir(exist_ok=True)
            shutil.copy(out / "ours" / "sequences.pt", out / name / "sequences.pt")
        argv = [*recipe, f"output_dir={out / name}", *overrides]
        res["rows"][name] = {"wall_s": phases.run(name, [py, ME, "_ours", str(logs / f"{name}.json"), *argv])}
        drafters[name] = out / name / "final"
    res["export_s"] = phases.run("export", [py, "-m", "train.speculators_data", str(out / "ours"), "--target",
                                            str(a.target), "--layer-ids", *map(str, ids), "--out", str(out / "data"),
                                            "--dtype", a.export_dtype, "--batch-size", "32", "--overwrite"])
    data = json.loads((out / "data" / "export.json").read_text())
    tokens_per_step = a.batch_size * data["max_seq_len"]
    for name, row in res["rows"].items():
        row.update(json.loads((logs / f"{name}.json").read_text()), e2e_s=row["wall_s"],
                   steady_tok_s=steady_ours(out / name, tokens_per_step, warm))
    seeds = [int(x) for x in a.spec_seeds.split(",") if x] or [a.seed]
    for opt, seed in [(o, s) for o in a.optimizers.split(",") if o for s in seeds]:
        name = f"speculators-{opt}" + ("" if seed == a.seed else f"-s{seed}")
        args = speculators_args(a, out, name, opt, data, mask_id, cuda, seed)
        row = {"wall_s": phases.run(name, [py, ME, "_speculators", str(logs / f"{name}.json"), *args],
                                    clear=(out / name,))}
        rec = json.loads((logs / f"{name}.json").read_text())
        row.update(steady_tok_s=steady_speculators(rec.pop("records"), warm), e2e_s=row["wall_s"] + res["export_s"],
                   **rec)
        drafters[name] = out / "drafters" / name
        ckpt = last_checkpoint(out / name / "ckpt")
        phases.run(f"convert-{name}", [py, "-m", "dspark.checkpoint", "convert", str(ckpt), "--target",
                                       str(a.target), "--out", str(drafters[name])], clear=(drafters[name],))
        phases.run(f"parity-{name}", [py, str(ROOT / "bench" / "speculators_parity.py"), str(ckpt), "--target",
                                      str(a.target), "--sequences", str(out / "ours" / "sequences.pt"), "--rows",
                                      str(a.parity_rows), "--out", str(logs / f"parity-{name}.json")])
        row["parity"] = json.loads((logs / f"parity-{name}.json").read_text())
        res["rows"][name] = row
    cmd = [py, "-m", "eval", "--target", str(a.target), "--out", str(out / "eval"), "--tasks", a.eval_tasks,
           "--num-prompts", str(a.eval_prompts), "--max-tokens", str(a.eval_max_tokens)]
    corpus = _recipe_corpus(a.recipe)
    if corpus and "_holdout" in a.eval_tasks:
        cmd += ["--corpus", corpus]
    for name, d in drafters.items():
        cmd += ["--drafter", str(d), "--name", name]
    res["eval_s"] = phases.run("eval", cmd, clear=(out / "eval",))
    report = json.loads((out / "eval" / "report.json").read_text())
    for name, row in res["rows"].items():
        row["tau"] = {t: v["drafters"][name]["tau"] for t, v in report["tasks"].items()}
        row["per_prompt"] = {t: v["drafters"][name]["per_prompt"] for t, v in report["tasks"].items()}
        row["tau_overall"] = report["overall"][name]["tau"]
        row["alpha_per_position"] = report["overall"][name]["per_position"]["conditional"]
    res["tokens_per_step"], res["device"] = tokens_per_step, torch.cuda.get_device_name() if cuda else "cpu"
    (out / "peer.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "peer.md").write_text(table(res) + "\n")
    return res


def _recipe_corpus(recipe: str) -> str | None:
    from dspark.config import load_recipe

    d = load_recipe(recipe).data
    return d.corpus.corpus_dir if d.dataset is None else None


def table(res: dict) -> str:
    rows = res["rows"]
    tasks = list(next(iter(rows.values()))["tau"])
    head = ["trainer", *[f"tau {t}" for t in tasks], "tau all", "train tok/s (steady)", "end-to-end s", "peak GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    f = lambda v, p=2: "n/a" if v is None else f"{v:.{p}f}"
    for name, r in rows.items():
        lines.append("| " + " | ".join([name, *[f(r["tau"][t]) for t in tasks], f(r["tau_overall"]),
                                         f(r["steady_tok_s"], 0), f(r["e2e_s"], 0), f(r["peak_alloc_gib"])]) + " |")
    groups: dict[str, list[str]] = {}  # rows that differ by their seed alone (NAME, NAME-sSEED)
    for name in rows:
        groups.setdefault(re.sub(r"-s\d+$", "", name), []).append(name)
    for base, names in groups.items():
        if len(names) > 1:
            taus = [[rows[n]["tau"][t] for n in names] for t in tasks] + [[rows[n]["tau_overall"] for n in names]]
            lines.append("| " + " | ".join([f"{base}, mean of {len(names)} seeds",
                                             *[f(sum(x) / len(x)) for x in taus], "", "", ""]) + " |")
    theirs = [n for n in rows if n.startswith("speculators")]
    if theirs and all("per_prompt" in r for r in rows.values()):
        lines.append(f"\nτ ours ÷ speculators per task, the same prompts (95 % bootstrap over prompts): "
                     f"{', '.join(tasks)}")
        for name in (n for n in rows if n not in theirs):
            for other in theirs:
                cis = []
                for t in tasks:
                    ci = M.tau_ratio_ci95(rows[name]["per_prompt"][t], rows[other]["per_prompt"][t])
                    cis.append("n/a" if ci is None else f"{rows[name]['tau'][t] / rows[other]['tau'][t]:.3f} "
                               f"[{ci[0]:.3f}, {ci[1]:.3f}]")
                lines.append(f"- {name} ÷ {other}: " + "; ".join(cis))
    for name, r in rows.items():
        if "parity" in r:
            p = r["parity"]
            lines.append(f"\n{name} checkpoint, speculators' model vs ours ({p['rows']} holdout rows of "
                         f"{p['row_len']}, every anchor): max |logit diff| fp32 {p['float32']['logits']:.2e}, bf16 "
                         f"{p['bfloat16']['logits']:.3f} (max |logit| {p['bfloat16']['max_abs_logit']:.1f}); "
                         f"confidence bf16 {p['bfloat16']['confidence']:.3f}")
    regen = res["regenerate_s"]
    lines.append(f"\nregeneration (shared, in neither end-to-end time): {f(regen, 0)} s; speculators' end-to-end time "
                 f"includes the feature export ({res['export_s']:.0f} s); {res['tokens_per_step']} tokens per step; "
                 f"{res['device']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    runners = {"_regenerate": run_regenerate, "_ours": run_ours, "_speculators": run_speculators}
    if argv and argv[0] in runners:
        return runners[argv[0]](Path(argv[1]), argv[2:])
    res = bench(parse_args(argv))
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
