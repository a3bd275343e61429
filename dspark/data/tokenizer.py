"""Byte-level BPE tokenizer for the from-scratch targets, token packing, and unigram entropy.

The tokenizer is saved in Hugging Face format so `transformers.AutoTokenizer.from_pretrained(dir)` loads it
offline. Special tokens: `<|endoftext|>` (eos and bos), `<|pad|>`, `<|mask|>` (the drafter's mask token,
`tokenizer.mask_token`), `<|im_start|>` / `<|im_end|>` (ChatML turns, see CHAT_TEMPLATE).
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS, PAD, MASK, IM_START, IM_END = "<|endoftext|>", "<|pad|>", "<|mask|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, PAD, MASK, IM_START, IM_END]  # ids 0..4, in this order
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (no prefix space; decode(encode(x)) == x for any text) and save it to `out_dir`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so nothing is ever unknown
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=PAD,
        mask_token=MASK,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
    )
    _save_atomically(hf, Path(out_dir))
    return hf


def _save_atomically(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.saving-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer.save_pretrained(str(tmp))  # tokenizer.json, tokenizer_config.json, chat_template.jinja
        # transformers 5 no longer writes special_tokens_map.json; older readers (and people) look for it
        special = {"bos_token": EOS, "eos_token": EOS, "pad_token": PAD, "mask_token": MASK,
                   "additional_special_tokens": [IM_START, IM_END]}
        (tmp / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _encode_batches(texts: Iterable[str], tokenizer, batch_docs: int = 64) -> Iterator[list[int]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == batch_docs:
            yield from tokenizer(batch, add_special_tokens=False)["input_ids"]
            batch = []
    if batch:
        yield from tokenizer(batch, add_special_tokens=False)["input_ids"]


def pack_tokens(texts: Iterable[str], tokenizer, seq_len: int, max_tokens: int | None = None) -> torch.LongTensor:
    """Encode each document, append `<|endoftext|>` after each, concatenate, and cut into rows.

    The stream stops at `max_tokens` (if given); the last incomplete row is dropped.
    -> LongTensor [N, seq_len], N = min(total, max_tokens) // seq_len.
    """
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in _encode_batches(texts, tokenizer):
        stream += ids
        stream.append(eos)
        if max_tokens is not None and len(stream) >= max_tokens:
            del stream[max_tokens:]
            break
    n_rows = len(stream) // seq_len
    return torch.tensor(stream[: n_rows * seq_len], dtype=torch.long).view(n_rows, seq_len)


@dataclass(frozen=True)
class UnigramEntropy:
    entropy: float  # H(p) of the unigram distribution of the ids, nats/token
    cross_entropy: float | None  # -sum p log q, q = Laplace-smoothed unigram of train_ids; None without train_ids
    tokens: int


def unigram_entropy(
    token_ids: torch.Tensor, vocab_size: int, train_ids: torch.Tensor | None = None
) -> UnigramEntropy:
    """token_ids, train_ids: integer tensors of any shape with values in [0, vocab_size)."""
    counts = torch.bincount(token_ids.reshape(-1).long(), minlength=vocab_size).double()  # [V]
    p = counts / counts.sum()
    nz = p > 0
    entropy = float(-(p[nz] * p[nz].log()).sum())
    cross = None
    if train_ids is not None:
        train_counts = torch.bincount(train_ids.reshape(-1).long(), minlength=vocab_size).double()  # [V]
        q = (train_counts + 1) / (train_counts.sum() + vocab_size)  # add-one (Laplace) smoothing
        cross = float(-(p[nz] * q[nz].log()).sum())
    return UnigramEntropy(entropy=entropy, cross_entropy=cross, tokens=int(counts.sum()))


def bytes_per_token(texts: Iterable[str], tokenizer) -> float:
    """UTF-8 bytes per token over `texts` (no special tokens added)."""
    texts = list(texts)
    n_tokens = sum(len(ids) for ids in _encode_batches(texts, tokenizer))
    return sum(len(t.encode("utf-8")) for t in texts) / max(n_tokens, 1)

