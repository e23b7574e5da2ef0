#!/usr/bin/env python
"""Predicted vs measured: run plans through the runtime and compare with the cost model.

Launches itself under torchrun (default 4 gloo ranks on CPU; on GPUs use --ranks). For each of K
batches it plans with several strategies under the given profile, runs every plan's micro-batches
through the runtime (dispatch, Ulysses attention, forward and backward of a layer stack of the
profiled model's shape), and records each group's time (slowest rank of the group) and the step
time. Prints per-step and per-group errors, writes JSON and a scatter plot (PNG).

    python scripts/validate_cost_model.py --profile out/profile/cpu-measured.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megatron_flexsp.utils.launch import worker_env  # noqa: E402
from megatron_flexsp.utils.report import header_lines, provenance, write_outputs  # noqa: E402


def parse_args():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--model", default="gpt-2x64-4h", help="model name in the profile")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--strategies", default="flexsp,batchada,static")
    ap.add_argument("--lengths", default=str(ROOT.parent / "shared" / "seqlen" / "flexsp_wikipedia_seqlens.txt"))
    ap.add_argument("--length-scale", type=float, default=0.5, help="multiply sampled lengths by this")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per plan (median reported)")
    ap.add_argument("--backend", default="auto", help="attention backend (auto: as in training)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=29534)
    ap.add_argument("--out", default="out/validate_cost_model.json")
    ap.add_argument("--plot", default="out/validate_cost_model.png")
    ap.add_argument("--md", default=None, help="also write the tables as markdown here")
    return ap.parse_args()


def sample_lengths(args, cap: int):
    import numpy as np
    rng = np.random.default_rng(args.seed)
    if Path(args.lengths).exists():
        pool = np.loadtxt(args.lengths, dtype=np.int64)
    else:  # documented stand-in: lognormal body with the Wikipedia median (347 tokens)
        pool = rng.lognormal(np.log(347), 1.3, 100_000).astype(np.int64)
    out = []
    for _ in range(args.batches):
        b = np.maximum((rng.choice(pool, args.global_batch) * args.length_scale).astype(np.int64), 16)
        out.append(np.minimum(b, cap))
    return out


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from megatron_flexsp.config import PlannerConfig
    import dataclasses

    from megatron_flexsp.cost_model import CostModel, load_profile
    from megatron_flexsp.cost_model.calibrate import layer_stack_entry
    from megatron_flexsp.model_spec import ModelSpec
    from megatron_flexsp.planner import plan_step
    from megatron_flexsp.runtime import profiler as P
    from megatron_flexsp.runtime.attention import choose_backend, installed_backends
    from megatron_flexsp.runtime.executor import run_step
    from megatron_flexsp.runtime.groups import SPGroupPool

    device, rank, world = P.init_job()
    cuda = device.type == "cuda"
    profile = load_profile(args.profile)
    # the runtime's layer stack runs here, not Megatron: predict with the profile's compute as its
    # layer stack measured it (a Megatron-run fit, which adds Megatron's own costs, undone)
    models = {name: layer_stack_entry(e) for name, e in profile.models.items()}
    if models != profile.models and rank == 0:
        print(f"profile {profile.name}: predicting the layer stack with its compute before the fit to a "
              f"Megatron run")
    profile = dataclasses.replace(profile, models=models)
    entry = profile.models[args.model]
    sh = entry["shape"]
    spec = ModelSpec(args.model, sh["num_layers"], sh["hidden_size"], sh["num_heads"],
                     num_kv_heads=sh.get("num_kv_heads", 0), ffn_hidden_size=sh.get("ffn_hidden_size", 0),
                     vocab_size=sh.get("vocab_size", 384), dtype_bytes=sh.get("dtype_bytes", 4),
                     swiglu=sh.get("swiglu", True))
    vocab = spec.vocab_size
    cm = CostModel.from_profile(profile, spec, num_gpus=world, max_seq_len=1 << 20)
    pool = SPGroupPool(cm.cluster, cm.sizes, singletons=True, device=device)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if spec.dtype_bytes == 2 else torch.float32  # as the profile was measured
    model = P.SpecStack(spec).to(device=device, dtype=dtype)
    backend = choose_backend(args.backend, cuda=cuda, dtype=dtype, installed=installed_backends(cuda))
    batches = sample_lengths(args, cm.max_tokens)
    cfg = PlannerConfig(over_length="truncate")
    records = []
    for k, lens in enumerate(batches):
        gen = torch.Generator().manual_seed(k)
        docs = {s: torch.randint(0, vocab, (int(n),), generator=gen) for s, n in enumerate(lens)}
        loaded = {s: t for s, t in docs.items() if s % world == rank}
        for strategy in args.strategies.split(","):
            plan = plan_step(lens, cm, strategy=strategy, config=cfg, max_seq_len=int(lens.max()))
            for rep in range(args.repeats + 1):
                mine: list[float] = []

                def run_group(rows, positions, group, layout):
                    t0 = time.perf_counter()
                    loss = P.step_loss(model, rows.to(device), group=group, layout=layout, backend=backend)
                    if cuda:
                        torch.cuda.synchronize()
                    mine.append((time.perf_counter() - t0) * 1e3)
                    return loss

                dist.barrier()
                t0 = time.perf_counter()
                stats = run_step(plan, pool=pool, rank=rank, loaded=loaded, run_group=run_group,
                                 num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, device=device)
                dist.barrier()
                step_ms = (time.perf_counter() - t0) * 1e3
                model.zero_grad(set_to_none=True)
                # this rank's time in each micro-batch (0 when it ran nothing), slowest rank per group
                per_mb = []
                it = iter(mine)
                for mb in plan.micro_batches:
                    per_mb.append(next(it) if any(rank in g.ranks for g in mb.groups) else 0.0)
                t = torch.tensor(per_mb, dtype=torch.float64, device=device)  # NCCL: GPU tensors
                gathered = [torch.zeros_like(t) for _ in range(world)]
                dist.all_gather(gathered, t)
                if rep == 0 or rank != 0:
                    continue  # warm-up run
                for j, mb in enumerate(plan.micro_batches):
                    for g in mb.groups:
                        measured = max(float(gathered[r][j].item()) for r in g.ranks)
                        records.append({"batch": k, "strategy": strategy, "rep": rep, "kind": "group",
                                        "size": len(g.ranks), "predicted_ms": g.predicted_ms,
                                        "measured_ms": measured})
                records.append({"batch": k, "strategy": strategy, "rep": rep, "kind": "step",
                                "predicted_ms": plan.predicted_step_ms, "measured_ms": step_ms,
                                "dispatch_ms": stats.dispatch_s * 1e3, "switch_ms": stats.switch_s * 1e3,
                                "micro_batches": len(plan.micro_batches)})
        if rank == 0:
            print(f"batch {k + 1}/{len(batches)} done", file=sys.stderr, flush=True)
    if rank == 0:
        report(args, records, cm)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _median_over_reps(records, kind):
    """One record per (batch, strategy, position) with the median measured time over repeats."""
    import numpy as np
    keyed: dict = {}
    counter: dict = {}
    for r in records:
        if r["kind"] != kind:
            continue
        base = (r["batch"], r["strategy"], r["rep"])
        pos = counter.get(base, 0)
        counter[base] = pos + 1
        keyed.setdefault((r["batch"], r["strategy"], pos), []).append(r)
    out = []
    for rows in keyed.values():
        merged = dict(rows[0])
        merged["measured_ms"] = float(np.median([r["measured_ms"] for r in rows]))
        merged.pop("rep", None)
        out.append(merged)
    return out


def report(args, records, cm) -> None:
    import numpy as np
    steps = _median_over_reps(records, "step")
    groups = _median_over_reps(records, "group")

    def errs(rows):
        return np.array([r["measured_ms"] / r["predicted_ms"] - 1 for r in rows])

    def stats(rows) -> dict:
        e = errs(rows)
        return {"count": len(rows), "predicted_ms": float(np.mean([r["predicted_ms"] for r in rows])),
                "measured_ms": float(np.mean([r["measured_ms"] for r in rows])),
                "median_abs_err": float(np.median(np.abs(e))), "median_signed_err": float(np.median(e))}

    es, eg = errs(steps), errs(groups)
    by_strategy = {s: stats([r for r in steps if r["strategy"] == s]) for s in args.strategies.split(",")}
    by_size = {d: stats([r for r in groups if r["size"] == d]) for d in sorted({r["size"] for r in groups})}
    summary = {"step_median_abs_err": float(np.median(np.abs(es))), "step_median_signed_err": float(np.median(es)),
               "group_median_abs_err": float(np.median(np.abs(eg))), "target_step_median_abs_err": 0.15,
               "by_group_size": {str(d): {"groups": v["count"], "median_abs_err": v["median_abs_err"],
                                          "median_signed_err": v["median_signed_err"],
                                          "spans_nodes": d > cm.cluster.gpus_per_node}
                                 for d, v in by_size.items()}}
    print(f"\nCost model {cm.profile.name} vs measurement, {cm.cluster.num_gpus} ranks, "
          f"{len(steps)} steps, {len(groups)} groups")
    print(f"{'strategy':>10} {'steps':>5} {'predicted ms':>13} {'measured ms':>12} {'median |err|':>13}")
    for s, v in by_strategy.items():
        print(f"{s:>10} {v['count']:>5} {v['predicted_ms']:>13.0f} {v['measured_ms']:>12.0f} "
              f"{v['median_abs_err']:>12.1%}")
    for d, v in by_size.items():
        print(f"groups of {d}: {v['count']}, median |err| {v['median_abs_err']:.1%}, "
              f"median signed {v['median_signed_err']:+.1%}")
    print(f"step: median |error| {summary['step_median_abs_err']:.1%} (target <= 15%), "
          f"group: median |error| {summary['group_median_abs_err']:.1%}")
    prov = provenance(profile=cm.profile.name, ranks=args.ranks, batches=args.batches, repeats=args.repeats)
    md = header_lines(f"Cost model {cm.profile.name}: predicted against measured", prov) + [
        "| strategy | steps | predicted ms (mean) | measured ms (mean) | median abs. error |", "|---|---|---|---|---|"]
    md += [f"| {s} | {v['count']} | {v['predicted_ms']:.0f} | {v['measured_ms']:.0f} | {v['median_abs_err']:.1%} |"
           for s, v in by_strategy.items()]
    md += ["", "| group size | spans nodes | groups | median abs. error | median signed error (measured over predicted - 1) |",
           "|---|---|---|---|---|"]
    md += [f"| {d} | {'yes' if d > cm.cluster.gpus_per_node else 'no'} | {v['count']} | {v['median_abs_err']:.1%} | "
           f"{v['median_signed_err']:+.1%} |" for d, v in by_size.items()]
    md += ["", f"Step: median abs. error {summary['step_median_abs_err']:.1%} (target <= 15%); groups: "
           f"{summary['group_median_abs_err']:.1%}. Each value is the median of {args.repeats} timed runs; "
           f"the layer stack is predicted with the profile's Megatron-run fit undone. Plot: `{args.plot}`."]
    write_outputs(args.out, {"provenance": prov, "profile": cm.describe(), "summary": summary,
                             "records": records}, args.md, md if args.md else None)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 6))
    for d in by_size:
        rows = [r for r in groups if r["size"] == d]
        ax.scatter([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows], s=12,
                   label=f"group of {d}", alpha=0.7)
    ax.scatter([r["predicted_ms"] for r in steps], [r["measured_ms"] for r in steps], marker="x",
               color="k", label="step")
    hi = max(max(r["measured_ms"], r["predicted_ms"]) for r in steps + groups)
    ax.plot([0, hi], [0, hi], "k--", lw=0.8)
    ax.set_xlabel("predicted (ms)")
    ax.set_ylabel("measured (ms)")
    ax.set_title(f"cost model {cm.profile.name}: step median |err| {summary['step_median_abs_err']:.1%}")
    ax.legend()
    fig.savefig(args.plot, dpi=110, bbox_inches="tight")
    print(f"wrote {args.out}{', ' + args.md if args.md else ''} and {args.plot}")


def main() -> int:
    args = parse_args()
    if os.environ.get("FLEXSP_VALIDATE_WORKER") == "1":
        return worker(args)
    env = worker_env("FLEXSP_VALIDATE_WORKER")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(args.port), __file__] + sys.argv[1:]
    return subprocess.call(cmd, env=env, cwd=ROOT)


if __name__ == "__main__":
    raise SystemExit(main())
