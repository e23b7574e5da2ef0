"""A valid lower bound on the step time, by branch and bound over the slowest micro-batches' makespans.

Any plan with ``m`` micro-batches, sorted by makespan, has makespans ``T_1 >= T_2 >= ...`` (fixed
costs included). The first ``k`` are explicit, the other ``m - k`` pooled with makespans summing to
``R``; the step time is ``T_1 + ... + T_k + R``. For every ``T_p`` within an interval ``[a_p, b_p]``
(a *box*) the linear program below is a relaxation of every such plan, so its least value bounds
the step from below:

* each explicit micro-batch ``p``, per group size ``d``: a continuous group count ``n_pd`` with
  the work of the sequences put there within ``n_pd (b_p - f_d)``, their tokens within
  ``n_pd d C``, sequences holding more than half a group's memory one per group, sequences whose
  work is over half of ``b_p - f_d`` one per group (two would not finish within ``b_p``), a whole
  group per placed sequence, ``sum_d d n_pd <= N`` and ``N T_p >= N f_min +`` its groups' GPU-time;
  a sequence (or bucket) may use size ``d`` there only if it fits its memory and finishes within
  ``b_p``, and an individual sequence's own time is within ``T_p``;
* the pooled micro-batches: the same per-size rows at their level (within ``b_k`` and within ``R``'s
  cap less the other pooled micro-batches' fixed costs), GPU-time within ``N (R - (m-k) f_min)``,
  tokens within ``(m-k) N C``, and each individual sequence's own time within ``R``.

Explicit micro-batches see where long sequences must go: eight sequences that fit four to a
micro-batch below a level and eight above it need two micro-batches above it, which one slowest
micro-batch and a fluid pool of the others hide. Short sequences enter as length buckets priced at
their shortest member's rate (cheaper than reality, so still a relaxation). A box's bound does not
fall as the box shrinks, so boxes are split, the one with the lowest bound first, until the bound
is within a tolerance or the boxes are narrow (a few LP re-solves, independent of N).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import highspy
import numpy as np

from megatron_flexsp.planner.bucketing import make_buckets
from megatron_flexsp.planner.heuristics import min_micro_batches
from megatron_flexsp.planner.layout import Tables
from megatron_flexsp.planner.milp import _Model
from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)

Box = tuple[tuple[float, float], ...]  # (a_p, b_p) per explicit micro-batch, ms


class SolverTrouble(RuntimeError):
    """HiGHS ended an LP of the bound with a status that proves neither optimality nor infeasibility."""


@dataclass(frozen=True)
class BoundResult:
    """``bound_ms``: valid lower bound on the step time for plans with ``m`` micro-batches;
    ``lp_solves``: linear programs solved; ``intervals``: open boxes at the end; ``t1_range``: the
    slowest micro-batch's makespans (ms) those boxes span (a plan faster than the target has its
    slowest micro-batch there)."""

    m: int
    bound_ms: float
    lp_solves: int
    intervals: int
    t1_range: tuple[float, float] = (0.0, math.inf)


class _Slow:
    """The singles of one (part, size) whose coefficients depend on the level: in the row
    counting slow ones one per group (``row``) and in the part's memory rows; ``update`` changes
    only the coefficients that differ from the last probe."""

    def __init__(self, row: int, cols: np.ndarray, work: np.ndarray, tokens: np.ndarray) -> None:
        self.row, self.cols, self.work, self.tokens = row, cols.astype(np.int64), work, tokens
        self.last = {"slow": np.zeros(len(cols)), "mem": tokens.copy(), "total": tokens.copy()}

    def update(self, h: highspy.Highs, row: int, values: np.ndarray, key: str) -> None:
        for k in np.flatnonzero(values != self.last[key]).tolist():
            h.changeCoeff(row, int(self.cols[k]), float(values[k]))
        self.last[key] = values


class _StepLP:
    """The relaxation for a fixed ``m`` with ``k`` explicit micro-batches (the slowest) and the
    other ``m - k`` pooled. ``solve`` returns the least ``T_1 + ... + T_k + R`` (inf when infeasible)."""

    def __init__(self, tab: Tables, m: int, units: list[tuple[np.ndarray, bool]], k: int = 1) -> None:
        cm = tab.cm
        self.tab, self.m = tab, m
        self.k = k = max(1, min(k, m))
        self.pooled = m - k
        n_gpus, sizes = cm.cluster.num_gpus, tab.sizes
        self.f_min = f = min(tab.fixed.values())
        mdl = _Model()
        self.T = [mdl.col(0.0, math.inf, 1.0) for _ in range(k)]
        self.R = mdl.col(self.pooled * f, math.inf, 1.0) if self.pooled else None
        copies = [1] * k + ([self.pooled] if self.pooled else [])
        parts = range(len(copies))
        self.counts = [{d: mdl.col(0.0, float(c * (n_gpus // d))) for d in sizes} for c in copies]
        # per part and size: time idx/val, mem idx/val, heavy idx/val (a lower bound on the number
        # of sequences over half a group's memory that the column places); singles' (column, work)
        per = [{d: ([], [], [], [], [], []) for d in sizes} for _ in parts]
        slow: list[dict[int, list[tuple[int, float]]]] = [{} for _ in parts]
        alone: list[dict[int, float]] = [{} for _ in parts]  # column -> its finish alone (level filter)
        # N T_p >= N f_min + sum over its groups of d (f_d - f_min + work); pooled: with R, (m-k) f_min
        area = [([c] + [self.counts[p][d] for d in sizes], [-float(n_gpus)] + [d * (tab.fixed[d] - f) for d in sizes])
                for p, c in enumerate(self.T + ([self.R] if self.pooled else []))]
        mem = [([], []) for _ in parts]
        # least work per token of anything on each size (a bucket at its shortest member's rate)
        self.rate: dict[int, float] = {}
        for members, _ in units:
            lo = int(tab.lens[members].min())
            for d in sizes:
                if int(tab.lens[members].max()) <= tab.cap[d]:
                    r = float(cm.seq_time_ms(np.array([lo]), d)[0]) / lo
                    self.rate[d] = min(self.rate.get(d, math.inf), r)
        for members, single in units:
            tokens = float(tab.lens[members].sum())
            longest = int(tab.lens[members].max())
            lo = int(tab.lens[members].min())
            own: list[list[tuple[int, float]]] = [[] for _ in parts]
            for d in sizes:
                if longest > tab.cap[d]:
                    continue
                if single:
                    t_alone = t = float(tab.time[d][members[0]])
                else:  # fluid bucket at its shortest member's rate
                    t_alone = float(cm.seq_time_ms(np.array([lo]), d)[0])
                    t = t_alone / lo * tokens
                for p in parts:
                    c = mdl.col(0.0, 1.0)
                    ti, tv, mi, mv, hi, hv = per[p][d]
                    ti.append(c), tv.append(t), mi.append(c), mv.append(tokens)
                    if lo * 2 > tab.cap[d]:  # every member needs a group of its own here
                        hi.append(c), hv.append(1.0 if single else tokens / longest)
                    if single:  # a sequence placed there needs at least one whole group
                        mdl.row(-math.inf, 0.0, [c, self.counts[p][d]], [1.0, -1.0])
                        slow[p].setdefault(d, []).append((c, t, tokens))
                    alone[p][c] = t_alone + tab.fixed[d]
                    area[p][0].append(c), area[p][1].append(d * t)
                    mem[p][0].append(c), mem[p][1].append(tokens)
                    own[p].append((c, t + tab.fixed[d]))
            if not own[0]:
                raise ValueError(f"sequence of {longest} tokens fits no group "
                                 f"(largest holds {max(tab.cap.values())})")
            mdl.row(1.0, 1.0, [c for o in own for c, _ in o], [1.0] * sum(len(o) for o in own))
            if single:  # its finish alone within its micro-batch's makespan (or within R)
                for p, whole in zip(parts, self.T + [self.R]):
                    mdl.row(-math.inf, 0.0, [c for c, _ in own[p]] + [whole], [tt for _, tt in own[p]] + [-1.0])
        # per size: work within groups x level (coefficient set per probe), tokens within memory,
        # sequences over half a group's memory one per group; and singles whose work is over half
        # of a group's time within the level one per group (coefficients 0 or 1 set per probe)
        self.time_rows: list[dict[int, int]] = [{} for _ in parts]
        self.mem_rows: list[dict[int, int]] = [{} for _ in parts]
        self.slow_rows: list[dict[int, _Slow]] = [{} for _ in parts]
        self.total_mem_rows: list[int] = []
        for p in parts:
            cnt = self.counts[p]
            for d in sizes:
                ti, tv, mi, mv, hi, hv = per[p][d]
                if not ti:
                    continue
                self.time_rows[p][d] = len(mdl.rows)
                mdl.row(-math.inf, 0.0, ti + [cnt[d]], tv + [0.0])
                self.mem_rows[p][d] = len(mdl.rows)
                mdl.row(-math.inf, 0.0, mi + [cnt[d]], mv + [-float(tab.cap[d])])
                if sum(hv) > 1.0:
                    mdl.row(-math.inf, 0.0, hi + [cnt[d]], hv + [-1.0])
                if d in slow[p]:
                    self.slow_rows[p][d] = _Slow(len(mdl.rows), *map(np.array, zip(*slow[p][d])))
                    mdl.rows.append((-math.inf, 0.0, [cnt[d]], [-1.0]))
            mdl.row(-math.inf, float(copies[p] * n_gpus), list(cnt.values()), [float(d) for d in sizes])
            self.total_mem_rows.append(len(mdl.rows))
            mdl.row(-math.inf, float(copies[p] * n_gpus * cm.capacity_tokens), *mem[p])
            mdl.row(-math.inf, -float(n_gpus) * copies[p] * f, *area[p])
        for p in range(k - 1):  # sorted by makespan
            mdl.row(0.0, math.inf, [self.T[p], self.T[p + 1]], [1.0, -1.0])
        self.h = mdl.to_highs(threads=1, time_limit_s=math.inf, node_limit=0, rel_gap=0.0, seed=0)
        self.h.setOptionValue("presolve", "off")  # re-solves start from the previous basis
        self.solves = 0
        self._cols = [np.array(list(a), dtype=np.int32) for a in alone]
        self._alone = [np.array(list(a.values())) for a in alone]

    def levels(self, box: Box, r_cap: float) -> list[float]:
        """Each part's level: the explicit ones' upper ends; the pooled ones within the last of
        them and within ``r_cap`` less the other pooled micro-batches' fixed costs."""
        out = [b for _, b in box]
        if self.pooled:
            out.append(max(min(box[-1][1], r_cap - (self.pooled - 1) * self.f_min), 0.0))
        return out

    def solve(self, box: Box, r_cap: float) -> float:
        """Least ``T_1 + ... + T_k + R`` (ms) of relaxed plans with ``T_p`` within ``box`` whose
        pooled micro-batches sum to ``R <= r_cap`` (inf when there is none)."""
        h, tab = self.h, self.tab
        r_lo = self.pooled * self.f_min
        r_hi = min(self.pooled * box[-1][1], r_cap)
        if self.pooled and r_hi < r_lo:
            return math.inf
        for p, level in enumerate(self.levels(box, r_cap)):
            for d, row in self.time_rows[p].items():
                h.changeCoeff(row, self.counts[p][d], -(level - tab.fixed[d]))
            for d, sl in self.slow_rows[p].items():
                room = level - tab.fixed[d]
                heavy = 2.0 * sl.work > room
                # a slow single's group (one per group) has under half its time left: the memory
                # that time cannot fill, at the least work per token, is lost to everything else
                lost = np.where(heavy, np.maximum(0.0, tab.cap[d] - sl.tokens
                                                  - np.maximum(room - sl.work, 0.0) / self.rate[d]), 0.0)
                sl.update(h, sl.row, heavy.astype(np.float64), "slow")
                mem = sl.tokens + lost
                sl.update(h, self.mem_rows[p][d], mem, "mem")
                sl.update(h, self.total_mem_rows[p], mem, "total")
            upper = (self._alone[p] <= level).astype(np.float64)
            h.changeColsBounds(len(self._cols[p]), self._cols[p], np.zeros(len(upper)), upper)
        for col, (a, b) in zip(self.T, box):
            h.changeColBounds(col, a, b)
        if self.pooled:
            h.changeColBounds(self.R, r_lo, r_hi)
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
                            f"(m={self.m}, box={[(round(a, 1), round(b, 1)) for a, b in box]}, "
                            f"R cap={r_cap:.1f} ms)")

    def least_step(self, box: Box, r_cap: float, rel_tol: float, deadline=None) -> float:
        """Valid lower bound on the step time of plans with makespans within ``box`` and
        ``R <= r_cap`` (``sum a_p + r_cap`` when there is none): plans with ``R <= r`` take at least
        the LP value ``g(r)``, the others at least ``sum a_p + r``; bisection on ``r`` for the
        largest ``min(g(r), sum a_p + r)``. Stopping early (``deadline``) returns what was proven."""
        base = sum(a for a, _ in box)
        if not self.pooled:
            return self.solve(box, 0.0)
        best = min(self.solve(box, r_cap), base + r_cap)
        # a cap below r0 is the only way to lower the pooled level below b_k; plans with R <= r
        # are bounded by g(r), the others by base + r <= base + r0: nothing to gain above g
        if best >= base + box[-1][1] + (self.pooled - 1) * self.f_min:
            return best
        lo, hi = self.pooled * self.f_min, r_cap
        while hi - lo > rel_tol * hi and not _late(deadline):
            mid = 0.5 * (lo + hi)
            g = self.solve(box, mid)
            best = max(best, min(g, base + mid))
            if g > base + mid:
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


