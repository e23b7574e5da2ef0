"""Configuration dataclasses (layer 0, stdlib only): one validation site, passed explicitly."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

OVER_LENGTH_POLICIES = ("error", "truncate", "drop")
SEARCHES = ("level", "milp")
#: Strategies of the planner itself (numpy + HiGHS).
BUILTIN_STRATEGIES = ("static", "batchada", "megatron-dcp", "flexsp")
#: Strategies that call code of another package, registered by the layer that imports it
#: (``megatron-hybrid-cp``: :mod:`megatron_flexsp.integration.hybrid_cp`, Megatron's own scheduler;
#: ``random``: :mod:`megatron_flexsp.sim.random_plans`, random valid plans for runtime tests).
EXTERNAL_STRATEGIES = {"megatron-hybrid-cp": "megatron_flexsp.integration.hybrid_cp",
                       "random": "megatron_flexsp.sim.random_plans"}
STRATEGIES = BUILTIN_STRATEGIES + tuple(EXTERNAL_STRATEGIES)
SOLVER_PRIORITIES = ("idle", "low", "normal")  # CPU priority of the background solver process


@dataclass(frozen=True)
class PlannerConfig:
    """Settings of the FlexSP planner.

    num_buckets: length buckets for short sequences in the MILP.
    long_fraction: sequences longer than this fraction of one GPU's token capacity are placed
        individually by the MILP (up to ``max_long`` of them, longest first).
    max_extra_micro_batches: the MILP may use up to this many micro-batches beyond the memory minimum.
    node_limit: branch-and-bound node limit (deterministic); time_limit_s: safety net (seconds).
    rel_gap: relative MIP gap at which HiGHS stops.
    slot_min_size: in the per-micro-batch refinement, group sizes of at least this many GPUs are
        explicit groups (exact time per group); smaller sizes are aggregated counts.
    refine_node_limit: branch-and-bound nodes per micro-batch in that refinement (a heuristic
        phase: its bound is not used, so a small budget only costs plan quality).
    node_slot_trigger: when at least this many long sequences need half a node or more, the step
        MILP also gives node-sized groups explicit slots: on 20 Wikipedia batches at 64 GPUs the worst
        gap fell from 11.2% to 4.0% and planning took about 2x longer. A large value turns it off.
    search: "milp" (the default: the fast search, then HiGHS MILPs warm-started from its plan on the
        time left, :mod:`planner.exact`) or "level" (the fast search only, :mod:`planner.search`).
    bound_lp_solves: LP solves spent on the lower bound (:mod:`planner.bound`); 0 keeps the simple
        bound only. The bound never changes the plan, only the reported gap.
    time_budget_s: wall-clock budget of one flexsp plan (seconds, one core). The best homogeneous
        plan and the fast search always complete; the local search, the LP bound and the MILPs
        share the rest and stop at the deadline with the best plan and the bound reached.
    over_length: what to do with a sequence longer than the cluster holds: "error", "truncate", "drop".
    """

    num_buckets: int = 16
    long_fraction: float = 0.5
    max_long: int = 48
    max_extra_micro_batches: int = 2
    node_limit: int = 500
    time_limit_s: float = 20.0
    rel_gap: float = 0.005
    over_length: str = "error"
    seed: int = 0
    slot_min_size: int = 4
    refine_node_limit: int = 50
    node_slot_trigger: int = 2
    search: str = "milp"
    bound_lp_solves: int = 2000
    time_budget_s: float = 1.0

    def __post_init__(self) -> None:
        if self.num_buckets < 1:
            raise ValueError(f"num_buckets={self.num_buckets} must be >= 1")
        if not 0.0 < self.long_fraction:
            raise ValueError(f"long_fraction={self.long_fraction} must be > 0")
        if self.max_long < 0:
            raise ValueError(f"max_long={self.max_long} must be >= 0")
        if self.max_extra_micro_batches < 0:
            raise ValueError(f"max_extra_micro_batches={self.max_extra_micro_batches} must be >= 0")
        if self.node_limit < 1 or self.time_limit_s <= 0:
            raise ValueError(f"node_limit={self.node_limit} and time_limit_s={self.time_limit_s} "
                             f"must be positive")
        if not 0.0 <= self.rel_gap < 1.0:
            raise ValueError(f"rel_gap={self.rel_gap} must be in [0, 1)")
        if self.search not in SEARCHES:
            raise ValueError(f"search={self.search!r} must be one of {SEARCHES}")
        if not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s={self.time_budget_s} must be > 0 (seconds)")
        if self.bound_lp_solves < 0:
            raise ValueError(f"bound_lp_solves={self.bound_lp_solves} must be >= 0")
        if self.over_length not in OVER_LENGTH_POLICIES:
            raise ValueError(f"over_length={self.over_length!r} must be one of {OVER_LENGTH_POLICIES}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "PlannerConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown planner setting(s) {unknown}; known: {sorted(known)}")
        return cls(**data)
