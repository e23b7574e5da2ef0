"""The planner's budget on very large batches: Megatron-DCP's greedy, the search, a shelf, a
micro-batch's re-packing and draining stop at their deadlines, the polishing starts nothing it
cannot pass over once, the homogeneous search wastes no packing (none where the plan in hand
beats every homogeneous layout's lower bound), the step floors for every count come at once, and
a plan's indices come out as Python ints without a remapping pass. (How long the planner takes is
measured by ``scripts/bench_planner_robustness.py``, not here.)"""

import itertools
import json

import numpy as np
import pytest

from megatron_flexsp.config import PlannerConfig
from megatron_flexsp.cost_model import CostModel, load_profile
from megatron_flexsp.model_spec import get_model
from megatron_flexsp.plan import StepPlan
from megatron_flexsp.planner import heuristics as H
from megatron_flexsp.planner import plan_step
from megatron_flexsp.planner.layout import Tables
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.search import Deadline, search_step
from tests.unit.helpers import tiny_cost_model


def _a100(num_gpus: int = 64) -> CostModel:
    return CostModel.from_profile(load_profile("a100-paper"), get_model("gpt-7b"), num_gpus=num_gpus,
                                  max_seq_len=196608)


def _fewest_bins(lens: list[int], cap: int) -> int:
    """The fewest bins of ``cap`` holding ``lens``, by trying every assignment (a few items only)."""
    for bins in range(1, len(lens) + 1):
        for assign in itertools.product(range(bins), repeat=len(lens)):
            load = [0] * bins
            for s, b in zip(lens, assign):
                load[b] += s
            if max(load) <= cap:
                return bins
    return len(lens)


