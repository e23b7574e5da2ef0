"""``plan_step``: the planner's one entry point, for every strategy.

Strategies (same harness, same cost model, same packing helpers):

* ``static``: one fixed group size for the whole run -- the smallest that holds ``max_seq_len``, as
  a Megatron-CP / DeepSpeed-Ulysses user must choose it -- with the best micro-batch count;
* ``batchada``: the best single group size for this batch;
* ``megatron-dcp``: Megatron's dynamic-context-parallel greedy;
* ``flexsp``: level packing (:mod:`level`), never worse than the best homogeneous plan, with a
  valid lower bound (:mod:`bound`, an LP relaxation searched over the slowest micro-batch's
  makespan) and its gap; ``search="milp"`` adds the step MILP (HiGHS) warm-started from it, for an
  exact optimum on small instances and its dual bound.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from megatron_flexsp.config import STRATEGIES, PlannerConfig
from megatron_flexsp.cost_model import CostModel
from megatron_flexsp.plan import GroupPlan, MicroBatchPlan, StepPlan
from megatron_flexsp.planner import heuristics as H
from megatron_flexsp.planner.bucketing import make_buckets
from megatron_flexsp.planner.bound import lp_step_bound
from megatron_flexsp.planner.layout import Tables, improve_layout, to_step_plan
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.search import Deadline, search_step
from megatron_flexsp.planner.milp import MilpOptions, MilpResult, solve_step_milp
from megatron_flexsp.planner.realize import bucket_cuts, realize, select_long
from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class LengthFix:
    """Result of the over-length policy: trained lengths, dropped indices and tokens cut."""

    lens: np.ndarray
    dropped: tuple[int, ...]
    tokens_truncated: int
    tokens_dropped: int


def apply_over_length(lens: np.ndarray, limit: int, policy: str) -> LengthFix:
    """Apply ``policy`` to sequences longer than ``limit`` tokens (what the cluster can hold)."""
    lens = np.asarray(lens, dtype=np.int64)
    over = np.flatnonzero(lens > limit)
    if len(over) == 0:
        return LengthFix(lens.copy(), (), 0, 0)
    if policy == "error":
        i = int(over[0])
        raise ValueError(f"sequence {i} has length {int(lens[i])}, above the capacity of the largest "
                         f"group ({limit} tokens); {len(over)} sequence(s) exceed it "
                         f"(set over_length to 'truncate' or 'drop')")
    out = lens.copy()
    if policy == "truncate":
        cut = int((lens[over] - limit).sum())
        out[over] = limit
        log.warning("truncated %d sequence(s) to %d tokens (%d tokens cut)", len(over), limit, cut)
        return LengthFix(out, (), cut, 0)
    dropped = int(lens[over].sum())
    out[over] = 0
    log.warning("dropped %d sequence(s) longer than %d tokens (%d tokens)", len(over), limit, dropped)
    return LengthFix(out, tuple(int(i) for i in over), 0, dropped)


def _validate_input(lens: np.ndarray) -> None:
    if lens.ndim != 1 or len(lens) == 0:
        raise ValueError(f"the global batch is empty (got {len(lens)} sequence lengths)")
    if (lens <= 0).any():
        i = int(np.flatnonzero(lens <= 0)[0])
        raise ValueError(f"sequence {i} has length {int(lens[i])}; lengths must be >= 1")


def plan_step(seq_lens, cm: CostModel, *, strategy: str = "flexsp",
              config: PlannerConfig | None = None, max_seq_len: int = 0) -> StepPlan:
    """Plan one global batch.

    ``seq_lens``: token counts of the global batch (1-D). ``cm``: cost model of the cluster and model.
    ``max_seq_len``: the run's longest allowed sequence (used by ``static`` to fix its group size;
    defaults to the batch's longest). Returns a validated-structure :class:`StepPlan`, times in ms.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    cfg = config or PlannerConfig()
    original = np.asarray(seq_lens, dtype=np.int64)
    _validate_input(original)
    fix = apply_over_length(original, cm.max_tokens, cfg.over_length)
    kept = np.flatnonzero(fix.lens > 0)
    if len(kept) == 0:
        raise ValueError(f"all {len(original)} sequences were dropped (longer than {cm.max_tokens})")
    t0 = time.perf_counter()
    tab = Tables(fix.lens[kept], cm)
    if strategy == "flexsp":
        plan = _plan_flexsp(tab, cfg)
    else:
        plan = _plan_baseline(tab, strategy, max_seq_len or int(original.max()))
    plan = dataclasses.replace(plan, solve_time_s=time.perf_counter() - t0)
    return _remap(plan, kept, fix, original)


