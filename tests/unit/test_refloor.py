"""Floors raised while the LP bound searches (planner.bound's ``refloor``) and the finer slot LP
that gives them in the planner (planner.api._finer_slot): valid, called once, reaching the
searches already built, and raising the bound of a step whose slot bound binds."""

import numpy as np
import pytest

from megatron_flexsp.config import PlannerConfig
from megatron_flexsp.plan import validate_plan
from megatron_flexsp.planner import heuristics as H
from megatron_flexsp.planner import plan_step
from megatron_flexsp.planner.api import _finer_slot, slot_lp
from megatron_flexsp.planner.bound import _Counts, bound_units, lp_step_bound
from megatron_flexsp.planner.floors import step_floors
from megatron_flexsp.planner.layout import Tables
from megatron_flexsp.planner.search import Deadline
from tests.unit.test_level_bound import many_micro_batch_instance
from tests.unit.test_packing import _batch, _paper_cluster
from tests.unit.test_planner import brute_force_step_ms


def _exact_floors(seed):
    """A tiny step of 3-6 micro-batches, its optimum, and each count's own optimum (brute force)
    for the counts the LP bound searches one by one (the memory minimum and two more)."""
    cm, lens, opt = many_micro_batch_instance(seed)
    tab = Tables(np.asarray(lens), cm)
    m0 = H.min_micro_batches(tab)
    exact = {c: brute_force_step_ms(tuple(int(x) for x in lens), cm, count=c) for c in range(m0, m0 + 3)}
    return tab, opt, exact


