"""Text in Parquet -> token id tensors, tokenized in the process that trains on them.

`tokenize_texts` turns sentences into [rows, 2, max_length] int32 (token ids and attention
mask, padded or truncated to max_length), in their order; the tokenizer is loaded once per
process. A worker tokenizes its own Ray Data shard (data/shards.py), or a split it reads in
memory. Tokenizing in Ray Data tasks instead started processes that each
imported transformers to load the tokenizer again, the costliest part of a small text run
(benchmarks/RESULTS.md). `data.check_text_file` checks the file's schema with pyarrow first, so
a wrong column fails before Ray starts; this module imports nothing of `raydp_train`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np


@functools.cache
def _tokenizer(path: str):
    """Loaded once per process, reused by every batch it tokenizes."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


def vocabulary_size(tokenizer_path: str) -> int:
    """The token ids the tokenizer at `tokenizer_path` gives: 0 .. size - 1."""
    return len(_tokenizer(tokenizer_path))


# Sentences per call of the tokenizer: its padded arrays stay small.
BATCH_ROWS = 1024


def tokenize_texts(texts: list, tokenizer_path: str, max_length: int) -> np.ndarray:
    """[rows, 2, max_length] int32: each text's token ids and attention mask, in order."""
    tokenizer, parts = _tokenizer(tokenizer_path), []
    for start in range(0, len(texts), BATCH_ROWS):
        encoded = tokenizer([str(text) for text in texts[start:start + BATCH_ROWS]],
                            padding="max_length", truncation=True, max_length=max_length,
                            return_tensors="np")
        parts.append(np.stack([encoded["input_ids"], encoded["attention_mask"]], axis=1))
    if not parts:
        return np.empty((0, 2, max_length), np.int32)
    return np.concatenate(parts).astype(np.int32)


def tokenize_parquet(path: Path, text_column: str, tokenizer_path: str,
                     max_length: int) -> np.ndarray:
    """[N, 2, max_length] int32 token ids and masks of every row of `path`, in file order."""
    import pyarrow.parquet as pq

    texts = pq.read_table(path, columns=[text_column]).column(text_column).to_pylist()
    return tokenize_texts(texts, tokenizer_path, max_length)
