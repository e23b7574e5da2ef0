"""Loss parity: --flexsp vs plain Megatron data parallelism (4 CPU gloo ranks, same seed and data).

Runs both for ``--steps`` steps (default 20) and compares, step by step, the per-token loss of the
global batch and Megatron's grad norm. fp32 everywhere; the stated tolerance is a relative 1e-5 (the
two runs sum the same per-token terms in different orders and attention kernels). Prints a table and
writes JSON; exit status 1 when a step is outside the tolerance.

    .venv/bin/python scripts/parity_megatron.py [--steps 20] [--out out/parity_megatron.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.megatron_runs import build_dataset, run_pretrain, write_report  # noqa: E402

RTOL = 1e-5


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--data", default=str(ROOT / "data" / "demo" / "pystdlib"))
    ap.add_argument("--out", default=str(ROOT / "out" / "parity_megatron.json"))
    args = ap.parse_args(argv)
    data = Path(args.data) if Path(args.data + ".idx").exists() else build_dataset(Path(args.data), 0)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run_pretrain(Path(tmp) / name, data, extra, steps=args.steps,
                                   seq_length=args.seq_length, gbs=args.global_batch_size)
                for name, extra in (("plain", []), ("flexsp", ["--flexsp"]))}
    for name, res in runs.items():
        if res.returncode != 0:
            sys.stderr.write(f"{name} failed:\n{res.log[-4000:]}")
            return 1
    plain, flex = runs["plain"], runs["flexsp"]
    rows = []
    for a, b in zip(plain.steps, flex.steps):
        it = a["step"] + 1
        ga, gb = plain.iterations[it][1], flex.iterations[it][1]
        rows.append({"step": a["step"], "tokens": a["tokens"], "loss_plain": a["loss"],
                     "loss_flexsp": b["loss"], "loss_rel_diff": abs(a["loss"] - b["loss"]) / abs(a["loss"]),
                     "grad_norm_plain": ga, "grad_norm_flexsp": gb,
                     "grad_norm_rel_diff": abs(ga - gb) / abs(ga),
                     "groups": b.get("group_sizes"), "same_tokens": a["tokens"] == b["tokens"]})
    worst_loss = max(r["loss_rel_diff"] for r in rows)
    worst_norm = max(r["grad_norm_rel_diff"] for r in rows)
    ok = len(rows) == args.steps and worst_loss <= RTOL and worst_norm <= RTOL and \
        all(r["same_tokens"] for r in rows)
    lines = [f"{'step':>4s} {'tokens':>7s} {'loss plain':>12s} {'loss flexsp':>12s} {'rel diff':>9s} "
             f"{'gnorm rel':>9s}  groups"]
    for r in rows:
        lines.append(f"{r['step']:4d} {r['tokens']:7d} {r['loss_plain']:12.8f} {r['loss_flexsp']:12.8f} "
                     f"{r['loss_rel_diff']:9.1e} {r['grad_norm_rel_diff']:9.1e}  {r['groups']}")
    lines.append(f"worst relative difference: loss {worst_loss:.2e}, grad norm {worst_norm:.2e} "
                 f"(tolerance {RTOL:.0e}): {'PASS' if ok else 'FAIL'}")
    write_report(args.out, lines, {"settings": vars(args), "rtol": RTOL, "pass": ok, "rows": rows})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
