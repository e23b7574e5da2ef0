"""What the micro-batch MILP reports as proven (``planner.exact.refine_micro_batches_of``): a
micro-batch counts as proven only where the MILP's dual bound is within the tolerance of its
makespan as it ends, and that claim holds against the brute-force optimum of the same sequences in
one micro-batch."""

import dataclasses

import numpy as np

from megatron_flexsp.config import PlannerConfig
from megatron_flexsp.planner import exact, plan_step
from megatron_flexsp.planner import heuristics as H
from megatron_flexsp.planner.layout import Tables
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.search import Deadline
from tests.unit.helpers import tiny_cost_model
from tests.unit.test_planner import brute_force_step_ms


def _run(cm, cfg) -> tuple[int, int, int]:
    """The micro-batch MILP on single-GPU layouts of one micro-batch (often above the best
    packing): (solved, improved, proven) summed over the seeds, checked against brute force."""
    totals = np.zeros(3, dtype=int)
    for seed in range(40):
        rng = np.random.default_rng(seed)
        lens = rng.integers(5, 120, size=int(rng.integers(2, 6)))
        tab = Tables(lens, cm)
        found = H.best_homogeneous(tab, [1])
        if found is None or len(found[0]) != 1:
            continue
        layout = found[0]
        before = tab.step_ms(layout)
        got = exact.refine_micro_batches_of(layout, tab, LevelPacker(tab), cfg, Deadline(30.0))
        solved, improved, proven = got
        assert 0 <= proven <= solved <= 1 and improved <= solved
        assert tab.step_ms(layout) <= before * (1 + 1e-9)
        if proven:
            opt = brute_force_step_ms(tuple(int(x) for x in lens), cm, count=1)
            assert tab.step_ms(layout) * (1 - cfg.rel_gap) <= opt * (1 + 1e-6), (seed, lens, opt)
        totals += got
    return tuple(int(x) for x in totals)


def test_micro_batches_counted_as_proven_are_within_the_tolerance_of_their_optimum(monkeypatch):
    cm, cfg = tiny_cost_model(), PlannerConfig()
    solved, improved, proven = _run(cm, cfg)
    assert solved > 0 and improved > 0 and proven > 0, (solved, improved, proven)
    # a dual bound too low to prove anything: nothing counts as proven, the plans still improve
    real = exact.solve_step_milp

    def weak(*args, **kw):
        res = real(*args, **kw)
        return dataclasses.replace(res, dual_bound_ms=0.5 * res.dual_bound_ms)

    monkeypatch.setattr(exact, "solve_step_milp", weak)
    assert _run(cm, cfg) == (solved, improved, 0)


def test_the_plan_says_when_the_step_milp_raised_its_bound():
    """With the LP bound off, the step MILP's dual bound is what lifts the bound above the simple
    one on small instances (it proves their optimum): ``milp_raised_bound`` says so exactly when
    the plan's bound is above the simple bound."""
    from megatron_flexsp.planner.api import simple_bounds
    from tests.unit.test_planner import EXACT, small_instance

    cfg = dataclasses.replace(EXACT, bound_lp_solves=0)
    raised = 0
    for seed in range(8):
        cm, lens, opt = small_instance(seed)
        plan = plan_step(lens, cm, config=cfg)
        simple = simple_bounds(Tables(np.asarray(lens), cm)).base
        above = plan.lower_bound_ms > min(simple, plan.predicted_step_ms) * (1 + 1e-9)
        assert plan.info.get("milp_raised_bound", False) == above, (seed, plan.lower_bound_ms, simple)
        assert plan.lower_bound_ms <= opt * (1 + 1e-6)
        raised += above
    assert raised > 0
