"""One training step of ``pretrain_gpt_flexsp.py``: global batch -> plan -> micro-batches -> Megatron.

:class:`StepDriver` owns the document sampler, the cost model, the group pool and the
context-parallel switch. Its :meth:`forward_backward` replaces Megatron's schedule function (see
:mod:`patches.schedule`): it takes one global batch from the data iterator, plans it (rank 0 solves,
the plan is broadcast), dispatches every rank its shards, and runs Megatron's no-pipelining schedule
over this rank's micro-batches. Without ``--flexsp`` the same driver packs each rank's documents into
rows (the plain-Megatron baseline). Rank 0 appends one JSON line per step to ``steps.jsonl``.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_flexsp.cost_model import CostModel, load_profile
from megatron_flexsp.integration.args import FlexSPSettings
from megatron_flexsp.integration.data import DocumentSampler, DocumentSource, open_indexed
from megatron_flexsp.integration.records import StepRecorder
from megatron_flexsp.integration.microbatches import (flexsp_micro_batches, placeholder_micro_batch,
                                                      plain_micro_batches)
from megatron_flexsp.model_spec import ModelSpec
from megatron_flexsp.plan import StepPlan
from megatron_flexsp.planner import plan_step
from megatron_flexsp.planner.service import PlanService
from megatron_flexsp.runtime.agreement import check_agreement
from megatron_flexsp.runtime.groups import SPGroupPool
from megatron_flexsp.runtime.plan_check import check_plan
from megatron_flexsp.runtime.device import synchronize
from megatron_flexsp.runtime.profiler import SavedTensorMeter
from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)

DATA_STATE_FORMAT = "megatron-flexsp-data"


def model_spec_from_args(args) -> ModelSpec:
    """The cost model's description of the Megatron model in ``args`` (name ``gpt-<L>x<h>-<a>h``)."""
    heads = args.num_attention_heads
    return ModelSpec(f"gpt-{args.num_layers}x{args.hidden_size}-{heads}h", args.num_layers,
                     args.hidden_size, heads,
                     num_kv_heads=args.num_query_groups if args.group_query_attention else heads,
                     ffn_hidden_size=args.ffn_hidden_size, vocab_size=args.padded_vocab_size,
                     dtype_bytes=2 if (args.bf16 or args.fp16) else 4, swiglu=bool(args.swiglu),
                     learned_positions=args.position_embedding_type == "learned_absolute")


