"""One training step of ``pretrain_gpt_flexsp.py``: global batch -> plan -> micro-batches -> Megatron.

:class:`StepDriver` owns the document splits, the cost model, the group pool and the
context-parallel switch. Its :meth:`forward_backward` replaces Megatron's schedule function (see
:mod:`patches.schedule`): it takes one global batch from the data iterator, plans it (rank 0 solves,
the plan is broadcast), dispatches every rank its shards, and runs Megatron's no-pipelining schedule
over this rank's micro-batches. Without ``--flexsp`` the same driver packs each rank's documents into
rows (the plain-Megatron baseline). Rank 0 appends one JSON line per step to ``steps.jsonl``.

Debugging parity: with ``FLEXSP_DEBUG_GRAD_DIR`` set, every rank saves its parameters' reduced
gradients (Megatron's ``main_grad``, after ``finalize_model_grads``) after each step to
``grads_iter<I>_rank<R>.pt`` there, so two runs can be compared gradient by gradient.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_flexsp.integration.accounting import CheckpointAccounting
from megatron_flexsp.integration.args import FlexSPSettings
from megatron_flexsp.integration.splits import BatchSchedule, build_splits, check_data_paths
from megatron_flexsp.integration.records import StepRecorder
from megatron_flexsp.integration.microbatches import (flexsp_micro_batches, placeholder_micro_batch,
                                                      plain_micro_batches)
from megatron_flexsp.integration.planning import RunPlanner, build_cost_model, model_spec_from_args  # noqa: F401
from megatron_flexsp.runtime.groups import SPGroupPool
from megatron_flexsp.runtime.device import synchronize
from megatron_flexsp.runtime.profiler import SavedTensorMeter
from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)


def params_dtype(args) -> torch.dtype:
    """The activation dtype Megatron trains with (``--bf16`` / ``--fp16``, else fp32)."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


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


