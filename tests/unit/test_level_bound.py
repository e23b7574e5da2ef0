"""Level packing (the default search) and the LP lower bound: valid plans, a valid bound, no worse
than the baselines; the bound never exceeds the brute-force optimum on tiny instances."""

import math

import numpy as np
import pytest

from megatron_flexsp.config import PlannerConfig
from megatron_flexsp.plan import validate_plan
from megatron_flexsp.planner import plan_step
from megatron_flexsp.planner.bound import lp_step_bound
from megatron_flexsp.planner.floors import step_floors
from megatron_flexsp.planner.layout import Tables
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.search import Deadline
from megatron_flexsp.sim import simulate
from tests.unit.helpers import tiny_cost_model
from tests.unit.test_planner import small_instance


@pytest.mark.parametrize("seed", range(8))
def test_level_plan_and_lp_bound_bracket_the_optimum(seed):
    cm, lens, opt = small_instance(seed)
    plan = plan_step(lens, cm, config=PlannerConfig(bound_lp_solves=400))
    validate_plan(plan)
    families = ("level", "shelves", "split", "stuffed+split", "groups-first", "lp-rounded", "lp-guided", "dcp-greedy", "greedy", "milp",
                "milp-refined", "best-fit")
    assert plan.method.split("+mb-milp")[0] in families or plan.method.startswith("homogeneous")
    assert plan.predicted_step_ms >= opt * (1 - 1e-9)
    assert plan.lower_bound_ms <= opt * (1 + 1e-6)
    # the LP bound alone (no simple-bound max) is valid too, whatever the target
    tab = Tables(np.asarray(lens), cm)
    for target in (opt, 2 * opt):
        assert lp_step_bound(tab, target_ms=target, max_solves=200).bound_ms <= opt * (1 + 1e-6)


def test_level_beats_baselines_and_reports_a_gap(wiki_lengths, paper_cm):
    rng = np.random.default_rng(5)
    for _ in range(2):
        b = np.minimum(rng.choice(wiki_lengths, 512), 196608)
        f = plan_step(b, paper_cm, max_seq_len=196608)
        validate_plan(f)
        sim = simulate(f, paper_cm)
        assert sim.memory_ok and sim.step_ms == pytest.approx(f.predicted_step_ms, rel=1e-9)
        for s in ("batchada", "static", "megatron-dcp"):
            other = plan_step(b, paper_cm, strategy=s, max_seq_len=196608)
            assert f.predicted_step_ms <= other.predicted_step_ms * (1 + 1e-9), s
            assert f.lower_bound_ms <= other.predicted_step_ms * (1 + 1e-9)
        assert 0 <= f.gap < 0.1
        assert f.info["lp_solves"] > 0


def test_level_packer_respects_memory_and_level():
    cm = tiny_cost_model()
    lens = np.array([150, 90, 60, 40, 30, 10])  # 380 of the 400 tokens 4 GPUs hold
    tab = Tables(lens, cm)
    lp = LevelPacker(tab)
    items = np.arange(len(lens))
    found = lp.min_level(items)
    assert found is not None
    level, groups = found
    assert sorted(i for g in groups for i in g.seqs) == list(range(len(lens)))
    assert sum(g.size for g in groups) <= cm.cluster.num_gpus
    for g in groups:
        assert g.tokens <= tab.cap[g.size]
        assert tab.finish(g) <= level * (1 + 1e-9)
    # against the exact optimum of this one micro-batch: never below it (that would be an invalid
    # packing), at most 10% above it, and no packing is ever found below it
    from tests.unit.test_planner import brute_force_step_ms

    opt = brute_force_step_ms(tuple(int(x) for x in lens), cm)
    assert tab.step_ms([groups]) >= opt * (1 - 1e-9)
    assert level <= 1.10 * opt, (level, opt)
    for frac in (0.999, 0.95, 0.8, 0.5):
        assert lp.pack(items, opt * frac) is None, frac


def test_search_setting_is_validated():
    with pytest.raises(ValueError, match="search='cplex'"):
        PlannerConfig(search="cplex")
    with pytest.raises(ValueError, match="bound_lp_solves=-1"):
        PlannerConfig(bound_lp_solves=-1)


def many_micro_batch_instance(seed: int):
    """6-7 sequences of 101-300 tokens on the tiny 4-GPU cluster (400 tokens per micro-batch):
    memory alone needs 3 to 6 micro-batches. (cost model, lengths, brute-force optimum ms)."""
    from tests.unit.test_planner import brute_force_step_ms

    rng = np.random.default_rng(100 + seed)
    cm = tiny_cost_model()
    lens = rng.integers(101, 301, size=int(rng.integers(6, 8)))
    return cm, lens, brute_force_step_ms(tuple(int(x) for x in lens), cm)


