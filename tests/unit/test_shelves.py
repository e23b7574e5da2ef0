"""Shelves (each micro-batch at a level of its own): valid plans, the candidate levels, and the case
they exist for -- long sequences that pack twice as densely on slower groups."""

import math

import numpy as np
import pytest

from megatron_flexsp.plan import validate_plan
from megatron_flexsp.planner.layout import Tables, to_step_plan
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.search import Deadline, common_level, level_grid
from megatron_flexsp.planner.shelves import SCORES, ShelfPlanner
from tests.unit.test_packing import _batch, _paper_cluster


def _grid(packer: LevelPacker, points: int = 8) -> list[float]:
    tab = packer.tab
    n = packer.n_gpus
    m_min = math.ceil(int(tab.lens.sum()) / (n * tab.cm.capacity_tokens))
    area = float(packer.gpu_time_min.sum())
    lo = packer.f_min + area / (n * (1.4 * m_min + 2))
    hi = max(float(packer.critical.max()), packer.f_min + area / (n * m_min)) * 1.25
    return level_grid(lo, hi, points)


@pytest.mark.parametrize("corpus,gpus", [("bimodal", 64), ("pareto-1.1", 256)])
def test_each_sequence_tries_the_sizes_holding_it_cheapest_first(corpus, gpus):
    cm = _paper_cluster(gpus)
    tab = Tables(_batch(corpus, 512, cm), cm)
    packer = LevelPacker(tab)
    assert tab.min_size.tolist() == [cm.min_group_size(int(n)) for n in tab.lens]
    for i in range(len(tab.lens)):
        holding = [d for d in tab.sizes if tab.lens[i] <= tab.cap[d]]
        cheapest = sorted(holding, key=lambda d: (d * tab.time[d][i], tab.sizes.index(d)))
        assert [tab.sizes[r] for r in packer.row_order[i]] == cheapest, i


@pytest.mark.parametrize("corpus,batch,gpus", [("bimodal", 256, 64), ("lognormal-4k", 512, 64),
                                               ("pareto-1.1", 512, 64)])
def test_shelf_layouts_are_valid_plans(corpus, batch, gpus):
    cm = _paper_cluster(gpus)
    tab = Tables(_batch(corpus, batch, cm), cm)
    packer = LevelPacker(tab)
    shelves = ShelfPlanner(packer)
    for score in SCORES:
        layout = shelves.layout(np.arange(len(tab.lens)), _grid(packer), score, Deadline())
        assert sorted(i for mb in layout for g in mb for i in g.seqs) == list(range(len(tab.lens)))
        for mb in layout:
            assert sum(g.size for g in mb) <= gpus
            assert all(g.tokens <= tab.cap[g.size] for g in mb)
        validate_plan(to_step_plan(layout, tab, strategy="flexsp", method="shelves"))
    with pytest.raises(ValueError, match="score='fastest'"):
        shelves.layout(np.arange(len(tab.lens)), _grid(packer), "fastest", Deadline())
    # past the deadline the rest is stuffed at the last level: still a valid plan
    late = shelves.layout(np.arange(len(tab.lens)), _grid(packer), "value", Deadline(0.0))
    validate_plan(to_step_plan(late, tab, strategy="flexsp", method="shelves"))


def test_candidate_levels():
    """A long sequence's finish time on each size is a candidate (just above it, so it fits); once
    no sequence left has half the base's work, only the bases next to the last level are tried."""
    cm = _paper_cluster(64)
    lens = np.array([100_000] + [1000] * 3000)
    tab = Tables(lens, cm)
    packer = LevelPacker(tab)
    shelves = ShelfPlanner(packer)
    bases = _grid(packer)
    levels = shelves.candidates(np.arange(len(lens)), bases)
    for r, d in enumerate(packer.sizes_l):
        t = float(packer.total[r, 0])
        if packer.ok[r, 0] and max(bases[0], packer.critical[0]) < t <= 3 * max(bases[0], packer.critical[0]):
            assert any(t < x <= t * (1 + 1e-8) for x in levels), d
    assert all(x >= packer.critical[0] for x in levels)
    shorts = np.arange(1, len(lens))
    everything = shelves.candidates(shorts, bases)
    k = everything.index(bases[4])
    assert shelves.candidates(shorts, bases, last=bases[4]) == everything[max(k - 4, 0):k + 5]
    assert len(everything) > 9