def params_dtype(args) -> torch.dtype:
    """The activation dtype Megatron trains with (``--bf16`` / ``--fp16``, else fp32)."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def data_prefixes(args) -> list[str]:
    """``--data-path`` as a list of prefixes; weighted blends are refused."""
    paths = list(args.data_path or [])
    if not paths:
        raise ValueError("--data-path is required (a Megatron indexed dataset prefix)")
    if re.fullmatch(r"[0-9.eE+-]+", paths[0]):  # Megatron's blend syntax: WEIGHT PREFIX ...
        raise ValueError(f"--data-path {' '.join(paths)}: weighted blends are not supported by the "
                         f"document sampler; give one or more unweighted prefixes")
    return paths


class _SwitchingIterator:
    """Yields micro-batches and makes each one's group the context-parallel group as it is taken;
    with a ``meter``, starts its next micro-batch (for the activation peak per token)."""

    def __init__(self, items, switch, meter=None) -> None:
        self._items, self._switch, self._next, self._meter = items, switch, 0, meter
        self.switch_s = 0.0

    def __iter__(self):
        return self

    def __next__(self):
        if self._next >= len(self._items):
            raise StopIteration
        item = self._items[self._next]
        self._next += 1
        if self._meter is not None:
            self._meter.micro_batch(0 if item.placeholder else int(item.tokens.numel()))
        if item.packed_seq_params is not None and self._switch is not None:
            t0 = time.perf_counter()
            self._switch.use(item.group, item.ranks)
            self.switch_s += time.perf_counter() - t0
        return item


class StepDriver:
    """Everything a step needs besides the model; create it on every rank alike."""

    def __init__(self, args, settings: FlexSPSettings, *, on_cpu: bool) -> None:
        self.args, self.settings, self.on_cpu = args, settings, on_cpu
        self.measure = True  # activation bytes per token, in the first step
        self._sync_step = -1  # the step solved in-process when planning is asynchronous
        self._last_step_s = 0.0  # this rank's last forward-backward time (sets the solver's budget)
        self.flexsp = bool(args.flexsp)
        self.source = DocumentSource(open_indexed(data_prefixes(args)))
        self.sampler = DocumentSampler(self.source.lengths, global_batch=args.global_batch_size,
                                       seq_length=args.seq_length, seed=args.seed,
                                       over_length=args.flexsp_over_length)
        self.cm: CostModel | None = None
        if self.flexsp:
            profile = load_profile(args.flexsp_profile or ("cpu-gloo-measured" if on_cpu else "h200-estimate"))
            world = args.world_size
            if world < profile.gpus_per_node and not world & (world - 1):
                log.info("%d ranks: one partial node of profile %s (%d per node)", world,
                         profile.name, profile.gpus_per_node)
                profile = profile.on_partial_node(world)
            if world % profile.gpus_per_node:
                raise ValueError(f"world size {world} is not a multiple of the {profile.gpus_per_node} "
                                 f"ranks per node of profile {profile.name!r}; node-aligned groups "
                                 f"need whole nodes")
            self.cm = CostModel.from_profile(
                profile, model_spec_from_args(args), num_gpus=world, max_seq_len=args.seq_length,
                allow_kv_replication=settings.runtime.kv_replication)
            if args.seq_length > self.cm.max_tokens:
                m = self.cm.model
                raise ValueError(
                    f"--seq-length {args.seq_length} is longer than the cluster can hold: "
                    f"{self.cm.max_tokens} tokens = {self.cm.capacity_tokens} per rank x the largest "
                    f"allowed group of {self.cm.sizes[-1]} ranks (group sizes must divide "
                    f"num_heads={m.num_heads} and num_kv_heads={m.num_kv_heads} and align with "
                    f"{profile.gpus_per_node} ranks per node; profile {profile.name!r}); lower "
                    f"--seq-length, add ranks or use --flexsp-over-length with a smaller length")
        self.backend = settings.runtime.backend(on_cpu, params_dtype(args),
                                                getattr(args, "transformer_impl", "local"))
        self.pool = None
        self.switch = None
        self.schedule = None
        self.service = None
        self.precomputed: dict[int, object] = {}
        self.solver_cpu_s = 0.0  # rank 0: CPU time of the solver process's solves taken this step
        self.out_dir = Path(args.flexsp_plan_dir or (Path(args.save) / "flexsp" if args.save
                                                     else "flexsp_out"))
        self.recorder = StepRecorder(self.out_dir, self.cm, settings.strategy if self.flexsp else "plain")
        self._training = None  # megatron.training.training, looked up at the first step

    # ------------------------------------------------------------------ data
    def data_iterator(self):
        """Global batches from Megatron's consumed-sample count on (resume continues the stream)."""
        first = self.args.consumed_train_samples // self.args.global_batch_size
        rank, world = dist.get_rank(), dist.get_world_size()
        self.check_resume()
        acct = self.sampler.acct
        log.info("documents: %d, usable %d, truncated %d (%d tokens), dropped %d short / %d long; "
                 "starting at global batch %d", acct.num_documents, acct.usable_documents,
                 acct.truncated_documents, acct.truncated_tokens, acct.dropped_too_short,
                 acct.dropped_too_long, first)
        step = first
        while True:
            yield self.sampler.batch(step, self.source, rank=rank, world=world)
            step += 1

    # ------------------------------------------------------------------ checkpoints
    def sampler_state(self) -> dict:
        smp = self.sampler
        return {"seed": smp.seed, "global_batch": smp.global_batch, "seq_length": smp.seq_length,
                "over_length": self.args.flexsp_over_length,
                "num_documents": smp.acct.num_documents, "usable_documents": smp.acct.usable_documents}

    def on_save(self, iteration: int) -> None:
        """Rank 0: write the document accounting next to Megatron's checkpoint of ``iteration``."""
        if dist.get_rank() != 0 or not self.args.save:
            return
        usable = self.sampler.acct.usable_documents
        consumed = int(getattr(self.args, "consumed_train_samples", 0)
                       or iteration * self.args.global_batch_size)
        rec = {"format": DATA_STATE_FORMAT, "version": 1, "iteration": iteration,
               "next_step": iteration, "documents_consumed": consumed, "epoch": consumed // usable,
               "position_in_epoch": consumed % usable, "sampler": self.sampler_state(),
               "dataset": self.sampler.acct.to_dict(), "this_run": dict(self.recorder.totals)}
        folder = Path(self.args.save) / f"iter_{iteration:07d}"
        folder = folder if folder.is_dir() else self.out_dir
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "flexsp_data.json").write_text(json.dumps(rec, indent=1))
        log.info("data accounting at iteration %d: %d documents consumed (epoch %d, %d/%d), this run "
                 "%d documents, %d truncated; dataset: %d dropped short, %d dropped long", iteration,
                 consumed, rec["epoch"], rec["position_in_epoch"], usable,
                 self.recorder.totals["documents"], self.recorder.totals["truncated_documents"],
                 self.sampler.acct.dropped_too_short, self.sampler.acct.dropped_too_long)

    def check_resume(self) -> None:
        """On resume, the saved sampler settings must equal this run's (else documents would be
        skipped or repeated): ``ValueError`` naming the differing values."""
        it = int(getattr(self.args, "iteration", 0) or 0)
        if not it or not self.args.load:
            return
        path = Path(self.args.load) / f"iter_{it:07d}" / "flexsp_data.json"
        if not path.exists():
            log.warning("resuming at iteration %d without %s: document accounting starts here", it, path)
            return
        saved = json.loads(path.read_text())
        now = self.sampler_state()
        diff = {k: (saved["sampler"].get(k), v) for k, v in now.items() if saved["sampler"].get(k) != v}
        if diff:
            raise ValueError(f"resuming from {path}: the document sampler changed (saved, now): {diff}; "
                             f"documents would be skipped or trained twice")
        log.info("resume: %d documents consumed before (epoch %d), sampler settings unchanged",
                 saved["documents_consumed"], saved["epoch"])

    # ------------------------------------------------------------------ setup on first step
    def _setup(self, model) -> None:
        from patches.context_parallel import ContextParallelSwitch
        from patches.schedule import megatron_no_pipelining

        import megatron.training.training as training

        self._training = training
        if not hasattr(training, "update_seqlen_stats_from_cu_seqlens"):
            log.warning("this megatron-core has no update_seqlen_stats_from_cu_seqlens: its TFLOP/s "
                        "count every document as a full --seq-length")
        self.switch = ContextParallelSwitch(model)
        self.schedule = megatron_no_pipelining()  # checked once, not every step
        if self.flexsp:
            minutes = getattr(self.args, "distributed_timeout_minutes", None) or 10
            self.pool = SPGroupPool(self.cm.cluster, self.cm.sizes, singletons=True, device=self.device,
                                    timeout=datetime.timedelta(minutes=minutes))
            log.info("group pool: sizes %s on %d ranks (%d per node), attention %s",
                     self.cm.sizes, self.cm.cluster.num_gpus, self.cm.cluster.gpus_per_node,
                     self.backend)
            if dist.get_rank() == 0:
                self._start_planning()

    def _start_planning(self) -> None:
        """Rank 0: precompute every step's plan, or start the solver process on the first step."""
        cfg = self.settings.planning
        first = self.args.consumed_train_samples // self.args.global_batch_size
        if cfg.precompute:
            for step in range(first, self.args.train_iters):
                lens = self.sampler.batch(step).lengths
                self.precomputed[step] = self._solve_now(lens)
            log.info("precomputed the plans of steps %d..%d", first, self.args.train_iters - 1)
        elif cfg.asynchronous:
            self.service = PlanService(self.cm, strategy=self.settings.strategy,
                                       config=self.settings.planner, max_seq_len=self.args.seq_length,
                                       wait_budget_s=cfg.wait_budget_s, fallback=cfg.fallback,
                                       delay_s=cfg.solver_delay_s, priority=cfg.solver_priority)
            # nothing trains yet: the first step is solved here while the solver process starts
            # (it would miss the budget while importing), and the process begins with the next one
            self.service.request(first + 1, self.sampler.batch(first + 1).lengths)
            self.precomputed[first] = self._solve_now(self.sampler.batch(first).lengths)
            self._sync_step = first

    def _solve_now(self, lengths) -> StepPlan:
        return plan_step(lengths, self.cm, strategy=self.settings.strategy, config=self.settings.planner,
                         max_seq_len=self.args.seq_length)

    def _plan_on_rank0(self, batch) -> tuple[StepPlan, str]:
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
        return max(self.settings.planner.time_budget_s, cfg.step_budget_fraction * self._last_step_s)

    def _look_ahead(self, step: int) -> None:
        """Rank 0: ask the solver for the next batch's plan, to be solved while ``step`` trains
        (called once all ranks hold this step's plan, so that the solver's start does not delay the
        plan's broadcast)."""
        if self.service is not None and dist.get_rank() == 0:
            self.service.request(step + 1, self.sampler.batch(step + 1).lengths, self.solve_budget_s())

    def _plan(self, batch) -> tuple[StepPlan, float, str]:
        t0 = time.perf_counter()
        payload = [None, None]
        if dist.get_rank() == 0:
            plan, source = self._plan_on_rank0(batch)
            payload = [plan.to_json(), source]
        dist.broadcast_object_list(payload, src=0)
        plan = StepPlan.from_json(payload[0])
        check_agreement(payload[0], batch.step, self.device)
        model = self.cm.model
        check_plan(plan, self.pool, num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                   kv_replication=self.settings.runtime.kv_replication)
        wait_s = time.perf_counter() - t0
        self._look_ahead(batch.step)
        return plan, wait_s, payload[1]

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors live: CPU in CPU mode, else its GPU."""
        return torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())

    def close(self) -> None:
        """Stop the solver process (rank 0); call when training ends."""
        if self.service is not None:
            self.service.close()
            self.service = None

    # ------------------------------------------------------------------ the step
    def forward_backward(self, *, forward_step_func, data_iterator, model, num_microbatches,
                         seq_length, micro_batch_size, forward_only=False, **kwargs):
        """Drop-in for Megatron's schedule function (``num_microbatches`` comes from the data)."""
        chunks = model if isinstance(model, list) else [model]
        if self.switch is None:
            self._setup(chunks)
        batch = next(data_iterator)
        rank, world = dist.get_rank(), dist.get_world_size()
        device = self.device
        plan, plan_s, dispatch_s, placeholder, source = None, 0.0, 0.0, False, ""
        if self.flexsp:
            plan, plan_s, source = self._plan(batch)
            items, dispatch_s = flexsp_micro_batches(plan, batch, pool=self.pool, rank=rank, world=world,
                                                     max_position=self.args.max_position_embeddings,
                                                     device=device)
            if not items:
                items, placeholder = [placeholder_micro_batch(rank, self.pool.get((rank,)), device)], True
        else:
            items = plain_micro_batches(batch, rank=rank, world=world, seq_length=self.args.seq_length,
                                        micro_batch_size=self.args.micro_batch_size, device=device)
        if not forward_only:
            self._count_real_tokens(items, rank)
        synchronize(device)
        t0 = time.perf_counter()
        # the first step also measures the Megatron model's activation bytes per token held
        meter = SavedTensorMeter([p for c in chunks for p in c.parameters()]) if self.measure else None
        feed = _SwitchingIterator(items, self.switch, meter)
        try:
            with meter or contextlib.nullcontext():
                out = self.schedule(
                    forward_step_func=forward_step_func, data_iterator=feed,
                    model=model, num_microbatches=len(items), seq_length=seq_length,
                    micro_batch_size=micro_batch_size, forward_only=forward_only, **kwargs)
            synchronize(device)
        finally:
            self.switch.restore()
        run_s = time.perf_counter() - t0
        self._last_step_s = run_s
        act = 0.0
        if meter is not None:
            self.measure = False
            act = meter.peak_per_token
        self._report(batch, plan, out, len(items), run_s, plan_s, dispatch_s, feed.switch_s, placeholder,
                     source, act)
        return out

    def _count_real_tokens(self, items, rank: int) -> None:
        """Megatron's TFLOP/s from the real document lengths: each document once (by the first rank
        of its group), through Megatron's own per-iteration ``sum L`` and ``sum L^2`` accumulator."""
        update = getattr(self._training, "update_seqlen_stats_from_cu_seqlens", None)
        if update is None:
            return
        lens = [L for item in items if not item.placeholder and (not item.ranks or item.ranks[0] == rank)
                for L in item.real_lengths]
        # every rank adds (possibly nothing): Megatron all-reduces the sums only on ranks that did
        update(torch.tensor([0, *itertools.accumulate(lens or [0])], dtype=torch.int32, device=self.device))

    def _report(self, batch, plan, out, n_items, run_s, plan_s, dispatch_s, switch_s,
                placeholder, source, act_bytes_per_token: float = 0.0) -> None:
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # NCCL reduces GPU tensors
        for d in out or []:
            v = d["lm loss"].detach().view(-1).double().to(self.device)
            sums[0] += v[0]
            sums[1] += v[1]
        sums[2] = float(placeholder)
        worst = torch.tensor([run_s, plan_s, dispatch_s, float(n_items), switch_s, act_bytes_per_token],
                             dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if dist.get_rank() != 0:
            return
        sums, worst = sums.tolist(), worst.tolist()
        self.recorder.record(batch, plan, loss_sum=sums[0], tokens=int(sums[1]), idle_ranks=int(sums[2]),
                             worst=dict(zip(("run_s", "plan_s", "dispatch_s", "micro_batches", "switch_s"),
                                            worst[:5])),
                             source=source, solver_cpu_s=self.solver_cpu_s, act_bytes_per_token=worst[5])
