"""The linear relaxation behind the LP bound (:mod:`planner.bound`): one LP for a micro-batch count.

For plans with ``m`` micro-batches, the ``k`` slowest explicit (makespans ``T_1 >= ... >= T_k``
within a *box* of intervals) and the other ``m - k`` pooled (makespans summing to ``R``), the LP
below is a relaxation of every such plan, so its least ``T_1 + ... + T_k + R`` bounds their step:

* each explicit micro-batch ``p``, per group size ``d``: a continuous group count ``n_pd`` with
  the work of the sequences put there within ``n_pd (b_p - f_d)``, their tokens within
  ``n_pd d C``, sequences holding more than half a group's memory one per group, sequences whose
  work is over half of ``b_p - f_d`` one per group (two would not finish within ``b_p``) and those
  that cannot share a group with one of them counted by their share of a group's time, at most
  ``k`` sequences over ``1 / (k + 1)`` of ``b_p - f_d`` per group (``k = 2, 3, 4``), the memory
  such a slow sequence's group has no time left to fill counted as used, a sequence over half a
  group's memory a group of its own beside those too long to share it (:func:`pair_rows`), a whole
  group per placed sequence, ``sum_d d n_pd <= N`` and ``N T_p >= N f_min +`` its groups'
  GPU-time; and, per set of the largest sizes ``S`` (the ``j`` largest, for every ``j``), the
  *lifted* time row ``sum_{d in S} d (W_pd + n_pd (f_d - a_p)) <= N (T_p - a_p)`` (``W_pd``: the
  work placed there): every group finishes within ``T_p``, so those groups' GPU-time is within
  ``G T_p`` for their ``G <= N`` GPUs, and ``G T_p <= a_p G + N (T_p - a_p)`` as ``T_p >= a_p``
  (McCormick). The work rows above give every group the box's upper end ``b_p``; this one charges
  a makespan above ``a_p`` for it, so a wide box bounds nearly as well as a narrow one (in the
  0.26 s a 1 s budget gives the bound, on the paired benchmark's 56 batches, the gap fell by 0.15
  points on average and by over 0.05 on 20 of them; it rose on none); a sequence may
  use size ``d`` there only if it fits its memory and finishes within ``b_p`` (a bucket only
  with the token share of its members that do), and an individual sequence's own time is within
  ``T_p``;
* the pooled micro-batches: the same per-size rows but the pair rows at their level (within
  ``b_k`` and within ``R``'s cap less the other pooled micro-batches' fixed costs), GPU-time
  within ``N (R - (m-k) f_min)``, tokens within ``(m-k) N C``, and each individual sequence's
  own time within ``R``.

Short sequences enter as length buckets priced at their shortest member's rate (cheaper than
reality, so still a relaxation); a bucket whose shortest member's work is over half of
``b_p - f_d`` counts ``tokens / longest`` slow sequences per unit placed (every member is slow, and
at least that many are placed). The LP is built once per count; a probe changes only the
coefficients and bounds that depend on a level that moved, and re-solves from a basis (the last
one, or the parent box's: :meth:`_StepLP.start_from`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import highspy
import numpy as np

from megatron_flexsp.planner.count_rows import PER_GROUP_KS, CountRow, Shares, pair_rows
from megatron_flexsp.planner.hot_lp import resolve
from megatron_flexsp.planner.layout import Tables
from megatron_flexsp.planner.milp import SolverOutOfTime, SolverTrouble, _Model

Box = tuple[tuple[float, float], ...]  # (a_p, b_p) per explicit micro-batch, ms
#: A bucket gets a tangent row (:meth:`~planner.count_rows.CountRow.count`) where its longest
#: member is at least this share of the batch's longest sequence: long members differ in how many
#: groups they need, short ones fill groups fluidly (and each row costs every re-solve)
TAIL_SHARE = 1 / 8


@dataclass(frozen=True)
class Hint:
    """Where the relaxation puts the long sequences, for rounding into a plan
    (:mod:`planner.guided`): ``value_ms`` is the LP's value for plans of ``m`` micro-batches in its
    lowest box; per explicit micro-batch (slowest first) its level (the LP's makespan for it, ms:
    in a box still wide the upper end can be far above it) and the individually placed sequences
    whose largest share it holds, as (sequence index, group size)."""

    m: int
    value_ms: float
    levels: tuple[float, ...]
    singles: tuple[tuple[tuple[int, int], ...], ...]


class _StepLP:
    """The relaxation for a fixed ``m`` with ``k`` explicit micro-batches (the slowest) and the
    other ``m - k`` pooled. ``solve`` returns the least ``T_1 + ... + T_k + R`` (inf when infeasible)."""

    def __init__(self, tab: Tables, m: int, units: list[tuple[np.ndarray, bool]], k: int = 1,
                 open_ended: bool = False) -> None:
        cm = tab.cm
        self.tab, self.m, self.units = tab, m, units
        # open-ended: plans with m or more micro-batches (the pooled part's GPUs, memory and
        # makespans unbounded; its fixed costs and level those of m, the fewest)
        self.open_ended = open_ended and m > 1
        self.k = k = max(1, min(k, m - 1 if self.open_ended else m))
        self.pooled = m - k
        n_gpus, sizes = cm.cluster.num_gpus, tab.sizes
        self.f_min = f = min(tab.fixed.values())
        mdl = _Model()
        self.T = [mdl.col(0.0, math.inf, 1.0) for _ in range(k)]
        self.R = mdl.col(self.pooled * f, math.inf, 1.0) if self.pooled else None
        copies = [1] * k + ([self.pooled] if self.pooled else [])
        parts = range(len(copies))
        room = [float(c) for c in copies]  # micro-batches' worth of GPUs and memory per part
        if self.open_ended:
            room[-1] = math.inf
        self.counts = [{d: mdl.col(0.0, c * (n_gpus // d)) for d in sizes} for c in room]
        # per part and size: time idx/val, mem idx/val, heavy idx/val (a lower bound on the number
        # of sequences over half a group's memory that the column places); singles' (column, work)
        per = [{d: ([], [], [], [], [], []) for d in sizes} for _ in parts]
        slow: list[dict[int, list[tuple[int, float]]]] = [{} for _ in parts]
        alone: list[dict[int, float]] = [{} for _ in parts]  # column -> its finish alone (level filter)
        # a bucket's columns: members' finish times alone (ascending) and the token share of the
        # members finishing by each (only those finishing within the level may go there)
        shares: list[dict[int, tuple[np.ndarray, np.ndarray]]] = [{} for _ in parts]
        # N T_p >= N f_min + sum over its groups of d (f_d - f_min + work); pooled: with R, (m-k) f_min
        area = [([c] + [self.counts[p][d] for d in sizes], [-float(n_gpus)] + [d * (tab.fixed[d] - f) for d in sizes])
                for p, c in enumerate(self.T + ([self.R] if self.pooled else []))]
        mem = [([], []) for _ in parts]
        # the quadratic (attention) coefficient of a sequence's time on each size (ms per token^2)
        s0 = 1024
        quad = {d: float(cm.seq_time_ms(np.array([2 * s0]), d)[0] - 2 * cm.seq_time_ms(np.array([s0]), d)[0])
                / (2.0 * s0 * s0) for d in sizes}
        # each unit's shortest sequence alone on each size (ms, one cost-model call per size), and
        # the least work per token of anything on each size (a bucket at its shortest's rate)
        los = np.array([int(tab.lens[members].min()) for members, _ in units], dtype=np.int64)
        his = np.array([int(tab.lens[members].max()) for members, _ in units], dtype=np.int64)
        lo_time = {d: cm.seq_time_ms(los, d) for d in sizes}
        self.rate: dict[int, float] = {}
        for d in sizes:
            fits = his <= tab.cap[d]
            if fits.any():
                self.rate[d] = float((lo_time[d] / los)[fits].min())
        longest_all = int(tab.lens.max())
        self.place: list[tuple[int, int, int, int]] = []  # (unit, part, size, column) placements
        placed: list[dict[int, list[tuple[int, int]]]] = [{} for _ in parts]  # (unit, column) by size
        for u, (members, single) in enumerate(units):
            tokens = float(tab.lens[members].sum())
            longest = int(tab.lens[members].max())
            lo = int(tab.lens[members].min())
            own: list[list[tuple[int, float]]] = [[] for _ in parts]
            # a bucket's attention work above its shortest member's rate: sum s (s - lo) times the
            # quadratic coefficient of each size, wherever the members go (``mass`` columns)
            excess = 0.0 if single else float((tab.lens[members] * (tab.lens[members] - lo)).astype(np.float64).sum())
            mass: list[int] = []
            for d in sizes:
                if longest > tab.cap[d]:
                    continue
                if single:
                    t_alone = t = float(tab.time[d][members[0]])
                else:  # fluid bucket at its shortest member's rate
                    t_alone = float(lo_time[d][u])
                    t = t_alone / lo * tokens
                    fin = tab.time[d][members] + tab.fixed[d]
                    by = np.argsort(fin, kind="stable")
                    finish_shares = (fin[by], np.cumsum(tab.lens[members][by]) / tokens)
                for p in parts:
                    c = mdl.col(0.0, 1.0)
                    self.place.append((u, p, d, c))
                    placed[p].setdefault(d, []).append((u, c))
                    ti, tv, mi, mv, hi, hv = per[p][d]
                    ti.append(c), tv.append(t), mi.append(c), mv.append(tokens)
                    if lo * 2 > tab.cap[d]:  # every member needs a group of its own here
                        hi.append(c), hv.append(1.0 if single else tokens / longest)
                    if single:  # a sequence placed there needs at least one whole group
                        mdl.row(-math.inf, 0.0, [c, self.counts[p][d]], [1.0, -1.0])
                        slow[p].setdefault(d, []).append((c, t, tokens, tokens, 1.0, members))
                    else:  # members over half a group's time within the level: one per group
                        slow[p].setdefault(d, []).append((c, t_alone, tokens, longest, tokens / longest,
                                                          members))
                    alone[p][c] = t_alone + tab.fixed[d]
                    if not single:
                        shares[p][c] = finish_shares
                    area[p][0].append(c), area[p][1].append(d * t)
                    if excess > 0.0:  # at most (longest - lo) per token of the share placed there
                        # q: the share of the excess placed there (tokens^2 as a column would span
                        # 17 orders of magnitude with the quadratic coefficient: HiGHS 'Unknown')
                        q = mdl.col(0.0, math.inf)
                        mass.append(q)
                        mdl.row(-math.inf, 0.0, [q, c], [1.0, -tokens * (longest - lo) / excess])
                        ti.append(q), tv.append(quad[d] * excess)
                        area[p][0].append(q), area[p][1].append(d * quad[d] * excess)
                    mem[p][0].append(c), mem[p][1].append(tokens)
                    own[p].append((c, t + tab.fixed[d]))
            if not own[0]:
                raise ValueError(f"sequence of {longest} tokens fits no group "
                                 f"(largest holds {max(tab.cap.values())})")
            mdl.row(1.0, 1.0, [c for o in own for c, _ in o], [1.0] * sum(len(o) for o in own))
            if mass:
                mdl.row(1.0, 1.0, mass, [1.0] * len(mass))
            if single:  # its finish alone within its micro-batch's makespan (or within R)
                for p, whole in zip(parts, self.T + [self.R]):
                    mdl.row(-math.inf, 0.0, [c for c, _ in own[p]] + [whole], [tt for _, tt in own[p]] + [-1.0])
        # per size: work within groups x level (coefficient set per probe), tokens within memory,
        # sequences over half a group's memory one per group; and singles whose work is over half
        # of a group's time within the level one per group (coefficients 0 or 1 set per probe)
        self.time_rows: list[dict[int, int]] = [{} for _ in parts]
        # per explicit part: (row, [(group-count column, d / N, f_d) per size of its set])
        self.lift_rows: list[list[tuple[int, list[tuple[int, float, float]]]]] = [[] for _ in parts]
        self.mem_rows: list[dict[int, int]] = [{} for _ in parts]
        self.slow_rows: list[dict[int, CountRow]] = [{} for _ in parts]
        self.total_mem_rows: list[int] = []
        pairs: dict[int, list[np.ndarray]] = {}  # pair rows' coefficients by size
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
                # a group holds at most cap // shortest sequences (a bucket: at least tokens / longest
                # placed per unit); binds where lengths are alike (documents packed to one length)
                per_group = tab.cap[d] // int(los[[u for u, _ in placed[p][d]]].min())
                if per_group < len(tab.lens):
                    mdl.row(-math.inf, 0.0, [c for _, c in placed[p][d]] + [cnt[d]],
                            [1.0 if units[u][1] else float(tab.lens[units[u][0]].sum()) / his[u]
                             for u, _ in placed[p][d]] + [-float(per_group)])
                if p < k:  # explicit parts only: in the pooled one they raised no converged bound
                    if d not in pairs:  # every part holds the same units at a size
                        pairs[d] = pair_rows([units[u] for u, _ in placed[p][d]], tab.lens, int(tab.cap[d]))
                    cols = [c for _, c in placed[p][d]]
                    for coef in pairs[d]:
                        nz = np.flatnonzero(coef)
                        mdl.row(-math.inf, 0.0, [cols[j] for j in nz] + [cnt[d]], coef[nz].tolist() + [-1.0])
                if d in slow[p]:
                    entries = slow[p][d]
                    zs = [(j, mdl.col(0.0, math.inf)) for j, e in enumerate(entries)
                          if len(e[5]) > 1 and e[3] >= TAIL_SHARE * longest_all]
                    row = len(mdl.rows)
                    mdl.rows.append((-math.inf, 0.0, [cnt[d]] + [z for _, z in zs],
                                     [-1.0] + [1.0] * len(zs)))
                    tails = []
                    for j, z in zs:  # z >= a x + b, set per level (inactive until then)
                        works = tab.time[d][entries[j][5]]
                        by = np.argsort(works, kind="stable")
                        tails.append((j, works[by], works[by] + tab.fixed[d],
                                      tab.lens[entries[j][5][by]].astype(np.float64), len(mdl.rows)))
                        mdl.rows.append((-math.inf, math.inf, [z], [-1.0]))
                    per_group = []
                    for kk in PER_GROUP_KS:  # set per level, like the counting row
                        per_group.append((len(mdl.rows), kk))
                        mdl.rows.append((-math.inf, 0.0, [cnt[d]], [-1.0]))
                    self.slow_rows[p][d] = CountRow(row, *map(np.array, zip(*(e[:5] for e in entries))),
                                                 tails, tuple(per_group))
            if p < k:  # the lifted time rows (coefficients set per probe)
                last: list[int] = []
                for j in range(len(sizes)):
                    subset = [d for d in sizes[j:] if per[p][d][0]]
                    if not subset or subset == last:  # a size with nothing placed adds no new row
                        continue
                    last = subset
                    self.lift_rows[p].append((len(mdl.rows), [(cnt[d], d / n_gpus, float(tab.fixed[d]))
                                                              for d in subset]))
                    # divided by N: coefficients on the work rows' scale (at 1,024 GPUs, unscaled,
                    # a hot start ended 'Unknown')
                    mdl.row(-math.inf, 0.0, [c for d in subset for c in per[p][d][0]] + [cnt[d] for d in subset]
                            + [self.T[p]], [d / n_gpus * v for d in subset for v in per[p][d][1]]
                            + [0.0] * len(subset) + [-1.0])
            mdl.row(-math.inf, room[p] * n_gpus, list(cnt.values()), [float(d) for d in sizes])
            self.total_mem_rows.append(len(mdl.rows))
            mdl.row(-math.inf, room[p] * n_gpus * cm.capacity_tokens, *mem[p])
            mdl.row(-math.inf, -float(n_gpus) * copies[p] * f, *area[p])
        for p in range(k - 1):  # sorted by makespan
            mdl.row(0.0, math.inf, [self.T[p], self.T[p + 1]], [1.0, -1.0])
        self.h = mdl.to_highs(threads=1, time_limit_s=math.inf, node_limit=0, rel_gap=0.0, seed=0)
        self.h.setOptionValue("presolve", "off")  # re-solves start from the previous basis
        # a hot start needing more iterations than the LP has rows is in numerical trouble (one
        # took 1,934 iterations and 0.37 s, then ended 'Unknown'); from scratch takes 1,400-1,900
        # iterations but a tenth of that time
        self.h.setOptionValue("simplex_iteration_limit", max(500, self.h.getNumRow()))
        self.solves = 0
        #: a :class:`~planner.search.Deadline` no solve runs past (:meth:`_limit`)
        self.deadline = None
        self._level_set: list[float | None] = [None] * len(copies)
        self._low_set: list[float | None] = [None] * k
        self._cols = [np.array(list(a), dtype=np.int32) for a in alone]
        self._alone = [np.array(list(a.values())) for a in alone]
        self._shares = [Shares([(pos, *shares[p][c]) for pos, c in enumerate(a) if c in shares[p]])
                        for p, a in enumerate(alone)]

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
        r_hi = r_cap if self.open_ended else min(self.pooled * box[-1][1], r_cap)
        if self.pooled and r_hi < r_lo:
            return math.inf
        for p, level in enumerate(self.levels(box, r_cap)):
            if level == self._level_set[p]:
                continue  # every coefficient and column bound below depends on the level alone
            self._level_set[p] = level
            for d, row in self.time_rows[p].items():
                h.changeCoeff(row, self.counts[p][d], -(level - tab.fixed[d]))
            for d, sl in self.slow_rows[p].items():
                room = level - tab.fixed[d]
                heavy = 2.0 * sl.work > room
                # a slow sequence's group (one per group) has under half its time left: the memory
                # that time cannot fill, at the least work per token, is lost to everything else
                # (per bucket member at least what its longest leaves after its shortest's work)
                lost = np.where(heavy, np.maximum(0.0, tab.cap[d] - sl.span
                                                  - np.maximum(room - sl.work, 0.0) / self.rate[d]), 0.0)
                lost = lost * sl.scale
                sl.count(h, level, room, heavy)
                mem = sl.tokens + lost
                sl.update(h, self.mem_rows[p][d], mem, "mem")
                sl.update(h, self.total_mem_rows[p], mem, "total")
            upper = (self._alone[p] <= level).astype(np.float64)
            self._shares[p].within(level, upper)  # a bucket: its members finishing within the level
            h.changeColsBounds(len(self._cols[p]), self._cols[p], np.zeros(len(upper)), upper)
        for p, (col, (a, b)) in enumerate(zip(self.T, box)):
            h.changeColBounds(col, a, b)
            if a != self._low_set[p]:
                self._low_set[p] = a
                for row, terms in self.lift_rows[p]:
                    for col, share, fixed in terms:
                        h.changeCoeff(row, col, share * (fixed - a))
                    h.changeRowBounds(row, -math.inf, -a)
        if self.pooled:
            h.changeColBounds(self.R, r_lo, r_hi)
        status, runs = resolve(h, self._limit)
        self.solves += runs
        if status == highspy.HighsModelStatus.kOptimal:
            return float(h.getInfo().objective_function_value)
        if status == highspy.HighsModelStatus.kInfeasible:
            return math.inf
        raise SolverTrouble(f"LP bound: HiGHS returned {h.modelStatusToString(status)!r} "
                            f"(m={self.m}, box={[(round(a, 1), round(b, 1)) for a, b in box]}, "
                            f"R cap={r_cap:.1f} ms)")

    def _limit(self, seconds: float) -> float:
        """``seconds``, or the time to :attr:`deadline` when that is less (raises
        :class:`SolverOutOfTime` once it has passed): a hot start may take 0.08 s and each solve
        from scratch after it 0.3 s, which had ended a Pareto-tailed step's bound 0.14 s late."""
        if self.deadline is None:
            return seconds
        left = self.deadline.left()
        if left <= 0.0:
            raise SolverOutOfTime(f"LP bound: out of time (m={self.m})")
        return min(seconds, left)

    def hint(self, box: Box, r_cap: float) -> Hint | None:
        """The relaxed placement at ``box`` (one more solve; None when infeasible)."""
        value = self.solve(box, r_cap)
        if not math.isfinite(value):
            return None
        x = self.h.getSolution().col_value
        best: dict[int, tuple[float, int, int]] = {}
        for u, p, d, col in self.place:
            if self.units[u][1] and x[col] > best.get(u, (1e-9,))[0]:
                best[u] = (x[col], p, d)
        parts: list[list[tuple[int, int]]] = [[] for _ in range(self.k)]
        for u, (_, p, d) in sorted(best.items()):
            if p < self.k:
                parts[p].append((int(self.units[u][0][0]), d))
        return Hint(self.m, value, tuple(float(x[c]) for c in self.T), tuple(map(tuple, parts)))

    def basis(self) -> highspy.HighsBasis:
        """The basis of the last solve (a hot start for boxes inside the one just solved)."""
        return self.h.getBasis()

    def start_from(self, basis: highspy.HighsBasis) -> None:
        """Start the next solve from ``basis``: a child box's optimum is near its parent's, far
        from the last box solved (best-first order jumps around); a third fewer simplex iterations."""
        self.h.setBasis(basis)

    def first_probe(self, box: Box, r_cap: float) -> tuple[float, bool]:
        """One solve at the whole cap: (a valid lower bound on the step time of plans within
        ``box`` and ``R <= r_cap``, whether :meth:`refine` could not raise it)."""
        base = sum(a for a, _ in box)
        if not self.pooled:
            return self.solve(box, 0.0), True
        best = min(self.solve(box, r_cap), base + r_cap)
        # a cap below r0 is the only way to lower the pooled level below b_k; plans with R <= r
        # are bounded by g(r), the others by base + r <= base + r0: nothing to gain above g
        return best, best >= base + box[-1][1] + (self.pooled - 1) * self.f_min

    def refine(self, box: Box, r_cap: float, first: float, rel_tol: float, deadline=None) -> float:
        """Raise ``first`` (:meth:`first_probe`'s value at ``box``, ``r_cap``): plans with
        ``R <= r`` take at least the LP value ``g(r)``, the others at least ``sum a_p + r``, so
        every probe ``r`` proves ``min(g(r), sum a_p + r)``. ``g`` does not rise with ``r``: the
        best such ``r`` is where ``g(r) = sum a_p + r``, found by regula falsi (Illinois), bisection
        while ``g`` is infinite at the low end, until what is proven is within ``rel_tol`` of what
        the bracket allows. Stopping early (``deadline``) returns what was proven."""
        base = sum(a for a, _ in box)
        best = g_hi = first
        lo, hi, g_lo = self.pooled * self.f_min, r_cap, math.inf
        kept = 0  # +1 / -1: the last step kept the high / low end (Illinois: halve its weight)
        w_lo = w_hi = 1.0
        while not (deadline is not None and deadline.expired()):
            # what any probe inside the bracket could still prove: min(g(lo), base + hi)
            if min(g_lo, base + hi) - best <= rel_tol * best or hi - lo <= 1e-6 * hi:
                break
            if math.isfinite(g_lo):  # h(r) = g(r) - base - r, with h(lo) > 0 >= h(hi)
                h_lo, h_hi = (g_lo - base - lo) * w_lo, (g_hi - base - hi) * w_hi
                mid = lo + (hi - lo) * min(max(h_lo / (h_lo - h_hi), 0.02), 0.98)
            else:
                mid = 0.5 * (lo + hi)
            g = self.solve(box, mid)
            best = max(best, min(g, base + mid))
            if g > base + mid:
                lo, g_lo, w_lo = mid, g, 1.0
                w_hi = 0.5 * w_hi if kept == 1 else 1.0
                kept = 1
            else:
                hi, g_hi, w_hi = mid, g, 1.0
                w_lo = 0.5 * w_lo if kept == -1 else 1.0
                kept = -1
        return best
