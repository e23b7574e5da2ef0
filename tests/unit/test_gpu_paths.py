"""What of the GPU paths can be checked on the host: devices of collectives, memory-capped profiling,
worker environments, the dataset-helper patch and the refusals of options whose kernels are absent."""

import os
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")


def test_collectives_use_the_gpu_under_nccl(monkeypatch):
    import torch.distributed as dist

    from megatron_flexsp.runtime import device as D

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert D.comm_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert D.comm_device() == torch.device("cuda", 3)
    D.synchronize("cpu")  # a no-op on the host


def test_profile_lengths_are_capped_by_memory(monkeypatch):
    from megatron_flexsp.runtime import profiler as P

    lengths = [1024, 2048, 4096, 8192, 16384, 32768]
    assert P.lengths_that_fit(lengths, 1, 5000) == [1024, 2048, 4096]
    assert P.lengths_that_fit(lengths, 4, 5000) == [1024, 2048, 4096, 8192, 16384]
    model = torch.nn.Linear(1000, 1000)  # 1.001e6 parameters: 16 MB of states
    assert P.device_capacity_tokens(model, 1e6, torch.device("cpu")) > 1 << 30  # the host: no limit
    props = SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    cap = P.device_capacity_tokens(model, 1e6, torch.device("cuda", 0))
    assert cap == int((0.9 * 80 * 2**30 - 16 * 1_001_000) // 1e6)


def test_workers_get_the_project_in_front_of_pythonpath():
    from megatron_flexsp.utils.launch import ROOT, worker_env

    env = worker_env("FLAG", base={"PYTHONPATH": os.pathsep.join(["/mine", str(ROOT), "/theirs"])})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/mine", "/theirs"]
    assert env["FLAG"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert worker_env(base={})["PYTHONPATH"] == str(ROOT)
    assert worker_env(base={"OMP_NUM_THREADS": "8"}, X="y")["OMP_NUM_THREADS"] == "8"


def test_dataset_helpers_are_not_rebuilt_when_shipped(monkeypatch):
    pytest.importorskip("megatron.core")
    import importlib.util

    import megatron.core.datasets.utils as utils

    import patches
    from patches.datasets import HELPERS, helpers_patch

    calls = []
    monkeypatch.setattr(utils, "compile_helpers", lambda: calls.append("make"))
    p = helpers_patch()
    patches.apply([p])
    try:
        shipped = importlib.util.find_spec(HELPERS) is not None
        utils.compile_helpers()
        assert calls == ([] if shipped else ["make"])
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # a source install
        utils.compile_helpers()
        assert calls[-1:] == ["make"]
    finally:
        patches.revert([p])


def _args(**kw):
    base = dict(flexsp=True, calculate_per_token_loss=True, dataloader_type="external", micro_batch_size=1,
                transformer_impl="local", gradient_accumulation_fusion=False, apply_rope_fusion=False,
                window_size=None, fp8=None, fp4=None)
    return SimpleNamespace(**dict(base, **kw))


@pytest.mark.parametrize("kw,kernels,needle", [
    (dict(transformer_impl="transformer_engine"), {}, "--transformer-impl local"),
    (dict(gradient_accumulation_fusion=True), {"transformer_engine": True}, "--no-gradient-accumulation-fusion"),
    (dict(apply_rope_fusion=True), {}, "--no-rope-fusion"),
    (dict(window_size=(128, 0)), {}, "--window-size (128, 0)"),
    (dict(fp8="hybrid"), {}, "--fp8-format hybrid"),
    (dict(flexsp=False, transformer_impl="transformer_engine"), {"transformer_engine": True},
     "document-causal mask"),
])
def test_options_whose_kernels_are_missing_are_refused_by_name(kw, kernels, needle):
    from megatron_flexsp.integration.checks import check_megatron_args

    with pytest.raises(ValueError) as err:
        check_megatron_args(_args(**kw), kernels)
    assert needle in str(err.value)
    check_megatron_args(_args(), {})  # the same run without the option passes
    check_megatron_args(_args(transformer_impl="transformer_engine", apply_rope_fusion=True,
                              gradient_accumulation_fusion=True),
                        {"transformer_engine": True, "apex_gradient_fusion": True})
