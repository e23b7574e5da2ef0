"""Plans rounded from the LP bound's relaxation.

The search families (:mod:`planner.search`, :mod:`planner.shelves`) decide front to back which
sequences share a micro-batch; the LP bound (:mod:`planner.bound`) sees the whole step at once, and
where it is low its relaxed placement often names a structure the families miss. On a bimodal
step at 256 GPUs (eight documents of 196K tokens, two of 158-166K, 2,000 short ones) the families
ran the long documents four to a micro-batch on groups of 64 (15.76 s); the relaxation put all
eight 196K documents in one micro-batch on groups of 32, the two others with short documents in a
second, the shortest documents in a third. Rounded and polished that is 15.20 s, within 0.1% of
the bound.

A :class:`~planner.step_lp.Hint` gives, per explicit (slowest) micro-batch, its level (the LP's
makespan for it) and the individually placed sequences with their sizes. Each such micro-batch
opens groups for its sequences (longest first; a sequence joins the least-loaded group of its size
where time and memory allow, and when the GPUs are used up the least-loaded one with memory room,
raising the level), then is stuffed at its level (:meth:`LevelPacker.stuff`); a second rounding
joins the fullest group it fits instead (best fit: the longest beside the longest that still
fits, where least-loaded pairs the longest with the shortest and can strand what comes last), a
third only stuffs at the levels (on nine batches of the sweep the first and third were each the
better one somewhere: 17.56 against 17.76 s on a pareto-1.1 step at 64 GPUs, 22.23 against
23.21 s on a GitHub-like one). The sequences left are laid out in shelves (:class:`~planner.shelves.ShelfPlanner`, both
scores); the best rounding is then polished.
Polynomial: a few stuffings per micro-batch.
"""

from __future__ import annotations

import math
import time

import numpy as np

from megatron_flexsp.planner.drain import DRAIN_TRIES, drain_micro_batches
from megatron_flexsp.planner.layout import Group
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.polish import settle
from megatron_flexsp.planner.search import groups_first_layouts
from megatron_flexsp.planner.shelves import SCORES, ShelfPlanner
from megatron_flexsp.planner.step_lp import Hint

Layout = list[list[Group]]


def _open_groups(packer: LevelPacker, singles: tuple[tuple[int, int], ...], level: float,
                 taken: np.ndarray, fullest: bool = False) -> list[Group]:
    """Groups for one micro-batch's ``singles`` (sequence, size) at ``level`` (ms), within N GPUs;
    a sequence already ``taken``, or that fits nowhere, is left to the stuffing. A sequence joins
    the least-loaded group it fits (time and memory), or with ``fullest`` the one holding the most
    tokens (best fit: pairs the longest with the longest that still fits)."""
    tab = packer.tab
    groups: list[Group] = []
    free = packer.n_gpus
    for i, d in sorted(singles, key=lambda s: (-int(tab.lens[s[0]]), s[0])):
        if taken[i]:
            continue
        t, size_in = float(tab.time[d][i]), int(tab.lens[i])
        room = [g for g in groups if g.size == d and g.tokens + size_in <= tab.cap[d]]
        fits = [g for g in room if g.load_ms + t + tab.fixed[d] <= level * (1 + 1e-9)]
        if fits:
            g = max(fits, key=lambda g: g.tokens) if fullest else min(fits, key=lambda g: g.load_ms)
        elif free >= d:
            g = Group(d)
            groups.append(g)
            free -= d
        elif room:
            g = min(room, key=lambda g: g.load_ms)
        else:
            continue
        tab.add(g, i)
        taken[i] = True
    return groups


def guided_layout(packer: LevelPacker, hint: Hint, bases: list[float], deadline,
                  seeded: bool = True, shelves: bool = True, fullest: bool = False) -> Layout | None:
    """A layout of the whole batch rounded from ``hint`` (see the module docstring); ``bases``:
    the shelves' base levels (ms) for the sequences the explicit micro-batches leave; ``seeded``:
    the explicit micro-batches open groups for the hint's sequences first (else they are only
    stuffed at the hint's levels); ``fullest``: they open them by best fit (:func:`_open_groups`).
    After each explicit micro-batch the sequences left are also laid out by groups first
    (:func:`~planner.search.groups_first_layouts`, milliseconds); after the last one by
    ``shelves`` too, which are not finished in a hurry. The fastest of these layouts, or None
    when ``deadline`` cut every one short. The layout's groups are its own."""
    tab = packer.tab
    n = len(tab.lens)
    taken = np.zeros(n, dtype=bool)
    heads: Layout = []
    done: list[Layout] = []
    for level, singles in zip(hint.levels, hint.singles):
        if taken.all() or deadline.expired():
            break
        groups = _open_groups(packer, singles, level, taken, fullest) if seeded else []
        level = max(level, tab.mb_ms(groups))
        groups, _ = packer.stuff(np.flatnonzero(~taken), level, seed=groups)
        if not groups:
            break
        for g in groups:
            taken[g.seqs] = True
        heads.append(groups)
        rest = np.flatnonzero(~taken)
        if not len(rest):
            done.append(heads)  # nothing left: no other completion shares these groups
            break
        # each completion gets a copy of the head's groups (the completions share the head)
        done += [tab.clone_layout(heads) + tail for tail in groups_first_layouts(tab, rest, deadline)]
    rest = np.flatnonzero(~taken)
    if shelves and len(rest):
        shelf = ShelfPlanner(packer)
        for score in SCORES:
            tail = shelf.layout(rest, bases, score, deadline, finish=False)
            if tail is not None:
                done.append(tab.clone_layout(heads) + tail)
    return min(done, key=tab.step_ms) if done else None


def guided_candidates(packer: LevelPacker, hints: tuple[Hint, ...], bases: list[float], deadline,
                      upper_ms: float = math.inf, slack: float = 0.05) -> list[tuple[float, str, Layout]]:
    """Layouts rounded from ``hints`` (lowest LP value first; each seeded least-loaded, then by
    best fit, then only stuffed at its levels; all with the rest packed groups first, then with
    shelves too) in the first half of the time to ``deadline``; the best, if at most ``slack``
    slower than ``upper_ms``, then drains its shortest micro-batches, is re-packed at its smallest
    levels, searched locally and its groups evened out by exchanges
    (:func:`~planner.polish.settle`) in the rest.
    Returns it with its step time (ms) and family name when it is then faster than ``upper_ms``."""
    tab = packer.tab
    if deadline.expired():
        return []
    half = deadline.capped(time.perf_counter() + deadline.left() / 2)
    out = []
    for shelves in (False, True):  # every rounding with its quick rests first, then with shelves
        for hint in hints:
            for seeded, fullest in ((True, False), (True, True), (False, False)):
                if half.expired():
                    break
                layout = guided_layout(packer, hint, bases, half, seeded, shelves, fullest)
                if layout is not None:
                    out.append((tab.step_ms(layout), layout))
    if not out:
        return []
    ms, layout = min(out, key=lambda c: c[0])
    if ms > upper_ms * (1 + slack):
        return []
    drain_micro_batches(layout, tab, deadline=deadline, tries=DRAIN_TRIES)
    settle(layout, packer, deadline)
    ms = tab.step_ms(layout)
    return [(ms, "lp-guided", layout)] if ms < upper_ms else []
