#!/usr/bin/env python
"""Large models with tensor parallelism: Llama-3-8B, Llama-2-13B, CodeLlama-34B and Llama-3-70B planned on
64 and 512 A100-80G / H200 GPUs at 192K and 1M tokens.

Per cell the model runs with the smallest tensor-parallel size (with sequence parallelism when TP > 1)
whose largest allowed group holds ``--max-seq-len``; when none does without recomputation, the
smallest that does with full recomputation (Megatron's ``--recompute-granularity full``). A cell no
setting can hold is listed with the longest length the best setting holds and why. Every batch is
planned by static, batchada, Megatron's hybrid-CP scheduler and flexsp with the same cost model;
step times are simulated, plan times are wall time on one core (``bench_planner.py``'s
``plan_batch``). The profiles are estimates from public specifications (their ``estimated`` flag).

    python scripts/bench_models.py --md docs/bench-models.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_planner import corpus_lengths, plan_batch, summarize, _hcp  # noqa: E402

from megatron_flexsp.config import PlannerConfig  # noqa: E402
from megatron_flexsp.cost_model import CostModel, load_profile  # noqa: E402
from megatron_flexsp.model_spec import get_model  # noqa: E402
from megatron_flexsp.parallelism import Parallelism  # noqa: E402
from megatron_flexsp.sim.workloads import sample_batches  # noqa: E402
from megatron_flexsp.utils.report import header_lines, provenance, write_outputs  # noqa: E402

MODELS = ("llama3-8b", "llama2-13b", "codellama-34b", "llama3-70b")
PROFILES = ("a100-80g-estimate", "h200-estimate")


def choose_setting(profile, model, n: int, max_len: int) -> tuple[CostModel | None, str]:
    """The cost model of the first setting that holds ``max_len`` tokens, or None and why not."""
    best, why = 0, []
    for recompute in ("none", "full"):
        for tp in (1, 2, 4, 8):
            if tp > profile.gpus_per_node:
                continue
            try:
                cm = CostModel.from_profile(profile, get_model(model), num_gpus=n, max_seq_len=max_len,
                                            allow_kv_replication=True,
                                            parallel=Parallelism(tp, tp > 1, recompute))
            except ValueError as exc:
                why.append(f"tp{tp}/{recompute}: {str(exc).split(' of profile')[0]}")
                continue
            if cm.max_tokens >= max_len:
                return cm, ""
            best = max(best, cm.max_tokens)
            why.append(f"tp{tp}/{recompute}: {cm.max_tokens} tokens (groups up to {cm.sizes[-1]} "
                       f"devices x {cm.capacity_tokens})")
    return None, f"longest held: {best} tokens; " + "; ".join(why[-2:])


def run(args) -> list[dict]:
    cells = []
    for prof_name in args.profiles.split(","):
        profile = load_profile(prof_name)
        for model in args.models.split(","):
            for n in (int(x) for x in args.gpus.split(",")):
                for max_len in (int(x) for x in args.lengths.split(",")):
                    cm, why = choose_setting(profile, model, n, max_len)
                    cell = {"profile": prof_name, "model": model, "num_gpus": n, "max_seq_len": max_len}
                    if cm is None:
                        cells.append({**cell, "infeasible": why})
                        print(f"{prof_name} {model} N={n} L={max_len}: infeasible ({why})", file=sys.stderr)
                        continue
                    gb = args.batch_per_gpu * n
                    batches, _ = sample_batches(corpus_lengths(args.corpus), global_batch=gb,
                                                num_batches=args.batches, seed=args.seed, max_seq_len=max_len)
                    cfg = PlannerConfig(over_length="truncate", time_budget_s=args.budget)
                    t0 = time.perf_counter()
                    rows = [plan_batch(b, cm, cfg, max_len) for b in batches]
                    s = summarize(rows)
                    cells.append({**cell, "global_batch": gb, "parallel": cm.parallel.to_dict(),
                                  "devices": cm.cluster.num_gpus, "group_sizes": cm.sizes,
                                  "capacity_tokens_per_device": cm.capacity_tokens,
                                  "summary": s, "batches": rows})
                    print(f"{prof_name} {model} N={n} L={max_len} tp={cm.parallel.tp} "
                          f"{cm.parallel.recompute}: x static {s['x_static']:.2f} x batchada "
                          f"{s['x_batchada']:.2f} gap {s['gap_median']:.2%} "
                          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return cells


def table(cells: list[dict]) -> list[str]:
    lines = ["| GPUs | model | N | max len | TP / recompute | groups (devices) | micro-batches | plan p99 s "
             "| gap median / max | x static | x batchada | x megatron-hybrid-cp |", "|" + "---|" * 12]
    for c in cells:
        head = f"| {c['profile'].split('-estimate')[0]} | {c['model']} | {c['num_gpus']} | {c['max_seq_len'] // 1024}K |"
        if "infeasible" in c:
            lines.append(head + f" does not fit: {c['infeasible']} |||||||")
            continue
        s, p = c["summary"], c["parallel"]
        lines.append(head + f" {p['tp']}{' +SP' if p['sequence_parallel'] else ''} / {p['recompute']} | "
                     f"{'/'.join(map(str, c['group_sizes']))} of {c['devices']} | "
                     f"{s['micro_batches_min']}-{s['micro_batches_max']} | {s['plan_p99_s']:.2f} | "
                     f"{s['gap_median']:.1%} / {s['gap_max']:.1%} | {s['x_static']:.2f} | "
                     f"{s['x_batchada']:.2f} | {_hcp(s)} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--gpus", default="64,512")
    ap.add_argument("--lengths", default=f"{192 * 1024},{1 << 20}")
    ap.add_argument("--corpus", default="wikipedia")
    ap.add_argument("--batch-per-gpu", type=int, default=4, help="global batch = this x GPUs (sequences)")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--budget", type=float, default=1.0, help="flexsp planning budget per batch (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_models.json")
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    result = {"provenance": provenance(corpus=args.corpus, budget_s=args.budget,
                                       batch_per_gpu=args.batch_per_gpu),
              "cells": run(args)}
    lines = header_lines("Large models with tensor parallelism", result["provenance"]) + table(result["cells"])
    lines += ["", "TP is the smallest that holds the max length (sequence parallelism on when TP > 1), without "
              "recomputation if possible, else with full recomputation. Groups are counted in devices of TP "
              "GPUs; their sizes are capped by query heads / TP and, without KV replication, KV heads / TP "
              "(KV replication is on here). Speedups are ratios of summed simulated step times; "
              "`x megatron-hybrid-cp` is over the batches whose Megatron groups Ulysses can run. The "
              "profiles are estimates from public specifications."]
    print("\n".join(lines))
    for path in write_outputs(args.out, result, args.md, lines if args.md else None):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
