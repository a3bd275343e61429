"""The held-out tasks (heldout_code, heldout_prose): shipped records, their form, their card, no overlap with the
corpus, a rebuild from the pinned packages, and `python -m eval --tasks heldout_code,heldout_prose`. Tests marked
`sources` read the held-out tasks' installed sources (`make data-sources`)."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from dspark.data.sources import SOURCES
from eval import heldout as H
from eval import tasks as T
from eval.__main__ import main
from eval.overlap import WINDOW, WindowIndex, normalize, window_hashes
from tests.test_eval import build_tiny_models

MANIFEST = json.loads((T.HELDOUT_DIR / "manifest.json").read_text(encoding="utf-8"))
CODE = T.heldout_rows("heldout_code")
PROSE = T.heldout_rows("heldout_prose")


def reference(row: dict) -> str:
    return row["prompt"] + row.get("canonical_solution", row.get("continuation", ""))


# ------------------------------------------------------------------------------------------ the overlap check
def test_window_hashes_match_the_polynomial_and_scan_finds_rewrapped_spans():
    text = "def f(x):\n    return x  # ünïcode ∑\n" * 3
    h = window_hashes(text, 7)
    expect = [sum(ord(c) * pow(1_000_003, j, 2**64) for j, c in enumerate(text[i: i + 7])) % 2**64
              for i in range(len(text) - 6)]
    assert h.tolist() == expect and len(window_hashes("short", 7)) == 0
    span = "the quick brown fox jumps over the lazy dog, then naps in the warm sun"
    index = WindowIndex(["nothing shared here " * 5, "PREFIX; " + span.replace(" ", "\n    ", 3), "tiny"])
    docs = [("src", "a.txt", "xx " + span + " yy"), ("src", "b.txt", span[:30]), ("src", "c.txt", span[30:])]
    hits = index.scan(docs)
    assert [(h.record, h.path) for h in hits] == [(1, "a.txt")]  # b + c hold the span only across a document edge
    assert len(hits[0].window) == WINDOW and hits[0].window in normalize(f" {span} ")


# ------------------------------------------------------------------------------------------ shipped records
def test_heldout_tasks_load_offline_with_the_card_counts():
    counts = MANIFEST["counts"]
    assert MANIFEST["format"] == H.FORMAT and counts["heldout_code"] >= 150 and counts["heldout_prose"] == 200
    code, prose = T.build_task("heldout_code"), T.build_task("heldout_prose")
    assert len(code.prompts) == counts["heldout_code"] and len(prose.prompts) == counts["heldout_prose"]
    assert not code.chat and not prose.chat and "eval/data/heldout" in code.source
    picked = T.resolve_tasks(["heldout_code", "heldout_prose"], num_prompts=20)
    assert [len(t.prompts) for t in picked] == [20, 20]
    for name, rows in (("heldout_code", CODE), ("heldout_prose", PROSE)):
        assert [r["task_id"] for r in rows] == [f"{name}/{i}" for i in range(len(rows))]
        assert len({r["id"] for r in rows}) == len(rows)
        per_source = {s.get("dist", s.get("package")): s["prompts"] for s in MANIFEST["sources"][name]}
        assert sum(per_source.values()) == len(rows)
        for src, n in per_source.items():
            assert sum(r["source"].startswith(src + ("==" if name == "heldout_code" else " ")) for r in rows) == n
    assert (T.HELDOUT_DIR / "README.md").read_text(encoding="utf-8") == H.card(MANIFEST)  # the card is current
    for p in MANIFEST["sources"]["heldout_code"]:
        assert p["licence"] in ("MIT", "BSD-3-Clause")
        assert "Copyright" in (T.HELDOUT_DIR / "licences" / f"{p['dist']}-LICENSE").read_text(encoding="utf-8")
    assert {d["licence"] for d in MANIFEST["sources"]["heldout_prose"]} == {"Public-Domain"}
    with pytest.raises(FileNotFoundError, match="python -m eval.heldout"):
        T.heldout_rows("heldout_code", Path("/nonexistent"))


def test_heldout_code_prompts_are_in_humaneval_form():
    """Each prompt parses once a body is added and ends on its function's docstring line: imports, then one def
    whose docstring closes on the prompt's last line; the canonical solution continues that function."""
    for r in CODE:
        prompt, body = r["prompt"], r["canonical_solution"]
        n_prompt = prompt.count("\n")
        first = next(line for line in body.splitlines() if line.strip())
        indent = first[: len(first) - len(first.lstrip(" "))]
        assert prompt.endswith(('"""\n', "'''\n")) and 1 <= len(indent) <= 8, r["id"]
        for source in (prompt + indent + "pass\n", prompt + body):
            fn = ast.parse(source).body[-1]
            assert isinstance(fn, ast.FunctionDef) and fn.name == r["entry_point"], r["id"]
            doc = fn.body[0]
            assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
            assert doc.end_lineno == n_prompt < fn.body[1].lineno, r["id"]
        assert all(isinstance(n, ast.Import | ast.ImportFrom) for n in ast.parse(prompt + indent + "pass\n").body[:-1])
        assert H.BODY_LINES[0] <= len(body.splitlines()) <= H.BODY_LINES[1], r["id"]


