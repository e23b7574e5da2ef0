"""Re-solving a HiGHS LP from the basis of its last solve, with fallbacks when that goes wrong.

The bounds (:mod:`planner.step_lp`, :mod:`planner.slot_bound`) change a few coefficients or column
bounds between solves and re-solve from the last basis. A hot start may end neither optimal nor
infeasible ('Unknown' after coefficient changes, or at a limit): the LP is then solved again from
scratch, then with presolve, then with the primal simplex (the dual simplex ended 'Unknown' on a
box of a lognormal step at 1,024 GPUs that the primal simplex and the interior point method both
prove infeasible). Any other end proves nothing, so callers raise rather than read it as
"infeasible", which would raise a bound without proof.
"""

from __future__ import annotations

from typing import Callable

import highspy

__all__ = ["DUAL_SIMPLEX", "HOT_START_S", "PRIMAL_SIMPLEX", "SCRATCH_S", "resolve"]

#: Seconds a hot-started solve may take (they take 2-25 ms; one in a thousand ran into numerical
#: trouble for 0.7 s and ended 'Unknown') and each solve from scratch after it (30-50 ms)
HOT_START_S = 0.08
SCRATCH_S = 0.3
#: HiGHS ``simplex_strategy`` values
DUAL_SIMPLEX, PRIMAL_SIMPLEX = 1, 4
_SETTLED = (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kInfeasible)
#: (presolve, simplex strategy) of each solve from scratch after a hot start that settled nothing
_FALLBACKS = (("off", DUAL_SIMPLEX), ("on", DUAL_SIMPLEX), ("on", PRIMAL_SIMPLEX))


def resolve(h: highspy.Highs, limit: Callable[[float], float] | None = None) -> tuple[highspy.HighsModelStatus, int]:
    """Run ``h`` from its current basis, then from scratch while the status is neither optimal nor
    infeasible (see the module docstring). Returns (the last status, solves run).

    ``limit(seconds)``: the seconds a solve may take given its default (:data:`HOT_START_S` for the
    hot start, :data:`SCRATCH_S` for each fallback), e.g. capped by a deadline (it may raise to stop
    before a solve); None leaves HiGHS's time limit alone. Options the fallbacks change (presolve,
    simplex strategy, iteration limit) are restored before returning.
    """
    if limit is not None:
        h.setOptionValue("time_limit", h.getRunTime() + limit(HOT_START_S))  # HiGHS's clock is cumulative
    h.run()
    runs, status = 1, h.getModelStatus()
    if status in _SETTLED:
        return status, runs
    saved = {key: _option(h, key) for key in ("presolve", "simplex_strategy", "simplex_iteration_limit")}
    try:
        for presolve, strategy in _FALLBACKS:
            h.setOptionValue("presolve", presolve)
            h.setOptionValue("simplex_strategy", strategy)
            h.setOptionValue("simplex_iteration_limit", 2**31 - 1)
            if limit is not None:
                h.setOptionValue("time_limit", h.getRunTime() + limit(SCRATCH_S))
            h.clearSolver()
            h.run()
            runs, status = runs + 1, h.getModelStatus()
            if status in _SETTLED:
                break
    finally:
        for key, value in saved.items():
            h.setOptionValue(key, value)
    return status, runs


def _option(h: highspy.Highs, key: str):
    """An option's value (highspy returns (status, value) or the value, by version)."""
    got = h.getOptionValue(key)
    return got[1] if isinstance(got, tuple) else got