def _children(box: Box, p: int) -> list[Box]:
    """``box`` split in half along dimension ``p``, each half tightened to sorted makespans
    (``T_q >= T_q+1``); empty halves are left out."""
    a, b = box[p]
    mid = 0.5 * (a + b)
    out = []
    for half in ((a, mid), (mid, b)):
        dims = list(box)
        dims[p] = half
        for q in range(1, len(dims)):  # T_q <= T_q-1
            dims[q] = (dims[q][0], min(dims[q][1], dims[q - 1][1]))
        for q in range(len(dims) - 2, -1, -1):  # T_q >= T_q+1
            dims[q] = (max(dims[q][0], dims[q + 1][0]), dims[q][1])
        if all(lo <= hi for lo, hi in dims):
            out.append(tuple(dims))
    return out


class _CountSearch:
    """Branch and bound over boxes of the ``explicit`` slowest makespans, for plans with exactly
    ``m`` micro-batches faster than ``target_ms`` whose slowest micro-batch lies in
    ``[t1_lo, t1_hi]``. ``bound`` is valid at any time; ``floor`` is a bound already proven."""

    def __init__(self, tab: Tables, m: int, units, *, target_ms: float, t1_lo: float, t1_hi: float,
                 rel_tol: float, explicit: int, floor: float = 0.0, deadline=None) -> None:
        self.lp = _StepLP(tab, m, units, k=explicit)
        self.m, self.k, self.target, self.rel_tol, self.floor = m, self.lp.k, target_ms, rel_tol, floor
        f = self.lp.f_min
        # the p-th slowest micro-batch of a plan faster than the target: p T_p + (m - p) f_min <= target
        box = tuple((t1_lo if p == 0 else f, (target_ms - (m - p - 1) * f) / (p + 1)) for p in range(self.k))
        box = ((t1_lo, min(box[0][1], t1_hi)),) + box[1:]
        self.heap: list[tuple[float, int, Box]] = []
        self.made = 0
        if box[0][1] > t1_lo:
            self._push(box, deadline)

    def _push(self, box: Box, deadline) -> None:
        val = self.lp.least_step(box, self.target - sum(a for a, _ in box), self.rel_tol, deadline)
        if val < self.target:
            heapq.heappush(self.heap, (val, self.made, box))
            self.made += 1

    @property
    def solves(self) -> int:
        return self.lp.solves

    @property
    def bound(self) -> float:
        """Valid lower bound (ms) on these plans' step time (the target when none is left)."""
        return max(self.floor, min(self.heap[0][0], self.target)) if self.heap else self.target

    def done(self) -> bool:
        """True once no box can raise the bound (converged, or the lowest box is narrow)."""
        if not self.heap or self.bound >= self.target * (1 - self.rel_tol):
            return True
        bx = self.heap[0][2]
        return all(b - a <= self.rel_tol * a for a, b in bx)

    def step(self, deadline=None) -> None:
        """Split the box with the lowest bound along its widest makespan range."""
        top = heapq.heappop(self.heap)
        bx = top[2]
        p = max(range(self.k), key=lambda q: bx[q][1] - bx[q][0])
        try:
            for child in _children(bx, p):
                self._push(child, deadline)
        except SolverTrouble:
            heapq.heappush(self.heap, top)  # its children may be missing: keep it whole
            raise

    def t1_range(self) -> tuple[float, float]:
        """Slowest makespans (ms) the open boxes span: a plan faster than the target is there."""
        if not self.heap:
            return (0.0, 0.0)
        return min(bx[0][0] for _, _, bx in self.heap), max(bx[0][1] for _, _, bx in self.heap)


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
    search = _CountSearch(tab, m, units, target_ms=target_ms, t1_lo=t1_lo, t1_hi=t1_hi, rel_tol=rel_tol,
                          explicit=explicit, deadline=deadline)
    while not search.done() and search.solves < max_solves and not _late(deadline):
        search.step(deadline)
    return BoundResult(m, search.bound, search.solves, len(search.heap))


