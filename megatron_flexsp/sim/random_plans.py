"""``random``: valid plans with random group mixes, for testing that the runtime trains any plan alike
(layer 1: numpy only).

Every sequence gets a random group size among those that hold it; micro-batches are formed from
random partitions of the devices into allowed sizes and filled in a random order within memory.
The plan is a deterministic function of the lengths (and :data:`SEED`), so a resumed run replans
a step identically. It optimises nothing: use it to compare the same documents under many different
plans (``planner: {strategy: random}`` in ``--flexsp-config``), never to train fast.
"""

from __future__ import annotations

import zlib

import numpy as np

from megatron_flexsp.cost_model import CostModel
from megatron_flexsp.plan import GroupPlan, MicroBatchPlan, StepPlan
from megatron_flexsp.planner.api import register_strategy
from megatron_flexsp.topology import place_groups

NAME = "random"
SEED = 0


def _partition(n: int, sizes: list[int], must: int, rng: np.random.Generator) -> list[int]:
    """Random group sizes summing to ``n`` devices, one of them ``must``."""
    out, left = [must], n - must
    while left:
        d = int(rng.choice([s for s in sizes if s <= left]))
        out.append(d)
        left -= d
    return out


def random_plan(lens: np.ndarray, cm: CostModel) -> StepPlan:
    """A valid plan of ``lens`` on ``cm``'s devices with random group sizes and micro-batches."""
    lens = np.asarray(lens, dtype=np.int64)
    rng = np.random.default_rng([SEED, zlib.crc32(lens.tobytes())])
    n = cm.cluster.num_gpus
    size_of = {}
    for s in range(len(lens)):
        fits = [d for d in cm.sizes if lens[s] <= cm.group_capacity_tokens(d)]
        if not fits:
            raise ValueError(f"sequence {s} of {int(lens[s])} tokens fits no group (largest holds "
                             f"{cm.max_tokens})")
        size_of[s] = int(rng.choice(fits))
    pending = [int(s) for s in rng.permutation(len(lens))]
    mbs = []
    while pending:
        first = pending[0]
        sizes = _partition(n, cm.sizes, size_of[first], rng)
        members: list[list[int]] = [[] for _ in sizes]
        room = [cm.group_capacity_tokens(d) for d in sizes]
        for s in list(pending):
            slots = [k for k, d in enumerate(sizes) if d == size_of[s] and lens[s] <= room[k]]
            if slots and (s == first or rng.random() < 0.7):
                k = int(rng.choice(slots))
                members[k].append(s)
                room[k] -= int(lens[s])
                pending.remove(s)
        used = [(d, seqs) for d, seqs in zip(sizes, members) if seqs]
        ranks = place_groups([d for d, _ in used], cm.cluster)
        mbs.append(MicroBatchPlan(tuple(GroupPlan(r, tuple(seqs), cm.group_time_ms(lens[seqs], d))
                                        for r, (d, seqs) in zip(ranks, used))))
    step = float(sum(mb.predicted_ms for mb in mbs))
    return StepPlan(num_gpus=n, gpus_per_node=cm.cluster.gpus_per_node,
                    seq_lens=tuple(int(x) for x in lens), micro_batches=tuple(mbs), strategy=NAME,
                    method="random", predicted_step_ms=step, tensor_parallel=cm.parallel.tp)


register_strategy(NAME, random_plan)
