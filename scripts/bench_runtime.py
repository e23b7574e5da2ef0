#!/usr/bin/env python
"""Runtime overhead on CPU: share of a step in dispatch, group switching, all-to-all and compute.

Launches itself under torchrun with 4 gloo ranks (one call: ``python scripts/bench_runtime.py``).
A toy transformer (hidden 256, 8 heads) trains on documents whose lengths are drawn from the real
Wikipedia lengths (divided by 8, capped at 1024 tokens); each plan runs 5 timed steps after one
warm-up. Prints a table and writes JSON (default out/bench_runtime.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megatron_flexsp.utils.launch import worker_env  # noqa: E402


def launch(args) -> int:
    env = worker_env("FLEXSP_BENCH_WORKER", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr",
           "127.0.0.1", "--master-port", str(args.port), __file__, "--out", args.out,
           "--lengths", args.lengths]
    return subprocess.call(cmd, env=env, cwd=ROOT)


def worker(args) -> int:
    import numpy as np
    import torch
    import torch.distributed as dist

    import megatron_flexsp.runtime.all_to_all as a2a
    from megatron_flexsp.runtime.dispatch import dispatch, owner
    from megatron_flexsp.runtime.groups import SPGroupPool
    from megatron_flexsp.runtime.layout import build_group_layout
    from megatron_flexsp.runtime.testing import ToyTransformer, local_positions, shifted_labels, token_loss_sum
    from megatron_flexsp.topology import ClusterSpec

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    pool = SPGroupPool(ClusterSpec(4, 2), [1, 2, 4])
    timers = {"alltoall": 0.0}
    for name in ("_seq_to_head", "_head_to_seq"):  # bench-only instrumentation, forward and backward
        orig = getattr(a2a, name)

        def timed(*xs, _orig=orig):
            t0 = time.perf_counter()
            out = _orig(*xs)
            timers["alltoall"] += time.perf_counter() - t0
            return out
        setattr(a2a, name, timed)

    lengths_all = np.loadtxt(args.lengths, dtype=np.int64)
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in np.minimum(np.maximum(rng.choice(lengths_all, 24) // 8, 8), 1024)]
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 512, (L,), generator=g) for L in lengths]
    total = sum(L - 1 for L in lengths)
    order = sorted(range(len(lengths)), key=lambda s: -lengths[s])
    plans = {
        "all size 4 (static SP=4)": [[((0, 1, 2, 3), tuple(order[k::2]))] for k in range(2)],
        "all size 1 (data parallel)": [[((r,), tuple(order[k * 4 + r::8])) for r in range(4)] for k in range(2)],
        "mixed 2+1+1 / 1x4": [[((0, 1), tuple(order[:2])), ((2,), tuple(order[2:12:2])), ((3,), tuple(order[3:12:2]))],
                              [((r,), tuple(order[12 + r::4])) for r in range(4)]],
    }
    model = ToyTransformer(vocab=512, hidden=256, heads=8, max_len=1024, seed=0)
    mine = {s: torch.stack([docs[s], shifted_labels(docs[s])], dim=1)
            for s in range(len(docs)) if owner(s, world) == rank}
    results = {}
    for name, plan in plans.items():
        stats = []
        for step in range(6):
            timers["alltoall"] = 0.0
            t_disp = t_switch = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            for mb in plan:
                a = time.perf_counter()
                tok, lab = dispatch(mb, lengths, mine, pad_value=(0, -100), trailing=(2,)).unbind(1)
                t_disp += time.perf_counter() - a
                for ranks, seqs in mb:
                    if rank not in ranks:
                        continue
                    a = time.perf_counter()
                    group = pool.get(ranks)
                    lens = [lengths[s] for s in seqs]
                    lay = build_group_layout(lens, len(ranks))
                    pos = local_positions(lens, len(ranks), ranks.index(rank))
                    t_switch += time.perf_counter() - a
                    loss = token_loss_sum(model(tok, pos, group=group, layout=lay), lab) / total
                    loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad = None
            dist.barrier()
            step_s = time.perf_counter() - t0
            if step > 0:
                stats.append((step_s, t_disp, t_switch, timers["alltoall"]))
        s = np.array(stats).mean(axis=0)
        local = torch.tensor(s, dtype=torch.float64)
        dist.all_reduce(local)
        s = (local / world).tolist()
        results[name] = {"step_ms": 1e3 * s[0], "dispatch": s[1] / s[0], "group_switch": s[2] / s[0],
                         "alltoall": s[3] / s[0], "compute_and_rest": 1 - (s[1] + s[2] + s[3]) / s[0]}
    if rank == 0:
        print(f"\nRuntime overhead on CPU, 4 gloo ranks, {len(lengths)} documents "
              f"({sum(lengths)} tokens), toy transformer h256/8 heads; mean over 5 steps, all ranks")
        print(f"{'plan':<28} {'step ms':>8} {'dispatch':>9} {'switch':>7} {'all2all':>8} {'compute+rest':>13}")
        for name, r in results.items():
            print(f"{name:<28} {r['step_ms']:>8.1f} {r['dispatch']:>8.1%} {r['group_switch']:>7.1%} "
                  f"{r['alltoall']:>8.1%} {r['compute_and_rest']:>13.1%}")
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"lengths": lengths, "results": results}, indent=1))
        print(f"wrote {out}")
    dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/bench_runtime.json")
    ap.add_argument("--lengths", default=str(ROOT.parent / "shared" / "seqlen" / "flexsp_wikipedia_seqlens.txt"))
    ap.add_argument("--port", type=int, default=29531)
    args = ap.parse_args()
    return worker(args) if os.environ.get("FLEXSP_BENCH_WORKER") else launch(args)


if __name__ == "__main__":
    raise SystemExit(main())