def megatron_tp_group(tp: int):
    """Megatron's tensor-parallel group of this rank, checked to be the ranks ``device * tp .. + tp-1``
    that FlexSP's devices assume (Megatron's default order with pipeline = context = 1)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    first = dist.get_rank() // tp * tp
    if ranks != list(range(first, first + tp)):
        raise RuntimeError(f"Megatron's tensor-parallel group of rank {dist.get_rank()} is {ranks}; "
                           f"--flexsp needs consecutive ranks {list(range(first, first + tp))} (the "
                           f"default rank order, without --use-tp-pp-dp-mapping)")
    return group


class StepDriver:
    """Everything a step needs besides the model; create it on every rank alike."""

    def __init__(self, args, settings: FlexSPSettings, *, on_cpu: bool) -> None:
        self.args, self.settings, self.on_cpu = args, settings, on_cpu
        self.measure = True  # activation bytes per token, in the first step
        self.flexsp = bool(args.flexsp)
        check_data_paths(args)
        self.batches = BatchSchedule(args)
        self.splits: dict = {}  # built when Megatron asks for datasets (datasets())
        self.eod: int | None = None  # --eod-mask-loss: the token that trains no loss
        self.cm = build_cost_model(args, settings, on_cpu) if self.flexsp else None
        self.backend = settings.runtime.backend(on_cpu, params_dtype(args),
                                                getattr(args, "transformer_impl", "local"))
        self.pool = None
        self.switch = None
        self.schedule = None
        self.tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        # THD shards split over TP ranks under sequence parallelism: pad to 2 d tp (Megatron's rule)
        self.pad_multiple = self.tp if getattr(args, "sequence_parallel", False) else 1
        self.tp_group = None
        self.out_dir = Path(args.flexsp_plan_dir or (Path(args.save) / "flexsp" if args.save
                                                     else "flexsp_out"))
        self.recorder = StepRecorder(self.out_dir, self.cm, settings.strategy if self.flexsp else "plain",
                                     write=int(getattr(args, "rank", 0) or 0) == 0,
                                     log_interval=getattr(args, "log_interval", 1))
        self.planner = RunPlanner(args, settings, self.cm, self.train_lengths) if self.flexsp else None
        self.accounting = CheckpointAccounting(args, self, self.out_dir, self.recorder)
        self._training = None  # megatron.training.training, looked up at the first step
        self._chunks = None  # the model chunks, seen at the first step

    # ------------------------------------------------------------------ data
    def datasets(self, sizes):
        """Megatron's dataset provider: the train, validation and test iterators of whole-document
        global batches, holding at least ``sizes`` samples each (``None`` for a split without
        documents)."""
        from megatron.training import get_tokenizer

        tokenizer = get_tokenizer()
        self.eod = tokenizer.eod if getattr(self.args, "eod_mask_loss", False) else None
        sizes = list(sizes)
        if self.args.train_iters:  # what the batch schedule draws (Megatron counts a constant batch)
            sizes[0] = max(sizes[0] or 0, self.batches.start(self.args.train_iters))
        self.splits = build_splits(self.args, tokenizer, sizes)
        valid, test = self.splits["valid"], self.splits["test"]
        return (self._train_iterator(),
                self._eval_iterator(valid, int(getattr(self.args, "consumed_valid_samples", 0) or 0))
                if valid else None,
                self._eval_iterator(test, 0) if test else None)

    @property
    def data_acct(self):
        """Documents left out of the train split, by reason."""
        return self.splits["train"].acct

    def train_lengths(self, step: int):
        """Document lengths of training step ``step`` (no tokens loaded)."""
        return self.splits["train"].batch(step, self.batches.start(step), self.batches.size(step)).lengths

    def _loads(self) -> tuple[bool, int, int]:
        """Whether this rank reads tokens, its device and the number of devices: with --flexsp TP
        rank 0 of each device reads and broadcasts (dispatch); plain: every TP rank reads its
        data-parallel rank's documents."""
        device, tp_rank = divmod(dist.get_rank(), self.tp)
        return (tp_rank == 0 or not self.flexsp), device, dist.get_world_size() // self.tp

    def _train_iterator(self):
        """Training batches from Megatron's iteration and consumed-sample count on (a resume
        continues exactly; the batch size follows Megatron's schedule)."""
        from megatron.core.num_microbatches_calculator import get_current_global_batch_size

        step = int(self.args.iteration or 0)
        start = self.batches.start(step)
        if start != int(self.args.consumed_train_samples or 0):
            raise ValueError(f"resuming at iteration {step}: Megatron consumed "
                             f"{self.args.consumed_train_samples} samples, but this run's batch "
                             f"schedule {self.batches.state()} starts step {step} at sample {start}")
        self.accounting.check_resume()
        load, device, devices = self._loads()
        acct = self.data_acct
        log.info("train documents: %d, usable %d, truncated %d (%d tokens), dropped %d short / %d long; "
                 "starting at step %d (sample %d)", acct.num_documents, acct.usable_documents,
                 acct.truncated_documents, acct.truncated_tokens, acct.dropped_too_short,
                 acct.dropped_too_long, step, start)
        while True:
            size = self.batches.size(step)
            megatron_size = get_current_global_batch_size()
            if megatron_size != size:
                raise RuntimeError(f"step {step}: Megatron's global batch size is {megatron_size}, the "
                                   f"document schedule's {size}: documents would be skipped or repeated")
            yield self.splits["train"].batch(step, self.batches.start(step), size, load=load,
                                             device=device, devices=devices)
            step += 1

    def _eval_iterator(self, split, start: int):
        """Evaluation batches of Megatron's evaluation batch size (``--eval-global-batch-size``,
        default ``--global-batch-size``) from sample ``start`` on."""
        load, device, devices = self._loads()
        size = int(getattr(self.args, "eval_global_batch_size", None) or self.args.global_batch_size)
        step = 0
        while True:
            yield split.batch(step, start, size, load=load, device=device, devices=devices)
            start += size
            step += 1

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
        if self.tp > 1:
            self.tp_group = megatron_tp_group(self.tp)
        if self.flexsp:
            minutes = getattr(self.args, "distributed_timeout_minutes", None) or 10
            self.pool = SPGroupPool(self.cm.cluster, self.cm.sizes, singletons=True, device=self.device,
                                    timeout=datetime.timedelta(minutes=minutes), tp=self.tp)
            log.info("group pool: sizes %s on %d devices of %d rank(s) (%d per node), attention %s",
                     self.cm.sizes, self.cm.cluster.num_gpus, self.tp, self.cm.cluster.gpus_per_node,
                     self.backend)
            if dist.get_rank() == 0:
                self.planner.start()

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors live: CPU in CPU mode, else its GPU."""
        return torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())

    def on_save(self, iteration: int) -> None:
        """Rank 0: the document accounting next to Megatron's checkpoint of ``iteration``."""
        self.accounting.on_save(iteration)

    def close(self) -> None:
        """Stop the solver process (rank 0); call when training ends."""
        if self.planner is not None:
            self.planner.close()

    def on_train_step(self, iteration, result) -> None:
        """Megatron's ``train_step`` returned ``result`` (patched in by :mod:`patches.schedule`)."""
        if dist.get_rank() == 0:
            loss_reduced, skipped, grad_norm = result[0], result[1], result[5]
            self.recorder.megatron_step(iteration, loss_reduced, grad_norm, skipped)
        grad_dir = os.environ.get("FLEXSP_DEBUG_GRAD_DIR")
        if grad_dir and self._chunks is not None:
            grads = {name: p.main_grad.detach().clone() for c in self._chunks
                     for name, p in c.named_parameters() if getattr(p, "main_grad", None) is not None}
            Path(grad_dir).mkdir(parents=True, exist_ok=True)
            torch.save(grads, Path(grad_dir) / f"grads_iter{iteration}_rank{dist.get_rank()}.pt")

    # ------------------------------------------------------------------ the step
    def forward_backward(self, *, forward_step_func, data_iterator, model, num_microbatches,
                         seq_length, micro_batch_size, forward_only=False, **kwargs):
        """Drop-in for Megatron's schedule function (``num_microbatches`` comes from the data)."""
        chunks = model if isinstance(model, list) else [model]
        if self.switch is None:
            self._setup(chunks)
            self._chunks = chunks
        batch = next(data_iterator)
        rank, world = dist.get_rank(), dist.get_world_size()
        me = rank // self.tp
        device = self.device
        plan, plan_s, dispatch_s, placeholder, source = None, 0.0, 0.0, False, ""
        if self.flexsp:
            plan, plan_s, source = self.planner.plan(batch, self.pool, self.device)
            items, dispatch_s = flexsp_micro_batches(plan, batch, pool=self.pool, rank=rank, world=world,
                                                     max_position=self.args.max_position_embeddings,
                                                     device=device, tp_group=self.tp_group,
                                                     pad_multiple=self.pad_multiple, eod=self.eod)
            if not items:
                items = [placeholder_micro_batch(rank, self.pool.get((me,)), device, self.pad_multiple)]
                placeholder = True
        else:
            items = plain_micro_batches(batch, rank=me, world=world // self.tp,
                                        seq_length=self.args.seq_length,
                                        micro_batch_size=self.args.micro_batch_size, device=device,
                                        eod=self.eod)
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
        if self.planner is not None and not forward_only:
            self.planner.last_step_s = run_s
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
        if dist.get_rank() % self.tp == 0:  # TP peers hold the same losses: count each device once
            for d in out or []:
                v = d["lm loss"].detach().view(-1).double().to(self.device)
                sums[0] += v[0]
                sums[1] += v[1]
            sums[2] = float(placeholder)
        worst = torch.tensor([run_s, plan_s, dispatch_s, float(n_items), switch_s, act_bytes_per_token],
                             dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        sums, worst = sums.tolist(), worst.tolist()
        rec = self.recorder.record(
            batch, plan, loss_sum=sums[0], tokens=int(sums[1]), idle_ranks=int(sums[2]),
            worst=dict(zip(("run_s", "plan_s", "dispatch_s", "micro_batches", "switch_s"), worst[:5])),
            source=source, solver_cpu_s=self.planner.solver_cpu_s if self.planner else 0.0,
            act_bytes_per_token=worst[5])
        self.recorder.publish(rec, batch.step + 1)  # Megatron's iteration count after this step
