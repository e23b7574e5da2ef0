"""Mutable working layout shared by every strategy, and its conversion to a :class:`StepPlan`.

A layout is a list of micro-batches, each a list of :class:`Group` (size, sequences, load). All
strategies build layouts with the same helpers, so the baselines get the same packing care as ours.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_flexsp.cost_model import CostModel
from megatron_flexsp.plan import GroupPlan, MicroBatchPlan, StepPlan
from megatron_flexsp.topology import place_groups


@dataclass(eq=False)
class Group:
    """A group being filled: ``load_ms`` excludes the fixed per-group cost."""

    size: int
    seqs: list[int] = field(default_factory=list)
    load_ms: float = 0.0
    tokens: int = 0


class Tables:
    """Per-size sequence times and per-size fixed costs for one batch (ms)."""

    def __init__(self, lens: np.ndarray, cm: CostModel) -> None:
        self.lens = np.asarray(lens, dtype=np.int64)
        self.cm = cm
        self.sizes = list(cm.sizes)
        self.time = {d: cm.seq_time_ms(self.lens, d) for d in self.sizes}
        self.fixed = {d: cm.group_fixed_ms(d) for d in self.sizes}
        self.cap = {d: cm.group_capacity_tokens(d) for d in self.sizes}
        self.min_size = np.array([cm.min_group_size(int(s)) for s in self.lens], dtype=np.int64)

    def area_min_ms(self) -> float:
        """Sum over sequences of the smallest GPU-time (size x time) any feasible group gives."""
        best = np.full(len(self.lens), np.inf)
        for d in self.sizes:
            ok = self.lens <= self.cap[d]
            best = np.where(ok, np.minimum(best, d * self.time[d]), best)
        return float(best.sum())

    def finish(self, g: Group) -> float:
        return self.fixed[g.size] + g.load_ms if g.seqs else 0.0

    def fits(self, g: Group, i: int) -> bool:
        return g.tokens + int(self.lens[i]) <= self.cap[g.size]

    def add(self, g: Group, i: int) -> None:
        g.seqs.append(int(i))
        g.load_ms += float(self.time[g.size][i])
        g.tokens += int(self.lens[i])

    def remove(self, g: Group, i: int) -> None:
        g.seqs.remove(int(i))
        g.load_ms -= float(self.time[g.size][i])
        g.tokens -= int(self.lens[i])

    def mb_ms(self, groups: list[Group]) -> float:
        return max((self.finish(g) for g in groups), default=0.0)

    def step_ms(self, layout: list[list[Group]]) -> float:
        return float(sum(self.mb_ms(mb) for mb in layout))


def pack_lpt(items, groups: list[Group], tab: Tables) -> bool:
    """Place ``items`` longest-first, each on the group where it finishes earliest and fits in memory.

    Ties go to the lower group index (deterministic). Returns False if some item fits nowhere
    (the groups are then partially filled).
    """
    order = sorted(items, key=lambda i: (-int(tab.lens[i]), i))
    for i in order:
        best, best_t = None, np.inf
        for g in groups:
            if tab.fits(g, i):
                t = tab.fixed[g.size] + g.load_ms + float(tab.time[g.size][i])
                if t < best_t - 1e-12:
                    best, best_t = g, t
        if best is None:
            return False
        tab.add(best, i)
    return True


def improve_layout(layout: list[list[Group]], tab: Tables, max_moves: int = 400) -> None:
    """Local search: move sequences off the slowest group of a micro-batch while the step time drops.

    A sequence may move to any group of any micro-batch (memory permitting); the move with the largest
    step-time reduction is applied first. Each move strictly lowers the step time, so this terminates.
    Empty groups and micro-batches are removed.
    """
    for mb in layout:
        mb[:] = [g for g in mb if g.seqs]
    layout[:] = [mb for mb in layout if mb]
    for _ in range(max_moves):
        spans = [tab.mb_ms(mb) for mb in layout]
        best = None  # (gain, item, from_group, from_mb, to_group)
        for a, mb in enumerate(layout):
            slow = max(mb, key=lambda g: (tab.finish(g), -g.size))
            others_a = max((tab.finish(g) for g in mb if g is not slow), default=0.0)
            for i in sorted(slow.seqs, key=lambda i: -float(tab.time[slow.size][i])):
                rest = tab.finish(slow) - float(tab.time[slow.size][i])
                if len(slow.seqs) == 1:
                    rest = 0.0
                new_a = max(others_a, rest)
                for b, mb_b in enumerate(layout):
                    for g in mb_b:
                        if g is slow or not tab.fits(g, i):
                            continue
                        t = tab.fixed[g.size] + g.load_ms + float(tab.time[g.size][i])
                        if b == a:
                            gain = spans[a] - max(new_a, t)
                        else:
                            gain = spans[a] - new_a - max(0.0, t - spans[b])
                        if gain > 1e-9 and (best is None or gain > best[0] + 1e-12):
                            best = (gain, i, slow, g)
        if best is None:
            break
        _, i, src, dst = best
        tab.remove(src, i)
        tab.add(dst, i)
        for mb in layout:
            mb[:] = [g for g in mb if g.seqs]
        layout[:] = [mb for mb in layout if mb]


def to_step_plan(layout: list[list[Group]], tab: Tables, *, strategy: str, method: str,
                 lower_bound_ms: float = 0.0, solve_time_s: float = 0.0, info: dict | None = None,
                 **extra) -> StepPlan:
    """Place every micro-batch's groups on ranks (node-aligned) and attach predicted times."""
    mbs = []
    for mb in layout:
        groups = [g for g in mb if g.seqs]
        ranks = place_groups([g.size for g in groups], tab.cm.cluster)
        order = sorted(range(len(groups)), key=lambda k: ranks[k][0])
        mbs.append(MicroBatchPlan(tuple(GroupPlan(ranks[k], tuple(groups[k].seqs),
                                                  tab.finish(groups[k])) for k in order)))
    mbs = [mb for mb in mbs if mb.groups]
    step = float(sum(mb.predicted_ms for mb in mbs))
    return StepPlan(num_gpus=tab.cm.cluster.num_gpus, gpus_per_node=tab.cm.cluster.gpus_per_node,
                    seq_lens=tuple(int(x) for x in tab.lens), micro_batches=tuple(mbs),
                    strategy=strategy, method=method, predicted_step_ms=step,
                    lower_bound_ms=lower_bound_ms, solve_time_s=solve_time_s, info=info or {}, **extra)
