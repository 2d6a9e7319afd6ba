"""Text in Parquet -> token id tensors, tokenized by Ray Data so the work spreads over the cluster.

`read_parquet` + `map_batches(tokenize_batch)`: each Ray worker process loads the tokenizer
once and turns a batch of sentences into [batch, 2, max_length] int32 (token ids and attention mask,
padded or truncated to max_length). Row order is preserved, so splits stay deterministic.
`data.check_text_file` checks the file's schema with pyarrow first, so a wrong column fails
before Ray starts; of the data layer this module imports only its Parquet read
(parquet_reads).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from raydp_train.data.parquet_reads import read_parquet


@functools.cache
def _tokenizer(path: str):
    """Loaded once per Ray worker process, reused by every batch it tokenizes."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


def tokenize_batch(batch: dict[str, np.ndarray], tokenizer_path: str, text_column: str,
                   max_length: int) -> dict[str, np.ndarray]:
    """A batch of texts -> {"tokens": [batch, 2, max_length] int32 ids and attention mask}."""
    encoded = _tokenizer(tokenizer_path)(
        [str(text) for text in batch[text_column]], padding="max_length", truncation=True,
        max_length=max_length, return_tensors="np")
    tokens = np.stack([encoded["input_ids"], encoded["attention_mask"]], axis=1)
    return {"tokens": tokens.astype(np.int32)}


def tokenize_parquet(path: Path, text_column: str, tokenizer_path: str,
                     max_length: int) -> np.ndarray:
    """[N, 2, max_length] int32 token ids and masks of every row of `path`, in file order."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # rows stay in file order
    texts = read_parquet(path).select_columns([text_column])
    tokenized = texts.map_batches(
        tokenize_batch, fn_kwargs={"tokenizer_path": tokenizer_path, "text_column": text_column,
                                   "max_length": max_length},
        batch_size=1024, batch_format="numpy")
    return np.concatenate([batch["tokens"] for batch in
                           tokenized.iter_batches(batch_size=None, batch_format="numpy")])
