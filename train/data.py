"""Training data for targets: the real corpus -> tokenizer -> packed token rows, cached on disk."""
from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dspark.config import DataConfig

log = logging.getLogger(__name__)


@dataclass
class TokenData:
    tokenizer: object  # transformers.PreTrainedTokenizerFast
    train: torch.Tensor  # [N, seq_len] long
    holdout: torch.Tensor  # [M, seq_len] long
    corpus_dir: Path


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def prepare_corpus(cfg: DataConfig):
    from dspark.data.corpus import build_corpus, load_corpus

    path = build_corpus(cfg.corpus_dir, sources=cfg.sources, max_bytes_per_source=cfg.max_bytes_per_source,
                        allow_missing=cfg.allow_missing)
    return load_corpus(path), Path(path)


def prepare_tokenizer(cfg: DataConfig, corpus):
    """Load the tokenizer in cfg.tokenizer_dir, or train it on the corpus train split (then save it there)."""
    from transformers import AutoTokenizer

    from dspark.data.tokenizer import train_tokenizer

    tok_dir = Path(cfg.tokenizer_dir)
    if (tok_dir / "tokenizer.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
        if len(tok) != cfg.vocab_size:
            raise ValueError(f"data.tokenizer_dir: {tok_dir} holds a tokenizer of {len(tok)} tokens but "
                             f"data.vocab_size={cfg.vocab_size}; point tokenizer_dir elsewhere or fix vocab_size")
        return tok
    log.info("training a %d-token BPE tokenizer on %s", cfg.vocab_size, cfg.corpus_dir)
    return train_tokenizer(corpus["train"]["text"], cfg.vocab_size, tok_dir)


def save_atomic(obj, path: Path) -> None:
    """torch.save into a temp file beside `path`, renamed when complete: a crash leaves no half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.rename(path)


def ids_dtype(tokenizer) -> torch.dtype:
    """The smallest integer dtype that holds the tokenizer's ids (cached token files)."""
    return torch.int16 if len(tokenizer) <= 32767 else torch.int32


def file_digest(path: Path) -> str:
    """A short content digest of a file ("none" when it does not exist): cache keys that follow content."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.is_file() else "none"


def packed_cache_path(cfg: DataConfig) -> Path:
    """Where the packed rows of (corpus card, tokenizer, seq_len) live: keyed by content, not by mtimes or paths, so
    a copy of the tokenizer dir with its packed file (e.g. carried to a GPU box) is reused without the corpus."""
    key = _key({"card": file_digest(Path(cfg.corpus_dir) / "card.json"),
                "tok": file_digest(Path(cfg.tokenizer_dir) / "tokenizer.json"), "seq": cfg.seq_len})
    return Path(cfg.tokenizer_dir) / f"packed-{key}.pt"


def prepare_tokens(cfg: DataConfig) -> TokenData:
    """Corpus -> tokenizer -> packed rows; the packed rows are cached (int16/int32) next to the tokenizer."""
    from transformers import AutoTokenizer

    from dspark.data.tokenizer import pack_tokens

    cache = packed_cache_path(cfg)
    if cache.is_file() and (Path(cfg.corpus_dir) / "card.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(cfg.tokenizer_dir))
        rows = {k: v.long() for k, v in torch.load(cache).items()}
        corpus_dir = Path(cfg.corpus_dir)
    else:
        corpus, corpus_dir = prepare_corpus(cfg)
        tok = prepare_tokenizer(cfg, corpus)
        rows = {split: pack_tokens(corpus[split]["text"], tok, cfg.seq_len) for split in ("train", "holdout")}
        save_atomic({k: v.to(ids_dtype(tok)) for k, v in rows.items()}, packed_cache_path(cfg))
    if len(rows["train"]) == 0:
        raise ValueError(f"data: the train split of {corpus_dir} gives no rows of seq_len={cfg.seq_len}")
    holdout = rows["holdout"][: max(1, cfg.holdout_tokens // cfg.seq_len)]
    return TokenData(tok, rows["train"], holdout, corpus_dir)


def prepare_code_prompts(cfg: DataConfig, tokenizer, tok_digest: str, n_tokens: int) -> list[list[int]]:
    """Token prompts of at most n_tokens that end where a function's body begins in the corpus's train .py files
    (dspark.data.completions), cached next to the tokenizer like the packed rows: a GPU box without the corpus (or
    `datasets`) reuses them. tok_digest: the tokenizer's file digest (part of the cache key)."""
    from dspark.data.completions import completion_prompts

    key = _key({"card": file_digest(Path(cfg.corpus_dir) / "card.json"), "tok": tok_digest, "n": n_tokens,
                "kind": "function-bodies/1"})
    cache = Path(cfg.tokenizer_dir) / f"code-prompts-{key}.pt"
    if cache.is_file():
        c = torch.load(cache)
        flat, ends = c["ids"].tolist(), c["ends"].tolist()
        return [flat[a:b] for a, b in zip([0] + ends[:-1], ends)]
    corpus, corpus_dir = prepare_corpus(cfg)
    train = corpus["train"]
    texts = [t for t, p in zip(train["text"], train["path"]) if p.endswith(".py")]
    prompts = completion_prompts(texts, tokenizer, n_tokens, tokenizer.eos_token_id)
    if not prompts:
        raise ValueError(f"data.regenerate.code_prompts: the train split of {corpus_dir} has no Python function to "
                         "cut a prompt at; add python_stdlib to data.corpus.sources or set code_prompts: 0")
    log.info("code prompts: %d function-body points in %d train .py files", len(prompts), len(texts))
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0)
    save_atomic({"ids": torch.tensor([t for p in prompts for t in p], dtype=ids_dtype(tokenizer)), "ends": ends}, cache)
    return prompts


def step_generator(seed: int, step: int) -> torch.Generator:
    """A step's own generator (its rows, its anchors): what a step draws depends only on (seed, step), so a resumed
    run draws what the uninterrupted one did."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def batch_for_step(rows: torch.Tensor, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """The packed rows of a target's step s, drawn with replacement by its step_generator."""
    return rows[rows_for_step(rows.shape[0], step, batch_size, seed, "replacement", step_generator(seed, step))]


def rows_for_step(n: int, step: int, batch: int, seed: int, order: str, g: torch.Generator) -> torch.Tensor:
    """The `batch` train rows (of n) of a step. replacement: drawn independently with g (the step's generator);
    passes: positions step*batch.. of the concatenated shuffled passes (each pass a permutation keyed by (seed, pass)),
    so every row is seen once per pass. Both depend only on (seed, step): a resumed run draws the same rows."""
    if order == "replacement":
        return torch.randint(0, n, (batch,), generator=g)
    first, last = divmod(step * batch, n), divmod((step + 1) * batch - 1, n)
    rows = torch.cat([_pass_order(n, seed, p) for p in range(first[0], last[0] + 1)])
    return rows[first[1]:first[1] + batch]


@functools.lru_cache(maxsize=4)
def _pass_order(n: int, seed: int, p: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7_919 + 104_729 * (p + 1)))


__all__ = ["TokenData", "prepare_tokens", "prepare_corpus", "prepare_tokenizer", "batch_for_step", "rows_for_step",
           "step_generator", "file_digest", "save_atomic", "ids_dtype", "asdict"]
