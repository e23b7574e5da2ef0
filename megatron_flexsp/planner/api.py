"""``plan_step``: the planner's one entry point, for every strategy.

Strategies (same harness, same cost model, same packing helpers):

* ``static``: one fixed group size for the whole run -- the smallest that holds ``max_seq_len``, as
  a Megatron-CP / DeepSpeed-Ulysses user must choose it -- with the best micro-batch count;
* ``batchada``: the best single group size for this batch;
* ``megatron-dcp``: Megatron's dynamic-context-parallel greedy (as described for its dev branch);
* ``flexsp``: anytime planning within ``PlannerConfig.time_budget_s``: the best homogeneous plan
  (never worse than it), the slot LP of :mod:`slot_bound` (a bound, and its placement rounded into a
  plan), the polynomial step search of :mod:`search`, its polishing (:mod:`polish`), a valid lower
  bound (:mod:`bound`, an LP relaxation searched over the slowest micro-batches' makespans), then with
  ``search="milp"`` (the default) the HiGHS MILPs of :mod:`exact` warm-started from the fast
  plan on the time left: they improve it or prove it, and their dual bound tightens the gap; the
  chosen plan is touched up (:func:`polish.touch_up`; the runners-up first get a local search,
  :func:`polish.search_runners_up`) until 95% of the budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from typing import Callable

import numpy as np

from megatron_flexsp.config import EXTERNAL_STRATEGIES, STRATEGIES, PlannerConfig
from megatron_flexsp.cost_model import CostModel
from megatron_flexsp.plan import StepPlan
from megatron_flexsp.planner import heuristics as H
from megatron_flexsp.planner.bound import SolverTrouble, deeper_bound, lp_step_bound
from megatron_flexsp.planner.exact import STEP_MILP_MAX_MICRO_BATCHES, milp_phase
from megatron_flexsp.planner.floors import StepFloors, step_floors
from megatron_flexsp.planner.layout import Tables, room_for_a_pass, to_step_plan
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.lengths import apply_over_length, remap_kept, validate_lengths
from megatron_flexsp.planner.search import Deadline, base_range, level_grid, search_step
from megatron_flexsp.planner.groups_first import pack_at_sizes
from megatron_flexsp.planner.guided import guided_candidates
from megatron_flexsp.planner.polish import polish, search_runners_up, touch_up
from megatron_flexsp.planner.slot_bound import SlotLP, solve_slot_lp
from megatron_flexsp.planner.tail import repack_tail
from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)
#: Relaxed placements of the LP bound rounded into plans (the lowest micro-batch counts still
#: open); a rounded plan is polished when at most ``GUIDED_SLACK`` slower than the best found
GUIDED_HINTS = 2
GUIDED_SLACK = 0.05
#: the share of the budget after which (counted from its start, and ending with the search's
#: share) the best homogeneous plan tries no further micro-batch count (it usually needs a few
#: hundredths of a second; batches needing hundreds of micro-batches took a second)
HOMOGENEOUS_SHARE = 0.2
#: the share of the budget at which the fast step search ends (and the candidates built before it)
SEARCH_SHARE = 0.42
#: seconds per group and per sequence that turning the chosen layout into a plan takes after the
#: last phase, with a margin (1-1.4 us per item for plans of 4,096-65,536 documents, 3-3.5 us
#: where each micro-batch holds one document: 0.39 s for 65,536, on a 2-core Xeon whose Python
#: loop of 1e7 additions takes 0.5 s): the last phase ends that much before the deadline
ASSEMBLY_S_PER_ITEM = 5e-6
#: the slot LP solved again once the LP bound's searches stall (:func:`_finer_slot`): bucket
#: lengths at most 3% apart, 16 dual-feasible functions a size, 64 sequences placed one by one
#: (3-4x the first slot LP's time); ``FINE_SLOT`` about 2x, with most of the gain
FINER_SLOT = {"grid": 1.03, "orders": 16, "max_single": 64}
FINE_SLOT = {"grid": 1.05, "orders": 12, "max_single": 48}


_REGISTERED: dict[str, Callable[[np.ndarray, CostModel], StepPlan]] = {}


def register_strategy(name: str, fn: Callable[[np.ndarray, CostModel], StepPlan]) -> None:
    """Make ``plan_step(strategy=name)`` call ``fn(lengths, cm)``: how a layer above the planner
    (one that may import other packages) adds a strategy of :data:`EXTERNAL_STRATEGIES`."""
    if name not in EXTERNAL_STRATEGIES:
        raise ValueError(f"strategy {name!r} is not one of the external strategies "
                         f"{sorted(EXTERNAL_STRATEGIES)}")
    _REGISTERED[name] = fn


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
    deadline = Deadline(cfg.time_budget_s)  # the budget covers the whole call
    original = np.asarray(seq_lens, dtype=np.int64)
    validate_lengths(original)
    fix = apply_over_length(original, cm.max_tokens, cfg.over_length)
    kept = np.flatnonzero(fix.lens > 0)
    if len(kept) == 0:
        raise ValueError(f"all {len(original)} sequences were dropped (longer than {cm.max_tokens})")
    t0 = time.perf_counter()
    tab = Tables(fix.lens[kept], cm)
    if strategy == "flexsp":
        with _no_cyclic_gc():  # a full collection of a large host process costs 0.1-0.3 s of budget
            plan = _plan_flexsp(tab, cfg, deadline)
    elif strategy in EXTERNAL_STRATEGIES:
        if strategy not in _REGISTERED:
            raise ValueError(f"strategy {strategy!r} calls code outside the planner: import "
                             f"{EXTERNAL_STRATEGIES[strategy]} first (it registers the strategy)")
        plan = _REGISTERED[strategy](tab.lens, cm)
    else:
        plan = _plan_baseline(tab, strategy, max_seq_len or int(original.max()))
    plan = dataclasses.replace(plan, solve_time_s=time.perf_counter() - t0)
    return remap_kept(plan, kept, fix, original)


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
    micro-batches (:mod:`~planner.floors`: fixed costs, GPU-time over N, the slowest
    micro-batches' slowest sequences). ``f_min``: the smallest fixed cost; ``area``: the least
    GPU-time over N."""

    base: float
    floors: StepFloors

    @property
    def f_min(self) -> float:
        return self.floors.f_min

    @property
    def area(self) -> float:
        return self.floors.area

    def tail(self, m: int) -> float:
        return self.floors.at_least(m + 1)


