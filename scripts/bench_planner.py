#!/usr/bin/env python
"""Planner benchmark on the real Wikipedia lengths: latency, proven gap, step times, reference MILP.

For each cluster size N (global batch 8*N, max length 192K, GPT-7B with the paper's constants by
default) it samples batches, plans each with every strategy, and reports: flexsp plan latency
p50/p99 (one core), realized gap against the valid lower bound (median / max), mean simulated step
time per strategy and flexsp's speedups; then a head-to-head with the reference's per-slot MILP
(HiGHS, 10 s limit per micro-batch) on the first batches at the smallest N. Prints tables and writes
JSON (default out/bench_planner.json). Example:

    python scripts/bench_planner.py --gpus 64,256,1024,4096 --batches 20,5,2,1 --ref-batches 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_milp import plan_reference  # noqa: E402

from megatron_flexsp.config import STRATEGIES, PlannerConfig  # noqa: E402
from megatron_flexsp.cost_model import CostModel, load_profile  # noqa: E402
from megatron_flexsp.model_spec import get_model  # noqa: E402
from megatron_flexsp.plan import validate_plan  # noqa: E402
from megatron_flexsp.planner import plan_step  # noqa: E402
from megatron_flexsp.sim import simulate  # noqa: E402
from megatron_flexsp.sim.workloads import load_lengths, sample_batches  # noqa: E402

PAPER = {"flexsp_vs_deepspeed": 1.72, "flexsp_vs_megatron": 1.98, "batchada_vs_deepspeed": 1.34,
         "batchada_vs_megatron": 1.54}


def pct(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def bench_setting(n, batches, cm, cfg, max_len):
    rows = []
    for k, b in enumerate(batches):
        row = {"tokens": int(b.sum()), "max_len": int(b.max())}
        for s in STRATEGIES:
            t0 = time.perf_counter()
            plan = plan_step(b, cm, strategy=s, config=cfg, max_seq_len=max_len)
            wall = time.perf_counter() - t0
            validate_plan(plan)
            sim = simulate(plan, cm)
            assert sim.memory_ok, (s, k)
            row[s] = {"step_ms": sim.step_ms, "plan_s": wall, "micro_batches": sim.num_micro_batches,
                      "idle_fraction": sim.idle_fraction, "alltoall_fraction": sim.alltoall_fraction}
            if s == "flexsp":
                row[s].update({"gap": plan.gap, "lower_bound_ms": plan.lower_bound_ms,
                               "method": plan.method, "bucketing_error": plan.bucketing_error,
                               "level_time_s": plan.info.get("level_time_s"),
                               "lp_time_s": plan.info.get("lp_time_s", 0.0),
                               "lp_solves": plan.info.get("lp_solves", 0)})
        rows.append(row)
        f = row["flexsp"]
        print(f"  N={n} batch {k + 1}/{len(batches)}: flexsp {f['step_ms']:.0f} ms "
              f"(gap {f['gap']:.2%}, {f['plan_s']:.1f} s, {f['method']}), batchada "
              f"{row['batchada']['step_ms']:.0f}, static {row['static']['step_ms']:.0f}",
              file=sys.stderr, flush=True)
    lat = [r["flexsp"]["plan_s"] for r in rows]
    gaps = [r["flexsp"]["gap"] for r in rows]
    tot = {s: float(sum(r[s]["step_ms"] for r in rows)) for s in STRATEGIES}
    summary = {
        "num_gpus": n, "global_batch": len(batches[0]), "batches": len(rows),
        "plan_p50_s": pct(lat, 50), "plan_p99_s": pct(lat, 99), "gap_median": pct(gaps, 50),
        "gap_max": max(gaps), "mean_step_ms": {s: tot[s] / len(rows) for s in STRATEGIES},
        "speedup_vs_static": tot["static"] / tot["flexsp"],
        "speedup_vs_batchada": tot["batchada"] / tot["flexsp"],
        "speedup_vs_megatron_dcp": tot["megatron-dcp"] / tot["flexsp"],
        "batchada_vs_static": tot["static"] / tot["batchada"],
        "flexsp_slower_than_batchada": sum(r["flexsp"]["step_ms"] > r["batchada"]["step_ms"] * (1 + 1e-9)
                                           for r in rows),
        "flexsp_idle_fraction": float(np.mean([r["flexsp"]["idle_fraction"] for r in rows])),
        "flexsp_alltoall_fraction": float(np.mean([r["flexsp"]["alltoall_fraction"] for r in rows])),
    }
    return summary, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default=str(Path(__file__).resolve().parents[2] / "shared" / "seqlen"
                                             / "flexsp_wikipedia_seqlens.txt"))
    ap.add_argument("--gpus", default="64,256,1024,4096")
    ap.add_argument("--batches", default="20,5,2,1", help="batches per cluster size")
    ap.add_argument("--ref-batches", type=int, default=5)
    ap.add_argument("--milp-batches", type=int, default=5,
                    help="also plan this many batches at the smallest N with search=milp (the step "
                         "MILP warm-started from level packing) to compare quality, bound and time")
    ap.add_argument("--ref-time-limit", type=float, default=10.0)
    ap.add_argument("--profile", default="a100-paper")
    ap.add_argument("--model", default="gpt-7b")
    ap.add_argument("--max-seq-len", type=int, default=196608)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_planner.json")
    args = ap.parse_args()
    gpus = [int(x) for x in args.gpus.split(",")]
    counts = [int(x) for x in args.batches.split(",")]
    if len(counts) != len(gpus):
        raise SystemExit(f"--batches has {len(counts)} entries, --gpus {len(gpus)}")
    lengths = load_lengths(args.lengths)
    profile = load_profile(args.profile)
    cfg = PlannerConfig()
    result = {"profile": args.profile, "model": args.model, "max_seq_len": args.max_seq_len,
              "planner_config": cfg.to_dict(), "paper": PAPER, "settings": [], "reference": [], "milp": []}
    for n, k in zip(gpus, counts):
        cm = CostModel.from_profile(profile, get_model(args.model), num_gpus=n, max_seq_len=args.max_seq_len)
        batches, _ = sample_batches(lengths, global_batch=8 * n, num_batches=k, seed=args.seed,
                                    max_seq_len=args.max_seq_len)
        summary, rows = bench_setting(n, batches, cm, cfg, args.max_seq_len)
        result["settings"].append({"summary": summary, "batches": rows})
        if n == gpus[0] and args.milp_batches > 0:
            mcfg = PlannerConfig(search="milp")
            for j, b in enumerate(batches[:args.milp_batches]):
                t0 = time.perf_counter()
                plan = plan_step(b, cm, config=mcfg, max_seq_len=args.max_seq_len)
                result["milp"].append({"batch": j, "milp_step_ms": plan.predicted_step_ms,
                                       "milp_bound_ms": plan.lower_bound_ms,
                                       "milp_plan_s": time.perf_counter() - t0, "milp_method": plan.method,
                                       "level_step_ms": rows[j]["flexsp"]["step_ms"],
                                       "level_bound_ms": rows[j]["flexsp"]["lower_bound_ms"],
                                       "level_plan_s": rows[j]["flexsp"]["plan_s"]})
                print(f"  milp batch {j + 1}/{args.milp_batches}", file=sys.stderr, flush=True)
        if n == gpus[0] and args.ref_batches > 0:
            for j, b in enumerate(batches[:args.ref_batches]):
                plan, info = plan_reference(b, cm, time_limit_s=args.ref_time_limit, seed=args.seed)
                ours = rows[j]["flexsp"]
                ref_ms = simulate(plan, cm).step_ms if plan is not None else None
                result["reference"].append({"batch": j, "reference_step_ms": ref_ms,
                                            "reference_plan_s": plan.solve_time_s if plan else None,
                                            "reference_status": info["status"],
                                            "flexsp_step_ms": ours["step_ms"], "flexsp_plan_s": ours["plan_s"],
                                            "batchada_step_ms": rows[j]["batchada"]["step_ms"]})
                print(f"  reference batch {j + 1}/{args.ref_batches}: {ref_ms} ms", file=sys.stderr, flush=True)

    print(f"\nPlanner benchmark: {args.profile} / {args.model}, max length {args.max_seq_len}, "
          f"Wikipedia lengths, global batch 8 x N")
    print(f"{'N':>5} {'B':>5} {'K':>3} {'p50 s':>7} {'p99 s':>7} {'gap med':>8} {'gap max':>8} "
          + " ".join(f"{s:>13}" for s in STRATEGIES) + f" {'xstatic':>8} {'xbatchada':>9} {'xdcp':>6} {'slower':>6}")
    for st in result["settings"]:
        s = st["summary"]
        print(f"{s['num_gpus']:>5} {s['global_batch']:>5} {s['batches']:>3} {s['plan_p50_s']:>7.2f} "
              f"{s['plan_p99_s']:>7.2f} {s['gap_median']:>8.2%} {s['gap_max']:>8.2%} "
              + " ".join(f"{s['mean_step_ms'][x]:>13.0f}" for x in STRATEGIES)
              + f" {s['speedup_vs_static']:>7.2f}x {s['speedup_vs_batchada']:>8.2f}x "
                f"{s['speedup_vs_megatron_dcp']:>5.2f}x {s['flexsp_slower_than_batchada']:>6}")
    print(f"paper (Wikipedia, 6.7B, 192K, 64 GPUs): FlexSP {PAPER['flexsp_vs_deepspeed']}x over DeepSpeed, "
          f"{PAPER['flexsp_vs_megatron']}x over Megatron; BatchAda {PAPER['batchada_vs_deepspeed']}x / "
          f"{PAPER['batchada_vs_megatron']}x, i.e. FlexSP {PAPER['flexsp_vs_deepspeed'] / PAPER['batchada_vs_deepspeed']:.2f}x over BatchAda")
    sets = result["settings"]
    for a, b in zip(sets, sets[1:]):
        sa, sb = a["summary"], b["summary"]
        print(f"latency growth {sa['num_gpus']} -> {sb['num_gpus']} GPUs "
              f"(x{sb['num_gpus'] / sa['num_gpus']:.0f} GPUs and sequences): p50 x{sb['plan_p50_s'] / sa['plan_p50_s']:.1f}")
    if result["milp"]:
        print(f"\nlevel packing (default) vs search=milp (step MILP warm-started from it), N={gpus[0]}")
        print(f"{'batch':>5} {'level ms':>9} {'bound':>7} {'s':>6} {'milp ms':>9} {'bound':>7} {'s':>6}  method")
        for r in result["milp"]:
            print(f"{r['batch']:>5} {r['level_step_ms']:>9.0f} {r['level_bound_ms']:>7.0f} {r['level_plan_s']:>6.2f} "
                  f"{r['milp_step_ms']:>9.0f} {r['milp_bound_ms']:>7.0f} {r['milp_plan_s']:>6.2f}  {r['milp_method']}")
    if result["reference"]:
        print(f"\nHead-to-head with the reference per-slot MILP (HiGHS, {args.ref_time_limit:.0f} s per micro-batch), N={gpus[0]}")
        print(f"{'batch':>5} {'reference ms':>13} {'ref plan s':>10} {'flexsp ms':>10} {'flexsp s':>9} {'batchada ms':>11}  reference status")
        for r in result["reference"]:
            ref = f"{r['reference_step_ms']:.0f}" if r["reference_step_ms"] else "none"
            rs = f"{r['reference_plan_s']:.1f}" if r["reference_plan_s"] else "-"
            print(f"{r['batch']:>5} {ref:>13} {rs:>10} {r['flexsp_step_ms']:>10.0f} {r['flexsp_plan_s']:>9.2f} "
                  f"{r['batchada_step_ms']:>11.0f}  {','.join(sorted(set(r['reference_status'])))}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
