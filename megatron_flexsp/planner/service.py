"""Planning off the critical path: a solver process, a wait budget and a fast fallback.

:class:`PlanService` runs :func:`plan_step` in a separate process (``spawn``: never a fork of a
process holding communicators or threads). The caller asks for step ``k``'s plan with
:meth:`PlanService.request` as early as it knows the batch's lengths (while step ``k-1`` trains) and
collects it with :meth:`PlanService.take` when step ``k`` starts: if the solver's plan is not there
within the wait budget, a fallback plan is made in-process (a fast baseline, milliseconds) and the
late solution is discarded when it arrives; when the solver is still busy with an earlier step the
step does not wait at all. The solver skips requested steps that have been taken meanwhile. A dead solver is restarted and a failed solve (an exception, an infeasible model)
yields the fallback with a warning: never a hang.

Stdlib + the planner only (no torch): the service runs on the planning rank; the plan it returns is
a value to broadcast.
"""

from __future__ import annotations

import dataclasses
import importlib
import multiprocessing as mp
import os
import queue
import time
from dataclasses import dataclass

import numpy as np

from megatron_flexsp.config import SOLVER_PRIORITIES, PlannerConfig
from megatron_flexsp.plan import StepPlan
from megatron_flexsp.planner.api import plan_step
from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class PlanOutcome:
    """A plan for one step and how it was obtained.

    ``source``: ``solver``, or ``fallback-late`` (budget spent), ``fallback-busy`` (the solver was
    still on an earlier step: no wait), ``fallback-error`` (the solve failed), ``fallback-crash``.
    """

    plan: StepPlan
    source: str
    wait_s: float
    note: str = ""
    solver_cpu_s: float = 0.0  # CPU time the solver process spent on this step (all its threads)


_STARTED = "__started__"


def _lower_priority(priority: str) -> str:
    """Give this process (and the threads it starts, e.g. HiGHS's) less CPU priority than training.

    ``idle``: Linux ``SCHED_IDLE`` (runs only on CPU time no other process wants), else ``low``;
    ``low``: nice 19; ``normal``: unchanged. Returns what was applied.
    """
    if priority == "idle" and hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return "idle"
        except OSError:
            pass
    if priority in ("idle", "low") and hasattr(os, "nice"):
        os.nice(19)
        return "low"
    return "normal"


