"""python -m eval: acceptance (tau, alpha, per position), speedup and losslessness per task, against task entropy.

    python -m eval --target DIR --drafter DIR [--drafter DIR2 ...] [--name NAME ...] --out DIR
                   [--tasks humaneval,code_holdout,...] [--task-file F.jsonl ...] [--corpus DIR]
                   [--num-prompts 10] [--max-tokens 64] [--max-prompt-tokens 128] [--temperature 0]
                   [--num-speculative-tokens K] [--chat] [--seed 0] [--ignore-eos] [--repeats 1] [--threads N]
    python -m eval --server URL [--target DIR] [--name NAME] --out DIR ...   # a running OpenAI server

Local mode runs the target alone (AR) and with each drafter on the same warmed engines and prompts, batch 1, and
computes the target's teacher-forced entropy on the outputs. Remote mode sends each task's prompts to
/v1/completions and reads the deltas of vLLM's spec-decode counters from /metrics; with --target the entropy is
computed locally on the re-tokenized outputs. Writes report.json / report.md / two PNGs (eval/report.py) and prints
the markdown table.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import time
from pathlib import Path

from dspark.device import DTYPES, resolve_device, resolve_dtype
from eval import entropy as ent
from eval import measure as M
from eval import report as R
from eval.tasks import TASKS, Task, resolve_tasks, truncate_ids


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m eval", description=__doc__.split("\n")[0])
    p.add_argument("--target", help="target checkpoint dir (HF layout with tokenizer)")
    p.add_argument("--drafter", action="append", default=[], help="drafter dir (vLLM dspark/dflash); repeatable")
    p.add_argument("--name", action="append", default=[], help="display name per --drafter (default: dir name)")
    p.add_argument("--out", required=True, help="output dir for report.json, report.md and the PNGs")
    p.add_argument("--tasks", help=f"comma-separated built-in tasks; valid: {','.join(TASKS)}")
    p.add_argument("--task-file", action="append", default=[], help="json/jsonl of {task?, prompt}; repeatable")
    p.add_argument("--corpus", help="dspark.data corpus dir (enables code_holdout, prose_holdout)")
    p.add_argument("--num-prompts", type=int, default=10, help="prompts per task, evenly spread (0 = all)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=128, help="keep the last N prompt tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-speculative-tokens", type=int, help="default: each drafter's num_drafts")
    p.add_argument("--chat", action="store_true", help="wrap chat tasks' prompts in the tokenizer's chat template")
    p.add_argument("--seed", type=int, default=0, help="per-prompt sampling seed base (T > 0)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--repeats", type=int, default=1, help="time each prompt this many times, keep the fastest")
    p.add_argument("--threads", type=int, help="torch CPU threads (1 is fastest for tiny models on a busy machine)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--server", help="measure a running OpenAI-compatible server instead of local engines")
    p.add_argument("--model", help="--server: model name (default: the first of /v1/models)")
    a = p.parse_args(argv)
    if a.num_prompts < 0 or a.max_tokens < 1 or a.max_prompt_tokens < 1 or a.temperature < 0 or a.repeats < 1:
        p.error("expected --num-prompts >= 0, --max-tokens >= 1, --max-prompt-tokens >= 1, --temperature >= 0, "
                "--repeats >= 1")
    if a.server is None and (a.target is None or not a.drafter):
        p.error("local mode needs --target DIR and at least one --drafter DIR (or use --server URL)")
    if a.name and len(a.name) != max(len(a.drafter), 1):
        p.error(f"--name: give one per --drafter ({len(a.drafter)}), got {len(a.name)}")
    return a


def versions(root: Path = Path(__file__).parent) -> dict:
    """The packages' versions and the checkout at root: its commit, and whether tracked files differ from it."""
    import importlib.metadata as md

    def v(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None

    head = git("rev-parse", "HEAD")
    commit = (head.stdout.strip() or None) if head is not None and head.returncode == 0 else None
    # tracked files that differ from that commit (a copy of a newer tree under an older .git, edits not committed):
    # the commit alone does not name the code that ran
    diff = git("diff", "--quiet", "HEAD", "--") if commit else None
    dirty = None if diff is None or diff.returncode not in (0, 1) else diff.returncode == 1
    return {"python": platform.python_version(), "torch": v("torch"), "transformers": v("transformers"),
            "dspark": v("dspark"), "git_commit": commit, "git_dirty": dirty}


def encode(task: Task, tokenizer, chat: bool, max_prompt_tokens: int) -> list[list[int]]:
    """Prompt ids: chat template (when asked and available) or the raw prefix, then keep the last tokens."""
    out = []
    for p in task.prompts:
        if chat and task.chat and getattr(tokenizer, "chat_template", None):
            p = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True)
        out.append(truncate_ids(tokenizer.encode(p, add_special_tokens=False), max_prompt_tokens))
    return out


