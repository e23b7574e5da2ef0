"""Re-packing a micro-batch with its longest sequences opened first (planner.reseed): valid,
never slower, and faster where the level packer leaves long sequences on full small groups."""

import numpy as np

from megatron_flexsp.plan import validate_plan
from megatron_flexsp.planner.layout import Tables, to_step_plan
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.reseed import reseed, reseed_micro_batches
from megatron_flexsp.planner.search import Deadline, common_level
from tests.unit.test_packing import _batch, _paper_cluster


def _memory_bound_micro_batch(cm):
    """Six documents of 18.6-21.1K tokens, twenty of 9.6-12.8K and short ones up to 99% of one
    micro-batch's memory at 64 GPUs (a lognormal step's third micro-batch, rebuilt)."""
    rng = np.random.default_rng(0)
    lens = [20975, 21122, 20564, 18932, 18923, 18605,
            12782, 12584, 11993, 11884, 11161, 10859, 10805, 10567, 10527, 10444, 10401, 10140, 10075,
            10046, 9960, 9948, 9810, 9599, 9556, 9636]
    room = 0.99 * cm.capacity_tokens * cm.cluster.num_gpus
    while sum(lens) + 2500 < room:
        lens.append(int(rng.integers(100, 2500)))
    return np.array(lens)


def test_long_sequences_opened_on_larger_groups_beat_the_level_packer():
    """The level packer puts each 20K document on the cheapest group that holds it (4 GPUs), full
    to the token, and the 10-12K ones on groups of 2: 2,374 ms. Opened first on groups of 8, the
    long ones have the medium ones beside them: over 3% faster. The packing holds every sequence
    once, within each group's memory, on at most N GPUs, and finishes within its makespan."""
    cm = _paper_cluster(64)
    lens = _memory_bound_micro_batch(cm)
    tab = Tables(lens, cm)
    packer = LevelPacker(tab)
    items = np.arange(len(lens))
    level, groups = packer.min_level(items)
    before = tab.mb_ms(groups)
    found = reseed(packer, items, before)
    assert found is not None
    ms, seeded = found
    assert ms == tab.mb_ms(seeded) < 0.97 * before
    assert sorted(i for g in seeded for i in g.seqs) == items.tolist()
    assert sum(g.size for g in seeded) <= cm.cluster.num_gpus
    assert all(g.tokens == lens[g.seqs].sum() <= tab.cap[g.size] for g in seeded)
    cheapest = {int(i): min((d for d in tab.sizes if lens[i] <= tab.cap[d]),
                            key=lambda d: d * tab.time[d][i]) for i in range(6)}
    assert any(g.size > cheapest[i] for g in seeded for i in g.seqs if i < 6)
    # nothing below the level found, with the same seeds or any others tried
    assert reseed(packer, items, ms) is None


def test_reseeding_a_layout_never_slows_it_and_stops_at_its_deadline():
    """A common-level layout of a lognormal step (mean 4K, 512 documents, 64 GPUs): some of its
    micro-batches get faster (18.4 s became 17.4 s), none slower, every sequence stays once."""
    cm = _paper_cluster(64)
    tab = Tables(_batch("lognormal-4k", 512, cm), cm)
    packer = LevelPacker(tab)
    layout = common_level(packer, np.arange(len(tab.lens)), float(packer.critical.max()), 200)
    before = [tab.mb_ms(mb) for mb in layout]
    better = reseed_micro_batches(layout, packer, Deadline())
    after = [tab.mb_ms(mb) for mb in layout]
    assert all(a <= b for a, b in zip(after, before))
    assert better == sum(a < b for a, b in zip(after, before)) >= 1
    assert sorted(i for mb in layout for g in mb for i in g.seqs) == list(range(len(tab.lens)))
    validate_plan(to_step_plan(layout, tab, strategy="flexsp", method="reseeded"))
    assert reseed_micro_batches(layout, packer, Deadline(0.0)) == 0
