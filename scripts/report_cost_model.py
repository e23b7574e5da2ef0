#!/usr/bin/env python
"""How well a measured profile predicts: its fit errors and its error on a run it was not fitted to.

Reads a profile's stored fit errors (compute fit; each group size's all-to-all fit; the fit of a
Megatron run, which is in-sample for that run) and a ``--flexsp`` run's ``steps.jsonl`` (measured
forward-backward time and the plan's predicted time per step) from a run whose data or seed differ
from the fitted one: the out-of-sample error. Writes a markdown report with provenance.

    SEED=4321 OUT=out/demo_oos bash scripts/demo_cpu.sh
    .venv/bin/python scripts/report_cost_model.py --profile cpu-gloo-measured --run out/demo_oos \
        --md docs/cost-model-cpu.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_flexsp.cost_model.profile import PROFILE_DIR  # noqa: E402
from megatron_flexsp.utils.report import header_lines, provenance, write_outputs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="cpu-gloo-measured")
    ap.add_argument("--run", required=True, help="plan directory of a --flexsp run (steps.jsonl)")
    ap.add_argument("--skip", type=int, default=2, help="first steps left out (warm-up)")
    ap.add_argument("--out", default="out/report_cost_model.json")
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    path = Path(args.profile) if Path(args.profile).exists() else PROFILE_DIR / f"{args.profile}.json"
    prof = json.loads(path.read_text())
    steps = [json.loads(x) for x in (Path(args.run) / "steps.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["step"] >= args.skip and "predicted_ms" in s]
    if not steps:
        raise SystemExit(f"{args.run}: no steps with predictions after the first {args.skip}")
    ratio = np.array([s["run_ms"] / s["predicted_ms"] for s in steps])
    err = np.abs(ratio - 1)
    fits = {name: entry.get("fit", {}) for name, entry in prof.get("models", {}).items()}
    result = {"profile": path.stem, "run": str(args.run), "steps": len(steps),
              "out_of_sample": {"median_ratio": float(np.median(ratio)), "p10_ratio": float(np.percentile(ratio, 10)),
                                "p90_ratio": float(np.percentile(ratio, 90)),
                                "median_abs_error": float(np.median(err)), "mean_abs_error": float(err.mean())},
              "fits": fits}
    lines = header_lines(f"Cost model {path.stem}: fit errors and out-of-sample error",
                         provenance(profile=path.stem, run=str(args.run))) + [
        "| model | compute fit RMS rel. error | all-to-all fit RMS rel. error by group size | Megatron-run fit "
        "(in-sample) |", "|---|---|---|---|"]
    for name, fit in fits.items():
        a2a = ", ".join(f"{d}: {e:.0%}" for d, e in sorted(fit.get("alltoall_rel_err", {}).items(),
                                                           key=lambda kv: int(kv[0])))
        meg = fit.get("megatron_run")
        meg_text = (f"x{meg['scale']:.3f} + {meg['per_micro_batch_ms']:.1f} ms per micro-batch, "
                    f"{meg['rel_err']:.1%} RMS over {meg['steps']} steps" if meg else "-")
        lines.append(f"| {name} | {fit.get('compute_rel_err', float('nan')):.1%} | {a2a or '-'} | {meg_text} |")
    o = result["out_of_sample"]
    lines += ["", f"Out of sample ({len(steps)} steps of `{args.run}`, first {args.skip} skipped): measured over "
              f"predicted forward-backward time median {o['median_ratio']:.3f} (p10 {o['p10_ratio']:.3f}, "
              f"p90 {o['p90_ratio']:.3f}); median |error| {o['median_abs_error']:.1%}, mean "
              f"{o['mean_abs_error']:.1%}. Median plan source: "
              f"{statistics.mode(s.get('plan_source', '?') for s in steps)}."]
    print("\n".join(lines))
    for p in write_outputs(args.out, result, args.md, lines if args.md else None):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
