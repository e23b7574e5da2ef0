"""The LP bound's strengthened rows and the plans rounded from its relaxation (planner.guided)."""

import itertools
import math

import numpy as np
import pytest

from megatron_flexsp.planner.bound import lp_step_bound
from megatron_flexsp.planner.guided import _open_groups, guided_candidates, guided_layout
from megatron_flexsp.planner.layout import Group, Tables, to_step_plan
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.search import base_range, level_grid, search_step, Deadline
from megatron_flexsp.planner.heuristics import min_micro_batches
from megatron_flexsp.planner.bound import bound_units
from megatron_flexsp.planner.count_rows import _groups_needed, time_dff
from megatron_flexsp.planner.step_lp import Hint, _StepLP
from megatron_flexsp.plan import validate_plan
from megatron_flexsp.sim import simulate
from tests.unit.helpers import tiny_cost_model


def test_group_coefficients_never_sum_above_one_in_a_group():
    """Every set of works that fits one group's room has coefficients summing to at most 1
    (exhaustive over subsets), so the group count is at least their sum; a slow work counts 1 and
    a work that cannot join the lightest slow one counts its share of the room."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        room = float(rng.uniform(50, 150))
        work = rng.uniform(1, 1.2 * room, size=int(rng.integers(2, 9)))
        heavy = 2.0 * work > room
        coef = _groups_needed(work, room, heavy)
        assert np.all(coef[heavy] == 1.0)
        for r in range(1, len(work) + 1):
            for combo in itertools.combinations(range(len(work)), r):
                if work[list(combo)].sum() <= room:
                    assert coef[list(combo)].sum() <= 1 + 1e-9, (room, work[list(combo)], coef[list(combo)])
    # four slow works of 49 and two of 38 and 35 in a room of 75: neither of these fits beside a
    # slow one, so four groups are not enough
    work = np.array([49.0] * 4 + [38.0, 35.0])
    coef = _groups_needed(work, 75.0, 2 * work > 75.0)
    assert coef.sum() > 4.9


def test_time_dff_never_sums_above_one_in_a_group():
    """For k = 2, 3, 4, every set of works that fits one group's time has values summing to at
    most 1 (exhaustive over subsets), and k + 1 works just over 1 / (k + 1) of it (which do not
    fit together) sum above 1: k of them fill the group."""
    rng = np.random.default_rng(1)
    for k in (2, 3, 4):
        for _ in range(200):
            room = float(rng.uniform(50, 150))
            work = rng.uniform(0.05 * room, 0.7 * room, size=int(rng.integers(2, 9)))
            val = time_dff(work / room, k)
            for r in range(1, len(work) + 1):
                for combo in itertools.combinations(range(len(work)), r):
                    if work[list(combo)].sum() <= room:
                        assert val[list(combo)].sum() <= 1 + 1e-9, (k, room, work[list(combo)])
        share = np.full(k + 1, 1.0 / (k + 1) + 1e-3)
        assert time_dff(share, k).sum() > 1.0
        assert time_dff(np.array([1.0 / (k + 1) - 1e-3]), k)[0] == 0.0


def _spikes_on_256_h200():
    """1,024 documents of 512 tokens and, one in ten, 32K (103 long), on 256 GPUs of the H200
    estimate with GPT-7B: one micro-batch runs the long ones on groups of 2 (2,115.8 ms); groups
    of 8 hold three long ones within 1.62 s."""
    from megatron_flexsp.cost_model import CostModel, load_profile
    from megatron_flexsp.model_spec import get_model

    cm = CostModel.from_profile(load_profile("h200-estimate"), get_model("gpt-7b"), num_gpus=256,
                                max_seq_len=196608)
    rng = np.random.default_rng(3)
    return Tables(np.where(rng.random(1024) < 0.1, 32768, 512), cm)


def test_counting_groups_by_a_few_works_each_lifts_the_bound_and_guides_a_faster_plan():
    """On the spikes batch the relaxation without the rows of :func:`time_dff` filled groups of 8
    with 3.4 long documents each and bounded the step at 1,873.8 ms; each group holds three within
    the level, so the bound is over 1.9 s, still under a plan of three micro-batches (1,941.7 ms),
    and the plan rounded from its placement is over 5% faster than the single micro-batch
    (2,115.8 ms) that every other family found."""
    tab = _spikes_on_256_h200()
    packer = LevelPacker(tab)
    r = lp_step_bound(tab, target_ms=2115.8, max_solves=4000, hints=2)
    assert 1900.0 < r.bound_ms <= 1941.7
    lo, hi = base_range(packer, min_micro_batches(tab))
    found = guided_candidates(packer, r.hints, level_grid(lo, hi, 8), Deadline(20.0), upper_ms=2115.8)
    assert found and min(c[0] for c in found) < 0.95 * 2115.8
    ms, _, layout = min(found, key=lambda c: c[0])
    assert ms >= r.bound_ms
    assert sorted(i for mb in layout for g in mb for i in g.seqs) == list(range(len(tab.lens)))
    plan = to_step_plan(layout, tab, strategy="flexsp", method="lp-guided")
    validate_plan(plan)
    assert simulate(plan, tab.cm).memory_ok


def test_bucket_columns_take_only_members_finishing_within_the_level():
    """A bucket's column at a size and level holds at most the token share of its members that
    finish there alone within the level (computed here from the sequences' own times)."""
    cm = tiny_cost_model()
    lens = np.array([300, 180, 120, 90, 70, 60, 50, 40, 30, 20, 15, 10])
    tab = Tables(lens, cm)
    units = bound_units(tab, num_buckets=3, max_single=2)
    lp = _StepLP(tab, 2, units, k=1)
    level = float(np.median([tab.time[d][i] + tab.fixed[d] for d in tab.sizes for i in range(len(lens))
                             if lens[i] <= tab.cap[d]]))
    box = ((level, level),)
    lp.solve(box, 10 * level)
    upper = lp.h.getLp().col_upper_
    checked = 0
    for u, p, d, col in lp.place:
        members, single = units[u]
        if single or p != 0:
            continue
        ok = [i for i in members if tab.time[d][i] + tab.fixed[d] <= level]
        expect = lens[ok].sum() / lens[members].sum()
        assert upper[col] == pytest.approx(expect), (u, d)
        checked += 0 < expect < 1
    assert checked >= 1  # some bucket is split by the level


def test_stuffing_keeps_its_seed_groups():
    cm = tiny_cost_model()
    lens = np.array([300, 120, 90, 60, 40, 30, 20, 10])
    tab = Tables(lens, cm)
    packer = LevelPacker(tab)
    d = min(d for d in tab.sizes if tab.cap[d] >= 300)
    seed = Group(d)
    tab.add(seed, 0)
    level = 2 * (seed.load_ms + tab.fixed[d])
    groups, left = packer.stuff(np.arange(1, len(lens)), level, seed=[seed])
    assert groups[0] is seed and 0 in seed.seqs
    assert sum(g.size for g in groups) <= cm.cluster.num_gpus
    placed = [i for g in groups for i in g.seqs]
    assert sorted(placed + left.tolist()) == list(range(len(lens)))
    assert all(g.tokens <= tab.cap[g.size] for g in groups)
    assert all(g.load_ms + tab.fixed[g.size] <= level * (1 + 1e-9) for g in groups)


def test_a_guided_layout_runs_every_sequence_once():
    """Whatever the hint (here a made-up one that over-fills a micro-batch's GPUs), the layout is
    valid: every sequence exactly once, within each group's memory and N GPUs per micro-batch."""
    cm = tiny_cost_model()
    lens = np.array([300, 290, 200, 150, 90, 60, 40, 30, 20, 10, 10, 5])
    tab = Tables(lens, cm)
    packer = LevelPacker(tab)
    big = [d for d in tab.sizes if tab.cap[d] >= 300][0]
    hint = Hint(m=3, value_ms=0.0, levels=(1.0, 1.0),  # levels below anything: raised as needed
                singles=(((0, big), (1, big), (2, big)), ((3, 1),)))
    lo, hi = base_range(packer, min_micro_batches(tab))
    layout = guided_layout(packer, hint, level_grid(lo, hi, 4), Deadline())
    assert layout is not None
    validate_plan(to_step_plan(layout, tab, strategy="flexsp", method="lp-guided"))
    assert sorted(i for mb in layout for g in mb for i in g.seqs) == list(range(len(lens)))


def test_best_fit_seeding_places_what_least_loaded_leaves():
    """Four groups of 2 GPUs (200 tokens each) for eight sequences: joining the least-loaded group
    strands the last 50-token one (every group then over 150 tokens); joining the fullest that
    fits pairs 84 with 108 and 65 with 133, leaving room for both 50s beside 99."""
    cm = tiny_cost_model(num_gpus=8, gpus_per_node=4, capacity_tokens=100)
    lens = np.array([156, 133, 108, 99, 84, 65, 50, 50])
    tab = Tables(lens, cm)
    assert tab.cap[2] == 200
    packer = LevelPacker(tab)
    singles = tuple((i, 2) for i in range(len(lens)))
    placed = {}
    for fullest in (False, True):
        taken = np.zeros(len(lens), dtype=bool)
        groups = _open_groups(packer, singles, math.inf, taken, fullest)
        assert sum(g.size for g in groups) <= 8
        assert all(int(lens[g.seqs].sum()) == g.tokens <= 200 for g in groups)
        seqs = sorted(i for g in groups for i in g.seqs)
        assert seqs == np.flatnonzero(taken).tolist()  # each once, and marked taken
        placed[fullest] = len(seqs)
    assert placed == {False: 7, True: 8}


def test_a_hint_names_the_relaxations_makespans():
    """The hint's levels are the LP's own makespans of its explicit micro-batches: within the box
    and summing, with the pooled part's, to the LP's value."""
    cm = tiny_cost_model()
    lens = np.array([300, 180, 120, 90, 70, 60, 50, 40, 30, 20, 15, 10])
    tab = Tables(lens, cm)
    lp = _StepLP(tab, 3, bound_units(tab, num_buckets=3, max_single=3), k=2)
    box = ((0.0, 1e6), (0.0, 1e6))
    hint = lp.hint(box, 1e6)
    assert hint is not None and len(hint.levels) == 2
    x = lp.h.getSolution().col_value
    assert hint.levels[0] >= hint.levels[1] - 1e-6 >= -1e-6  # sorted, within HiGHS's feasibility tolerance
    assert sum(hint.levels) + x[lp.R] == pytest.approx(hint.value_ms, rel=1e-9)
    assert hint.levels[1] < 1e6  # not the box's upper end


def test_the_relaxation_names_a_plan_the_search_missed():
    """Bimodal documents on 256 GPUs (2,048 per step; eight of 196K tokens, two of 158-166K): the
    search runs the long ones on groups of 64 over two micro-batches; the relaxation puts all
    eight 196K documents in one micro-batch on groups of 32, and its rounding, polished, is 3.5%
    faster and within 2% of the bound."""
    from tests.unit.test_packing import _paper_cluster
    from megatron_flexsp.sim.corpora import synthetic_lengths
    from megatron_flexsp.sim.workloads import sample_batches

    cm = _paper_cluster(256)
    batch = sample_batches(synthetic_lengths("bimodal", seed=1), global_batch=2048, num_batches=2, seed=0,
                           max_seq_len=196608)[0][1]
    tab = Tables(np.minimum(batch, cm.max_tokens), cm)
    packer = LevelPacker(tab)
    found = search_step(tab, packer, m_min=min_micro_batches(tab), upper_ms=math.inf, deadline=Deadline(2.0))
    searched = min(c[0] for c in found)
    r = lp_step_bound(tab, target_ms=searched, max_solves=3000, hints=2)
    lo, hi = base_range(packer, min_micro_batches(tab))
    guided = guided_candidates(packer, r.hints, level_grid(lo, hi, 8), Deadline())
    assert guided, r.hints
    best = min(c[0] for c in guided)
    assert best < 0.98 * searched
    assert best <= 1.02 * r.bound_ms


def test_the_rest_of_a_rounding_is_also_packed_groups_first():
    """Lognormal documents (mean 4K) on 64 GPUs, memory-bound: the relaxation runs the 150K and
    73K documents together on a group of 64 in the slowest micro-batch. Shelves for the other 510
    need one micro-batch more than memory does (16.73 s); groups first packs them into the five
    memory allows, within 2.5% of the bound. (The hint is the lowest box's after 300 LP solves:
    early in the search the lowest box moves between placements, some of which round worse.)"""
    from tests.unit.test_packing import _paper_cluster
    from megatron_flexsp.sim.corpora import synthetic_lengths
    from megatron_flexsp.sim.workloads import sample_batches

    cm = _paper_cluster(64)
    batch = sample_batches(synthetic_lengths("lognormal-4k", seed=1), global_batch=512, num_batches=1,
                           seed=0, max_seq_len=196608)[0][0]
    tab = Tables(np.minimum(batch, cm.max_tokens), cm)
    packer = LevelPacker(tab)
    found = search_step(tab, packer, m_min=min_micro_batches(tab), upper_ms=math.inf, deadline=Deadline(1.0))
    searched = min(c[0] for c in found)
    r = lp_step_bound(tab, target_ms=searched, max_solves=300, hints=1)
    hint = r.hints[0]
    assert sorted(int(tab.lens[i]) for i, _ in hint.singles[0]) == [73038, 150151]
    lo, hi = base_range(packer, min_micro_batches(tab))
    layout = guided_layout(packer, hint, level_grid(lo, hi, 8), Deadline())
    assert sorted(i for mb in layout for g in mb for i in g.seqs) == list(range(len(batch)))
    plan = to_step_plan(layout, tab, strategy="flexsp", method="lp-guided")
    validate_plan(plan)
    assert simulate(plan, cm).memory_ok
    assert len(layout) == min_micro_batches(tab)
    assert tab.step_ms(layout) <= 1.025 * r.bound_ms


def test_a_stuffed_first_micro_batch_then_the_rest_groups_first():
    """Lognormal documents (mean 4K) on 64 GPUs, memory-bound: the first micro-batch stuffed at
    a level where the hardest documents' sizes change, the rest packed by memory (groups first),
    beats every other family by over 1% (splitting the rest evenly, shelves, a common level,
    groups first alone), and runs every sequence once within memory."""
    from tests.unit.test_packing import _paper_cluster
    from megatron_flexsp.sim.corpora import synthetic_lengths
    from megatron_flexsp.sim.workloads import sample_batches

    cm = _paper_cluster(64)
    batches = sample_batches(synthetic_lengths("lognormal-4k", seed=1), global_batch=512, num_batches=4,
                             seed=0, max_seq_len=196608)[0]
    for batch in (batches[0], batches[3]):
        tab = Tables(np.minimum(batch, cm.max_tokens), cm)
        found = search_step(tab, LevelPacker(tab), m_min=min_micro_batches(tab), upper_ms=math.inf,
                            deadline=Deadline(10.0))
        best: dict[str, tuple[float, list]] = {}
        for ms, name, layout in found:
            if ms < best.get(name, (math.inf,))[0]:
                best[name] = (ms, layout)
        ms, layout = best.pop("stuffed+groups")
        assert ms < 0.99 * min(v[0] for v in best.values()), (ms, {k: v[0] for k, v in best.items()})
        assert sorted(i for mb in layout for g in mb for i in g.seqs) == list(range(len(batch)))
        plan = to_step_plan(layout, tab, strategy="flexsp", method="stuffed+groups")
        validate_plan(plan)
        assert simulate(plan, cm).memory_ok


def test_stuffing_into_open_groups_first_gives_a_faster_first_micro_batch():
    """Lognormal documents (mean 4K, 2,048 a step) on 256 GPUs, memory-bound (five micro-batches).
    Stuffed with open groups first, the first micro-batch puts documents into the time a long
    document's group has left before opening groups for them (no group past the level or its
    memory, every item placed or left once), and the stuffed family's best layout is then over 1%
    faster than from the plain stuffing alone (14.33 s against 14.49 s)."""
    from tests.unit.test_packing import _paper_cluster
    from megatron_flexsp.planner.search import stuffed_layouts
    from megatron_flexsp.sim.corpora import synthetic_lengths
    from megatron_flexsp.sim.workloads import sample_batches

    cm = _paper_cluster(256)
    batch = sample_batches(synthetic_lengths("lognormal-4k", seed=1), global_batch=2048, num_batches=1,
                           seed=0, max_seq_len=196608)[0][0]
    tab = Tables(np.minimum(batch, cm.max_tokens), cm)
    packer = LevelPacker(tab)
    items = np.arange(len(batch))
    level = 5100.0
    groups, left = packer.stuff(items, level, open_first=True)
    placed = [i for g in groups for i in g.seqs]
    assert sorted(placed + left.tolist()) == list(range(len(batch)))
    assert sum(g.size for g in groups) <= 256
    assert all(g.tokens <= tab.cap[g.size] and g.load_ms + tab.fixed[g.size] <= level * (1 + 1e-9)
               for g in groups)
    plain_groups, _ = packer.stuff(items, level)
    assert [sorted(g.seqs) for g in groups] != [sorted(g.seqs) for g in plain_groups]

    def best(pk) -> float:
        return min(tab.step_ms(layout) for _, layout in stuffed_layouts(
            pk, items, Deadline(), best=lambda: math.inf, m_min=min_micro_batches(tab)))

    class Plain(LevelPacker):
        def stuff(self, *args, **kwargs):
            return super().stuff(*args, **{**kwargs, "open_first": False})

    assert best(packer) < 0.99 * best(Plain(tab))


def test_the_groups_first_family_also_drains_megatron_dcps_greedy():
    """Lognormal documents (mean 4K, 512 a step) on 64 GPUs, memory-bound (five micro-batches):
    on the third step Megatron-DCP's memory-filling greedy, drained, is over 1% faster than every
    groups-first layout (12.65 s against 12.82 s); the family yields it beside them, every
    sequence once, within memory."""
    from tests.unit.test_packing import _paper_cluster
    from megatron_flexsp.planner.search import groups_first_layouts
    from megatron_flexsp.sim.corpora import synthetic_lengths
    from megatron_flexsp.sim.workloads import sample_batches

    cm = _paper_cluster(64)
    batch = sample_batches(synthetic_lengths("lognormal-4k", seed=1), global_batch=512, num_batches=4,
                           seed=0, max_seq_len=196608)[0][2]
    tab = Tables(np.minimum(batch, cm.max_tokens), cm)
    items = np.arange(len(batch))
    plain = groups_first_layouts(tab, items, Deadline())
    with_dcp = groups_first_layouts(tab, items, Deadline(), dcp=True)
    assert len(with_dcp) == len(plain) + 1
    assert [tab.step_ms(x) for x in with_dcp[:-1]] == [tab.step_ms(x) for x in plain]
    greedy = with_dcp[-1]
    assert tab.step_ms(greedy) < 0.99 * min(tab.step_ms(x) for x in plain)
    assert len(greedy) == min_micro_batches(tab)
    assert sorted(i for mb in greedy for g in mb for i in g.seqs) == list(range(len(batch)))
    plan = to_step_plan(greedy, tab, strategy="flexsp", method="groups-first")
    validate_plan(plan)
    assert simulate(plan, cm).memory_ok


def test_the_stuffing_level_where_the_rest_fits_one_micro_batch_fewer():
    """Pareto-tailed documents (alpha 1.3, 2,048 a step) on 64 GPUs fill 2.76 micro-batches of
    memory. The fill level (bisection) is where the stuffed first micro-batch leaves a rest that
    fits two: it leaves at most that many tokens, and a level just below it leaves more. The
    search tries it, and its stuffed plans beat every stuffed plan from the grid of first levels
    alone (the rest split or packed groups first, as the search does)."""
    from tests.unit.test_packing import _paper_cluster
    from megatron_flexsp.planner.search import first_levels, groups_first_layouts
    from megatron_flexsp.planner.split import split_pack
    from megatron_flexsp.sim.corpora import synthetic_lengths
    from megatron_flexsp.sim.workloads import sample_batches

    cm = _paper_cluster(64)
    batch = sample_batches(synthetic_lengths("pareto-1.3", seed=1), global_batch=2048, num_batches=4,
                           seed=0, max_seq_len=196608)[0][0]
    tab = Tables(np.minimum(batch, cm.max_tokens), cm)
    packer = LevelPacker(tab)
    items = np.arange(len(tab.lens))
    m_min = min_micro_batches(tab)
    assert m_min == 3
    crit = float(packer.critical.max())
    top = max(crit, 2 * (packer.f_min + float(packer.gpu_time_min.sum()) / (64 * m_min)))
    rest = 2 * cm.capacity_tokens * 64
    level = packer.fill_level(items, rest, crit, top)
    assert level is not None and crit < level < top
    assert int(tab.lens[packer.stuff(items, level)[1]].sum()) <= rest
    assert int(tab.lens[packer.stuff(items, level * (1 - 5e-3))[1]].sum()) > rest
    # started from the grid's stuffings (as the search does), the bisection needs fewer probes, finds
    # a level within its tolerance of that one, and leaves that level's stuffing in the cache
    probes = []
    stuff = packer.stuff
    packer.stuff = lambda *a, **k: probes.append(a[1]) or stuff(*a, **k)
    packer.fill_level(items, rest, crit, top)
    plain = len(probes)
    grid = {t1: stuff(items, t1) for t1 in first_levels(packer, items, crit, top)}
    probes.clear()
    cached = packer.fill_level(items, rest, crit, top, stuffed=grid)
    packer.stuff = stuff
    assert abs(cached - level) <= 4e-3 * level, (cached, level)
    assert 0 < len(probes) < plain - 2, (len(probes), plain)
    assert int(tab.lens[grid[cached][1]].sum()) <= rest
    assert int(tab.lens[stuff(items, cached * (1 - 5e-3))[1]].sum()) > rest

    grid_best = math.inf
    for t1 in first_levels(packer, items, crit, top):
        first, left = packer.stuff(items, t1)
        if not first or not len(left):
            continue
        m_rest = math.ceil(int(tab.lens[left].sum()) / rest * 2)
        tails = list(groups_first_layouts(tab, left, Deadline(10.0)))
        tails += [t for t in (split_pack(packer, left, m, Deadline(10.0)) for m in (m_rest, m_rest + 1)) if t]
        grid_best = min([grid_best] + [tab.mb_ms(first) + tab.step_ms(t) for t in tails])
    found = search_step(tab, packer, m_min=m_min, upper_ms=math.inf, deadline=Deadline(10.0))
    stuffed = min(ms for ms, name, _ in found if name.startswith("stuffed"))
    assert stuffed < 0.995 * grid_best, (stuffed, grid_best)