def test_heldout_prose_prompts_are_entry_prefixes():
    lo, hi = H.ENTRY_CHARS
    for r in PROSE:
        text = r["prompt"] + r["continuation"]
        assert lo <= len(text) <= hi and r["prompt"].endswith("\n") and r["continuation"].strip(), r["id"]
        assert len(r["prompt"]) <= 0.6 * len(text), r["id"]
        assert r["prompt"] == T.prefix_of(text, r["id"].replace(":", "/", 1))


# ------------------------------------------------------------------------------------------ disjoint from the corpus
@pytest.mark.sources
def test_heldout_sources_are_not_corpus_sources_and_share_no_window_with_the_quickstart_corpus():
    """The held-out packages are no corpus source's package, none of their files is a document of the quickstart
    corpus's source (python_stdlib, all of it), and no shipped record shares a 50-char window with that source
    (a planted record copied from a stdlib file, re-indented, is found: the check can fail)."""
    corpus_packages = {s.package for s in SOURCES.values()}
    assert not corpus_packages & ({p.dist for p in H.CODE_PACKAGES} | {d.package for d in H.PROSE_SOURCES})
    dropped = {d["id"] for d in MANIFEST["dropped"]}
    assert not dropped & {r["id"] for r in CODE + PROSE}
    stdlib = SOURCES["python_stdlib"]
    root = stdlib.root()
    docs = list(stdlib.documents())
    files = {(root / path).resolve() for path, _ in docs}
    held = [f.resolve() for p in H.CODE_PACKAGES for f in H.package_dir(p).rglob("*.py")]
    assert held and not files & set(held)
    json_init = next(text for path, text in docs if path == "json/__init__.py")
    planted = "\n".join("  " + line for line in json_init[2000:2300].splitlines())
    records = [reference(r) for r in CODE + PROSE] + [planted]
    hits = WindowIndex(records).scan(("python_stdlib", path, text) for path, text in docs)
    assert {h.record for h in hits} == {len(records) - 1}
    assert MANIFEST["overlap_check"]["window"] == WINDOW
    assert set(MANIFEST["overlap_check"]["corpus_sources"]) == set(SOURCES)  # the build checked every source


@pytest.mark.sources
def test_rebuild_from_the_pinned_packages_gives_the_shipped_records():
    code, prose, sources = H.final_records({d["id"] for d in MANIFEST["dropped"]})
    assert code == CODE and prose == PROSE and sources == MANIFEST["sources"]
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps boltons==0\.0\.1"):
        H.package_dir(H.CodePackage("boltons", "0.0.1", "boltons", "BSD-3-Clause"))


# ------------------------------------------------------------------------------------------ python -m eval
def test_cli_runs_the_heldout_tasks(tmp_path):
    root, out = build_tiny_models(tmp_path), tmp_path / "rep"
    rc = main(["--target", str(root / "target"), "--drafter", str(root / "dspark"), "--out", str(out),
               "--tasks", "heldout_code,heldout_prose", "--num-prompts", "2", "--max-tokens", "6",
               "--max-prompt-tokens", "32", "--ignore-eos", "--threads", "1"])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["tasks"]) == {"heldout_code", "heldout_prose"}
    for t in rep["tasks"].values():
        assert t["num_prompts"] == 2 and t["num_tokens"] == 12 and t["drafters"]["dspark"]["identical_to_ar"] == 2
