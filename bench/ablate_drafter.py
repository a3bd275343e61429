"""Drafter recipe ablation: one row per change, the same budget and the same regenerated sequences, evaluated on
the same prompts; one table of τ per task, task τ ÷ holdout τ and training tokens/s.

    python bench/ablate_drafter.py RECIPE.yaml --target DIR --out DIR [--row 'NAME: key=value ...' ...]
        [--rows ROWS.yaml] [--set key=value ...] [--sequences FILE] [--tasks humaneval,heldout_code,...]
        [--num-prompts 16] [--max-tokens 128] [--max-prompt-tokens 256] [--temperature 0] [--chat] [--corpus DIR]
        [--threads N]
        [--train-cmd 'python -m train'] [--overwrite | --resume]

Rows: DEFAULT_ROWS unless --row / --rows (a YAML mapping NAME: [key=value, ...]) name them; each is a list of recipe
overrides on top of RECIPE and --set. The budget (--set max_steps=... max_minutes=...) is the same for every row.
Same data: the first row that overrides no `data.` field trains as the recipe says (regenerating its sequences, or
starting from --sequences FILE) and every other such row starts from a copy of its sequences.pt with resume=true
(no checkpoint yet: step 0, the sequences read back). A row that overrides a `data.` field (e.g.
data.regenerate.chat_prompts) regenerates its own, but for data.order (which sequences a step draws).
Eval: one `python -m eval` over every row's drafter (<row>/best when the recipe keeps one, else <row>/final), the
target alone once. holdout τ: the trainer's holdout τ of that drafter (final_metrics.json). Training tokens/s: the
rows x sequence length the target reads per step, over the steps after the first (which compiles), from
train_log.jsonl. Writes <out>/ablation.json and <out>/ablation.md (rows under <out>/rows/NAME, eval under <out>/eval).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark.config import RecipeError, load_recipe  # noqa: E402

DEFAULT_ROWS = {
    "baseline": [],  # the recipe (k3-mini: CE + KL, position decay γ = 4, Muon)
    "ce": ["loss.kl=0"],  # hard targets alone (the target's argmax)
    "kl": ["loss.ce=0"],  # soft targets alone
    "tv-confidence": ["loss.confidence_target=tv"],
    "rejection-anchors": ["anchors=rejection"],
    # the DFlash layout takes Qwen3 layers (the k3 backbone has only the dspark layout); block 9 = 8 drafts
    "dflash": ["drafter.backbone=qwen3", "drafter.mode=dflash", "drafter.block_size=9"],
    "adamw": ["optim.optimizer=adamw"],
}
DEFAULT_TASKS = "humaneval,heldout_code,creative,heldout_prose,chat"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def parse_rows(specs: list[str], rows_file: str | None = None,
               default: dict[str, list[str]] = DEFAULT_ROWS) -> dict[str, list[str]]:
    """Rows from a YAML file (NAME: [key=value, ...]) and 'NAME: key=value ...' specs; `default` when neither."""
    rows: dict[str, list[str]] = {}
    if rows_file:
        data = yaml.safe_load(Path(rows_file).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"--rows {rows_file}: expected a mapping NAME: [key=value, ...]")
        for name, ov in data.items():
            rows[str(name)] = [ov] if isinstance(ov, str) else list(ov or [])
    for spec in specs:
        name, _, ov = spec.partition(":")
        rows[name.strip()] = shlex.split(ov)
    rows = rows or dict(default)
    for name, ov in rows.items():
        if not NAME.fullmatch(name):
            raise ValueError(f"row {name!r}: expected a name of letters, digits, '.', '_', '+', '-'")
        bad = [o for o in ov if "=" not in o]
        if bad:
            raise ValueError(f"row {name}: {bad[0]!r} is not a key=value recipe override")
    return rows


SAME_SEQUENCES = {"data.order"}  # data fields that do not change the sequences (which a step draws, not what)


def own_data(overrides: list[str]) -> bool:
    keys = (o.split("=", 1)[0].strip() for o in overrides)
    return any(k.startswith("data.") and k not in SAME_SEQUENCES for k in keys)


def step_rate(run: Path, skip: int = 0) -> tuple[int, float] | None:
    """(steps timed, steps/s) over a run's logged steps from `skip` on (0: after the first logged one); None when
    fewer than two were logged there."""
    lines = [json.loads(ln) for ln in (run / "train_log.jsonl").read_text().splitlines()]
    kept = [ln for ln in lines if ln["step"] >= skip]
    if len(kept) < 2 or kept[-1]["seconds"] <= kept[0]["seconds"]:
        return None
    steps = kept[-1]["step"] - kept[0]["step"]
    return steps, steps / (kept[-1]["seconds"] - kept[0]["seconds"])


def tokens_per_s(run: Path, batch_size: int) -> float | None:
    """Target-side tokens (rows x sequence length) per second over the logged steps after the first."""
    rate = step_rate(run)
    return None if rate is None else rate[1] * batch_size * torch.load(run / "sequences.pt")["train"].shape[1]


def run_logged(cmd: list[str], log_path: Path | str) -> str | None:
    """Run cmd, its output to log_path -> None, or "training exit N: <the log's last line>" when it failed."""
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc == 0:
        return None
    tail = Path(log_path).read_text().strip().splitlines()[-1:] or ["(no output)"]
    return f"training exit {rc}: {tail[0]}"


def train_row(a, name: str, overrides: list[str], run: Path, sequences: Path | None) -> dict:
    """One row's training run (output in <run>.log); -> its facts for the table, or {"error": ...}. With --resume a
    row that finished before is not trained again."""
    if a.resume and (run / "final_metrics.json").is_file():
        want = asdict(load_recipe(a.recipe, [*a.set, *overrides, f"output_dir={run}"]))
        had = json.loads((run / "recipe.json").read_text())
        differ = sorted(k for k in want if k not in ("resume", "overwrite", "log") and had.get(k) != want[k])
        if differ:
            return {"error": f"--resume: trained with another recipe ({', '.join(differ)} differ); use --overwrite"}
        print(f"[ablate] {name}: trained before, kept", file=sys.stderr)
        return row_facts(a, overrides, run)
    shutil.rmtree(run, ignore_errors=True)
    resume = []
    run.mkdir(parents=True)
    if sequences is not None:
        shutil.copy(sequences, run / "sequences.pt")
        resume = ["resume=true"]
    cmd = [*shlex.split(a.train_cmd), a.recipe, f"target={a.target}", *a.set, *overrides, f"output_dir={run}",
           "log.wandb_mode=disabled", *resume]
    print(f"[ablate] {name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    error = run_logged(cmd, f"{run}.log")
    if error is not None:
        print(f"[ablate] {name}: {error}", file=sys.stderr)
        return {"error": error}
    return row_facts(a, overrides, run)


def row_facts(a, overrides: list[str], run: Path) -> dict:
    """A finished row's facts for the table: its drafter dir, holdout τ, steps, training tokens/s."""
    m = json.loads((run / "final_metrics.json").read_text())
    recipe = load_recipe(a.recipe, [*a.set, *overrides, f"output_dir={run}"])
    use_best = (run / "best").is_dir() and "best" in m
    drafter = run / ("best" if use_best else "final")
    ev = m["final"]
    if use_best:  # the best checkpoint's evaluation (kept by another metric: find it in the history)
        ev = m["best"] if "tau" in m["best"] else next(h for h in m["history"] if h["step"] == m["best"]["step"])
    return {"overrides": overrides, "mode": recipe.drafter.mode, "drafter": str(drafter), "steps": m["steps"],
            "train_minutes": m["train_minutes"], "holdout_tau": ev["tau"], "holdout_tau_walked": ev.get("tau_walked"),
            "holdout_ce": m["final"].get("ce"),
            "train_tokens_per_s": tokens_per_s(run, recipe.optim.batch_size)}


