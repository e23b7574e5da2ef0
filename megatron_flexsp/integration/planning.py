"""Where each step's plan comes from, on rank 0, and how every rank gets it.

:func:`build_cost_model` turns Megatron's arguments and the cost profile into the planner's cost
model (one partial node when the job is smaller than a node; refused when ``--seq-length`` does not
fit the cluster). :class:`RunPlanner` makes plans on rank 0 -- precomputed, solved in-process, or
solved one step ahead by the background solver (:class:`PlanService`) with a wait budget and a
fallback -- and :meth:`RunPlanner.plan` broadcasts the step's plan, checks that every rank holds
the same one and that the group pool can run it.
"""

from __future__ import annotations

import importlib
import time

import torch.distributed as dist

from megatron_flexsp.config import EXTERNAL_STRATEGIES
from megatron_flexsp.cost_model import CostModel, load_profile
from megatron_flexsp.model_spec import ModelSpec
from megatron_flexsp.parallelism import Parallelism
from megatron_flexsp.plan import StepPlan
from megatron_flexsp.planner import plan_step
from megatron_flexsp.planner.service import PlanService
from megatron_flexsp.runtime.agreement import check_agreement
from megatron_flexsp.runtime.plan_check import check_plan
from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)


def model_spec_from_args(args) -> ModelSpec:
    """The cost model's description of the Megatron model in ``args`` (name ``gpt-<L>x<h>-<a>h``)."""
    heads = args.num_attention_heads
    return ModelSpec(f"gpt-{args.num_layers}x{args.hidden_size}-{heads}h", args.num_layers,
                     args.hidden_size, heads,
                     num_kv_heads=args.num_query_groups if args.group_query_attention else heads,
                     ffn_hidden_size=args.ffn_hidden_size, vocab_size=args.padded_vocab_size,
                     dtype_bytes=2 if (args.bf16 or args.fp16) else 4, swiglu=bool(args.swiglu),
                     learned_positions=args.position_embedding_type == "learned_absolute",
                     untied_embeddings=bool(getattr(args, "untie_embeddings_and_output_weights", False)))


def build_cost_model(args, settings, on_cpu: bool) -> CostModel:
    """The cost model of ``args``' model on this job's ranks (``--flexsp-profile``), planning over
    devices of ``--tensor-model-parallel-size`` ranks."""
    profile = load_profile(args.flexsp_profile or ("cpu-gloo-measured" if on_cpu else "h200-estimate"))
    world = args.world_size
    parallel = Parallelism.from_megatron_args(args)
    if world < profile.gpus_per_node and not world & (world - 1):
        log.info("%d ranks: one partial node of profile %s (%d per node)", world,
                 profile.name, profile.gpus_per_node)
        profile = profile.on_partial_node(world)
    if world % profile.gpus_per_node:
        raise ValueError(f"world size {world} is not a multiple of the {profile.gpus_per_node} "
                         f"ranks per node of profile {profile.name!r}; node-aligned groups "
                         f"need whole nodes")
    cm = CostModel.from_profile(
        profile, model_spec_from_args(args), num_gpus=world, max_seq_len=args.seq_length,
        allow_kv_replication=settings.runtime.kv_replication, parallel=parallel)
    if args.seq_length > cm.max_tokens:
        m, tp = cm.model, parallel.tp
        per = f"/tp={tp}" if tp > 1 else ""
        raise ValueError(
            f"--seq-length {args.seq_length} is longer than the cluster can hold: "
            f"{cm.max_tokens} tokens = {cm.capacity_tokens} per device x the largest "
            f"allowed group of {cm.sizes[-1]} devices of {tp} rank(s) (group sizes must divide "
            f"num_heads={m.num_heads}{per} and num_kv_heads={m.num_kv_heads}{per} and align with "
            f"{profile.gpus_per_node} ranks per node; profile {profile.name!r}); lower "
            f"--seq-length, add ranks or use --flexsp-over-length with a smaller length")
    return cm


