#!/usr/bin/env python
"""GPU checks in one call: attention backends vs the reference in bf16, timings; skips what is absent.

Run by scripts/gpu_check.sh. Prints one line per check and a summary; exit status 1 if any check that
could run failed, 0 otherwise (skips are not failures). Writes JSON to $OUT/gpu_check.json if OUT is set.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from megatron_flexsp.runtime.attention import varlen_causal_attention

# bf16 has an 8-bit mantissa: outputs of softmax-weighted sums of unit-variance values agree with the
# float64 reference to about 2e-2 absolute.
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def bench(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> int:
    results, failed = [], 0
    if not torch.cuda.is_available():
        print("SKIP all: no CUDA device")
        return 0
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    g = torch.Generator(device=dev).manual_seed(0)
    lengths = [8192, 4096, 1024, 512, 300, 37]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device=dev)
    T, n, H = int(cu[-1]), 8, 128
    for n_kv in (8, 2):
        q = torch.randn(T, n, H, device=dev, generator=g, dtype=torch.bfloat16)
        k = torch.randn(T, n_kv, H, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn(T, n_kv, H, device=dev, generator=g, dtype=torch.bfloat16)
        ref = varlen_causal_attention(q.float(), k.float(), v.float(), cu, backend="sdpa")
        for backend in ("sdpa", "flash", "te"):
            name = f"{backend} (kv heads {n_kv})"
            try:
                out = varlen_causal_attention(q, k, v, cu, backend=backend)
                err = float((out.float() - ref).abs().max())
                ok = torch.allclose(out.float(), ref, **BF16_TOL)
                ms = bench(lambda: varlen_causal_attention(q, k, v, cu, backend=backend))
                print(f"{'PASS' if ok else 'FAIL'} {name}: max err {err:.3e}, {ms:.2f} ms")
                failed += not ok
                results.append({"check": name, "ok": ok, "max_err": err, "ms": ms})
            except RuntimeError as exc:
                print(f"SKIP {name}: {exc}")
                results.append({"check": name, "skipped": str(exc)})
    # the fp32 reference itself against the float64 plain reference on a short prefix
    cu_s = torch.tensor([0, 512, 812], device=dev)
    qs, ks, vs = (torch.randn(812, 8, 64, device=dev, generator=g) for _ in range(3))
    err = float((varlen_causal_attention(qs, ks, vs, cu_s, backend="sdpa")
                 - varlen_causal_attention(qs, ks, vs, cu_s, backend="reference")).abs().max())
    ok = err < 1e-4
    failed += not ok
    print(f"{'PASS' if ok else 'FAIL'} sdpa fp32 vs reference: max err {err:.3e}")
    results.append({"check": "sdpa fp32 vs reference", "ok": ok, "max_err": err})
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    print(f"gpu_check: {sum(1 for r in results if r.get('ok'))} passed, {failed} failed, "
          f"{sum(1 for r in results if 'skipped' in r)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