def task_entry(task: Task, ents: list[list[float]], num_tokens: int, tok_s, seconds, outputs: list[list[int]]
               ) -> dict:
    """A task's report entry: the target's entropy on its outputs, their 4-gram repeat share, AR's speed."""
    flat = [h for e in ents for h in e]
    return {"entropy": ent.mean(flat), "entropy_ci95": ent.bootstrap_ci(ents), "repeats": M.mean_repeats(outputs),
            "num_prompts": len(task.prompts),
            "num_tokens": num_tokens, "source": task.source, "chat": task.chat,
            "ar": {"tok_s": tok_s, "seconds": seconds}, "drafters": {}}


def run_local(a, tasks: list[Task], names: list[str], log=print) -> dict:
    import torch

    from dspark.checkpoint import load_drafter, load_target
    from dspark.engine import Engine

    torch.manual_seed(a.seed)
    if a.threads:
        torch.set_num_threads(a.threads)
    target = load_target(a.target, device=a.device, dtype=a.dtype)
    tok = getattr(target, "tokenizer", None)
    if tok is None:
        raise ValueError(f"--target {a.target}: no tokenizer.json in the checkpoint; eval needs one for text prompts")
    drafters = [load_drafter(d, target) for d in a.drafter]
    ks = [a.num_speculative_tokens or d.config.num_drafts for d in drafters]
    prompts = {t.name: encode(t, tok, a.chat, a.max_prompt_tokens) for t in tasks}
    longest = max(len(p) for ps in prompts.values() for p in ps)
    mml = min(target.config.max_position_embeddings, longest + a.max_tokens + max(ks) + 1)
    engines = [Engine(target, None, tokenizer=tok, max_batch_size=1, max_model_len=mml)]
    engines += [Engine(target, d, num_speculative_tokens=k, tokenizer=tok, max_batch_size=1, max_model_len=mml)
                for d, k in zip(drafters, ks)]
    first = next(p for ps in prompts.values() for p in ps)
    for e in engines:  # warm up (lazy allocations, first-call overheads) outside the timed runs
        M.generate_timed(e, first, M.sampling(2, a.temperature, a.seed, 0))
    cache: dict[tuple, list[float]] = {}

    def entropies(ps, outs):
        res = []
        for p, g in zip(ps, outs):
            key = (tuple(p), tuple(g))
            if key not in cache:
                cache[key] = ent.generated_entropies(target, p, g)
            res.append(cache[key])
        return res

    logs = {n: M.DrafterLog() for n in names}
    ar_total, all_h = M.DrafterLog(), []
    identical = {n: 0 for n in names}
    rep_tasks = {}
    for task in tasks:
        ps = prompts[task.name]
        runs = [M.Run() for _ in engines]  # [AR, drafter...], interleaved prompt by prompt
        for i, ids in enumerate(ps):
            sp = M.sampling(a.max_tokens, a.temperature, a.seed, i, a.ignore_eos)
            for run, engine in zip(runs, engines):
                run.add(*M.generate_timed(engine, ids, sp, a.repeats))
        ar = runs[0]
        ar_h = entropies(ps, ar.token_ids)
        all_h += [h for e in ar_h for h in e]
        ar_total.tokens += ar.num_tokens
        ar_total.seconds += ar.seconds
        entry = task_entry(task, ar_h, ar.num_tokens, ar.tok_s, ar.seconds, ar.token_ids)
        for name, run in zip(names, runs[1:]):
            hs = entropies(ps, run.token_ids)
            lg = logs[name]
            for acc, dr, h in zip(run.accepted, run.drafted, hs):
                lg.events += M.token_events(acc, dr, h)
                lg.accepted += acc
                lg.drafted += dr
            lg.tokens += run.num_tokens
            lg.seconds += run.seconds
            same = sum(x == y for x, y in zip(run.token_ids, ar.token_ids))
            identical[name] += same
            stats = M.step_stats([x for r in run.accepted for x in r], [x for r in run.drafted for x in r])
            steps, committed = zip(*map(M.prompt_steps, run.accepted, run.drafted))
            entry["drafters"][name] = {
                **stats, "tau_ci95": M.pooled_ratio_ci95([committed], [steps]),
                "per_prompt": {"steps": list(steps), "committed": list(committed)},
                "num_tokens": run.num_tokens, "tok_s": run.tok_s,
                "speedup": run.tok_s / ar.tok_s if run.tok_s and ar.tok_s else None,
                "identical_to_ar": same if a.temperature == 0 else None,
                "entropy": ent.mean([h for e in hs for h in e])}
        rep_tasks[task.name] = entry
        log(f"[eval] {task.name}: H={R._f(entry['entropy'], 3)} "
            + " ".join(f"τ[{n}]={R._f(d['tau'])}" for n, d in entry["drafters"].items()), file=sys.stderr)
    overall = {}
    for name in names:
        lg = logs[name]
        tok_s, ar_tok_s = lg.tokens / lg.seconds if lg.seconds else None, ar_total.tokens / ar_total.seconds
        overall[name] = {**M.step_stats(lg.accepted, lg.drafted), "tok_s": tok_s,
                         "speedup": tok_s / ar_tok_s if tok_s and ar_tok_s else None,
                         "identical_to_ar": identical[name] if a.temperature == 0 else None,
                         "num_prompts": sum(len(t.prompts) for t in tasks)}
    drafters_cfg = [{"name": n, "path": d, "mode": dr.config.mode, "num_speculative_tokens": k}
                    for n, d, dr, k in zip(names, a.drafter, drafters, ks)]
    return {"drafters": drafters_cfg, "tasks": rep_tasks, "overall": overall,
            "entropy_bins": R.entropy_bins(all_h, {n: logs[n].events for n in names}),
            "spearman": {n: M.spearman([h for _, h, _ in logs[n].events], [float(x) for *_, x in logs[n].events])
                         for n in names}}