def _late(deadline) -> bool:
    return deadline is not None and deadline.expired()


def lp_step_bound(tab: Tables, *, target_ms: float, max_solves: int, max_extra: int = 2,
                  rel_tol: float = 0.002, deadline=None, max_explicit: int = 3,
                  switch_after: int = 120) -> BoundResult:
    """Valid lower bound on the step time of any plan of ``tab``'s batch (ms).

    One search (:class:`_CountSearch`) per micro-batch count, from the memory minimum up to
    ``max_extra`` more, with the slowest micro-batch explicit; the count whose bound is lowest is
    refined, box by box, until ``max_solves`` LP solves or ``deadline``. A count whose search has
    converged, or has taken ``switch_after`` solves, is searched again with one more explicit
    micro-batch (up to ``max_explicit``), within the slowest makespans still open and above the
    bound already proven. Plans with even more micro-batches are bounded by ``m f_min + GPU-time /
    N``, which grows with m. ``target_ms`` (the best plan) caps the result. Past ``deadline`` the
    counts not reached get that simple bound, so the result stays valid.
    """
    m_min = min_micro_batches(tab)
    f_min = min(tab.fixed.values())
    area = tab.area_min_ms() / tab.cm.cluster.num_gpus
    crit = float(tab.critical_ms().max())
    units = bound_units(tab)

    def simple(m: int) -> float:
        return max(m * f_min + area, crit + (m - 1) * f_min)

    def search(m: int, **kw) -> _CountSearch:
        return _CountSearch(tab, m, units, target_ms=target_ms, rel_tol=rel_tol, deadline=deadline, **kw)

    found: dict[int, _CountSearch] = {}
    beyond = simple(m_min + max_extra + 1)
    spent = 0  # solves of searches replaced by ones with more explicit micro-batches
    for m in range(m_min, m_min + max_extra + 1):
        if simple(m) >= target_ms:
            beyond = target_ms
            break
        if _late(deadline):  # this count and all larger ones: the simple bound
            beyond = simple(m)
            break
        try:
            found[m] = search(m, t1_lo=crit, t1_hi=math.inf, explicit=1, floor=simple(m))
        except SolverTrouble as exc:  # this count and all larger ones: the simple bound
            log.warning("%s; using the simple bound for %d or more micro-batches", exc, m)
            beyond = simple(m)
            break
    try:
        while found and not _late(deadline):
            m = min(found, key=lambda c: found[c].bound)
            cur = found[m]
            if cur.bound >= min(beyond, target_ms * (1 - rel_tol)):
                break
            used = sum(s.solves for s in found.values()) + spent
            if used >= max_solves:
                break
            if cur.done() or cur.solves >= switch_after * cur.k:
                if cur.k >= min(max_explicit, m):
                    if cur.done():
                        break  # the lowest count cannot be raised further
                else:
                    lo, hi = cur.t1_range()
                    spent += cur.solves
                    found[m] = search(m, t1_lo=max(crit, lo), t1_hi=hi, explicit=cur.k + 1, floor=cur.bound)
                    continue
            cur.step(deadline)
    except SolverTrouble as exc:  # what the searches proved stays valid
        log.warning("%s; keeping the bounds proven so far", exc)
    solves = sum(s.solves for s in found.values()) + spent
    best = min([s.bound for s in found.values()] + [beyond, target_ms])
    return BoundResult(m_min + max_extra, best, solves, sum(len(s.heap) for s in found.values()))