class RunPlanner:
    """Rank 0's planning for one run (the other ranks only receive plans). ``lengths_of(step)``: the
    document lengths of training step ``step`` (for planning ahead)."""

    def __init__(self, args, settings, cm: CostModel, lengths_of) -> None:
        self.args, self.settings, self.cm, self.lengths_of = args, settings, cm, lengths_of
        self._last: tuple | None = None  # (split, step, plan): a replayed step reuses its plan
        self.service = None
        self.precomputed: dict[int, StepPlan] = {}
        self._sync_step = -1  # the step solved in-process when planning is asynchronous
        self.last_step_s = 0.0  # this rank's last forward-backward time (sets the solver's budget)
        self.solver_cpu_s = 0.0  # CPU time of the solver process's solves taken this step

    def start(self) -> None:
        """Rank 0: precompute every step's plan, or start the solver process on the first step."""
        cfg = self.settings.planning
        first = int(self.args.iteration or 0)
        if cfg.precompute:
            for step in range(first, self.args.train_iters):
                self.precomputed[step] = self._solve_now(self.lengths_of(step))
            log.info("precomputed the plans of steps %d..%d", first, self.args.train_iters - 1)
        elif cfg.asynchronous:
            self.service = PlanService(self.cm, strategy=self.settings.strategy,
                                       config=self.settings.planner, max_seq_len=self.args.seq_length,
                                       wait_budget_s=cfg.wait_budget_s, fallback=cfg.fallback,
                                       delay_s=cfg.solver_delay_s, priority=cfg.solver_priority,
                                       imports=self._strategy_modules())
            # nothing trains yet: the first step is solved here while the solver process starts
            # (it would miss the budget while importing), and the process begins with the next one
            if first + 1 < self.args.train_iters:
                self.service.request(first + 1, self.lengths_of(first + 1))
            self.precomputed[first] = self._solve_now(self.lengths_of(first))
            self._sync_step = first

    def _strategy_modules(self) -> tuple[str, ...]:
        """The module that registers the run's strategy when it is an external one (imported here
        and in the solver process)."""
        module = EXTERNAL_STRATEGIES.get(self.settings.strategy)
        if module is None:
            return ()
        importlib.import_module(module)
        return (module,)

    def _solve_now(self, lengths) -> StepPlan:
        self._strategy_modules()
        return plan_step(lengths, self.cm, strategy=self.settings.strategy, config=self.settings.planner,
                         max_seq_len=self.args.seq_length)

    def _plan_on_rank0(self, batch) -> tuple[StepPlan, str]:
        if self._last is not None and self._last[:2] == (batch.split, batch.step):
            return self._last[2], "replay"  # Megatron's rerun state machine replays this batch
        if batch.split != "train":  # evaluation: planned now, like a training step, never ahead
            return self._solve_now(batch.lengths), "solver-sync"
        if batch.step in self.precomputed:
            source = "solver-sync" if batch.step == self._sync_step else "precomputed"
            return self.precomputed.pop(batch.step), source
        if self.service is None:
            return self._solve_now(batch.lengths), "solver-sync"
        before = self.service.solver_cpu_s
        outcome = self.service.take(batch.step, batch.lengths)
        self.solver_cpu_s = self.service.solver_cpu_s - before  # solves finished since the last step
        return outcome.plan, outcome.source

    def solve_budget_s(self) -> float:
        """The background solver's budget for the next step: a fixed ``planning.solve_budget``, or
        ``step_budget_fraction`` of the last step's time, at least ``planner.time_budget_s``."""
        cfg = self.settings.planning
        if cfg.solve_budget != "auto":
            return float(cfg.solve_budget)
        return max(self.settings.planner.time_budget_s, cfg.step_budget_fraction * self.last_step_s)

    def _look_ahead(self, step: int) -> None:
        """Rank 0: ask the solver for the next batch's plan, to be solved while ``step`` trains
        (called once all ranks hold this step's plan, so that the solver's start does not delay the
        plan's broadcast)."""
        if self.service is not None and dist.get_rank() == 0 and step + 1 < self.args.train_iters:
            self.service.request(step + 1, self.lengths_of(step + 1), self.solve_budget_s())

    def plan(self, batch, pool, device) -> tuple[StepPlan, float, str]:
        """Collective: step ``batch.step``'s plan on every rank (from rank 0), checked against the
        group ``pool``; returns it, the seconds spent and where it came from."""
        t0 = time.perf_counter()
        payload = [None, None]
        if dist.get_rank() == 0:
            plan, source = self._plan_on_rank0(batch)
            self._last = (batch.split, batch.step, plan)
            payload = [plan.to_json(), source]
        dist.broadcast_object_list(payload, src=0)
        plan = StepPlan.from_json(payload[0])
        check_agreement(payload[0], batch.step, device)
        model, tp = self.cm.model, self.cm.parallel.tp
        check_plan(plan, pool, num_heads=model.num_heads // tp, num_kv_heads=model.num_kv_heads // tp,
                   kv_replication=self.settings.runtime.kv_replication)
        wait_s = time.perf_counter() - t0
        if batch.split == "train" and payload[1] != "replay":
            self._look_ahead(batch.step)
        return plan, wait_s, payload[1]

    def close(self) -> None:
        """Stop the solver process (rank 0); call when training ends."""
        if self.service is not None:
            self.service.close()
            self.service = None
            self.service = None

