"""pretrain_gpt_flexsp.py: plan-only mode, and bad input refused before any training starts."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args, tmp_path):
    return subprocess.run([sys.executable, str(ROOT / "pretrain_gpt_flexsp.py"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                               "CUDA_VISIBLE_DEVICES": ""})


def test_plan_only_mode_plans(tmp_path):
    lens = tmp_path / "l.txt"
    lens.write_text("\n".join(str(x) for x in [100, 2000, 30, 7000, 450] * 20))
    out = _run(["--flexsp-plan-only", "--lengths", str(lens), "--global-batch", "32",
                "--num-gpus", "16", "--gpus-per-node", "8", "--profile", "a100-paper", "--model",
                "gpt-7b", "--max-seq-len", "8192"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "step ms" in out.stdout


@pytest.mark.parametrize("extra, message", [
    (["--data-path", "/nonexistent/docs"], "is not a Megatron indexed dataset"),
    (["--data-path", "/x", "--tensor-model-parallel-size", "1", "--no-calculate-per-token-loss"],
     None),
])
def test_bad_input_is_refused_with_the_value(tmp_path, extra, message):
    pytest.importorskip("megatron.training")
    from tests.integration.megatron_runs import tiny_args

    args = [a for a in tiny_args() if not (a == "--calculate-per-token-loss" and
                                           "--no-calculate-per-token-loss" in extra)]
    extra = [a for a in extra if a != "--no-calculate-per-token-loss"]
    out = _run(["--flexsp", *args, "--train-iters", "1", *extra], tmp_path)
    assert out.returncode != 0
    expected = message or "--calculate-per-token-loss is required"
    assert expected in out.stderr, out.stderr[-3000:]
