"""Launch ``pretrain_gpt_flexsp.py`` with torchrun on CPU and read back what it recorded.

Shared by the integration tests and ``scripts/bench_megatron.py``: a small demo dataset, the tiny
model's Megatron arguments (``scripts/tiny_gpt_args.sh``), per-step records (``steps.jsonl``) and
Megatron's own iteration log (loss and grad norm per iteration).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from megatron_flexsp.utils.launch import worker_env  # noqa: E402
_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([0-9.]+) .*?"
                   r"lm loss: ([0-9.E+-]+) .*?grad norm: ([0-9.]+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_dataset(prefix: Path, max_docs: int = 400, source: str | None = None) -> Path:
    """A small indexed dataset of real documents (first ``max_docs`` stdlib definitions, or those
    under the stdlib subdirectory ``source``)."""
    if not Path(str(prefix) + ".idx").exists():
        extra = []
        if source:
            import sysconfig

            extra = ["--source", str(Path(sysconfig.get_paths()["stdlib"]) / source)]
        subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_demo_data.py"), "--out",
                        str(prefix), "--max-docs", str(max_docs), *extra], check=True, cwd=ROOT,
                       capture_output=True, text=True)
    return prefix


def tiny_args(seq_length: int = 1024, gbs: int = 8, seed: int = 1234) -> list[str]:
    env = dict(os.environ, SEQ_LENGTH=str(seq_length), GBS=str(gbs), SEED=str(seed))
    out = subprocess.run(["bash", str(ROOT / "scripts" / "tiny_gpt_args.sh")], env=env,
                         capture_output=True, text=True, check=True)
    return shlex.split(out.stdout)


@dataclass
class RunResult:
    returncode: int
    log: str
    steps: list[dict]
    iterations: dict[int, tuple[float, float]]  # Megatron iteration -> (lm loss, grad norm), logged
    iteration_ms: dict[int, float]  # Megatron iteration -> its logged elapsed time (ms)
    megatron: dict[int, dict]  # train_step's returns at full precision: iteration -> lm_loss, grad_norm
    eval: list[dict]  # per evaluation batch (eval.jsonl)


def run_pretrain(out_dir: Path, data: Path | None, extra: list[str], *, nproc: int = 4, steps: int = 6,
                 seq_length: int = 1024, gbs: int = 8, timeout: int = 1800,
                 env: dict | None = None, testbed: dict | None = None,
                 without: tuple[str, ...] = (), raw: bool = False, on_start=None) -> RunResult:
    """One launch of the entry script; never raises on a failed run (see ``returncode``).

    On this machine (torchrun, ``nproc`` ranks), or with ``testbed`` (``{"rate": "400mbit",
    "latency": "50ms"}``) on two emulated nodes of ``nproc // 2`` ranks each, started as the Slurm
    script starts them (``scripts/testbed/two_nodes.sh`` and ``node.sh``). ``without``: value-less
    flags of the tiny model's arguments to leave out."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = worker_env(base=dict(os.environ, **(env or {})), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    base = [] if raw else [a for a in tiny_args(seq_length, gbs) if a not in without]  # value-less only
    data_args = [] if data is None else ["--data-path", str(data)]
    script = [str(ROOT / "pretrain_gpt_flexsp.py"), *base, *data_args,
              "--train-iters", str(steps), "--flexsp-plan-dir", str(out_dir), *extra]
    if testbed is None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *script]
    else:
        env.update(NPROC=str(nproc // 2), PORT=str(free_port()), PYTHON=sys.executable)
        cmd = ["bash", str(ROOT / "scripts" / "testbed" / "two_nodes.sh"), "--rate", testbed["rate"],
               "--latency", testbed.get("latency", "50ms"), "--", "bash",
               str(ROOT / "scripts" / "testbed" / "node.sh"), *script]
    if on_start is None:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        text, code = proc.stdout + proc.stderr, proc.returncode
    else:
        with open(out_dir / "run.log", "w") as log:
            running = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            on_start(running)
            code = running.wait(timeout=timeout)
        text = (out_dir / "run.log").read_text()
    (out_dir / "run.log").write_text(text)
    def lines(name):
        path = out_dir / name
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    records = lines("steps.jsonl")
    found = list(_ITER.finditer(text))
    iters = {int(m.group(1)): (float(m.group(3)), float(m.group(4))) for m in found}
    times = {int(m.group(1)): float(m.group(2)) for m in found}
    megatron = {}
    if (out_dir / "megatron.jsonl").exists():
        for line in (out_dir / "megatron.jsonl").read_text().splitlines():
            rec = json.loads(line)
            megatron[rec["iteration"]] = rec
    return RunResult(code, text, records, iters, times, megatron, lines("eval.jsonl"))


def run_independent(out_dir: Path, data: Path, ckpt: Path, iteration: int, *, seq_length: int = 1024,
                    gbs: int = 8, timeout: int = 600) -> dict:
    """``tests/integration/independent_step.py`` on one process: the step's loss and grad norm."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = worker_env(base=dict(os.environ), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "tests" / "integration" / "independent_step.py"), *tiny_args(seq_length, gbs),
           "--data-path", str(data), "--load", str(ckpt), "--iteration", str(iteration)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    (out_dir / "independent.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(proc.stdout[-2000:] + proc.stderr[-4000:])
    return json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])


def write_report(path: str, lines: list[str], payload: dict) -> None:
    """Print a benchmark's table and write its JSON (parent folders created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    sys.stdout.write("\n".join(lines) + f"\nwrote {out}\n")