def evaluate(a, rows: dict[str, dict], out: Path) -> dict:
    done = {n: r for n, r in rows.items() if "error" not in r}
    if not done:
        return {}
    cmd = [sys.executable, "-m", "eval", "--target", a.target, "--out", str(out), "--tasks", a.tasks,
           "--num-prompts", str(a.num_prompts), "--max-tokens", str(a.max_tokens),
           "--max-prompt-tokens", str(a.max_prompt_tokens), "--temperature", str(a.temperature)]
    cmd += ["--chat"] if a.chat else []
    cmd += ["--corpus", a.corpus] if a.corpus else []
    cmd += ["--threads", str(a.threads)] if a.threads else []
    for n, r in done.items():
        cmd += ["--drafter", r["drafter"], "--name", n]
    print(f"[ablate] eval: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    with open(out.parent / "eval.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"eval failed (exit {rc}); see {out.parent / 'eval.log'}")
    report = json.loads((out / "report.json").read_text())
    return {t: {n: e["drafters"][n]["tau"] for n in done} for t, e in report["tasks"].items()}


def table(rows: dict[str, dict], taus: dict[str, dict[str, float]]) -> dict:
    """rows[name] gets tau (per task) and tau_over_holdout; a dflash row adds over_dflash to the others."""
    dflash = next((n for n, r in rows.items() if r.get("mode") == "dflash" and "error" not in r), None)
    for n, r in rows.items():
        if "error" in r:
            continue
        r["tau"] = {t: taus[t][n] for t in taus}
        r["tau_over_holdout"] = {t: v / r["holdout_tau"] for t, v in r["tau"].items()}
    for n, r in rows.items():
        if dflash is not None and n != dflash and "error" not in r:
            r["over_dflash"] = {t: v / rows[dflash]["tau"][t] for t, v in r["tau"].items()}
    return {"tasks": list(taus), "dflash_row": dflash, "rows": rows}


