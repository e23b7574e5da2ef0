"""pretrain_gpt_flexsp.py: plan-only mode works; training (issue 4) refuses clearly, exit 2."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(args, tmp_path):
    return subprocess.run([sys.executable, str(ROOT / "pretrain_gpt_flexsp.py"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_plan_only_mode_plans(tmp_path):
    lens = tmp_path / "l.txt"
    lens.write_text("\n".join(str(x) for x in [100, 2000, 30, 7000, 450] * 20))
    out = _run(["--flexsp-plan-only", "--lengths", str(lens), "--global-batch", "32",
                "--num-gpus", "16", "--gpus-per-node", "8", "--profile", "a100-paper", "--model",
                "gpt-7b", "--max-seq-len", "8192"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "step ms" in out.stdout


def test_training_is_refused_with_a_reason(tmp_path):
    out = _run(["--num-layers", "2"], tmp_path)
    assert out.returncode == 2
    assert "--flexsp-plan-only" in out.stderr