def simple_bounds(tab: Tables) -> SimpleBounds:
    floors = step_floors(tab)
    return SimpleBounds(floors.at_least(H.min_micro_batches(tab)), floors)


def _plan_flexsp(tab: Tables, cfg: PlannerConfig, deadline: Deadline) -> StepPlan:
    """Anytime FlexSP planning within ``cfg.time_budget_s`` (``deadline``, started with the call):
    the slot LP (a bound, and its placement rounded into a plan), the best homogeneous plan faster
    than that one (no further count tried after 20% of the budget), the fast search (to 42% of the
    budget), polishing (to 55%), the LP bound (to 81%; what its stalled searches leave re-packs
    the best plan's fastest micro-batches, :func:`~planner.tail.repack_tail`, then searches the
    bound again, deeper, :func:`~planner.bound.deeper_bound`), plans rounded from its relaxation
    (to 84%), then
    the MILPs (``search="milp"``) on what is left, ending at 87% of the budget, and the chosen plan
    touched up (the local search and exchanges) to 95%, or earlier where assembling the plan
    (:data:`ASSEMBLY_S_PER_ITEM`) needs more than the rest. Past a budget of 1 s the 0.07 s,
    0.02 s and 0.01 s those phase ends moved for the bound (:func:`_phase_ends`) stay seconds, so
    the shares tend to 62/79/83%. The slot LP's rounding and, where some homogeneous layout's
    lower bound is below it, the best homogeneous plan are built whatever the time (the plan is
    never slower than either); Megatron-DCP's greedy gives up at the search's end and the search
    builds nothing past it, and no phase after it starts a pass over the whole plan without the
    time one takes (:func:`~planner.layout.room_for_a_pass`), so on batches of tens of thousands
    of documents the budget holds wherever those two fit in it. Where the plan is the
    homogeneous one and its search was cut short, it goes on with the time the phases leave."""
    info: dict = {}
    candidates = []
    # the slot LP's placement, rounded to one size per sequence and packed, first: it is built
    # whatever the time (on batches of 65,536 documents it is the plan; cut short, the homogeneous
    # one was 31-46% slower), and the homogeneous search then looks only for layouts faster than
    # it. The candidates take milliseconds, but 0.1-0.6 s each on 65,536 documents
    slot = slot_lp(tab, cfg, info)
    rounded = []
    if slot is not None:
        layout = pack_at_sizes(tab, slot.sizes)
        rounded.append((tab.step_ms(layout), "lp-rounded", layout))
    t0 = deadline.elapsed()
    own = _phase(deadline, cfg, SEARCH_SHARE).capped(
        time.perf_counter() + HOMOGENEOUS_SHARE * cfg.time_budget_s)
    tried: dict[tuple[int, int], float] = {}  # (size, count) -> step ms: what a resumed search skips
    homo = H.best_homogeneous(tab, tab.sizes, deadline=own, tried=tried,
                              faster_than=min((c[0] for c in rounded), default=math.inf))
    if homo is not None:
        homo_ms = tab.step_ms(homo[0])
        candidates.append((homo_ms, f"homogeneous-d{homo[1]}", homo[0]))
    info["homogeneous_time_s"] = deadline.elapsed() - t0
    homo_cut = homo is not None and own.expired()  # (its search may have been cut short)
    # Megatron-DCP's greedy only within the search's share
    ends = _phase_ends(cfg.time_budget_s)
    search_end = _phase(deadline, cfg, SEARCH_SHARE)
    dcp = H.megatron_dcp(tab, deadline=search_end)  # memory-filling: strong where memory sets the count
    if dcp is not None:
        candidates.append((tab.step_ms(dcp), "dcp-greedy", dcp))
    packer = LevelPacker(tab)
    info["search_family_s"] = {}
    found = search_step(tab, packer, m_min=H.min_micro_batches(tab),
                        upper_ms=min((c[0] for c in candidates), default=math.inf),
                        deadline=search_end, times=info["search_family_s"],
                        greedy=tab.clone_layout(dcp) if dcp is not None else None) + rounded
    found.sort(key=lambda c: c[0])
    families: dict[str, float] = {}
    for ms, name, _ in found:
        families.setdefault(name, ms)
    info["search_ms"] = families
    local = _phase(deadline, cfg, ends["polish"])
    if dcp is not None:
        found.append(candidates.pop())
        found.sort(key=lambda c: c[0])
    candidates += polish(found, packer, local, info)
    info["search_time_s"] = deadline.elapsed() - info["homogeneous_time_s"]
    if not candidates:
        greedy = H.greedy(tab)
        if greedy is not None:
            candidates.append((tab.step_ms(greedy), "greedy", greedy))
    if not candidates:
        raise ValueError("no memory-feasible plan exists for this batch")
    bounds = simple_bounds(tab)
    bound = bounds.base
    best_ms = min(c[0] for c in candidates)
    if cfg.bound_lp_solves > 0 and slot is not None:
        bound = max(bound, min(slot.bound_ms, best_ms))
    lp = None
    if cfg.bound_lp_solves > 0 and bound < best_ms * (1 - cfg.rel_gap):
        t0 = time.perf_counter()
        guided_end = _phase(deadline, cfg, ends["guided"])
        bound_end = _phase(deadline, cfg, ends["bound"])
        lp = lp_step_bound(tab, target_ms=best_ms, max_solves=cfg.bound_lp_solves, deadline=bound_end,
                           hints=GUIDED_HINTS, refine_above=_milp_covers(candidates, cfg),
                           hint_deadline=guided_end, **lp_bound_inputs(tab, cfg, info, slot, bounds, bound_end))
        info.update(lp_bound_ms=lp.bound_ms, lp_solves=lp.lp_solves, lp_time_s=time.perf_counter() - t0)
        bound = max(bound, lp.bound_ms)
        # the searches ended early (stalled or converged): the plan gets the rest, where it leaves
        # the time one pass over the plan takes (0.13 s for 65,536 documents; re-packing its tail or
        # rounding the relaxation, started without it, took 0.1-0.3 s past the phase's end)
        k = min(range(len(candidates)), key=lambda j: candidates[j][0])
        if room_for_a_pass(bound_end, tab, candidates[k][2]):
            ms, name, layout = candidates[k]
            info["tail_repacked"] = repack_tail(layout, tab, bound_end)
            candidates[k] = (tab.step_ms(layout), name, layout)
            best_ms = min(c[0] for c in candidates)
            if not bound_end.expired() and bound < best_ms * (1 - cfg.rel_gap):  # and the bound what it leaves
                t0, before = time.perf_counter(), lp.lp_solves
                lp = deeper_bound(tab, lp, target_ms=best_ms, max_solves=cfg.bound_lp_solves - lp.lp_solves,
                                  max_extra=cfg.max_extra_micro_batches, rel_tol=cfg.rel_gap, deadline=bound_end,
                                  refine_above=_milp_covers(candidates, cfg), floors=bounds.floors)
                info.update(deeper_bound_ms=lp.bound_ms, deeper_solves=lp.lp_solves - before,
                            deeper_time_s=time.perf_counter() - t0)
                bound = max(bound, lp.bound_ms)
        best_layout = min(candidates, key=lambda c: c[0])[2]
        if bound < best_ms * (1 - cfg.rel_gap) and lp.hints and room_for_a_pass(guided_end, tab, best_layout):
            candidates += _guided(tab, packer, lp.hints, best_ms, guided_end, info)
            best_ms = min(c[0] for c in candidates)
    if cfg.search == "milp" and bound < best_ms * (1 - cfg.rel_gap):
        tail = bounds.tail  # plans with more micro-batches than the MILP's (the LP's too where it ran)
        if lp is not None:
            tail = lambda m: max(bounds.tail(m), lp.more_than(m))  # noqa: E731
        milp_bound = milp_phase(tab, cfg, candidates, packer, tail, info, _phase(deadline, cfg, 0.87))
        info["milp_raised_bound"] = milp_bound > bound * (1 + 1e-9)  # (the step MILP's dual bound)
        bound = max(bound, milp_bound)
    best_layout = min(candidates, key=lambda c: c[0])[2]
    items = sum(len(mb) for mb in best_layout) + len(tab.lens)
    window = _phase(deadline, cfg, 0.95).capped(deadline.end - ASSEMBLY_S_PER_ITEM * items)
    if homo_cut and min(candidates, key=lambda c: c[0])[2] is homo[0] and not window.expired():
        # the plan is the homogeneous one, whose search its share cut short: it goes on with the
        # time the phases left (65,536 documents at 256 H200 GPUs: 103 micro-batches after 0.8 s,
        # 0.02% slower than the 106 BatchAda's search finds in 1.8 s, where the plan took 2 of 3 s)
        more = H.best_homogeneous(tab, [homo[1]], deadline=window, faster_than=homo_ms, tried=tried,
                                  resume=True)
        if more is not None:
            candidates.append((tab.step_ms(more[0]), f"homogeneous-d{homo[1]}", more[0]))
    info["runners_up"] = search_runners_up(candidates, tab, window)
    best_ms, method, layout = min(candidates, key=lambda c: c[0])
    info["touched_up"] = touch_up(layout, tab, window, packer)
    best_ms = tab.step_ms(layout)
    info["candidates_ms"] = {name: ms for ms, name, _ in sorted(candidates, key=lambda c: -c[0])}
    info["time_s"] = deadline.elapsed()
    info["time_budget_s"] = cfg.time_budget_s
    return to_step_plan(layout, tab, strategy="flexsp", method=method, lower_bound_ms=min(bound, best_ms),
                        info=info, bucketing_error=info.get("bucketing_error", 0.0))


