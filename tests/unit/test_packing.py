"""Memory packing: the groups-first and LP-rounded layouts are valid plans, the dual-feasible
functions are valid, and the slot bound never exceeds the brute-force optimum (tiny instances, 1 to
6 micro-batches)."""

import itertools
import math

import numpy as np
import pytest

from megatron_flexsp.config import PlannerConfig
from megatron_flexsp.plan import validate_plan
from megatron_flexsp.planner import plan_step
from megatron_flexsp.planner.groups_first import bin_sizes, groups_first, opening_sizes, pack_at_sizes, place_by_time
from megatron_flexsp.planner.drain import drain_micro_batches
from megatron_flexsp.planner.layout import Group, Tables, to_step_plan
from megatron_flexsp.planner.slot_bound import _round_sizes, dff, slot_bound, solve_slot_lp
from megatron_flexsp.sim.corpora import synthetic_lengths
from megatron_flexsp.sim.workloads import sample_batches
from tests.unit.helpers import tiny_cost_model
from tests.unit.test_level_bound import many_micro_batch_instance
from tests.unit.test_planner import small_instance


def _paper_cluster(num_gpus=64):
    from megatron_flexsp.cost_model import CostModel, load_profile
    from megatron_flexsp.model_spec import get_model

    return CostModel.from_profile(load_profile("a100-paper"), get_model("gpt-7b"), num_gpus=num_gpus,
                                  max_seq_len=196608)


def _batch(corpus, size, cm):
    b = sample_batches(synthetic_lengths(corpus, seed=1), global_batch=size, num_batches=1, seed=0,
                       max_seq_len=196608)[0][0]
    return np.minimum(b, cm.max_tokens)


