"""Shared-window check between prompt records and a corpus: which records share an n-character span with it.

Texts are compared after collapsing every whitespace run to one space, so a span re-wrapped or re-indented in the
corpus still counts as shared. Every n-character window of every record is hashed (a polynomial hash mod 2^64,
vectorised with numpy); corpus text is streamed through in chunks, each of its windows is looked up among the
records' hashes, and a hash hit counts only after the two windows compare equal as strings.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

WINDOW = 50
_BASE = 1_000_003  # odd, so it has an inverse mod 2^64
_BASE_INV = pow(_BASE, -1, 2**64)
_SEP = "\x00"  # between corpus documents in one chunk; never in a record, so no window spans two documents
_CHUNK_CHARS = 2_000_000
_FILTER_BITS = 24  # a first lookup on the hashes' top bits, so only a few corpus windows reach the binary search
_WS = re.compile(r"\s+")


def normalize(text: str) -> str:
    return _WS.sub(" ", text)


def _powers(base: int, n: int) -> np.ndarray:
    p = np.full(n, base, dtype=np.uint64)
    p[0] = 1
    return np.cumprod(p, dtype=np.uint64)  # wraps mod 2^64


def window_hashes(text: str, n: int = WINDOW) -> np.ndarray:
    """[len(text) - n + 1] uint64: hash of text[i:i+n] = sum_j ord(text[i+j]) * B^j mod 2^64."""
    if len(text) < n:
        return np.zeros(0, dtype=np.uint64)
    c = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)  # [L]
    with np.errstate(over="ignore"):
        s = np.concatenate([np.zeros(1, np.uint64), np.cumsum(c * _powers(_BASE, len(c)), dtype=np.uint64)])
        return (s[n:] - s[: len(c) - n + 1]) * _powers(_BASE_INV, len(c) - n + 1)


@dataclass
class Hit:
    record: int  # index into the records given to `WindowIndex`
    source: str
    path: str
    window: str  # the shared span, whitespace-normalised


class WindowIndex:
    """The n-character windows of a list of records, to find which records a corpus shares a span with."""

    def __init__(self, records: list[str], n: int = WINDOW):
        self.n = n
        self.texts = [normalize(r) for r in records]
        hashes = [window_hashes(t, n) for t in self.texts]
        rec = np.concatenate([np.full(len(h), i, dtype=np.int64) for i, h in enumerate(hashes)] or [np.zeros(0, np.int64)])
        pos = np.concatenate([np.arange(len(h), dtype=np.int64) for h in hashes] or [np.zeros(0, np.int64)])
        flat = np.concatenate(hashes or [np.zeros(0, np.uint64)])
        order = np.argsort(flat, kind="stable")
        self.hashes, self.rec, self.pos = flat[order], rec[order], pos[order]
        self.filter = np.zeros(1 << _FILTER_BITS, dtype=bool)
        self.filter[self.hashes >> np.uint64(64 - _FILTER_BITS)] = True

    def _scan(self, chunk: str, spans: list[tuple[int, str, str]]) -> list[Hit]:
        hits = []
        h = window_hashes(chunk, self.n)
        if not len(self.hashes) or not len(h):
            return hits
        maybe = np.nonzero(self.filter[h >> np.uint64(64 - _FILTER_BITS)])[0]
        lo = np.searchsorted(self.hashes, h[maybe], side="left")
        hit = (lo < len(self.hashes)) & (self.hashes[np.minimum(lo, len(self.hashes) - 1)] == h[maybe])
        starts = [s for s, _, _ in spans]
        for i, j in zip(maybe[hit].tolist(), lo[hit].tolist()):
            window = chunk[i: i + self.n]
            while j < len(self.hashes) and self.hashes[j] == h[i]:
                r, p = int(self.rec[j]), int(self.pos[j])
                if self.texts[r][p: p + self.n] == window:
                    _, source, path = spans[int(np.searchsorted(starts, i, side="right")) - 1]
                    hits.append(Hit(r, source, path, window))
                j += 1
        return hits

    def scan(self, documents: Iterable[tuple[str, str, str]]) -> list[Hit]:
        """Every (record, corpus document) shared window, at most one Hit per record and document.
        `documents`: (source name, path, text)."""
        hits, seen = [], set()
        parts, spans, size = [], [], 0

        def flush():
            for hit in self._scan("".join(parts), spans):
                if (hit.record, hit.source, hit.path) not in seen:
                    seen.add((hit.record, hit.source, hit.path))
                    hits.append(hit)

        for source, path, text in documents:
            spans.append((size, source, path))
            t = normalize(text) + _SEP
            parts.append(t)
            size += len(t)
            if size >= _CHUNK_CHARS:
                flush()
                parts, spans, size = [], [], 0
        if parts:
            flush()
        return hits
