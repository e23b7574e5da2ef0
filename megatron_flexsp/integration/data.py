"""Whole documents as Megatron datasets: one sample per document, built by Megatron's own builder.

:class:`DocumentDataset` is a ``MegatronDataset`` over one low-level dataset -- a Megatron indexed
dataset (``.bin/.idx``; a document is one entry of its ``document_indices``) or Megatron's mock one
(``--mock-data``) -- restricted to the document range of one split. Its samples are the split's
usable documents, each once per epoch, in a per-epoch permutation seeded by ``(seed, split,
epoch)``; as many epochs as the builder asks samples for. ``BlendedMegatronDatasetBuilder`` makes
the splits (``--split`` or ``--train/valid/test-data-path``) and the weighted blends
(``--data-path 0.3 A 0.7 B``) from it, exactly as for Megatron's ``GPTDataset``.

A document of ``n`` tokens trains ``n - 1`` positions (inputs ``tokens[:-1]``, labels
``tokens[1:]``); one longer than ``seq_length + 1`` tokens is truncated, dropped or refused
(``--flexsp-over-length``), and one with fewer than 2 tokens cannot train and is dropped. Every such
document is counted (:class:`DataAccounting`).

:class:`DocumentSplit` turns a built split into global batches: positions ``[start, start + size)``
of the split's samples (a blend maps each position to a dataset and sample, as Megatron's
``BlendedDataset`` does). Every rank computes all lengths (no communication) and loads only the
tokens of the documents it owns (batch position ``s`` with ``s % devices == device``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset

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

    def add(self, other: "DataAccounting") -> None:
        for key, value in other.__dict__.items():
            setattr(self, key, getattr(self, key) + value)


@dataclass(frozen=True)
class GlobalBatch:
    """One step's documents. ``lengths[s]``: training positions of batch sequence ``s``; ``start``:
    the split position of its first document; ``split``: ``train``, ``valid`` or ``test``."""

    step: int
    doc_ids: np.ndarray
    lengths: np.ndarray
    epochs: np.ndarray
    truncated: int
    loaded: dict = field(default_factory=dict)  # {s: LongTensor[L_s, 2]} (tokens, labels), owned only
    split: str = "train"
    start: int = 0


@dataclass
class DocumentDatasetConfig(BlendedMegatronDatasetConfig):
    """Megatron's dataset config plus what to do with over-length documents."""

    over_length: str = "truncate"


def check_prefix(prefix: str) -> None:
    """``ValueError`` naming a ``--data-path`` prefix that is not a Megatron indexed dataset."""
    missing = [p for p in (prefix + ".bin", prefix + ".idx") if not Path(p).is_file()]
    if missing:
        raise ValueError(f"data prefix {prefix!r} is not a Megatron indexed dataset: missing {missing}")


def _document_bounds(low) -> np.ndarray | None:
    """Item ranges of the documents of an indexed dataset (None for the mock one: one item each)."""
    return np.asarray(low.document_indices, dtype=np.int64) if hasattr(low, "document_indices") else None