@pytest.mark.parametrize("seed", range(4))
def test_floors_handed_over_when_the_searches_stall_are_used_once_and_stay_valid(seed):
    """Each count's exact optimum handed over (and the step's optimum for every count past them,
    which every plan takes at least): the hook is called once, here at once (no time has to pass),
    and the bound is the optimum, never below what the searches alone prove."""
    tab, opt, exact = _exact_floors(seed)
    calls = []

    def refloor():
        calls.append(1)
        return exact, opt

    plain = lp_step_bound(tab, target_ms=1.5 * opt, max_solves=300, max_extra=2, deadline=Deadline(60.0))
    raised = lp_step_bound(tab, target_ms=1.5 * opt, max_solves=300, max_extra=2, deadline=Deadline(60.0),
                           refloor=refloor, refloor_after=0)
    assert calls == [1]
    assert opt * (1 - 1e-9) <= raised.bound_ms <= opt * (1 + 1e-6)
    assert plain.bound_ms <= raised.bound_ms * (1 + 1e-9)
    # a hook with nothing to give leaves the searches to themselves
    none = lp_step_bound(tab, target_ms=1.5 * opt, max_solves=300, max_extra=2, deadline=Deadline(60.0),
                         refloor=lambda: None, refloor_after=0)
    assert none.bound_ms <= opt * (1 + 1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_raised_floors_reach_the_count_searches_already_built(seed):
    """Floors raised after some counts' searches are built lift those searches' bounds as well as
    the counts still waiting; the hook is gone once called."""
    tab, opt, exact = _exact_floors(seed)
    run = _Counts(tab, bound_units(tab), target_ms=1.5 * opt, max_extra=2, rel_tol=0.002, deadline=None,
                  max_explicit=3, switch_after=120, count_floor={}, beyond_floor=0.0, hints=0, refine_above=0,
                  floors=step_floors(tab), start={})
    run.search(3)
    assert run.found  # the lowest count's search is built
    run.refloor = lambda: (exact, opt)
    run._raise_floors()
    assert run.refloor is None
    for c, s in run.found.items():
        assert s.bound >= (exact[c] if c < run.last else opt) * (1 - 1e-12), (c, s.bound)
    for c, v in run.waiting.items():
        assert v >= (exact[c] if c < run.last else opt) * (1 - 1e-12), (c, v)
    got = run.result(run.solves)
    assert opt * (1 - 1e-9) <= got.bound_ms <= opt * (1 + 1e-6)


def test_the_finer_slot_lp_raises_the_bound_of_a_step_of_many_micro_batches():
    """Lognormal documents (mean 16K tokens, 2,048) at 256 GPUs need about 20 micro-batches; there
    the slot bound binds (the LP bound's searches raise none of its counts). The finer slot LP
    proves more at every count it is asked for (85,311 ms to 85,736 ms at 20), stays below the
    plan, and gives nothing once its deadline is too near."""
    cm = _paper_cluster(256)
    tab = Tables(_batch("lognormal-16k", 2048, cm), cm)
    cfg, info = PlannerConfig(), {}
    slot = slot_lp(tab, cfg, info)
    got = _finer_slot(tab, cfg, info, Deadline(60.0))()
    assert got is not None
    by_count, beyond = got
    assert set(by_count) == set(slot.by_count)
    for c, v in by_count.items():
        assert v >= slot.by_count[c] * (1 - 1e-9), (c, v, slot.by_count[c])
    assert min(by_count.values()) >= 1.004 * slot.bound_ms
    last = H.min_micro_batches(tab) + cfg.max_extra_micro_batches
    assert beyond >= slot.at_least(last + 1) * (1 - 1e-9)
    assert info["slot_refined_ms"] >= 1.004 * slot.bound_ms
    plan = plan_step(tab.lens, cm, config=PlannerConfig(time_budget_s=1.0))
    validate_plan(plan)
    m = len(plan.micro_batches)  # the plan's own count is bounded by its value there
    assert (by_count[m] if m in by_count and m <= last else beyond) <= plan.predicted_step_ms
    assert _finer_slot(tab, cfg, {"slot_time_s": info["slot_time_s"]}, Deadline(0.0))() is None


@pytest.mark.parametrize("seed", range(3))
def test_searches_stalled_above_the_raised_floors_give_back_their_time(seed):
    """Floors the searches cannot pass (each count's exact optimum, from the start and again from
    the hook): once raised, the searches stop after as many solves again instead of splitting
    boxes on, and the bound is still the optimum."""
    tab, opt, exact = _exact_floors(seed)
    after = 4
    kw = dict(target_ms=1.5 * opt, max_solves=300, max_extra=2, count_floor=exact, beyond_floor=opt)
    plain = lp_step_bound(tab, deadline=Deadline(60.0), **kw)
    r = lp_step_bound(tab, deadline=Deadline(60.0), refloor=lambda: (exact, opt), refloor_after=after, **kw)
    assert opt * (1 - 1e-9) <= r.bound_ms <= opt * (1 + 1e-6)
    # the checks run between search steps, and a step may take a few solves (the pooled cap's
    # refinement)
    assert r.lp_solves <= 2 * after + 12 < plain.lp_solves, (r.lp_solves, plain.lp_solves)


@pytest.mark.parametrize("seed", range(4))
def test_the_deeper_search_stays_below_the_optimum(seed):
    """Tiny steps of 3-6 micro-batches (brute-force optimum): searched again with three explicit
    micro-batches from where a short first search ended, the bound rises or stays, never above
    the optimum, nor above any count's own optimum."""
    from megatron_flexsp.planner.bound import deeper_bound

    tab, opt, exact = _exact_floors(seed)
    first = lp_step_bound(tab, target_ms=1.5 * opt, max_solves=6, max_extra=2, deadline=Deadline(60.0))
    deeper = deeper_bound(tab, first, target_ms=1.5 * opt, max_solves=300, max_extra=2, deadline=Deadline(60.0))
    assert first.bound_ms <= deeper.bound_ms <= opt * (1 + 1e-6), (first.bound_ms, deeper.bound_ms, opt)
    got = dict(deeper.by_count)
    for c, v in exact.items():  # each count the searches bound one by one, at most its own optimum
        assert got.get(c, deeper.rest_ms) <= v * (1 + 1e-6), (c, got, exact)


def test_searches_stalled_at_the_slot_bound_go_on_deeper_with_the_time_they_left():
    """Lognormal documents (mean 4K tokens, 1,024 at 64 GPUs, the second step): the slowest
    micro-batch alone, then two, stay below the finer slot bound (26,996 ms) at ten micro-batches,
    and the searches stall there. Searched again with three explicit micro-batches from the start
    (``deeper_bound``), above what the first proved, the bound passes 27,200 ms within 300 solves
    (27,308 ms converged), still below the best plan (27,815 ms); per count it never drops below
    the first search's, and without time it is the first search's."""
    from megatron_flexsp.planner.bound import deeper_bound
    from megatron_flexsp.sim.corpora import synthetic_lengths
    from megatron_flexsp.sim.workloads import sample_batches

    cm = _paper_cluster(64)
    batch = sample_batches(synthetic_lengths("lognormal-4k", seed=1), global_batch=1024, num_batches=2, seed=0,
                           max_seq_len=196608)[0][1]
    tab = Tables(np.minimum(batch, cm.max_tokens), cm)
    cfg, info = PlannerConfig(), {}
    slot = slot_lp(tab, cfg, info)
    last = H.min_micro_batches(tab) + cfg.max_extra_micro_batches
    kw = dict(target_ms=27_944.0, max_extra=cfg.max_extra_micro_batches)
    first = lp_step_bound(tab, max_solves=300, deadline=Deadline(60.0),
                          refloor=_finer_slot(tab, cfg, info, Deadline(60.0)), count_floor=slot.by_count,
                          beyond_floor=slot.at_least(last + 1), **kw)
    assert first.lp_solves < 100 and first.bound_ms < 27_000.0  # stalled at the slot bound
    deeper = deeper_bound(tab, first, max_solves=300, deadline=Deadline(60.0), **kw)
    assert 27_200.0 <= deeper.bound_ms <= 27_814.0, deeper
    assert deeper.lp_solves > first.lp_solves and deeper.rest_ms >= first.rest_ms
    for c, v in first.by_count:
        assert dict(deeper.by_count)[c] >= v
    assert deeper_bound(tab, first, max_solves=300, deadline=Deadline(0.0), **kw).bound_ms == first.bound_ms


def test_repacking_the_fastest_micro_batches_by_memory():
    """A shelf layout of GitHub-like files (1,024 at 64 GPUs, six micro-batches): its fastest
    micro-batches packed by memory again fit five, over 1.5% faster; every sequence stays once,
    within memory. Past its deadline, or where no packing is faster, nothing changes."""
    from megatron_flexsp.planner.layout import to_step_plan
    from megatron_flexsp.planner.tail import repack_tail
    from tests.unit.test_tail import _seq_sets, _shelves

    tab, _, layout = _shelves("github", 1024, 64)
    before, count = tab.step_ms(layout), len(layout)
    sets = [_seq_sets(mb) for mb in layout]
    assert repack_tail(layout, tab, Deadline(0.0)) == 0
    assert [_seq_sets(mb) for mb in layout] == sets
    assert repack_tail(layout, tab, Deadline()) >= 1
    assert tab.step_ms(layout) < 0.985 * before and len(layout) < count
    assert sorted(i for mb in layout for g in mb for i in g.seqs) == list(range(len(tab.lens)))
    validate_plan(to_step_plan(layout, tab, strategy="flexsp", method="tail"))
    tab, _, layout = _shelves("lognormal-4k", 512, 64)
    sets = [_seq_sets(mb) for mb in layout]
    assert repack_tail(layout, tab, Deadline()) == 0
    assert [_seq_sets(mb) for mb in layout] == sets
