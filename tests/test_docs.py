"""The repository's cross-references resolve inside it: every `docs/<name>.md` a file cites exists, and every markdown
link to a section of a repository file (`FILE.md#anchor`) names one of that file's headings."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("dspark", "train", "serve", "eval", "bench", "tests", "recipes", "docs", "scripts")
SUFFIXES = {".py", ".md", ".yaml", ".sh", ".toml"}


def _files() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    for top in SCANNED:
        found += [p for p in sorted((ROOT / top).rglob("*")) if p.suffix in SUFFIXES and "data" not in p.parts]
    return [p for p in found if p.is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", md.read_text(), re.M)}


def test_slug_follows_github():
    assert slug("KDA decode / verify kernel (H200)") == "kda-decode--verify-kernel-h200"
    assert slug("Trainer τ against engine τ: anchor selection (CPU)") == "trainer-τ-against-engine-τ-anchor-selection-cpu"


def test_cited_docs_exist():
    cited = {(p.relative_to(ROOT).as_posix(), name) for p in _files()
             for name in re.findall(r"\bdocs/([\w-]+\.md)", p.read_text(errors="replace"))}
    assert cited, "no file cites docs/"
    missing = sorted((where, name) for where, name in cited if not (ROOT / "docs" / name).is_file())
    assert not missing, missing


def test_section_links_resolve():
    links = []
    for p in _files():
        if p.suffix != ".md":
            continue
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?#([^)\s]+)\)", p.read_text()):
            links.append((p, (p.parent / target) if target else p, anchor))
    assert len(links) > 10
    broken = [(p.relative_to(ROOT).as_posix(), f"{t.relative_to(ROOT).as_posix()}#{a}") for p, t, a in links
              if not t.is_file() or a not in anchors(t)]
    assert not broken, broken
