"""``flexsp`` command line: ``plan`` and ``simulate`` global batches sampled from a lengths file.

Entry-level module (may print). Examples::

    flexsp plan --lengths ../shared/seqlen/flexsp_wikipedia_seqlens.txt --global-batch 512 \\
        --num-batches 4 --seed 0 --num-gpus 64 --gpus-per-node 8 --profile a100-paper \\
        --model gpt-7b --max-seq-len 196608 --json plans.json --plot plan.png
    flexsp simulate ...same inputs...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

import importlib

from megatron_flexsp.config import (BUILTIN_STRATEGIES, EXTERNAL_STRATEGIES, OVER_LENGTH_POLICIES,
                                   STRATEGIES, PlannerConfig)
from megatron_flexsp.cost_model import CostModel, load_profile
from megatron_flexsp.model_spec import get_model
from megatron_flexsp.parallelism import RECOMPUTE, Parallelism
from megatron_flexsp.plan import StepPlan, validate_plan
from megatron_flexsp.planner import plan_step
from megatron_flexsp.sim import simulate
from megatron_flexsp.sim.gap import GapParts, gap_parts
from megatron_flexsp.sim.workloads import load_lengths, sample_batches


def _out(text: str = "", *, err: bool = False) -> None:
    """The CLI's user-facing output (tables to stdout, progress and errors to stderr)."""
    stream = sys.stderr if err else sys.stdout
    stream.write(text + "\n")
    stream.flush()


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", required=True, help="file with one sequence length per line")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per global batch")
    p.add_argument("--num-batches", type=int, default=1, help="global batches to sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-gpus", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--profile", required=True, help="shipped profile name or path to a profile JSON")
    p.add_argument("--model", default=None, help="model preset (default: the profile's only model)")
    p.add_argument("--max-seq-len", type=int, required=True, help="data-loader truncation length")
    p.add_argument("--cost-mode", choices=("flexsp", "reference"), default="flexsp",
                   help="'reference' reproduces the FlexSP reference code's cost model exactly")
    p.add_argument("--over-length", choices=OVER_LENGTH_POLICIES, default="error")
    p.add_argument("--kv-replication", action="store_true",
                   help="GQA: allow groups larger than the KV-head count by replicating KV heads")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size inside a node (groups are formed over num_gpus/tp devices)")
    p.add_argument("--sequence-parallel", action="store_true", help="TP's sequence parallelism")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none",
                   help="activation recomputation ('full': every layer, uniform)")
    p.add_argument("--json", dest="json_out", default=None, help="write plans / results as JSON")
    p.add_argument("--time-budget", type=float, default=PlannerConfig().time_budget_s,
                   help="flexsp planning budget per batch (seconds)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexsp", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="plan sampled global batches with one strategy")
    _common(plan)
    plan.add_argument("--strategy", choices=STRATEGIES, default="flexsp")
    plan.add_argument("--plot", default=None, help="Gantt chart PNG of the first batch's plan")
    plan.add_argument("--explain", action="store_true",
                      help="per batch, where the step goes beyond the floor every plan pays (extra "
                           "micro-batches, idle GPUs, larger groups) and what the bound proves above it")
    sim = sub.add_parser("simulate", help="run all strategies side by side and compare step times")
    _common(sim)
    sim.add_argument("--megatron-hybrid-cp", action="store_true",
                     help="also run Megatron's own hybrid-CP scheduler (imports megatron-core)")
    return parser


def _setup(args) -> tuple[CostModel, list, PlannerConfig, int]:
    if args.gpus_per_node <= 0 or args.num_gpus <= 0:
        raise ValueError(f"--num-gpus={args.num_gpus} and --gpus-per-node={args.gpus_per_node} "
                         f"must be positive")
    if args.num_gpus % args.gpus_per_node and args.num_gpus > args.gpus_per_node:
        raise ValueError(f"--num-gpus={args.num_gpus} is not a multiple of "
                         f"--gpus-per-node={args.gpus_per_node}")
    profile = load_profile(args.profile)
    name = args.model or (next(iter(profile.models)) if len(profile.models) == 1 else None)
    if name is None:
        raise ValueError(f"--model is required: profile {profile.name!r} has models "
                         f"{sorted(profile.models) or 'none'}")
    cm = CostModel.from_profile(profile, get_model(name), num_gpus=args.num_gpus,
                                max_seq_len=args.max_seq_len,
                                reference_exact=args.cost_mode == "reference",
                                allow_kv_replication=args.kv_replication,
                                parallel=Parallelism(args.tp, args.sequence_parallel, args.recompute))
    if profile.gpus_per_node != args.gpus_per_node:
        raise ValueError(f"--gpus-per-node={args.gpus_per_node} differs from profile "
                         f"{profile.name!r} ({profile.gpus_per_node})")
    lengths = load_lengths(args.lengths)
    batches, cut = sample_batches(lengths, global_batch=args.global_batch,
                                  num_batches=args.num_batches, seed=args.seed,
                                  max_seq_len=args.max_seq_len)
    return cm, batches, PlannerConfig(over_length=args.over_length, time_budget_s=args.time_budget), cut


