"""The fast step search: families of whole-step layouts, each in polynomial time.

Six families of candidate layouts, in this order; all but the first and the fifth are built
from the one-micro-batch packing of :class:`~megatron_flexsp.planner.level.LevelPacker` (nothing
branches per micro-batch):

* **groups first** (:mod:`planner.groups_first`): sequences packed into groups by memory, groups
  into micro-batches by time; strong when memory sets the micro-batch count. Megatron-DCP's
  memory-filling greedy (:func:`~planner.heuristics.megatron_dcp`) is drained beside them.
* **shelves** (:mod:`planner.shelves`): micro-batches stuffed one after another, each at a level
  chosen for it (the base levels, the hardest sequences' finish times, a grid above), by two
  scores; strong where a few long sequences want slower, denser micro-batches of their own.
* **common level** ``T``: micro-batches are stuffed one after another, hardest sequences first, each
  at the level ``max(T, fastest finish of its hardest remaining sequence)``; ``T`` runs over a
  geometric grid and is then refined around the best point. In good plans every micro-batch but
  the last has about the same makespan, which is what one common level gives.
* **stuffed first, split rest** (or **packed groups first**): the first micro-batch stuffed at a
  level ``T1`` from a small grid above the longest sequence's fastest finish, or at the level where
  the rest first fits one micro-batch fewer than the memory minimum
  (:meth:`~megatron_flexsp.planner.level.LevelPacker.fill_level`), the rest split as below into
  ``m - 1``, or packed by memory as in the first family (where memory sets the count); once
  every such first has been tried, each level again with open groups first
  (:meth:`~megatron_flexsp.planner.level.LevelPacker.stuff`'s ``open_first``).
* **best fit** (:mod:`planner.best_fit`, only where the batch fits one micro-batch's memory): one
  micro-batch, longest sequences first into the group with the least time left at a common level,
  new groups of one base size; strong with few sequences per GPU.
* **balanced split** into ``m`` micro-batches (only where the batch fits one micro-batch's memory):
  sequences heaviest first (least GPU-time over the sizes that hold them) to the lightest
  micro-batch with token room, then each micro-batch packed at its smallest level (bisection). The
  stuffed family splits its rest this way.

Each family gets a share of the time left (a quarter, a third, half, two thirds or, where the last
two do not run, all of it, a quarter, half), and a
layout being built is given up once the micro-batches made and a lower bound on the rest are
:data:`PRUNE` above the best layout so far. Costs: a common level is O(n log n) per level, a shelf
O(candidates x n log n), a split O(n log m) plus one bisection (about 15 packings) per micro-batch,
a best fit O(n x groups) per packing and one bisection per base size;
levels are searched on fixed grids, so the total is polynomial in sequences, micro-batches and group
sizes. Every loop checks the :class:`Deadline`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import numpy as np

from megatron_flexsp.planner.best_fit import best_fit_micro_batch
from megatron_flexsp.planner.groups_first import (bin_sizes, groups_first, longest_first, opening_sizes,
                                                  pack_opening, spread_evenly)
from megatron_flexsp.planner.drain import DRAIN_TRIES, could_drain_below, drain_micro_batches
from megatron_flexsp.planner.heuristics import megatron_dcp
from megatron_flexsp.planner.layout import Group, Tables
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.shelves import SCORES, ShelfPlanner
from megatron_flexsp.planner.split import PRUNE, best_split, common_level, split_pack_or_give_up

Layout = list[list[Group]]


class Deadline:
    """A wall-clock deadline ``seconds`` from now (``math.inf``: none)."""

    def __init__(self, seconds: float = math.inf) -> None:
        self.start = time.perf_counter()
        self.end = self.start + seconds

    def left(self) -> float:
        """Seconds left (negative once passed)."""
        return self.end - time.perf_counter()

    def expired(self) -> bool:
        return time.perf_counter() >= self.end

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def capped(self, end: float) -> "Deadline":
        """The same clock ending at ``end`` (a ``time.perf_counter()`` value) or at this deadline,
        whichever comes first."""
        return self._ending(min(self.end, end))

    def extended(self, seconds: float) -> "Deadline":
        """The same clock ending ``seconds`` after this deadline."""
        return self._ending(self.end + seconds)

    def _ending(self, end: float) -> "Deadline":
        sub = Deadline(0.0)
        sub.start, sub.end = self.start, end
        return sub


def level_grid(lo: float, hi: float, points: int) -> list[float]:
    """``points`` levels spaced geometrically from ``lo`` to ``hi``."""
    if hi <= lo * (1 + 1e-9) or points < 2:
        return [lo]
    return [lo * (hi / lo) ** (k / (points - 1)) for k in range(points)]


def base_range(packer: LevelPacker, m_min: int) -> tuple[float, float]:
    """The range (ms) of the search's base levels: from the level of 1.4x the memory minimum
    ``m_min`` of balanced micro-batches to 1.25x the level of the memory minimum (or of the hardest
    sequence's fastest finish, if higher)."""
    n_gpus, f_min = packer.n_gpus, packer.f_min
    area = float(packer.gpu_time_min.sum())
    lo = f_min + area / (n_gpus * (1.4 * m_min + 2))
    return lo, max(float(packer.critical.max()), f_min + area / (n_gpus * m_min)) * 1.25


def first_levels(packer: LevelPacker, items: np.ndarray, lo: float, hi: float, grid: int = 5,
                 hardest: int = 4) -> list[float]:
    """Levels for a stuffed first micro-batch: a geometric grid from ``lo`` to ``hi`` plus every
    size's finish time of the ``hardest`` sequences within it (where their cheapest size changes)."""
    top = items[np.argsort(-packer.critical[items], kind="stable")[:hardest]]
    times = packer.total[:, top][packer.ok[:, top]]
    return sorted(set(level_grid(lo, hi, grid)) | {float(t) for t in times if t >= lo})


def groups_first_layouts(tab: Tables, items: np.ndarray, deadline: Deadline, dcp: bool = False,
                         greedy: Layout | None = None) -> list[Layout]:
    """Groups-first layouts of the sequences ``items`` (:mod:`planner.groups_first`), drained: the
    best of open groups of one or two GPUs with sequences at their smallest size or, under a level
    from a short grid above the hardest one's fastest finish, at the cheapest size finishing them
    within it; and one with memory spread evenly over as many micro-batches as the plain packing
    needed (when that leaves over 2% free); with ``dcp``, Megatron-DCP's memory-filling greedy
    (:func:`~planner.heuristics.megatron_dcp`) drained the same way (``greedy``: that greedy of
    ``items`` where the caller has built it, drained in place). Milliseconds each; none once
    ``deadline`` has passed."""
    crit = float(tab.critical_ms()[items].max())
    packed = []
    order = longest_first(tab, items)
    seen = set()  # the groups' opening sizes: equal ones give the same layout (packed once)
    for level in [math.inf] + level_grid(crit, 3 * crit, 4):
        for bin_size in bin_sizes(tab)[:2]:
            if deadline.expired():
                break
            opens = opening_sizes(tab, bin_size, level, order)
            key = opens.tobytes()
            if key in seen:
                continue
            seen.add(key)
            layout = pack_opening(tab, order, opens)
            packed.append((tab.step_ms(layout), len(packed), layout))
    if not packed:
        return []
    chosen = [min(packed)[2]]
    count = len(packed[0][2])  # the plain packing's (level inf, the first bin size)
    room = count * tab.cm.cluster.num_gpus * tab.cm.capacity_tokens
    if int(tab.lens[items].sum()) < 0.98 * room and not deadline.expired():
        chosen.append(spread_evenly(tab, items, count))
    for layout in chosen:
        drain_micro_batches(layout, tab, deadline=deadline, tries=DRAIN_TRIES)
    # the greedy drained only where that could beat the best so far (on 4,096 documents at 64
    # GPUs it takes 0.01 s to build and 0.04-0.16 s to drain, often to no use)
    if deadline.expired() or not (dcp or greedy is not None):
        return chosen
    greedy = greedy if greedy is not None else megatron_dcp(tab, items, deadline=deadline)
    if greedy is not None and could_drain_below(greedy, tab, min(tab.step_ms(x) for x in chosen)):
        drain_micro_batches(greedy, tab, deadline=deadline, tries=DRAIN_TRIES)
        chosen.append(greedy)
    return chosen


def stuffed_layouts(packer: LevelPacker, items: np.ndarray, deadline: Deadline, best: Callable[[], float],
                    prefix_ms: float = 0.0, m_min: int = 0, by_memory: bool = True
                    ) -> Iterator[tuple[str, Layout]]:
    """Layouts of ``items`` whose first micro-batch is stuffed (:meth:`LevelPacker.stuff`) at a
    level where the hardest sequences' sizes change (:func:`first_levels`) or where the rest first
    fits one micro-batch fewer than the memory minimum (memory full, or 2% free), the rest packed
    by memory (``"stuffed+groups"``: :func:`groups_first_layouts` with Megatron-DCP's greedy)
    and split at its memory minimum (one more when that does not pack; ``"stuffed+split"``); once
    every first has been tried, the same levels stuffed with open groups first (where that leaves
    another rest). The
    levels are tried in the order of a cheap estimate (the first micro-batch plus the rest's
    simple bound), skipped once that estimate plus ``prefix_ms`` (micro-batches the caller keeps)
    reaches ``best()``, the step time to beat. ``m_min``: the memory minimum of micro-batches (of
    ``items``' tokens when not given); ``by_memory``: whether to pack the rest by memory too.
    Yields (family, layout) until ``deadline``."""
    tab = packer.tab
    n_gpus, f_min = packer.n_gpus, packer.f_min
    m_min = m_min or packer.memory_minimum(items)
    crit = float(packer.critical[items].max())
    top = max(crit, 2 * (f_min + float(packer.gpu_time_min[items].sum()) / (n_gpus * m_min)))
    stuffed = {}  # level -> packer.stuff(items, level)
    for t1 in sorted(first_levels(packer, items, crit, top)):
        if deadline.expired():
            break
        stuffed[t1] = packer.stuff(items, t1)
    levels = set(stuffed)
    mb_tokens = tab.cm.capacity_tokens * n_gpus
    if m_min > 1:  # where the rest first fits one micro-batch fewer (bracketed by the levels above)
        for share in (1.0, 0.98):
            if deadline.expired():
                break
            fits = packer.fill_level(items, int(share * (m_min - 1) * mb_tokens), crit, top,
                                     deadline=deadline, stuffed=stuffed)
            if fits is not None:
                levels.add(fits)
    seen: list[np.ndarray] = []  # the rests of the plain stuffing (the other way only where it differs)
    for variant in (False, True):  # plain stuffing, then open groups first once every plain one ran
        firsts = []
        for t1 in sorted(levels):
            if variant and deadline.expired():
                break
            first, left = packer.stuff(items, t1, open_first=True) if variant else stuffed[t1]
            if not first or not len(left) or (variant and any(np.array_equal(left, x) for x in seen)):
                continue
            seen.append(left)
            m_rest = max(1, math.ceil(int(tab.lens[left].sum()) / mb_tokens))
            estimate = (prefix_ms + tab.mb_ms(first) + m_rest * f_min
                        + float(packer.gpu_time_min[left].sum()) / n_gpus)
            firsts.append((estimate, t1, first, left, m_rest))
        for estimate, t1, first, left, m_rest in sorted(firsts, key=lambda f: f[:2]):
            if deadline.expired():
                break
            if estimate >= best():
                continue
            tails = groups_first_layouts(tab, left, deadline, dcp=True) if by_memory else []
            for tail in tails:  # the rest packed by memory
                yield "stuffed+groups", [[tab.clone(g) for g in first]] + tail
            for m in (m_rest, m_rest + 1):  # one more only where memory refused the memory minimum
                rest, gave_up = split_pack_or_give_up(packer, left, m, deadline,
                                                      give_up_ms=best() * (1 + PRUNE) - prefix_ms - tab.mb_ms(first))
                if rest is not None:
                    yield "stuffed+split", [first] + rest
                if rest is not None or gave_up:
                    break


def search_step(tab: Tables, packer: LevelPacker, *, m_min: int, upper_ms: float, deadline: Deadline,
                grid: int = 8, times: dict | None = None,
                greedy: Layout | None = None) -> list[tuple[float, str, Layout]]:
    """Candidate layouts of the whole batch (see the module docstring), each with its step time
    (ms) and family name; only those faster than ``upper_ms``. Each family is capped so that a
    short deadline still leaves time to the next. ``times`` (if given) gets the seconds each
    family took. ``greedy``: Megatron-DCP's greedy of the whole batch where the caller has built
    it (the groups-first family drains it in place; built here otherwise)."""
    items = np.arange(len(tab.lens))
    out: list[tuple[float, str, Layout]] = []
    if deadline.expired():  # (the candidates before it took the search's time: a huge batch)
        return out
    best = upper_ms

    clock = [time.perf_counter()]

    def keep(layout: Layout | None, name: str) -> None:
        nonlocal best
        now = time.perf_counter()
        if times is not None:
            times[name] = times.get(name, 0.0) + now - clock[0]
        clock[0] = now
        if layout is None:
            return
        ms = tab.step_ms(layout)
        if ms < upper_ms:
            out.append((ms, name, layout))
            best = min(best, ms)

    # 0. groups first (milliseconds each): open groups of one or two GPUs, sequences at their
    #    smallest size or, under a level from a short grid above the hardest sequence's fastest
    #    finish, the cheapest size that finishes them within it. The best of these, one with
    #    memory spread evenly over as many micro-batches as the plain packing needed, and
    #    Megatron-DCP's greedy then empty their shortest micro-batches into the others' free memory
    #    (a quarter of the search's time at most, so the other families always get the rest)
    own = deadline.capped(time.perf_counter() + deadline.left() / 4)
    for layout in groups_first_layouts(tab, items, own, dcp=True, greedy=greedy):
        keep(layout, "groups-first")
    lo, hi = base_range(packer, m_min)
    # 1. shelves: each micro-batch at its own level, by both scores (a third of the time left)
    shelf = ShelfPlanner(packer)
    own = deadline.capped(time.perf_counter() + deadline.left() / 3)
    for k, score in enumerate(SCORES):
        if k and own.expired():  # a layout past the deadline is one stuffing per micro-batch at the
            break                # lowest base level: the common level family's first layout
        keep(shelf.layout(items, level_grid(lo, hi, grid), score, own, give_up_ms=best * (1 + PRUNE)), "shelves")
    # 2. common level: every micro-batch at one of the base levels (then refined around the best;
    #    half the time left)
    tried: dict[float, float] = {}
    cap_mbs = 4 * m_min + 8
    own = deadline.capped(time.perf_counter() + deadline.left() / 2)
    # a layout started within this share may finish past it, and past the search's deadline (one
    # that did was the plan of a Pareto-tailed step; the phases after take less), but stops half
    # the search's span after it (4,096 documents each filling a micro-batch took 1.2 s a layout)
    late = deadline.extended(0.5 * (deadline.end - deadline.start))
    for level in level_grid(lo, hi, grid):
        if own.expired():
            break
        layout = common_level(packer, items, level, cap_mbs, give_up_ms=best * (1 + PRUNE), deadline=late)
        tried[level] = tab.step_ms(layout) if layout is not None else math.inf
        keep(layout, "level")
    if tried and math.isfinite(min(tried.values())):  # refine around the best grid point
        levels = sorted(tried)
        k = min(range(len(levels)), key=lambda j: tried[levels[j]])
        a, b = levels[max(k - 1, 0)], levels[min(k + 1, len(levels) - 1)]
        for level in level_grid(a, b, 6)[1:-1]:
            if own.expired():
                break
            keep(common_level(packer, items, level, cap_mbs, give_up_ms=best * (1 + PRUNE), deadline=late),
                 "level")
    # 3. the first micro-batch stuffed at a level where the hardest sequences' sizes change, the
    #    rest packed groups first or split (two thirds of the time left, the rest for best fit and
    #    the balanced split; all of it where memory needs more than one micro-batch and neither
    #    runs: see 5.)
    own = deadline.capped(time.perf_counter() + deadline.left() * 2 / 3) if m_min == 1 else deadline
    for name, layout in stuffed_layouts(packer, items, own, lambda: best, m_min=m_min):
        keep(layout, name)
    # 4. one micro-batch packed best fit, where memory allows one (a quarter of the time left)
    if m_min == 1:
        own = deadline.capped(time.perf_counter() + deadline.left() / 4)
        mb = best_fit_micro_batch(tab, items, own, best)
        keep([mb] if mb else None, "best-fit")
    # 5. balanced split over micro-batch counts (half the time left: the rest goes to polishing),
    #    where memory allows one micro-batch. Where it needs more, the family gave no final plan in
    #    420 batches of the sweep and the robustness benchmark (it did in 8 of one micro-batch), and
    #    its 25-100 ms on batches of 1,024-4,096 documents at 64 GPUs go to the stuffed family (the
    #    rest of the search's time: paired at 1 s, -0.034% with five sixths, -0.066% more with all)
    if m_min == 1:
        own = deadline.capped(time.perf_counter() + deadline.left() / 2)
        _, _, layout = best_split(packer, items, own, upper_ms=best)
        keep(layout, "split")
    return out
