"""Our command-line flags (through Megatron's ``extra_args_provider``) and their checks.

The set is small and fixed (:data:`FLEXSP_FLAGS`; a test fails when it changes without the list).
Planner, cost-model and runtime settings that are rarely changed live in the YAML file given by
``--flexsp-config`` (sections ``planning``: :class:`PlanningSettings`; ``planner``: ``strategy`` (:data:`STRATEGIES`; ``flexsp`` by default,
the others are the baselines) and :class:`PlannerConfig` fields; ``runtime``: ``attention_backend``,
``kv_replication``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path

from megatron_flexsp.config import OVER_LENGTH_POLICIES, SOLVER_PRIORITIES, STRATEGIES, PlannerConfig
from megatron_flexsp.integration.cpu_mode import CPU_MODES
from megatron_flexsp.runtime.attention import BACKENDS, choose_backend, installed_backends

#: Every flag this plugin adds to Megatron's parser.
FLEXSP_FLAGS = ("--flexsp", "--flexsp-config", "--flexsp-profile", "--flexsp-over-length",
                "--flexsp-cpu", "--flexsp-plan-dir")

ATTENTION_BACKENDS = ("auto",) + BACKENDS


def add_flexsp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: adds :data:`FLEXSP_FLAGS`."""
    g = parser.add_argument_group("flexsp", "heterogeneous sequence parallelism (megatron-flexsp)")
    g.add_argument("--flexsp", action="store_true",
                   help="plan every global batch into heterogeneous Ulysses groups (Megatron sees "
                        "TP=PP=CP=1 and DP=world size)")
    g.add_argument("--flexsp-config", type=str, default=None,
                   help="YAML with 'planner' and 'runtime' sections (see configs/flexsp_default.yaml)")
    g.add_argument("--flexsp-profile", type=str, default=None,
                   help="cost profile: a name in configs/profiles or a JSON path (default: "
                        "cpu-gloo-measured in CPU mode, else h200-estimate)")
    g.add_argument("--flexsp-over-length", choices=OVER_LENGTH_POLICIES, default="truncate",
                   help="documents longer than --seq-length (+1 for the label shift): truncate, "
                        "drop (counted) or error")
    g.add_argument("--flexsp-cpu", choices=CPU_MODES, default="auto",
                   help="CPU mode for Megatron (auto: on when CUDA is absent)")
    g.add_argument("--flexsp-plan-dir", type=str, default=None,
                   help="where rank 0 writes plans.jsonl, steps.jsonl and a plan picture (default: "
                        "<--save>/flexsp, else ./flexsp_out)")
    return parser


@dataclass(frozen=True)
class RuntimeSettings:
    attention_backend: str = "auto"
    kv_replication: bool = False

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"runtime.attention_backend={self.attention_backend!r} must be one of "
                             f"{ATTENTION_BACKENDS}")

    def backend(self, on_cpu: bool, dtype, transformer_impl: str = "local") -> str:
        """The attention backend for this machine and activation dtype (:func:`choose_backend`:
        ``auto`` is flash-attn for fp16/bf16 when installed, else Transformer Engine when installed,
        else SDPA; SDPA on CPU). With Transformer Engine's layers (``transformer_impl``) ``auto`` is
        its fused attention. An explicit backend that cannot run raises ``ValueError``."""
        installed = installed_backends(not on_cpu)
        if self.attention_backend == "auto" and transformer_impl == "transformer_engine" and installed["te"]:
            return "te"
        return choose_backend(self.attention_backend, cuda=not on_cpu, dtype=dtype, installed=installed)


@dataclass(frozen=True)
class PlanningSettings:
    """Where and when plans are made (section ``planning``).

    asynchronous: solve step k+1's plan in a separate process while step k trains (rank 0);
        otherwise rank 0 solves each step's plan when the step starts.
    wait_budget_s: how long a step waits for the solver before using ``fallback`` (a fast baseline
        strategy); the late solution is discarded.
    precompute: solve every step's plan before training starts (benchmark reference).
    solver_delay_s: delay every solve (test and benchmark hook for a slow solver).
    solver_priority: the solver process's CPU priority: ``low`` (nice 19, the default), ``idle``
        (Linux ``SCHED_IDLE``: only CPU time nothing else wants) or ``normal``.
    solve_budget: the planner's time budget for a step solved in the background: ``auto`` (the
        default) gives it ``step_budget_fraction`` of the last step's measured time (the solve
        overlaps the step before, so it may use most of it), at least ``planner.time_budget_s``;
        a number of seconds fixes it.
    """

    asynchronous: bool = True
    wait_budget_s: float = 0.25
    fallback: str = "batchada"
    precompute: bool = False
    solver_delay_s: float = 0.0
    solver_priority: str = "low"
    solve_budget: float | str = "auto"
    step_budget_fraction: float = 0.8

    def __post_init__(self) -> None:
        if self.wait_budget_s < 0 or self.solver_delay_s < 0:
            raise ValueError(f"planning.wait_budget_s={self.wait_budget_s} and solver_delay_s="
                             f"{self.solver_delay_s} must be >= 0")
        if self.solver_priority not in SOLVER_PRIORITIES:
            raise ValueError(f"planning.solver_priority={self.solver_priority!r} must be one of "
                             f"{list(SOLVER_PRIORITIES)}")
        if self.solve_budget != "auto" and not (isinstance(self.solve_budget, (int, float))
                                                 and self.solve_budget > 0):
            raise ValueError(f"planning.solve_budget={self.solve_budget!r} must be 'auto' or a "
                             f"number of seconds > 0")
        if not 0 < self.step_budget_fraction <= 1:
            raise ValueError(f"planning.step_budget_fraction={self.step_budget_fraction} must be in "
                             f"(0, 1]")
        if self.fallback not in STRATEGIES or self.fallback == "flexsp":
            raise ValueError(f"planning.fallback={self.fallback!r} must be a fast baseline: one of "
                             f"{[s for s in STRATEGIES if s != 'flexsp']}")


@dataclass(frozen=True)
class FlexSPSettings:
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    strategy: str = "flexsp"
    planning: PlanningSettings = field(default_factory=PlanningSettings)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"planner.strategy={self.strategy!r} must be one of {STRATEGIES}")


def load_settings(path: str | None) -> FlexSPSettings:
    """Read ``--flexsp-config`` (``None``: defaults); unknown sections or keys raise ``ValueError``."""
    if path is None:
        return FlexSPSettings()
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--flexsp-config {path!r} does not exist")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--flexsp-config {path!r}: expected a mapping, got {type(data).__name__}")
    unknown = set(data) - {"planner", "runtime", "planning"}
    if unknown:
        raise ValueError(f"--flexsp-config {path!r}: unknown section(s) {sorted(unknown)}; "
                         f"expected 'planner', 'planning' and 'runtime'")
    runtime = data.get("runtime") or {}
    bad = set(runtime) - {"attention_backend", "kv_replication"}
    if bad:
        raise ValueError(f"--flexsp-config {path!r}: unknown runtime key(s) {sorted(bad)}")
    planning = data.get("planning") or {}
    bad = set(planning) - {f.name for f in fields(PlanningSettings)}
    if bad:
        raise ValueError(f"--flexsp-config {path!r}: unknown planning key(s) {sorted(bad)}")
    planner = dict(data.get("planner") or {})
    strategy = planner.pop("strategy", "flexsp")
    return FlexSPSettings(PlannerConfig.from_dict(planner), RuntimeSettings(**runtime), strategy,
                          PlanningSettings(**planning))
