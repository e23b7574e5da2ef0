"""Sequence lengths in and out of the planner: the over-length policy (``PlannerConfig.over_length``:
``error``, ``truncate`` or ``drop`` sequences longer than the largest group holds), the input check,
and a plan of the kept sequences expressed in indices of the whole batch."""

from __future__ import annotations

import dataclasses

import numpy as np

from megatron_flexsp.plan import GroupPlan, MicroBatchPlan, StepPlan
from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class LengthFix:
    """Result of the over-length policy: trained lengths, dropped indices and tokens cut."""

    lens: np.ndarray
    dropped: tuple[int, ...]
    tokens_truncated: int
    tokens_dropped: int


def apply_over_length(lens: np.ndarray, limit: int, policy: str) -> LengthFix:
    """Apply ``policy`` to sequences longer than ``limit`` tokens (what the cluster can hold)."""
    lens = np.asarray(lens, dtype=np.int64)
    over = np.flatnonzero(lens > limit)
    if len(over) == 0:
        return LengthFix(lens.copy(), (), 0, 0)
    if policy == "error":
        i = int(over[0])
        raise ValueError(f"sequence {i} has length {int(lens[i])}, above the capacity of the largest "
                         f"group ({limit} tokens); {len(over)} sequence(s) exceed it "
                         f"(set over_length to 'truncate' or 'drop')")
    out = lens.copy()
    if policy == "truncate":
        cut = int((lens[over] - limit).sum())
        out[over] = limit
        log.warning("truncated %d sequence(s) to %d tokens (%d tokens cut)", len(over), limit, cut)
        return LengthFix(out, (), cut, 0)
    dropped = int(lens[over].sum())
    out[over] = 0
    log.warning("dropped %d sequence(s) longer than %d tokens (%d tokens)", len(over), limit, dropped)
    return LengthFix(out, tuple(int(i) for i in over), 0, dropped)


def validate_lengths(lens: np.ndarray) -> None:
    """Raise ``ValueError`` naming the first bad length: the batch must be 1-D, non-empty, all >= 1."""
    if lens.ndim != 1 or len(lens) == 0:
        raise ValueError(f"the global batch is empty (got {len(lens)} sequence lengths)")
    if (lens <= 0).any():
        i = int(np.flatnonzero(lens <= 0)[0])
        raise ValueError(f"sequence {i} has length {int(lens[i])}; lengths must be >= 1")


def remap_kept(plan: StepPlan, kept: np.ndarray, fix: LengthFix, original: np.ndarray) -> StepPlan:
    """Express a plan of the kept sub-batch in indices of the whole batch (unchanged where every
    sequence was kept)."""
    mbs = plan.micro_batches
    if len(kept) != len(original):
        index = kept.tolist()
        mbs = tuple(MicroBatchPlan(tuple(GroupPlan(g.ranks, tuple(index[i] for i in g.seqs), g.predicted_ms)
                                         for g in mb.groups)) for mb in mbs)
    return dataclasses.replace(plan, micro_batches=mbs, seq_lens=tuple(fix.lens.tolist()),
                               original_lens=tuple(original.tolist()), dropped=fix.dropped,
                               tokens_truncated=fix.tokens_truncated, tokens_dropped=fix.tokens_dropped)