def lp_bound_inputs(tab: Tables, cfg: PlannerConfig, info: dict, slot: SlotLP | None,
                    bounds: SimpleBounds, deadline: Deadline) -> dict:
    """The arguments of :func:`~planner.bound.lp_step_bound` that the planner derives from the
    configuration and the bounds before it: the counts searched, the tolerance, the slot LP's
    floors (per count and past the counts searched) and its finer re-solve (``refloor``, within
    ``deadline``), the step floors. ``scripts/bench_bound.py`` calls the bound with them too."""
    last = H.min_micro_batches(tab) + cfg.max_extra_micro_batches
    return dict(max_extra=cfg.max_extra_micro_batches, rel_tol=cfg.rel_gap, floors=bounds.floors,
                refloor=_finer_slot(tab, cfg, info, deadline) if slot is not None else None,
                count_floor=slot.by_count if slot is not None else None,
                beyond_floor=slot.at_least(last + 1) if slot is not None else 0.0)


def _milp_covers(candidates: list, cfg: PlannerConfig) -> int:
    """The micro-batch counts the step MILP will bound (up to the best plan's; 0 when it will not
    run): the LP bound then refines the counts above them."""
    best = min(candidates, key=lambda c: c[0])[2]
    return len(best) if cfg.search == "milp" and len(best) <= STEP_MILP_MAX_MICRO_BATCHES else 0