class DocumentDataset(MegatronDataset):
    """The usable documents of one split of one low-level dataset, one sample per document."""

    def __init__(self, dataset, dataset_path, indices, num_samples, index_split, config) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        if config.over_length not in OVER_LENGTH_POLICIES:
            raise ValueError(f"over_length={config.over_length!r} must be one of {OVER_LENGTH_POLICIES}")
        seq = np.asarray(dataset.sequence_lengths, dtype=np.int64)
        bounds = _document_bounds(dataset)
        if bounds is None:
            doc_len = seq
        else:
            cum = np.concatenate([[0], np.cumsum(seq)])
            doc_len = cum[bounds[1:]] - cum[bounds[:-1]]
        docs = np.asarray(indices, dtype=np.int64)
        lens = doc_len[docs]
        cap = config.sequence_length + 1
        short, long = lens < 2, lens > cap
        acct = DataAccounting(num_documents=len(docs), dropped_too_short=int(short.sum()))
        where = f"{dataset_path or 'mock data'} ({index_split.name} split)"
        if config.over_length == "error" and long.any():
            k = int(np.flatnonzero(long)[0])
            raise ValueError(f"{where}: document {int(docs[k])} has {int(lens[k])} tokens, more than "
                             f"--seq-length {config.sequence_length} + 1 ({int(long.sum())} such "
                             f"documents); use --flexsp-over-length truncate or drop")
        if config.over_length == "drop":
            acct.dropped_too_long = int((long & ~short).sum())
            usable = ~short & ~long
        else:
            usable = ~short
            acct.truncated_documents = int((long & usable).sum())
            acct.truncated_tokens = int(np.sum(lens[long & usable] - cap))
        self.docs = docs[usable]
        self.full_lengths = lens[usable]
        self.used_lengths = np.minimum(self.full_lengths, cap)
        acct.usable_documents = len(self.docs)
        self.acct = acct
        if num_samples and not len(self.docs):
            raise ValueError(f"{where}: no usable documents among {len(docs)} (each needs 2..{cap} "
                             f"tokens, or truncation), but {num_samples} samples are needed")
        self.size = len(self.docs) if num_samples is None else int(num_samples)
        self._bounds = bounds
        self._perm: dict[int, np.ndarray] = {}

    @staticmethod
    def numel_low_level_dataset(low_level_dataset) -> int:
        bounds = _document_bounds(low_level_dataset)
        return len(low_level_dataset) if bounds is None else len(bounds) - 1

    @staticmethod
    def build_low_level_dataset(dataset_path, config):
        if dataset_path is None:  # --mock-data: Megatron's own mock documents
            from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

            return MockGPTLowLevelDataset(config.tokenizer)
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        check_prefix(dataset_path)
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return MegatronDataset._key_config_attributes() + ["over_length"]

    def __len__(self) -> int:
        return self.size

    def _epoch(self, e: int) -> np.ndarray:
        if e not in self._perm:
            if len(self._perm) > 2:
                self._perm.pop(min(self._perm))
            rng = np.random.default_rng([self.config.random_seed, self.index_split.value, e])
            self._perm[e] = rng.permutation(len(self.docs))
        return self._perm[e]

    def locate(self, i: int) -> tuple[int, int]:
        """(index into the usable documents, epoch) of sample ``i``."""
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} outside 0..{self.size - 1} of {self.dataset_path}")
        e, o = divmod(i, len(self.docs))
        return int(self._epoch(e)[o]), e

    def __getitem__(self, i: int) -> dict:
        k, e = self.locate(i)
        return {"document": int(self.docs[k]), "length": int(self.used_lengths[k]) - 1, "epoch": e}

    def tokens(self, i: int) -> np.ndarray:
        """The tokens sample ``i`` trains on (its first ``seq_length + 1``), int64."""
        k, _ = self.locate(i)
        doc, need = int(self.docs[k]), int(self.used_lengths[k])
        if self._bounds is None:
            return np.asarray(self.dataset.get(doc, 0, need), dtype=np.int64)
        parts = []
        for item in range(int(self._bounds[doc]), int(self._bounds[doc + 1])):
            if need <= 0:
                break
            n = min(need, int(self.dataset.sequence_lengths[item]))
            parts.append(np.asarray(self.dataset.get(item, 0, n), dtype=np.int64))
            need -= n
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class DocumentSplit:
    """Global batches of one built split (a :class:`DocumentDataset` or a ``BlendedDataset`` of
    them)."""

    def __init__(self, top, name: str) -> None:
        self.top, self.name = top, name
        self.parts = list(top.datasets) if hasattr(top, "dataset_index") else [top]
        self.acct = DataAccounting()
        for p in self.parts:
            self.acct.add(p.acct)

    def __len__(self) -> int:
        return len(self.top)

    def _where(self, pos: int) -> tuple[DocumentDataset, int]:
        if not 0 <= pos < len(self.top):
            raise ValueError(f"the {self.name} split holds {len(self.top)} samples; position {pos} is "
                             f"beyond it (the builder sized it from --train-iters/--train-samples, "
                             f"--eval-iters and --eval-interval)")
        if len(self.parts) == 1 and not hasattr(self.top, "dataset_index"):
            return self.top, pos
        return self.parts[int(self.top.dataset_index[pos])], int(self.top.dataset_sample_index[pos])

    def batch(self, step: int, start: int, size: int, *, load: bool = False, device: int = 0,
              devices: int = 1) -> GlobalBatch:
        """Documents at positions ``[start, start + size)``; with ``load``, the tokens of those this
        device owns."""
        docs, lens, epochs, loaded, truncated = [], [], [], {}, 0
        for s, pos in enumerate(range(start, start + size)):
            ds, i = self._where(pos)
            k, e = ds.locate(i)
            docs.append(int(ds.docs[k]))
            lens.append(int(ds.used_lengths[k]) - 1)
            epochs.append(e)
            truncated += int(ds.full_lengths[k] > ds.used_lengths[k])
            if load and owner(s, devices) == device:
                tok = torch.from_numpy(ds.tokens(i))
                loaded[s] = torch.stack([tok[:-1], tok[1:]], dim=1)
        return GlobalBatch(step, np.asarray(docs, np.int64), np.asarray(lens, np.int64),
                           np.asarray(epochs, np.int64), truncated, loaded, self.name, start)
