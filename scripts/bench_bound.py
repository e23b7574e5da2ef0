#!/usr/bin/env python
"""LP bound benchmark by solve count: how high the planner's LP bound gets, without a clock.

Within the planner the LP bound gets a share of a wall-clock budget, so what it proves moves with
the machine's speed and with every phase before it, and a change to the relaxation is hard to tell
from noise (`bench_planner_paired.py` needs several repeats to see 0.1%). Here the bound runs alone,
as the planner runs it (:func:`~megatron_flexsp.planner.api.lp_bound_inputs`: the same counts,
tolerance, slot LP floors, finer slot LP and step floors), stopped after a number of LP solves
instead of a deadline: the result depends on the batch and the code alone. Each batch's gap is
taken against a fixed plan: the planner's plan at ``--budget`` seconds, made once and kept in
``--targets`` (a JSON file, written when missing), so two trees measured with the same targets
file compare bound against bound (the targets of `docs/planner-bound.md` are kept beside it, in
`docs/planner-bound-targets.json`). ``--explicit 1,3`` runs the bound twice: every count's search
starting with one explicit micro-batch (as the planner's first search) and with three (its
second, deeper search). A second table says where each batch's bound comes from: the LP bound of
each micro-batch count after the last run, beside the memory minimum and how full it is.

    python scripts/bench_bound.py --solves 100,250,1000 --targets docs/planner-bound-targets.json \
        --md docs/planner-bound.md --out out/bench_bound.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_flexsp.config import PlannerConfig  # noqa: E402
from megatron_flexsp.planner import plan_step  # noqa: E402
from megatron_flexsp.planner.api import lp_bound_inputs, simple_bounds, slot_lp  # noqa: E402
from megatron_flexsp.planner.bound import BoundResult, lp_step_bound  # noqa: E402
from megatron_flexsp.planner.heuristics import min_micro_batches  # noqa: E402
from megatron_flexsp.planner.layout import Tables  # noqa: E402
from megatron_flexsp.planner.search import Deadline  # noqa: E402
from megatron_flexsp.sim import simulate  # noqa: E402
from megatron_flexsp.utils.report import header_lines, machine_speed, provenance, write_outputs  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from bench_planner_paired import add_sample_args, cost_model, sample  # noqa: E402

#: (corpus, global batch) at 64 GPUs: the sweep cells whose median gap is above 2% at 1 s
CELLS = "github:2048,lognormal-4k:512,lognormal-4k:1024,lognormal-4k:2048,pareto-1.1:4096"


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sample_args(ap, CELLS, 4)
    ap.add_argument("--solves", default="100,250,1000", help="LP solve counts to stop at")
    ap.add_argument("--explicit", default="1,3", help="explicit micro-batches every search starts with, one run each")
    ap.add_argument("--budget", type=float, default=1.0, help="planner budget (s) of the target plans")
    ap.add_argument("--targets", default="out/bound_targets.json",
                    help="target plans' step times (ms), made where missing and kept")
    ap.add_argument("--out", default="out/bench_bound.json")
    ap.add_argument("--md", default=None)
    return ap.parse_args(argv)


def bounds_after(tab: Tables, target_ms: float, runs: list[tuple[int, int]]) -> list[tuple[float, BoundResult]]:
    """The planner's lower bound (ms) on ``tab``'s batch once the LP bound, its searches starting
    with ``e`` explicit micro-batches, has taken ``s`` LP solves, for each ``(e, s)`` of ``runs``:
    the slot bound, the step floors and the LP bound as :func:`plan_step` combines them (the slot
    LP and the step floors are solved once for all runs); with each the LP bound's result, whose
    ``by_count`` says which micro-batch count the bound comes from."""
    cfg, info = PlannerConfig(), {}
    slot, bounds = slot_lp(tab, cfg, info), simple_bounds(tab)
    bound = bounds.base if slot is None else max(bounds.base, min(slot.bound_ms, target_ms))
    out = []
    for e, s in runs:
        lp = lp_step_bound(tab, target_ms=target_ms, max_solves=s, explicit=e,
                           **lp_bound_inputs(tab, cfg, info, slot, bounds, Deadline(1e9)))
        out.append((max(bound, lp.bound_ms), lp))
    return out


def by_count_row(name: str, tab: Tables, target_ms: float, lp: BoundResult) -> list[str]:
    """One row of the table of where the bound binds: the memory minimum (fewest micro-batches
    the batch's tokens fit) and how full it would be, the LP bound of each count searched one by
    one (ms) and of every count past them, and the count whose bound is the lowest."""
    m0 = min_micro_batches(tab)
    fill = float(tab.lens.sum()) / (m0 * tab.cm.cluster.num_gpus * tab.cm.capacity_tokens)
    counts = sorted(lp.by_count)
    low = min(counts + [(math.inf, lp.rest_ms)], key=lambda c: c[1])
    return [name, f"{target_ms:,.0f}", str(m0), f"{fill:.2%}",
            ", ".join(f"{c}: {min(v, target_ms):,.0f}" for c, v in counts) or "-", f"{min(lp.rest_ms, target_ms):,.0f}",
            "past them" if math.isinf(low[0]) else str(low[0])]


def main(argv=None) -> int:
    args = _args(argv)
    solves = [int(s) for s in args.solves.split(",")]
    runs = [(e, s) for e in map(int, args.explicit.split(",")) for s in solves]
    cm = cost_model(args)
    cells = sample(args)
    path = Path(args.targets)
    targets = json.loads(path.read_text()) if path.exists() else {}
    rows, per_batch, counts = [], [], []
    t_start = time.perf_counter()
    for (corpus, gb), batches in cells.items():
        gaps = np.zeros((len(batches), len(runs)))
        for k, lens in enumerate(batches):
            key = f"{args.gpus}:{corpus}:{gb}:{k}"
            if key not in targets:
                cfg = PlannerConfig(over_length="truncate", time_budget_s=args.budget)
                plan = plan_step(lens, cm, strategy="flexsp", config=cfg, max_seq_len=args.max_seq_len)
                targets[key] = simulate(plan, cm).step_ms
            tab = Tables(np.asarray(lens), cm)
            found = bounds_after(tab, targets[key], runs)
            gaps[k] = [targets[key] / b - 1 for b, _ in found]
            per_batch.append({"cell": f"{corpus}:{gb}", "batch": k, "target_ms": targets[key],
                              "gap": {f"{e}:{s}": g for (e, s), g in zip(runs, gaps[k].tolist())},
                              "by_count": {f"{e}:{s}": [[c, min(v, targets[key])] for c, v in lp.by_count]
                                           + [["more", min(lp.rest_ms, targets[key])]]
                                           for (e, s), (_, lp) in zip(runs, found)}})
            counts.append(by_count_row(f"{corpus}:{gb}:{k}", tab, targets[key], found[-1][1]))
            print(f"{corpus}:{gb} batch {k}: " + ", ".join(f"{e} explicit, {s} solves {g:.2%}"
                                                            for (e, s), g in zip(runs, gaps[k])), flush=True)
        rows.append([f"{corpus}:{gb}", len(batches)] + [f"{g:.2%}" for g in gaps.mean(axis=0)])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(targets, indent=1))
    means = np.array([[b["gap"][f"{e}:{s}"] for e, s in runs] for b in per_batch]).mean(axis=0)
    rows.append(["all", len(per_batch)] + [f"{g:.2%}" for g in means])
    lines = header_lines("LP bound by solve count", provenance(
        gpus=args.gpus, targets=f"{args.targets} (plans at {args.budget:g} s)",
        machine=machine_speed()))
    lines += ["Mean gap of each cell's batches against the target plans, by the explicit micro-batches the",
              "bound's searches start with and the LP solves it took.", "",
              "| cell | batches | " + " | ".join(f"{e} explicit, {s} solves" for e, s in runs) + " |",
              "|---|---|" + "---|" * len(runs)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    print("\n".join(lines[-len(rows) - 2:]))
    e, s = runs[-1]
    lines += ["", f"Where the bound binds ({e} explicit, {s} solves): the LP bound of each micro-batch count",
              "searched one by one and of every count past them, against the memory minimum (the fewest",
              "micro-batches the batch's tokens fit) and how full its micro-batches would be.", "",
              "| batch | target ms | memory minimum | its fill | bound by count (ms) | more (ms) | lowest |",
              "|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in counts]
    write_outputs(args.out, {"runs": [f"{e}:{s}" for e, s in runs], "batches": per_batch,
                             "seconds": time.perf_counter() - t_start}, args.md, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
