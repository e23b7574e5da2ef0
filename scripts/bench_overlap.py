"""Planning off the critical path, measured in Megatron's training loop on CPU (4 gloo ranks).

Three runs of the demo (same data, model, seed), each ``--flexsp``:

- ``precomputed``: every plan solved before training starts (the reference: no planning in steps);
- ``async``: the solver process plans step k+1 while step k trains; a step waits at most the budget,
  then uses the fallback;
- ``slow-solver``: as ``async`` with every solve delayed by ``--delay`` seconds: the fallback must keep
  steps on time.

Prints a table and writes JSON: median iteration time (Megatron's log, first 2 iterations skipped),
median plan wait, where plans came from, and the ratio to ``precomputed`` (target for ``async``:
<= 1.02).

    .venv/bin/python scripts/bench_overlap.py [--steps 12] [--budget 1.0] [--delay 30]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.megatron_runs import build_dataset, run_pretrain, write_report  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--budget", type=float, default=1.0, help="plan wait budget (s)")
    ap.add_argument("--delay", type=float, default=30.0, help="solver delay of the slow-solver run (s)")
    ap.add_argument("--bound-lp-solves", type=int, default=-1,
                    help="planner bound_lp_solves in every run (-1: the default); the bound only "
                         "changes the reported gap, not the plans")
    ap.add_argument("--data", default=str(ROOT / "data" / "demo" / "pystdlib"))
    ap.add_argument("--out", default=str(ROOT / "out" / "bench_overlap.json"))
    args = ap.parse_args(argv)
    data = Path(args.data) if Path(args.data + ".idx").exists() else build_dataset(Path(args.data), 0)
    limit = f"planner:\n  bound_lp_solves: {args.bound_lp_solves}\n" if args.bound_lp_solves >= 0 else ""
    runs = {
        "precomputed": "planning:\n  precompute: true\n",
        "async": f"planning:\n  asynchronous: true\n  wait_budget_s: {args.budget}\n",
        "slow-solver": (f"planning:\n  asynchronous: true\n  wait_budget_s: {args.budget}\n"
                        f"  solver_delay_s: {args.delay}\n"),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in runs.items():
            cfg = Path(tmp) / f"{name}.yaml"
            cfg.write_text(limit + text)
            res = run_pretrain(Path(tmp) / name, data, ["--flexsp", "--flexsp-config", str(cfg)],
                               steps=args.steps, seq_length=args.seq_length, gbs=args.global_batch_size)
            if res.returncode != 0:
                sys.stderr.write(res.log[-4000:])
                return 1
            steps = [r for r in res.steps if r["step"] >= 2]
            rows.append({
                "run": name,
                "iteration_ms": statistics.median(ms for it, ms in res.iteration_ms.items() if it > 2),
                "forward_backward_ms": statistics.median(r["run_ms"] for r in steps),
                "plan_wait_ms": statistics.median(r["plan_wait_ms"] for r in steps),
                "max_plan_wait_ms": max(r["plan_wait_ms"] for r in steps),
                "sources": dict(collections.Counter(r["plan_source"] for r in res.steps)),
                "predicted_ms": statistics.median(r["predicted_ms"] for r in steps),
            })
    ref = rows[0]["iteration_ms"]
    for r in rows:
        r["ratio_to_precomputed"] = r["iteration_ms"] / ref
    lines = [f"{'run':12s} {'iter ms':>8s} {'fwd-bwd':>8s} {'pred':>6s} {'wait':>6s} {'max wait':>9s} "
             f"{'ratio':>6s}  plan sources"]
    for r in rows:
        lines.append(f"{r['run']:12s} {r['iteration_ms']:8.0f} {r['forward_backward_ms']:8.0f} "
                     f"{r['predicted_ms']:6.0f} {r['plan_wait_ms']:6.0f} {r['max_plan_wait_ms']:9.0f} "
                     f"{r['ratio_to_precomputed']:6.3f}  {r['sources']}")
    write_report(args.out, lines, {"settings": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