def markdown(result: dict, a) -> str:
    tasks, rows = result["tasks"], result["rows"]
    f = lambda v, p=2: "–" if v is None else f"{v:.{p}f}"  # noqa: E731
    out = [f"Recipe `{a.recipe}`, target `{a.target}`, common overrides `{' '.join(a.set) or '-'}`; eval "
           f"{a.num_prompts} prompts per task, {a.max_tokens} new tokens, "
           f"{'greedy' if a.temperature == 0 else f'temperature {a.temperature}'}.", "",
           "| row | overrides | steps | train tok/s | holdout τ | holdout τ walked | "
           + " | ".join(f"τ {t}" for t in tasks) + " | " + " | ".join(f"{t} ÷ holdout" for t in tasks) + " |",
           "|---|---|--:|--:|--:|--:|" + "--:|" * (2 * len(tasks))]
    for n, r in rows.items():
        ov = " ".join(f"`{o}`" for o in r.get("overrides", [])) or "–"
        if "error" in r:
            out.append(f"| {n} | {ov} | {r['error']} |")
            continue
        out.append(f"| {n} | {ov} | {r['steps']} | {f(r['train_tokens_per_s'], 0)} | {f(r['holdout_tau'])} | "
                   f"{f(r.get('holdout_tau_walked'))} | "
                   + " | ".join(f(r["tau"][t]) for t in tasks) + " | "
                   + " | ".join(f(r["tau_over_holdout"][t]) for t in tasks) + " |")
    if result["dflash_row"] is not None:
        out += ["", f"τ ÷ τ of the DFlash row ({result['dflash_row']}):", "",
                "| row | " + " | ".join(tasks) + " |", "|---|" + "--:|" * len(tasks)]
        out += [f"| {n} | " + " | ".join(f(r["over_dflash"][t]) for t in tasks) + " |"
                for n, r in rows.items() if "over_dflash" in r]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/ablate_drafter.py", description=__doc__.split("\n")[0])
    p.add_argument("recipe")
    p.add_argument("--target", required=True, help="target checkpoint dir")
    p.add_argument("--out", required=True)
    p.add_argument("--row", action="append", default=[], help="'NAME: key=value ...' (repeatable)")
    p.add_argument("--rows", help="YAML mapping NAME: [key=value, ...]")
    p.add_argument("--set", nargs="*", default=[], help="overrides for every row (the budget: max_steps, max_minutes)")
    p.add_argument("--sequences", help="a sequences.pt to start the shared-data rows from (no regeneration)")
    p.add_argument("--tasks", default=DEFAULT_TASKS)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="eval: sampling temperature (0 = greedy)")
    p.add_argument("--chat", action="store_true", help="eval: chat tasks' prompts in the chat template")
    p.add_argument("--corpus", help="eval: corpus dir (for code_holdout / prose_holdout)")
    p.add_argument("--threads", type=int, help="eval: torch CPU threads")
    p.add_argument("--train-cmd", default=f"{shlex.quote(sys.executable)} -m train",
                   help="how to run training (e.g. accelerate launch ... -m train)")
    p.add_argument("--overwrite", action="store_true", help="delete an earlier ablation in --out first")
    p.add_argument("--resume", action="store_true", help="keep the rows an earlier ablation in --out finished (same "
                                                          "recipe and --set), train the others, evaluate all again")
    a = p.parse_args(argv)
    out = Path(a.out)
    try:
        rows = parse_rows(a.row, a.rows)
        for name, ov in rows.items():  # every row's recipe validates before any training
            try:
                load_recipe(a.recipe, [*a.set, *ov, f"output_dir={out / 'rows' / name}"])
            except RecipeError as e:
                raise ValueError(f"row {name}: {e}") from None
        if not Path(a.target).is_dir():
            raise FileNotFoundError(f"--target {a.target}: no such directory")
        if a.sequences and not Path(a.sequences).is_file():
            raise FileNotFoundError(f"--sequences {a.sequences}: no such file")
        earlier = [q for q in (out / "rows", out / "eval", out / "ablation.json") if q.exists()]
        if a.resume and a.overwrite:
            raise ValueError("--resume, --overwrite: choose one")
        if earlier and not (a.overwrite or a.resume):
            raise ValueError(f"--out {out} holds an earlier ablation ({', '.join(q.name for q in earlier)}); pass "
                             "--resume to keep its finished rows, --overwrite to delete it, or choose another --out")
    except (ValueError, FileNotFoundError, OSError, yaml.YAMLError) as e:
        print(f"ablate_drafter: error: {e}", file=sys.stderr)
        return 2
    for q in (out / "eval",) if a.resume else (out / "rows", out / "eval"):
        shutil.rmtree(q, ignore_errors=True)
    (out / "rows").mkdir(parents=True, exist_ok=True)
    shared = Path(a.sequences) if a.sequences else None
    results = {}
    for name, ov in rows.items():
        run = out / "rows" / name
        results[name] = train_row(a, name, ov, run, None if own_data(ov) else shared)
        if shared is None and not own_data(ov) and "error" not in results[name]:
            shared = run / "sequences.pt"  # the next shared-data rows start from these
        if "error" not in results[name]:
            r = results[name]
            print(f"[ablate] {name}: {r['steps']} steps, holdout τ {r['holdout_tau']:.3f}, "
                  f"{r['train_tokens_per_s'] or 0:.0f} train tok/s", file=sys.stderr, flush=True)
    try:
        taus = evaluate(a, results, out / "eval")
    except RuntimeError as e:
        print(f"[ablate] {e}", file=sys.stderr)
        taus, results["eval"] = {}, {"error": str(e)}
    result = table(results, taus)
    result["config"] = {"recipe": a.recipe, "target": a.target, "set": a.set, "tasks": a.tasks.split(","),
                        "num_prompts": a.num_prompts, "max_tokens": a.max_tokens,
                        "max_prompt_tokens": a.max_prompt_tokens, "temperature": a.temperature,
                        "chat": a.chat}
    (out / "ablation.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result, a)
    (out / "ablation.md").write_text(md)
    print(md, end="")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
