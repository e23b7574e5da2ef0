"""Per-step records of ``pretrain_gpt_flexsp.py``: JSON lines, a plan picture, log lines, and
Megatron's TensorBoard and W&B writers.

:class:`StepRecorder` (rank 0 writes files) appends one JSON line per training step to
``steps.jsonl`` (loss, tokens, measured and predicted times, plan wait, dispatch, group switching,
where the plan came from, its gap and group sizes) and per evaluation batch to ``eval.jsonl``,
every plan to ``plans.jsonl`` and what Megatron's ``train_step`` returned (its reduced ``lm loss``,
the gradient norm) to ``megatron.jsonl``, at full precision; draws the first plan (when matplotlib
is installed) and logs one line every ``--log-interval`` steps. It keeps the run's totals that the
checkpoint's document accounting reports. :meth:`StepRecorder.publish` adds a step's numbers to
Megatron's TensorBoard and W&B writers, on the rank that holds them (``flexsp/...`` scalars).
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)


class StepRecorder:
    """Writes under ``out_dir``; ``cm``: the cost model (for the plan picture; None without --flexsp)."""

    def __init__(self, out_dir: Path, cm, mode: str, *, write: bool = True, log_interval: int = 1) -> None:
        self.out_dir, self.cm, self.mode = Path(out_dir), cm, mode
        self.write, self.log_interval = write, max(1, int(log_interval or 1))
        self.totals = {"steps": 0, "documents": 0, "tokens": 0, "truncated_documents": 0}
        self._pictured = False

    def record(self, batch, plan, *, loss_sum: float, tokens: int, idle_ranks: int, worst: dict,
               source: str = "", solver_cpu_s: float = 0.0, act_bytes_per_token: float = 0.0) -> dict:
        """One step's record (``worst``: maxima over ranks, seconds); returns it. Call on every rank
        alike; only a writing rank writes files and logs."""
        train = batch.split == "train"
        if train:
            for key, value in (("steps", 1), ("documents", len(batch.lengths)), ("tokens", tokens),
                               ("truncated_documents", batch.truncated)):
                self.totals[key] += value
        rec = {"step": batch.step, **({} if train else {"split": batch.split}), "mode": self.mode,
               "loss": loss_sum / max(tokens, 1), "tokens": tokens, "documents": len(batch.lengths), "truncated": batch.truncated,
               "run_ms": 1e3 * worst["run_s"], "plan_wait_ms": 1e3 * worst["plan_s"],
               "dispatch_ms": 1e3 * worst["dispatch_s"], "switch_ms": 1e3 * worst["switch_s"],
               "max_micro_batches_per_rank": int(worst["micro_batches"]), "idle_ranks": idle_ranks}
        if plan is not None:
            rec.update(plan_source=source, predicted_ms=plan.predicted_step_ms,
                       plan_budget_s=plan.info.get("time_budget_s"), solver_cpu_ms=1e3 * solver_cpu_s,
                       gap=plan.gap if plan.lower_bound_ms > 0 else None, method=plan.method,
                       group_sizes=plan.group_sizes, solve_s=plan.solve_time_s)
        if not self.write:
            return rec
        if act_bytes_per_token > 0:
            rec["activation_bytes_per_token"] = act_bytes_per_token
            model_value = self.cm.activation_bytes_per_token if self.cm is not None else None
            log.info("activation memory of the Megatron model, measured in step %d: %.0f bytes per token "
                     "held at the peak of a micro-batch (cost model: %s)", batch.step, act_bytes_per_token,
                     "n/a" if model_value is None else f"{model_value:.0f}")
        if plan is not None and (not train or batch.step % self.log_interval == 0):
            log.info("%s %s %d: %d micro-batches, groups %s, plan by %s (%s, gap %s), predicted %.0f "
                     "ms, measured %.0f ms (plan wait %.0f ms, dispatch %.0f ms), loss %.4f",
                     self.mode, "step" if train else f"{batch.split} batch", batch.step,
                     len(plan.micro_batches), plan.group_sizes, source,
                     plan.method, "n/a" if rec["gap"] is None else f"{100 * rec['gap']:.1f}%",
                     plan.predicted_step_ms, rec["run_ms"], rec["plan_wait_ms"], rec["dispatch_ms"],
                     rec["loss"])
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / ("steps.jsonl" if train else "eval.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        if plan is not None and train:
            with open(self.out_dir / "plans.jsonl", "a") as f:
                f.write(plan.to_json() + "\n")
            if not self._pictured:
                self._picture(plan, batch)
        return rec

    def publish(self, rec: dict, iteration: int) -> None:
        """A training step's numbers to Megatron's TensorBoard and W&B writers, where this rank has
        them (Megatron creates them on one rank), as ``flexsp/<name>`` at ``iteration``."""
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        tb, wandb = get_tensorboard_writer(), get_wandb_writer()
        if (tb is None and wandb is None) or "split" in rec:
            return
        scalars = {k: rec[k] for k in ("loss", "tokens", "run_ms", "plan_wait_ms", "dispatch_ms",
                                       "switch_ms", "max_micro_batches_per_rank", "idle_ranks",
                                       "predicted_ms", "gap") if rec.get(k) is not None}
        source = rec.get("plan_source", "")
        if source:
            scalars["plan_from_solver"] = float(source in ("solver", "solver-sync", "precomputed", "replay"))
            scalars["plan_fallback"] = float(source.startswith("fallback"))
        for mb in rec.get("group_sizes", []):
            for d in mb:
                scalars[f"groups_of_{d}"] = scalars.get(f"groups_of_{d}", 0) + 1
        if rec.get("predicted_ms"):
            scalars["measured_over_predicted"] = rec["run_ms"] / rec["predicted_ms"]
        for k, v in scalars.items():
            if tb is not None:
                tb.add_scalar(f"flexsp/{k}", v, iteration)
        if wandb is not None:
            wandb.log({f"flexsp/{k}": v for k, v in scalars.items()}, iteration)

    def megatron_step(self, iteration, loss_reduced: dict, grad_norm, skipped: int) -> dict:
        """What Megatron's ``train_step`` returned for ``iteration`` (its losses reduced over the
        global batch, the gradient norm before clipping), at full precision, to ``megatron.jsonl``."""
        rec = {"iteration": None if iteration is None else int(iteration), "skipped": int(skipped),
               "grad_norm": None if grad_norm is None else float(grad_norm),
               **{key.replace(" ", "_"): float(value) for key, value in loss_reduced.items()}}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / "megatron.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec

    def _picture(self, plan, batch) -> None:
        self._pictured = True
        try:
            from megatron_flexsp.viz import plot_plan

            path = self.out_dir / f"plan_step{batch.step}.png"
            plot_plan(plan, self.cm, str(path), title=f"step {batch.step}: {len(batch.lengths)} "
                      f"documents on {plan.num_gpus} ranks")
            log.info("plan picture: %s", path)
        except ImportError as exc:  # matplotlib is optional where training runs
            log.info("no plan picture (%s)", exc)