@pytest.mark.parametrize("seed", range(6))
def test_lp_bound_is_valid_with_three_to_six_micro_batches(seed):
    cm, lens, opt = many_micro_batch_instance(seed)
    tab = Tables(np.asarray(lens), cm)
    from megatron_flexsp.planner.heuristics import min_micro_batches

    assert 3 <= min_micro_batches(tab) <= 6
    for target in (opt, 1.5 * opt):
        for extra in (0, 2, 4):
            r = lp_step_bound(tab, target_ms=target, max_solves=300, max_extra=extra)
            assert r.bound_ms <= opt * (1 + 1e-6), (target, extra, r, opt)
    plan = plan_step(lens, cm, config=PlannerConfig(bound_lp_solves=300))
    validate_plan(plan)
    assert plan.predicted_step_ms >= opt * (1 - 1e-9)
    assert plan.lower_bound_ms <= opt * (1 + 1e-6)
    # the bound is not vacuous: it proves most of the optimum
    assert plan.lower_bound_ms >= 0.8 * opt


def test_a_non_optimal_lp_status_falls_back_to_the_simple_bound(monkeypatch, caplog):
    """HiGHS stopping without a proof (a limit, numerical trouble) must never count as
    'infeasible', which would raise the bound without proof: the simple bound is used instead."""
    import highspy

    from megatron_flexsp.planner import bound as B

    cm, lens, opt = many_micro_batch_instance(0)
    tab = Tables(np.asarray(lens), cm)
    honest = lp_step_bound(tab, target_ms=opt, max_solves=300, max_extra=2)
    real_run = highspy.Highs.run
    state = {"calls": 0}

    def flaky_run(self):
        state["calls"] += 1
        return real_run(self)

    monkeypatch.setattr(highspy.Highs, "run", flaky_run)
    monkeypatch.setattr(highspy.Highs, "getModelStatus",
                        lambda self: highspy.HighsModelStatus.kTimeLimit)
    with caplog.at_level("WARNING"):
        r = lp_step_bound(tab, target_ms=opt, max_solves=300, max_extra=2)
    f_min = min(tab.fixed.values())
    area = tab.area_min_ms() / cm.cluster.num_gpus
    m_min = B.min_micro_batches(tab)
    simple = step_floors(tab).at_least(m_min)
    assert simple >= m_min * f_min + area
    assert state["calls"] >= 1
    assert r.bound_ms == pytest.approx(min(simple, opt))
    assert r.bound_ms <= honest.bound_ms + 1e-9
    assert "Time limit" in caplog.text and "simple bound" in caplog.text


def test_lp_bound_is_valid_beside_a_long_slow_sequence():
    """One sequence needing every GPU plus a few short ones, all in one micro-batch's memory: the
    long one leaves memory its group has no time to fill. The bound never passes the brute-force
    optimum, and is above the simple bound on some of these instances."""
    from megatron_flexsp.planner.heuristics import min_micro_batches
    from tests.unit.test_planner import brute_force_step_ms

    cm = tiny_cost_model()
    rng = np.random.default_rng(0)
    above = 0
    for _ in range(40):
        lens = np.array([int(rng.integers(201, 400))] + rng.integers(5, 60, size=int(rng.integers(2, 5))).tolist())
        tab = Tables(lens, cm)
        if min_micro_batches(tab) != 1:
            continue
        opt = brute_force_step_ms(tuple(int(x) for x in lens), cm)
        r = lp_step_bound(tab, target_ms=2 * opt, max_solves=500)
        assert r.bound_ms <= opt * (1 + 1e-6), (lens, r.bound_ms, opt)
        simple = max(min(tab.fixed.values()) + tab.area_min_ms() / cm.cluster.num_gpus,
                     float(tab.critical_ms().max()))
        above += r.bound_ms > simple * (1 + 1e-3)
    assert above >= 5


@pytest.mark.parametrize("lens", [(390, 95, 90, 85, 80, 70), (380, 100, 100, 60, 55, 50, 45),
                                  (390, 380, 60, 50, 40, 30)])
def test_the_slowest_micro_batches_leave_the_other_tokens_to_the_rest(lens):
    """Sequences filling nearly a micro-batch's memory, small fixed costs: the sequences outside
    the slowest micro-batch hold at least the tokens it has no memory for, and a second sequence
    that cannot share its memory heads a second one. The floors are above the older simple bound
    (fixed costs beside the slowest finish) and never above the brute-force optimum at any count,
    alone or as the LP bound's bound for the counts it leaves to its open-ended search."""
    from megatron_flexsp.planner import bound as B
    from tests.unit.test_planner import brute_force_step_ms

    cm = tiny_cost_model(overhead_ms=0.5)
    tab = Tables(np.array(lens), cm)
    f_min, n = min(tab.fixed.values()), cm.cluster.num_gpus
    m_min = B.min_micro_batches(tab)
    floors = step_floors(tab)
    # written out for the slowest micro-batch: it holds at most N C tokens; the rest, cheapest
    # GPU-time per token first, up to the tokens left over
    crit = tab.critical_ms()
    slowest = int(np.argmax(crit))
    need = float(sum(lens)) - n * cm.capacity_tokens
    per = sorted((min(d * float(tab.time[d][i]) for d in tab.sizes if lens[i] <= tab.cap[d]) / lens[i], lens[i])
                 for i in range(len(lens)) if i != slowest)
    outside = 0.0
    for rate, tokens in per:
        take = min(tokens, need)
        outside, need = outside + rate * take, need - take
    assert floors.heads[0] == pytest.approx(float(crit[slowest]) + outside / n)
    older = max(m_min * f_min + tab.area_min_ms() / n, float(crit.max()) + (m_min - 1) * f_min)
    assert floors.at_least(m_min) > older * (1 + 1e-3)
    if lens[1] > n * cm.capacity_tokens - lens[0] and lens[1] > 300:  # two long ones head two
        assert floors.heads[1] + (m_min - 2) * f_min > floors.heads[0] + (m_min - 1) * f_min
    exact = {m: brute_force_step_ms(lens, cm, count=m) for m in range(m_min, len(lens) + 1)}
    for m in exact:
        assert floors.at_least(m) <= min(v for c, v in exact.items() if c >= m) * (1 + 1e-9)
    opt = min(exact.values())
    for extra in (0, 1, 2):
        assert lp_step_bound(tab, target_ms=2 * opt, max_solves=300, max_extra=extra).bound_ms <= opt * (1 + 1e-6)


