"""Evaluate a :class:`~megatron_flexsp.plan.StepPlan` under a :class:`CostModel`.

Independent of how the plan was made: group time = fixed cost of its size + sum of its sequences'
compute and all-to-all time; micro-batch time = its slowest group; step time = sum over micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_flexsp.cost_model import CostModel
from megatron_flexsp.plan import StepPlan


@dataclass(frozen=True)
class SimResult:
    """Simulated step. Times in ms, memory in bytes; fractions in [0, 1].

    ``idle_fraction``: share of GPU-time (num_gpus x step) in which GPUs wait for the slowest
    group of their micro-batch or belong to no group. ``alltoall_fraction``: share of busy
    GPU-time spent in all-to-all. ``memory_ok``: every group within the device budget.
    """

    step_ms: float
    micro_batch_ms: tuple[float, ...]
    group_ms: tuple[tuple[float, ...], ...]
    idle_fraction: float
    alltoall_fraction: float
    peak_memory_bytes: float
    memory_budget_bytes: float
    memory_ok: bool
    num_micro_batches: int
    tokens: int

    def to_dict(self) -> dict:
        return {"step_ms": self.step_ms, "micro_batch_ms": list(self.micro_batch_ms),
                "idle_fraction": self.idle_fraction, "alltoall_fraction": self.alltoall_fraction,
                "peak_memory_gib": self.peak_memory_bytes / 2**30,
                "memory_budget_gib": self.memory_budget_bytes / 2**30, "memory_ok": self.memory_ok,
                "num_micro_batches": self.num_micro_batches, "tokens": self.tokens}


def simulate(plan: StepPlan, cm: CostModel) -> SimResult:
    """Simulate ``plan`` with ``cm``; raises ``ValueError`` if the plan's cluster differs from ``cm``'s."""
    if plan.num_gpus != cm.cluster.num_gpus or plan.gpus_per_node != cm.cluster.gpus_per_node:
        raise ValueError(f"plan is for {plan.num_gpus} GPUs ({plan.gpus_per_node}/node), cost model for "
                         f"{cm.cluster.num_gpus} GPUs ({cm.cluster.gpus_per_node}/node)")
    if plan.tensor_parallel != cm.parallel.tp:
        raise ValueError(f"plan is for devices of tensor_parallel={plan.tensor_parallel} GPUs, cost "
                         f"model for tp={cm.parallel.tp}")
    lens = np.asarray(plan.seq_lens, dtype=np.int64)
    mb_ms, group_ms = [], []
    busy = a2a = 0.0
    peak = cm.state_bytes_per_gpu
    tokens = 0
    for mb in plan.micro_batches:
        times = []
        for g in mb.groups:
            seq = lens[list(g.seqs)]
            d = g.size
            t = cm.group_time_ms(seq, d) if len(seq) else 0.0
            times.append(t)
            busy += d * t
            a2a += d * float(np.sum(cm.alltoall_ms(seq, d))) if len(seq) else 0.0
            peak = max(peak, cm.memory_bytes(float(seq.sum()), d))
            tokens += int(seq.sum())
        group_ms.append(tuple(times))
        mb_ms.append(max(times, default=0.0))
    step = float(sum(mb_ms))
    total = cm.cluster.num_gpus * step
    budget = cm.profile.memory_budget_bytes
    return SimResult(step_ms=step, micro_batch_ms=tuple(mb_ms), group_ms=tuple(group_ms),
                     idle_fraction=(1.0 - busy / total) if total > 0 else 0.0,
                     alltoall_fraction=(a2a / busy) if busy > 0 else 0.0,
                     peak_memory_bytes=peak, memory_budget_bytes=budget,
                     memory_ok=peak <= budget * (1 + 1e-9), num_micro_batches=len(plan.micro_batches),
                     tokens=tokens)
