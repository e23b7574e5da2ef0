"""The run's document splits and batch sizes, as Megatron's ``pretrain_gpt.py`` would make them.

:func:`build_splits` reads Megatron's data flags (``--data-path`` with or without weights,
``--split``, ``--train/valid/test-data-path``, ``--data-args-path``, ``--per-split-data-args-path``,
``--mock-data``, ``--data-cache-path``, ``--no-mmap-bin-files``) with Megatron's own helpers and
builds train, validation and test splits of whole documents with ``BlendedMegatronDatasetBuilder``,
sized as Megatron's ``get_train_valid_test_num_samples`` asks.

:class:`BatchSchedule` gives step ``k``'s global batch: ``--global-batch-size`` documents, or under
Megatron's ``--step-batch-size-schedule`` the size Megatron's own calculator gives at the samples
consumed before it; step ``k`` starts at the sum of the sizes before it, so a resumed run continues
exactly where Megatron's consumed-sample count says.
"""

from __future__ import annotations

from megatron_flexsp.integration.data import (DocumentDataset, DocumentDatasetConfig, DocumentSplit,
                                              check_prefix)
from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)

SPLITS = ("train", "valid", "test")


def build_splits(args, tokenizer, sizes) -> dict[str, DocumentSplit | None]:
    """Train / valid / test splits of the run (None where a split has no documents) holding at least
    ``sizes`` (train, valid, test) samples -- what Megatron's ``get_train_valid_test_num_samples``
    asks its dataset provider for. Every rank builds the same indices (no communication)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, per_split = get_blend_and_blend_per_split(args)  # checked by check_data_paths
    config = DocumentDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=per_split,
        split=args.split, path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer, over_length=args.flexsp_over_length)
    sizes = list(sizes)
    built = BlendedMegatronDatasetBuilder(DocumentDataset, sizes, lambda: True, config).build()
    out = {}
    for name, ds, size in zip(SPLITS, built, sizes):
        out[name] = DocumentSplit(ds, name) if ds is not None and len(ds) else None
        if out[name] is not None:
            a = out[name].acct
            log.info("%s split: %d samples from %d document(s) of %d (truncated %d, dropped %d short / "
                     "%d long)", name, len(out[name]), a.usable_documents, a.num_documents,
                     a.truncated_documents, a.dropped_too_short, a.dropped_too_long)
    if out["train"] is None and sizes[0]:
        raise ValueError(f"the train split has no documents but {sizes[0]} samples are needed: check "
                         f"--split {args.split!r} and the data paths")
    if out["valid"] is None and getattr(args, "eval_iters", 0) and not getattr(args, "skip_train", False):
        raise ValueError(f"--eval-iters {args.eval_iters} needs validation documents, but the valid "
                         f"split has none (--split {args.split!r}); give --eval-iters 0, a split "
                         f"with a validation share, or --valid-data-path")
    return out


def check_data_paths(args) -> None:
    """Before training: every data prefix of the run is a Megatron indexed dataset (``ValueError``
    naming the first that is not), or ``--mock-data`` is given."""
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, per_split = get_blend_and_blend_per_split(args)
    blends = [blend] if blend is not None else [b for b in (per_split or []) if b is not None]
    if not blends and not getattr(args, "mock_data", False):
        raise ValueError("no data: give --data-path (prefixes, optionally weighted), "
                         "--train-data-path/--valid-data-path/--test-data-path, or --mock-data")
    for prefixes, _weights in blends:
        for prefix in prefixes:
            check_prefix(prefix)


class BatchSchedule:
    """Global batch size and start position of every training step."""

    def __init__(self, args) -> None:
        self.global_batch_size = int(args.global_batch_size)
        self.schedule = getattr(args, "step_batch_size_schedule", None)
        self._calc = None
        if self.schedule:
            from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

            self._calc = StepBatchsizeNumMicroBatchesCalculator(
                args.micro_batch_size, args.data_parallel_size, False, args.rank, self.schedule,
                seq_length=args.seq_length)
        self._starts = [0]

    def size_at(self, consumed: int) -> int:
        """Documents in the batch that starts after ``consumed`` samples."""
        if self._calc is None:
            return self.global_batch_size
        self._calc.update(consumed, False)
        return int(self._calc.get_current_global_batch_size())

    def start(self, step: int) -> int:
        """Samples consumed before step ``step``."""
        while len(self._starts) <= step:
            self._starts.append(self._starts[-1] + self.size_at(self._starts[-1]))
        return self._starts[step]

    def size(self, step: int) -> int:
        return self.size_at(self.start(step))

    def state(self) -> dict:
        return {"global_batch": self.global_batch_size, "step_batch_size_schedule": self.schedule}