def test_shelves_stack_long_sequences_where_a_common_level_cannot():
    """Bimodal documents on 256 GPUs (2,048 per step, 19 of 160-196K tokens): at one common level the
    long ones run four to a micro-batch on groups of 64; shelves put eight per micro-batch on groups
    of 32 at a slower level, which the common levels never try: over 5% faster."""
    cm = _paper_cluster(256)
    tab = Tables(_batch("bimodal", 2048, cm), cm)
    packer = LevelPacker(tab)
    items = np.arange(len(tab.lens))
    grid = _grid(packer)
    common = min(tab.step_ms(lay) for lay in (common_level(packer, items, t, 40) for t in grid) if lay)
    shelves = ShelfPlanner(packer)
    best = min(tab.step_ms(shelves.layout(items, grid, s, Deadline())) for s in SCORES)
    assert best < 0.95 * common
    layout = shelves.layout(items, grid, "value", Deadline())
    first = layout[0]
    assert {g.size for g in first} == {32} and len(first) == 8


def test_a_late_layout_needing_many_micro_batches_is_given_up():
    cm = _paper_cluster(64)
    tab = Tables(_batch("lognormal-16k", 2048, cm), cm)  # about 90 micro-batches by memory
    packer = LevelPacker(tab)
    assert ShelfPlanner(packer).layout(np.arange(len(tab.lens)), _grid(packer), "value", Deadline(0.0)) is None


@pytest.mark.parametrize("corpus", ["pareto-1.3", "lognormal-4k"])
def test_balanced_split_loops_agree(corpus, monkeypatch):
    """The plain-Python loop of the balanced split makes the NumPy loop's choices: the same parts
    for a few to many micro-batches, each part within one micro-batch's memory."""
    from megatron_flexsp.planner import split

    cm = _paper_cluster(64)
    tab = Tables(_batch(corpus, 1024, cm), cm)
    weight = LevelPacker(tab).gpu_time_min
    items = np.arange(len(tab.lens))
    m_min = math.ceil(int(tab.lens.sum()) / (cm.capacity_tokens * cm.cluster.num_gpus))
    for m in (3, 6, 12, m_min, m_min + 1):  # at the memory minimum, parts fill to the token cap
        monkeypatch.setattr(split, "_SPLIT_LOOP_MAX", 64)
        plain = split.balanced_split(tab, items, m, weight)
        monkeypatch.setattr(split, "_SPLIT_LOOP_MAX", 0)
        vector = split.balanced_split(tab, items, m, weight)
        assert (plain is None) == (vector is None)
        if plain is None:
            continue
        assert [p.tolist() for p in plain] == [v.tolist() for v in vector]
        assert sorted(i for p in plain for i in p.tolist()) == items.tolist()
        assert all(int(tab.lens[p].sum()) <= cm.capacity_tokens * cm.cluster.num_gpus for p in plain)


def test_a_split_past_its_deadline_is_not_computed(monkeypatch):
    """Once the deadline has passed, ``split_pack`` returns None before splitting (the split of
    4,096 documents into 20 parts takes 0.1 s, which ran past the search's deadline for nothing)."""
    from megatron_flexsp.planner import split

    cm = _paper_cluster(64)
    tab = Tables(_batch("github", 512, cm), cm)
    packer = LevelPacker(tab)
    items = np.arange(len(tab.lens))
    assert split.split_pack(packer, items, 3, Deadline()) is not None

    def no_split(*args, **kwargs):
        raise AssertionError("split after the deadline")

    monkeypatch.setattr(split, "balanced_split", no_split)
    assert split.split_pack(packer, items, 3, Deadline(0.0)) is None


def test_a_split_says_whether_it_was_given_up_or_refused():
    """``split_pack_or_give_up`` tells a split given up at ``give_up_ms`` (the stuffed family then
    tries no further count: one more micro-batch never packed below the same mark on 34 such rests of
    twelve batches of six hard cells) from one memory refuses, which one more micro-batch may hold."""
    from megatron_flexsp.planner import split

    cm = _paper_cluster(64)
    tab = Tables(_batch("github", 512, cm), cm)
    packer = LevelPacker(tab)
    items = np.arange(len(tab.lens))
    layout, gave_up = split.split_pack_or_give_up(packer, items, 3, Deadline())
    assert layout is not None and not gave_up
    ms = tab.step_ms(layout)
    assert split.split_pack_or_give_up(packer, items, 3, Deadline(), give_up_ms=0.5 * ms) == (None, True)
    assert split.split_pack_or_give_up(packer, items, 3, Deadline(0.0), give_up_ms=0.5 * ms) == (None, False)
    m_min = -(-int(tab.lens.sum()) // (cm.capacity_tokens * cm.cluster.num_gpus))
    assert m_min >= 2
    # below the memory minimum no split holds the tokens: refused, not given up
    assert split.split_pack_or_give_up(packer, items, m_min - 1, Deadline(), give_up_ms=0.5 * ms) == (None, False)
    assert split.split_pack_or_give_up(packer, items, 3, Deadline(), give_up_ms=2 * ms)[0] is not None
