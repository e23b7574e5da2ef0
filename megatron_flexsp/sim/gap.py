"""Where a plan's step time goes beyond the floor every plan pays.

Every micro-batch ``j`` of makespan ``T_j`` keeps all ``N`` GPUs for ``T_j``, and each GPU pays at
least the smallest fixed cost ``f_min``; so, per micro-batch,

    N (T_j - f_min) = sum over groups g of d_g (f_g - f_min + work_g)     (busy beyond f_min)
                    + sum over groups g of d_g (T_j - f_g - work_g)        (waiting for the slowest)
                    + (N - GPUs in groups) (T_j - f_min)                   (in no group)

Summed over the step and split against the **floor** ``m_min f_min + A / N`` (``m_min``: the fewest
micro-batches memory allows; ``A``: every sequence at its least GPU-time over the sizes that hold
it, which the planner's simple bound also uses), the step time is exactly

    step = floor + micro_batches + idle + sizes

* ``micro_batches_ms``: ``(m - m_min) f_min``, the micro-batches run beyond the memory minimum;
* ``idle_ms``: GPU-time spent waiting for a micro-batch's slowest group or in no group, over ``N``;
* ``sizes_ms``: GPU-time beyond each sequence's least (sequences on larger groups than the
  cheapest that holds them, and larger fixed costs), over ``N``.

A proven lower bound ``bound`` sits between the floor and the step: ``bound - floor`` is what the
bound proves beyond the floor, ``step - bound`` the gap. Neither side says which of the parts an
optimal plan avoids; the parts say which costs the plan pays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_flexsp.cost_model import CostModel
from megatron_flexsp.plan import StepPlan
from megatron_flexsp.planner.api import simple_bounds
from megatron_flexsp.planner.heuristics import min_micro_batches
from megatron_flexsp.planner.layout import Tables


@dataclass(frozen=True)
class GapParts:
    """A step split into the floor and what the plan pays above it (ms of step time; see the module
    docstring). ``step_ms = floor_ms + micro_batches_ms + idle_ms + sizes_ms``; ``bound_ms``: the
    plan's proven lower bound; ``micro_batches`` and ``min_micro_batches``: its count and the
    memory minimum."""

    step_ms: float
    bound_ms: float
    floor_ms: float
    micro_batches_ms: float
    idle_ms: float
    sizes_ms: float
    micro_batches: int
    min_micro_batches: int

    def shares(self) -> dict[str, float]:
        """The parts and the bound's lead over the floor as fractions of the step time."""
        s = self.step_ms if self.step_ms > 0 else math.inf
        return {"micro_batches": self.micro_batches_ms / s, "idle": self.idle_ms / s,
                "sizes": self.sizes_ms / s, "bound_over_floor": (self.bound_ms - self.floor_ms) / s}


def gap_parts(plan: StepPlan, cm: CostModel) -> GapParts:
    """Split ``plan``'s step time (under ``cm``) into the floor, the micro-batches beyond the memory
    minimum, idle GPU-time and GPU-time beyond each sequence's least; raises ``ValueError`` when the
    plan's cluster is not ``cm``'s. The floor is the planner's simple bound
    (:func:`~megatron_flexsp.planner.api.simple_bounds`) before its fastest-sequence term, over the
    sequences the plan trains."""
    n = cm.cluster.num_gpus
    if plan.num_gpus != n:
        raise ValueError(f"plan is for {plan.num_gpus} GPUs, cost model for {n}")
    lens = np.asarray(plan.seq_lens, dtype=np.int64)
    trained = np.array(sorted({i for mb in plan.micro_batches for g in mb.groups for i in g.seqs}), dtype=np.int64)
    tab = Tables(lens[trained], cm)  # dropped sequences are in seq_lens but in no group
    where = np.zeros(len(lens), dtype=np.int64)
    where[trained] = np.arange(len(trained))
    simple = simple_bounds(tab)
    f_min, m_min = simple.f_min, min_micro_batches(tab)
    step = idle = busy = 0.0
    for mb in plan.micro_batches:
        ends = [(g.size, tab.fixed[g.size] + float(tab.time[g.size][where[list(g.seqs)]].sum()))
                for g in mb.groups if g.seqs]
        t = max((e for _, e in ends), default=0.0)
        mine = sum(d * (e - f_min) for d, e in ends)  # GPU-time beyond f_min of the groups at work
        step += t
        busy += mine
        idle += n * (t - f_min) - mine
    m = len(plan.micro_batches)
    return GapParts(step_ms=step, bound_ms=float(plan.lower_bound_ms), floor_ms=m_min * f_min + simple.area,
                    micro_batches_ms=(m - m_min) * f_min, idle_ms=idle / n, sizes_ms=busy / n - simple.area,
                    micro_batches=m, min_micro_batches=m_min)
