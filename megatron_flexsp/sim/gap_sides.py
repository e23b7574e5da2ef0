"""Which side of a plan's gap is loose: its micro-batches' packing or the bound.

A plan's gap (step time over its proven lower bound) says neither whether a faster plan exists nor
whether a higher bound does. Two measurements split it, per micro-batch ``j`` with makespan ``T_j``:

* ``lp_bound_ms``: the planner's step LP for ``j``'s sequences alone as one micro-batch, searched
  until its boxes converge. ``sum T_j - sum lp_bound_ms`` is what the plan loses *inside* its
  micro-batches as far as the LP can tell; what is left of the gap, ``sum lp_bound_ms - bound``,
  sits in which sequences share a micro-batch (the step LP may split them otherwise) or in a step
  bound that has not converged.
* ``exact_ms`` / ``exact_bound_ms``: the step MILP (:mod:`megatron_flexsp.planner.milp`) on ``j``'s
  sequences with every sequence placed by itself and every group an explicit slot, warm-started
  from the plan's micro-batch: no part of it is fluid, so once HiGHS proves it (``proven``) its
  value is the least makespan of those sequences in one micro-batch. ``T_j - exact_ms`` is then
  the plan's own loss there and ``exact_ms - lp_bound_ms`` the relaxation's looseness.

Exact solves take seconds to minutes (31 sequences of a memory-full micro-batch at 64 GPUs: 73 s),
so they run only for micro-batches of at most ``exact_max_sequences`` sequences.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from megatron_flexsp.cost_model import CostModel
from megatron_flexsp.plan import GroupPlan, StepPlan
from megatron_flexsp.planner.bound import step_bound
from megatron_flexsp.planner.bucketing import Buckets
from megatron_flexsp.planner.layout import Group, Tables
from megatron_flexsp.planner.milp import MilpOptions, solve_step_milp

#: relative difference under which the exact MILP's value and dual bound count as proven equal
PROVEN_REL = 1e-4


@dataclass(frozen=True)
class MicroBatchGap:
    """One micro-batch of a plan (times in ms): ``fill`` its tokens over the cluster's memory;
    ``exact_*`` are NaN where the exact MILP did not run."""

    index: int
    sequences: int
    fill: float
    makespan_ms: float
    lp_bound_ms: float
    exact_ms: float = math.nan
    exact_bound_ms: float = math.nan
    exact_time_s: float = math.nan

    @property
    def proven(self) -> bool:
        """Whether the exact MILP proved its value the least makespan of these sequences."""
        return (math.isfinite(self.exact_ms) and math.isfinite(self.exact_bound_ms)
                and self.exact_bound_ms >= self.exact_ms * (1 - PROVEN_REL))


def micro_batch_gaps(plan: StepPlan, cm: CostModel, *, lp_solves: int = 400, exact_max_sequences: int = 0,
                     exact_time_s: float = 60.0) -> list[MicroBatchGap]:
    """Per micro-batch of ``plan``: its makespan, the LP bound of its sequences as one micro-batch
    (at most ``lp_solves`` LP solves) and, for micro-batches of at most ``exact_max_sequences``
    sequences, the exact MILP's best makespan and dual bound within ``exact_time_s`` seconds each.
    Raises ``ValueError`` when the plan's cluster is not ``cm``'s or a limit is not positive."""
    n = cm.cluster.num_gpus
    if plan.num_gpus != n:
        raise ValueError(f"plan is for {plan.num_gpus} GPUs, cost model for {n}")
    if lp_solves < 1 or exact_time_s <= 0:
        raise ValueError(f"lp_solves={lp_solves} must be >= 1 and exact_time_s={exact_time_s} > 0")
    lens = np.asarray(plan.seq_lens, dtype=np.int64)
    out = []
    for j, mb in enumerate(plan.micro_batches):
        groups = [g for g in mb.groups if g.seqs]
        idx = [i for g in groups for i in g.seqs]
        if not idx:
            continue
        tab = Tables(lens[idx], cm)
        layout = [_groups(tab, groups, {i: k for k, i in enumerate(idx)})]
        makespan = tab.step_ms(layout)
        lp = step_bound(tab, 1, target_ms=makespan, t1_lo=0.0, max_solves=lp_solves).bound_ms
        row = MicroBatchGap(j, len(idx), float(lens[idx].sum()) / (n * cm.capacity_tokens), makespan, lp)
        if len(idx) <= exact_max_sequences:
            res = solve_step_milp(tab, list(range(len(idx))), Buckets((), (), (), 0.0), m_max=1,
                                  upper_ms=makespan * (1 + 1e-6), warm=layout, m_min=1,
                                  options=MilpOptions(exact_time_s, 10**9, 0.0, 0, slot_max=n, slot_min_size=1))
            best = min(res.objective_ms, makespan) if math.isfinite(res.objective_ms) else makespan
            row = dataclasses.replace(row, exact_ms=best, exact_bound_ms=min(res.dual_bound_ms, best),
                                      exact_time_s=res.solve_time_s)
        out.append(row)
    return out


def _groups(tab: Tables, groups: list[GroupPlan], where: dict[int, int]) -> list[Group]:
    """The planner's groups of ``groups``, their sequences renumbered by ``where`` into ``tab``."""
    made = []
    for gp in groups:
        g = Group(gp.size)
        for i in gp.seqs:
            tab.add(g, where[i])
        made.append(g)
    return made