def run_remote(a, tasks: list[Task], name: str, log=print) -> dict:
    server = M.Server(a.server, a.model)
    target = tok = None
    if a.target:
        from dspark.checkpoint import load_target

        target = load_target(a.target)
        tok = target.tokenizer
        if tok is None:
            raise ValueError(f"--target {a.target}: no tokenizer.json in the checkpoint; eval needs one for entropy")
    rep_tasks, total_before, total_tok, total_s = {}, server.counters(), 0, 0.0
    for task in tasks:
        ps = ([tok.decode(ids) for ids in encode(task, tok, a.chat, a.max_prompt_tokens)] if tok is not None
              else [p[-4 * a.max_prompt_tokens:] for p in task.prompts])  # no tokenizer: ~4 chars per token
        before, texts, n_tok, secs = server.counters(), [], 0, 0.0
        for i, p in enumerate(ps):
            t0 = time.perf_counter()
            text, n = server.complete(p, a.max_tokens, a.temperature, a.seed + i if a.temperature > 0 else None)
            secs += time.perf_counter() - t0
            texts.append(text)
            n_tok += n
        c = M.counters_delta(before, server.counters())
        ents, outs = [], []
        if target is not None:
            ids = [tok.encode(p, add_special_tokens=False) for p in ps]
            outs = [tok.encode(t, add_special_tokens=False) for t in texts]
            ents = [ent.generated_entropies(target, p, o) for p, o in zip(ids, outs)]
        entry = task_entry(task, ents, n_tok, None, None, outs)
        entry["drafters"][name] = {**M.stats_from_counters(c), "num_tokens": n_tok,
                                   "tok_s": n_tok / secs if secs else None, "speedup": None,
                                   "identical_to_ar": None, "entropy": entry["entropy"]}
        rep_tasks[task.name] = entry
        total_tok, total_s = total_tok + n_tok, total_s + secs
        log(f"[eval] {task.name}: τ={R._f(entry['drafters'][name]['tau'])}", file=sys.stderr)
    total_c = M.counters_delta(total_before, server.counters())
    overall = {name: {**M.stats_from_counters(total_c), "tok_s": total_tok / total_s if total_s else None,
                      "speedup": None, "identical_to_ar": None, "num_prompts": sum(len(t.prompts) for t in tasks)}}
    return {"drafters": [{"name": name, "path": None, "mode": None, "num_speculative_tokens": None}],
            "tasks": rep_tasks, "overall": overall, "entropy_bins": [], "spearman": {name: None}}


