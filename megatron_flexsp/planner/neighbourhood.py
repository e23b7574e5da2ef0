"""Re-planning neighbourhoods of a layout: a few micro-batches pooled and planned again.

The polishing's moves look at one micro-batch (re-packing, splitting), a pair (re-splits), the
tail, or single sequences and groups (the local search, exchanges). Once they stall, what is left
lies in which sequences share a micro-batch, across micro-batches none of those moves pairs up.
:func:`replan_neighbourhoods` pools the sequences of ``size`` micro-batches at a time (three
adjacent in makespan order from a random start, or three at random, in turn) and plans them again
with one search family per try, each family with either kind of neighbourhood: the stuffed first
micro-batch with the rest packed or split (:func:`~planner.search.stuffed_layouts`), shelves
(:class:`~planner.shelves.ShelfPlanner`), the balanced split over counts
(:func:`~planner.split.best_split`) and groups first
(:func:`~planner.search.groups_first_layouts`); the micro-batches are replaced where the new
ones take less time in all. Each try takes 10-100 ms at 64-256 GPUs, and most find nothing:
it is a use for time the other moves leave, not a replacement for them. Given 5 s on 1 s plans
of eight failing steps (64 and 256 GPUs) it took 0-0.76% off (a Pareto-tailed step of 4,096
documents at 64 GPUs 0.36% in its first 0.2 s, 0.76% in all; a GitHub-like one of 2,048 0.41%).
Pseudo-random with a fixed seed: the same layout and the same number of tries give the same
result.
"""

from __future__ import annotations

import itertools
import random

import numpy as np

from megatron_flexsp.planner.layout import Group, improve_layout, mb_items
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.search import base_range, groups_first_layouts, level_grid, stuffed_layouts
from megatron_flexsp.planner.shelves import SCORES, ShelfPlanner
from megatron_flexsp.planner.split import best_split

__all__ = ["FAMILIES", "replan_neighbourhoods"]

Layout = list[list[Group]]
#: the search families a neighbourhood is planned with, one per try in this order
FAMILIES = ("stuffed", "shelves", "split", "groups-first")
#: a re-planned neighbourhood gets the local search (milliseconds) where it is within this share of
#: the time it replaces
SEARCH_WITHIN = 0.03
#: stuffed layouts tried per neighbourhood (in the order of their estimate)
STUFFED_TRIES = 4


def replan_neighbourhoods(layout: Layout, packer: LevelPacker, deadline, *, tries: int, size: int = 3,
                          seed: int = 0) -> int:
    """Up to ``tries`` neighbourhoods of ``size`` micro-batches of ``layout`` re-planned (see the
    module docstring), in place, until ``deadline``; stops after the first that makes the step
    faster. Returns 1 if one did, else 0. ``seed`` fixes the choice of neighbourhoods."""
    if tries < 0 or size < 2:
        raise ValueError(f"tries={tries} must be >= 0 and size={size} >= 2")
    tab = packer.tab
    if len(layout) < size:
        return 0
    rng = random.Random(seed)
    order = sorted(range(len(layout)), key=lambda j: (-tab.mb_ms(layout[j]), j))  # fixed until a try gains
    for t in range(tries):
        if deadline.expired():
            break
        if t % 2 == 0:
            start = rng.randrange(len(layout) - size + 1)
            pick = order[start:start + size]
        else:
            pick = rng.sample(range(len(layout)), size)
        before = sum(tab.mb_ms(layout[j]) for j in pick)
        items = np.concatenate([mb_items(layout[j]) for j in pick])
        # each family in turn with either kind of neighbourhood
        new = _replan(packer, items, before, FAMILIES[(t // 2) % len(FAMILIES)], deadline)
        if new is not None and tab.step_ms(new) < before * (1 - 1e-9):
            gone = set(pick)
            layout[:] = [mb for j, mb in enumerate(layout) if j not in gone] + new
            return 1
    return 0


def _replan(packer: LevelPacker, items: np.ndarray, before: float, family: str, deadline) -> Layout | None:
    """``items`` planned by ``family`` (one of :data:`FAMILIES`), the best layout searched locally
    where it is within :data:`SEARCH_WITHIN` of ``before`` (ms); None when none was made."""
    tab = packer.tab
    found: list[Layout] = []
    if family == "stuffed":
        found += [lay for _, lay in itertools.islice(
            stuffed_layouts(packer, items, deadline, lambda: before), STUFFED_TRIES)]
    elif family == "shelves":
        bases = level_grid(*base_range(packer, packer.memory_minimum(items)), 8)
        shelf = ShelfPlanner(packer)
        for score in SCORES:
            lay = shelf.layout(items, bases, score, deadline, give_up_ms=before)
            if lay is not None:
                found.append(lay)
    elif family == "split":
        _, _, lay = best_split(packer, items, deadline, upper_ms=before)
        if lay is not None:
            found.append(lay)
    elif family == "groups-first":
        found += groups_first_layouts(tab, items, deadline)
    else:
        raise ValueError(f"family={family!r} must be one of {FAMILIES}")
    if not found:
        return None
    best = min(found, key=tab.step_ms)
    if tab.step_ms(best) < before * (1 + SEARCH_WITHIN):
        improve_layout(best, tab, deadline=deadline)
    return best
