"""Megatron's own hybrid-context-parallel scheduler as a planning strategy: ``megatron-hybrid-cp``.

megatron-core 0.19.2 schedules ``--hybrid-context-parallel`` with
``megatron.core.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler``: sequences sorted by
length, each given ``2^ceil(log2(len / max_seqlen_per_rank))`` ranks, greedy buckets balanced on
``len^2 / cp`` with 5% slack, then groups doubled until no rank is idle. Its output is a list of
barrier-separated *groups*; inside one, every rank set runs its sub-samples one after another, each
as its own forward and backward (so memory holds one sub-sample at a time).

:func:`plan_hybrid_cp` calls that code itself (with a stand-in for its process group: it only asks
for the size), with ``max_seqlen_per_rank`` set to the cost model's tokens per GPU, and prices the
result with our cost model in two ways:

* ``info["megatron_step_ms"]``: as Megatron runs it -- per barrier group, the slowest rank set's sum
  over its sub-samples of (fixed cost + sequence time): every sub-sample pays a whole pass;
* the returned :class:`StepPlan` (the strategy's step time): Megatron's assignment of sequences to
  rank sets, run by our runtime -- each rank set's sub-samples packed into as few passes as its
  memory holds (in Megatron's order, first fit), the k-th pass of every rank set of a barrier group
  in the k-th micro-batch. This form is executable, and never slower than the first one for the
  peer, which makes it the stronger baseline.
"""

from __future__ import annotations

import time

import numpy as np

from megatron_flexsp.cost_model import CostModel
from megatron_flexsp.plan import GroupPlan, MicroBatchPlan, StepPlan
from megatron_flexsp.planner.api import register_strategy
from megatron_flexsp.topology import place_groups

NAME = "megatron-hybrid-cp"


class _GroupSize:
    """What ``BalancedCPScheduler`` needs of its DP x CP process group: its size."""

    def __init__(self, n: int) -> None:
        self._n = n

    def size(self) -> int:
        return self._n


def megatron_groups(lens, num_gpus: int, max_seqlen_per_rank: int) -> list[list[tuple[tuple[int, ...], list[int]]]]:
    """Megatron's schedule of one global batch: per barrier group, (ranks, sequence ids) of every
    rank set, the sequences in the order each set runs them."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    scheduler = BalancedCPScheduler(max_seqlen_per_rank, _GroupSize(num_gpus))
    _, per_rank = scheduler.get_groups_and_subsamples([(i, int(s)) for i, s in enumerate(lens)], None)
    out = []
    for ranks_samples in per_rank:
        sets: dict[int, list[int]] = {}
        order: dict[int, int] = {}
        for r, samples in enumerate(ranks_samples):
            for pos, s in enumerate(samples):
                sets.setdefault(s, []).append(r)
                order.setdefault(s, pos)
        by_set: dict[tuple[int, ...], list[int]] = {}
        for s in sorted(sets, key=lambda s: (order[s], s)):
            by_set.setdefault(tuple(sets[s]), []).append(s)
        out.append(sorted(by_set.items()))
    return out


def plan_hybrid_cp(lens, cm: CostModel) -> StepPlan:
    """Megatron's hybrid-CP schedule of ``lens`` on ``cm``'s cluster, priced by ``cm`` (see the
    module docstring). ``ValueError`` when it uses a group size the model does not allow."""
    t0 = time.perf_counter()
    lens = np.asarray(lens, dtype=np.int64)
    n = cm.cluster.num_gpus
    schedule = megatron_groups(lens, n, cm.capacity_tokens)
    megatron_ms = 0.0
    mbs = []
    for group in schedule:
        spans, passes = [], []
        for ranks, seqs in group:
            d = len(ranks)
            if d not in cm.sizes:
                raise ValueError(f"{NAME}: Megatron's scheduler formed a group of {d} ranks; "
                                 f"{cm.model.name} on {n} GPUs allows {cm.sizes}")
            spans.append(sum(cm.group_time_ms(lens[[s]], d) for s in seqs))
            passes.append((d, _first_fit(seqs, lens, cm.group_capacity_tokens(d))))
        megatron_ms += max(spans)
        for k in range(max(len(p) for _, p in passes)):
            members = [(d, p[k]) for d, p in passes if k < len(p)]
            placed = place_groups([d for d, _ in members], cm.cluster)
            mbs.append(MicroBatchPlan(tuple(sorted(
                (GroupPlan(r, tuple(seqs), cm.group_time_ms(lens[seqs], d))
                 for r, (d, seqs) in zip(placed, members)), key=lambda g: g.ranks[0]))))
    step = float(sum(mb.predicted_ms for mb in mbs))
    return StepPlan(num_gpus=n, gpus_per_node=cm.cluster.gpus_per_node,
                    seq_lens=tuple(int(x) for x in lens), micro_batches=tuple(mbs), strategy=NAME,
                    method="megatron-balanced-cp", predicted_step_ms=step,
                    solve_time_s=time.perf_counter() - t0, tensor_parallel=cm.parallel.tp,
                    info={"megatron_step_ms": megatron_ms, "barrier_groups": len(schedule),
                          "max_seqlen_per_rank": cm.capacity_tokens})


def _first_fit(seqs: list[int], lens: np.ndarray, capacity: int) -> list[list[int]]:
    """``seqs`` in order into passes of at most ``capacity`` tokens (first fit)."""
    passes: list[list[int]] = []
    room: list[int] = []
    for s in seqs:
        for k, free in enumerate(room):
            if lens[s] <= free:
                passes[k].append(s)
                room[k] -= int(lens[s])
                break
        else:
            passes.append([s])
            room.append(capacity - int(lens[s]))
    return passes


register_strategy(NAME, plan_hybrid_cp)