def task_names(tasks: str | None) -> list[str] | None:
    """--tasks as a list (None: the default tasks); an empty value or unknown names are errors naming them all."""
    if tasks is None:
        return None
    names = [n.strip() for n in tasks.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--tasks: empty; give comma-separated task names from {','.join(TASKS)} (or leave the flag "
                         "out for the default tasks)")
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(f"--tasks: unknown task{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; valid: "
                         f"{', '.join(TASKS)} (or add your own with --task-file)")
    return names


def check_out(out: str) -> None:
    """--out must be a directory or creatable as one: no file at it or at any of its parents."""
    p = Path(out)
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                raise ValueError(f"--out {out}: {q} is a file, not a directory")
            return


def main(argv=None, log=print) -> int:
    a = parse_args(argv)
    try:
        for path, what in [(a.target, "--target"), (a.corpus, "--corpus")] + [(d, "--drafter") for d in a.drafter]:
            if path is not None and not Path(path).is_dir():
                raise FileNotFoundError(f"{what} {path}: no such directory")
        check_out(a.out)
        names_arg = task_names(a.tasks)
        if a.server is None:
            a.device = resolve_device(a.device)
            a.dtype = resolve_dtype(a.dtype, a.device)
        corpus = None
        if a.corpus:
            from dspark.data.corpus import load_corpus

            corpus = load_corpus(a.corpus)
        tasks = resolve_tasks(names_arg, corpus, a.task_file, a.num_prompts or None)
        if a.server:
            result = run_remote(a, tasks, (a.name or ["server"])[0], log)
        else:
            names = a.name or [Path(d).name or str(d) for d in a.drafter]
            names = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
            result = run_local(a, tasks, names, log)
    except (FileNotFoundError, ValueError, ConnectionError) as e:
        print(f"python -m eval: error: {e}", file=sys.stderr)
        return 2
    config = {"mode": "remote" if a.server else "local", "target": a.target, "server": a.server,
              "drafters": result.pop("drafters"), "tasks": [t.name for t in tasks],
              "num_prompts": a.num_prompts or None, "max_tokens": a.max_tokens,
              "max_prompt_tokens": a.max_prompt_tokens, "temperature": a.temperature, "seed": a.seed,
              "chat": a.chat, "repeats": a.repeats, "threads": a.threads, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "versions": versions()}
    report = {"schema_version": R.SCHEMA_VERSION, "config": config, **result}
    paths = R.write_report(report, a.out)
    log(paths["report.md"].read_text(), end="")
    log(f"[eval] wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
