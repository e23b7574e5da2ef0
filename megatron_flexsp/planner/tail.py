"""Re-planning a layout's tail: its slowest micro-batches kept, the rest planned again.

The search families plan the whole batch with one structure: a common level, shelves (each
micro-batch stuffed at its own level), a stuffed first micro-batch and the rest split or packed by
memory. Where the longest sequences need two levels of their own, no one structure fits: on a
lognormal step (mean 4K tokens, 8,192 documents, 1,024 GPUs) the best layout ran the 196K-token
documents in a first micro-batch of 5.53 s, the 50K ones in a second of 3.33 s, and then four
more shelves of falling makespans (2.39 to 1.04 s), the last a third full; the same sequences
after the first micro-batch, stuffed once more and split evenly into four, take 10.47 s instead
of 10.67 s. :func:`replan_tail` keeps the ``j`` slowest micro-batches of a layout (``j`` = 1, 2,
3) and plans the sequences of the others as the search's stuffed-and-split family does
(:func:`~planner.search.stuffed_layouts`) and as a balanced split over counts
(:func:`~planner.split.best_split`), keeping the fastest layout.

:func:`repack_tail` works from the other end: the ``t`` fastest micro-batches, where the
memory-bound short sequences end up once the long ones have had their levels, are pooled and
packed by memory again, spread evenly over as many micro-batches as a plain packing of them needs,
and drained (:func:`~planner.drain.drain_micro_batches`): on a lognormal step (mean 16K tokens,
2,048 documents, 256 GPUs) the 10 fastest of 22 micro-batches (22.48 s) became 9 (21.98 s).
"""

from __future__ import annotations

import itertools

import numpy as np

from megatron_flexsp.planner.groups_first import bin_sizes, groups_first, spread_evenly
from megatron_flexsp.planner.drain import DRAIN_TRIES, drain_micro_batches
from megatron_flexsp.planner.layout import Group, Tables, mb_items
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.search import stuffed_layouts
from megatron_flexsp.planner.split import best_split

Layout = list[list[Group]]


def replan_tail(layout: Layout, packer: LevelPacker, deadline, keep: int = 3, tries: int = 2) -> int:
    """Keep the ``j`` slowest micro-batches of ``layout`` (``j`` from 1 to ``keep``, fewer than all)
    and re-plan the sequences of the others: a first micro-batch stuffed at the levels of
    :func:`~planner.search.stuffed_layouts` with the rest split at its memory minimum or one more
    (the ``tries`` levels with the least estimate; the first won in most layouts measured, and each
    try is a stuffing and a split, 0.2-0.4 s at 1,024 GPUs), then a balanced split over
    micro-batch counts. The fastest layout found replaces ``layout`` in place when it is faster.
    Stops at ``deadline``. Returns how many micro-batches were kept (0: unchanged)."""
    tab = packer.tab
    order = sorted(range(len(layout)), key=lambda j: -tab.mb_ms(layout[j]))
    best_ms = tab.step_ms(layout)
    best: Layout | None = None
    kept = 0
    for j in range(1, min(keep, len(layout) - 1) + 1):
        if deadline.expired():
            break
        fixed = [layout[q] for q in order[:j]]
        fixed_ms = sum(tab.mb_ms(mb) for mb in fixed)
        items = np.concatenate([mb_items(layout[q]) for q in order[j:]])
        for _, rest in itertools.islice(stuffed_layouts(packer, items, deadline, lambda: best_ms,
                                                        prefix_ms=fixed_ms, by_memory=False), tries):
            ms = fixed_ms + tab.step_ms(rest)
            if ms < best_ms * (1 - 1e-9):
                best_ms, best, kept = ms, fixed + rest, j
        ms, _, rest = best_split(packer, items, deadline, prefix_ms=fixed_ms, upper_ms=best_ms)
        if rest is not None and ms < best_ms * (1 - 1e-9):
            best_ms, best, kept = ms, fixed + rest, j
    if best is not None:
        layout[:] = [[tab.clone(g) for g in mb] for mb in best]
    return kept


def repack_tail(layout: Layout, tab: Tables, deadline) -> int:
    """Pool the ``t`` fastest micro-batches of ``layout``, pack their sequences groups first with
    memory spread evenly over as many micro-batches as the plain packing needs
    (:func:`~planner.groups_first.spread_evenly`) and drain the result; it replaces
    them, in place, where its micro-batches take less time in all. ``t`` from half the
    micro-batches outwards (half, one more, one fewer, ...; 2 to all), each try on ``layout`` as
    the tries before left it: the best ``t`` ranged from 4 of 9 to 10 of 22 on the steps measured
    (module docstring). Tens of milliseconds a try at a few thousand sequences; stops at
    ``deadline``. Returns how many tries replaced micro-batches."""
    replaced = 0
    half = max(2, (len(layout) + 1) // 2)
    for t in sorted(range(2, len(layout) + 1), key=lambda t: (abs(t - half), -t)):
        if deadline.expired():
            break
        if t > len(layout):
            continue
        ranked = sorted(range(len(layout)), key=lambda j: tab.mb_ms(layout[j]))
        tail = ranked[:t]
        items = np.concatenate([mb_items(layout[j]) for j in tail])
        even = spread_evenly(tab, items, len(groups_first(tab, bin_sizes(tab)[0], items=items)))
        drain_micro_batches(even, tab, deadline=deadline, tries=DRAIN_TRIES)
        if tab.step_ms(even) < sum(tab.mb_ms(layout[j]) for j in tail) * (1 - 1e-9):
            gone = set(tail)
            layout[:] = [layout[j] for j in range(len(layout)) if j not in gone] + even
            replaced += 1
    return replaced
