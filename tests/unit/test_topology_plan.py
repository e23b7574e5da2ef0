import itertools
import random

import pytest

from megatron_flexsp.plan import GroupPlan, MicroBatchPlan, StepPlan, validate_plan
from megatron_flexsp.topology import (ClusterSpec, all_group_blocks, candidate_group_sizes,
                                      check_group_size, is_node_aligned, place_groups)


def test_placement_is_node_aligned_over_a_sweep():
    rng = random.Random(0)
    for n_nodes, gpn in itertools.product([1, 2, 3, 8, 16], [1, 2, 4, 8]):
        cluster = ClusterSpec(n_nodes * gpn, gpn)
        sizes_all = candidate_group_sizes(cluster, num_heads=1024, num_kv_heads=1024)
        for _ in range(30):
            sizes, free = [], cluster.num_gpus
            while free:
                d = rng.choice([s for s in sizes_all if s <= free and free % s == 0] or [1])
                sizes.append(d)
                free -= d
            ranks = place_groups(sizes, cluster)
            flat = sorted(r for g in ranks for r in g)
            assert flat == list(range(cluster.num_gpus))
            assert all(is_node_aligned(g, cluster) for g in ranks)
            assert [len(g) for g in ranks] == sizes


def test_candidate_sizes_respect_heads_and_nodes():
    c = ClusterSpec(64, 8)
    assert candidate_group_sizes(c, num_heads=64, num_kv_heads=64) == [1, 2, 4, 8, 16, 32, 64]
    assert candidate_group_sizes(c, num_heads=32, num_kv_heads=8) == [1, 2, 4, 8]
    assert candidate_group_sizes(c, num_heads=32, num_kv_heads=8,
                                 allow_kv_replication=True) == [1, 2, 4, 8, 16, 32]
    assert candidate_group_sizes(ClusterSpec(24, 8), num_heads=64, num_kv_heads=64) == [1, 2, 4, 8]
    blocks = all_group_blocks(c, [1, 16])
    assert len(blocks) == 64 + 4 and blocks[64] == tuple(range(16))


def test_bad_cluster_and_group_sizes():
    with pytest.raises(ValueError, match="num_gpus=12 is not a multiple of gpus_per_node=8"):
        ClusterSpec(12, 8)
    with pytest.raises(ValueError, match="gpus_per_node=6"):
        ClusterSpec(12, 6)
    c = ClusterSpec(64, 8)
    with pytest.raises(ValueError, match="does not divide num_heads=32"):
        check_group_size(64, c, num_heads=32, num_kv_heads=32)
    with pytest.raises(ValueError, match="num_kv_heads=8"):
        check_group_size(16, c, num_heads=32, num_kv_heads=8)
    with pytest.raises(ValueError, match="need 72 GPUs"):
        place_groups([64, 8], c)
    assert not is_node_aligned((4, 5, 6, 7, 8, 9, 10, 11), c)
    assert not is_node_aligned((2, 3, 4, 5), c)


def _plan(mbs, lens=(5, 6, 7), dropped=()):
    return StepPlan(num_gpus=4, gpus_per_node=2, seq_lens=lens,
                    micro_batches=tuple(MicroBatchPlan(tuple(GroupPlan(r, s, 1.0) for r, s in mb))
                                        for mb in mbs),
                    strategy="flexsp", method="test", predicted_step_ms=2.0, lower_bound_ms=1.5,
                    dropped=dropped)


def test_plan_json_round_trip():
    p = _plan([[((0, 1), (0, 2)), ((2,), ()), ((3,), (1,))]])
    q = StepPlan.from_json(p.to_json())
    assert q == p
    assert p.to_dict()["gap"] == pytest.approx(2.0 / 1.5 - 1)
    assert p.to_dict()["micro_batches"][0]["predicted_ms"] == 1.0
    with pytest.raises(ValueError, match="version 7"):
        StepPlan.from_dict({**p.to_dict(), "version": 7})


@pytest.mark.parametrize("mbs, dropped, message", [
    ([[((0, 1), (0, 1))]], (), "sequence 2 .* scheduled 0 times"),
    ([[((0, 1), (0, 1, 2)), ((1, 2), ())]], (), "not node-aligned"),
    ([[((0, 1), (0, 1, 2)), ((1,), ())]], (), r"rank\(s\) \[1\] are in two groups"),
    ([[((0,), (0, 1, 2))], [((0,), (2,))]], (), "scheduled 2 times"),
    ([[((0,), (0, 1, 2))]], (2,), "dropped but scheduled"),
    ([[((0,), (0, 1, 9))]], (), "index 9 outside"),
])
def test_validate_plan_rejects(mbs, dropped, message):
    with pytest.raises(ValueError, match=message):
        validate_plan(_plan(mbs, dropped=dropped))
