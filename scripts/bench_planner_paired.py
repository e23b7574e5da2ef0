#!/usr/bin/env python
"""Paired planner benchmark: flexsp alone on the sweep's hardest cells, batch by batch.

The sweep (``bench_planner.py --sweep``) reports how many cells meet the gap targets; with four
batches a cell and a wall-clock budget, that count moves by a few cells between two runs of the
same code. This benchmark measures a change instead: the same batches (14 cells of 64 GPUs, four
batches each by default) planned at each budget of ``--budgets``, every batch's step time, proven
bound, gap and plan time; with ``--baseline`` (an earlier run's JSON) the mean change of the plans
and of the bounds on the same batches, and how many plans got faster or slower. Two runs of the
same code differ by about 0.03% in mean plan time; the cells' own gaps differ by points.

    python scripts/bench_planner_paired.py --md docs/planner-paired.md --out out/bench_planner_paired.json
    python scripts/bench_planner_paired.py --baseline out/bench_planner_paired.json --out out/after.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_flexsp.config import PlannerConfig  # noqa: E402
from megatron_flexsp.cost_model import CostModel, load_profile  # noqa: E402
from megatron_flexsp.model_spec import get_model  # noqa: E402
from megatron_flexsp.planner import plan_step  # noqa: E402
from megatron_flexsp.sim.corpora import synthetic_lengths  # noqa: E402
from megatron_flexsp.sim.workloads import load_lengths, sample_batches  # noqa: E402
from megatron_flexsp.utils.report import header_lines, provenance, write_outputs  # noqa: E402

WIKI = ROOT.parent / "shared" / "seqlen" / "flexsp_wikipedia_seqlens.txt"
#: (corpus, global batch) at 64 GPUs: the sweep cells with the largest gaps
HARD_CELLS = ("wikipedia:2048,wikipedia:4096,github:1024,github:2048,commoncrawl:2048,commoncrawl:4096,"
              "lognormal-1k:4096,lognormal-4k:512,lognormal-4k:1024,lognormal-4k:2048,lognormal-4k:4096,"
              "pareto-1.1:2048,pareto-1.1:4096,pareto-1.5:4096")


def plan_cells(args, cm: CostModel) -> list[dict]:
    """Every batch of every cell at every budget: step ms, bound ms, gap, plan s, method."""
    cells = [(c, int(gb)) for c, gb in (x.split(":") for x in args.cells.split(","))]
    batches = {}
    for corpus, gb in cells:
        lens = load_lengths(WIKI) if corpus == "wikipedia" else synthetic_lengths(corpus, seed=1)
        batches[corpus, gb], _ = sample_batches(lens, global_batch=gb, num_batches=args.batches, seed=args.seed,
                                                max_seq_len=args.max_seq_len)
    # one untimed plan first: the first call imports and initialises HiGHS, which is not planning time
    plan_step(batches[cells[0]][0], cm, config=PlannerConfig(over_length="truncate", time_budget_s=0.2),
              max_seq_len=args.max_seq_len)
    gc.freeze()  # the results kept so far stay out of the garbage collector's passes
    rows = []
    for budget in args.budgets:
        cfg = PlannerConfig(over_length="truncate", time_budget_s=budget)
        t0 = time.perf_counter()
        for (corpus, gb), bs in batches.items():
            for k, b in enumerate(bs):
                start = time.perf_counter()
                plan = plan_step(b, cm, config=cfg, max_seq_len=args.max_seq_len)
                rows.append({"cell": f"{corpus}:{gb}", "batch": k, "budget_s": budget,
                             "step_ms": plan.predicted_step_ms, "bound_ms": plan.lower_bound_ms, "gap": plan.gap,
                             "plan_s": time.perf_counter() - start, "method": plan.method,
                             "micro_batches": len(plan.micro_batches)})
        print(f"budget {budget:g} s: {len(rows)} plans so far ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict], baseline: list[dict] | None) -> list[str]:
    """One line per budget: gap mean / median / max, plan p99, and the paired change against ``baseline``."""
    before = {(r["cell"], r["batch"], r["budget_s"]): r for r in baseline or []}
    head = "| budget s | batches | gap mean | gap median | gap max | plan p99 s |"
    sep = "|---|---|---|---|---|---|"
    if baseline is not None:
        head += " plans vs baseline (mean) | faster / slower | bounds vs baseline (mean) |"
        sep += "---|---|---|"
    lines = [head, sep]
    for budget in sorted({r["budget_s"] for r in rows}):
        mine = [r for r in rows if r["budget_s"] == budget]
        gaps = np.array([r["gap"] for r in mine])
        line = (f"| {budget:g} | {len(mine)} | {gaps.mean():.2%} | {np.median(gaps):.2%} | {gaps.max():.2%} | "
                f"{np.percentile([r['plan_s'] for r in mine], 99):.2f} |")
        if baseline is not None:
            pairs = [(before[k], r) for r in mine if (k := (r["cell"], r["batch"], r["budget_s"])) in before]
            if pairs:
                plan = np.array([b["step_ms"] / a["step_ms"] - 1 for a, b in pairs])
                bound = np.array([b["bound_ms"] / a["bound_ms"] - 1 for a, b in pairs])
                line += (f" {plan.mean():+.3%} | {int((plan < -1e-4).sum())} / {int((plan > 1e-4).sum())} | "
                         f"{bound.mean():+.3%} |")
            else:
                line += " no common batches | | |"
        lines.append(line)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default=HARD_CELLS, help="corpus:global-batch pairs at --gpus")
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--batches", type=int, default=4, help="batches per cell")
    ap.add_argument("--budgets", default="1,4", help="planner time budgets (s), each over every batch")
    ap.add_argument("--baseline", default=None, help="an earlier run's JSON: paired changes per budget")
    ap.add_argument("--profile", default="a100-paper")
    ap.add_argument("--model", default="gpt-7b")
    ap.add_argument("--max-seq-len", type=int, default=196608)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_planner_paired.json")
    ap.add_argument("--md", default=None, help="write the markdown table here")
    args = ap.parse_args()
    args.budgets = [float(x) for x in args.budgets.split(",")]
    if min(args.budgets) <= 0:
        raise ValueError(f"--budgets {args.budgets}: every budget must be > 0 seconds")
    cm = CostModel.from_profile(load_profile(args.profile), get_model(args.model), num_gpus=args.gpus,
                                max_seq_len=args.max_seq_len)
    before = json.loads(Path(args.baseline).read_text()) if args.baseline else None
    baseline = before["rows"] if before else None
    named = f"{args.baseline} (commit {before['provenance'].get('commit', 'unknown')})" if before else None
    result = {"provenance": provenance(profile=args.profile, model=args.model, num_gpus=args.gpus,
                                       max_seq_len=args.max_seq_len, cells=args.cells, baseline=named),
              "rows": plan_cells(args, cm)}
    lines = header_lines("Paired planner benchmark", result["provenance"]) + table(result["rows"], baseline)
    lines += ["", "Gaps are against each plan's own proven bound; plan times are wall time on one core. "
              "Per cell (median / max gap at each budget):", "",
              "| cell | " + " | ".join(f"{b:g} s" for b in args.budgets) + " |",
              "|---|" + "---|" * len(args.budgets)]
    for cell in dict.fromkeys(r["cell"] for r in result["rows"]):
        parts = []
        for budget in args.budgets:
            gaps = [r["gap"] for r in result["rows"] if r["cell"] == cell and r["budget_s"] == budget]
            parts.append(f"{np.median(gaps):.2%} / {max(gaps):.2%}")
        lines.append(f"| {cell} | " + " | ".join(parts) + " |")
    print("\n".join(lines))
    for path in write_outputs(args.out, result, args.md, lines if args.md else None):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
