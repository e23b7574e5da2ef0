"""The shipped GPU configuration parses with Megatron's parser, passes our checks and plans."""

import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _file_args(path: Path) -> list[str]:
    text = "\n".join(line.split("#", 1)[0] for line in path.read_text().splitlines())
    return shlex.split(text)


def _parsed(name: str, monkeypatch, *extra: str):
    """Megatron's parse of a shipped argument file (plus ``extra``), as the launchers pass it."""
    from megatron.training.arguments import parse_args

    from megatron_flexsp.integration.args import add_flexsp_args

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt_flexsp.py", *_file_args(ROOT / "configs" / name),
                                     *extra, "--dataloader-type", "external"])
    return parse_args(add_flexsp_args)


def test_gpt7b_64gpu_config_parses_and_fits(monkeypatch):
    pytest.importorskip("megatron.training")
    import numpy as np

    from megatron_flexsp.cost_model import CostModel, load_profile
    from megatron_flexsp.integration.args import load_settings
    from megatron_flexsp.integration.checks import check_megatron_args
    from megatron_flexsp.integration.driver import model_spec_from_args
    from megatron_flexsp.planner import plan_step

    args = _parsed("gpt7b_64gpu_192k.args", monkeypatch, "--data-path", "x")
    args.padded_vocab_size = 50304
    assert args.flexsp and args.seq_length == 196608
    # a GPU cluster with Transformer Engine and without apex: the config asks for nothing missing
    check_megatron_args(args, {"apex_gradient_fusion": False, "transformer_engine": True})
    with pytest.raises(ValueError, match="--transformer-impl local") as err:  # no TE: refused by name
        check_megatron_args(args, {"apex_gradient_fusion": False, "transformer_engine": False})
    assert "--no-rope-fusion" in str(err.value)
    settings = load_settings(args.flexsp_config)
    assert settings.runtime.attention_backend == "flash"
    cm = CostModel.from_profile(load_profile(args.flexsp_profile), model_spec_from_args(args),
                                num_gpus=64, max_seq_len=args.seq_length)
    assert cm.max_tokens >= args.seq_length
    lens = np.random.default_rng(0).integers(100, args.seq_length, size=64)
    plan = plan_step(lens, cm, strategy="batchada", max_seq_len=args.seq_length)  # fast; flexsp: bench
    assert plan.num_gpus == 64


def test_llama3_70b_64_h200_config_plans_with_tensor_parallelism(monkeypatch):
    pytest.importorskip("megatron.training")
    import numpy as np

    from megatron_flexsp.config import PlannerConfig
    from megatron_flexsp.integration.args import load_settings
    from megatron_flexsp.integration.checks import check_megatron_args
    from megatron_flexsp.integration.planning import build_cost_model
    from megatron_flexsp.planner import plan_step
    from megatron_flexsp.sim import simulate

    args = _parsed("llama3_70b_64h200_1m.args", monkeypatch, "--data-path", "x")
    args.padded_vocab_size, args.world_size = 128256, 64
    assert args.tensor_model_parallel_size == 8 and args.sequence_parallel
    check_megatron_args(args, {"apex_gradient_fusion": False, "transformer_engine": True})
    settings = load_settings(args.flexsp_config)
    cm = build_cost_model(args, settings, on_cpu=False)  # refuses when 1M tokens do not fit
    assert cm.cluster.num_gpus == 8 and cm.parallel.recompute == "full" and cm.model.num_kv_heads == 8
    assert cm.sizes == [1, 2, 4, 8] and cm.max_tokens >= args.seq_length
    lens = np.minimum(np.random.default_rng(0).lognormal(9.0, 1.8, 256).astype(int) + 64, args.seq_length)
    lens[0] = args.seq_length
    plan = plan_step(lens, cm, config=PlannerConfig(time_budget_s=0.5, over_length="truncate"),
                     max_seq_len=args.seq_length)
    assert plan.tensor_parallel == 8 and simulate(plan, cm).memory_ok


def test_llama_style_pretraining_script_passes_the_checks(monkeypatch):
    """The Llama-style script (blend, split, eval, ramp, TensorBoard) asks for nothing refused;
    tests/integration/test_launch_parity.py runs it shrunk to the demo model."""
    pytest.importorskip("megatron.training")
    from megatron_flexsp.integration.checks import check_megatron_args

    args = _parsed("llama3_8b_pretrain_flexsp.args", monkeypatch)
    assert args.data_path == ["0.7", "/data/web_text_document", "0.3", "/data/code_text_document"]
    assert args.split == "98,1,1" and args.step_batch_size_schedule == "0:256 100B:512"
    assert args.eval_iters == 10 and args.tensorboard_dir and args.exit_signal_handler and args.flexsp
    check_megatron_args(args, {"apex_gradient_fusion": False, "transformer_engine": True})


@pytest.mark.parametrize("script", ["scripts/launch_local.sh", "scripts/slurm/train_flexsp.sbatch",
                                    "scripts/demo_cpu.sh", "scripts/tiny_gpt_args.sh",
                                    "scripts/slurm/profile.sbatch", "scripts/gpu_check.sh"])
def test_launchers_are_valid_bash(script):
    out = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
