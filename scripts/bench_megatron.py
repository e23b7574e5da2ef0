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

Prints a table and writes JSON: median iteration time (Megatron's log, first 2 iterations skipped),
the forward-backward part, and our overhead per step: waiting for the plan, dispatching shards,
switching groups (each the maximum over ranks).

    .venv/bin/python scripts/bench_megatron.py [--steps 8] [--seq-length 2048] [--out out/bench_megatron.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.megatron_runs import build_dataset, run_pretrain, write_report  # noqa: E402


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
    ap.add_argument("--out", default=str(ROOT / "out" / "bench_megatron.json"))
    args = ap.parse_args(argv)

    data = build_dataset(Path(args.data), max_docs=0) if not Path(args.data + ".idx").exists() \
        else Path(args.data)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            extra = []
            if mode != "plain":
                cfg = Path(tmp) / f"{mode}.yaml"
                pre = mode.endswith("-precomputed")
                strategy = mode.removesuffix("-precomputed")
                cfg.write_text(f"planner:\n  strategy: {strategy}\n"
                               + ("planning:\n  precompute: true\n" if pre else ""))
                extra = ["--flexsp", "--flexsp-config", str(cfg)]
            res = run_pretrain(Path(tmp) / mode, data, extra, steps=args.steps,
                               seq_length=args.seq_length, gbs=args.global_batch_size)
            if res.returncode != 0:
                sys.stderr.write(res.log[-4000:])
                return 1
            rows.append(summarize(mode, res, skip=2))
    base = {r["mode"]: r for r in rows}
    for r in rows:
        r["speedup_vs_plain"] = base["plain"]["iteration_ms"] / r["iteration_ms"] if "plain" in base else None
        r["speedup_vs_static"] = base["static"]["iteration_ms"] / r["iteration_ms"] if "static" in base else None
    head = (f"{'mode':19s} {'iter ms':>9s} {'fwd-bwd':>9s} {'pred':>7s} {'plan':>7s} {'dispatch':>9s} "
            f"{'switch':>7s} {'overhead':>9s} {'x plain':>8s} {'x static':>9s} {'loss':>7s}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['mode']:19s} {r['iteration_ms']:9.0f} {r['forward_backward_ms']:9.0f} "
                     f"{r.get('predicted_ms', float('nan')):7.0f} {r['plan_wait_ms']:7.0f} "
                     f"{r['dispatch_ms']:9.1f} {r['switch_ms']:7.2f} {100 * r['overhead_share']:8.1f}% "
                     f"{(r['speedup_vs_plain'] or float('nan')):8.2f} "
                     f"{(r['speedup_vs_static'] or float('nan')):9.2f} {r['final_loss']:7.3f}")
    write_report(args.out, lines, {"settings": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
