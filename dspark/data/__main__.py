"""Command line for the offline corpus and tokenizer.

    python -m dspark.data build --out DIR [--sources a,b] [--max-bytes-per-source N] [--allow-missing]
    python -m dspark.data tokenizer --corpus DIR --vocab-size 8192 --out DIR [--max-bytes N] [--sources a,b]
    python -m dspark.data card DIR

Errors print one line and exit with status 2.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from dspark.data.corpus import build_corpus, card_table, iter_texts, load_corpus, read_card
from dspark.data.sources import SOURCES
from dspark.data.tokenizer import bytes_per_token, train_tokenizer


def _names(value: str | None) -> list[str] | None:
    return None if value is None else [n.strip() for n in value.split(",") if n.strip()]


def cmd_build(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    out = build_corpus(
        args.out,
        sources=_names(args.sources),
        max_bytes_per_source=args.max_bytes_per_source,
        holdout_every=args.holdout_every,
        allow_missing=args.allow_missing,
    )
    print(card_table(read_card(out)), end="")
    print(f"corpus in {out} ({time.perf_counter() - start:.1f} s)")


def cmd_tokenizer(args: argparse.Namespace) -> None:
    corpus = load_corpus(args.corpus)
    sources = _names(args.sources)
    start = time.perf_counter()
    texts = list(iter_texts(corpus["train"], sources, args.max_bytes))
    if not texts:
        raise ValueError(f"no train text in {args.corpus} for sources {sources}")
    tokenizer = train_tokenizer(texts, args.vocab_size, args.out)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    print(f"tokenizer ({len(tokenizer)} tokens) trained on {len(texts)} docs, {n_bytes / 1e6:.2f} MB "
          f"in {time.perf_counter() - start:.1f} s -> {args.out}")
    holdout = list(iter_texts(corpus["holdout"], sources))
    if holdout:
        print(f"holdout bytes/token: {bytes_per_token(holdout, tokenizer):.3f} ({len(holdout)} docs)")


def cmd_card(args: argparse.Namespace) -> None:
    print(card_table(read_card(args.dir)), end="")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build", help="build the offline corpus")
    p.add_argument("--out", required=True)
    p.add_argument("--sources", help=f"comma-separated subset of: {','.join(SOURCES)} (default: all)")
    p.add_argument("--max-bytes-per-source", type=int)
    p.add_argument("--holdout-every", type=int, default=20)
    p.add_argument("--allow-missing", action="store_true", help="skip uninstalled sources instead of failing")
    p.set_defaults(run=cmd_build)

    p = sub.add_parser("tokenizer", help="train a byte-level BPE on a corpus's train split")
    p.add_argument("--corpus", required=True)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--out", required=True)
    p.add_argument("--max-bytes", type=int, help="train on at most this many bytes of text")
    p.add_argument("--sources", help="comma-separated sources to train on (default: all in the corpus)")
    p.set_defaults(run=cmd_tokenizer)

    p = sub.add_parser("card", help="print a corpus card")
    p.add_argument("dir")
    p.set_defaults(run=cmd_card)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        args.run(args)
    except (FileNotFoundError, FileExistsError, KeyError, ValueError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