def test_the_step_milp_and_the_lp_bound_of_the_counts_above_it_prove_the_optimum(monkeypatch):
    """The step MILP proves plans with up to the best plan's micro-batches; the LP bound's
    searches of the counts above it (refined after the lower counts converge) cover the rest:
    together they prove this one-micro-batch plan optimal, where the simple bound for two or
    more micro-batches alone left a gap."""
    from megatron_flexsp.planner import bound as B
    from tests.unit.test_planner import brute_force_step_ms

    cm = tiny_cost_model(overhead_ms=0.5)
    lens = (71, 132, 56, 118)
    tab = Tables(np.array(lens), cm)
    exact = {m: brute_force_step_ms(lens, cm, count=m) for m in range(1, len(lens) + 1)}
    r = lp_step_bound(tab, target_ms=2 * exact[1], max_solves=300, refine_above=1)
    assert r.more_than(1) <= min(exact[m] for m in exact if m > 1) * (1 + 1e-6)
    assert r.bound_ms <= exact[1] * (1 + 1e-6)
    plan = plan_step(lens, cm, config=PlannerConfig(time_budget_s=1.0))
    assert plan.predicted_step_ms == pytest.approx(exact[1])
    assert plan.lower_bound_ms == pytest.approx(exact[1], rel=1e-6)
    monkeypatch.setattr(B.BoundResult, "more_than", lambda self, m: -math.inf)
    assert plan_step(lens, cm, config=PlannerConfig(time_budget_s=1.0)).lower_bound_ms < exact[1] * (1 - 1e-3)


def test_memory_a_slow_sequence_leaves_idle_is_not_counted():
    """Pareto-1.1 documents on 1024 GPUs (8,192 per step) fit one micro-batch's memory, but only if
    the groups of 64 GPUs running the 160-196K-token documents were also filled with short ones,
    for which they have no time left: one micro-batch is proven slower than two."""
    from megatron_flexsp.planner.bound import step_bound
    from megatron_flexsp.planner.heuristics import min_micro_batches
    from tests.unit.test_packing import _batch, _paper_cluster

    cm = _paper_cluster(1024)
    tab = Tables(_batch("pareto-1.1", 8192, cm), cm)
    assert min_micro_batches(tab) == 1
    f = min(tab.fixed.values())
    crit = float(tab.critical_ms().max())
    two = max(2 * f + tab.area_min_ms() / cm.cluster.num_gpus, crit + f)  # no 2-micro-batch plan is faster
    assert step_bound(tab, 1, target_ms=1.05 * two, t1_lo=crit).bound_ms >= two


def test_a_group_holds_no_more_equal_documents_than_fit_whole():
    """186 documents of 4,096 tokens at 64 GPUs of 5,992 tokens each: memory alone allows two
    micro-batches, but a group of d GPUs holds only ``5,992 d // 4,096`` of them (93 at 64, 46 at
    32), so the only two-micro-batch plans run 93 documents on all 64 GPUs each. The bound for two
    micro-batches is that plan's time (the token count alone gave 45% of it); on equal-length
    tiny batches it stays below the brute-force optimum."""
    from megatron_flexsp.planner.bound import step_bound
    from tests.unit.test_packing import _paper_cluster
    from tests.unit.test_planner import brute_force_step_ms

    cm = _paper_cluster(64)
    tab = Tables(np.full(186, 4096), cm)
    two = 2 * cm.group_time_ms([4096] * 93, 64)
    crit = float(tab.critical_ms().max())
    assert step_bound(tab, 2, target_ms=10 * two, t1_lo=crit, max_solves=300).bound_ms == pytest.approx(two, rel=1e-6)
    tiny = tiny_cost_model(overhead_ms=0.2)
    for length, n in ((130, 5), (60, 7), (90, 6)):
        lens = (length,) * n
        opt = brute_force_step_ms(lens, tiny)
        assert lp_step_bound(Tables(np.array(lens), tiny), target_ms=2 * opt, max_solves=300).bound_ms <= opt * (1 + 1e-6)


