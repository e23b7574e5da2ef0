"""A valid lower bound on the step time, by branch and bound over the slowest micro-batches' makespans.

Any plan with ``m`` micro-batches, sorted by makespan, has makespans ``T_1 >= T_2 >= ...`` (fixed
costs included). For the ``k`` slowest within a *box* of intervals, the LP of :mod:`planner.step_lp`
(those ``k`` explicit, the others pooled) is a relaxation of every such plan, so its least value
bounds the step from below. Explicit micro-batches see where long sequences must go: eight
sequences that fit four to a micro-batch below a level and eight above it need two micro-batches
above it, which one slowest micro-batch and a fluid pool of the others hide. A box's bound does not
fall as the box shrinks, so boxes are split, the one with the lowest bound first, until the bound is
within a tolerance or the boxes are narrow (a few LP re-solves, independent of N).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron_flexsp.planner.heuristics import min_micro_batches
from megatron_flexsp.planner.layout import Tables
from megatron_flexsp.planner.bucketing import WIDE_UNITS, bound_units
from megatron_flexsp.planner.floors import StepFloors, step_floors
from megatron_flexsp.planner.box_search import CountSearch
from megatron_flexsp.planner.step_lp import Hint, SolverOutOfTime, SolverTrouble
from megatron_flexsp.utils.logging import get_logger

__all__ = ["BoundResult", "SolverTrouble", "bound_units", "lp_step_bound", "step_bound"]

log = get_logger(__name__)

#: :func:`lp_step_bound` calls its ``refloor`` once its searches have taken this many LP solves
#: without raising the lowest bound (on 64-GPU steps where they raise it, they had within 12-21)
REFLOOR_AFTER = 24


@dataclass(frozen=True)
class BoundResult:
    """``bound_ms``: valid lower bound on the step time for plans with ``m`` micro-batches;
    ``lp_solves``: linear programs solved; ``intervals``: open boxes at the end; ``t1_range``: the
    slowest micro-batch's makespans (ms) those boxes span (a plan faster than the target has its
    slowest micro-batch there); ``hints``: the relaxed placements of the lowest counts still open,
    lowest first; ``by_count``: (count, bound) for the counts bounded one by one, ``rest_ms`` a
    bound for every other count (:meth:`more_than` combines them)."""

    m: int
    bound_ms: float
    lp_solves: int
    intervals: int
    t1_range: tuple[float, float] = (0.0, math.inf)
    hints: tuple[Hint, ...] = ()
    by_count: tuple[tuple[int, float], ...] = ()
    rest_ms: float = -math.inf

    def more_than(self, m: int) -> float:
        """A valid lower bound (ms) on plans with more than ``m`` micro-batches."""
        return min([v for c, v in self.by_count if c > m] + [self.rest_ms])


def step_bound(tab: Tables, m: int, *, target_ms: float, t1_lo: float, rel_tol: float = 0.002,
               max_solves: int = 200, units: list[tuple[np.ndarray, bool]] | None = None,
               deadline=None, explicit: int = 1, t1_hi: float = math.inf) -> BoundResult:
    """Lower bound on the step time of plans with exactly ``m`` micro-batches.

    ``target_ms``: stop once the bound reaches it (e.g. the best plan's time); ``t1_lo``: a valid
    lower bound on the slowest micro-batch (e.g. the longest sequence's fastest finish); ``units``:
    :func:`bound_units` (computed when not given); ``deadline`` (with ``expired()``) stops the
    search early with the bound reached so far (still valid); ``explicit``: how many of the
    slowest micro-batches get their own part of the LP (the rest are pooled); ``t1_hi``: a known
    upper end of the slowest micro-batch's makespan in plans faster than the target.
    """
    units = units if units is not None else bound_units(tab)
    search = CountSearch(tab, m, units, target_ms=target_ms, t1_lo=t1_lo, t1_hi=t1_hi, rel_tol=rel_tol,
                          explicit=explicit, deadline=deadline)
    while not search.done() and search.solves < max_solves and not _late(deadline):
        search.step(deadline)
    return BoundResult(m, search.bound, search.solves, len(search.heap))


def _late(deadline) -> bool:
    return deadline is not None and deadline.expired()


def _report(exc: SolverTrouble, msg: str, *args) -> None:
    """A warning for HiGHS trouble; a note for a solve stopped at the deadline (the usual end)."""
    (log.debug if isinstance(exc, SolverOutOfTime) else log.warning)(msg, exc, *args)


def lp_step_bound(tab: Tables, *, target_ms: float, max_solves: int, max_extra: int = 2,
                  rel_tol: float = 0.002, deadline=None, max_explicit: int = 3,
                  switch_after: int = 120, count_floor: dict[int, float] | None = None,
                  beyond_floor: float = 0.0, hints: int = 0, refine_above: int = 0,
                  floors: StepFloors | None = None, hint_deadline=None,
                  refloor: Callable[[], tuple[dict[int, float], float] | None] | None = None,
                  refloor_after: int = REFLOOR_AFTER, explicit: int = 1) -> BoundResult:
    """Valid lower bound on the step time of any plan of ``tab``'s batch (ms).

    One search (:class:`CountSearch`) per micro-batch count, from the memory minimum up to
    ``max_extra`` more, and one for every count past those at once (its pooled part without a
    limit on GPUs, memory or makespans: :class:`~planner.step_lp._StepLP`'s ``open_ended``),
    with the slowest micro-batch explicit; the count whose bound is lowest is refined, box by
    box, until ``max_solves`` LP solves or ``deadline``; a count's search is built only once its
    floor (:func:`~planner.floors.step_floors` or ``count_floor``) is the lowest bound left. A
    count whose search has converged, or has taken ``switch_after`` solves, is searched again with
    one more explicit micro-batch (up to ``max_explicit``; two more where at most one would stay
    pooled), within the slowest makespans still open and above the bound already proven.
    The LP places :func:`bound_units`' small set of units first (quick solves); once that pass
    has converged below the target with time left, every count is searched again with
    :data:`WIDE_UNITS` (more sequences placed one by one), within the slowest makespans where the
    first pass ended and above what it proved, from one explicit micro-batch again.
    ``target_ms`` (the best plan) caps the result.
    Past ``deadline`` the counts not reached keep their floors, so the result stays valid.
    ``count_floor``: bounds already proven for plans of a given count (e.g. the slot bound's,
    :mod:`planner.slot_bound`), ``beyond_floor``: one for every count past those searched; each
    raises what it covers.
    ``hints``: the relaxed placements of up to this many counts still open (one solve each, after
    the deadline too, within ``hint_deadline`` where given), for :mod:`planner.guided`.
    ``refine_above``: a count up to which converged searches are set aside while the counts above
    it are refined (for
    :meth:`BoundResult.more_than`: another proof, such as the step MILP's, covers those counts).
    ``floors``: :func:`~planner.floors.step_floors` of ``tab`` when the caller has them.
    ``refloor``: called at most once, when the searches have taken ``refloor_after`` LP solves
    and none has raised the lowest bound above where it started (the floors bind, as on steps of
    many micro-batches, whose slowest few explicit micro-batches say little): it returns
    floors proven another way (per count, and for every count past those; e.g. a finer slot
    bound) or None, and the searches go on above them; stalled as long again, they stop (the time
    left to ``deadline`` is the caller's). Only the first pass (the small units) has it.
    ``explicit``: the explicit micro-batches every count's search starts with (at most
    ``max_explicit``): more to search again, deeper, where an earlier call stalled.
    """
    floors = floors or step_floors(tab)
    proven = dict(count_floor or {})
    solves, found, result, start = 0, {}, None, {}
    small, wide = bound_units(tab), bound_units(tab, **WIDE_UNITS)
    same = len(small) == len(wide) and all(sa == sb and np.array_equal(a, b)
                                           for (a, sa), (b, sb) in zip(small, wide))
    for units in (small,) if same else (small, wide):
        run = _Counts(tab, units, target_ms=target_ms, max_extra=max_extra, rel_tol=rel_tol,
                      deadline=deadline, max_explicit=max_explicit, switch_after=switch_after,
                      count_floor=proven, beyond_floor=beyond_floor, hints=hints,
                      refine_above=refine_above, floors=floors, start=start, explicit=explicit)
        if refloor is not None:
            run.refloor, run.refloor_after = refloor, refloor_after
        converged = run.search(max_solves - solves)
        # the first pass only: the wide one starts above what that proved, where no floor binds, and
        # needs hundreds of solves before it rises (a stall rule there stopped it at 48)
        refloor = None
        solves += run.solves
        if run.found:
            found = run.found
        result = run.result(solves, prev=result)
        if not converged or result.bound_ms >= target_ms * (1 - rel_tol) or _late(deadline):
            break
        proven = {c: max(v, proven.get(c, 0.0)) for c, v in result.by_count}
        beyond_floor = max(beyond_floor, result.rest_ms)
        # each count starts within the slowest makespans the first pass's open boxes still span
        # (plans faster than the target are there), with one explicit micro-batch again: with the
        # wide units each explicit one costs more per solve, and it goes up to more as the first did
        start = {c: (1, *s.t1_range()) for c, s in run.found.items() if s.heap}
    placed = []
    for m in sorted((c for c in found if found[c].heap), key=lambda c: found[c].bound)[:hints]:
        found[m].lp.deadline = hint_deadline
        try:
            hint = found[m].hint()
        except SolverTrouble as exc:
            _report(exc, "%s; no placement hint for %d micro-batches", m)
            continue
        if hint is not None:
            placed.append(hint)
    return dataclasses.replace(result, hints=tuple(placed))


def deeper_bound(tab: Tables, prior: BoundResult, *, target_ms: float, max_solves: int, max_extra: int = 2,
                 rel_tol: float = 0.002, deadline=None, max_explicit: int = 3, refine_above: int = 0,
                 floors: StepFloors | None = None) -> BoundResult:
    """``prior`` (a :func:`lp_step_bound` result that stopped before ``deadline``: stalled at its
    floors, or converged) raised by searching every count again with ``max_explicit`` explicit
    micro-batches from the start, above what ``prior`` proved, until ``deadline`` or
    ``max_solves``. Where the slowest micro-batch alone stalls at the slot bound, three explicit
    ones still raise it: on the second lognormal step (mean 4K tokens) of 1,024 documents at 64
    GPUs, from 26,996 ms to 27,223 ms in 300 solves (27,308 ms converged, the plan 27,815 ms)."""
    got = lp_step_bound(tab, target_ms=target_ms, max_solves=max_solves, max_extra=max_extra, rel_tol=rel_tol,
                        deadline=deadline, max_explicit=max_explicit, count_floor=dict(prior.by_count),
                        beyond_floor=prior.rest_ms, refine_above=refine_above, floors=floors,
                        explicit=max_explicit)
    counts, rest = _merged(dict(got.by_count), got.rest_ms, prior)
    return dataclasses.replace(prior, bound_ms=max(prior.bound_ms, min(list(counts.values()) + [rest])),
                               lp_solves=prior.lp_solves + got.lp_solves, by_count=tuple(sorted(counts.items())),
                               rest_ms=rest)


def _merged(counts: dict[int, float], rest: float, prev: BoundResult) -> tuple[dict[int, float], float]:
    """Bounds per count (ms) and for the counts not named (``rest``), raised to ``prev``'s: per
    count the higher of the two, each result's rest standing for the counts it does not name. A
    count a later pass dropped when out of time before building its search keeps what the first
    pass proved (taking the first pass's rest for it, which covered only the other counts, had put
    a bound 0.7% above the converged one)."""
    before = dict(prev.by_count)
    return ({c: max(counts.get(c, rest), before.get(c, prev.rest_ms)) for c in set(counts) | set(before)},
            max(rest, prev.rest_ms))


class _Counts:
    """One pass of :func:`lp_step_bound` over the micro-batch counts with one set of ``units``;
    ``start``: per count, the explicit micro-batches and slowest makespans (lo, hi) to start from."""

    def __init__(self, tab: Tables, units, *, target_ms: float, max_extra: int, rel_tol: float, deadline,
                 max_explicit: int, switch_after: int, count_floor: dict[int, float], beyond_floor: float,
                 hints: int, refine_above: int, floors: StepFloors,
                 start: dict[int, tuple[int, float, float]], explicit: int = 1) -> None:
        self.tab, self.units, self.target, self.rel_tol, self.deadline = tab, units, target_ms, rel_tol, deadline
        self.max_explicit, self.switch_after, self.hints, self.refine_above = (max_explicit, switch_after,
                                                                               hints, refine_above)
        self.m_min = min_micro_batches(tab)
        self.max_extra, self.start, self.explicit = max_extra, start, max(1, min(explicit, max_explicit))
        simple = floors.at_least  # valid for plans with m or more micro-batches
        self.found: dict[int, CountSearch] = {}
        # counts not searched yet, at a bound already proven for them; a count's LP is built only once
        # it is the lowest (each costs a build and a solve from scratch: most of a short budget); the
        # last, ``last``, stands for every count from it on (an open-ended search)
        self.waiting: dict[int, float] = {}
        self.last = last = self.m_min + max_extra + 1
        self.beyond = math.inf  # a bound for the counts from the first one left out on
        for m in range(self.m_min, last + 1):
            if simple(m) >= target_ms:
                self.beyond = target_ms
                break
            self.waiting[m] = max(simple(m), count_floor.get(m, 0.0) if m < last else beyond_floor)
        self.spent = 0  # solves of searches replaced by ones with more explicit micro-batches
        self.settled: set[int] = set()  # counts up to ``refine_above`` whose search converged
        # :func:`lp_step_bound`'s ``refloor`` (None once called) and the solves before it may be
        self.refloor: Callable[[], tuple[dict[int, float], float] | None] | None = None
        self.refloor_after = 0

    @property
    def solves(self) -> int:
        return sum(s.solves for s in self.found.values()) + self.spent

    def _new(self, m: int, **kw) -> CountSearch:
        return CountSearch(self.tab, m, self.units, target_ms=self.target, rel_tol=self.rel_tol,
                            deadline=self.deadline, open_ended=m == self.last, **kw)

    def _lowest(self) -> tuple[int, float]:
        values = {c: s.bound for c, s in self.found.items() if c not in self.settled} | self.waiting
        m = min(values, key=lambda c: (values[c], c))
        return m, values[m]

    def search(self, max_solves: int) -> bool:
        """Refine the lowest count until ``max_solves``, the deadline, or the bound cannot rise;
        True when it stopped because no search can raise it further (converged)."""
        found, crit, last = self.found, float(self.tab.critical_ms().max()), self.last
        first_low = self._lowest()[1] if self.waiting or found else math.inf
        mark = None  # the solves when the floors were raised
        try:
            while (len(found) > len(self.settled) or self.waiting) and not _late(self.deadline):
                m, value = self._lowest()
                if value <= first_low * (1 + 1e-9):
                    if self.refloor is not None and self.solves >= self.refloor_after:
                        self._raise_floors()
                        mark, first_low = self.solves, self._lowest()[1]
                        continue
                    if mark is not None and self.solves >= mark + self.refloor_after:
                        return False  # stalled above the raised floors too: the rest is the caller's
                # past ``beyond`` the bound cannot rise, but refining still sharpens the hints
                if value >= self.target * (1 - self.rel_tol) or (value >= self.beyond and not self.hints):
                    return False
                if self.solves >= max_solves:
                    return False
                if m in self.waiting:
                    k, lo, hi = self.start.get(m, (self.explicit, crit, math.inf))  # (the LP caps k at m)
                    try:
                        found[m] = self._new(m, t1_lo=max(crit, lo), t1_hi=hi, explicit=k, floor=self.waiting[m])
                    except SolverTrouble as exc:  # this count and all larger ones keep their floors
                        _report(exc, "%s; using the simple bound (or a floor proven for it) for %d or more "
                                "micro-batches", m)
                        self.beyond = min(self.beyond, min(v for c, v in self.waiting.items() if c >= m))
                        self.waiting = {c: v for c, v in self.waiting.items() if c < m}
                        continue
                    del self.waiting[m]
                    continue
                cur = found[m]
                if cur.done() or cur.solves >= self.switch_after * cur.k:
                    if cur.k >= min(self.max_explicit, m - 1 if m == last else m):  # open-ended: one pooled
                        if cur.done() and m <= self.refine_above:
                            self.settled.add(m)
                            continue
                        if cur.done():
                            return True  # the lowest count cannot be raised further
                    else:
                        lo, hi = cur.t1_range()
                        self.spent += cur.solves
                        # two more at once where at most one micro-batch would stay pooled
                        k = cur.k + 2 if cur.k + 3 >= m else cur.k + 1
                        found[m] = self._new(m, t1_lo=max(crit, lo), t1_hi=hi,
                                             explicit=min(k, self.max_explicit, m), floor=cur.bound)
                        continue
                cur.step(self.deadline)
        except SolverTrouble as exc:  # what the searches proved stays valid
            _report(exc, "%s; keeping the bounds proven so far")
            return False
        return not _late(self.deadline)

    def _raise_floors(self) -> None:
        """Call :attr:`refloor` (once) and raise every count's floor to what it returns."""
        got, self.refloor = self.refloor(), None
        if got is None:
            return
        by_count, beyond = got
        for c in self.waiting:  # ``beyond`` covers the open-ended count, every count from it on
            self.waiting[c] = max(self.waiting[c], by_count.get(c, 0.0) if c < self.last else beyond)
        for c, s in self.found.items():
            s.floor = max(s.floor, by_count.get(c, 0.0) if c < self.last else beyond)

    def result(self, solves: int, prev: BoundResult | None = None) -> BoundResult:
        """The bounds proven (each count's at least ``prev``'s, from an earlier pass)."""
        counts = {c: s.bound for c, s in self.found.items()} | self.waiting
        rest = min(self.beyond, self.target, counts.pop(self.last, math.inf))  # with the open-ended search's
        if prev is not None:
            counts, rest = _merged(counts, rest, prev)
        return BoundResult(self.m_min + self.max_extra, min(list(counts.values()) + [rest]), solves,
                           sum(len(s.heap) for s in self.found.values()),
                           by_count=tuple(sorted(counts.items())), rest_ms=rest)