def _plan_baseline(tab: Tables, strategy: str, max_seq_len: int) -> StepPlan:
    if strategy == "megatron-dcp":
        layout = H.megatron_dcp(tab)
        if layout is None:
            raise ValueError("megatron-dcp found no memory-feasible plan for this batch")
        return to_step_plan(layout, tab, strategy=strategy, method="dcp-greedy")
    if strategy == "static":
        d = tab.cm.min_group_size(min(max_seq_len, tab.cm.max_tokens))
        sizes = [d]
    else:
        sizes = tab.sizes
    found = H.best_homogeneous(tab, sizes)
    if found is None:
        raise ValueError(f"{strategy}: no memory-feasible homogeneous plan with group sizes {sizes}")
    layout, d = found
    return to_step_plan(layout, tab, strategy=strategy, method=f"homogeneous-d{d}")


@dataclasses.dataclass(frozen=True)
class SimpleBounds:
    """Bounds valid for any plan (ms): ``base``; and ``tail(m)`` for plans with more than m
    micro-batches. Every micro-batch costs at least the smallest fixed cost ``f_min`` plus its
    GPU-time over N (``area`` in total); every sequence at least its fastest feasible time."""

    base: float
    f_min: float
    area: float

    def tail(self, m: int) -> float:
        return (m + 1) * self.f_min + self.area


def simple_bounds(tab: Tables) -> SimpleBounds:
    f_min = min(tab.fixed.values())
    area = tab.area_min_ms() / tab.cm.cluster.num_gpus
    fastest = float(tab.critical_ms().max())
    return SimpleBounds(max(H.min_micro_batches(tab) * f_min + area, fastest), f_min, area)


