"""The asynchronous planner: solver plans within the budget, fallback when late, failed or dead."""

import os
import subprocess
import sys
import signal
import time

import numpy as np
import pytest

from megatron_flexsp.planner.service import PlanService

LENS = np.array([9000, 300, 1200, 50, 4000, 700, 2500, 80] * 8)


@pytest.fixture
def small_cm():
    from megatron_flexsp.cost_model import CostModel, load_profile
    from megatron_flexsp.model_spec import get_model

    return CostModel.from_profile(load_profile("a100-paper"), get_model("gpt-7b"), num_gpus=16,
                                  max_seq_len=16384)


def test_solver_plan_within_budget_and_lookahead(small_cm):
    svc = PlanService(small_cm, max_seq_len=16384, wait_budget_s=120)
    try:
        svc.request(0, LENS)
        svc.request(1, LENS[::-1])
        a = svc.take(0, LENS)
        b = svc.take(1, LENS[::-1])
        assert a.source == "solver" and b.source == "solver"
        assert a.plan.strategy == "flexsp" and list(a.plan.seq_lens) == LENS.tolist()
        assert list(b.plan.seq_lens) == LENS[::-1].tolist()
        # each solve reports the solver process's CPU time; the service sums them
        assert a.solver_cpu_s > 0 and b.solver_cpu_s > 0
        assert svc.solver_cpu_s == pytest.approx(a.solver_cpu_s + b.solver_cpu_s)
    finally:
        svc.close()
    assert not svc.alive


def test_late_solver_falls_back_and_discards_the_late_plan(small_cm):
    svc = PlanService(small_cm, max_seq_len=16384, wait_budget_s=0.2, delay_s=1.5)
    try:
        svc.request(0, LENS)
        limit = time.perf_counter() + 60
        while svc._current != 0 and time.perf_counter() < limit:  # the solver has begun step 0
            svc._drain(0.05)
        t0 = time.perf_counter()
        out = svc.take(0, LENS)
        assert out.source == "fallback-late" and out.plan.strategy == "batchada"
        assert time.perf_counter() - t0 < 1.5  # did not wait for the solver
        svc.wait_budget_s = 60
        svc.request(1, LENS[:16])
        t0 = time.perf_counter()
        busy = svc.take(1, LENS[:16])  # the solver is still on step 0: no waiting at all
        assert busy.source == "fallback-busy" and time.perf_counter() - t0 < 1.0, busy
        time.sleep(2.0)  # the solver finishes step 0 (dropped: late) and skips step 1 (taken)
        svc.request(2, LENS[:24])
        nxt = svc.take(2, LENS[:24])
        assert nxt.source == "solver" and len(nxt.plan.seq_lens) == 24
    finally:
        svc.close()


def test_failed_solve_and_dead_solver_fall_back_without_hanging(small_cm):
    svc = PlanService(small_cm, strategy="no-such-strategy", max_seq_len=16384, wait_budget_s=60)
    try:
        out = svc.take(0, LENS)
        assert out.source == "fallback-error" and "no-such-strategy" in out.note
    finally:
        svc.close()
    svc = PlanService(small_cm, max_seq_len=16384, wait_budget_s=30, delay_s=20)
    try:
        svc.request(0, LENS)
        time.sleep(0.5)
        os.kill(svc._proc.pid, signal.SIGKILL)
        t0 = time.perf_counter()
        out = svc.take(0, LENS)
        assert out.source == "fallback-crash" and time.perf_counter() - t0 < 10
        assert svc.restarts == 1 and svc.alive
    finally:
        svc.close()


def test_bad_budget_and_priority_are_refused(small_cm):
    with pytest.raises(ValueError, match="wait_budget_s=-1"):
        PlanService(small_cm, wait_budget_s=-1)
    with pytest.raises(ValueError, match="priority='high'"):
        PlanService(small_cm, priority="high")


def _sched_idle_allowed() -> bool:
    """Whether a process may switch itself to SCHED_IDLE here (it needs no privilege on Linux, but
    some sandboxes refuse it)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    code = "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.parametrize("priority", ["idle", "low"])
def test_solver_priority_is_below_training(small_cm, priority):
    """The solver process runs at the CPU priority asked for: SCHED_IDLE where the system allows it
    (else nice 19, said in a warning), nice 19 for ``low``."""
    svc = PlanService(small_cm, max_seq_len=16384, wait_budget_s=120, priority=priority)
    try:
        assert svc.take(0, LENS[:8]).source == "solver"
        pid = svc._proc.pid
        lowered = os.getpriority(os.PRIO_PROCESS, pid) >= min(19, os.getpriority(os.PRIO_PROCESS, 0) + 1)
        if priority == "idle" and _sched_idle_allowed():
            assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        else:
            assert lowered and (not hasattr(os, "SCHED_IDLE") or os.sched_getscheduler(pid) != os.SCHED_IDLE)
    finally:
        svc.close()
