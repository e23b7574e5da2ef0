"""pretrain_gpt_flexsp.py: plan-only mode, and bad input refused before any training starts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args, tmp_path, **env):
    return subprocess.run([sys.executable, str(ROOT / "pretrain_gpt_flexsp.py"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                               "CUDA_VISIBLE_DEVICES": "", **env})


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    pytest.importorskip("megatron.training")
    from tests.integration.megatron_runs import build_dataset

    return build_dataset(tmp_path_factory.mktemp("docs") / "d", max_docs=50)


def _bad_profile(tmp_path, **changes):
    import json

    data = json.loads((ROOT / "configs" / "profiles" / "cpu-gloo-demo.json").read_text())
    data.update(changes)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("case", ["seq-too-long", "world-not-whole-nodes", "profile-version",
                                  "profile-missing-key", "profile-other-model", "heads"])
def test_bad_cluster_or_profile_is_refused_before_training(case, docs, tmp_path):
    from tests.integration.megatron_runs import tiny_args

    args, env = tiny_args(), {}
    if case == "seq-too-long":
        args = tiny_args(seq_length=60000)
        expected = "--seq-length 60000 is longer than the cluster can hold"
    elif case == "world-not-whole-nodes":
        args, env = tiny_args(gbs=6), {"WORLD_SIZE": "3", "RANK": "0"}
        expected = "world size 3 is not a multiple of the 2 ranks per node"
    elif case == "profile-version":
        args += ["--flexsp-profile", _bad_profile(tmp_path, version=7)]
        expected = "unknown version 7"
    elif case == "profile-missing-key":
        args += ["--flexsp-profile", _bad_profile(tmp_path, alltoall={"intra_node": []})]
        expected = "inter_node"
    elif case == "profile-other-model":
        prof = _bad_profile(tmp_path, models={"gpt-2x64-4h": {
            "shape": {"num_layers": 12, "hidden_size": 64, "num_heads": 4},
            "a_attn_ms_per_token2": 1e-5, "a_lin_ms_per_token": 0.1, "group_overhead_ms": 1.0,
            "activation_bytes_per_token": 8704.0}})
        args += ["--flexsp-profile", prof]
        expected = "this profile is for another model"
    else:  # 3 heads: only groups of 1, too small for an 8192-token document
        args = [a if a != "4" or args[i - 1] != "--num-attention-heads" else "3"
                for i, a in enumerate(tiny_args(seq_length=8192))]
        args = [a if a != "64" or args[i - 1] != "--hidden-size" else "48" for i, a in enumerate(args)]
        expected = "group sizes must divide num_heads=3"
    out = _run(["--flexsp", *args, "--train-iters", "1", "--data-path", str(docs)], tmp_path, **env)
    assert out.returncode != 0
    assert expected in out.stderr, out.stderr[-3000:]


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


@pytest.mark.parametrize("code, status, stderr", [(None, 0, ""), (0, 0, ""), (3, 3, ""),
                                                  ("'stopped: disk full'", 1, "stopped: disk full")])
def test_the_script_leaves_as_system_exit_would_after_the_exit_handlers(code, status, stderr, tmp_path):
    """``_leave`` (the end of every run of the script) skips the interpreter's finalization, so it
    must keep what that would have done for the user: the exit status SystemExit gives (a message
    printed, status 1), the atexit handlers (here one writing a file after buffered output)."""
    program = (f"import atexit, pathlib, sys\n"
               f"sys.path.insert(0, {str(ROOT)!r})\n"
               f"from pretrain_gpt_flexsp import _leave\n"
               f"atexit.register(lambda: pathlib.Path('handler_ran').write_text('yes'))\n"
               f"print('buffered', end='')\n"
               f"_leave({code})\n"
               f"print('never')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered
    proc = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == status
    assert proc.stdout == "buffered"
    assert proc.stderr.strip() == stderr
    assert (tmp_path / "handler_ran").read_text() == "yes"
