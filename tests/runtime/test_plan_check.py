import pytest

pytest.importorskip("torch")

from megatron_flexsp.plan import GroupPlan, MicroBatchPlan, StepPlan  # noqa: E402
from megatron_flexsp.runtime.plan_check import check_plan  # noqa: E402
from megatron_flexsp.topology import ClusterSpec, all_group_blocks  # noqa: E402


class FakePool:
    def __init__(self, cluster, sizes):
        self.cluster = cluster
        self.blocks = set(all_group_blocks(cluster, sizes))

    def __contains__(self, ranks):
        return tuple(ranks) in self.blocks


def _plan(groups, n=4, gpn=2, lens=(5, 6, 7)):
    mb = MicroBatchPlan(tuple(GroupPlan(r, s, 1.0) for r, s in groups))
    return StepPlan(num_gpus=n, gpus_per_node=gpn, seq_lens=lens, micro_batches=(mb,),
                    strategy="flexsp", method="hand", predicted_step_ms=1.0)


def test_good_plan_passes_and_bad_plans_raise():
    pool = FakePool(ClusterSpec(4, 2), [1, 2])
    check_plan(_plan([((0, 1), (0, 1)), ((2,), (2,))]), pool, num_heads=4, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"group \[0, 1, 2, 3\] is not in the group pool"):
        check_plan(_plan([((0, 1, 2, 3), (0, 1, 2))]), pool, num_heads=4, num_kv_heads=4)
    with pytest.raises(ValueError, match="does not divide num_kv_heads=1"):
        check_plan(_plan([((0, 1), (0, 1, 2))]), pool, num_heads=4, num_kv_heads=1)
    check_plan(_plan([((0, 1), (0, 1, 2))]), pool, num_heads=4, num_kv_heads=1, kv_replication=True)
    with pytest.raises(ValueError, match="does not divide num_heads=3"):
        check_plan(_plan([((0, 1), (0, 1, 2))]), pool, num_heads=3, num_kv_heads=3)
    with pytest.raises(ValueError, match="plan is for 8 GPUs"):
        check_plan(_plan([((0,), (0, 1, 2))], n=8), pool, num_heads=4, num_kv_heads=4)
    with pytest.raises(ValueError, match="scheduled 0 times"):
        check_plan(_plan([((0,), (0, 1))]), pool, num_heads=4, num_kv_heads=4)
