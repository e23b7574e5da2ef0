#!/usr/bin/env python
"""FlexSP's speed-up measured, not simulated: two emulated nodes, a shaped link, Megatron's loop.

Runs the demo model on 2 nodes x 2 gloo ranks (``scripts/testbed/two_nodes.sh``: network
namespaces joined by a veth pair shaped with tc tbf; ranks of a node talk over its own loopback)
through Megatron's training loop, for every mode on the same long-tailed documents and seed:

* ``plain``: Megatron data parallelism (documents packed into rows, a document-causal mask);
* ``static``: Ulysses over all 4 ranks for every sequence (the group a static SP user sizes for
  ``--seq-length``);
* ``batchada``: the best single group size per batch; ``megatron-hybrid-cp``: Megatron's own
  hybrid-CP scheduler; ``flexsp``: heterogeneous groups, planned in the background.

Modes run in interleaved rounds (the order rotates); every ratio is taken within a round. Reported
per link speed and mode: measured iteration time (median over iterations after the first 2; spread
over rounds), the plan's predicted step time, the ratio to static and to batchada (median and range
over rounds), and how many steps ran a group spanning the two nodes. ``--rates`` gives the link
speeds (e.g. 4x apart). Writes JSON and, with ``--md``, a markdown report.

    .venv/bin/python scripts/bench_testbed.py --rates 100mbit,400mbit --repeats 3 --md docs/testbed.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_flexsp.utils.report import header_lines, provenance, write_outputs  # noqa: E402
from tests.integration.megatron_runs import build_dataset, run_pretrain  # noqa: E402

MODES = ("plain", "static", "batchada", "megatron-hybrid-cp", "flexsp")


def spanning(plan_groups: list[list[int]], per_node: int) -> bool:
    return any(size > per_node for size in plan_groups)


def measure(mode: str, res, skip: int = 2, per_node: int = 2) -> dict:
    iters = [ms for it, ms in res.iteration_ms.items() if it > skip]
    steps = [r for r in res.steps if r["step"] >= skip]
    row = {"mode": mode, "iteration_ms": statistics.median(iters),
           "forward_backward_ms": statistics.median(r["run_ms"] for r in steps)}
    if steps and "predicted_ms" in steps[0]:
        row["predicted_ms"] = statistics.median(r["predicted_ms"] for r in steps)
        row["steps_spanning_nodes"] = sum(any(spanning(mb, per_node) for mb in r["group_sizes"])
                                          for r in res.steps)
        row["steps"] = len(res.steps)
        row["sources"] = sorted({r.get("plan_source", "") for r in res.steps})
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="100mbit,400mbit", help="link speeds (tc tbf rates)")
    ap.add_argument("--latency", default="50ms", help="tbf latency (the queue's bound)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq-length", type=int, default=4096)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--profile", default=None,
                    help="cost profile (default: configs/profiles/cpu-2node-emulated.json if present, "
                         "else cpu-gloo-measured)")
    ap.add_argument("--data", default=str(ROOT / "data" / "demo" / "pystdlib"))
    ap.add_argument("--out", default="out/bench_testbed.json")
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    emulated = ROOT / "configs" / "profiles" / "cpu-2node-emulated.json"
    profile = args.profile or (str(emulated) if emulated.exists() else "cpu-gloo-measured")
    data = Path(args.data) if Path(args.data + ".idx").exists() else build_dataset(Path(args.data), 0)
    modes = args.modes.split(",")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates.split(","):
            for rnd in range(args.repeats):
                for mode in modes[rnd % len(modes):] + modes[:rnd % len(modes)]:
                    extra = []
                    if mode != "plain":
                        cfg = Path(tmp) / f"{mode}.yaml"
                        cfg.write_text(f"planner:\n  strategy: {mode}\n")
                        extra = ["--flexsp", "--flexsp-config", str(cfg), "--flexsp-profile", profile]
                    res = run_pretrain(Path(tmp) / f"{rate}-{mode}-{rnd}", data, extra, steps=args.steps,
                                       seq_length=args.seq_length, gbs=args.global_batch_size, timeout=1800,
                                       testbed={"rate": rate, "latency": args.latency})
                    if res.returncode == 77:
                        print(res.log.strip().splitlines()[-1])
                        return 77
                    if res.returncode != 0:
                        sys.stderr.write(res.log[-5000:])
                        return 1
                    runs.append(dict(measure(mode, res), rate=rate, round=rnd))
                    print(f"{rate} round {rnd} {mode}: {runs[-1]['iteration_ms']:.0f} ms", file=sys.stderr,
                          flush=True)
    rows = []
    for rate in args.rates.split(","):
        ref = {m: {r["round"]: r["iteration_ms"] for r in runs if r["rate"] == rate and r["mode"] == m}
               for m in ("static", "batchada")}
        for mode in modes:
            mine = [r for r in runs if r["rate"] == rate and r["mode"] == mode]
            times = [r["iteration_ms"] for r in mine]
            row = {"rate": rate, "mode": mode, "rounds": len(mine), "iteration_ms": statistics.median(times),
                   "iteration_ms_min": min(times), "iteration_ms_max": max(times),
                   "predicted_ms": statistics.median(r["predicted_ms"] for r in mine) if "predicted_ms" in mine[0]
                   else None,
                   "steps_spanning_nodes": sum(r.get("steps_spanning_nodes", 0) for r in mine),
                   "steps": sum(r.get("steps", 0) for r in mine)}
            for base, by_round in ref.items():  # base's time over this mode's, round by round
                ratios = [by_round[r["round"]] / r["iteration_ms"] for r in mine if r["round"] in by_round]
                if ratios:
                    row[f"x_{base}"] = (statistics.median(ratios), min(ratios), max(ratios))
            rows.append(row)
    lines = header_lines("Two emulated nodes: measured step times", provenance(
        rates=args.rates, latency=args.latency, repeats=args.repeats, steps=args.steps,
        seq_length=args.seq_length, global_batch_size=args.global_batch_size, profile=Path(profile).stem)) + [
        "| link | mode | rounds | iteration ms: median (min-max) | predicted ms | x static: median (min-max) "
        "| x batchada: median (min-max) | steps with a group across the nodes |", "|" + "---|" * 8]

    def ratio(r, key):
        return f"{r[key][0]:.2f} ({r[key][1]:.2f}-{r[key][2]:.2f})" if key in r else "-"

    for r in rows:
        pred = f"{r['predicted_ms']:.0f}" if r["predicted_ms"] else "-"
        span = f"{r['steps_spanning_nodes']} of {r['steps']}" if r["steps"] else "-"
        lines.append(f"| {r['rate']} | {r['mode']} | {r['rounds']} | {r['iteration_ms']:.0f} "
                     f"({r['iteration_ms_min']:.0f}-{r['iteration_ms_max']:.0f}) | {pred} | "
                     f"{ratio(r, 'x_static')} | {ratio(r, 'x_batchada')} | {span} |")
    print("\n".join(lines))
    for path in write_outputs(args.out, {"settings": vars(args), "profile": profile, "rows": rows, "runs": runs},
                              args.md, lines if args.md else None):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
