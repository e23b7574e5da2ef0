"""Sequence-length workloads: read a lengths file, sample global batches from it (numpy only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def load_lengths(path: str | Path) -> np.ndarray:
    """Read one positive integer per line (blank lines ignored); ``ValueError`` names a bad line."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"lengths file {str(path)!r} does not exist")
    values = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            text = line.strip()
            if not text:
                continue
            try:
                v = int(text)
            except ValueError:
                raise ValueError(f"{path}:{lineno}: {text[:40]!r} is not an integer length") from None
            if v <= 0:
                raise ValueError(f"{path}:{lineno}: length {v} must be >= 1")
            values.append(v)
    if not values:
        raise ValueError(f"lengths file {str(path)!r} holds no lengths")
    return np.asarray(values, dtype=np.int64)


def sample_batches(lengths: np.ndarray, *, global_batch: int, num_batches: int, seed: int,
                   max_seq_len: int = 0) -> tuple[list[np.ndarray], int]:
    """``num_batches`` global batches of ``global_batch`` lengths drawn with replacement (seeded).

    Lengths above ``max_seq_len`` (> 0) are truncated to it, as a data loader with that sequence
    length does. Returns the batches and the number of tokens truncated.
    """
    if global_batch < 1 or num_batches < 1:
        raise ValueError(f"global_batch={global_batch} and num_batches={num_batches} must be >= 1")
    rng = np.random.default_rng(seed)
    batches, cut = [], 0
    for _ in range(num_batches):
        b = rng.choice(lengths, size=global_batch, replace=True)
        if max_seq_len > 0:
            cut += int(np.maximum(b - max_seq_len, 0).sum())
            b = np.minimum(b, max_seq_len)
        batches.append(b.astype(np.int64))
    return batches, cut