def _solver_main(requests, results, cm, strategy: str, config: PlannerConfig, max_seq_len: int,
                 delay_s: float, priority: str, imports: tuple[str, ...] = ()) -> None:
    """Solve requested steps, oldest first, skipping those the trainer has already taken."""
    for module in imports:  # modules that register external strategies in this fresh process
        importlib.import_module(module)
    applied = _lower_priority(priority)  # training processes get the CPU first
    if applied != priority:
        log.warning("planner process: CPU priority %r is not available here; running at %r",
                    priority, applied)
    wanted: dict[int, list[int]] = {}
    taken = -1
    while True:
        items = [requests.get()] if not wanted else []
        while True:
            try:
                items.append(requests.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if item is None:
                return
            if item[0] == "taken":
                taken = max(taken, item[1])
            else:
                wanted[item[1]] = (item[2], item[3])
        for k in [k for k in wanted if k <= taken]:
            del wanted[k]
        if not wanted:
            continue
        step = min(wanted)
        lens, budget_s = wanted.pop(step)
        results.put((step, _STARTED, "", 0.0))
        cpu0 = time.process_time()
        try:
            if delay_s:
                time.sleep(delay_s)
            cfg = dataclasses.replace(config, time_budget_s=budget_s) if budget_s else config
            plan = plan_step(np.asarray(lens), cm, strategy=strategy, config=cfg,
                             max_seq_len=max_seq_len)
            results.put((step, plan.to_json(), "", time.process_time() - cpu0))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which falls back
            results.put((step, None, f"{type(exc).__name__}: {exc}", time.process_time() - cpu0))


class PlanService:
    """Solver process for one run; create on the planning rank only, :meth:`close` at the end.

    ``delay_s`` delays every solve (a test hook: shows that the fallback keeps steps on time).
    ``priority``: the solver's CPU priority (:data:`~megatron_flexsp.config.SOLVER_PRIORITIES`):
    ``low`` (nice 19, the default) or ``idle`` (``SCHED_IDLE``) let the training processes have the
    CPU first; ``normal`` keeps the trainer's. ``imports``: modules the solver process imports first
    (those that register an external strategy, e.g. ``megatron-hybrid-cp``).
    """

    def __init__(self, cm, *, strategy: str = "flexsp", config: PlannerConfig | None = None,
                 max_seq_len: int = 0, wait_budget_s: float = 1.0, fallback: str = "batchada",
                 delay_s: float = 0.0, priority: str = "low", imports: tuple[str, ...] = ()) -> None:
        if wait_budget_s < 0:
            raise ValueError(f"wait_budget_s={wait_budget_s} must be >= 0")
        if priority not in SOLVER_PRIORITIES:
            raise ValueError(f"priority={priority!r} must be one of {SOLVER_PRIORITIES}")
        self.cm, self.strategy, self.config = cm, strategy, config or PlannerConfig()
        self.max_seq_len, self.wait_budget_s, self.fallback = max_seq_len, wait_budget_s, fallback
        self.delay_s, self.priority, self.imports = delay_s, priority, tuple(imports)
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._requests = self._results = None
        self._pending: dict[int, np.ndarray] = {}
        self._done: dict[int, tuple[str | None, str, float]] = {}
        self._current: int | None = None  # the step the solver is working on, as last reported
        self.restarts = 0
        self.solver_cpu_s = 0.0  # CPU seconds of all finished solves so far
        self._start()

    def _start(self) -> None:
        self._requests, self._results = self._ctx.Queue(), self._ctx.Queue()
        self._proc = self._ctx.Process(
            target=_solver_main, name="flexsp-planner", daemon=True,
            args=(self._requests, self._results, self.cm, self.strategy, self.config,
                  self.max_seq_len, self.delay_s, self.priority, self.imports))
        self._proc.start()

    def _restart(self) -> None:
        self.restarts += 1
        log.warning("planner process died (exit code %s); restarting it (restart %d)",
                    self._proc.exitcode, self.restarts)
        self._proc.join(timeout=1)
        self._pending.clear()
        self._start()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def request(self, step: int, lengths, budget_s: float | None = None) -> None:
        """Start solving step ``step`` (non-blocking; at most once per step) within ``budget_s``
        seconds (default: the planner config's ``time_budget_s``)."""
        if step in self._pending or step in self._done:
            return
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"budget_s={budget_s} must be > 0 (seconds)")
        if not self.alive:
            self._restart()
        lens = np.asarray(lengths, dtype=np.int64)
        self._pending[step] = lens
        self._requests.put(("solve", step, lens.tolist(), budget_s))

    def _drain(self, timeout: float) -> bool:
        """Take one message from the solver (waiting up to ``timeout``); False if none came."""
        try:
            step, text, err, cpu_s = self._results.get(timeout=timeout) if timeout > 0 \
                else self._results.get_nowait()
        except queue.Empty:
            return False
        if text == _STARTED:
            self._current = step
            return True
        if self._current == step:
            self._current = None
        self._pending.pop(step, None)
        self._done[step] = (text, err, cpu_s)
        self.solver_cpu_s += cpu_s  # every solve, also those discarded as late
        return True

    def _busy_with_older(self, step: int) -> bool:
        """The solver is still on an earlier step, whose plan is no longer wanted."""
        return self._current is not None and self._current < step

    def take(self, step: int, lengths) -> PlanOutcome:
        """Step ``step``'s plan: the solver's if it arrives within the budget, else the fallback.

        Afterwards the solver skips step ``step`` (and earlier ones) if it has not started them.
        """
        try:
            return self._take(step, lengths)
        finally:
            if self.alive:
                self._requests.put(("taken", step))

    def _take(self, step: int, lengths) -> PlanOutcome:
        lens = np.asarray(lengths, dtype=np.int64)
        t0 = time.perf_counter()
        if step not in self._pending and step not in self._done:
            self.request(step, lens)
        deadline = t0 + self.wait_budget_s
        while self._drain(0):  # everything the solver has said so far
            pass
        while step not in self._done and not self._busy_with_older(step):
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            if not self.alive:
                self._restart()
                return self._fallback(step, lens, t0, "fallback-crash", "the planner process died")
            self._drain(min(left, 0.05))
        for old in [k for k in self._done if k < step]:  # late solutions of earlier steps
            del self._done[old]
        for old in [k for k in self._pending if k < step]:  # skipped by the solver
            del self._pending[old]
        if step not in self._done:
            self._pending.pop(step, None)  # its late result is dropped when it arrives
            busy = self._busy_with_older(step)
            return self._fallback(step, lens, t0, "fallback-busy" if busy else "fallback-late",
                                  f"the solver is still on step {self._current}" if busy else
                                  f"no plan within the {self.wait_budget_s:.2f} s budget")
        text, err, cpu_s = self._done.pop(step)
        if text is None:
            log.warning("step %d: the planner failed (%s); using the %s fallback", step, err,
                        self.fallback)
            return self._fallback(step, lens, t0, "fallback-error", err)
        plan = StepPlan.from_json(text)
        if not np.array_equal(np.asarray(plan.original_lens or plan.seq_lens), lens):
            return self._fallback(step, lens, t0, "fallback-error", "plan for other lengths")
        return PlanOutcome(plan, "solver", time.perf_counter() - t0, solver_cpu_s=cpu_s)

    def _fallback(self, step: int, lens: np.ndarray, t0: float, source: str, note: str) -> PlanOutcome:
        plan = plan_step(lens, self.cm, strategy=self.fallback,
                         config=self.config, max_seq_len=self.max_seq_len)
        log.info("step %d: %s plan (%s): %s", step, self.fallback, source, note)
        return PlanOutcome(plan, source, time.perf_counter() - t0, note)

    def close(self) -> None:
        """Stop the solver process (idempotent)."""
        if self._proc is None:
            return
        try:
            self._requests.put(None)
            self._proc.join(timeout=2)
        finally:
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=2)
            self._proc = None