def test_groups_needed_bounds_every_packing():
    """:func:`heuristics._groups_needed` is at most the fewest groups any packing needs (brute
    force over random instances of up to seven sequences), and exact for sequences of one length."""
    rng = np.random.default_rng(3)
    tight = 0
    for _ in range(120):
        n, cap = int(rng.integers(1, 8)), int(rng.integers(10, 60))
        lens = rng.integers(1, cap + 1, n).tolist()
        exact = _fewest_bins(lens, cap)
        got = H._groups_needed(np.sort(np.array(lens)), cap)
        assert got <= exact, (lens, cap, got, exact)
        tight += got == exact
    assert tight >= 60  # a bound that says something, not zero
    for length, cap, n in ((4096, 23968, 65536), (7, 20, 11), (10, 10, 5)):
        assert H._groups_needed(np.full(n, length), cap) == -(-n // (cap // length))


def test_homogeneous_search_tries_the_most_promising_size_first():
    """512 documents of 4,096 tokens at 64 GPUs: groups of one GPU have the least GPU-time but need
    eight micro-batches (one document a GPU); groups of eight need six and are faster. With no time
    the search returns what its first size finds: the untimed best, not the one-GPU plan."""
    tab = Tables(np.full(512, 4096), _a100())
    least_gpu_time = min(tab.sizes, key=lambda d: float(tab.time[d].sum()) * d)
    full = H.best_homogeneous(tab, tab.sizes)
    late = H.best_homogeneous(tab, tab.sizes, deadline=Deadline(0.0))
    assert least_gpu_time == 1 and full[1] == 8  # the case this test is about
    assert late[1] == full[1] and len(late[0]) == len(full[0])
    assert tab.step_ms(late[0]) == pytest.approx(tab.step_ms(full[0]), rel=1e-9)
    one_gpu = H.homogeneous(tab, 1, len(late[0]) + 2)  # eight micro-batches: one document a GPU
    assert one_gpu is not None and tab.step_ms(one_gpu) > 1.03 * tab.step_ms(full[0])


def test_homogeneous_search_packs_no_count_twice(monkeypatch):
    """The bisection back to the fewest counts with room packs counts the search then steps through
    again: each (size, count) is packed once (4,096 documents of up to 64K tokens at 64 GPUs)."""
    tab = Tables(np.random.default_rng(7).integers(1, 65536, 4096), _a100())
    tries = []
    real = H._homogeneous_ms
    monkeypatch.setattr(H, "_homogeneous_ms",
                        lambda tab_, d, m, order: tries.append((d, m)) or real(tab_, d, m, order))
    found = H.best_homogeneous(tab, tab.sizes)
    assert found is not None and len(tries) >= 5
    assert len(set(tries)) == len(tries), sorted(tries)


def test_homogeneous_search_looks_only_below_a_plan_in_hand(monkeypatch):
    """``faster_than``: with a plan in hand just slower than the best homogeneous one the search
    finds that one; with one faster than every size's lower bound it packs nothing and returns None
    (4,096 documents of up to 64K tokens at 64 GPUs)."""
    tab = Tables(np.random.default_rng(7).integers(1, 65536, 4096), _a100())
    tries = []
    real = H._homogeneous_ms
    monkeypatch.setattr(H, "_homogeneous_ms", lambda *a: tries.append(a[1:3]) or real(*a))
    layout, d = H.best_homogeneous(tab, tab.sizes)
    best_ms = tab.step_ms(layout)
    tries.clear()
    again = H.best_homogeneous(tab, tab.sizes, faster_than=best_ms * 1.001)
    assert again is not None and again[1] == d and tab.step_ms(again[0]) == pytest.approx(best_ms, rel=1e-12)
    tries.clear()
    assert H.best_homogeneous(tab, tab.sizes, faster_than=best_ms) is None  # none is faster than itself
    tries.clear()
    gpu_time = min(float(tab.time[x].sum()) * x for x in tab.sizes) / 64  # every size's bound is above it
    assert H.best_homogeneous(tab, tab.sizes, faster_than=gpu_time) is None and tries == []


def test_homogeneous_search_cut_short_resumes_where_it_stopped(monkeypatch):
    """Cut by its deadline after its first plan, the search resumed with the counts it tried
    (``tried``) and that plan's time ends where the uncut search does, packing again no count the
    first call packed except the one it keeps; a resumed call stops at its own deadline."""
    rng = np.random.default_rng(4)
    n = int(rng.choice([512, 1024, 2048]))
    tab = Tables(rng.integers(1, int(rng.choice([4000, 16000, 30000])), n), _a100())  # 2,048 of < 30K
    full = H.best_homogeneous(tab, [8])
    tried: dict = {}
    cut = H.best_homogeneous(tab, [8], deadline=Deadline(0.0), tried=tried)
    assert tab.step_ms(cut[0]) > tab.step_ms(full[0]) * (1 + 1e-6)  # the case this test is about
    first = dict(tried)
    packed = []
    real = H._homogeneous_ms
    monkeypatch.setattr(H, "_homogeneous_ms", lambda *a: packed.append(a[2]) or real(*a))
    assert H.best_homogeneous(tab, [8], deadline=Deadline(0.0), faster_than=tab.step_ms(cut[0]),
                              tried=dict(first), resume=True) is None and packed == []
    more = H.best_homogeneous(tab, [8], deadline=Deadline(60.0), faster_than=tab.step_ms(cut[0]),
                              tried=tried, resume=True)
    assert len(more[0]) == len(full[0]) and tab.step_ms(more[0]) == pytest.approx(tab.step_ms(full[0]))
    assert len([m for m in packed if (8, m) in first]) <= 1


def test_planner_packs_no_homogeneous_layout_its_rounded_plan_beats(monkeypatch):
    """256 documents of up to 60K tokens at 64 GPUs: the slot LP's rounded plan is faster than
    every homogeneous layout's lower bound, so the planner packs none (each packing of 65,536
    documents takes 0.1 s), and its plan is still no slower than BatchAda's."""
    cm = _a100()
    lens = np.random.default_rng(0).integers(1, 60000, 256)
    tries = []
    real = H._homogeneous_ms
    monkeypatch.setattr(H, "_homogeneous_ms", lambda *a: tries.append(a[1:3]) or real(*a))
    plan = plan_step(lens, cm, config=PlannerConfig(time_budget_s=0.3))
    assert tries == []
    ada = plan_step(lens, cm, strategy="batchada")
    assert tries  # (BatchAda's own search does pack)
    assert plan.predicted_step_ms <= ada.predicted_step_ms * (1 + 1e-9)


def test_step_floors_at_many_micro_batches_match_a_scalar_reference():
    """The floors for every count up to the memory minimum (here over 100) are computed at once;
    a per-count loop over the module docstring's definition, written here, gives the same values
    to the last bit, and so does ``at_least`` against its own per-head loop."""
    from megatron_flexsp.planner.floors import step_floors

    tab = Tables(np.random.default_rng(3).integers(1000, 196608, 2000), _a100())
    n, cap = 64, float(64 * tab.cm.capacity_tokens)
    floors = step_floors(tab)
    crit, lens = tab.critical_ms(), tab.lens.astype(np.float64)
    gpu = tab.least_gpu_time_ms()
    slowest_first = sorted(range(len(lens)), key=lambda i: -crit[i])
    rest = sorted((i for i in range(len(lens)) if i != slowest_first[0]), key=lambda i: gpu[i] / lens[i])
    heads, total, held, pos = [], float(crit[slowest_first[0]]), 0.0, 0
    for k in range(1, H.min_micro_batches(tab) + 1):
        if k > 1:
            while pos < len(lens) and held + lens[slowest_first[pos]] <= (k - 1) * cap:
                held += lens[slowest_first[pos]]
                pos += 1
            if pos >= len(lens):
                break
            total += float(crit[slowest_first[pos]])
        left, cheap = float(lens.sum()) - k * cap, 0.0
        for i in rest:  # the cheapest tokens per GPU-ms first, the last in part
            if left <= 0.0:
                break
            cheap += min(left / lens[i], 1.0) * gpu[i]
            left -= lens[i]
        heads.append(total + cheap / n)
    assert len(heads) > 100 and len(floors.heads) == len(heads)
    np.testing.assert_allclose(floors.heads, heads, rtol=1e-12)
    for m in (1, 2, 50, len(heads), len(heads) + 7):
        ref = max([m * floors.f_min + floors.area] +
                  [h + (m - k) * floors.f_min for k, h in enumerate(floors.heads[:m], start=1)])
        assert floors.at_least(m) == ref


def test_megatron_dcp_as_a_candidate_stops_at_its_deadline():
    """Megatron-DCP's greedy gives up (None) once its deadline has passed, also within a
    micro-batch; with time left it builds the same layout as without one."""
    cm = tiny_cost_model(num_gpus=8, gpus_per_node=4, capacity_tokens=200)
    tab = Tables(np.random.default_rng(0).integers(5, 900, size=60), cm)
    assert H.megatron_dcp(tab, deadline=Deadline(0.0)) is None

    def shape(layout):
        return [[(g.size, sorted(g.seqs)) for g in mb] for mb in layout]

    assert shape(H.megatron_dcp(tab, deadline=Deadline(60.0))) == shape(H.megatron_dcp(tab))

    class PassesOnceAsked:  # a deadline that passes while the greedy fills its first micro-batch
        asked = 0

        def expired(self) -> bool:
            self.asked += 1
            return self.asked > 1

    one = Tables(np.random.default_rng(0).integers(5, 900, size=20), tiny_cost_model(8, 4, 2000))
    assert len(H.megatron_dcp(one)) == 1  # one micro-batch: only the check within it can stop it
    assert H.megatron_dcp(one, deadline=PassesOnceAsked()) is None


def test_search_past_its_deadline_builds_nothing():
    """The step search entered with its deadline passed (the candidates before it took its share)
    returns no layout instead of one stuffing per micro-batch."""
    cm = tiny_cost_model(num_gpus=8, gpus_per_node=4, capacity_tokens=2000)
    tab = Tables(np.random.default_rng(1).integers(5, 900, size=60), cm)  # two micro-batches
    packer = LevelPacker(tab)
    late = search_step(tab, packer, m_min=H.min_micro_batches(tab), upper_ms=np.inf, deadline=Deadline(0.0))
    assert late == []
    assert search_step(tab, packer, m_min=H.min_micro_batches(tab), upper_ms=np.inf, deadline=Deadline(5.0))


class _PassesAfter:
    """A deadline that passes after ``checks`` looks at it (a clock that does not depend on the
    machine's speed)."""

    def __init__(self, checks: int) -> None:
        self.checks, self.asked = checks, 0

    def expired(self) -> bool:
        self.asked += 1
        return self.asked > self.checks


def _counting(monkeypatch, obj, name: str) -> list:
    calls = []
    real = getattr(obj, name)
    monkeypatch.setattr(obj, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_a_shelf_past_its_deadline_takes_the_best_level_tried(monkeypatch):
    """Shelves whose deadline passes while the first shelf's levels are tried: that shelf takes the
    level tried so far and the rest is stuffed, one stuffing a micro-batch (each stuffing of
    32,768 documents takes 0.05-0.1 s), not every candidate level stuffed first."""
    from megatron_flexsp.planner.shelves import ShelfPlanner

    tab = Tables(np.random.default_rng(5).integers(1000, 20000, 100), _a100())
    packer = LevelPacker(tab)
    bases = [4000.0, 5000.0, 6000.0]
    items = np.arange(len(tab.lens))
    shelves = ShelfPlanner(packer)
    assert len(shelves.candidates(items, bases)) >= 4 and H.min_micro_batches(tab) >= 2
    stuffed = _counting(monkeypatch, packer, "stuff")
    late = shelves.layout(items, bases, "estimate", _PassesAfter(1))
    assert sorted(i for mb in late for g in mb for i in g.seqs) == items.tolist()
    assert len(stuffed) <= len(late) + 1  # the first shelf's one level, then the rest's stuffings


def test_repacking_stops_at_its_deadline_within_a_micro_batch(monkeypatch):
    """Re-packing a micro-batch at its smallest level (a bisection of packings, 1 s for 32,768
    documents) stops at the deadline within that micro-batch too, keeping the layout valid."""
    tab = Tables(np.random.default_rng(6).integers(100, 20000, 600), _a100())
    packer = LevelPacker(tab)
    layout = H.best_homogeneous(tab, [16])[0]  # slow micro-batches: groups of 16 for short documents
    full = _counting(monkeypatch, packer, "_pack_fast")
    packer.repack(tab.clone_layout(layout), Deadline(60.0))
    late = _counting(monkeypatch, packer, "_pack_fast")
    packer.repack(layout, _PassesAfter(1))
    assert len(full) >= 6 and len(late) <= 2
    assert sorted(i for mb in layout for g in mb for i in g.seqs) == list(range(len(tab.lens)))


def test_draining_gives_up_where_its_deadline_passes_while_it_indexes(monkeypatch):
    """Draining a layout of thousands of micro-batches indexes every group first (a tenth of a
    second for 65,536): a deadline passing there stops it before the rest are indexed, and leaves
    the layout as it was."""
    from megatron_flexsp.planner.drain import drain_micro_batches
    from megatron_flexsp.planner.layout import GroupIndex

    tab = Tables(np.full(3000, 4096), _a100())
    layout = [[g] for mb in H.homogeneous(tab, 64, 3000) for g in mb]  # one document a micro-batch
    before = [[(g.size, list(g.seqs)) for g in mb] for mb in layout]
    indexed = _counting(monkeypatch, GroupIndex, "add")
    assert drain_micro_batches(layout, tab, deadline=_PassesAfter(1)) == 0
    assert len(indexed) <= 1024
    assert [[(g.size, list(g.seqs)) for g in mb] for mb in layout] == before
    assert drain_micro_batches(layout, tab, deadline=Deadline(60.0)) >= 1  # with time it drains


def test_polishing_starts_nothing_it_cannot_pass_over_once(monkeypatch):
    """With less time left than one pass over the best layout takes (``PASS_S_PER_ITEM`` per
    sequence and micro-batch), the polishing returns the layouts as they are, best first."""
    from megatron_flexsp.planner import polish as polishing
    from megatron_flexsp.planner.layout import PASS_S_PER_ITEM
    from megatron_flexsp.planner.polish import polish

    tab = Tables(np.random.default_rng(8).integers(100, 20000, 4096), _a100())
    packer = LevelPacker(tab)
    layouts = [H.best_homogeneous(tab, [d])[0] for d in (8, 16)]
    found = [(tab.step_ms(lay), f"homogeneous-d{d}", lay) for d, lay in zip((8, 16), layouts)][::-1]
    shapes = [[[(g.size, list(g.seqs)) for g in mb] for mb in lay] for _, _, lay in found]
    need = PASS_S_PER_ITEM * (len(tab.lens) + len(layouts[0]))
    started = _counting(monkeypatch, polishing, "distinct")  # its first step
    out = polish(list(found), packer, Deadline(0.5 * need), {})
    assert started == [] and [c[0] for c in out] == sorted(c[0] for c in found)
    assert [[[(g.size, list(g.seqs)) for g in mb] for mb in lay] for _, _, lay in found] == shapes
    out = polish(list(found), packer, Deadline(0.3), {})
    assert min(c[0] for c in out) < min(c[0] for c in found)  # with time it polishes


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_plan_indices_are_python_ints_with_or_without_a_dropped_sequence(policy):
    """Every sequence kept: the plan's indices are the planner's own (no remapping pass), Python
    ints, and survive the JSON round trip; one dropped: they are remapped past it."""
    cm = tiny_cost_model(num_gpus=8, gpus_per_node=4, capacity_tokens=200)
    lens = np.random.default_rng(2).integers(5, 900, size=40)
    lens[7] = 10 * cm.max_tokens  # over the cluster's length: truncated, or dropped
    plan = plan_step(lens, cm, config=PlannerConfig(over_length=policy, time_budget_s=0.3))
    seqs = [i for mb in plan.micro_batches for g in mb.groups for i in g.seqs]
    assert all(type(i) is int for i in seqs)
    expected = list(range(40)) if policy == "truncate" else [i for i in range(40) if i != 7]
    assert sorted(seqs) == expected
    assert StepPlan.from_json(plan.to_json()).micro_batches == plan.micro_batches
    assert json.loads(plan.to_json())["seq_lens"][7] == (cm.max_tokens if policy == "truncate" else 0)
