#!/usr/bin/env python
"""Which side of the planner's gap is loose, micro-batch by micro-batch (a diagnostic).

Plans each batch of ``--cells`` at ``--budget`` seconds, then splits its gap with
:func:`megatron_flexsp.sim.gap_sides.micro_batch_gaps`: each micro-batch's makespan against the LP
bound of its sequences as one micro-batch, and, for micro-batches of at most ``--exact-max``
sequences, against the exact MILP (every sequence and every group explicit, ``--exact-time``
seconds each). A micro-batch the MILP proves optimal at the plan's makespan is packed as well as
it can be, and whatever of the gap lies there is the bound's.

    python scripts/gap_sides.py --cells github:2048 --batches 1 --exact-max 40 --exact-time 120 \
        --md docs/planner-gap-sides.md --out out/gap_sides.json

Exact solves take minutes on micro-batches of 30-60 sequences; the command above takes about ten.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_flexsp.config import PlannerConfig  # noqa: E402
from megatron_flexsp.planner import plan_step  # noqa: E402
from megatron_flexsp.sim import simulate  # noqa: E402
from megatron_flexsp.sim.gap_sides import micro_batch_gaps  # noqa: E402
from megatron_flexsp.utils.report import header_lines, machine_speed, provenance, write_outputs  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from bench_planner_paired import add_sample_args, cost_model, sample  # noqa: E402


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sample_args(ap, "github:2048", 1)
    ap.add_argument("--budget", type=float, default=1.0, help="planner budget (s)")
    ap.add_argument("--lp-solves", type=int, default=400, help="LP solves per micro-batch bound")
    ap.add_argument("--exact-max", type=int, default=40, help="exact MILP for micro-batches of at most this many "
                                                              "sequences (0: none)")
    ap.add_argument("--exact-time", type=float, default=120.0, help="seconds per exact MILP")
    ap.add_argument("--out", default="out/gap_sides.json")
    ap.add_argument("--md", default=None)
    return ap.parse_args(argv)


def _ms(x: float) -> str:
    return f"{x:,.0f}" if math.isfinite(x) else ""


def main(argv=None) -> int:
    args = _args(argv)
    cm = cost_model(args)
    t_start = time.perf_counter()
    steps, mb_rows, out = [], [], []
    for (corpus, gb), batches in sample(args).items():
        for k, lens in enumerate(batches):
            cfg = PlannerConfig(over_length="truncate", time_budget_s=args.budget)
            plan = plan_step(lens, cm, strategy="flexsp", config=cfg, max_seq_len=args.max_seq_len)
            step, bound = simulate(plan, cm).step_ms, plan.lower_bound_ms
            rows = micro_batch_gaps(plan, cm, lp_solves=args.lp_solves, exact_max_sequences=args.exact_max,
                                    exact_time_s=args.exact_time)
            lp_sum = sum(r.lp_bound_ms for r in rows)
            name = f"{corpus}:{gb}:{k}"
            steps.append(f"| {name} | {len(rows)} | {step:,.0f} | {bound:,.0f} | {step / bound - 1:.2%} | "
                         f"{(step - lp_sum) / step:.2%} | {(lp_sum - bound) / step:.2%} |")
            for r in rows:
                if math.isfinite(r.exact_ms):
                    mb_rows.append(f"| {name} | {r.index} | {r.sequences} | {r.fill:.2%} | {r.makespan_ms:,.1f} | "
                                   f"{r.lp_bound_ms:,.1f} | {_ms(r.exact_ms)} | {_ms(r.exact_bound_ms)} | "
                                   f"{'yes' if r.proven else 'no'} | {r.exact_time_s:.0f} |")
            out.append({"batch": name, "step_ms": step, "bound_ms": bound,
                        "micro_batches": [dict(vars(r), proven=r.proven) for r in rows]})
            print(steps[-1], flush=True)
    lines = header_lines("Which side of the gap is loose", provenance(
        gpus=args.gpus, budget_s=args.budget, lp_solves=args.lp_solves, exact_max=args.exact_max,
        exact_time_s=args.exact_time, machine=machine_speed()))
    lines += ["Per step: the gap, the part of the step inside its micro-batches as far as the LP can tell",
              "(makespans over each micro-batch's own LP bound) and the rest (those bounds over the step's).", "",
              "| batch | micro-batches | step ms | bound ms | gap | inside micro-batches | across |",
              "|---|---|---|---|---|---|---|", *steps, "",
              "Micro-batches the exact MILP ran on (every sequence and group explicit; proven: its dual bound",
              "meets its value, the least makespan of those sequences in one micro-batch):", "",
              "| batch | micro-batch | sequences | memory | makespan ms | LP bound ms | exact ms | exact bound ms "
              "| proven | s |", "|---|---|---|---|---|---|---|---|---|---|", *mb_rows]
    print("\n".join(lines[-len(mb_rows) - 2:]))
    write_outputs(args.out, {"batches": out, "seconds": time.perf_counter() - t_start}, args.md, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
