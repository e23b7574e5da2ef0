"""The plan: the contract between planner and runtime (layer 0, stdlib only).

A :class:`StepPlan` says, for one global batch, which micro-batches run, which sequence-parallel
groups (explicit rank lists) each micro-batch forms, and which sequences (indices into the global
batch) each group runs. It carries the planner's predictions and its proof of quality (lower bound,
gap). It is serialised to JSON (schema in README.md, ``version`` below) so rank 0 can broadcast it
and users can inspect it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from megatron_flexsp.topology import ClusterSpec, is_node_aligned

PLAN_FORMAT = "megatron-flexsp-plan"
PLAN_VERSION = 1


@dataclass(frozen=True)
class GroupPlan:
    """One sequence-parallel group of one micro-batch.

    ``ranks``: global ranks, contiguous and node-aligned. ``seqs``: indices into the global batch,
    in the order they are packed. ``predicted_ms``: the cost model's time of this group.
    """

    ranks: tuple[int, ...]
    seqs: tuple[int, ...]
    predicted_ms: float = 0.0

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class MicroBatchPlan:
    """Groups that run concurrently; their rank sets are disjoint."""

    groups: tuple[GroupPlan, ...]

    @property
    def predicted_ms(self) -> float:
        return max((g.predicted_ms for g in self.groups), default=0.0)


@dataclass(frozen=True)
class StepPlan:
    """Plan of one training step (one global batch).

    Lengths: ``seq_lens`` are the lengths actually trained (after the over-length policy);
    ``original_lens`` the lengths of the batch as given. ``dropped`` lists sequences not trained,
    ``tokens_truncated`` / ``tokens_dropped`` count the tokens cut. Times in milliseconds.
    ``lower_bound_ms`` is a valid lower bound on the step time of *any* plan of this batch under
    the same cost model; ``gap = predicted_step_ms / lower_bound_ms - 1``.
    """

    num_gpus: int
    gpus_per_node: int
    seq_lens: tuple[int, ...]
    micro_batches: tuple[MicroBatchPlan, ...]
    strategy: str
    method: str
    predicted_step_ms: float
    lower_bound_ms: float = 0.0
    solve_time_s: float = 0.0
    original_lens: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    tokens_truncated: int = 0
    tokens_dropped: int = 0
    bucketing_error: float = 0.0
    info: dict = field(default_factory=dict)
    tensor_parallel: int = 1

    @property
    def gap(self) -> float:
        if self.lower_bound_ms <= 0:
            return float("inf")
        return self.predicted_step_ms / self.lower_bound_ms - 1.0

    @property
    def group_sizes(self) -> list[list[int]]:
        """Group sizes per micro-batch, largest first."""
        return [sorted((g.size for g in mb.groups), reverse=True) for mb in self.micro_batches]

    def to_dict(self) -> dict:
        data = asdict(self)
        data = {"format": PLAN_FORMAT, "version": PLAN_VERSION, **data}
        for mb, out in zip(self.micro_batches, data["micro_batches"]):
            out["predicted_ms"] = mb.predicted_ms
        data["gap"] = self.gap if self.lower_bound_ms > 0 else None
        return data

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict) -> "StepPlan":
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(f"not a plan: format={data.get('format')!r}, expected {PLAN_FORMAT!r}")
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {data.get('version')!r} is not supported "
                             f"(this build reads version {PLAN_VERSION})")
        mbs = tuple(MicroBatchPlan(tuple(GroupPlan(tuple(g["ranks"]), tuple(g["seqs"]),
                                                   float(g["predicted_ms"]))
                                         for g in mb["groups"]))
                    for mb in data["micro_batches"])
        return cls(num_gpus=int(data["num_gpus"]), gpus_per_node=int(data["gpus_per_node"]),
                   seq_lens=tuple(data["seq_lens"]), micro_batches=mbs, strategy=data["strategy"],
                   method=data["method"], predicted_step_ms=float(data["predicted_step_ms"]),
                   lower_bound_ms=float(data["lower_bound_ms"]),
                   solve_time_s=float(data["solve_time_s"]),
                   original_lens=tuple(data.get("original_lens", ())),
                   dropped=tuple(data.get("dropped", ())),
                   tokens_truncated=int(data.get("tokens_truncated", 0)),
                   tokens_dropped=int(data.get("tokens_dropped", 0)),
                   bucketing_error=float(data.get("bucketing_error", 0.0)),
                   info=dict(data.get("info", {})),
                   tensor_parallel=int(data.get("tensor_parallel", 1)))

    @classmethod
    def from_json(cls, text: str) -> "StepPlan":
        return cls.from_dict(json.loads(text))


def validate_plan(plan: StepPlan) -> None:
    """Check the structure of ``plan``; raise ``ValueError`` describing the first violation.

    Every sequence not in ``dropped`` runs exactly once; no dropped sequence runs; within a
    micro-batch the groups' ranks are disjoint and inside ``0..num_gpus-1``; every group is
    node-aligned and non-empty. (Memory is checked by the simulator, which knows the cost model.)
    """
    cluster = ClusterSpec(plan.num_gpus, plan.gpus_per_node)
    n = len(plan.seq_lens)
    seen = [0] * n
    for j, mb in enumerate(plan.micro_batches):
        used: set[int] = set()
        for g in mb.groups:
            if not g.ranks:
                raise ValueError(f"micro-batch {j}: a group has no ranks")
            if not is_node_aligned(g.ranks, cluster):
                raise ValueError(f"micro-batch {j}: group ranks {list(g.ranks)[:4]}.. (size "
                                 f"{g.size}) are not node-aligned for {plan.gpus_per_node} GPUs/node "
                                 f"and {plan.num_gpus} GPUs")
            overlap = used.intersection(g.ranks)
            if overlap:
                raise ValueError(f"micro-batch {j}: rank(s) {sorted(overlap)[:4]} are in two groups")
            used.update(g.ranks)
            for i in g.seqs:
                if not 0 <= i < n:
                    raise ValueError(f"micro-batch {j}: sequence index {i} outside 0..{n - 1}")
                seen[i] += 1
    dropped = set(plan.dropped)
    for i, count in enumerate(seen):
        if i in dropped and count:
            raise ValueError(f"sequence {i} is dropped but scheduled {count} time(s)")
        if i not in dropped and count != 1:
            raise ValueError(f"sequence {i} (length {plan.seq_lens[i]}) is scheduled {count} "
                             f"times, expected exactly once")
