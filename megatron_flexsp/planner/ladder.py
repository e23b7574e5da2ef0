"""The level-ladder MILP (HiGHS): a lower bound for any micro-batch count, and a plan to realize.

Every micro-batch of a plan has a makespan ``T`` (fixed costs included). A sequence ``i`` in it runs
on a group whose size finishes it within ``T`` and holds it in memory, so it costs at least
``g_i(T) = min {d t_i(d) : t_i(d) + f_d <= T, s_i <= d C}`` GPU-milliseconds, a step function that
falls as ``T`` grows; the micro-batch's GPUs give at most ``N (T - f_min)`` of them and hold at most
``N C`` tokens; and ``T`` is at least every member's fastest finish.

Round every makespan up to a geometric ladder ``L_0 < L_1 < ... < L_K`` (ratio ``r``): a micro-batch
with ``L_{k-1} < T <= L_k`` costs at least ``L_{k-1}`` and at least ``f_min + G / N`` with ``G`` its
members' GPU-time priced at ``g_i(L_k) <= g_i(T)``. With ``n_k`` micro-batches at level ``k`` (an
integer) and ``y_uk`` tokens of unit ``u`` there (the hardest sequences one by one, the others as
length buckets priced at their cheapest member's rate per token)::

    min  sum_k z_k
    s.t. z_k >= n_k L_{k-1};   z_k >= n_k f_min + sum_u rho_u(k) y_uk / N
         sum_u rho_u(k) y_uk <= N (L_k - f_min) n_k;   sum_u y_uk <= N C n_k
         sum_k y_uk = S_u;   y_uk <= S_u n_k (a sequence needs a micro-batch);  y_uk = 0 if crit_u > L_k

Every plan whose makespans stay below ``L_K`` maps to a feasible point of no greater cost, so
HiGHS's dual bound is a valid lower bound on the step time, with no assumption on the number of
micro-batches (plans with a makespan above ``L_K`` cannot beat the incumbent, which sets ``L_K``).
The model has (units x levels) columns, independent of the batch size; HiGHS solves it within a
time limit, warm-started from the incumbent plan, and its solution (how many micro-batches at which
level, which sequences there) is realized into a plan by :func:`realize_ladder`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import highspy
import numpy as np

from megatron_flexsp.planner.layout import Group, Tables
from megatron_flexsp.planner.milp import _Model


@dataclass
class LadderResult:
    """``bound_ms``: valid lower bound on the step time of any plan (ms); ``counts[k]``: micro-batches
    at level ``levels[k]`` in HiGHS's best solution; ``tokens[u, k]``: tokens of unit ``u`` there."""

    bound_ms: float
    objective_ms: float
    status: str
    levels: np.ndarray
    counts: np.ndarray
    tokens: dict[tuple[int, int], float]
    nodes: int
    solve_time_s: float


