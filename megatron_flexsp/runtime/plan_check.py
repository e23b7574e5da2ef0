"""Check a plan against the runtime before executing it: raise on every rank instead of hanging.

The plan is the same value on every rank (broadcast), so a bad plan raises the same ``ValueError``
everywhere before any collective starts.
"""

from __future__ import annotations

from megatron_flexsp.plan import StepPlan, validate_plan


def check_plan(plan: StepPlan, pool, *, num_heads: int, num_kv_heads: int,
               kv_replication: bool = False) -> None:
    """Structure (:func:`validate_plan`), cluster size, tensor parallelism, groups known to ``pool``,
    head divisibility (``num_heads`` / ``num_kv_heads``: the heads each rank holds, i.e. divided by
    TP).

    ``pool`` needs ``__contains__(ranks)`` (an :class:`SPGroupPool`); ``pool.cluster`` its cluster
    (of devices), ``pool.tp`` (default 1) its tensor-parallel size.
    """
    validate_plan(plan)
    n = pool.cluster.num_gpus
    if plan.num_gpus != n or plan.gpus_per_node != pool.cluster.gpus_per_node:
        raise ValueError(f"plan is for {plan.num_gpus} GPUs ({plan.gpus_per_node}/node), the runtime "
                         f"runs {n} ({pool.cluster.gpus_per_node}/node)")
    tp = getattr(pool, "tp", 1)
    if plan.tensor_parallel != tp:
        raise ValueError(f"plan is for devices of tensor_parallel={plan.tensor_parallel} ranks, the "
                         f"runtime runs tp={tp}")
    for j, mb in enumerate(plan.micro_batches):
        for g in mb.groups:
            if g.ranks not in pool:
                raise ValueError(f"micro-batch {j}: group {list(g.ranks)[:8]} is not in the group pool "
                                 f"(created at start-up); groups are never created mid-step")
            d = g.size
            if num_heads % d:
                raise ValueError(f"micro-batch {j}: group size {d} does not divide num_heads={num_heads}")
            if num_kv_heads % d and not (kv_replication and d % num_kv_heads == 0):
                raise ValueError(f"micro-batch {j}: group size {d} does not divide "
                                 f"num_kv_heads={num_kv_heads} and KV-head replication is off")
