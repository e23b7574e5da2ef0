"""The FlexSP reference code's planner, re-stated on HiGHS for a head-to-head (benchmark only).

What the reference does (``../shared/notes/flexsp-reference.md``): buckets by a DP that minimises
padding, each bucket represented by its *maximum*; a sequence blaster that splits the batch into the
fewest micro-batches memory allows by a contiguous linear partition of the sorted lengths that
balances *tokens*; then per micro-batch one MILP over interchangeable slots -- ``N/d`` slots per power
of two ``d >= 2`` (SP=1 excluded) -- with integer ``A[k,p]`` (sequences of bucket k on slot p), binary
``m[p]`` (slot used), makespan ``M``, solved with a time limit (10 s in the reference); real
sequences are then drawn at random from their bucket. Only the smallest micro-batch count is tried
here (the reference tries 4-5 counts in parallel processes).
"""

from __future__ import annotations

import math
import time

import highspy
import numpy as np

from megatron_flexsp.cost_model import CostModel
from megatron_flexsp.plan import GroupPlan, MicroBatchPlan, StepPlan
from megatron_flexsp.topology import place_groups


def padding_buckets(lens: np.ndarray, k: int) -> list[np.ndarray]:
    """Reference bucketing: contiguous buckets of sorted lengths minimising total padding to the max."""
    order = np.argsort(lens, kind="stable")
    x = lens[order].astype(np.float64)
    n = len(x)
    pre = np.r_[0.0, np.cumsum(x)]
    cost = np.full((k + 1, n + 1), np.inf)
    arg = np.zeros((k + 1, n + 1), dtype=np.int64)
    cost[0, 0] = 0.0
    for kk in range(1, k + 1):
        for b in range(1, n + 1):
            a = np.arange(0, b)
            vals = cost[kk - 1, a] + x[b - 1] * (b - a) - (pre[b] - pre[a])
            j = int(np.argmin(vals))
            cost[kk, b], arg[kk, b] = vals[j], a[j]
    kk = int(np.argmin(cost[:, n]))
    edges, b = [n], n
    for level in range(kk, 0, -1):
        b = int(arg[level, b])
        edges.append(b)
    edges = edges[::-1]
    return [order[a:b] for a, b in zip(edges[:-1], edges[1:]) if b > a]


def token_blaster(lens: np.ndarray, m: int) -> list[np.ndarray]:
    """Contiguous split of the lengths sorted descending into m parts minimising the max token sum."""
    order = np.argsort(-lens, kind="stable")
    x = lens[order]
    lo, hi = int(x.max()), int(x.sum())
    while lo < hi:  # smallest feasible max part sum (greedy check)
        mid = (lo + hi) // 2
        parts, cur = 1, 0
        for v in x:
            if cur + v > mid:
                parts, cur = parts + 1, 0
            cur += v
        lo, hi = (mid + 1, hi) if parts > m else (lo, mid)
    out, cur, start = [], 0, 0
    for i, v in enumerate(x):
        if cur + v > lo:
            out.append(order[start:i])
            start, cur = i, 0
        cur += v
    out.append(order[start:])
    return [p for p in out if len(p)]


