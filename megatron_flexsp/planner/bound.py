"""A valid lower bound on the step time, by branch and bound over the fullest micro-batch's makespan.

Any plan with ``m`` micro-batches has a slowest micro-batch of makespan ``T1`` (fixed costs
included) and the others sum to ``R``; the step time is ``T1 + R``. For ``T1`` in an interval
``[a, b]`` the linear program below is a relaxation of every such plan, so its least ``T1 + R``
bounds the step from below:

* micro-batch 1, per group size ``d``: a continuous group count ``n_d`` with the work of the
  sequences put there within ``n_d (b - f_d)``, their tokens within ``n_d d C``, sequences holding
  more than half a group's memory one per group, sequences whose work is over half of
  ``b - f_d`` one per group (two would not finish within ``b``), ``sum_d d n_d <= N``, and
  ``N T1 >= N f_min +`` its groups' GPU-time; a sequence (or bucket) may use size ``d`` only if it
  fits its memory and finishes within ``b`` there;
* the other micro-batches, pooled: the same per-size rows at their level (within ``b`` and within
  ``R``'s cap less the others' fixed costs), GPU-time within ``N (R - (m-1) f_min)``, tokens within
  ``(m-1) N C``, and each individual sequence's own time within ``R``.

Short sequences enter as length buckets priced at their shortest member's rate (cheaper than
reality, so still a relaxation). The bound of an interval is non-decreasing as it narrows, so
intervals are split where the bound is lowest until it is within a tolerance or the interval is
narrow (a few LP re-solves, independent of N).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import highspy
import numpy as np

from megatron_flexsp.planner.bucketing import make_buckets
from megatron_flexsp.planner.heuristics import min_micro_batches
from megatron_flexsp.planner.layout import Tables
from megatron_flexsp.planner.milp import _quiet_stdout
from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)


class SolverTrouble(RuntimeError):
    """HiGHS ended an LP of the bound with a status that proves neither optimality nor infeasibility."""


@dataclass(frozen=True)
class BoundResult:
    """``bound_ms``: valid lower bound on the step time for plans with ``m`` micro-batches;
    ``lp_solves``: linear programs solved; ``intervals``: open intervals at the end."""

    m: int
    bound_ms: float
    lp_solves: int
    intervals: int


class _StepLP:
    """The relaxation for a fixed ``m``: micro-batch 1 (the slowest, makespan ``T1``) on its own,
    the other ``m - 1`` pooled (makespans summing to ``R``). ``solve`` returns the least ``T1 + R``
    (inf when infeasible)."""

    def __init__(self, tab: Tables, m: int, units: list[tuple[np.ndarray, bool]]) -> None:
        cm = tab.cm
        self.tab, self.m = tab, m
        n_gpus, cap1 = cm.cluster.num_gpus, cm.capacity_tokens
        sizes = tab.sizes
        self.f_min = f = min(tab.fixed.values())
        lb, ub, cost, rows = [], [], [], []

        def col(lo, hi, c=0.0):
            lb.append(lo), ub.append(hi), cost.append(c)
            return len(lb) - 1

        self.R = col((m - 1) * f, math.inf, 1.0)
        self.T1 = col(0.0, math.inf, 1.0)
        # the two parts (micro-batch 1, the pooled others): a group count per size and, per column,
        # the finish time alone (ms) for the level filter, and the singles' (column, work) per size
        self.counts = ({d: col(0.0, float(n_gpus // d)) for d in sizes},
                       {d: col(0.0, float((m - 1) * (n_gpus // d))) for d in sizes})
        self.totals: tuple[dict[int, float], dict[int, float]] = ({}, {})
        slow: tuple[dict, dict] = ({}, {})
        # per part and size: time idx/val, mem idx/val, heavy idx/val (a lower bound on the number
        # of sequences over half a group's memory that the column places)
        per = tuple({d: ([], [], [], [], [], []) for d in sizes} for _ in range(2))
        area_idx, area_val, mem_idx, mem_val = [self.R], [-float(n_gpus)], [], []
        # micro-batch 1: N T1 >= N f_min + sum over its groups of d (f_d - f_min + work)
        area1_idx = [self.T1] + [self.counts[0][d] for d in sizes]
        area1_val = [float(n_gpus)] + [-d * (tab.fixed[d] - f) for d in sizes]
        for members, single in units:
            tokens = float(tab.lens[members].sum())
            longest = int(tab.lens[members].max())
            lo = int(tab.lens[members].min())
            own = []
            for d in sizes:
                if longest > tab.cap[d]:
                    continue
                if single:
                    alone = t = float(tab.time[d][members[0]])
                else:  # fluid bucket at its shortest member's rate
                    alone = float(cm.seq_time_ms(np.array([lo]), d)[0])
                    t = alone / lo * tokens
                c1, cr = col(0.0, 1.0), col(0.0, 1.0)
                for c, part, cnt, totals, sl in zip((c1, cr), per, self.counts, self.totals, slow):
                    ti, tv, mi, mv, hi, hv = part[d]
                    ti.append(c), tv.append(t), mi.append(c), mv.append(tokens)
                    if lo * 2 > tab.cap[d]:  # every member needs a group of its own here
                        hi.append(c), hv.append(1.0 if single else tokens / longest)
                    if single:  # a sequence placed there needs at least one whole group
                        rows.append((-math.inf, 0.0, [c, cnt[d]], [1.0, -1.0]))
                        sl.setdefault(d, []).append((c, t))
                    totals[c] = alone + tab.fixed[d]
                area1_idx.append(c1), area1_val.append(-d * t)
                area_idx.append(cr), area_val.append(d * t)
                mem_idx.append(cr), mem_val.append(tokens)
                own.append((c1, cr, t + tab.fixed[d]))
            if not own:
                raise ValueError(f"sequence of {longest} tokens fits no group "
                                 f"(largest holds {max(tab.cap.values())})")
            rows.append((1.0, 1.0, [c for c1, cr, _ in own for c in (c1, cr)], [1.0] * (2 * len(own))))
            if single:  # its finish alone within micro-batch 1's makespan, or within R
                rows.append((-math.inf, 0.0, [c1 for c1, _, _ in own] + [self.T1],
                             [tt for _, _, tt in own] + [-1.0]))
                rows.append((-math.inf, 0.0, [cr for _, cr, _ in own] + [self.R],
                             [tt for _, _, tt in own] + [-1.0]))
        # per size: work within groups x level (coefficient set per probe), tokens within memory,
        # sequences over half a group's memory one per group; and singles whose work is over half
        # of a group's time within the level one per group (coefficients 0 or 1 set per probe)
        self.time_rows: tuple[dict[int, int], dict[int, int]] = ({}, {})
        self.slow_rows: tuple[dict, dict] = ({}, {})
        for part, cnt, where, sl, slow_rows in zip(per, self.counts, self.time_rows, slow, self.slow_rows):
            for d in sizes:
                ti, tv, mi, mv, hi, hv = part[d]
                if not ti:
                    continue
                where[d] = len(rows)
                rows.append((-math.inf, 0.0, ti + [cnt[d]], tv + [0.0]))
                rows.append((-math.inf, 0.0, mi + [cnt[d]], mv + [-float(tab.cap[d])]))
                if sum(hv) > 1.0:
                    rows.append((-math.inf, 0.0, hi + [cnt[d]], hv + [-1.0]))
                if d in sl:
                    slow_rows[d] = (len(rows), sl[d])
                    rows.append((-math.inf, 0.0, [cnt[d]], [-1.0]))
        self._slow_coef: dict[tuple[int, int], float] = {}
        rows.append((-math.inf, float(n_gpus), list(self.counts[0].values()), [float(d) for d in sizes]))
        rows.append((-math.inf, float((m - 1) * n_gpus), list(self.counts[1].values()), [float(d) for d in sizes]))
        rows.append((-math.inf, -float(n_gpus) * (m - 1) * f, area_idx, area_val))
        rows.append((float(n_gpus) * f, math.inf, area1_idx, area1_val))
        rows.append((-math.inf, float((m - 1) * n_gpus * cap1), mem_idx, mem_val))
        with _quiet_stdout():
            h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", 1)
        h.setOptionValue("presolve", "off")  # re-solves start from the previous basis
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = len(lb), len(rows)
        lp.col_cost_ = np.array(cost, dtype=np.float64)
        lp.col_lower_ = np.array(lb, dtype=np.float64)
        lp.col_upper_ = np.array(ub, dtype=np.float64)
        lp.row_lower_ = np.array([r[0] for r in rows], dtype=np.float64)
        lp.row_upper_ = np.array([r[1] for r in rows], dtype=np.float64)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.cumsum([0] + [len(r[2]) for r in rows]).astype(np.int32)
        lp.a_matrix_.index_ = np.concatenate([r[2] for r in rows]).astype(np.int32)
        lp.a_matrix_.value_ = np.concatenate([r[3] for r in rows]).astype(np.float64)
        h.passModel(lp)
        self.h = h
        self.solves = 0
        self._cols = np.array(list(self.totals[0]) + list(self.totals[1]), dtype=np.int32)
        self._alone = np.array(list(self.totals[0].values()) + list(self.totals[1].values()))
        self._first = np.arange(len(self._cols)) < len(self.totals[0])

    def solve(self, t1_lo: float, t1: float, r_cap: float) -> float:
        """Least ``T1 + R`` (ms) of relaxed plans with ``t1_lo <= T1 <= t1`` whose other micro-batches
        sum to ``R <= r_cap`` (inf when there is none)."""
        h, tab = self.h, self.tab
        # each other micro-batch is within t1 and within r_cap less the others' fixed costs
        level_r = max(min(t1, r_cap - (self.m - 2) * self.f_min), 0.0)
        for k, level in enumerate((t1, level_r)):
            for d, row in self.time_rows[k].items():
                h.changeCoeff(row, self.counts[k][d], -(level - tab.fixed[d]))
            for d, (row, members) in self.slow_rows[k].items():
                for c, work in members:
                    coef = 1.0 if 2.0 * work > level - tab.fixed[d] else 0.0
                    if self._slow_coef.get((row, c), 0.0) != coef:
                        h.changeCoeff(row, c, coef)
                        self._slow_coef[row, c] = coef
        upper = (self._alone <= np.where(self._first, t1, level_r)).astype(np.float64)
        h.changeColsBounds(len(self._cols), self._cols, np.zeros(len(self._cols)), upper)
        r_lo = (self.m - 1) * self.f_min
        r_hi = min((self.m - 1) * t1, r_cap)
        if r_hi < r_lo or t1 < t1_lo:
            return math.inf
        h.changeColBounds(self.R, r_lo, r_hi)
        h.changeColBounds(self.T1, t1_lo, t1)
        h.run()
        self.solves += 1
        status = h.getModelStatus()
        if status == highspy.HighsModelStatus.kOptimal:
            return float(h.getInfo().objective_function_value)
        if status == highspy.HighsModelStatus.kInfeasible:
            return math.inf
        # anything else (a limit, numerical trouble, unboundedness) proves nothing: never read it
        # as "infeasible", which would raise the bound without proof
        raise SolverTrouble(f"LP bound: HiGHS returned {h.modelStatusToString(status)!r} "
                            f"(m={self.m}, T1={t1:.1f} ms, R cap={r_cap:.1f} ms)")

    def least_step(self, t1_lo: float, t1: float, r_cap: float, rel_tol: float, deadline=None) -> float:
        """Valid lower bound on the step time of plans with ``t1_lo <= T1 <= t1`` and ``R <= r_cap``
        (``t1_lo + r_cap`` when there is none): plans with ``R <= r`` take at least the LP value
        ``g(r)``, the others at least ``t1_lo + r``; bisection on ``r`` for the largest
        ``min(g(r), t1_lo + r)``. Stopping early (``deadline``) returns what was proven so far."""
        best = min(self.solve(t1_lo, t1, r_cap), t1_lo + r_cap)
        lo, hi = (self.m - 1) * self.f_min, r_cap
        while hi - lo > rel_tol * hi and not (deadline is not None and deadline.expired()):
            mid = 0.5 * (lo + hi)
            g = self.solve(t1_lo, t1, mid)
            best = max(best, min(g, t1_lo + mid))
            if g > t1_lo + mid:
                lo = mid
            else:
                hi = mid
        return best


def bound_units(tab: Tables, *, num_buckets: int = 12, max_single: int = 24) -> list[tuple[np.ndarray, bool]]:
    """What the LP places: the ``max_single`` sequences with the slowest fastest finish one by one,
    the others as length buckets (cut at every size's memory capacity)."""
    order = np.argsort(-tab.critical_ms(), kind="stable")
    singles = [int(i) for i in order[:max_single]]
    rest = np.array(sorted(set(range(len(tab.lens))) - set(singles)), dtype=np.int64)
    cm = tab.cm
    buckets = make_buckets(tab.lens, rest, num_buckets=num_buckets, a_attn=cm.coeffs.a_attn_ms_per_token2,
                           a_lin=cm.coeffs.a_lin_ms_per_token,
                           cuts=_heavy_cuts(tab))
    return [(np.array([i]), True) for i in singles] + [(mem, False) for mem in buckets.members]


def _heavy_cuts(tab: Tables) -> tuple[int, ...]:
    """Bucket boundaries: every size's memory capacity and half of it (a bucket of sequences over
    half a group's memory then counts at least ``tokens / longest`` sequences needing a group each)."""
    return tuple(sorted({int(tab.cap[d]) // k for d in tab.sizes for k in (1, 2)}))


def step_bound(tab: Tables, m: int, *, target_ms: float, t1_lo: float, rel_tol: float = 0.002,
               max_solves: int = 200, units: list[tuple[np.ndarray, bool]] | None = None,
               deadline=None) -> BoundResult:
    """Lower bound on the step time of plans with exactly ``m`` micro-batches.

    ``target_ms``: stop once the bound reaches it (e.g. the best plan's time); ``t1_lo``: a valid
    lower bound on the slowest micro-batch (e.g. the longest sequence's fastest finish); ``units``:
    :func:`bound_units` (computed when not given); ``deadline`` (with ``expired()``) stops the
    search early with the bound reached so far (still valid).
    """
    units = units if units is not None else bound_units(tab)
    lp = _StepLP(tab, m, units)
    if m == 1:
        lo, hi = t1_lo, target_ms
        if lp.solve(lo, hi, 0.0) == math.inf:
            return BoundResult(m, hi, lp.solves, 0)
        while hi - lo > rel_tol * hi and lp.solves < max_solves and not _late(deadline):
            mid = 0.5 * (lo + hi)
            if lp.solve(lo, mid, 0.0) == math.inf:
                lo = mid
            else:
                hi = mid
        return BoundResult(m, lo, lp.solves, 1)
    t1_hi = target_ms - (m - 1) * lp.f_min  # a plan with a slower micro-batch cannot beat the target
    if t1_hi <= t1_lo:
        return BoundResult(m, target_ms, 0, 0)

    def interval(a: float, b: float) -> float:  # bound on plans with T1 in [a, b]
        return lp.least_step(a, b, target_ms - a, rel_tol, deadline)

    heap = [(interval(t1_lo, t1_hi), t1_lo, t1_hi)]
    while heap:
        bound, a, b = heap[0]
        if (bound >= target_ms * (1 - rel_tol) or b - a <= rel_tol * a or lp.solves >= max_solves
                or _late(deadline)):
            break
        heapq.heappop(heap)
        mid = 0.5 * (a + b)
        for lo, hi in ((a, mid), (mid, b)):
            val = interval(lo, hi)
            if val < target_ms:
                heapq.heappush(heap, (val, lo, hi))
    final = min(heap[0][0], target_ms) if heap else target_ms
    return BoundResult(m, final, lp.solves, len(heap))


def _late(deadline) -> bool:
    return deadline is not None and deadline.expired()


def lp_step_bound(tab: Tables, *, target_ms: float, max_solves: int, max_extra: int = 2,
                  rel_tol: float = 0.002, deadline=None) -> BoundResult:
    """Valid lower bound on the step time of any plan of ``tab``'s batch (ms).

    The LP search runs for the memory-minimum micro-batch count and up to ``max_extra`` more
    (sharing ``max_solves`` LP solves); plans with even more micro-batches are bounded by
    ``m f_min + GPU-time / N``, which grows with m. ``target_ms`` (the best plan) caps the result.
    Past ``deadline`` the counts not searched yet get that simple bound, so the result stays valid.
    """
    m_min = min_micro_batches(tab)
    f_min = min(tab.fixed.values())
    area = tab.area_min_ms() / tab.cm.cluster.num_gpus
    crit = float(tab.critical_ms().max())
    units = bound_units(tab)

    def simple(m: int) -> float:
        return max(m * f_min + area, crit + (m - 1) * f_min)

    best, solves, last = target_ms, 0, m_min
    for m in range(m_min, m_min + max_extra + 1):
        last = m
        if simple(m) >= best:
            break
        if _late(deadline):  # this count and all larger ones: the simple bound
            best = min(best, simple(m))
            break
        budget = max(1, max_solves - solves - 12 * (m_min + max_extra - m))  # a little for larger m
        try:
            r = step_bound(tab, m, target_ms=best, t1_lo=crit, rel_tol=rel_tol, max_solves=budget,
                           units=units, deadline=deadline)
        except SolverTrouble as exc:  # this count and all larger ones: the simple bound
            log.warning("%s; using the simple bound for %d or more micro-batches", exc, m)
            best = min(best, simple(m))
            break
        solves += r.lp_solves
        best = min(best, max(r.bound_ms, simple(m)))
    else:
        last = m_min + max_extra + 1
        best = min(best, simple(last))
    return BoundResult(last, best, solves, 0)