def _groups_text(plan: StepPlan) -> str:
    parts = []
    for sizes in plan.group_sizes:
        c = Counter(sizes)
        parts.append(" ".join(f"{c[d]}x{d}" for d in sorted(c, reverse=True)))
    return " | ".join(parts)


def _explain(parts: GapParts) -> str:
    sh = parts.shares()
    return (f"{'':>5} floor {parts.floor_ms:.1f} ms; above it (shares of the step): micro-batches "
            f"beyond the memory minimum of {parts.min_micro_batches} {sh['micro_batches']:.2%}, idle GPUs "
            f"{sh['idle']:.2%}, larger groups {sh['sizes']:.2%}; the bound proves {sh['bound_over_floor']:.2%}")


def _progress(k: int, total: int, started: float) -> None:
    if total > 1:
        _out(f"  planned {k}/{total} batches ({time.perf_counter() - started:.1f} s)", err=True)


def cmd_plan(args) -> int:
    cm, batches, cfg, cut = _setup(args)
    _load_external([args.strategy])
    plans = []
    _out(f"{'batch':>5} {'tokens':>8} {'max':>7} {'step ms':>9} {'gap':>7} {'solve s':>8}  method / groups")
    started = time.perf_counter()
    for k, b in enumerate(batches):
        plan = plan_step(b, cm, strategy=args.strategy, config=cfg, max_seq_len=args.max_seq_len)
        validate_plan(plan)
        plans.append(plan)
        gap = f"{plan.gap:.2%}" if plan.lower_bound_ms > 0 else "-"
        _out(f"{k:>5} {int(b.sum()):>8} {int(b.max()):>7} {plan.predicted_step_ms:>9.1f} {gap:>7} "
              f"{plan.solve_time_s:>8.2f}  {plan.method}: {_groups_text(plan)}")
        if args.explain:
            _out(_explain(gap_parts(plan, cm)))
        _progress(k + 1, len(batches), started)
    if cut:
        _out(f"data loader truncated {cut} tokens at --max-seq-len={args.max_seq_len}")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"cost_model": cm.describe(), "plans": [p.to_dict() for p in plans]}, fh)
        _out(f"wrote {len(plans)} plan(s) to {args.json_out}")
    if args.plot:
        from megatron_flexsp.viz import plot_plan

        plot_plan(plans[0], cm, args.plot)
        _out(f"wrote {args.plot}")
    return 0


def _load_external(strategies) -> None:
    """Import the modules that register external strategies (they import other packages)."""
    for s in strategies:
        if s in EXTERNAL_STRATEGIES:
            importlib.import_module(EXTERNAL_STRATEGIES[s])


def cmd_simulate(args) -> int:
    cm, batches, cfg, _ = _setup(args)
    STRATEGIES = BUILTIN_STRATEGIES + (("megatron-hybrid-cp",) if args.megatron_hybrid_cp else ())
    _load_external(STRATEGIES)
    rows = []
    _out(f"{'batch':>5} " + " ".join(f"{s:>13}" for s in STRATEGIES) + f" {'vs static':>9} {'vs batchada':>11}")
    started = time.perf_counter()
    for k, b in enumerate(batches):
        row = {}
        for s in STRATEGIES:
            plan = plan_step(b, cm, strategy=s, config=cfg, max_seq_len=args.max_seq_len)
            validate_plan(plan)
            res = simulate(plan, cm)
            row[s] = {"step_ms": res.step_ms, "idle_fraction": res.idle_fraction,
                      "alltoall_fraction": res.alltoall_fraction, "memory_ok": res.memory_ok,
                      "micro_batches": res.num_micro_batches, "solve_time_s": plan.solve_time_s}
        rows.append(row)
        f = row["flexsp"]["step_ms"]
        _out(f"{k:>5} " + " ".join(f"{row[s]['step_ms']:>13.1f}" for s in STRATEGIES)
              + f" {row['static']['step_ms'] / f:>8.2f}x {row['batchada']['step_ms'] / f:>10.2f}x")
        _progress(k + 1, len(batches), started)
    tot = {s: sum(r[s]["step_ms"] for r in rows) for s in STRATEGIES}
    _out("total " + " ".join(f"{tot[s]:>13.1f}" for s in STRATEGIES)
          + f" {tot['static'] / tot['flexsp']:>8.2f}x {tot['batchada'] / tot['flexsp']:>10.2f}x")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"cost_model": cm.describe(), "batches": rows, "total_ms": tot}, fh, indent=1)
        _out(f"wrote {args.json_out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"plan": cmd_plan, "simulate": cmd_simulate}[args.command](args)
    except ValueError as exc:
        _out(f"flexsp: error: {exc}", err=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