@pytest.mark.parametrize("explicit", [1, 2, 3])
def test_explicit_slowest_micro_batches_keep_every_plan(explicit):
    """Two or three sequences that each fill the cluster's memory run one per micro-batch, all as
    slow as each other: the searches with 1-3 explicit micro-batches stay below that optimum (a
    box that left out the second slowest micro-batch's range would prove too much)."""
    from megatron_flexsp.planner.bound import step_bound
    from tests.unit.test_planner import brute_force_step_ms

    cm = tiny_cost_model()
    for lens in ([300, 300], [300, 290, 310]):
        tab = Tables(np.asarray(lens), cm)
        opt = brute_force_step_ms(tuple(lens), cm)
        m = len(lens)
        r = step_bound(tab, m, target_ms=1.5 * opt, t1_lo=float(tab.critical_ms().max()),
                       max_solves=2000, explicit=explicit)
        assert r.bound_ms <= opt * (1 + 1e-6), (lens, explicit, r.bound_ms, opt)
        assert r.bound_ms >= 0.95 * opt  # and the explicit boxes prove most of it


def test_bucket_shares_match_a_lookup_per_column():
    """The flattened lookup of the members finishing within a level equals a per-column
    ``searchsorted`` (written here without the helper), including columns none of whose members
    finish in time and levels past every member."""
    from megatron_flexsp.planner.count_rows import Shares

    rng = np.random.default_rng(3)
    for _ in range(100):
        cols = []
        for j in range(int(rng.integers(0, 6))):
            fin = np.sort(rng.uniform(0.0, 10.0, int(rng.integers(1, 8))))
            share = np.cumsum(rng.uniform(0.1, 1.0, len(fin)))
            cols.append((2 * j, fin, share / share[-1]))
        shares = Shares(cols)
        for level in rng.uniform(-1.0, 11.0, 6):
            got = np.full(12, 7.0)
            shares.within(float(level), got)
            want = np.full(12, 7.0)
            for pos, fin, share in cols:
                k = int(np.searchsorted(fin, level, side="right"))
                want[pos] = share[k - 1] if k else 0.0
            np.testing.assert_array_equal(got, want)


def test_refined_pooled_cap_matches_a_dense_scan():
    """Refining a box's pooled cap (regula falsi on ``g(r) = sum a_p + r``) proves what a dense
    scan of caps proves, ``max_r min(g(r), sum a_p + r)`` (within the tolerance plus one step of
    the scan), and never more: every probe's value is a valid bound, so the scan's best is the
    reference. On these boxes refining raises the first probe's value by 1-4%."""
    from megatron_flexsp.planner.heuristics import min_micro_batches
    from megatron_flexsp.planner.bound import bound_units
    from megatron_flexsp.planner.step_lp import _StepLP
    from tests.unit.test_packing import _batch, _paper_cluster

    cm = _paper_cluster(64)
    tab = Tables(_batch("pareto-1.1", 1024, cm), cm)
    m = min_micro_batches(tab)
    lp = _StepLP(tab, m, bound_units(tab), k=1)
    crit = float(tab.critical_ms().max())
    top = 2.5 * max(crit, lp.f_min + tab.area_min_ms() / cm.cluster.num_gpus / m)
    r_cap = 2.0 * top
    caps = np.linspace(lp.pooled * lp.f_min, r_cap, 600)
    raised = 0
    for b in np.linspace(crit, top, 6)[1:]:
        box = ((crit, float(b)),)
        first, settled = lp.first_probe(box, r_cap)
        if settled:
            continue
        scan = max(min(lp.solve(box, float(r)), crit + float(r)) for r in caps)
        value = lp.refine(box, r_cap, first, 2e-3)
        assert value <= scan + (caps[1] - caps[0]) + 1e-6  # no more than the scan proves ...
        assert value >= scan * (1 - 2e-3) - 1e-6  # ... and as much
        raised += value > first * 1.005
    assert raised >= 2


