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


def _uniform_64k_at_64_gpus():
    """4,096 documents of 1 to 65,535 tokens on 64 A100s: LPT onto groups of 16 finds no room for
    dozens of micro-batch counts above the memory minimum."""
    from megatron_flexsp.cost_model import CostModel, load_profile
    from megatron_flexsp.model_spec import get_model
    cm = CostModel.from_profile(load_profile("a100-paper"), get_model("gpt-7b"), num_gpus=64, max_seq_len=196608)
    return Tables(np.random.default_rng(7).integers(1, 65536, 4096), cm)


def test_best_homogeneous_steps_over_counts_without_room(monkeypatch):
    """The counts where LPT finds no room are stepped over and bisected back: the same count as
    trying every count in turn (a scan written here), in fewer tries."""
    tab = _uniform_64k_at_64_gpus()
    d, m0 = 16, H.min_micro_batches(tab)
    scan = {}
    for m in range(m0, m0 + 80):
        scan[m] = H._homogeneous_ms(tab, d, m, np.argsort(-tab.lens, kind="stable").tolist())[0]
    first = min(m for m, ms in scan.items() if np.isfinite(ms))
    assert first - m0 >= 20  # the case this test is about
    best_m, best_ms, misses = first, scan[first], 0
    for m in range(first + 1, m0 + 80):  # every count in turn until three in a row do not improve
        if scan[m] < best_ms - 1e-9:
            best_m, best_ms, misses = m, scan[m], 0
        else:
            misses += 1
            if misses > 3:
                break
    tries = []
    real = H._homogeneous_ms
    monkeypatch.setattr(H, "_homogeneous_ms", lambda *a: tries.append(a[2]) or real(*a))
    layout, size = H.best_homogeneous(tab, [d])
    assert size == d and len(layout) == best_m
    assert abs(tab.step_ms(layout) - best_ms) <= 1e-6 * best_ms
    assert len(tries) < first - m0


def test_best_homogeneous_past_its_deadline_still_returns_a_plan(monkeypatch):
    """An expired deadline stops the counts tried once one plan is found (the bisection back to
    the fewest counts with room included), never before."""
    from megatron_flexsp.planner.search import Deadline
    tab = _uniform_64k_at_64_gpus()
    tries = []
    real = H._homogeneous_ms
    monkeypatch.setattr(H, "_homogeneous_ms", lambda *a: tries.append(a[2]) or real(*a))
    full = H.best_homogeneous(tab, tab.sizes)
    n_full = len(tries)
    tries.clear()
    late = H.best_homogeneous(tab, tab.sizes, deadline=Deadline(0.0))
    assert late is not None and full is not None
    assert len(tries) < n_full
    order = np.argsort(-tab.lens, kind="stable").tolist()
    finite = [m for m in tries if np.isfinite(real(tab, late[1], m, order)[0])]
    assert len(late[0]) == min(finite)  # the fewest counts with room (bisected), nothing past them
    assert tab.step_ms(late[0]) >= tab.step_ms(full[0]) - 1e-6


def _dcp_reference(tab):
    """Megatron-DCP's greedy written out plainly (quadratic): per micro-batch, the sequences left,
    longest first, each opens a group of its smallest size on free ranks, else joins the group of
    that size with room and the least ``sum(len^2)/size`` (the first made among equals), else
    waits; then the critical group doubles while free ranks allow and that lowers its workload."""
    lens, sizes = tab.lens.tolist(), tab.min_size.tolist()
    n = tab.cm.cluster.num_gpus
    left = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    layout = []
    while left:
        free, groups, waiting = n, [], []  # groups: [size, seqs, tokens, work]
        for i in left:
            d = sizes[i]
            if free >= d:
                groups.append([d, [i], lens[i], lens[i] ** 2 / d])
                free -= d
                continue
            room = [g for g in groups if g[0] == d and g[2] + lens[i] <= tab.cap[d]]
            if not room:
                waiting.append(i)
                continue
            g = min(room, key=lambda g: g[3])
            g[1].append(i)
            g[2] += lens[i]
            g[3] += lens[i] ** 2 / d
        while True:
            crit = max(groups, key=lambda g: g[3])
            if 2 * crit[0] > free + crit[0] or 2 * crit[0] not in tab.cap:
                break
            others = max((g[3] for g in groups if g is not crit), default=0.0)
            if max(others, crit[3] / 2) >= crit[3]:
                break
            free -= crit[0]
            crit[0] *= 2
            crit[3] /= 2
        layout.append([(g[0], g[1]) for g in groups])
        left = waiting
    return layout


def test_megatron_dcp_follows_its_rule_where_sequences_wait_for_later_micro_batches():
    """The greedy's layouts equal the plain rule's, where sequences that each fill a micro-batch
    leave the rest waiting (kept in place rather than copied per micro-batch) and where short
    sequences wait among long ones."""
    cm = tiny_cost_model(num_gpus=8, gpus_per_node=4, capacity_tokens=200)
    rng = np.random.default_rng(3)
    for lens in (np.full(60, 1600),                                          # one per micro-batch
                 np.concatenate([np.full(20, 1600), rng.integers(5, 900, 40)]),
                 np.where(rng.random(80) < 0.3, 1500, rng.integers(150, 260, 80))):
        tab = Tables(lens, cm)
        got = [[(g.size, list(g.seqs)) for g in mb] for mb in H.megatron_dcp(tab)]
        assert got == _dcp_reference(tab)


def test_megatron_dcp_of_a_subset_is_the_greedy_of_those_sequences_alone():
    """``megatron_dcp(tab, items)`` lays out only ``items``, exactly as the plain reference lays out
    a batch of those sequences alone (indices mapped back; in index order, so ties break alike)."""
    cm = tiny_cost_model(num_gpus=8, gpus_per_node=4, capacity_tokens=200)
    rng = np.random.default_rng(5)
    lens = np.where(rng.random(90) < 0.25, rng.integers(900, 1600, 90), rng.integers(5, 300, 90))
    tab = Tables(lens, cm)
    for items in (np.arange(0, 90, 2), np.sort(rng.permutation(90)[:37]), np.array([3])):
        got = [[(g.size, sorted(g.seqs)) for g in mb] for mb in H.megatron_dcp(tab, items)]
        alone = Tables(lens[items], cm)
        want = [[(d, sorted(int(items[i]) for i in seqs)) for d, seqs in mb] for mb in _dcp_reference(alone)]
        assert got == want