def _guided(tab: Tables, packer: LevelPacker, hints, upper_ms: float, deadline: Deadline,
            info: dict) -> list[tuple[float, str, list]]:
    """The plan rounded from the LP bound's relaxed placements and polished
    (:func:`~planner.guided.guided_candidates`), when faster than ``upper_ms``."""
    t0 = time.perf_counter()
    lo, hi = base_range(packer, H.min_micro_batches(tab))
    out = guided_candidates(packer, hints, level_grid(lo, hi, 8), deadline, upper_ms, slack=GUIDED_SLACK)
    info.update(guided_ms=[round(c[0], 1) for c in out], guided_time_s=time.perf_counter() - t0)
    return out


def _finer_slot(tab: Tables, cfg: PlannerConfig, info: dict, deadline: Deadline
                ) -> Callable[[], tuple[dict[int, float], float] | None]:
    """The LP bound's ``refloor`` (:func:`~planner.bound.lp_step_bound`): the slot LP again with
    finer buckets, more dual-feasible functions and more sequences placed one by one
    (:data:`FINER_SLOT`, or :data:`FINE_SLOT` where the time left is under five times what the
    first slot LP took; nothing under two and a half times), within ``deadline``; its values per
    count and for every count past them, or None. On steps of many micro-batches the slot bound is
    the one that binds and the LP bound's searches raise none of its counts: lognormal documents
    (mean 16K tokens) at 256 GPUs, 85,311 ms with the first slot LP, 85,736 ms finer (0.2 s)."""
    def refloor() -> tuple[dict[int, float], float] | None:
        left = deadline.left()
        took = info.get("slot_time_s", math.inf)
        if left < 2.5 * took:
            return None
        t0, counts = time.perf_counter(), _slot_counts(tab, cfg)
        try:
            finer = solve_slot_lp(tab, counts=counts, time_limit_s=left,
                                  **(FINER_SLOT if left >= 5 * took else FINE_SLOT))
        except SolverTrouble as exc:
            log.debug("%s; the finer slot bound is left out", exc)
            return None
        info.update(slot_refined_ms=finer.bound_ms, slot_refined_s=time.perf_counter() - t0)
        return finer.by_count, finer.at_least(counts[-1])  # every count past those searched
    return refloor


