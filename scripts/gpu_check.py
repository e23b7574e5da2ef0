#!/usr/bin/env python
"""GPU checks in one call: attention backends vs the reference in bf16, timings; skips what is absent.

Run by ``scripts/gpu_check.sh`` and ``scripts/gpu_check_device.sh``. A backend whose package is not
installed is a SKIP; one that is installed but fails in any way (flash-attn's RuntimeError,
Transformer Engine's AssertionError, a wrong result) is a FAIL. Prints one line per check and a
summary; exit status 1 if any check failed, 0 otherwise. Writes JSON to $OUT/gpu_check.json if OUT is
set.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import torch

from megatron_flexsp.runtime.attention import varlen_causal_attention

# bf16 has an 8-bit mantissa: outputs of softmax-weighted sums of unit-variance values agree with the
# float64 reference to about 2e-2 absolute.
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
#: The package each optional backend needs; absent means SKIP.
PACKAGES = {"flash": "flash_attn", "te": "transformer_engine"}


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
    cu = [0] + [int(x) for x in torch.tensor(lengths).cumsum(0)]
    T, n, H = cu[-1], 8, 128
    for n_kv in (8, 2):
        q = torch.randn(T, n, H, device=dev, generator=g, dtype=torch.bfloat16)
        k = torch.randn(T, n_kv, H, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn(T, n_kv, H, device=dev, generator=g, dtype=torch.bfloat16)
        ref = varlen_causal_attention(q.float(), k.float(), v.float(), cu, backend="sdpa")
        for backend in ("sdpa", "flash", "te"):
            name = f"{backend} (kv heads {n_kv})"
            package = PACKAGES.get(backend)
            if package and importlib.util.find_spec(package) is None:
                print(f"SKIP {name}: {package} is not installed")
                results.append({"check": name, "skipped": f"{package} is not installed"})
                continue
            try:
                out = varlen_causal_attention(q, k, v, cu, backend=backend)
                err = float((out.float() - ref).abs().max())
                ok = torch.allclose(out.float(), ref, **BF16_TOL)
                ms = bench(lambda: varlen_causal_attention(q, k, v, cu, backend=backend))
                print(f"{'PASS' if ok else 'FAIL'} {name}: max err {err:.3e}, {ms:.2f} ms")
                results.append({"check": name, "ok": ok, "max_err": err, "ms": ms})
            except Exception as exc:  # noqa: BLE001 - installed but broken is a failure, not a skip
                ok = False
                print(f"FAIL {name}: installed but raised {type(exc).__name__}: {exc}")
                results.append({"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
            failed += not ok
    # the fp32 reference itself against the float64 plain reference on a short prefix
    cu_s = [0, 512, 812]
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
