"""Which side of the gap is loose (``sim.gap_sides``): the exact micro-batch MILP against brute force."""

import math

import numpy as np
import pytest

from megatron_flexsp.plan import GroupPlan, MicroBatchPlan, StepPlan
from megatron_flexsp.sim.gap_sides import micro_batch_gaps
from tests.unit.helpers import tiny_cost_model
from tests.unit.test_planner import brute_force_step_ms


def _one_group_each(lens, cm) -> StepPlan:
    """Every sequence alone on the smallest group that holds it, one micro-batch per GPU set
    filled in order: a valid plan that packs nothing well."""
    mbs, cur, used = [], [], 0
    for i, n in enumerate(lens):
        d = next(d for d in cm.sizes if cm.group_capacity_tokens(d) >= n)
        if used + d > cm.cluster.num_gpus:
            mbs.append(cur)
            cur, used = [], 0
        cur.append(GroupPlan(tuple(range(used, used + d)), (i,)))
        used += d
    mbs.append(cur)
    return StepPlan(num_gpus=cm.cluster.num_gpus, gpus_per_node=cm.cluster.gpus_per_node, seq_lens=tuple(lens),
                    strategy="hand", method="hand", predicted_step_ms=0.0, lower_bound_ms=0.0,
                    micro_batches=tuple(MicroBatchPlan(tuple(mb)) for mb in mbs))


@pytest.mark.parametrize("seed", range(4))
def test_exact_micro_batch_value_is_the_brute_force_optimum(seed):
    cm = tiny_cost_model()
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in rng.integers(5, 180, size=int(rng.integers(3, 6)))]
    plan = _one_group_each(lens, cm)
    rows = micro_batch_gaps(plan, cm, exact_max_sequences=10, exact_time_s=30.0)
    assert len(rows) == len(plan.micro_batches)
    for row, mb in zip(rows, plan.micro_batches):
        mine = tuple(lens[i] for g in mb.groups for i in g.seqs)
        opt = brute_force_step_ms(mine, cm, count=1)
        span = max(cm.group_time_ms([lens[i] for i in g.seqs], len(g.ranks)) for g in mb.groups)
        assert row.makespan_ms == pytest.approx(span, rel=1e-9)
        assert row.proven
        assert row.exact_ms == pytest.approx(opt, rel=1e-6)
        assert row.lp_bound_ms <= opt * (1 + 1e-6)
        assert row.exact_ms <= row.makespan_ms * (1 + 1e-9)
        assert row.fill == pytest.approx(sum(mine) / (cm.cluster.num_gpus * cm.capacity_tokens))


def test_exact_solve_skipped_above_the_limit_and_bad_input_named():
    cm = tiny_cost_model()
    plan = _one_group_each([40, 50, 60, 70], cm)
    rows = micro_batch_gaps(plan, cm, exact_max_sequences=0)
    assert all(math.isnan(r.exact_ms) and not r.proven for r in rows)
    with pytest.raises(ValueError, match="cost model for 8"):
        micro_batch_gaps(plan, tiny_cost_model(num_gpus=8))
    with pytest.raises(ValueError, match="lp_solves=0"):
        micro_batch_gaps(plan, cm, lp_solves=0)
