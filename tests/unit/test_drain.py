"""Shedding the slowest group's short sequences into other micro-batches' free memory
(:func:`~planner.drain.shed_slowest_groups`): kept only where the step gets faster, every sequence
still placed once, within memory."""

import numpy as np

from megatron_flexsp.plan import validate_plan
from megatron_flexsp.planner.drain import shed_slowest_groups
from megatron_flexsp.planner.layout import Group, Tables, to_step_plan
from tests.unit.helpers import tiny_cost_model

# a 150-token document and four of 10 on a group of 2 (cap 200), two memory-full single GPUs
# beside it; the second micro-batch's single GPUs hold 60 tokens each (cap 100)
LENS = [150, 10, 10, 10, 10, 100, 100, 60, 60, 60, 60]
FIRST = [(2, [0, 1, 2, 3, 4]), (1, [5]), (1, [6])]


def _layout(tab: Tables, micro_batches) -> list[list[Group]]:
    layout = []
    for mb in micro_batches:
        groups = []
        for size, items in mb:
            g = Group(size)
            for i in items:
                tab.add(g, i)
            groups.append(g)
        layout.append(groups)
    return layout


def _ms(tab: Tables, size: int, i: int) -> float:
    return float(tab.time[size][i])


def test_the_slowest_groups_short_sequences_move_where_memory_is_free():
    """The group of 2 finishes 1.98 ms after the single GPUs beside it (memory-full, nothing can
    join them); moving one 10-token document alone raises the second micro-batch by more than it
    saves (0.52 against 0.36 ms), so single moves stay put, but all four, one per single GPU of
    the second micro-batch, raise it once: 1.43 ms saved for 0.52."""
    tab = Tables(np.array(LENS), tiny_cost_model())
    layout = _layout(tab, [FIRST, [(1, [7]), (1, [8]), (1, [9]), (1, [10])]])
    assert _ms(tab, 1, 1) > _ms(tab, 2, 1)  # a single move costs more than it saves
    before = tab.step_ms(layout)
    assert shed_slowest_groups(layout, tab) == 1
    saved, raised = 4 * _ms(tab, 2, 1), _ms(tab, 1, 1)
    assert abs(tab.step_ms(layout) - (before - saved + raised)) < 1e-9
    assert [[g.seqs for g in mb] for mb in layout] == [[[0], [5], [6]], [[7, 1], [8, 2], [9, 3], [10, 4]]]
    assert sorted(i for mb in layout for g in mb for i in g.seqs) == list(range(len(LENS)))
    assert all(g.tokens <= tab.cap[g.size] for mb in layout for g in mb)
    validate_plan(to_step_plan(layout, tab, strategy="flexsp", method="shed"))


def test_moves_that_raise_the_step_more_than_they_save_are_undone():
    """With one GPU in the second micro-batch, the four documents all land on it: their raises
    (0.52 ms each) outgrow what leaving saves (0.36 ms each), and the layout stays as it was."""
    tab = Tables(np.array(LENS[:8]), tiny_cost_model())
    layout = _layout(tab, [FIRST, [(1, [7])]])
    before = [[list(g.seqs) for g in mb] for mb in layout]
    step = tab.step_ms(layout)
    assert shed_slowest_groups(layout, tab) == 0
    assert [[g.seqs for g in mb] for mb in layout] == before
    assert [[g.tokens for g in mb] for mb in layout] == [[190, 100, 100], [60]]
    assert abs(tab.step_ms(layout) - step) < 1e-9  # loads back up to rounding


def test_a_group_of_one_sequence_or_a_lone_slowest_group_is_left_alone():
    tab = Tables(np.array([150, 100, 100, 60]), tiny_cost_model())
    layout = _layout(tab, [[(2, [0]), (1, [1]), (1, [2])], [(1, [3])]])
    assert shed_slowest_groups(layout, tab) == 0
    assert [[g.seqs for g in mb] for mb in layout] == [[[0], [1], [2]], [[3]]]


def test_the_drain_never_ends_below_what_the_greedys_prune_allows():
    """``could_drain_below`` (where it says no, the search does not drain Megatron-DCP's greedy)
    is false only where even emptying the fastest micro-batches (as many as the tries and the
    memory minimum allow) could not reach the target. Checked against the drain itself on random
    batches: whatever step the drain reaches, it says could be reached, and it refuses a target
    at the emptied micro-batches' full saving."""
    from megatron_flexsp.planner import heuristics as H
    from megatron_flexsp.planner.drain import DRAIN_TRIES, could_drain_below, drain_micro_batches

    cm = tiny_cost_model(num_gpus=8, gpus_per_node=4, capacity_tokens=200)
    rng = np.random.default_rng(11)
    drained_some = 0
    for _ in range(60):
        lens = np.where(rng.random(70) < 0.2, rng.integers(300, 1500, 70), rng.integers(5, 200, 70))
        tab = Tables(lens, cm)
        layout = H.megatron_dcp(tab)
        tokens = int(lens.sum())
        before = tab.step_ms(layout)
        spans = sorted(tab.mb_ms(mb) for mb in layout)
        m_min = -(-tokens // (8 * 200))
        full_saving = sum(spans[:max(0, min(DRAIN_TRIES, len(layout) - m_min))])
        assert not could_drain_below(layout, tab, before - full_saving, DRAIN_TRIES)
        removed = drain_micro_batches(layout, tab, tries=DRAIN_TRIES)
        after = tab.step_ms(layout)
        drained_some += removed > 0
        assert could_drain_below(H.megatron_dcp(tab), tab, after + 1e-6, DRAIN_TRIES)
    assert drained_some >= 10
