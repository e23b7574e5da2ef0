"""Planning off the critical path, measured in Megatron's training loop on CPU (4 gloo ranks).

Runs of the demo (same data, model, seed), each ``--flexsp``:

- ``precomputed``: every plan solved before training starts (the reference: no planning in steps);
- ``async-<priority>``: the solver process plans step k+1 while step k trains, at that CPU priority
  (``idle``: the default, ``low``, ``normal``); a step waits at most the budget, then uses the
  fallback;
- ``slow-solver``: as ``async`` with every solve delayed by ``--delay`` seconds: the fallback must keep
  steps on time (run once).

This machine is noisy, so the precomputed and asynchronous runs are repeated ``--repeats`` times,
interleaved (the order rotates each round), and each asynchronous run is compared with the
precomputed run of its own round. Prints a table and writes JSON: median iteration time (Megatron's
log, first 2 iterations skipped), median plan wait, where plans came from, and the ratio to
``precomputed`` (target for the default ``async``: <= 1.02): the median over rounds of the run's
median iteration time over its round's, and ``paired``: the median over all rounds and iterations of
an iteration's time over the same iteration's (same batch, same plan) in its round's precomputed run.
``solver`` is the solver process's median CPU time per step (ms, all its threads) and ``share`` that
over the machine's CPU time per iteration (cores x iteration time): on a machine whose cores training
already fills, the most the solver can take from it. Every run uses the demo's ``--flexsp-config`` (its planner settings) with the planning section
replaced.

    .venv/bin/python scripts/bench_overlap.py [--steps 16] [--repeats 3] [--priority idle low]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_flexsp.config import SOLVER_PRIORITIES  # noqa: E402
from megatron_flexsp.utils.report import header_lines, provenance, write_outputs  # noqa: E402
from tests.integration.megatron_runs import build_dataset, run_pretrain  # noqa: E402


def _measure(name: str, res) -> dict:
    steps = [r for r in res.steps if r["step"] >= 2]
    return {
        "run": name,
        "per_iteration_ms": {it: ms for it, ms in res.iteration_ms.items() if it > 2},
        "iteration_ms": statistics.median(ms for it, ms in res.iteration_ms.items() if it > 2),
        "forward_backward_ms": statistics.median(r["run_ms"] for r in steps),
        "plan_wait_ms": statistics.median(r["plan_wait_ms"] for r in steps),
        "max_plan_wait_ms": max(r["plan_wait_ms"] for r in steps),
        "sources": dict(collections.Counter(r["plan_source"] for r in res.steps)),
        "predicted_ms": statistics.median(r["predicted_ms"] for r in steps),
        "solver_cpu_ms": statistics.median(r.get("solver_cpu_ms", 0.0) for r in steps),
        "micro_batches": statistics.median(len(r["group_sizes"]) for r in res.steps),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of precomputed + async runs")
    ap.add_argument("--priority", nargs="+", default=["idle"], choices=SOLVER_PRIORITIES,
                    help="solver priorities to run (one async run each per round)")
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.25, help="plan wait budget (s)")
    ap.add_argument("--delay", type=float, default=30.0, help="solver delay of the slow-solver run (s)")
    ap.add_argument("--no-slow-solver", action="store_true", help="skip the slow-solver run")
    ap.add_argument("--bound-lp-solves", type=int, nargs="+", default=[-1],
                    help="planner bound_lp_solves of the async runs (-1: the config's); one async run "
                         "each per round and priority; the bound only changes the reported gap, not "
                         "the plans")
    ap.add_argument("--config", default=str(ROOT / "configs" / "flexsp_demo_cpu.yaml"),
                    help="the demo's --flexsp-config; its planner section is used by every run")
    ap.add_argument("--data", default=str(ROOT / "data" / "demo" / "pystdlib"))
    ap.add_argument("--out", default=str(ROOT / "out" / "bench_overlap.json"))
    ap.add_argument("--md", default=None, help="also write the table as markdown here")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.steps < 4:
        raise ValueError(f"--repeats {args.repeats} must be >= 1 and --steps {args.steps} >= 4")
    data = Path(args.data) if Path(args.data + ".idx").exists() else build_dataset(Path(args.data), 0)
    base = yaml.safe_load(Path(args.config).read_text()) or {}
    planner = dict(base.get("planner") or {})

    def config(planning: dict, lp_solves: int = -1) -> dict:
        mine = dict(planner, **({"bound_lp_solves": lp_solves} if lp_solves >= 0 else {}))
        return {**base, "planner": mine, "planning": planning} if mine else {**base, "planning": planning}

    asynchronous = {**(base.get("planning") or {}), "asynchronous": True, "precompute": False,
                    "wait_budget_s": args.budget}
    configs = {"precomputed": config({"precompute": True})}
    for prio in args.priority:
        for lp in args.bound_lp_solves:
            name = f"async-{prio}" + (f"-lp{lp}" if lp >= 0 else "")
            configs[name] = config(dict(asynchronous, solver_priority=prio), lp)
    names = list(configs)
    schedule = [(r, names[r % len(names):] + names[:r % len(names)]) for r in range(args.repeats)]
    if not args.no_slow_solver:
        configs["slow-solver"] = config(dict(asynchronous, solver_priority=args.priority[0],
                                             solver_delay_s=args.delay), args.bound_lp_solves[0])
        schedule.append((args.repeats, ["slow-solver"]))
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd, order in schedule:
            for name in order:
                cfg = Path(tmp) / f"{name}.yaml"
                cfg.write_text(yaml.safe_dump(configs[name]))
                res = run_pretrain(Path(tmp) / f"{name}-{rnd}", data,
                                   ["--flexsp", "--flexsp-config", str(cfg)], steps=args.steps,
                                   seq_length=args.seq_length, gbs=args.global_batch_size)
                if res.returncode != 0:
                    sys.stderr.write(res.log[-4000:])
                    return 1
                runs.append(dict(_measure(name, res), round=rnd))
                sys.stderr.write(f"round {rnd} {name}: {runs[-1]['iteration_ms']:.0f} ms\n")
    pre = {r["round"]: r for r in runs if r["run"] == "precomputed"}
    for r in runs:  # the slow-solver run is compared with the median precomputed run
        ref = pre.get(r["round"])
        r["ratio_to_precomputed"] = r["iteration_ms"] / (ref["iteration_ms"] if ref else statistics.median(
            p["iteration_ms"] for p in pre.values()))
        # the same iteration (same batch, same plan) of the precomputed run of the same round
        r["step_ratios"] = [ms / ref["per_iteration_ms"][it] for it, ms in r["per_iteration_ms"].items()
                            if ref and it in ref["per_iteration_ms"]]
    rows = []
    for name in configs:
        mine = [r for r in runs if r["run"] == name]
        ratios = [r["ratio_to_precomputed"] for r in mine]
        rows.append({
            "run": name, "repeats": len(mine),
            "iteration_ms": statistics.median(r["iteration_ms"] for r in mine),
            "forward_backward_ms": statistics.median(r["forward_backward_ms"] for r in mine),
            "predicted_ms": statistics.median(r["predicted_ms"] for r in mine),
            "plan_wait_ms": statistics.median(r["plan_wait_ms"] for r in mine),
            "solver_cpu_ms": statistics.median(r["solver_cpu_ms"] for r in mine),
            "max_plan_wait_ms": max(r["max_plan_wait_ms"] for r in mine),
            "micro_batches": statistics.median(r["micro_batches"] for r in mine),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "step_ratio_median": statistics.median(x for r in mine for x in r["step_ratios"])
            if any(r["step_ratios"] for r in mine) else None,
            "sources": dict(sum((collections.Counter(r["sources"]) for r in mine), collections.Counter())),
        })
    cores = os.cpu_count() or 1
    for r in rows:  # what the solver takes of the machine's CPU time per step
        r["solver_cpu_share"] = r["solver_cpu_ms"] / (cores * r["iteration_ms"])
    lines = header_lines("Planning off the critical path (CPU, 4 gloo ranks)",
                         provenance(steps=args.steps, repeats=args.repeats, seq_length=args.seq_length,
                                    global_batch_size=args.global_batch_size, wait_budget_s=args.budget,
                                    config=Path(args.config).name)) + [
        "| run | rounds | micro-batches per step | iteration ms | fwd-bwd ms | predicted ms | plan wait ms "
        "(median / max) | solver CPU ms per step | share | x precomputed: median (min-max) | paired "
        "| plan sources |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['run']} | {r['repeats']} | {r['micro_batches']:.0f} | {r['iteration_ms']:.0f} | "
                     f"{r['forward_backward_ms']:.0f} | {r['predicted_ms']:.0f} | {r['plan_wait_ms']:.0f} / "
                     f"{r['max_plan_wait_ms']:.0f} | {r['solver_cpu_ms']:.1f} | {100 * r['solver_cpu_share']:.1f}% | "
                     f"{r['ratio_median']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | "
                     f"{r['step_ratio_median'] or 0:.3f} | {r['sources']} |")
    print("\n".join(lines))
    for path in write_outputs(args.out, {"settings": vars(args), "rows": rows, "runs": runs}, args.md,
                              lines if args.md else None):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
