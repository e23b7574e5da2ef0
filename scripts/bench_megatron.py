"""Per-step time of --flexsp vs plain Megatron in Megatron's own training loop, on CPU (4 gloo ranks).

Same data, model and seed for every row (the demo's real documents, tiny GPT):

- ``plain``: Megatron data parallelism, each rank's documents packed into rows of ``--seq-length``
  (Megatron's local attention with a document mask: on CPU its cost grows with the row length
  squared, so this row is slow for a reason FlexSP does not address on GPUs, where plain Megatron
  would use packed THD attention);
- ``static``: our runtime with one homogeneous Ulysses group size for every sequence (the
  DeepSpeed-Ulysses baseline), same varlen attention as FlexSP;
- ``flexsp``: heterogeneous groups from the planner, solved in the background (default settings);
- ``flexsp-precomputed``: the same planner with every plan solved before training (the runtime's
  speed without the solver competing for this machine's 2 cores).

The modes run in ``--repeats`` interleaved rounds (the order rotates each round, since this machine's
speed drifts); each mode's iteration time is compared with ``static``'s of the same round. Prints a
table and writes JSON (and markdown with ``--md``): median iteration time (Megatron's log, first 2
iterations skipped), the forward-backward part, the ratio to static (median and range over rounds),
and our overhead per step: waiting for the plan, dispatching shards, switching groups (each the
maximum over ranks).

    .venv/bin/python scripts/bench_megatron.py [--steps 8] [--repeats 3] [--md docs/bench-megatron.md]
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


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(name: str, res, skip: int) -> dict:
    steps = [r for r in res.steps if r["step"] >= skip]
    iters = [ms for it, ms in res.iteration_ms.items() if it > skip]
    row = {"mode": name, "iteration_ms": _median(iters),
           "forward_backward_ms": _median([r["run_ms"] for r in steps]),
           "plan_wait_ms": _median([r["plan_wait_ms"] for r in steps]),
           "dispatch_ms": _median([r["dispatch_ms"] for r in steps]),
           "switch_ms": _median([r.get("switch_ms", 0.0) for r in steps]),
           "final_loss": res.steps[-1]["loss"] if res.steps else float("nan"),
           "tokens_per_step": _median([r["tokens"] for r in steps])}
    over = row["plan_wait_ms"] + row["dispatch_ms"] + row["switch_ms"]
    row["overhead_ms"] = over
    row["overhead_share"] = over / row["iteration_ms"] if row["iteration_ms"] else float("nan")
    if steps and "predicted_ms" in steps[0]:
        row["predicted_ms"] = _median([r["predicted_ms"] for r in steps])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--data", default=str(ROOT / "data" / "demo" / "pystdlib"))
    ap.add_argument("--modes", default="plain,static,flexsp,flexsp-precomputed")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds of all modes")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench_megatron.json"))
    ap.add_argument("--md", default=None, help="also write the table as markdown here")
    args = ap.parse_args(argv)

    data = build_dataset(Path(args.data), max_docs=0) if not Path(args.data + ".idx").exists() \
        else Path(args.data)
    modes = args.modes.split(",")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.repeats):
            for mode in modes[rnd % len(modes):] + modes[:rnd % len(modes)]:
                extra = []
                if mode != "plain":
                    cfg = Path(tmp) / f"{mode}.yaml"
                    pre = mode.endswith("-precomputed")
                    strategy = mode.removesuffix("-precomputed")
                    cfg.write_text(f"planner:\n  strategy: {strategy}\n"
                                   + ("planning:\n  precompute: true\n" if pre else ""))
                    extra = ["--flexsp", "--flexsp-config", str(cfg)]
                res = run_pretrain(Path(tmp) / f"{mode}-{rnd}", data, extra, steps=args.steps,
                                   seq_length=args.seq_length, gbs=args.global_batch_size)
                if res.returncode != 0:
                    sys.stderr.write(res.log[-4000:])
                    return 1
                runs.append(dict(summarize(mode, res, skip=2), round=rnd))
                sys.stderr.write(f"round {rnd} {mode}: {runs[-1]['iteration_ms']:.0f} ms\n")
    static = {r["round"]: r["iteration_ms"] for r in runs if r["mode"] == "static"}
    rows = []
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        row = {k: _median([r[k] for r in mine]) for k in mine[0] if isinstance(mine[0][k], float)}
        row["mode"], row["repeats"] = mode, len(mine)
        if static:  # static's time over this mode's, round by round: above 1 means faster than static
            ratios = [static[r["round"]] / r["iteration_ms"] for r in mine]
            row["x_static"], row["x_static_min"], row["x_static_max"] = _median(ratios), min(ratios), max(ratios)
        rows.append(row)
    lines = header_lines("Megatron training loop on CPU: --flexsp against plain Megatron and static Ulysses",
                         provenance(steps=args.steps, seq_length=args.seq_length,
                                    global_batch_size=args.global_batch_size, repeats=args.repeats)) + [
        "| mode | rounds | iteration ms | fwd-bwd ms | predicted ms | plan wait ms | dispatch ms | switch ms "
        "| overhead | x static: median (min-max) | final loss |", "|" + "---|" * 11]
    for r in rows:
        xs = (f"{r['x_static']:.2f} ({r['x_static_min']:.2f}-{r['x_static_max']:.2f})"
              if "x_static" in r else "-")
        lines.append(f"| {r['mode']} | {r['repeats']} | {r['iteration_ms']:.0f} | {r['forward_backward_ms']:.0f} | "
                     f"{r.get('predicted_ms', float('nan')):.0f} | {r['plan_wait_ms']:.0f} | {r['dispatch_ms']:.1f} | "
                     f"{r['switch_ms']:.2f} | {100 * r['overhead_share']:.1f}% | {xs} | {r['final_loss']:.3f} |")
    print("\n".join(lines))
    for path in write_outputs(args.out, {"settings": vars(args), "rows": rows, "runs": runs}, args.md,
                              lines if args.md else None):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