@pytest.mark.parametrize("tails", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_lp_bound_with_buckets_of_slow_sequences_is_valid(seed, tails, monkeypatch):
    """With few single sequences, buckets hold sequences too slow to share a group within the
    level (their members count one group each, and the memory their groups cannot fill as used):
    the bound still never passes the brute-force optimum, with one to three explicit
    micro-batches, and proves most of it; with the long buckets counting their members one by one
    (``tails``) and with every bucket counted at its shortest member."""
    import functools

    from megatron_flexsp.planner import bound as bound_mod
    from megatron_flexsp.planner.bound import bound_units
    from megatron_flexsp.planner.heuristics import min_micro_batches
    from tests.unit.test_planner import brute_force_step_ms

    rng = np.random.default_rng(300 + seed)
    cm = tiny_cost_model(overhead_ms=float(rng.choice([1.0, 5.0])))
    lens = np.concatenate([rng.integers(120, 300, size=int(rng.integers(2, 4))),
                           rng.integers(10, 120, size=int(rng.integers(2, 4)))])
    tab = Tables(lens, cm)
    opt = brute_force_step_ms(tuple(int(x) for x in lens), cm)
    single = int(rng.integers(0, 2))
    monkeypatch.setattr(bound_mod, "bound_units",
                        functools.partial(bound_units, max_single=single, num_buckets=2))
    if not tails:
        from megatron_flexsp.planner import step_lp

        monkeypatch.setattr(step_lp, "TAIL_SHARE", 2.0)
    assert any(not s for _, s in bound_mod.bound_units(tab))
    r = lp_step_bound(tab, target_ms=1.5 * opt, max_solves=1500, max_extra=6 - min_micro_batches(tab),
                      max_explicit=3, switch_after=100)
    assert r.bound_ms <= opt * (1 + 1e-6), (lens.tolist(), single, r.bound_ms, opt)
    assert r.bound_ms >= 0.7 * opt, (lens.tolist(), r.bound_ms, opt)


def test_bucketed_documents_too_slow_to_share_a_group_count_one_each(monkeypatch):
    """Bimodal documents on 1024 GPUs (8,192 per step, about 40 of 128-196K tokens, more than the
    LP's 24 singles): with every micro-batch explicit, the LP once put two bucketed 196K documents
    in one group of 64 within a level where each alone takes over half the group's time (bound
    17.66 s against plans of 19.6 s). Counting such bucket members one group each, and the memory
    their groups cannot fill, proves over 18.5 s; counting each member of the long buckets by its
    own work (a 172-186K bucket held members that can and members that cannot share a group with
    a 196K one, all counted as its shortest), over 19.0 s."""
    from megatron_flexsp.planner import step_lp
    from megatron_flexsp.planner.bound import step_bound
    from megatron_flexsp.sim.corpora import synthetic_lengths
    from megatron_flexsp.sim.workloads import sample_batches
    from tests.unit.test_packing import _paper_cluster

    cm = _paper_cluster(1024)
    batch = sample_batches(synthetic_lengths("bimodal", seed=1), global_batch=8192, num_batches=2, seed=0,
                           max_seq_len=196608)[0][1]
    tab = Tables(np.minimum(batch, cm.max_tokens), cm)
    assert int((tab.lens >= 131072).sum()) > 24

    def bound() -> float:
        return step_bound(tab, 3, target_ms=19561.0, t1_lo=float(tab.critical_ms().max()), max_solves=400,
                          explicit=3).bound_ms

    assert bound() >= 19000.0
    monkeypatch.setattr(step_lp, "TAIL_SHARE", 2.0)  # no bucket counts its members one by one
    assert bound() >= 18500.0


@pytest.mark.parametrize("seed", range(4))
def test_a_count_is_searched_only_once_its_floor_is_the_lowest(seed, monkeypatch):
    """Given each count's exact optimum as its floor, the bound builds the LP of a micro-batch
    count only when that floor is at or below the bound it ends with (the others keep their
    floors, valid as they are), and the result never passes the optimum."""
    from megatron_flexsp.planner import bound as bound_mod
    from megatron_flexsp.planner.heuristics import min_micro_batches
    from tests.unit.test_planner import brute_force_step_ms

    cm, lens, opt = many_micro_batch_instance(seed)
    tab = Tables(np.asarray(lens), cm)
    m0 = min_micro_batches(tab)
    floors = {c: brute_force_step_ms(tuple(int(x) for x in lens), cm, count=c) for c in range(m0, m0 + 3)}
    built = []

    class Counting(bound_mod.CountSearch):
        def __init__(self, tab, m, *args, **kw):
            built.append(m)
            super().__init__(tab, m, *args, **kw)

    monkeypatch.setattr(bound_mod, "CountSearch", Counting)
    r = lp_step_bound(tab, target_ms=1.5 * opt, max_solves=300, max_extra=2, count_floor=floors)
    assert r.bound_ms <= opt * (1 + 1e-6)
    for c in set(built):
        assert floors[c] <= r.bound_ms * (1 + 1e-9), (c, floors, r.bound_ms)
    skipped = set(range(m0, m0 + 3)) - set(built)
    assert all(floors[c] >= r.bound_ms * (1 - 1e-9) for c in skipped)


def test_a_count_search_never_gives_back_a_bound_it_proved():
    """A box's halves are first bounded by one solve each, which can prove less than the refined
    bound of the box they split (here 27.09 against 27.16-27.22 ms, again and again): they keep
    that bound, so a count's bound never falls while its search goes on (a deadline may stop it
    anywhere), and it stays below the plan found."""
    from megatron_flexsp.planner.bound import CountSearch, bound_units

    cm = tiny_cost_model(num_gpus=8)
    lens = np.array([89, 38, 48, 55, 42, 59, 102, 61, 91, 112, 292])
    tab = Tables(lens, cm)
    plan_ms = plan_step(lens, cm).predicted_step_ms
    search = CountSearch(tab, 2, bound_units(tab, max_single=6, num_buckets=4), target_ms=plan_ms,
                          rel_tol=0.002, t1_lo=float(tab.critical_ms().max()), t1_hi=math.inf, explicit=1)
    seen = []
    while not search.done() and search.solves < 200:
        search.step()
        seen.append(search.bound)
    assert len(seen) > 10 and seen == sorted(seen), seen
    assert 27.2 <= seen[-1] <= plan_ms


def test_second_pass_with_wide_units_keeps_the_first_and_stays_valid(monkeypatch):
    """The bound searches with few units placed one by one first and, once that pass converged
    below the target, again with :data:`~planner.bound.WIDE_UNITS`: each count's second search
    starts with one explicit micro-batch (its solves are the quicker; with the wide units on a
    lognormal-4k step at 1,024 GPUs it rose to 15,000 ms in 1.6 s where starting with the first
    pass's three reached 14,987 ms) and goes up to more as the first did, the result is at least
    what the first pass alone proves (whatever the second pass proves by itself), and it stays
    below the brute-force optimum. (Tiny instances: the first pass forced down to 2 singles and 1
    bucket, the second to buckets alone, which proves less by itself.)"""
    from megatron_flexsp.planner import bound as bound_mod

    built = _record_two_passes(monkeypatch)
    second = deeper = 0
    for seed in range(6):
        cm, lens, opt = many_micro_batch_instance(seed)
        tab = Tables(np.asarray(lens), cm)
        monkeypatch.setattr(bound_mod, "WIDE_UNITS", {"num_buckets": 1, "max_single": 2})
        alone = lp_step_bound(tab, target_ms=1.5 * opt, max_solves=4000, max_extra=2, rel_tol=0.01)
        # a second pass that proves less alone (everything bucketed): what the first proved stays
        monkeypatch.setattr(bound_mod, "WIDE_UNITS", {"num_buckets": 1, "max_single": 0})
        built.clear()
        r = lp_step_bound(tab, target_ms=1.5 * opt, max_solves=4000, max_extra=2, rel_tol=0.01)
        assert alone.bound_ms * (1 - 1e-9) <= r.bound_ms <= opt * (1 + 1e-6), (seed, alone, r, opt)
        starts: dict[int, int] = {}
        for wide, m, k in built:
            if wide:
                assert starts.setdefault(m, k) == 1, (seed, m, k)
                second += 1
                deeper += k > 1
    assert second > 0 and deeper > 0, (second, deeper)


def test_floors_handed_over_only_to_the_first_pass(monkeypatch):
    """``refloor`` (floors proven another way, for searches stalled at their floors) belongs to
    the first pass: the wide pass starts above what the first proved and needs many solves before
    it rises, so a stall rule there stopped it after twice ``refloor_after`` solves, and only where
    the first pass had not called the hook. On tiny instances whose first pass rises at once the
    hook is never called from the wide pass, and that pass runs until it converges."""
    from megatron_flexsp.planner import bound as bound_mod

    built = _record_two_passes(monkeypatch)
    calls: list[int] = []  # wide searches built when the hook was called
    monkeypatch.setattr(bound_mod, "WIDE_UNITS", {"num_buckets": 1, "max_single": 0})
    second = 0
    for seed in range(6):
        cm, lens, opt = many_micro_batch_instance(seed)
        tab = Tables(np.asarray(lens), cm)
        built.clear()
        calls.clear()
        r = lp_step_bound(tab, target_ms=1.5 * opt, max_solves=4000, max_extra=2, rel_tol=0.01,
                          deadline=Deadline(60.0), refloor_after=2,
                          refloor=lambda: calls.append(sum(wide for wide, _, _ in built)))
        assert r.bound_ms <= opt * (1 + 1e-6), (seed, r, opt)
        assert all(c == 0 for c in calls), (seed, calls)
        second += any(wide for wide, _, _ in built)
    assert second > 0


def _record_two_passes(monkeypatch) -> list[tuple[bool, int, int]]:
    """The bound's two passes on tiny instances: the first pass's units forced to 2 singles and 1
    bucket (the wide pass's as ``WIDE_UNITS`` asks); returns the list that records every count
    search built, (no single: the wide pass, count, explicit micro-batches)."""
    from megatron_flexsp.planner import bound as bound_mod

    original = bound_mod.bound_units
    built: list[tuple[bool, int, int]] = []

    def units(tab, **kw):
        return original(tab, **(kw or {"num_buckets": 1, "max_single": 2}))

    class Counting(bound_mod.CountSearch):
        def __init__(self, tab, m, units_, *args, explicit, **kw):
            built.append((not any(single for _, single in units_), m, explicit))
            super().__init__(tab, m, units_, *args, explicit=explicit, **kw)

    monkeypatch.setattr(bound_mod, "CountSearch", Counting)
    monkeypatch.setattr(bound_mod, "bound_units", units)
    return built


def test_few_micro_batches_go_to_all_but_one_explicit_at_once(monkeypatch):
    """A count whose search with one explicit micro-batch is done is searched again with more: up
    to four micro-batches straight to three explicit, all of three and all but the last of four
    (the search with two took hundreds of LP solves on bimodal steps where three rose twice as
    fast), from five on one more at a time. Every search's bound stays below the brute-force
    optimum."""
    from megatron_flexsp.planner import bound as bound_mod

    built: list[tuple[int, int]] = []

    class Counting(bound_mod.CountSearch):
        def __init__(self, tab, m, *args, explicit, **kw):
            built.append((m, explicit))
            super().__init__(tab, m, *args, explicit=explicit, **kw)

    monkeypatch.setattr(bound_mod, "CountSearch", Counting)
    escalated = set()
    for seed in range(6):
        cm, lens, opt = many_micro_batch_instance(seed)
        tab = Tables(np.asarray(lens), cm)
        built.clear()
        r = lp_step_bound(tab, target_ms=1.5 * opt, max_solves=2000, max_extra=2)
        assert r.bound_ms <= opt * (1 + 1e-6), (seed, r.bound_ms, opt)
        for m in {c for c, _ in built}:
            ks = [k for c, k in built if c == m]
            want = [1, min(3, m)] if m <= 4 else [1, 2, 3]
            assert ks == want[:len(ks)], (seed, m, ks)
            escalated |= {(m <= 4, len(ks) > 1)}
    assert (True, True) in escalated and (False, True) in escalated, escalated


def test_long_documents_that_cannot_pair_in_memory_count_a_group_each():
    """Lognormal documents of mean 4K on 256 GPUs (2,048 per step; plans of 5 micro-batches, 14.47
    s): the relaxation ran every document of 40K tokens or more in its slowest micro-batch, filling
    the groups' memory fluidly with documents that cannot share a group with any of them (a group of
    16 holding a 56K document has no room for a 44K one). The memory pair rows count those as a
    group each: 13.51 s without them, over 13.65 s with. They need the documents of 40K tokens and
    more placed one by one: the wide units of the bound's second pass (24 singles; the first
    pass's 12 prove 13.49 s)."""
    from megatron_flexsp.planner.bound import WIDE_UNITS, bound_units, step_bound
    from megatron_flexsp.sim.corpora import synthetic_lengths
    from megatron_flexsp.sim.workloads import sample_batches
    from tests.unit.test_packing import _paper_cluster

    cm = _paper_cluster(256)
    batch = sample_batches(synthetic_lengths("lognormal-4k", seed=1), global_batch=2048, num_batches=2,
                           seed=0, max_seq_len=196608)[0][0]
    tab = Tables(np.minimum(batch, cm.max_tokens), cm)
    bound = step_bound(tab, 5, target_ms=14472.0, t1_lo=float(tab.critical_ms().max()), max_solves=600,
                       explicit=2, units=bound_units(tab, **WIDE_UNITS)).bound_ms
    assert bound >= 13650.0


def test_the_step_lp_is_well_scaled():
    """A bucket's attention work above its shortest member's rate is placed as a share, not in
    tokens^2: with tokens^2 the matrix spanned 17 orders of magnitude (8e-8 to 2e10) on a lognormal
    batch at 1,024 GPUs and the dual simplex ended 'Unknown' on boxes it could settle."""
    from megatron_flexsp.cost_model import CostModel, load_profile
    from megatron_flexsp.model_spec import get_model
    from megatron_flexsp.planner.bound import bound_units
    from megatron_flexsp.planner.step_lp import _StepLP

    cm = CostModel.from_profile(load_profile("a100-paper"), get_model("gpt-7b"), num_gpus=1024,
                                max_seq_len=196608)
    rng = np.random.default_rng(0)
    lens = np.minimum(rng.lognormal(np.log(4096) - 0.5, 1.0, 2048).astype(np.int64) + 1, 196608)
    tab = Tables(lens, cm)
    lp = _StepLP(tab, 3, bound_units(tab, num_buckets=48), k=1)
    values = np.abs(np.array(lp.h.getLp().a_matrix_.value_))
    values = values[values > 0]
    assert values.max() / values.min() < 1e9


def test_dual_simplex_trouble_is_settled_by_the_primal_simplex(monkeypatch, caplog):
    """When the dual simplex ends without a proof even from scratch, the primal simplex settles the
    box: the search goes on and the bound stays valid."""
    import highspy

    cm, lens, opt = many_micro_batch_instance(0)
    tab = Tables(np.asarray(lens), cm)
    real_status = highspy.Highs.getModelStatus

    def dual_fails(self):
        value = self.getOptionValue("simplex_strategy")
        value = value[1] if isinstance(value, tuple) else value
        return highspy.HighsModelStatus.kUnknown if value == 1 else real_status(self)

    monkeypatch.setattr(highspy.Highs, "getModelStatus", dual_fails)
    with caplog.at_level("WARNING"):
        r = lp_step_bound(tab, target_ms=opt, max_solves=2000, max_extra=2)
    simple = lp_step_bound(tab, target_ms=opt, max_solves=0, max_extra=2).bound_ms
    assert "HiGHS returned" not in caplog.text
    assert simple < r.bound_ms <= opt * (1 + 1e-6)


def test_lp_solves_stop_at_the_deadline_and_keep_what_was_proven(caplog):
    """No LP solve starts past the bound's deadline (one from scratch may take 0.3 s): a step LP
    whose deadline has passed raises without touching its options, and runs as before once the
    deadline is lifted; a bound whose deadline passes mid-search keeps the bounds proven, with
    no warning, and no placement hint is solved past its own deadline."""
    from megatron_flexsp.planner.bound import bound_units
    from megatron_flexsp.planner.search import Deadline
    from megatron_flexsp.planner.step_lp import SolverOutOfTime, _StepLP

    cm, lens, opt = many_micro_batch_instance(0)
    tab = Tables(np.asarray(lens), cm)
    lp = _StepLP(tab, 3, bound_units(tab), k=1)
    box = ((float(tab.critical_ms().max()), opt),)
    fresh = lp.solve(box, opt)
    names = ("presolve", "simplex_strategy", "simplex_iteration_limit")
    options = {k: lp.h.getOptionValue(k) for k in names}
    lp.deadline = Deadline(0.0)
    with pytest.raises(SolverOutOfTime):
        lp.solve(box, opt)
    assert {k: lp.h.getOptionValue(k) for k in options} == options
    lp.deadline = None
    assert lp.solve(box, opt) == pytest.approx(fresh, rel=1e-9)

    full = lp_step_bound(tab, target_ms=opt, max_solves=2000, max_extra=2)
    floor = lp_step_bound(tab, target_ms=opt, max_solves=0, max_extra=2).bound_ms
    with caplog.at_level("WARNING"):
        for seconds in (0.0, 0.002, 0.01):
            r = lp_step_bound(tab, target_ms=opt, max_solves=2000, max_extra=2,
                              deadline=Deadline(seconds), hints=2, hint_deadline=Deadline(0.0))
            assert floor - 1e-9 <= r.bound_ms <= full.bound_ms + 1e-9
            assert r.hints == ()
    assert caplog.text == ""
    assert lp_step_bound(tab, target_ms=opt, max_solves=2000, max_extra=2, hints=2).hints


def _without_lifted_rows(lp):
    """``lp`` with its lifted time rows switched off (free rows, never set again)."""
    for rows in lp.lift_rows:
        for row, _ in rows:
            lp.h.changeRowBounds(row, -math.inf, math.inf)
        rows.clear()
    return lp


def test_lifted_time_rows_bound_wide_boxes():
    """The lifted time rows charge a makespan above the box's low end for the time its groups use
    up to the high end: on tiny batches that fit one micro-batch no box around the brute-force
    optimum is bounded above it; and on a memory-bound lognormal step at 64 GPUs wide boxes are
    bounded higher with them than without (the LP without them, written here by freeing those
    rows: 16,023 ms against 15,791 ms with the slowest makespan from 1.5x the hardest sequence's
    fastest finish), never lower."""
    from megatron_flexsp.planner.bound import bound_units
    from megatron_flexsp.planner.heuristics import min_micro_batches
    from megatron_flexsp.planner.step_lp import _StepLP
    from tests.unit.test_packing import _batch, _paper_cluster
    from tests.unit.test_planner import brute_force_step_ms

    cm = tiny_cost_model()
    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(12):
        lens = tuple(int(x) for x in rng.integers(20, 190, int(rng.integers(2, 6))))
        tab = Tables(np.asarray(lens), cm)
        opt = brute_force_step_ms(lens, cm, count=1)
        if not math.isfinite(opt):
            continue
        lp = _StepLP(tab, 1, bound_units(tab), k=1)
        for lo, hi in ((0.5, 1.0), (0.9, 1.0), (1.0, 2.0), (0.6, 3.0)):
            box = ((float(tab.critical_ms().max()) * lo if lo < 1 else opt, opt * hi),)
            if box[0][0] <= opt <= box[0][1]:
                assert lp.solve(box, 0.0) <= opt * (1 + 1e-6), (lens, box, opt)
                checked += 1
    assert checked >= 10

    cm = _paper_cluster(64)
    tab = Tables(_batch("lognormal-4k", 512, cm), cm)
    crit, m, units = float(tab.critical_ms().max()), min_micro_batches(tab), bound_units(tab)
    lifted, plain = _StepLP(tab, m, units, k=2), _without_lifted_rows(_StepLP(tab, m, units, k=2))
    raised = 0
    for low, width in ((1.0, 0.25), (1.0, 1.0), (1.5, 0.25), (1.5, 1.0)):
        box = ((low * crit, low * crit * (1 + width)), (0.5 * low * crit, low * crit * (1 + width)))
        with_rows, without = lifted.solve(box, 3 * m * crit), plain.solve(box, 3 * m * crit)
        assert math.isfinite(without) and with_rows >= without * (1 - 1e-9)
        raised += with_rows > without * 1.002
    assert raised >= 3


def test_a_second_pass_out_of_time_at_its_first_build_keeps_the_first_pass_bounds(monkeypatch):
    """When the first pass has converged and the second (more units placed one by one) runs out
    of time building its first count's search, that count keeps what the first pass proved: the
    result is the first pass's bound, not the first pass's bound for the other counts (which is
    the target here, every larger count's floor being above it)."""
    from megatron_flexsp.planner import bound as B
    from megatron_flexsp.planner.step_lp import SolverOutOfTime
    from tests.unit.test_packing import _batch, _paper_cluster

    cm = _paper_cluster(64)
    tab = Tables(_batch("lognormal-1k", 256, cm), cm)
    small = B.bound_units(tab)
    assert len(B.bound_units(tab, **B.WIDE_UNITS)) > len(small)  # two passes
    target = 1.3 * step_floors(tab).at_least(1)
    with monkeypatch.context() as m:
        m.setattr(B, "WIDE_UNITS", {"num_buckets": 8, "max_single": 12})  # one pass: the first alone
        first = lp_step_bound(tab, target_ms=target, max_solves=5000)
    assert first.bound_ms < target * 0.99 and first.by_count

    built = B._Counts._new

    def out_of_time_in_the_second_pass(self, m, **kw):
        if len(self.units) > len(small):
            raise SolverOutOfTime("LP bound: out of time (test)")
        return built(self, m, **kw)

    monkeypatch.setattr(B._Counts, "_new", out_of_time_in_the_second_pass)
    both = lp_step_bound(tab, target_ms=target, max_solves=5000)
    assert both.bound_ms == pytest.approx(first.bound_ms, rel=1e-9)
    assert dict(both.by_count) == pytest.approx(dict(first.by_count), rel=1e-9)
