"""Neighbourhoods of micro-batches re-planned: a valid plan, never slower, deterministic, and faster
where three micro-batches were mixed badly; the touch-up turns to them once its other moves stall."""

import numpy as np
import pytest

from megatron_flexsp.plan import validate_plan
from megatron_flexsp.planner import polish
from megatron_flexsp.planner.layout import Tables, to_step_plan
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.neighbourhood import FAMILIES, replan_neighbourhoods
from megatron_flexsp.planner.search import Deadline
from tests.unit.test_packing import _paper_cluster


def _three_mixed_badly():
    """Three documents of 60K tokens, one in each of three micro-batches of short ones, each packed
    at its smallest level: (tables, packer, layout)."""
    cm = _paper_cluster(64)
    rng = np.random.default_rng(0)
    lens = np.array([60_000] * 3 + rng.integers(200, 2000, size=450).tolist())
    tab = Tables(lens, cm)
    packer = LevelPacker(tab)
    parts = [np.r_[j, np.arange(3 + 150 * j, 3 + 150 * (j + 1))] for j in range(3)]
    return tab, packer, [packer.min_level(p)[1] for p in parts]


def _seqs(layout):
    return sorted(i for mb in layout for g in mb for i in g.seqs)


def test_three_micro_batches_mixed_badly_are_planned_again_faster():
    """Pooled, the three long documents share a micro-batch and the short ones fill fewer others:
    the first family that finds a faster plan takes 9.9% off, every sequence once, the plan valid."""
    tab, packer, layout = _three_mixed_badly()
    before = tab.step_ms(layout)
    assert replan_neighbourhoods(layout, packer, Deadline(), tries=len(FAMILIES)) == 1
    assert tab.step_ms(layout) < 0.95 * before
    assert _seqs(layout) == list(range(len(tab.lens)))
    validate_plan(to_step_plan(layout, tab, strategy="flexsp", method="neighbourhoods"))


def test_neighbourhoods_are_deterministic_and_never_slower():
    tab, packer, layout = _three_mixed_badly()
    replan_neighbourhoods(layout, packer, Deadline(), tries=len(FAMILIES))
    again = tab.clone_layout(layout)
    first = tab.clone_layout(layout)
    ms = tab.step_ms(layout)
    got = replan_neighbourhoods(layout, packer, Deadline(), tries=8, seed=5)
    assert tab.step_ms(layout) <= ms * (1 + 1e-12)
    assert (got == 1) == (tab.step_ms(layout) < ms * (1 - 1e-9))
    assert replan_neighbourhoods(again, packer, Deadline(), tries=8, seed=5) == got
    assert [[g.seqs for g in mb] for mb in again] == [[g.seqs for g in mb] for mb in layout]
    # past the deadline, or with fewer micro-batches than a neighbourhood holds: nothing changes
    assert replan_neighbourhoods(first, packer, Deadline(0.0), tries=8) == 0
    assert replan_neighbourhoods(first[:2], packer, Deadline(), tries=8) == 0
    assert tab.step_ms(first) == ms


@pytest.mark.parametrize("tries,size", [(-1, 3), (4, 1)])
def test_bad_arguments_are_refused(tries, size):
    tab, packer, layout = _three_mixed_badly()
    with pytest.raises(ValueError, match="tries="):
        replan_neighbourhoods(layout, packer, Deadline(), tries=tries, size=size)


def test_touch_up_replans_neighbourhoods_once_its_other_moves_stall(monkeypatch):
    """With the local search, exchanges and the touch-up's other moves finding nothing, the
    neighbourhoods still take the badly mixed micro-batches apart; with them gone too, nothing
    changes."""
    for name in ("shed_slowest_groups", "reseed_micro_batches", "split_slowest", "resplit_pairs",
                 "balance_groups", "improve_layout"):
        monkeypatch.setattr(polish, name, lambda *a, **k: 0)
    tab, packer, layout = _three_mixed_badly()
    still = tab.clone_layout(layout)
    before = tab.step_ms(layout)
    polish.touch_up(layout, tab, Deadline(), packer)
    assert tab.step_ms(layout) < 0.9 * before
    assert _seqs(layout) == list(range(len(tab.lens)))
    monkeypatch.setattr(polish, "replan_neighbourhoods", lambda *a, **k: 0)
    polish.touch_up(still, tab, Deadline(), packer)
    assert tab.step_ms(still) == before
