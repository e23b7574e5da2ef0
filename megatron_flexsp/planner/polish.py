"""Polishing a layout: two micro-batches pooled and split again, the slowest first.

The search families decide which sequences share a micro-batch once, front to back. Here the
slowest micro-batch is pooled with another and the pool split again into two: the first of them
stuffed (:meth:`LevelPacker.stuff`) at each level of a short grid from the pool's hardest sequence's
fastest finish up to 0.6 of the pair's summed makespans, and at its two hardest sequences' finish
times on each size there, the rest packed at its smallest level (:meth:`LevelPacker.min_level`).
A split replaces the pair when its two makespans sum to less. On GitHub-like documents at 64 GPUs
(4,096 per step, 20 micro-batches) the first pairs, those of the slowest micro-batch, took 1% off
the step. A pair costs a few stuffings and two bisections; the deadline is checked between pairs.
"""

from __future__ import annotations

import numpy as np

from megatron_flexsp.planner.layout import Group
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.search import level_grid

Layout = list[list[Group]]


def _items(mb: list[Group]) -> np.ndarray:
    return np.array([i for g in mb for i in g.seqs], dtype=np.int64)


def split_two(packer: LevelPacker, pool: np.ndarray, upper: float, deadline, levels: int = 4,
              packed: int = 3) -> tuple[float, Layout] | None:
    """The best split of ``pool`` into two micro-batches found (sum of makespans ms, layout), among
    those faster than ``upper``; None when none is. The first is stuffed at ``levels`` levels and
    at the two hardest sequences' finish times on each size in that range; the ``packed`` with the
    least first makespan plus a lower bound on the rest get their rest packed; ``deadline`` is
    checked before each packing."""
    tab = packer.tab
    best: tuple[float, Layout] | None = None
    crit = float(packer.critical[pool].max())
    top = pool[np.argsort(-packer.critical[pool], kind="stable")[:2]]
    times = packer.total[:, top][packer.ok[:, top]]
    high = max(crit, 0.6 * upper)
    grid = set(level_grid(crit, high, levels)) | {float(t) * (1 + 1e-9) for t in times if crit < t <= high}
    tries = []
    for level in sorted(grid):
        if deadline.expired():
            return None
        first, rest = packer.stuff(pool, level)
        if first and len(rest):
            tries.append((first, rest))
    ranked = sorted((tab.mb_ms(first) + packer.lower_bound(rest, 1), k) for k, (first, rest) in enumerate(tries))
    for estimate, k in ranked[:packed]:  # the most promising by a lower estimate of the rest
        if estimate >= upper or deadline.expired():
            break
        first, rest = tries[k]
        ms = tab.mb_ms(first)
        found = packer.min_level(rest, rel_tol=1e-2)
        if found is None:
            continue
        total = ms + tab.mb_ms(found[1])
        if total < upper and (best is None or total < best[0]):
            best = (total, [first, found[1]])
    return best


def resplit_pairs(layout: Layout, packer: LevelPacker, deadline, slowest: int = 2) -> int:
    """Pool each of the ``slowest`` micro-batches of ``layout`` with every other (the slowest
    partners first) and keep a faster split (:func:`split_two`), in place, until ``deadline``.
    Returns how many pairs got faster."""
    tab = packer.tab
    better = 0
    for rank in range(slowest):
        if deadline.expired() or len(layout) < 2:
            break
        order = sorted(range(len(layout)), key=lambda j: -tab.mb_ms(layout[j]))
        if rank >= len(order):
            break
        a = order[rank]
        for b in order:
            if deadline.expired():
                return better
            if b == a:
                continue
            upper = (tab.mb_ms(layout[a]) + tab.mb_ms(layout[b])) * (1 - 1e-9)
            found = split_two(packer, np.concatenate([_items(layout[a]), _items(layout[b])]), upper, deadline)
            if found is not None:
                layout[a], layout[b] = found[1]
                better += 1
    return better