def test_dual_feasible_functions_never_sum_above_one_in_a_full_group():
    """Every multiset of lengths that fits ``cap`` has sum u_k <= 1 (exhaustive on a small cap)."""
    cap, most = 60, 5

    def fitting(smallest, room, r):  # multisets of r lengths >= smallest summing to at most room
        if r == 0:
            yield ()
            return
        for x in range(smallest, room // r + 1):
            for rest in fitting(x, room - x, r - 1):
                yield (x,) + rest

    for r in range(1, most + 1):
        combos = np.array(list(fitting(1, cap, r)), dtype=np.int64)
        # every multiset of r lengths that fits, none twice: as many as the brute-force filter keeps
        if r <= 3:
            assert len(combos) == sum(1 for c in itertools.combinations_with_replacement(range(1, cap + 1), r)
                                      if sum(c) <= cap)
        for k in range(1, 9):
            sums = dff(combos.ravel(), cap, k).reshape(combos.shape).sum(axis=1)
            worst = int(sums.argmax())
            assert sums[worst] <= 1 + 1e-12, (k, combos[worst].tolist())
    # and u_1 counts what is over half: two such lengths never share
    assert dff(np.array([31, 30, 29]), cap, 1).tolist() == [1.0, 0.5, 0.0]


@pytest.mark.parametrize("seed", range(8))
def test_slot_bound_is_below_the_optimum(seed):
    for cm, lens, opt in (small_instance(seed), many_micro_batch_instance(seed % 6)):
        tab = Tables(np.asarray(lens), cm)
        assert slot_bound(tab) <= opt * (1 + 1e-6), (lens, opt)
        assert slot_bound(tab, orders=1, max_single=0) <= opt * (1 + 1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_slot_bound_per_count_is_below_each_counts_optimum(seed):
    """With the count fixed the slot LP bounds plans of exactly that many micro-batches, and past
    its optimum count every larger count too (the LP value is convex in the count)."""
    from megatron_flexsp.planner.heuristics import min_micro_batches
    from tests.unit.test_planner import brute_force_step_ms

    cm, lens, _ = many_micro_batch_instance(seed)
    tab = Tables(np.asarray(lens), cm)
    m_min = min_micro_batches(tab)
    counts = tuple(range(m_min, min(m_min + 3, len(lens)) + 1))
    slot = solve_slot_lp(tab, counts=counts)
    per = {m: brute_force_step_ms(tuple(int(x) for x in lens), cm, count=m) for m in range(1, len(lens) + 1)}
    for m in counts:
        assert slot.by_count[m] <= per[m] * (1 + 1e-6), (m, slot.by_count[m], per[m])
        assert slot.at_least(m) <= min(per[k] for k in per if k >= m) * (1 + 1e-6)
        assert slot.by_count[m] >= slot.bound_ms * (1 - 1e-9)  # convex in the count: least at slot.m


def test_slot_bound_sees_memory_that_fluid_tokens_miss():
    """Three sequences of 210 tokens on 4 GPUs of 100: fluid memory fits them in two micro-batches
    (630 <= 800 tokens), but each needs all 4 GPUs alone (two do not fit 400), so three are needed;
    the slot bound charges the third micro-batch's fixed cost."""
    cm = tiny_cost_model()
    tab = Tables(np.array([210, 210, 210]), cm)
    f = min(tab.fixed.values())
    area = tab.area_min_ms() / cm.cluster.num_gpus
    assert slot_bound(tab, orders=1) >= 3 * f + area - 1e-9
    from tests.unit.test_planner import brute_force_step_ms

    assert slot_bound(tab) <= brute_force_step_ms((210, 210, 210), cm) * (1 + 1e-9)


@pytest.mark.parametrize("corpus,batch", [("lognormal-16k", 256), ("github", 512), ("bimodal", 128)])
def test_groups_first_layouts_are_valid_plans(corpus, batch):
    cm = _paper_cluster()
    b = _batch(corpus, batch, cm)
    tab = Tables(b, cm)
    assert bin_sizes(tab) == [1, 2, 4, 8]
    for bin_size in bin_sizes(tab):
        layout = groups_first(tab, bin_size)
        assert sorted(i for mb in layout for g in mb for i in g.seqs) == list(range(len(b)))
        for mb in layout:
            assert sum(g.size for g in mb) <= 64
            for g in mb:
                assert g.tokens <= tab.cap[g.size]
                # shrunk: the next smaller size would not hold the group's tokens
                smaller = [d for d in tab.sizes if d < g.size]
                assert not smaller or g.tokens > tab.cap[max(smaller)]
        validate_plan(to_step_plan(layout, tab, strategy="flexsp", method="groups-first"))
    with pytest.raises(ValueError, match="bin_size=3"):
        groups_first(tab, 3)


@pytest.mark.parametrize("corpus,batch", [("pareto-1.1", 512), ("github", 512), ("bimodal", 256)])
def test_opening_sizes_decide_the_groups_first_layout(corpus, batch):
    """The size a sequence's group opens at, against a per-sequence reference: its bin when that
    holds it, else its smallest size; when too slow there under the level, the larger size with the
    least GPU-time finishing within it (the largest when none does). Equal opening sizes give the
    same layout, which is what lets the search pack each distinct one once."""
    cm = _paper_cluster()
    tab = Tables(_batch(corpus, batch, cm), cm)
    items = np.argsort(-tab.lens, kind="stable")
    crit = float(tab.critical_ms().max())
    by_key = {}
    for level in (math.inf, crit, 1.5 * crit, 3 * crit):
        for bin_size in bin_sizes(tab)[:2]:
            got = opening_sizes(tab, bin_size, level, items)
            for k, i in enumerate(items.tolist()):
                d = bin_size if tab.lens[i] <= tab.cap[bin_size] else int(tab.min_size[i])
                if tab.fixed[d] + tab.time[d][i] > level:
                    fast = [x for x in tab.sizes if x > d and tab.fixed[x] + tab.time[x][i] <= level]
                    d = min(fast, key=lambda x: x * tab.time[x][i]) if fast else max(tab.sizes)
                assert got[k] == d, (level, bin_size, int(tab.lens[i]))
            layout = [[(g.size, tuple(g.seqs)) for g in mb] for mb in groups_first(tab, bin_size, level)]
            assert by_key.setdefault(got.tobytes(), layout) == layout
    assert 1 < len(by_key) < 8  # some levels change the opening sizes, some do not


def test_lp_rounding_follows_the_shares():
    """A single takes its largest share; a bucket's members, shortest first, fill the sizes,
    smallest first, in proportion to tokens; nothing goes below its smallest size."""
    tab = Tables(np.array([500, 10, 20, 30, 40]), tiny_cost_model())
    order, starts = np.array([0, 4, 2, 1, 3]), np.array([0, 1])  # unit 0: seq 0; unit 1: the rest
    sizes = _round_sizes(tab, order, starts, [(0, 2, 0.4), (0, 4, 0.6), (1, 1, 0.3), (1, 2, 0.7)])
    # bucket tokens by length 10, 20, 30, 40: cumulative 0.1, 0.3, 0.6, 1.0 -> sizes 1, 1, 2, 2
    assert sizes[1:].tolist() == [1, 1, 2, 2]
    assert sizes[0] == max(4, tab.min_size[0])


@pytest.mark.parametrize("corpus,batch", [("lognormal-16k", 512), ("github", 512), ("bimodal", 128)])
def test_lp_rounded_layouts_are_valid_plans(corpus, batch):
    cm = _paper_cluster()
    tab = Tables(_batch(corpus, batch, cm), cm)
    slot = solve_slot_lp(tab)
    assert slot.bound_ms == slot_bound(tab)
    assert set(slot.sizes.tolist()) <= set(tab.sizes) and (slot.sizes >= tab.min_size).all()
    layout = pack_at_sizes(tab, slot.sizes)
    assert sorted(i for mb in layout for g in mb for i in g.seqs) == list(range(len(tab.lens)))
    for mb in layout:
        assert sum(g.size for g in mb) <= 64
        for g in mb:
            assert g.tokens <= tab.cap[g.size]
            assert all(g.size <= slot.sizes[i] for i in g.seqs)  # shrunk, never grown
    validate_plan(to_step_plan(layout, tab, strategy="flexsp", method="lp-rounded"))
    assert tab.step_ms(layout) >= slot.bound_ms
    with pytest.raises(ValueError, match="one allowed group size"):
        pack_at_sizes(tab, np.full(len(tab.lens), 3))


def test_lp_rounding_beats_groups_first_where_memory_binds():
    """lognormal mean 16K at 64 GPUs: memory sets the micro-batch count; the LP's sizes put short
    sequences into the memory long ones leave in large groups, which groups first never does (they
    are beyond one node); drained alike, the rounded LP is faster by over half a percent."""
    cm = _paper_cluster()
    tab = Tables(_batch("lognormal-16k", 1024, cm), cm)
    rounded = pack_at_sizes(tab, solve_slot_lp(tab).sizes)
    drain_micro_batches(rounded, tab, tries=8)
    best_gf = math.inf
    for d in bin_sizes(tab)[:2]:
        layout = groups_first(tab, d)
        drain_micro_batches(layout, tab, tries=8)
        best_gf = min(best_gf, tab.step_ms(layout))
    assert tab.step_ms(rounded) < 0.995 * best_gf


def test_place_by_time_opens_a_micro_batch_only_when_the_others_are_full():
    cm = tiny_cost_model()
    tab = Tables(np.array([90, 80, 70, 60, 50, 40]), cm)
    groups = []
    for i in range(6):
        g = Group(1)
        tab.add(g, i)
        groups.append(g)
    layout = place_by_time(tab, groups)
    assert [[g.seqs[0] for g in mb] for mb in layout] == [[0, 1, 2, 3], [4, 5]]


def test_flexsp_uses_groups_first_where_memory_binds():
    """On a memory-bound batch (lognormal mean 16K, 64 GPUs) the planner's plan is at least as fast
    as the groups-first layouts and well below the DCP baseline."""
    cm = _paper_cluster()
    b = _batch("lognormal-16k", 512, cm)
    plan = plan_step(b, cm, config=PlannerConfig(over_length="truncate"), max_seq_len=196608)
    validate_plan(plan)
    tab = Tables(b, cm)
    best_gf = min(tab.step_ms(groups_first(tab, d)) for d in bin_sizes(tab))
    assert plan.predicted_step_ms <= best_gf * (1 + 1e-9)
    dcp = plan_step(b, cm, strategy="megatron-dcp", max_seq_len=196608)
    assert plan.predicted_step_ms < 0.97 * dcp.predicted_step_ms
    assert plan.info["slot_bound_ms"] <= plan.predicted_step_ms


def _single_groups(tab, items_per_mb):
    layout = []
    for mb in items_per_mb:
        groups = []
        for items in mb:
            g = Group(1)
            for i in items:
                tab.add(g, i)
            groups.append(g)
        layout.append(groups)
    return layout


def test_drain_empties_a_short_micro_batch_into_free_memory():
    from megatron_flexsp.planner.drain import drain_micro_batches

    cm = tiny_cost_model()
    tab = Tables(np.array([50, 50, 50, 50, 30]), cm)
    layout = _single_groups(tab, [[[0], [1], [2], [3]], [[4]]])
    before = tab.step_ms(layout)
    assert drain_micro_batches(layout, tab) == 1
    assert len(layout) == 1 and tab.step_ms(layout) < before
    assert sorted(i for g in layout[0] for i in g.seqs) == [0, 1, 2, 3, 4]
    assert all(g.tokens <= tab.cap[g.size] for g in layout[0])
    # with no free memory nothing moves, and the layout is left exactly as it was
    tab = Tables(np.array([100, 100, 100, 100, 30]), cm)
    layout = _single_groups(tab, [[[0], [1], [2], [3]], [[4]]])
    assert drain_micro_batches(layout, tab) == 0
    assert [[g.seqs for g in mb] for mb in layout] == [[[0], [1], [2], [3]], [[4]]]
    assert [[g.tokens for g in mb] for mb in layout] == [[100] * 4, [30]]


def _drain_reference(layout, tab, v):
    """Emptying micro-batch ``v`` as :func:`drain_micro_batches` defines it, by brute force: each
    sequence, longest first, to the group of another micro-batch with memory room that raises that
    micro-batch's makespan least (then finishes first, then was made first); kept when the raises
    sum to less than ``v``'s makespan. Returns the moves (sequence, group uid), or None."""
    spans = [tab.mb_ms(mb) for mb in layout]
    level = list(spans)
    load = {g.uid: (g.load_ms, g.tokens) for j, mb in enumerate(layout) if j != v for g in mb}
    where = {g.uid: (j, g) for j, mb in enumerate(layout) if j != v for g in mb}
    items = sorted((i for g in layout[v] for i in g.seqs), key=lambda i: (-int(tab.lens[i]), i))
    moves, raised = [], 0.0
    for i in items:
        options = []
        for uid, (j, g) in where.items():
            ms, tokens = load[uid]
            if tokens + tab.lens[i] <= tab.cap[g.size]:
                t = tab.fixed[g.size] + ms + float(tab.time[g.size][i])
                options.append((max(0.0, t - level[j]), t, uid))
        if not options:
            return None
        rise, t, uid = min(options)
        if raised + rise >= spans[v]:
            return None
        j, g = where[uid]
        load[uid] = (load[uid][0] + float(tab.time[g.size][i]), load[uid][1] + int(tab.lens[i]))
        raised += rise
        level[j] = max(level[j], t)
        moves.append((i, uid))
    return moves


def test_drain_moves_each_sequence_where_it_raises_a_makespan_least():
    """On random layouts (groups of 1, 2 and 4 GPUs) a micro-batch is emptied exactly when, and
    exactly as, the brute-force rule says: the drain probes only the classes whose least load
    could still beat the best found, which must not change a single choice."""
    from megatron_flexsp.planner.drain import _drain

    rng = np.random.default_rng(7)
    cm = tiny_cost_model(num_gpus=16, gpus_per_node=4, capacity_tokens=100, overhead_ms=20.0)
    emptied = kept = 0
    for _ in range(80):
        lens = rng.integers(5, 90, size=int(rng.integers(12, 40)))  # any one fits a single GPU
        tab = Tables(lens, cm)
        layout, pos = [], 0
        while pos < len(lens):
            mb, free = [], 16
            while free and pos < len(lens):
                g = Group(int(rng.choice([d for d in (1, 2, 4) if d <= free])))
                tab.add(g, pos)
                pos += 1
                while pos < len(lens) and tab.fits(g, pos) and rng.random() < 0.7:
                    tab.add(g, pos)
                    pos += 1
                mb.append(g)
                free -= g.size
            layout.append(mb)
        if len(layout) < 2:
            continue
        v = int(rng.integers(len(layout)))
        spans = [tab.mb_ms(mb) for mb in layout]
        free = [sum(int(tab.cap[g.size]) - g.tokens for g in mb) for mb in layout]
        want = _drain_reference(layout, tab, v)
        uids = {g.uid: g for mb in layout for g in mb}
        before = [[list(g.seqs) for g in mb] for mb in layout]
        assert _drain(layout, tab, v, spans, free, None) == (want is not None)
        if want is None:
            assert [[list(g.seqs) for g in mb] for mb in layout] == before
            kept += 1
            continue
        emptied += 1
        for i, uid in want:
            assert i in uids[uid].seqs
    assert emptied >= 10 and kept >= 10


def test_drain_keeps_a_micro_batch_whose_moves_would_cost_more_than_it():
    """Five 40-token sequences: moving the fifth onto a loaded GPU of the first micro-batch raises
    it by more than the second micro-batch costs only if the fixed cost is small; with no fixed
    cost, draining gains nothing and must not happen."""
    from megatron_flexsp.planner.drain import drain_micro_batches

    cm = tiny_cost_model(overhead_ms=0.0)
    tab = Tables(np.array([40, 40, 40, 40, 40]), cm)
    layout = _single_groups(tab, [[[0], [1], [2], [3]], [[4]]])
    before = tab.step_ms(layout)
    assert drain_micro_batches(layout, tab) == 0
    assert len(layout) == 2 and tab.step_ms(layout) == before


def test_best_fit_packs_one_micro_batch_validly_and_fills_groups_the_level_families_spread():
    """One micro-batch packed best fit: every sequence once, memory and GPUs respected, and no
    group past the makespan. 64 documents of about 8K tokens on 256 H200 GPUs (GPT-7B): best fit
    into groups of one node beats the level families' stuffing (least-loaded groups of each
    sequence's cheapest size) and the common level by several percent."""
    import math

    from megatron_flexsp.cost_model import CostModel, load_profile
    from megatron_flexsp.model_spec import get_model
    from megatron_flexsp.planner.best_fit import best_fit_micro_batch
    from megatron_flexsp.planner.level import LevelPacker
    from megatron_flexsp.planner.search import Deadline, common_level

    cm = tiny_cost_model(num_gpus=8, gpus_per_node=4)
    rng = np.random.default_rng(3)
    for _ in range(20):
        lens = rng.integers(5, 150, size=int(rng.integers(2, 12)))
        if lens.sum() > 8 * cm.capacity_tokens:
            continue
        tab = Tables(lens, cm)
        mb = best_fit_micro_batch(tab, np.arange(len(lens)), Deadline(), math.inf)
        assert mb is not None
        validate_plan(to_step_plan([mb], tab, strategy="flexsp", method="best-fit"))
        assert sorted(i for g in mb for i in g.seqs) == list(range(len(lens)))
        assert sum(g.size for g in mb) <= 8 and all(g.tokens <= tab.cap[g.size] for g in mb)
    h200 = CostModel.from_profile(load_profile("h200-estimate"), get_model("gpt-7b"), num_gpus=256,
                                  max_seq_len=196608)
    lens = np.maximum(np.random.default_rng(0).lognormal(np.log(8192) - 0.125, 0.5, 64), 1).astype(np.int64)
    tab = Tables(lens, h200)
    items = np.arange(len(lens))
    mb = best_fit_micro_batch(tab, items, Deadline(), math.inf)
    packer = LevelPacker(tab)
    level = min(tab.step_ms(lay) for t in np.geomspace(tab.critical_ms().max(), 2000, 40)
                if (lay := common_level(packer, items, float(t), 1)) is not None)
    assert tab.mb_ms(mb) < 0.96 * level


def test_group_index_passes_over_full_classes_and_sees_room_freed_later():
    """``GroupIndex.best_fit`` skips a class whose groups have no room without probing them, finds
    room a removal frees once the group is touched, and agrees with a scan of every group (the
    least-loaded group with room, or none) across random adds and removals."""
    from megatron_flexsp.planner.layout import Group, GroupIndex

    cm = _paper_cluster(16)
    rng = np.random.default_rng(0)
    lens = rng.integers(200, 9_000, 400)
    tab = Tables(lens, cm)
    groups = [Group(d) for d in (1, 1, 1, 2, 2, 4)]
    index = GroupIndex(tab)
    for k, g in enumerate(groups):
        index.add(k % 2, g)
    placed: dict[int, Group] = {}
    for step in range(3_000):
        i = int(rng.integers(len(lens)))
        if i in placed and rng.random() < 0.5:
            g = placed.pop(i)
            tab.remove(g, i)
            index.touch(g)
            continue
        if i in placed:
            continue
        for key in sorted(index.classes()):
            live = [g for g in groups if (groups.index(g) % 2, g.size) == key and tab.fits(g, i)]
            want = min(live, key=lambda g: (g.load_ms, g.uid)) if live else None
            got = index.best_fit(key, i)
            assert (got is None) == (want is None), (step, key)
            if got is not None:
                assert tab.fits(got, i) and got.load_ms == want.load_ms
        key = sorted(index.classes())[step % len(index.classes())]
        g = index.best_fit(key, i)
        if g is not None:
            tab.add(g, i)
            index.touch(g)
            placed[i] = g
    assert len(placed) > 20
