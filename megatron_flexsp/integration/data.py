"""Whole documents from Megatron indexed datasets (``.bin/.idx``), one global batch per step.

The document stream is the concatenation of per-epoch permutations (seeded by ``(seed, epoch)``)
of the usable documents, so every usable document is consumed exactly once per epoch; step ``k``
takes documents ``[k G, (k+1) G)`` of that stream (``G`` = ``--global-batch-size``). A document of
``n`` tokens trains ``n - 1`` positions (inputs ``tokens[:-1]``, labels ``tokens[1:]``); one longer
than ``seq_length + 1`` tokens is truncated, dropped or refused (``--flexsp-over-length``), and one
with fewer than 2 tokens cannot train and is dropped. Every such document is counted.

Every rank reads all document lengths from the index (no communication) and loads only the tokens of
the documents it owns (batch position ``s`` with ``s % world == rank``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megatron_flexsp.config import OVER_LENGTH_POLICIES
from megatron_flexsp.runtime.dispatch import owner


@dataclass
class DataAccounting:
    """Documents and tokens left out of training, by reason (counted once, when found)."""

    num_documents: int = 0
    usable_documents: int = 0
    dropped_too_short: int = 0
    dropped_too_long: int = 0
    truncated_documents: int = 0
    truncated_tokens: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class GlobalBatch:
    """One step's documents. ``lengths[s]``: training positions of batch sequence ``s``."""

    step: int
    doc_ids: np.ndarray
    lengths: np.ndarray
    epochs: np.ndarray
    truncated: int
    loaded: dict = field(default_factory=dict)  # {s: LongTensor[L_s, 2]} (tokens, labels), owned only


def open_indexed(prefixes: list[str]):
    """Open Megatron indexed datasets; ``ValueError`` naming a prefix that is not one."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out = []
    for prefix in prefixes:
        missing = [p for p in (prefix + ".bin", prefix + ".idx") if not Path(p).is_file()]
        if missing:
            raise ValueError(f"--data-path {prefix!r} is not a Megatron indexed dataset: missing "
                             f"{missing}")
        try:
            out.append(IndexedDataset(prefix))
        except Exception as exc:  # noqa: BLE001 - re-raised with the path
            raise ValueError(f"--data-path {prefix!r}: cannot read the indexed dataset ({exc})") from exc
    return out


class DocumentSource:
    """All documents of one or more indexed datasets, addressed by a global document id."""

    def __init__(self, datasets) -> None:
        self._datasets = datasets
        self._doc_items, lengths, self._owner = [], [], []
        for k, ds in enumerate(datasets):
            docs = np.asarray(ds.document_indices, dtype=np.int64)
            seq = np.asarray(ds.sequence_lengths, dtype=np.int64)
            cum = np.concatenate([[0], np.cumsum(seq)])
            lengths.append(cum[docs[1:]] - cum[docs[:-1]])
            self._doc_items.append(docs)
            self._owner.append(np.full(len(docs) - 1, k, dtype=np.int64))
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self._ds_of = np.concatenate(self._owner) if self._owner else np.zeros(0, np.int64)
        self._first = np.concatenate([[0], np.cumsum([len(o) for o in self._owner])])

    def __len__(self) -> int:
        return len(self.lengths)

    def tokens(self, doc: int, count: int) -> np.ndarray:
        """The first ``count`` tokens of document ``doc`` (int64)."""
        k = int(self._ds_of[doc])
        ds, local = self._datasets[k], doc - int(self._first[k])
        items = range(int(self._doc_items[k][local]), int(self._doc_items[k][local + 1]))
        parts, need = [], count
        for i in items:
            if need <= 0:
                break
            n = min(need, int(ds.sequence_lengths[i]))
            parts.append(np.asarray(ds.get(i, 0, n), dtype=np.int64))
            need -= n
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class DocumentSampler:
    """Deterministic global batches of whole documents (see the module docstring)."""

    def __init__(self, doc_lengths: np.ndarray, *, global_batch: int, seq_length: int, seed: int,
                 over_length: str = "truncate") -> None:
        if over_length not in OVER_LENGTH_POLICIES:
            raise ValueError(f"over_length={over_length!r} must be one of {OVER_LENGTH_POLICIES}")
        if global_batch < 1 or seq_length < 1:
            raise ValueError(f"global_batch={global_batch} and seq_length={seq_length} must be >= 1")
        lens = np.asarray(doc_lengths, dtype=np.int64)
        self.global_batch, self.seq_length, self.seed = global_batch, seq_length, seed
        self.acct = DataAccounting(num_documents=len(lens))
        short = lens < 2
        long = lens > seq_length + 1
        self.acct.dropped_too_short = int(short.sum())
        if over_length == "error" and long.any():
            doc = int(np.flatnonzero(long)[0])
            raise ValueError(f"document {doc} has {int(lens[doc])} tokens, more than --seq-length "
                             f"{seq_length} + 1 ({int(long.sum())} such documents); use "
                             f"--flexsp-over-length truncate or drop")
        if over_length == "drop":
            self.acct.dropped_too_long = int((long & ~short).sum())
            usable = ~short & ~long
        else:
            usable = ~short
            self.acct.truncated_documents = int((long & usable).sum())
            self.acct.truncated_tokens = int(np.sum(lens[long & usable] - (seq_length + 1)))
        self.usable = np.flatnonzero(usable)
        self.acct.usable_documents = len(self.usable)
        if len(self.usable) == 0:
            raise ValueError(f"no usable documents among {len(lens)} (each needs 2..{seq_length + 1} "
                             f"tokens, or truncation)")
        self._lens = lens
        self._perm: dict[int, np.ndarray] = {}

    def _epoch(self, e: int) -> np.ndarray:
        if e not in self._perm:
            if len(self._perm) > 2:
                self._perm.pop(min(self._perm))
            self._perm[e] = self.usable[np.random.default_rng([self.seed, e]).permutation(len(self.usable))]
        return self._perm[e]

    def batch_docs(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Document ids and their epochs for global batch ``step``."""
        n = len(self.usable)
        pos = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        epochs, offs = pos // n, pos % n
        docs = np.array([self._epoch(int(e))[int(o)] for e, o in zip(epochs, offs)], dtype=np.int64)
        return docs, epochs

    def batch(self, step: int, source: DocumentSource | None = None, *, rank: int = 0,
              world: int = 1) -> GlobalBatch:
        """Global batch ``step``; with ``source``, this rank's owned documents are loaded."""
        docs, epochs = self.batch_docs(step)
        full = self._lens[docs]
        used = np.minimum(full, self.seq_length + 1)
        loaded = {}
        if source is not None:
            for s, (doc, n) in enumerate(zip(docs.tolist(), used.tolist())):
                if owner(s, world) == rank:
                    tok = torch.from_numpy(source.tokens(doc, n))
                    loaded[s] = torch.stack([tok[:-1], tok[1:]], dim=1)
        return GlobalBatch(step, docs, used - 1, epochs, int((full > used).sum()), loaded)