class LadderModel:
    """Units (index arrays into the batch; ``single`` ones are one sequence) priced on a ladder."""

    def __init__(self, tab: Tables, units: list[tuple[np.ndarray, bool]], *, top_ms: float,
                 ratio: float = 1.02) -> None:
        if ratio <= 1.0:
            raise ValueError(f"ladder ratio={ratio} must be > 1")
        self.tab, self.units = tab, units
        cm = tab.cm
        self.n_gpus, self.cap = cm.cluster.num_gpus, cm.capacity_tokens
        self.f_min = min(tab.fixed.values())
        sizes = tab.sizes
        total = np.stack([tab.time[d] + tab.fixed[d] for d in sizes])            # [sizes, n] ms
        gpu = np.stack([d * tab.time[d] for d in sizes])                          # [sizes, n] GPU-ms
        ok = np.stack([tab.lens <= tab.cap[d] for d in sizes])
        crit = tab.critical_ms()
        self.crit_u = np.array([float(crit[m].min()) for m, _ in units])
        base = max(self.f_min, float(self.crit_u.min()), 1e-6)
        k_top = max(1, math.ceil(math.log(max(top_ms, base * ratio) / base) / math.log(ratio)))
        self.levels = base * ratio ** np.arange(k_top + 1)                      # L_0 .. L_K
        self.tokens_u = np.array([float(tab.lens[m].sum()) for m, _ in units])
        # rho[u, k]: least GPU-ms per token of any member at level L_k (inf when none fits)
        self.rho = np.full((len(units), len(self.levels)), np.inf)
        for u, (members, _) in enumerate(units):
            t = total[:, members].ravel()
            r = np.where(ok[:, members], gpu[:, members] / tab.lens[members], np.inf).ravel()
            order = np.argsort(t, kind="stable")
            best = np.minimum.accumulate(r[order])
            at = np.searchsorted(t[order], self.levels, side="right") - 1
            self.rho[u] = np.where(at >= 0, best[np.maximum(at, 0)], np.inf)

    def level_of(self, makespan_ms: float) -> int:
        """Index ``k >= 1`` of the smallest ladder level at or above ``makespan_ms`` (``-1`` if none)."""
        k = int(np.searchsorted(self.levels, makespan_ms * (1 - 1e-12), side="left"))
        return max(k, 1) if k < len(self.levels) else -1

    def solve(self, *, time_limit_s: float, rel_gap: float = 0.005, integer: bool = True,
              warm: list[list[Group]] | None = None, seed: int = 0, min_micro_batches: int = 1
              ) -> LadderResult:
        """Build and solve the MILP (or its LP relaxation with ``integer=False``)."""
        L, rho, n_gpus = self.levels, self.rho, float(self.n_gpus)
        K = len(L)
        mdl = _Model()
        n = {k: mdl.col(0.0, math.inf, 0.0, integer) for k in range(1, K)}
        z = {k: mdl.col(0.0, math.inf, 1.0) for k in range(1, K)}
        y: dict[tuple[int, int], int] = {}
        for u, (members, single) in enumerate(self.units):
            for k in range(1, K):
                if self.crit_u[u] <= L[k] * (1 + 1e-12) and math.isfinite(rho[u, k]):
                    y[u, k] = mdl.col(0.0, self.tokens_u[u])
            cols = [y[u, k] for k in range(1, K) if (u, k) in y]
            if not cols:
                raise ValueError(f"unit {u} ({len(members)} sequence(s), longest "
                                 f"{int(self.tab.lens[members].max())} tokens) fits no level up to "
                                 f"{L[-1]:.0f} ms")
            mdl.row(self.tokens_u[u], self.tokens_u[u], cols, [1.0] * len(cols))
            if single:
                for k in range(1, K):
                    if (u, k) in y:
                        mdl.row(-math.inf, 0.0, [y[u, k], n[k]], [1.0, -self.tokens_u[u]])
        mdl.row(float(min_micro_batches), math.inf, list(n.values()), [1.0] * len(n))
        for k in range(1, K):
            us = [u for u in range(len(self.units)) if (u, k) in y]
            cols = [y[u, k] for u in us]
            work = [float(rho[u, k]) for u in us]
            mdl.row(-math.inf, 0.0, cols + [n[k]], work + [-n_gpus * (L[k] - self.f_min)])
            mdl.row(-math.inf, 0.0, cols + [n[k]], [1.0] * len(cols) + [-n_gpus * self.cap])
            mdl.row(0.0, math.inf, [z[k], n[k]], [1.0, -float(L[k - 1])])
            mdl.row(0.0, math.inf, [z[k], n[k]] + cols, [1.0, -self.f_min] + [-w / n_gpus for w in work])
        h = mdl.to_highs(threads=1, time_limit_s=max(time_limit_s, 1e-3), node_limit=1 << 30,
                         rel_gap=rel_gap, seed=seed)
        if warm is not None:
            x = self._warm(warm, len(mdl.lb), n, z, y)
            if x is not None:
                sol = highspy.HighsSolution()
                sol.col_value = list(x)
                sol.value_valid = True
                h.setSolution(sol)
        t0 = time.perf_counter()
        h.run()
        elapsed = time.perf_counter() - t0
        info = h.getInfo()
        status = h.modelStatusToString(h.getModelStatus())
        if integer:
            bound = float(info.mip_dual_bound)
        else:
            bound = float(info.objective_function_value) if status == "Optimal" else -math.inf
        if not math.isfinite(bound):
            bound = -math.inf
        values = np.array(h.getSolution().col_value) if info.primal_solution_status else None
        counts = np.zeros(K)
        tokens: dict[tuple[int, int], float] = {}
        objective = math.inf
        if values is not None and len(values) == len(mdl.lb):
            counts[1:] = [values[n[k]] for k in range(1, K)]
            tokens = {key: float(values[c]) for key, c in y.items() if values[c] > 1e-6}
            objective = float(info.objective_function_value)
        return LadderResult(bound, objective, status, L, counts, tokens,
                            int(getattr(info, "mip_node_count", 0)), elapsed)

    def _warm(self, layout, ncols, n, z, y) -> np.ndarray | None:
        """Column values of a real layout; None when a makespan lies above the ladder."""
        tab = self.tab
        unit_of = np.full(len(tab.lens), -1)
        for u, (members, _) in enumerate(self.units):
            unit_of[members] = u
        x = np.zeros(ncols)
        work = np.zeros(len(self.levels))
        for mb in layout:
            k = self.level_of(tab.mb_ms(mb))
            if k < 0:
                return None
            x[n[k]] += 1.0
            for g in mb:
                for i in g.seqs:
                    u = int(unit_of[i])
                    if (u, k) not in y:
                        return None
                    x[y[u, k]] += float(tab.lens[i])
                    work[k] += float(self.rho[u, k]) * float(tab.lens[i])
        for k, c in z.items():
            x[c] = max(x[n[k]] * float(self.levels[k - 1]), x[n[k]] * self.f_min + work[k] / self.n_gpus)
        return x


def ladder_parts(tab: Tables, units: list[tuple[np.ndarray, bool]], res: LadderResult
                 ) -> list[tuple[int, np.ndarray]]:
    """(micro-batch count, sequences) of every level a ladder solution uses: each unit's members go
    to its levels in proportion to its tokens there, longest members to the highest level."""
    levels = [k for k in range(len(res.counts)) if res.counts[k] > 0.5]
    if not levels:
        return []
    chosen: dict[int, list[int]] = {k: [] for k in levels}
    for u, (members, _) in enumerate(units):
        want = sorted(((k, res.tokens.get((u, k), 0.0)) for k in levels), reverse=True)
        want = [(k, v) for k, v in want if v > 0] or [(levels[-1], 1.0)]
        order = members[np.argsort(-tab.lens[members], kind="stable")]
        pos = 0
        for idx, (k, v) in enumerate(want):
            got = 0.0
            while pos < len(order) and (got < v * (1 - 1e-9) or idx == len(want) - 1):
                chosen[k].append(int(order[pos]))
                got += float(tab.lens[order[pos]])
                pos += 1
    return [(max(1, int(round(res.counts[k]))), np.array(chosen[k], dtype=np.int64))
            for k in levels if chosen[k]]
