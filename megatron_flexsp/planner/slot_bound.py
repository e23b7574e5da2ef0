"""A lower bound on the step time that knows how sequences pack into groups' memory.

Every plan satisfies, per micro-batch ``j`` of makespan ``T_j`` (every GPU waits at least the
smallest fixed cost ``f_min``, a group of ``d`` GPUs is busy ``f_d`` plus its work):

    N T_j >= N f_min + sum over its groups g of d_g (f_g - f_min + work_g)

so the step is at least ``m f_min + (sum_g d_g (f_g - f_min + work_g)) / N`` with the groups using
at most ``m N`` GPUs. The linear program below minimises that over fractional placements of the
sequences on group sizes, with per size ``d`` a continuous group count ``n_d`` and

* tokens within ``n_d`` groups' memory;
* for ``k = 1..K``, ``sum of u_k(len / cap_d) <= n_d`` over the sequences placed there, where
  ``u_k`` is the dual-feasible function of Fekete and Schepers (any set of sequences that fits one
  group has ``sum u_k <= 1``). ``k = 1`` says a sequence over half a group's memory runs alone; larger
  ``k`` count how many mid-sized sequences a group can really hold, which fluid memory ignores.

Short sequences enter as length buckets cut at every ``u_k`` breakpoint, priced at their shortest
member's rate and counted at their least ``u_k`` per token, so the LP stays a relaxation of every
plan. The count ``m`` is continuous in the LP; the LP value is convex in ``m``, so the integer
counts on either side of its optimum give the bound.

The LP's placement is also a plan in outline: :func:`solve_slot_lp` rounds it to one group size per
sequence (a bucket's members, shortest first, over its sizes in proportion to the tokens the LP
put on each), which :func:`~megatron_flexsp.planner.groups_first.pack_at_sizes` turns into a layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import highspy
import numpy as np

from megatron_flexsp.planner.hot_lp import resolve
from megatron_flexsp.planner.step_lp import SolverTrouble
from megatron_flexsp.planner.layout import Tables
from megatron_flexsp.planner.milp import _Model

DFF_ORDERS = 8  # K: dual-feasible functions u_1..u_K per group size


def dff(lens: np.ndarray, cap: int, k: int) -> np.ndarray:
    """Fekete-Schepers ``u_k(len / cap)``: ``len / cap`` where ``(k + 1) len / cap`` is an integer,
    else ``floor((k + 1) len / cap) / k``; exact integer arithmetic (lengths in tokens)."""
    num = (k + 1) * np.asarray(lens, dtype=np.int64)
    return np.where(num % cap == 0, np.asarray(lens, dtype=np.float64) / cap, (num // cap) / k)


def _cuts(tab: Tables, orders: int, grid: float) -> tuple[int, ...]:
    """Bucket upper ends: every ``u_k`` breakpoint of every size, and lengths ``grid`` apart."""
    cuts = {int(round(x)) for x in np.geomspace(64, max(64, int(tab.lens.max())) * grid,
                                                num=2 + int(math.log(max(2.0, tab.lens.max() / 64))
                                                            / math.log(grid)))}
    for d in tab.sizes:
        cap = int(tab.cap[d])
        cuts.add(cap)
        for k in range(1, orders + 1):
            cuts.update(cap * j // (k + 1) for j in range(1, k + 1))
    return tuple(sorted(cuts))


@dataclass(frozen=True)
class SlotLP:
    """``bound_ms``: valid lower bound on the step time; ``m``: the micro-batch count where the
    LP is least; ``sizes``: a group size per sequence, rounded from the LP's placement at ``m``."""

    bound_ms: float
    m: int
    sizes: np.ndarray
    m_real: float = 1.0
    by_count: dict[int, float] = field(default_factory=dict)

    def at_least(self, m: int) -> float:
        """Valid lower bound (ms) on plans with ``m`` or more micro-batches: the LP at ``m`` once
        ``m`` is past its continuous optimum (the LP is convex in m), else its least value."""
        if m >= self.m_real and m in self.by_count:
            return self.by_count[m]
        return self.bound_ms


