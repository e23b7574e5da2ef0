"""The step MILP, solved with HiGHS (single thread, node limit for determinism).

Variables, for micro-batch ``j`` (at most ``m_max``) and allowed group size ``d``:

* ``M_j``: makespan of micro-batch j; objective ``min sum_j M_j`` (the step time); ``u_j``: j is used;
* groups: sizes of at least ``slot_min_size`` GPUs get explicit *slots* ``(d, s)`` (binary "slot
  used", at most ``slot_max`` per size and never more than the long sequences that fit that size,
  ordered so that the r-th longest sequence only uses slots 0..r: no interchangeable copies); the
  other sizes an integer *count* ``n_jd``;
* ``y_ijds``: long sequence i runs in micro-batch j on slot / class (d, s) (binary);
* ``tau_kjds``: tokens of length bucket k run there (continuous, fluid), with a binary ``w_kjd``
  that lets them in only if ``M_j`` covers the bucket's shortest sequence on size d.

Constraints: every long sequence once, every bucket's tokens once; GPUs per micro-batch <= N;
tokens per slot / class <= groups x d x capacity; a slot's whole time (fixed cost + sequences) <= M_j;
a long sequence's own time <= M_j; sequences longer than half (a third) of a group's memory cannot
share it with another (two others); GPU-time: ``N (M_j - f_min u_j) >= sum of d x work`` (every group
of a used micro-batch pays at least the smallest fixed cost); memory per micro-batch; ``M_j >= M_j+1``.

Validity: short sequences are priced at their bucket's cheapest rate and are fluid, aggregated
classes only see GPU-time and memory, so (unless ``restrict_to_slots``) every real plan with at most
``m_max`` micro-batches maps to a feasible point: HiGHS's dual bound is a valid lower bound. The
products ``n_jd * M_j`` of an exact per-class time constraint are deliberately absent (their
McCormick relaxation gave bounds at 30-50% of the optimum); the slots make the per-group time exact
where it matters most, the large groups.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import highspy
import numpy as np

from megatron_flexsp.planner.bucketing import Buckets
from megatron_flexsp.planner.heuristics import min_micro_batches
from megatron_flexsp.planner.layout import Group, Tables


@contextmanager
def _quiet_stdout():
    """HiGHS prints a banner to the C-level stdout when the first instance is built."""
    fd = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(fd, 1)
        os.close(fd)


@dataclass
class MilpResult:
    """Decoded MILP solution: per micro-batch group counts, long-sequence sizes, bucket tokens."""

    counts: list[dict[int, int]]          # counts[j][d] = number of groups of size d
    long_at: dict[int, tuple[int, int, int]]  # sequence -> (micro-batch, size, slot or -1)
    tokens: dict[tuple[int, int, int], float]  # (bucket, j, d) -> tokens
    makespans: list[float]
    objective_ms: float
    dual_bound_ms: float
    status: str
    nodes: int
    solve_time_s: float


class _Model:
    """Tiny sparse model builder (columns, rows) passed to HiGHS in one call."""

    def __init__(self) -> None:
        self.lb, self.ub, self.cost, self.integer = [], [], [], []
        self.rows: list[tuple[float, float, list[int], list[float]]] = []

    def col(self, lb: float, ub: float, cost: float = 0.0, integer: bool = False) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.cost.append(cost)
        self.integer.append(integer)
        return len(self.lb) - 1

    def row(self, lo: float, hi: float, idx: list[int], val: list[float]) -> None:
        if idx:
            self.rows.append((lo, hi, idx, val))

    def to_highs(self, *, threads: int, time_limit_s: float, node_limit: int, rel_gap: float,
                 seed: int) -> highspy.Highs:
        with _quiet_stdout():
            h = highspy.Highs()
        for key, value in (("output_flag", False), ("threads", threads), ("random_seed", seed),
                           ("time_limit", float(time_limit_s)), ("mip_max_nodes", int(node_limit)),
                           ("mip_rel_gap", float(rel_gap))):
            h.setOptionValue(key, value)
        lp = highspy.HighsLp()
        lp.num_col_ = len(self.lb)
        lp.num_row_ = len(self.rows)
        lp.col_cost_ = np.array(self.cost, dtype=np.float64)
        lp.col_lower_ = np.array(self.lb, dtype=np.float64)
        lp.col_upper_ = np.array(self.ub, dtype=np.float64)
        lp.row_lower_ = np.array([r[0] for r in self.rows], dtype=np.float64)
        lp.row_upper_ = np.array([r[1] for r in self.rows], dtype=np.float64)
        starts = np.cumsum([0] + [len(r[2]) for r in self.rows])
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = starts.astype(np.int32)
        lp.a_matrix_.index_ = np.concatenate([r[2] for r in self.rows]).astype(np.int32)
        lp.a_matrix_.value_ = np.concatenate([r[3] for r in self.rows]).astype(np.float64)
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                           for i in self.integer]
        h.passModel(lp)
        return h


class SolverTrouble(RuntimeError):
    """HiGHS ended an LP of the bound with a status that proves neither optimality nor infeasibility."""


class SolverOutOfTime(SolverTrouble):
    """An LP of the bound was stopped, or not started, at the caller's deadline."""