def _plan_flexsp(tab: Tables, cfg: PlannerConfig) -> StepPlan:
    deadline = Deadline(cfg.time_budget_s)
    info: dict = {}
    candidates = []
    t0 = time.perf_counter()
    homo = H.best_homogeneous(tab, tab.sizes)
    if homo is not None:
        candidates.append((tab.step_ms(homo[0]), f"homogeneous-d{homo[1]}", homo[0]))
    info["homogeneous_time_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    packer = LevelPacker(tab)
    found = search_step(tab, packer, m_min=H.min_micro_batches(tab),
                        upper_ms=min((c[0] for c in candidates), default=math.inf),
                        deadline=_phase(deadline, cfg, 0.45))
    found.sort(key=lambda c: c[0])
    families: dict[str, float] = {}
    for ms, name, _ in found:
        families.setdefault(name, ms)
    info["search_ms"] = families
    local = _phase(deadline, cfg, 0.6)
    for ms, name, layout in found[:2]:
        improve_layout(layout, tab, deadline=local)
        candidates.append((tab.step_ms(layout), name, layout))
    info["search_time_s"] = time.perf_counter() - t0
    if not any(name not in ("greedy",) and not name.startswith("homogeneous") for _, name, _ in candidates):
        greedy = H.greedy(tab)
        if greedy is not None:
            candidates.append((tab.step_ms(greedy), "greedy", greedy))
    if not candidates:
        raise ValueError("no memory-feasible plan exists for this batch")
    bounds = simple_bounds(tab)
    bound = bounds.base
    if cfg.search == "milp":
        bound = max(bound, _milp_search(tab, cfg, candidates, bounds, info))
    best_ms = min(c[0] for c in candidates)
    if cfg.bound_lp_solves > 0 and bound < best_ms * (1 - cfg.rel_gap):
        t0 = time.perf_counter()
        lp = lp_step_bound(tab, target_ms=best_ms, max_solves=cfg.bound_lp_solves,
                           max_extra=cfg.max_extra_micro_batches, rel_tol=cfg.rel_gap)
        info.update(lp_bound_ms=lp.bound_ms, lp_solves=lp.lp_solves, lp_time_s=time.perf_counter() - t0)
        bound = max(bound, lp.bound_ms)
    best_ms, method, layout = min(candidates, key=lambda c: c[0])
    info["candidates_ms"] = {name: ms for ms, name, _ in sorted(candidates, key=lambda c: -c[0])}
    info["time_s"] = deadline.elapsed()
    return to_step_plan(layout, tab, strategy="flexsp", method=method, lower_bound_ms=min(bound, best_ms),
                        info=info, bucketing_error=info.get("bucketing_error", 0.0))


def _phase(deadline: Deadline, cfg: PlannerConfig, fraction: float) -> Deadline:
    """A deadline at ``fraction`` of the planning budget (never after ``deadline``)."""
    sub = Deadline(0.0)
    sub.start, sub.end = deadline.start, min(deadline.end, deadline.start + fraction * cfg.time_budget_s)
    return sub


def _milp_search(tab: Tables, cfg: PlannerConfig, candidates: list, bounds: SimpleBounds,
                 info: dict) -> float:
    """The step MILP (HiGHS) with iterative deepening over the micro-batch count, warm-started from
    the best candidate; appends its realized layouts to ``candidates``, returns its valid bound."""
    m_min = H.min_micro_batches(tab)
    longs, rest = select_long(tab, fraction=cfg.long_fraction, max_long=cfg.max_long)
    cm = tab.cm
    buckets = make_buckets(tab.lens, rest, num_buckets=cfg.num_buckets,
                           a_attn=cm.coeffs.a_attn_ms_per_token2, a_lin=cm.coeffs.a_lin_ms_per_token,
                           cuts=bucket_cuts(tab))
    # Several sequences that need half a node or more pack badly in an aggregated class: give the
    # node size explicit slots in phase A too when that happens (better plans and bounds, ~2x time).
    gpn = tab.cm.cluster.gpus_per_node
    big = sum(1 for i in longs if tab.min_size[i] * 2 >= gpn)
    phase_a = MilpOptions(cfg.time_limit_s, cfg.node_limit, cfg.rel_gap, cfg.seed,
                          slot_min_size=gpn if big >= cfg.node_slot_trigger else 2 * gpn)
    # Iterative deepening over the micro-batch count: solve with at most m_max micro-batches, and
    # allow one more only while plans with more could still beat the best plan found.
    m_max, milp_time, refine_time, refined = m_min, 0.0, 0.0, None
    while True:
        inc_ms, _, inc = min(candidates, key=lambda c: c[0])
        res = solve_step_milp(tab, longs, buckets, m_max=m_max, upper_ms=inc_ms * (1 + 1e-6),
                              warm=inc if len(inc) <= m_max else None, options=phase_a)
        milp_time += res.solve_time_s
        if res.counts:
            refined = refine_micro_batches(res, tab, longs, buckets, upper_ms=inc_ms * (1 + 1e-6),
                                           cfg=cfg)
            refine_time += refined.solve_time_s
            for name, sol in (("milp", res), ("milp-refined", refined)):
                for use_quota in (True, False) if sol.counts else ():
                    layout = realize(sol, tab, buckets, use_quota=use_quota)
                    candidates.insert(0, (tab.step_ms(layout), name, layout))
        best_ms = min(c[0] for c in candidates)
        if bounds.tail(m_max) >= best_ms or m_max >= m_min + cfg.max_extra_micro_batches:
            break
        m_max += 1
    bound = bounds.base
    if math.isfinite(res.dual_bound_ms):
        bound = max(bound, min(res.dual_bound_ms, bounds.tail(m_max)))
    info.update({"milp_status": res.status, "milp_nodes": res.nodes, "milp_time_s": milp_time,
                 "refine_time_s": refine_time, "refine_status": refined.status if refined else "",
                 "milp_objective_ms": res.objective_ms, "milp_dual_bound_ms": res.dual_bound_ms,
                 "m_max": m_max, "num_long": len(longs), "num_buckets": len(buckets.members),
                 "bucketing_error": buckets.error})
    return bound


def refine_micro_batches(res: MilpResult, tab: Tables, longs: list[int], buckets, *, upper_ms: float,
                         cfg: PlannerConfig) -> MilpResult:
    """Phase B: re-solve each micro-batch of the step MILP alone with explicit groups for every size
    of at least ``cfg.slot_min_size`` GPUs, keeping its long sequences and bucket token shares."""
    out = MilpResult([], {}, {}, [], 0.0, 0.0, "", 0, 0.0)
    options = MilpOptions(cfg.time_limit_s, cfg.refine_node_limit, cfg.rel_gap, cfg.seed,
                          slot_min_size=cfg.slot_min_size, restrict_to_slots=True)
    statuses = []
    used = sorted({j for j, _, _ in res.long_at.values()} | {j for _, j, _ in res.tokens})
    for j in used:
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


def _remap(plan: StepPlan, kept: np.ndarray, fix: LengthFix, original: np.ndarray) -> StepPlan:
    """Express a plan of the kept sub-batch in indices of the whole batch."""
    mbs = tuple(MicroBatchPlan(tuple(GroupPlan(g.ranks, tuple(int(kept[i]) for i in g.seqs),
                                               g.predicted_ms) for g in mb.groups))
                for mb in plan.micro_batches)
    return dataclasses.replace(plan, micro_batches=mbs, seq_lens=tuple(int(x) for x in fix.lens),
                               original_lens=tuple(int(x) for x in original), dropped=fix.dropped,
                               tokens_truncated=fix.tokens_truncated, tokens_dropped=fix.tokens_dropped)
