import numpy as np

from megatron_flexsp.planner import heuristics as H
from megatron_flexsp.planner import plan_step
from megatron_flexsp.planner.layout import Tables
from tests.unit.helpers import tiny_cost_model


def _area(tab, items):
    return sum(tab.min_size[i] * tab.time[int(tab.min_size[i])][i] for i in items)


def test_blaster_balances_predicted_time_not_tokens():
    cm = tiny_cost_model(num_gpus=4, gpus_per_node=2, capacity_tokens=400)
    # two long sequences (quadratic attention makes them expensive) and many short ones
    lens = np.array([380, 370] + [40] * 36)
    tab = Tables(lens, cm)
    split = H._blast(tab, 2)
    areas = [_area(tab, part) for part in split]
    assert max(areas) / min(areas) < 1.1
    assert all(int(lens[part].sum()) <= 4 * cm.capacity_tokens for part in split)
    # the two long sequences land in different micro-batches
    assert {0, 1} & set(split[0]) and {0, 1} & set(split[1])
    # a token-balanced split would have put both long sequences together with few short ones
    assert sorted(i for part in split for i in part) == list(range(len(lens)))


def test_micro_batch_count_follows_fixed_cost():
    lens = np.array([60] * 40)
    cheap = plan_step(lens, tiny_cost_model(capacity_tokens=400, overhead_ms=0.01))
    dear = plan_step(lens, tiny_cost_model(capacity_tokens=400, overhead_ms=500.0))
    assert len(dear.micro_batches) == 2  # the memory minimum: 2400 tokens over 4 x 400
    assert len(cheap.micro_batches) >= len(dear.micro_batches)
    assert dear.predicted_step_ms >= 2 * 500.0


def test_fallbacks_are_valid_and_memory_feasible():
    cm = tiny_cost_model(num_gpus=8, gpus_per_node=4, capacity_tokens=200)
    lens = np.random.default_rng(0).integers(5, 900, size=30)
    tab = Tables(lens, cm)
    for layout in (H.greedy(tab), H.best_homogeneous(tab, tab.sizes)[0], H.megatron_dcp(tab)):
        seen = sorted(i for mb in layout for g in mb for i in g.seqs)
        assert seen == list(range(len(lens)))
        for mb in layout:
            assert sum(g.size for g in mb) <= 8
            assert all(g.tokens <= tab.cap[g.size] for g in mb)


def test_homogeneous_plans_exist_for_sequences_each_needing_a_micro_batch():
    """140 sequences each over half the cluster's memory: every homogeneous plan needs 140
    micro-batches, twice the memory minimum (71). BatchAda and the homogeneous candidate find it."""
    cm = tiny_cost_model()
    lens = np.full(140, 201)
    tab = Tables(lens, cm)
    assert H.min_micro_batches(tab) == 71
    found = H.best_homogeneous(tab, tab.sizes)
    assert found is not None and found[1] == 4 and len(found[0]) == 140
    plan = plan_step(lens, cm, strategy="batchada")
    assert len(plan.micro_batches) == 140
    assert sorted(i for mb in plan.micro_batches for g in mb.groups for i in g.seqs) == list(range(140))
