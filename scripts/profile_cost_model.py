#!/usr/bin/env python
"""Profile this machine for the cost model and write a profile JSON the planner loads.

Measures, with every rank busy at once (as in training): forward+backward time of one sequence on
one GPU (or CPU rank) against its length, through the runtime's attention backend and a layer stack
of the model's shape; the same on every group size (Ulysses all-to-alls included); the raw
all-to-all time of every group size against bytes per rank (gloo on CPU, NCCL on GPU); and
activation bytes per token (tensors autograd saves in a forward); and the runtime's token dispatch
per micro-batch (folded into the fixed cost and linear rate). Fits the compute coefficients on
one GPU, then each group size's effective all-to-all latency and bandwidth from what its sequences
take beyond their compute share (least squares; fit errors printed and stored), and writes the
profile; the raw all-to-all fits are kept under ``measurements``. On a GPU each group size times
only the lengths whose activations it holds next to the stack's parameters, gradients and Adam
states (measured at the shortest length first; the device memory read from CUDA).

CPU (4 gloo ranks, the demo model, 2 ranks per "node" as in the demo):
    python scripts/profile_cost_model.py --out out/profile/cpu-measured.json
GPU node (8 GPUs): python scripts/profile_cost_model.py --ranks 8 --gpus-per-node 8 --layers 32 \
    --hidden 4096 --heads 32 --ffn 11008 --vocab 32000 --swiglu --dtype bf16 --base h200-estimate \
    --lengths 1024,2048,4096,8192,16384,32768 --out out/profile/h200-measured.json
Multi-node: scripts/slurm/profile.sbatch.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megatron_flexsp.utils.launch import worker_env  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="ranks to launch on this node (torchrun)")
    ap.add_argument("--gpus-per-node", type=int, default=2, help="ranks per node in the profile")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=0)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=384, help="padded vocabulary (Megatron pads 257 to 384)")
    ap.add_argument("--swiglu", action="store_true", default=True)
    ap.add_argument("--no-swiglu", dest="swiglu", action="store_false")
    ap.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                    help="auto: bf16 on GPUs, fp32 on the host")
    ap.add_argument("--backend", default="auto",
                    help="attention backend (auto: flash-attn for bf16 when installed, else Transformer "
                         "Engine when installed, else sdpa; sdpa on the host)")
    ap.add_argument("--lengths", default="64,128,256,512,1024,2048,4096")
    ap.add_argument("--alltoall-bytes", default="4096,32768,262144,1048576")
    ap.add_argument("--tensor-parallel-sizes", default="auto",
                    help="TP sizes whose all-reduce to profile (the profile's tensor_parallel table; "
                         "auto: powers of two from 2 to --gpus-per-node; 'none' to skip)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--megatron-run", default="",
                    help="--flexsp-plan-dir of a --flexsp Megatron run on the same ranks (steps.jsonl, "
                         "plans.jsonl): take the activation bytes per token its first step measured in "
                         "the Megatron model, and fit how its steps relate to this profile's predictions "
                         "(a scale on compute and a cost per micro-batch)")
    ap.add_argument("--base", default="cpu-gloo-demo", help="profile whose device and state fields are kept")
    ap.add_argument("--hardware", default="")
    ap.add_argument("--capacity-tokens", type=int, default=0,
                    help="CPU only: set the profile's (artificial) device memory so that each rank holds "
                         "this many tokens of activations next to the model states (0: keep --base's)")
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--out", default="out/profile/cpu-measured.json")
    return ap.parse_args(argv)


def megatron_fit(prof: dict, spec, world: int, run: Path, steps: list[dict]):
    """Fit (scale, per-micro-batch cost) of the Megatron run's steps against ``prof``'s predictions
    of the same plans (its first 2 steps skipped: warm-up)."""
    from megatron_flexsp.cost_model import CostModel
    from megatron_flexsp.cost_model.calibrate import fit_training
    from megatron_flexsp.cost_model.profile import parse_profile
    from megatron_flexsp.plan import StepPlan
    from megatron_flexsp.sim import simulate

    cm = CostModel.from_profile(parse_profile(prof, "unscaled"), spec, num_gpus=world, max_seq_len=1 << 20)
    plans = [StepPlan.from_json(x) for x in (run / "plans.jsonl").read_text().splitlines()]
    if len(plans) != len(steps):
        raise ValueError(f"{run}: {len(plans)} plans for {len(steps)} steps")
    used = list(zip(plans, steps))[2:]
    return fit_training([simulate(p, cm).step_ms for p, _ in used],
                        [len(p.micro_batches) for p, _ in used], [s["run_ms"] for _, s in used])


def launch(args) -> int:
    env = worker_env("FLEXSP_PROFILE_WORKER")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(args.port), __file__] + sys.argv[1:]
    return subprocess.call(cmd, env=env, cwd=ROOT)


def worker(args) -> int:
    import numpy as np
    import torch
    import torch.distributed as dist

    from megatron_flexsp.cost_model import CostModel
    from megatron_flexsp.cost_model.calibrate import (fit_alltoall, fit_compute, fit_group_excess,
                                                      measured_profile, scaled, with_dispatch)
    from megatron_flexsp.cost_model.profile import parse_profile
    from megatron_flexsp.model_spec import ModelSpec
    from megatron_flexsp.runtime import profiler as P
    from megatron_flexsp.runtime.attention import choose_backend, installed_backends
    from megatron_flexsp.runtime.groups import SPGroupPool
    from megatron_flexsp.topology import ClusterSpec, candidate_group_sizes
    from megatron_flexsp.utils.logging import get_logger

    log = get_logger("flexsp.profile")
    device, rank, world = P.init_job()
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if args.dtype == "bf16" or (args.dtype == "auto" and cuda) else torch.float32
    spec = ModelSpec(f"gpt-{args.layers}x{args.hidden}-{args.heads}h", args.layers, args.hidden, args.heads,
                     num_kv_heads=args.kv_heads or args.heads, ffn_hidden_size=args.ffn,
                     vocab_size=args.vocab, dtype_bytes=2 if dtype == torch.bfloat16 else 4,
                     swiglu=args.swiglu)
    backend = choose_backend(args.backend, cuda=cuda, dtype=dtype, installed=installed_backends(cuda))
    cluster = ClusterSpec(world, args.gpus_per_node)
    sizes = candidate_group_sizes(cluster, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads)
    pool = SPGroupPool(cluster, sizes, singletons=True, device=device)
    torch.manual_seed(0)
    model = P.SpecStack(spec).to(device=device, dtype=dtype)

    def progress(msg):
        if rank == 0:
            log.info("%s", msg)

    t_start = time.perf_counter()
    asked = [int(x) for x in args.lengths.split(",")]
    own = pool.get((rank,))
    # activations of a short sequence first: then only lengths whose activations the device holds
    act = P.activation_bytes_per_token(model, min(asked), group=own, backend=backend, device=device,
                                       vocab=spec.vocab_size)
    capacity = P.device_capacity_tokens(model, act, device)
    lengths = P.lengths_that_fit(asked, 1, capacity)
    if len(lengths) < 3:
        raise ValueError(f"only {lengths} of the lengths {asked} fit one rank ({capacity} tokens of "
                         f"{act:.0f} bytes each); give shorter --lengths or fewer --layers")
    if len(lengths) < len(asked):
        progress(f"one rank holds {capacity} tokens: profiling lengths up to {lengths[-1]} on one rank")
    times = P.time_sequences(model, lengths, group=own, repeats=args.repeats, backend=backend,
                             device=device, vocab=spec.vocab_size, progress=progress)
    act = P.activation_bytes_per_token(model, lengths[-1], group=own, backend=backend, device=device,
                                       vocab=spec.vocab_size)
    dispatch_tokens = [lengths[0], lengths[len(lengths) // 2], lengths[-1]]
    dispatch_ms = P.time_dispatch(dispatch_tokens, repeats=args.repeats, device=device, progress=progress)
    nbytes = [int(x) for x in args.alltoall_bytes.split(",")]
    a2a, grouped = {}, {}
    for d in sizes:
        if d == 1:
            continue
        block = tuple(range(rank // d * d, rank // d * d + d))
        a2a[d] = P.time_alltoall(pool.get(block), nbytes, repeats=args.repeats, device=device,
                                 progress=progress)
        fits = P.lengths_that_fit(asked, d, capacity)
        grouped[d] = (fits, P.time_sequences(model, fits, group=pool.get(block), repeats=args.repeats,
                                             backend=backend, device=device, vocab=spec.vocab_size,
                                             progress=progress))
    tp_sizes = ([] if args.tensor_parallel_sizes == "none" else
                [t for t in (2, 4, 8, 16, 32) if t <= args.gpus_per_node] if args.tensor_parallel_sizes == "auto"
                else [int(x) for x in args.tensor_parallel_sizes.split(",")])
    allreduce = {}
    for t in tp_sizes:  # one TP group per node-aligned block of t ranks (pool blocks of that size)
        if t not in sizes or t > args.gpus_per_node:
            raise ValueError(f"--tensor-parallel-sizes: {t} must be a group size of this job inside a "
                             f"node (sizes {sizes}, {args.gpus_per_node} per node)")
        block = tuple(range(rank // t * t, rank // t * t + t))
        allreduce[t] = P.time_allreduce(pool.get(block), nbytes, repeats=args.repeats, device=device,
                                        progress=progress)
    if rank == 0:
        stack_act = act
        run_steps = []
        if args.megatron_run:
            run = Path(args.megatron_run)
            run_steps = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
            if "activation_bytes_per_token" not in run_steps[0]:
                raise ValueError(f"{run / 'steps.jsonl'}: its first step has no activation_bytes_per_token")
            act = float(run_steps[0]["activation_bytes_per_token"])
        cfit = fit_compute(lengths, times)
        raw = [fit_alltoall(d, nbytes, ms) for d, ms in a2a.items()]
        kernel_fit = cfit
        cfit, disp_fixed, disp_rate = with_dispatch(cfit, dispatch_tokens, dispatch_ms)
        afits = []
        for d, (fits, ms) in grouped.items():  # effective all-to-all: group time beyond compute
            s = np.asarray(fits, dtype=np.float64)
            share = kernel_fit.time_ms(s, d)
            sent = (2.0 * spec.num_layers * spec.alltoall_elems_per_token() * spec.dtype_bytes
                    * (s / d) * (d - 1) / d)
            afits.append(fit_group_excess(d, sent, np.asarray(ms) - share, 4 * spec.num_layers))
        base_path = Path(args.base) if Path(args.base).exists() else ROOT / "configs" / "profiles" / f"{args.base}.json"
        base = json.loads(base_path.read_text())
        hardware = args.hardware or (torch.cuda.get_device_name() if cuda else f"cpu-{socket.gethostname()}")
        source = (f"measured by scripts/profile_cost_model.py on {hardware}, {world} ranks "
                  f"({args.gpus_per_node} per node), {time.strftime('%Y-%m-%d')}, backend {backend}, "
                  f"{args.dtype}; device memory and state fields from {args.base!r}")
        shape = {"num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "num_heads": spec.num_heads,
                 "num_kv_heads": spec.num_kv_heads, "ffn_hidden_size": spec.ffn_hidden_size,
                 "vocab_size": spec.vocab_size, "swiglu": spec.swiglu, "dtype_bytes": spec.dtype_bytes}
        # TP's all-reduce: fitted against the bytes a ring sends per rank, 2 (t-1)/t of the tensor
        tp_fits = [fit_alltoall(t, [2.0 * (t - 1) / t * b for b in nbytes], ms) for t, ms in allreduce.items()]

        def build(compute):
            out = measured_profile(base, hardware=hardware, gpus_per_node=args.gpus_per_node,
                                   model_name=spec.name, shape=shape, compute=compute, alltoall=afits,
                                   activation_bytes_per_token=act, num_layers=spec.num_layers,
                                   source=source)
            if tp_fits:
                out["tensor_parallel"] = [{"group_size": f.group_size, "latency_ms": f.latency_ms,
                                           "bandwidth_mib_per_ms": f.bandwidth_mib_per_ms} for f in tp_fits]
            return out

        prof = build(cfit)
        if run_steps:  # fitted against the unscaled profile's predictions, then applied
            tfit = megatron_fit(prof, spec, world, Path(args.megatron_run), run_steps)
            cfit = scaled(cfit, tfit)
            prof = build(cfit)
            prof["source"] += (f"; activation bytes per token measured in the Megatron model and compute "
                               f"scaled x{tfit.scale:.3f} + {tfit.per_micro_batch_ms:.2f} ms per micro-batch "
                               f"to fit {tfit.steps} steps of the Megatron run {args.megatron_run}")
            prof["models"][spec.name]["fit"]["megatron_run"] = vars(tfit)
        prof["measurements"] = {
            "lengths": lengths, "compute_ms": times,
            "group_lengths": {str(d): v[0] for d, v in grouped.items()},
            "group_compute_ms": {str(d): v[1] for d, v in grouped.items()},
            "dispatch_tokens": dispatch_tokens, "dispatch_ms": dispatch_ms,
            "dispatch_fit": {"fixed_ms": disp_fixed, "ms_per_token": disp_rate},
            "alltoall_bytes": nbytes, "alltoall_ms": {str(d): v for d, v in a2a.items()},
            "allreduce_ms": {str(t): v for t, v in allreduce.items()},
            "raw_alltoall_fit": {str(f.group_size): {"latency_ms": f.latency_ms,
                                                     "bandwidth_mib_per_ms": f.bandwidth_mib_per_ms,
                                                     "rel_err": f.rel_err} for f in raw}}
        if args.capacity_tokens:
            if cuda:
                raise ValueError("--capacity-tokens is for CPU profiles; a GPU profile keeps the device's memory")
            probe = CostModel.from_profile(parse_profile(dict(prof, device_memory_bytes=1e18), "probe"), spec,
                                           num_gpus=world, max_seq_len=max(lengths))
            prof["device_memory_bytes"] = float(prof.get("memory_reserve_bytes", 0) + probe.state_bytes_per_gpu
                                                + args.capacity_tokens * act + 1)
            prof["source"] += (f"; device memory set for {args.capacity_tokens} tokens per rank "
                               f"(artificial on CPU, so that long documents need groups)")
        parse_profile(prof, args.out)  # the planner must be able to load it
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(prof, indent=1))
        print(f"\nProfile of {spec.name} on {hardware} ({world} ranks), {time.perf_counter() - t_start:.0f} s")
        print(f"{'tokens':>7} {'measured ms':>12} {'fit ms':>9} {'error':>7}")
        for s, ms in zip(lengths, times):
            fit = float(kernel_fit.time_ms(s))
            print(f"{s:>7} {ms:>12.2f} {fit:>9.2f} {fit / ms - 1:>+7.1%}")
        print(f"fit: overhead {kernel_fit.overhead_ms:.3f} ms, a_lin {kernel_fit.a_lin_ms_per_token:.3e} ms/token, "
              f"a_attn {kernel_fit.a_attn_ms_per_token2:.3e} ms/token^2, RMS relative error {cfit.rel_err:.1%}")
        print(f"dispatch per micro-batch: {disp_fixed:.3f} ms + {disp_rate:.2e} ms/token (added to the "
              f"fixed cost and the linear rate)")
        print(f"activation memory: {act:.0f} bytes per token held"
              + (f" (Megatron model; layer stack: {stack_act:.0f})" if run_steps else " (layer stack)"))
        if run_steps:
            print(f"Megatron run: measured/predicted median {tfit.raw_median_ratio:.3f} before the fit; "
                  f"compute x{tfit.scale:.3f} + {tfit.per_micro_batch_ms:.2f} ms per micro-batch, RMS "
                  f"relative error {tfit.rel_err:.1%} over {tfit.steps} steps")
        for f, r in zip(afits, raw):
            print(f"all-to-all size {f.group_size}: effective (from Ulysses layer timings) latency "
                  f"{f.latency_ms:.3f} ms/call, bandwidth {f.bandwidth_mib_per_ms:.3f} MiB/ms, fit error "
                  f"{f.rel_err:.1%}; raw all_to_all_single: latency {r.latency_ms:.3f} ms, bandwidth "
                  f"{r.bandwidth_mib_per_ms:.3f} MiB/ms, fit error {r.rel_err:.1%}")
        for f in tp_fits:
            print(f"all-reduce (tensor parallelism) size {f.group_size}: latency {f.latency_ms:.3f} ms, "
                  f"bandwidth {f.bandwidth_mib_per_ms:.3f} MiB/ms per rank sent, fit error {f.rel_err:.1%}")
        print(f"wrote {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main() -> int:
    args = parse_args()
    if os.environ.get("FLEXSP_PROFILE_WORKER") == "1":
        return worker(args)
    return launch(args)


if __name__ == "__main__":
    raise SystemExit(main())