def _slot_counts(tab: Tables, cfg: PlannerConfig) -> tuple[int, ...]:
    """The micro-batch counts the slot LP is solved at: those the LP bound searches one by one
    (the memory minimum and ``cfg.max_extra_micro_batches`` more) and the one after."""
    m_min = H.min_micro_batches(tab)
    return tuple(range(m_min, m_min + cfg.max_extra_micro_batches + 2))


def slot_lp(tab: Tables, cfg: PlannerConfig, info: dict) -> SlotLP | None:
    """The slot bound's LP (:mod:`slot_bound`, tens of milliseconds), with its value at each count
    the LP bound searches and the one after; None when HiGHS fails it."""
    t0 = time.perf_counter()
    try:
        slot = solve_slot_lp(tab, counts=_slot_counts(tab, cfg))
    except SolverTrouble as exc:
        log.warning("%s; the slot bound and its rounded plan are left out", exc)
        return None
    info.update(slot_bound_ms=slot.bound_ms, slot_m=slot.m, slot_time_s=time.perf_counter() - t0)
    return slot


@contextlib.contextmanager
def _no_cyclic_gc():
    """The cyclic garbage collector paused (plans free their objects by reference counting):
    within a process holding many objects, one full collection would take a tenth of the budget."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _phase_ends(budget_s: float) -> dict[str, float]:
    """Where polishing, the LP bound and the rounding of its relaxation end (shares of the budget).

    The bound's LP does not grow with the cluster or the batch (a few dozen sequences and buckets),
    so its solves need about the same time at any budget: at 1 s it gets 0.26 s (0.07 s taken from
    the polishing and 0.02 s from the rounding, which takes 0.01 s from the MILPs; the ends were
    62/79/83%), where 0.17 s left the bound of many 64-GPU batches unconverged. Past 1 s those
    moves stay 0.07, 0.02 and 0.01 s, and the search and polishing, whose work grows with the
    batch, keep the rest (at 1,024 GPUs and 9 s the 1 s shares and these gave the same plans and
    bounds on lognormal-4k and -16k steps, within their run-to-run variation)."""
    f = min(1.0, 1.0 / max(budget_s, 1e-9))
    return {"polish": 0.62 - 0.07 * f, "bound": 0.79 + 0.02 * f, "guided": 0.83 + 0.01 * f}


def _phase(deadline: Deadline, cfg: PlannerConfig, fraction: float) -> Deadline:
    """A deadline at ``fraction`` of the planning budget (never after ``deadline``)."""
    return deadline.capped(deadline.start + fraction * cfg.time_budget_s)
