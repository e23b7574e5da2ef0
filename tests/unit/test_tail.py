"""Re-planning a layout's tail (planner.tail): the slowest micro-batches kept, the others planned
again as a stuffed micro-batch and an even split; valid, never slower, stops at its deadline."""

import numpy as np

from megatron_flexsp.plan import validate_plan
from megatron_flexsp.planner import heuristics as H
from megatron_flexsp.planner.layout import Tables, to_step_plan
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.search import Deadline, base_range, level_grid
from megatron_flexsp.planner.shelves import ShelfPlanner
from megatron_flexsp.planner.tail import replan_tail
from tests.unit.test_packing import _batch, _paper_cluster


def _shelves(corpus: str, size: int, num_gpus: int):
    cm = _paper_cluster(num_gpus)
    tab = Tables(_batch(corpus, size, cm), cm)
    packer = LevelPacker(tab)
    lo, hi = base_range(packer, H.min_micro_batches(tab))
    layout = ShelfPlanner(packer).layout(np.arange(len(tab.lens)), level_grid(lo, hi, 8), "value", Deadline())
    return tab, packer, layout


def _seq_sets(mb):
    return sorted(tuple(sorted(g.seqs)) for g in mb)


def test_tail_after_the_slowest_micro_batch_is_stuffed_and_split_evenly():
    """A shelf layout of a lognormal step (mean 4K, 2,048 documents, 256 GPUs) runs its shelves at
    falling makespans, the last one mostly empty (about 4.15, 3.44, 2.47, 2.0, 1.92 and 0.93 s).
    With the slowest kept and the rest stuffed once and split evenly the step is over 1.5% faster;
    the kept micro-batch is untouched and the layout holds every sequence once, within memory."""
    tab, packer, layout = _shelves("lognormal-4k", 2048, 256)
    before = tab.step_ms(layout)
    slowest = max(layout, key=tab.mb_ms)
    kept = replan_tail(layout, packer, Deadline())
    after = tab.step_ms(layout)
    assert kept >= 1
    assert after < 0.985 * before
    assert _seq_sets(slowest) in [_seq_sets(mb) for mb in layout]
    assert sorted(i for mb in layout for g in mb for i in g.seqs) == list(range(len(tab.lens)))
    validate_plan(to_step_plan(layout, tab, strategy="flexsp", method="tail"))
    # the re-planned micro-batches after the stuffed one are within 2% of each other
    rest = sorted(tab.mb_ms(mb) for mb in layout)[:len(layout) - kept - 1]
    assert rest[-1] <= 1.02 * rest[0]


def test_replanning_never_slows_a_layout_and_stops_at_its_deadline():
    """Nothing changes past the deadline, nor where no re-planned tail is faster: a shelf layout of
    a lognormal step at 64 GPUs (mean 4K, 512 documents, seven micro-batches) whose tails
    re-planned are all slower."""
    tab, packer, layout = _shelves("lognormal-4k", 512, 64)
    sets = [_seq_sets(mb) for mb in layout]
    assert replan_tail(layout, packer, Deadline(0.0)) == 0
    assert [_seq_sets(mb) for mb in layout] == sets
    assert replan_tail(layout, packer, Deadline()) == 0
    assert [_seq_sets(mb) for mb in layout] == sets