@dataclass(frozen=True)
class MilpOptions:
    """How to build and solve one MILP.

    ``slot_min_size``: sizes of at least this many GPUs get explicit group slots (0: just above a
    node), at most ``slot_max`` per size and no more than the long sequences that fit them.
    ``restrict_to_slots`` keeps long sequences of a slotted size out of its aggregated class even when
    the slots cannot cover every group (a restriction, not a relaxation: only when the dual bound is
    not needed). ``bucket_indicators``: the bucket-in-(micro-batch, size) binaries. Single-threaded;
    ``node_limit`` makes the result deterministic, ``time_limit_s`` is a safety net (a run that hits
    it may differ between machines).
    """

    time_limit_s: float
    node_limit: int
    rel_gap: float
    seed: int = 0
    slot_max: int = 8
    slot_min_size: int = 0
    bucket_indicators: bool = True
    restrict_to_slots: bool = False


def solve_step_milp(tab: Tables, longs: list[int], buckets: Buckets, *, m_max: int,
                    upper_ms: float, warm: list[list[Group]] | None, options: MilpOptions,
                    bucket_tokens: list[float] | None = None, m_min: int | None = None) -> MilpResult:
    """Build and solve the step MILP for ``longs`` (individual) and ``buckets`` (fluid).

    ``upper_ms``: a known feasible step time (big-M for ``M_j``); ``warm``: a layout with at most
    ``m_max`` micro-batches given to HiGHS as its first incumbent. ``bucket_tokens`` overrides each
    bucket's token total (to solve one micro-batch's share); ``m_min`` the micro-batches that must be
    used (default: the memory minimum of the whole batch).
    """
    built_from = time.perf_counter()  # the time limit covers building the model too
    slot_max, slot_min_size = options.slot_max, options.slot_min_size
    restrict_to_slots, bucket_indicators = options.restrict_to_slots, options.bucket_indicators
    cm = tab.cm
    n_gpus = cm.cluster.num_gpus
    sizes = tab.sizes
    cap = tab.cap
    big = float(upper_ms)
    mdl = _Model()
    M = [mdl.col(0.0, big, 1.0) for _ in range(m_max)]
    # sizes spanning nodes (at most `slot_max` such groups fit) get explicit group slots, the
    # intra-node sizes an aggregated count
    gpn = cm.cluster.gpus_per_node
    slot_min_size = slot_min_size or 2 * gpn
    totals = ([float(t) for t in bucket_tokens] if bucket_tokens is not None
              else [float(tab.lens[mem].sum()) for mem in buckets.members])
    fit_order = {d: sorted((i for i in longs if tab.lens[i] <= cap[d]), key=lambda i: (-int(tab.lens[i]), i))
                 for d in sizes}
    feasible = {d: len(fit_order[d]) for d in sizes}
    slots = {d: (min(n_gpus // d, feasible[d], slot_max) if d >= slot_min_size else 0) for d in sizes}
    if sum(n_gpus // d for d in sizes) <= 2 * slot_max:  # tiny cluster: every group explicit
        slots = {d: n_gpus // d for d in sizes}
    keys = [(d, s) for d in sizes for s in range(slots[d])]
    keys += [(d, -1) for d in sizes if slots[d] < n_gpus // d]
    n, y, tau = {}, {}, {}
    for j in range(m_max):
        for d, s in keys:
            n[j, d, s] = mdl.col(0.0, 1.0 if s >= 0 else float(n_gpus // d), integer=True)
            for r, i in enumerate(fit_order[d]):
                if s < 0 and slots[d] and (restrict_to_slots or slots[d] >= min(n_gpus // d, feasible[d])):
                    continue  # long sequences of this size only in explicit slots
                if s > r:
                    continue  # the r-th longest needs none of the later slots (symmetry)
                if tab.time[d][i] + tab.fixed[d] <= big:
                    y[i, j, d, s] = mdl.col(0.0, 1.0, integer=True)
            for k, mem in enumerate(buckets.members):
                if int(tab.lens[mem[-1]]) <= cap[d]:
                    tau[k, j, d, s] = mdl.col(0.0, totals[k])
    rate = {(k, d): float(cm.seq_time_ms([lo], d)[0]) / lo
            for k, lo in enumerate(buckets.lo) for d in sizes}
    # a bucket's tokens may run in (j, d) only if M_j covers its shortest sequence there (w binary)
    w_of: dict[tuple[int, int, int], int] = {}
    for j in range(m_max if bucket_indicators else 0):
        for d in sizes:
            for k in range(len(buckets.members)):
                cols = [tau[k, j, d, s] for dd, s in keys if dd == d and (k, j, d, s) in tau]
                if not cols:
                    continue
                w = w_of[k, j, d] = mdl.col(0.0, 1.0, integer=True)
                mdl.row(-math.inf, 0.0, cols + [w], [1.0] * len(cols) + [-totals[k]])
                lo = buckets.lo[k]
                mdl.row(-math.inf, 0.0, [w, M[j]], [tab.fixed[d] + float(cm.seq_time_ms([lo], d)[0]), -1.0])
    for i in longs:  # each long sequence exactly once
        cols = [c for key, c in y.items() if key[0] == i]
        mdl.row(1.0, 1.0, cols, [1.0] * len(cols))
    for k, mem in enumerate(buckets.members):  # each bucket's tokens exactly once
        cols = [c for key, c in tau.items() if key[0] == k]
        total = totals[k]
        mdl.row(total, total, cols, [1.0] * len(cols))
    f_min = min(tab.fixed.values())
    if m_min is None:
        m_min = min_micro_batches(tab)
    u = [mdl.col(1.0 if j < m_min else 0.0, 1.0, integer=True) for j in range(m_max)]
    kk = range(len(buckets.members))
    for j in range(m_max):
        # micro-batch j is used (u_j) when it holds any tokens; a used one costs >= f_min + work/N
        area_idx, area_val = [M[j], u[j]], [-float(n_gpus), float(n_gpus) * f_min]
        tok_idx, tok_val = [u[j]], [-float(cm.capacity_tokens * n_gpus)]
        for d, s in keys:
            ly = [i for i in longs if (i, j, d, s) in y]
            kt = [k for k in kk if (k, j, d, s) in tau]
            yc = [y[i, j, d, s] for i in ly]
            tc = [tau[k, j, d, s] for k in kt]
            work = [float(tab.time[d][i]) for i in ly] + [rate[k, d] for k in kt]
            toks = [float(tab.lens[i]) for i in ly] + [1.0] * len(kt)
            area_idx += yc + tc
            area_val += [d * w for w in work]
            tok_idx += yc + tc
            tok_val += toks
            # tokens of the slot / class <= groups * d * capacity
            mdl.row(-math.inf, 0.0, yc + tc + [n[j, d, s]], toks + [-float(cap[d])])
            if s >= 0:  # one explicit group: its whole time fits in the micro-batch
                mdl.row(-math.inf, 0.0, yc + tc + [n[j, d, s], M[j]], work + [tab.fixed[d], -1.0])
                if s > 0:
                    mdl.row(0.0, math.inf, [n[j, d, s - 1], n[j, d, s]], [1.0, -1.0])
                continue
            for share, mult in ((2, 1.0), (3, 2.0)):  # sequences that cannot share a group
                heavy = [i for i in ly if tab.lens[i] * share > cap[d]]
                if len(heavy) > 1:
                    mdl.row(-math.inf, 0.0, [y[i, j, d, s] for i in heavy] + [n[j, d, s]],
                            [1.0] * len(heavy) + [-mult])
        for i in longs:  # a long sequence's own time fits in its micro-batch, whatever its size
            ks = [(d, s) for d, s in keys if (i, j, d, s) in y]
            mdl.row(-math.inf, 0.0, [y[i, j, d, s] for d, s in ks] + [M[j]],
                    [float(tab.time[d][i]) + tab.fixed[d] for d, _ in ks] + [-1.0])
        mdl.row(-math.inf, 0.0, area_idx, area_val)
        mdl.row(-math.inf, 0.0, tok_idx, tok_val)
        mdl.row(-math.inf, float(n_gpus), [n[j, d, s] for d, s in keys], [float(d) for d, _ in keys])
        if j + 1 < m_max:
            mdl.row(0.0, math.inf, [M[j], M[j + 1]], [1.0, -1.0])

    h = mdl.to_highs(threads=1, time_limit_s=options.time_limit_s, node_limit=options.node_limit,
                     rel_gap=options.rel_gap, seed=options.seed)
    if warm is not None and len(warm) <= m_max:
        x = _warm_start(len(mdl.lb), warm, tab, M, u, n, y, tau, buckets, slots, fit_order)
        used = {key[:3] for key, c in tau.items() if x[c] > 0}
        for kjd, c in w_of.items():
            x[c] = float(kjd in used)
        sol = highspy.HighsSolution()
        sol.col_value = list(x)
        sol.value_valid = True
        h.setSolution(sol)
    t0 = time.perf_counter()
    h.setOptionValue("time_limit", max(options.time_limit_s - (t0 - built_from), 1e-3))
    h.run()
    elapsed = time.perf_counter() - t0
    info = h.getInfo()
    status = h.modelStatusToString(h.getModelStatus())
    x = np.array(h.getSolution().col_value) if info.primal_solution_status else None
    dual = float(info.mip_dual_bound)
    if status == "Infeasible":  # no plan with at most m_max micro-batches is faster than upper_ms
        dual = big
    if x is None or len(x) != len(mdl.lb):
        return MilpResult([], {}, {}, [], math.inf, dual, status, int(info.mip_node_count), elapsed)
    counts = [{d: int(round(sum(x[n[j, dd, s]] for dd, s in keys if dd == d))) for d in sizes}
              for j in range(m_max)]
    long_at = {i: (j, d, s) for (i, j, d, s), c in y.items() if x[c] > 0.5}
    tokens: dict[tuple[int, int, int], float] = {}
    for (k, j, d, s), c in tau.items():
        if x[c] > 1e-6:
            tokens[k, j, d] = tokens.get((k, j, d), 0.0) + float(x[c])
    return MilpResult(counts, long_at, tokens, [float(x[c]) for c in M],
                      float(info.objective_function_value), dual, status,
                      int(info.mip_node_count), elapsed)


def _warm_start(ncols, layout, tab, M, u, n, y, tau, buckets, slots, fit_order) -> np.ndarray:
    """Column values of a real layout (micro-batches sorted by makespan, groups of a size by load)."""
    x = np.zeros(ncols)
    order = sorted(layout, key=lambda mb: -tab.mb_ms(mb))
    bucket_of = {int(i): k for k, mem in enumerate(buckets.members) for i in mem}
    for j, mb in enumerate(order):
        x[M[j]] = tab.mb_ms(mb)
        x[u[j]] = 1.0
        for d in tab.sizes:
            rank = {i: r for r, i in enumerate(fit_order[d])}
            mine = sorted((g for g in mb if g.size == d and g.seqs),
                          key=lambda g: (min((rank[i] for i in g.seqs if i in rank), default=1 << 30),
                                         -g.load_ms))
            for pos, g in enumerate(mine):
                s = pos if pos < slots[d] else -1
                x[n[j, d, s]] += 1.0
                for i in g.seqs:
                    if (i, j, d, s) in y:
                        x[y[i, j, d, s]] = 1.0
                    elif i in bucket_of and (bucket_of[i], j, d, s) in tau:
                        x[tau[bucket_of[i], j, d, s]] += float(tab.lens[i])
    return x