def slot_bound(tab: Tables, *, orders: int = DFF_ORDERS, grid: float = 1.1, max_single: int = 24) -> float:
    """Valid lower bound (ms) on the step time of every plan of ``tab``'s batch (see the module
    docstring). ``orders``: how many dual-feasible functions per size; ``grid``: ratio of the
    longest to the shortest length a bucket may span (besides the breakpoints); ``max_single``:
    sequences placed one by one (the slowest)."""
    return solve_slot_lp(tab, orders=orders, grid=grid, max_single=max_single).bound_ms


def solve_slot_lp(tab: Tables, *, orders: int = DFF_ORDERS, grid: float = 1.1, max_single: int = 24,
                  counts: tuple[int, ...] = (), time_limit_s: float = math.inf) -> SlotLP:
    """The LP of :func:`slot_bound`: its bound and its placement rounded to sizes (:class:`SlotLP`),
    and its value at each micro-batch count of ``counts`` (``SlotLP.by_count``). HiGHS stops at
    ``time_limit_s`` (seconds over all the solves), which raises :class:`SolverTrouble`."""
    if orders < 1:
        raise ValueError(f"orders={orders} must be >= 1")
    cm = tab.cm
    n_gpus, sizes = cm.cluster.num_gpus, tab.sizes
    f_min = min(tab.fixed.values())
    lens = tab.lens
    singles = np.argsort(-tab.critical_ms(), kind="stable")[:max_single]
    rest = np.setdiff1d(np.arange(len(lens)), singles)
    cuts = np.array(_cuts(tab, orders, grid), dtype=np.int64)
    rest = rest[np.argsort(lens[rest], kind="stable")]
    seg = np.searchsorted(cuts, lens[rest], side="left")  # members share (cuts[k-1], cuts[k]]
    # units: the singles, then the buckets as runs of ``order`` starting at ``starts``
    order = np.concatenate([singles, rest])
    runs = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]]) if len(rest) else np.zeros(0, np.int64)
    starts = np.concatenate([np.arange(len(singles)), len(singles) + runs]).astype(np.int64)
    lens_o = lens[order]
    ln = lens_o.astype(np.float64)
    tokens = np.add.reduceat(ln, starts)
    lo = np.minimum.reduceat(ln, starts)
    hi = np.maximum.reduceat(ln, starts)
    count = np.diff(np.r_[starts, len(order)])
    # per size: the work of each unit (a bucket at its shortest member's rate: never more than the
    # real work) and, per order k, its least u_k per token times its tokens (at most the real sum)
    work, coef = {}, {}
    for d in sizes:
        rate = cm.seq_time_ms(lo.astype(np.int64), d) / lo
        work[d] = np.where(count == 1, tab.time[d][order[starts]], rate * tokens)
        for k in range(1, orders + 1):
            coef[d, k] = np.minimum.reduceat(dff(lens_o, int(tab.cap[d]), k) / ln, starts) * tokens

    model = _Model()
    placed: list[tuple[int, int, int]] = []  # (unit, size, column)
    m_col = model.col(1.0, math.inf, f_min)
    n = {d: model.col(0.0, math.inf, d * (tab.fixed[d] - f_min) / n_gpus) for d in sizes}
    per = {(d, k): ([], []) for d in sizes for k in range(orders + 1)}  # k = 0: tokens
    for u in range(len(starts)):
        cols = []
        for d in sizes:
            if hi[u] > tab.cap[d]:
                continue
            c = model.col(0.0, 1.0, d * float(work[d][u]) / n_gpus)
            cols.append(c)
            placed.append((u, d, c))
            per[d, 0][0].append(c), per[d, 0][1].append(float(tokens[u]))
            for k in range(1, orders + 1):
                if coef[d, k][u] > 0:
                    per[d, k][0].append(c), per[d, k][1].append(float(coef[d, k][u]))
        if not cols:
            raise ValueError(f"sequence of {int(hi[u])} tokens fits no group "
                             f"(largest holds {max(tab.cap.values())})")
        model.row(1.0, 1.0, cols, [1.0] * len(cols))
    for d in sizes:
        idx, val = per[d, 0]
        model.row(-math.inf, 0.0, idx + [n[d]], val + [-float(tab.cap[d])])
        for k in range(1, orders + 1):
            idx, val = per[d, k]
            model.row(-math.inf, 0.0, idx + [n[d]], val + [-1.0])
    model.row(-math.inf, 0.0, [n[d] for d in sizes] + [m_col], [float(d) for d in sizes] + [-float(n_gpus)])
    h = model.to_highs(threads=1, time_limit_s=time_limit_s, node_limit=0, rel_gap=0.0, seed=0)
    m_star = _solve(h, m_col)
    if m_star is None:
        raise SolverTrouble("slot bound: HiGHS found a feasible LP infeasible")
    m_real, value = m_star
    best, at, x = math.inf, max(1, round(m_real)), np.asarray(h.getSolution().col_value)
    for m in sorted({math.floor(m_real), math.ceil(m_real)}):  # m_real >= 1: its column's lower bound
        h.changeColBounds(m_col, float(m), float(m))
        got = _solve(h, m_col)
        if got is not None and got[1] < best:
            best, at, x = got[1], m, np.asarray(h.getSolution().col_value)
    sizes = _round_sizes(tab, order, starts, [(u, d, float(x[c])) for u, d, c in placed])
    by_count = {}
    for m in counts:  # warm re-solves with the count fixed
        h.changeColBounds(m_col, float(m), float(m))
        got = _solve(h, m_col)
        by_count[m] = got[1] if got is not None else math.inf  # infeasible: no such plan
    return SlotLP(best if math.isfinite(best) else value, at, sizes, m_real, by_count)


