"""Shelves: micro-batches stuffed one after another, each at a level chosen for it.

The common-level family (:mod:`planner.search`) stuffs every micro-batch at one level ``T`` (or
the fastest finish of its hardest sequence). Long sequences often want another level: eight
sequences of 196K tokens finish in 9.3 s on groups of 32 GPUs but in 4.9 s on groups of 64, and
the slower micro-batch holds twice as many of them for 5% less GPU-time; two long sequences
stacked in one group may beat two micro-batches. Here each micro-batch (a *shelf*) tries

* the base levels (a grid given by the caller, each raised to the fastest finish of the hardest
  sequence left),
* every size's finish time of the ``hardest`` sequences left, up to three times the lowest base,
* a geometric grid of ``grid`` levels up to three times it (long sequences stacked in one group, or
  short ones in fewer, slower micro-batches),

stuffs the micro-batch at each (:meth:`LevelPacker.stuff`) and keeps the best by one of two scores:

* ``value``: the work it takes per ms of makespan, a sequence being worth its least GPU-time over
  N plus its share ``tokens / (N C)`` of one fixed cost (a micro-batch full in time and memory
  scores about 1): greedy shelf packing by efficiency;
* ``estimate``: its makespan plus a lower estimate of the rest (the memory-minimum count of fixed
  costs plus the rest's least GPU-time over N, or its hardest sequence's fastest finish).

Once the hardest sequence left finishes below every base, a micro-batch only tries the levels next
to the one before. What is left once it fits in one micro-batch is packed at its smallest level. Stuffings are cached
by the choices that led to them, so the two scores share their common first shelves. A shelf costs
``O(candidates x n log n)`` with a bounded number of candidates: polynomial in sequences,
micro-batches and group sizes.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_flexsp.planner.layout import Group
from megatron_flexsp.planner.level import LevelPacker

Layout = list[list[Group]]
SCORES = ("value", "estimate")
#: Past the deadline, a layout is finished at its last level only if that takes at most this many
#: more micro-batches (one stuffing each); else :meth:`ShelfPlanner.layout` gives up.
FINISH_MAX = 16


class ShelfPlanner:
    """Shelf layouts of one batch (see the module docstring).

    ``hardest``: sequences whose finish times are candidate levels; ``grid``: levels of the grid
    above the base; ``near``: levels on either side of the one before tried once only short
    sequences are left; ``last_tol``: relative tolerance of the last micro-batch's smallest level.
    """

    def __init__(self, packer: LevelPacker, hardest: int = 6, grid: int = 6, near: int = 4,
                 last_tol: float = 2e-2) -> None:
        tab = packer.tab
        self.packer, self.tab = packer, tab
        self.hardest, self.grid, self.near, self.last_tol = hardest, grid, near, last_tol
        self.n_gpus = packer.n_gpus
        self.mb_tokens = tab.cm.capacity_tokens * packer.n_gpus
        self.f_min = packer.f_min
        # what a sequence is worth in a micro-batch full in time and memory (ms)
        self.value = (packer.gpu_time_min / self.n_gpus
                      + self.f_min * tab.lens.astype(np.float64) / self.mb_tokens)
        self._memo: dict[tuple, tuple[list[Group], np.ndarray]] = {}

    def candidates(self, left: np.ndarray, bases: list[float], last: float | None = None) -> list[float]:
        """Levels (ms) to try for the next micro-batch of ``left`` (ascending). ``last``: the level
        of the micro-batch before; once the hardest sequence left finishes below every base, only
        the ``near`` levels on either side of it are tried (a run of short sequences keeps about
        the same level)."""
        p = self.packer
        crit = p.critical[left]
        hardest = float(crit.max())
        raised = {max(b, hardest) for b in bases}
        c0 = min(raised)
        top = left[np.argsort(-crit, kind="stable")[:self.hardest]]
        times = p.total[:, top][p.ok[:, top]]
        out = raised | {float(t) * (1 + 1e-9) for t in times if c0 < t <= 3 * c0}  # just above: it fits
        if self.grid > 1:
            out.update(c0 * 3 ** (k / (self.grid - 1)) for k in range(1, self.grid))
        levels = sorted(out)
        if last is not None and hardest < min(bases):
            k = int(np.searchsorted(levels, last))
            return levels[max(k - self.near, 0):k + self.near + 1]
        return levels

    def layout(self, items: np.ndarray, bases: list[float], score: str, deadline,
               give_up_ms: float = math.inf, finish: bool = True) -> Layout | None:
        """Shelves of ``items`` over the base levels ``bases`` (ms) with ``score`` (one of
        :data:`SCORES`). When ``deadline`` passes first, the shelf being chosen takes the best
        level tried so far and the rest is stuffed at the last level chosen (None if that needs
        over :data:`FINISH_MAX` micro-batches, or if not ``finish``).
        None once the micro-batches so far and a lower bound on the rest reach ``give_up_ms``. The
        layout's groups are its own."""
        if score not in SCORES:
            raise ValueError(f"score={score!r} must be one of {SCORES}")
        tab, p = self.tab, self.packer
        left = np.asarray(items, dtype=np.int64)
        path: tuple = ()
        last = None
        done = 0.0
        shelves: list[list[Group]] = []
        while len(left):
            if deadline.expired():  # finish at the last level, one stuffing per micro-batch
                if not finish:
                    return None
                return self._finish(shelves, left, last if last is not None else min(bases))
            if int(tab.lens[left].sum()) <= self.mb_tokens:
                found = p.min_level(left, rel_tol=self.last_tol, deadline=None if finish else deadline)
                if found is not None:
                    shelves.append(found[1])
                    break
            best = None
            for level in self.candidates(left, bases, last):
                if deadline.expired():  # (each stuffing of 32,768 documents takes 0.05-0.1 s)
                    if not finish:
                        return None
                    if best is not None:  # the best level tried so far
                        break
                key = path + (level,)
                if key not in self._memo:
                    self._memo[key] = p.stuff(left, level)
                groups, rest = self._memo[key]
                if not groups:
                    continue
                ms = tab.mb_ms(groups)
                if score == "value":
                    rank = -float(self.value[left].sum() - self.value[rest].sum()) / ms
                else:
                    rank = ms + p.least_ms(rest)
                if best is None or rank < best[0]:
                    best = (rank, level, groups, rest)
            if best is None:
                return None
            _, last, groups, left = best
            path += (last,)
            shelves.append(groups)
            done += tab.mb_ms(groups)
            if done + p.least_ms(left) >= give_up_ms:
                return None
        return tab.clone_layout(shelves)

    def _finish(self, shelves: list[list[Group]], left: np.ndarray, level: float) -> Layout | None:
        """``shelves`` completed by stuffing ``left`` at ``level`` (raised to its hardest sequence's
        fastest finish); None when memory needs more than :data:`FINISH_MAX` micro-batches for it
        (or stuffing more than twice that)."""
        p = self.packer
        if math.ceil(int(self.tab.lens[left].sum()) / self.mb_tokens) > FINISH_MAX:
            return None
        for _ in range(2 * FINISH_MAX):  # stuffing may need more than the memory minimum
            if not len(left):
                return self.tab.clone_layout(shelves)
            groups, left = p.stuff(left, max(level, float(p.critical[left].max())))
            if not groups:
                return None
            shelves.append(groups)
        return None