def solve_slot_milp(lens: np.ndarray, idx: np.ndarray, cm: CostModel, *, time_limit_s: float,
                    num_buckets: int, rng: np.random.Generator):
    """Per-micro-batch slot MILP; returns (groups as (size, seqs) list, solve seconds, status)."""
    n = cm.cluster.num_gpus
    sizes = [d for d in cm.sizes if d >= 2]
    slots = [d for d in sizes for _ in range(n // d)]
    buckets = padding_buckets(lens[idx], min(num_buckets, len(idx)))
    bmax = [int(lens[idx][b].max()) for b in buckets]
    count = [len(b) for b in buckets]
    cap = cm.capacity_tokens
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("time_limit", float(time_limit_s))
    inf = highspy.kHighsInf
    big = 1e7
    Mv = h.addVariable(lb=0.0, ub=inf, obj=1.0)
    used = [h.addVariable(lb=0, ub=1, type=highspy.HighsVarType.kInteger) for _ in slots]
    A = {}
    for k, bm in enumerate(bmax):
        for p, d in enumerate(slots):
            if bm <= cap * d:  # minimum SP per bucket
                A[k, p] = h.addVariable(lb=0, ub=count[k], type=highspy.HighsVarType.kInteger)
    for k in range(len(buckets)):
        h.addConstr(sum(A[k, p] for p in range(len(slots)) if (k, p) in A) == count[k])
    for p, d in enumerate(slots):
        ks = [k for k in range(len(buckets)) if (k, p) in A]
        if not ks:
            h.addConstr(used[p] == 0)
            continue
        h.addConstr(sum(bmax[k] * A[k, p] for k in ks) <= cap * d)
        t = {k: float(cm.seq_time_ms([bmax[k]], d)[0]) for k in ks}
        h.addConstr(sum(t[k] * A[k, p] for k in ks) + cm.group_fixed_ms(d) * used[p] - Mv <= 0)
        for k in ks:
            h.addConstr(A[k, p] - count[k] * used[p] <= 0)
        h.addConstr(sum(A[k, p] for k in ks) - used[p] >= 0)
    h.addConstr(sum(d * used[p] for p, d in enumerate(slots)) == n)
    del big
    t0 = time.perf_counter()
    h.run()
    elapsed = time.perf_counter() - t0
    status = h.modelStatusToString(h.getModelStatus())
    sol = h.getSolution()
    if not h.getInfo().primal_solution_status:
        return None, elapsed, status
    x = np.array(sol.col_value)
    groups = []
    pools = {k: list(rng.permutation(idx[b])) for k, b in enumerate(buckets)}
    for p, d in enumerate(slots):
        if x[used[p].index] < 0.5:
            continue
        seqs = []
        for k in range(len(buckets)):
            if (k, p) in A:
                c = int(round(x[A[k, p].index]))
                seqs += [int(pools[k].pop()) for _ in range(c)]
        groups.append((d, seqs))
    return groups, elapsed, status


def plan_reference(lens, cm: CostModel, *, time_limit_s: float = 10.0, num_buckets: int = 16,
                   seed: int = 0) -> tuple[StepPlan | None, dict]:
    """Plan a batch as the reference does; returns (plan or None, details)."""
    lens = np.asarray(lens, dtype=np.int64)
    rng = np.random.default_rng(seed)
    m = max(1, math.ceil(int(lens.sum()) / (cm.capacity_tokens * cm.cluster.num_gpus)))
    t0 = time.perf_counter()
    mbs, statuses, solve = [], [], 0.0
    for part in token_blaster(lens, m):
        groups, elapsed, status = solve_slot_milp(lens, part, cm, time_limit_s=time_limit_s,
                                                  num_buckets=num_buckets, rng=rng)
        solve += elapsed
        statuses.append(status)
        if groups is None:
            return None, {"status": statuses, "solve_s": solve}
        ranks = place_groups([d for d, _ in groups], cm.cluster)
        mbs.append(MicroBatchPlan(tuple(
            GroupPlan(r, tuple(seqs), cm.group_time_ms(lens[seqs], d) if seqs else 0.0)
            for r, (d, seqs) in zip(ranks, groups) if seqs)))
    step = float(sum(mb.predicted_ms for mb in mbs))
    plan = StepPlan(num_gpus=cm.cluster.num_gpus, gpus_per_node=cm.cluster.gpus_per_node,
                    seq_lens=tuple(int(v) for v in lens), micro_batches=tuple(mbs),
                    strategy="reference", method="slot-milp", predicted_step_ms=step,
                    solve_time_s=time.perf_counter() - t0)
    return plan, {"status": statuses, "solve_s": solve}
