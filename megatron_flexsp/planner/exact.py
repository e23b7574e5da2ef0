"""The exact core of the planner: HiGHS MILPs warm-started from the fast plan, within the budget.

* **Step MILP** (:func:`step_milp`, the model of :mod:`planner.milp`): every micro-batch, group size
  and long sequence of the step, the short sequences as length buckets. Warm-started from the best
  fast plan with at most as many micro-batches, so HiGHS starts from an incumbent; whatever it finds
  within its share of the budget is realized (with and without its bucket quotas) and each
  micro-batch re-solved with explicit groups (phase B). Its dual bound is valid for plans with at
  most that many micro-batches; more are covered by ``m f_min + GPU-time / N``. Used while the plan
  has few micro-batches (the model grows with them).
* **Micro-batch MILP** (:func:`refine_micro_batches_of`): one micro-batch of the incumbent at a time,
  the one furthest above its own lower bound first, its sequences fixed, explicit groups for sizes of
  4 GPUs and up, warm-started from its current groups; a better realized micro-batch replaces it.

Both only ever replace the incumbent by a faster plan; :func:`milp_phase` records what they did.
"""

from __future__ import annotations

import math
import time

import numpy as np

from megatron_flexsp.config import PlannerConfig
from megatron_flexsp.planner.bucketing import make_buckets
from megatron_flexsp.planner.layout import Group, Tables, improve_layout, mb_items, room_for_a_pass
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.milp import MilpOptions, MilpResult, solve_step_milp
from megatron_flexsp.planner.realize import bucket_cuts, realize, select_long

#: The step MILP is tried while the incumbent has at most this many micro-batches.
STEP_MILP_MAX_MICRO_BATCHES = 4
#: Sequences placed individually in a micro-batch MILP (the rest as buckets).
MB_MILP_SINGLES = 32
#: Seconds a micro-batch MILP needs at least (none is started with less left)
MB_MILP_MIN_S = 0.05


def _buckets(tab: Tables, rest: np.ndarray, num: int):
    cm = tab.cm
    return make_buckets(tab.lens, rest, num_buckets=num, a_attn=cm.coeffs.a_attn_ms_per_token2,
                        a_lin=cm.coeffs.a_lin_ms_per_token, cuts=bucket_cuts(tab))


def step_milp(tab: Tables, cfg: PlannerConfig, incumbent: list[list[Group]], tail, info: dict,
              deadline) -> tuple[float, list[tuple[float, str, list]]]:
    """The step MILP with at most ``len(incumbent)`` micro-batches, warm-started from it, within
    ``deadline``. Returns (valid lower bound, realized candidate layouts)."""
    longs, rest = select_long(tab, fraction=cfg.long_fraction, max_long=cfg.max_long)
    buckets = _buckets(tab, rest, cfg.num_buckets)
    gpn = tab.cm.cluster.gpus_per_node
    big = sum(1 for i in longs if tab.min_size[i] * 2 >= gpn)
    m_max = len(incumbent)
    inc_ms = tab.step_ms(incumbent)
    left = deadline.left()
    phase_a = MilpOptions(max(0.7 * left, 1e-3), cfg.node_limit, cfg.rel_gap, cfg.seed,
                          slot_min_size=gpn if big >= cfg.node_slot_trigger else 2 * gpn)
    res = solve_step_milp(tab, longs, buckets, m_max=m_max, upper_ms=inc_ms * (1 + 1e-6),
                          warm=incumbent, options=phase_a)
    out = []
    refined = None
    if res.counts and res.objective_ms < inc_ms * (1 - 1e-6):  # HiGHS found more than the warm start
        refined = _phase_b(res, tab, longs, buckets, upper_ms=inc_ms * (1 + 1e-6), cfg=cfg,
                           deadline=deadline)
        for name, sol in (("milp", res), ("milp-refined", refined)):
            for use_quota in (True, False) if sol.counts else ():
                if deadline.expired():
                    break
                layout = realize(sol, tab, buckets, use_quota=use_quota, deadline=deadline)
                if layout is not None:
                    out.append((tab.step_ms(layout), name, layout))
    bound = -math.inf
    if math.isfinite(res.dual_bound_ms):
        bound = min(res.dual_bound_ms, tail(m_max))
    info.update({"milp_status": res.status, "milp_nodes": res.nodes, "milp_time_s": res.solve_time_s,
                 "refine_status": refined.status if refined else "",
                 "milp_objective_ms": res.objective_ms, "milp_dual_bound_ms": res.dual_bound_ms,
                 "m_max": m_max, "num_long": len(longs), "num_buckets": len(buckets.members),
                 "bucketing_error": buckets.error})
    return bound, out


