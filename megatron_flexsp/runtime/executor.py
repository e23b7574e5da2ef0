"""Execute one step of a plan on this rank: check, dispatch, and run each micro-batch's group.

The caller supplies ``run_group(rows, positions, group, layout)``: forward and backward of its
model on this rank's rows (``[t, *trailing]``, e.g. tokens and labels) of one group, returning the
(detached) loss sum it added. The executor never imports a model, Megatron or the planner.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron_flexsp.plan import StepPlan
from megatron_flexsp.runtime.device import synchronize
from megatron_flexsp.runtime.dispatch import dispatch
from megatron_flexsp.runtime.layout import build_group_layout, local_positions
from megatron_flexsp.runtime.plan_check import check_plan


@dataclass
class StepStats:
    """What this rank did in a step: loss sum, seconds in dispatch / group switching / its groups."""

    loss_sum: float = 0.0
    dispatch_s: float = 0.0
    switch_s: float = 0.0
    run_s: float = 0.0
    group_sizes: list[int] = field(default_factory=list)


def run_step(plan: StepPlan, *, pool, rank: int, loaded: dict[int, torch.Tensor],
             run_group: Callable, num_heads: int, num_kv_heads: int, kv_replication: bool = False,
             pad_value=0, trailing: tuple[int, ...] = (), dtype: torch.dtype = torch.int64,
             device: torch.device | str = "cpu") -> StepStats:
    """Run ``plan`` on this rank (collective: every rank calls it with the same plan).

    ``loaded``: the sequences this rank owns (``s % world == rank``), ``{s: rows[L_s, *trailing]}``.
    """
    check_plan(plan, pool, num_heads=num_heads, num_kv_heads=num_kv_heads, kv_replication=kv_replication)
    stats = StepStats()
    lengths = list(plan.seq_lens)
    for mb in plan.micro_batches:
        groups = [(g.ranks, g.seqs) for g in mb.groups]
        t0 = time.perf_counter()
        rows = dispatch(groups, lengths, loaded, pad_value=pad_value, trailing=trailing, dtype=dtype,
                        device=device)
        synchronize(device)
        stats.dispatch_s += time.perf_counter() - t0
        for g in mb.groups:
            if rank not in g.ranks:
                continue
            t0 = time.perf_counter()
            group = pool.get(g.ranks)
            lens = [lengths[s] for s in g.seqs]
            layout = build_group_layout(lens, g.size).to(device)
            r = g.ranks.index(rank)
            positions = local_positions(lens, g.size, r).to(device)
            t1 = time.perf_counter()
            stats.switch_s += t1 - t0
            stats.loss_sum += float(run_group(rows, positions, group, layout))
            synchronize(device)
            stats.run_s += time.perf_counter() - t1
            stats.group_sizes.append(g.size)
    return stats
