"""Property tests: whatever the batch and cluster, every strategy's plan is valid and fits memory."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_flexsp.plan import validate_plan
from megatron_flexsp.planner import plan_step
from megatron_flexsp.sim import simulate
from megatron_flexsp.topology import is_node_aligned
from tests.unit.helpers import tiny_cost_model

CLUSTERS = [(4, 2), (8, 4), (8, 2), (16, 4)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=st.sampled_from(CLUSTERS),
       lens=st.lists(st.integers(1, 1600), min_size=1, max_size=40),
       strategy=st.sampled_from(["static", "batchada", "megatron-dcp", "flexsp"]))
def test_every_plan_is_valid(cluster, lens, strategy):
    n, gpn = cluster
    cm = tiny_cost_model(num_gpus=n, gpus_per_node=gpn, capacity_tokens=100)
    lens = [min(x, cm.max_tokens) for x in lens]
    plan = plan_step(np.array(lens), cm, strategy=strategy, max_seq_len=cm.max_tokens)
    validate_plan(plan)
    seen = sorted(i for mb in plan.micro_batches for g in mb.groups for i in g.seqs)
    assert seen == list(range(len(lens)))
    for mb in plan.micro_batches:
        ranks = [r for g in mb.groups for r in g.ranks]
        assert len(ranks) == len(set(ranks)) and max(ranks) < n
        assert all(is_node_aligned(g.ranks, cm.cluster) for g in mb.groups)
    sim = simulate(plan, cm)
    assert sim.memory_ok
    assert sim.step_ms == plan.predicted_step_ms or abs(sim.step_ms - plan.predicted_step_ms) < 1e-6
    if strategy == "flexsp":
        assert plan.lower_bound_ms <= plan.predicted_step_ms * (1 + 1e-9)