def _phase_b(res: MilpResult, tab: Tables, longs: list[int], buckets, *, upper_ms: float,
             cfg: PlannerConfig, deadline) -> MilpResult:
    """Re-solve each micro-batch of the step MILP alone with explicit groups for every size of at
    least ``cfg.slot_min_size`` GPUs, keeping its long sequences and bucket token shares."""
    out = MilpResult([], {}, {}, [], 0.0, 0.0, "", 0, 0.0)
    statuses = []
    used = sorted({j for j, _, _ in res.long_at.values()} | {j for _, j, _ in res.tokens})
    for n_done, j in enumerate(used):
        share = deadline.left() / max(len(used) - n_done, 1)
        if share <= 0:
            return MilpResult([], {}, {}, [], math.inf, 0.0, "budget", out.nodes, out.solve_time_s)
        options = MilpOptions(share, cfg.refine_node_limit, cfg.rel_gap, cfg.seed,
                              slot_min_size=cfg.slot_min_size, restrict_to_slots=True)
        mine = [i for i in longs if res.long_at.get(i, (-1,))[0] == j]
        shares = [sum(v for (k, jj, _), v in res.tokens.items() if k == kk and jj == j)
                  for kk in range(len(buckets.members))]
        r = solve_step_milp(tab, mine, buckets, m_max=1, upper_ms=upper_ms, warm=None,
                            options=options, bucket_tokens=shares, m_min=1)
        if not r.counts:
            return MilpResult([], {}, {}, [], math.inf, 0.0, r.status, out.nodes + r.nodes,
                              out.solve_time_s + r.solve_time_s)
        jj = len(out.counts)
        out.counts.append(r.counts[0])
        out.makespans.append(r.makespans[0])
        out.long_at.update({i: (jj, d, s) for i, (_, d, s) in r.long_at.items()})
        out.tokens.update({(k, jj, d): v for (k, _, d), v in r.tokens.items()})
        out.objective_ms += r.objective_ms
        out.nodes += r.nodes
        out.solve_time_s += r.solve_time_s
        statuses.append(r.status)
    out.status = ",".join(sorted(set(statuses)))
    return out


def refine_micro_batches_of(layout: list[list[Group]], tab: Tables, packer: LevelPacker, cfg: PlannerConfig,
                            deadline, per_solve_s: float = 0.25) -> tuple[int, int, int]:
    """Improve ``layout`` in place, one micro-batch at a time (furthest above its lower bound first),
    with the micro-batch MILP until ``deadline``. Returns (MILPs solved, micro-batches improved,
    micro-batches proven: the MILP's dual bound, valid for any packing of the micro-batch's
    sequences, within ``cfg.rel_gap`` of its makespan as it ends, improved or not; micro-batches
    skipped as already within it of their own lower bound are not counted)."""
    order = sorted(range(len(layout)), key=lambda j: -tab.mb_ms(layout[j]) / max(
        packer.lower_bound(np.array([i for g in layout[j] for i in g.seqs]), 1), 1e-9))
    solved = improved = proven = 0
    for j in order:
        left = deadline.left()
        if left <= MB_MILP_MIN_S:
            break
        mb = layout[j]
        items = mb_items(mb)
        before = tab.mb_ms(mb)
        if before <= packer.lower_bound(items, 1) * (1 + cfg.rel_gap):
            continue
        order_i = items[np.argsort(-tab.lens[items], kind="stable")]
        longs = [int(i) for i in order_i[:MB_MILP_SINGLES]]
        buckets = _buckets(tab, order_i[MB_MILP_SINGLES:], 8)
        # HiGHS checks its time limit between stages: it ran 0.05-0.17 s past limits of 0.2 s on
        # micro-batches of a bimodal step, so a solve gets half the time left
        options = MilpOptions(min(per_solve_s, 0.5 * left), cfg.refine_node_limit * 10, cfg.rel_gap,
                              cfg.seed, slot_min_size=cfg.slot_min_size)
        res = solve_step_milp(tab, longs, buckets, m_max=1, upper_ms=before * (1 + 1e-6), warm=[mb],
                              options=options, m_min=1)
        solved += 1
        if res.counts and res.objective_ms < before * (1 - 1e-6):
            new = realize(res, tab, buckets, deadline=deadline)
            if new is not None and len(new) == 1 and tab.mb_ms(new[0]) < before * (1 - 1e-6):
                layout[j] = new[0]
                improved += 1
        proven += res.dual_bound_ms >= tab.mb_ms(layout[j]) * (1 - cfg.rel_gap)
    return solved, improved, proven


def milp_phase(tab: Tables, cfg: PlannerConfig, candidates: list, packer: LevelPacker, tail,
               info: dict, deadline) -> float:
    """Run the MILPs on the best candidate within ``deadline``; appends improved layouts to
    ``candidates`` and returns a valid lower bound (``-inf`` when none was proven)."""
    t0 = time.perf_counter()
    best_ms, _, best = min(candidates, key=lambda c: c[0])
    bound = -math.inf
    kind = "micro-batch"
    if len(best) <= STEP_MILP_MAX_MICRO_BATCHES and deadline.left() > 0.05:
        kind = "step"
        bound, found = step_milp(tab, cfg, best, tail, info, deadline)
        for ms, name, layout in found:
            if ms < best_ms:
                improve_layout(layout, tab, deadline=deadline)
                candidates.append((tab.step_ms(layout), name, layout))
    new_ms, name, layout = min(candidates, key=lambda c: c[0])
    solved = improved = proven = 0
    # (the copy alone took 0.14 s on 65,536 documents)
    if deadline.left() > MB_MILP_MIN_S and room_for_a_pass(deadline, tab, layout):
        copy = tab.clone_layout(layout)
        solved, improved, proven = refine_micro_batches_of(copy, tab, packer, cfg, deadline)
        if improved:
            candidates.append((tab.step_ms(copy), name + "+mb-milp", copy))
    final = min(c[0] for c in candidates)
    info.update({"milp_kind": kind, "milp_phase_s": time.perf_counter() - t0,
                 "milp_before_ms": best_ms, "milp_after_ms": final,
                 "milp_improved": final < best_ms * (1 - 1e-9), "mb_milp_solved": solved,
                 "mb_milp_improved": improved, "mb_milp_proven": proven})
    return bound

