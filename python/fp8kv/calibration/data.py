"""Calibration data: token sequences from a file of ids or from text, cut into batches."""

from __future__ import annotations

import math
import os
import pathlib
from typing import Iterable

import torch


def token_id_sequences(path: str | os.PathLike, vocab_size: int) -> list[torch.Tensor]:
    """One int64 sequence per non-empty line of whitespace-separated token ids in [0, vocab_size)."""
    sequences = []
    for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        try:
            ids = [int(f) for f in fields]
        except ValueError:
            raise ValueError(f"{path}:{number}: token ids must be integers separated by whitespace") from None
        bad = next((i for i in ids if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{path}:{number}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        sequences.append(torch.tensor(ids, dtype=torch.int64))
    if not sequences:
        raise ValueError(f"{path} holds no token ids")
    return sequences


def text_sequences(path: str | os.PathLike, tokenizer, seq_len: int) -> list[torch.Tensor]:
    """The text of `path`, tokenized as one stream and cut into sequences of up to `seq_len` tokens,
    each starting with the tokenizer's BOS token when it has one (as prompts do at inference)."""
    text = pathlib.Path(path).read_text()
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if not ids:
        raise ValueError(f"{path} holds no text")
    bos = tokenizer.bos_token_id
    body = seq_len - (bos is not None)
    if body < 1:
        raise ValueError(f"seq_len must leave room for one token after BOS, got {seq_len}")
    prefix = [bos] if bos is not None else []
    return [torch.tensor(prefix + ids[i:i + body], dtype=torch.int64) for i in range(0, len(ids), body)]


def make_batches(sequences: Iterable[torch.Tensor], seq_len: int, batch_size: int = 1,
                 max_tokens: int | None = None) -> list[torch.Tensor]:
    """Rows of at most `seq_len` tokens (longer sequences are cut), grouped `batch_size` at a time
    into [rows, length] batches of equal-length rows, so no row needs padding. `max_tokens` stops
    after that many tokens in total."""
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens > 0):
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    rows, budget = [], max_tokens if max_tokens is not None else math.inf
    for sequence in sequences:
        for start in range(0, sequence.numel(), seq_len):
            if budget <= 0:
                break
            row = sequence[start:start + min(seq_len, budget)]
            rows.append(row)
            budget -= row.numel()
    by_length: dict[int, list[torch.Tensor]] = {}
    for row in rows:
        by_length.setdefault(row.numel(), []).append(row)
    return [torch.stack(group[i:i + batch_size]) for group in by_length.values()
            for i in range(0, len(group), batch_size)]
