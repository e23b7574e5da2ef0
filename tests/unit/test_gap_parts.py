"""The split of a step into the floor, extra micro-batches, idle GPU-time and GPU-time beyond each
sequence's least (``sim.gap``), against hand arithmetic and the simulator."""

import numpy as np
import pytest

from megatron_flexsp.config import PlannerConfig
from megatron_flexsp.plan import GroupPlan, MicroBatchPlan, StepPlan
from megatron_flexsp.planner import plan_step
from megatron_flexsp.sim import simulate
from megatron_flexsp.sim.corpora import synthetic_lengths
from megatron_flexsp.sim.gap import gap_parts
from megatron_flexsp.sim.workloads import sample_batches
from tests.unit.helpers import tiny_cost_model


def _plan(lens, mbs, bound=0.0) -> StepPlan:
    """``mbs``: per micro-batch, (ranks, sequences) per group; group times are not needed."""
    return StepPlan(num_gpus=8, gpus_per_node=4, seq_lens=tuple(lens), strategy="hand", method="hand",
                    predicted_step_ms=0.0, lower_bound_ms=bound,
                    micro_batches=tuple(MicroBatchPlan(tuple(GroupPlan(tuple(r), tuple(s)) for r, s in mb))
                                        for mb in mbs))


def test_hand_made_plan_splits_exactly_as_computed_by_hand():
    cm = tiny_cost_model(num_gpus=8, gpus_per_node=4, capacity_tokens=100, overhead_ms=5.0)
    lens = [300, 60, 90, 40, 30]
    # micro-batch 0: 300+60 tokens on 4 GPUs, 90 on 2, two GPUs in no group; micro-batch 1: 40 and
    # 30 on one GPU each, six GPUs in no group
    plan = _plan(lens, [[(range(0, 4), (0, 1)), (range(4, 6), (2,))],
                        [(range(0, 1), (3,)), (range(1, 2), (4,))]], bound=1.0)
    parts = gap_parts(plan, cm)
    f = {d: cm.group_fixed_ms(d) for d in cm.sizes}
    t = {d: cm.seq_time_ms(np.array(lens), d) for d in cm.sizes}
    g0, g1 = f[4] + t[4][0] + t[4][1], f[2] + t[2][2]
    g2, g3 = f[1] + t[1][3], f[1] + t[1][4]
    t0, t1 = max(g0, g1), max(g2, g3)
    f_min = min(f.values())
    idle = (4 * (t0 - g0) + 2 * (t0 - g1) + 2 * (t0 - f_min) + (t1 - g2) + (t1 - g3) + 6 * (t1 - f_min)) / 8
    # least GPU-time: 300 tokens need 4 GPUs (100 per GPU), 60 and 90 fit one
    least = 4 * t[4][0] + sum(min(d * t[d][i] for d in cm.sizes if lens[i] <= 100 * d) for i in (1, 2, 3, 4))
    m_min = int(np.ceil(sum(lens) / (100 * 8)))
    assert parts.min_micro_batches == m_min == 1 and parts.micro_batches == 2
    assert parts.step_ms == pytest.approx(t0 + t1, rel=1e-12)
    assert parts.idle_ms == pytest.approx(idle, rel=1e-12)
    assert parts.floor_ms == pytest.approx(m_min * f_min + least / 8, rel=1e-12)
    assert parts.micro_batches_ms == pytest.approx(f_min, rel=1e-12)
    total = parts.floor_ms + parts.micro_batches_ms + parts.idle_ms + parts.sizes_ms
    assert total == pytest.approx(simulate(plan, cm).step_ms, rel=1e-12)
    assert parts.sizes_ms > 0  # sequence 1 runs on 4 GPUs, not on one


def test_planner_plans_split_into_parts_that_add_up_and_the_bound_is_above_the_floor(paper_cm):
    batches, _ = sample_batches(synthetic_lengths("lognormal-4k", seed=1), global_batch=256, num_batches=1,
                                seed=0, max_seq_len=196608)
    plan = plan_step(batches[0], paper_cm, config=PlannerConfig(time_budget_s=0.5))
    assert len(plan.micro_batches) >= 2
    parts = gap_parts(plan, paper_cm)
    assert parts.floor_ms + parts.micro_batches_ms + parts.idle_ms + parts.sizes_ms == pytest.approx(
        simulate(plan, paper_cm).step_ms, rel=1e-9)
    assert parts.idle_ms >= 0 and parts.sizes_ms >= -1e-9 and parts.micro_batches_ms >= 0
    assert parts.floor_ms <= parts.bound_ms * (1 + 1e-9) <= parts.step_ms * (1 + 1e-9)
    shares = parts.shares()
    assert shares["bound_over_floor"] >= -1e-9
    assert sum(shares[k] for k in ("micro_batches", "idle", "sizes")) == pytest.approx(
        1 - parts.floor_ms / parts.step_ms, rel=1e-9)


def test_plan_of_another_cluster_is_refused(paper_cm):
    with pytest.raises(ValueError, match="plan is for 8 GPUs, cost model for 64"):
        gap_parts(_plan([10], [[(range(0, 1), (0,))]]), paper_cm)