def _round_sizes(tab: Tables, order: np.ndarray, starts: np.ndarray,
                 shares: list[tuple[int, int, float]]) -> np.ndarray:
    """One size per sequence from the LP's shares ``(unit, size, fraction)``: a single takes its
    largest share; a bucket's members, shortest first, fill its sizes, smallest first, in
    proportion to the fractions (by tokens). Never below a sequence's smallest size."""
    per_unit: dict[int, list[tuple[int, float]]] = {}
    for u, d, frac in shares:
        if frac > 1e-9:
            per_unit.setdefault(u, []).append((d, frac))
    ends = np.r_[starts[1:], len(order)]
    out = tab.min_size.copy()
    for u, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
        found = sorted(per_unit.get(u, []))
        if not found:
            continue
        members = order[a:b]
        if len(members) == 1:
            out[members[0]] = max(found, key=lambda t: (t[1], -t[0]))[0]
            continue
        members = members[np.argsort(tab.lens[members], kind="stable")]
        tokens = np.cumsum(tab.lens[members]) / float(tab.lens[members].sum())
        cum = np.cumsum([f for _, f in found])
        k = np.minimum(np.searchsorted(cum / cum[-1], tokens - 1e-9), len(found) - 1)
        out[members] = [found[j][0] for j in k.tolist()]
    return np.maximum(out, tab.min_size)


def _solve(h: highspy.Highs, m_col: int) -> tuple[float, float] | None:
    """Run; (m, objective) at an optimum, None when infeasible. A hot start that ends without
    either is run again from scratch (:func:`~planner.hot_lp.resolve`); any other status after
    that raises."""
    status, _ = resolve(h)
    if status == highspy.HighsModelStatus.kOptimal:
        return float(h.getSolution().col_value[m_col]), float(h.getInfo().objective_function_value)
    if status == highspy.HighsModelStatus.kInfeasible:
        return None
    raise SolverTrouble(f"slot bound: HiGHS returned {h.modelStatusToString(status)!r}")
