"""Fitting measured times into a profile the planner loads."""

import json

import numpy as np
import pytest

from megatron_flexsp.cost_model import CostModel
from megatron_flexsp.cost_model.calibrate import fit_alltoall, fit_compute, measured_profile
from megatron_flexsp.cost_model.profile import PROFILE_DIR, parse_profile
from megatron_flexsp.model_spec import ModelSpec


def test_compute_fit_recovers_coefficients_and_error():
    s = np.array([64, 128, 256, 512, 1024, 2048, 4096])
    y = 3.0 + 0.01 * s + 2e-6 * s * s
    fit = fit_compute(s, y)
    assert fit.overhead_ms == pytest.approx(3.0, rel=1e-6)
    assert fit.a_lin_ms_per_token == pytest.approx(0.01, rel=1e-6)
    assert fit.a_attn_ms_per_token2 == pytest.approx(2e-6, rel=1e-6)
    assert fit.rel_err < 1e-9
    noisy = fit_compute(s, y * (1 + 0.05 * np.resize([1, -1], len(s))))
    assert 0.01 < noisy.rel_err < 0.1


def test_compute_fit_never_negative():
    s = np.array([100, 200, 400, 800])
    fit = fit_compute(s, 0.5 * s - 1e-5 * s * s + 1.0)  # concave: the quadratic term is dropped
    assert min(fit.overhead_ms, fit.a_lin_ms_per_token, fit.a_attn_ms_per_token2) >= 0


def test_alltoall_fit_and_bad_input():
    b = np.array([4096, 32768, 262144, 1048576])
    y = 0.2 + b / (5.0 * 2 ** 20)
    f = fit_alltoall(2, b, y)
    assert f.latency_ms == pytest.approx(0.2, rel=1e-6)
    assert f.bandwidth_mib_per_ms == pytest.approx(5.0, rel=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        fit_alltoall(2, [1], [1.0])
    with pytest.raises(ValueError, match="positive"):
        fit_compute([1, 2, 3], [1.0, 0.0, 2.0])


def test_measured_profile_is_loadable_and_plans():
    base = json.loads((PROFILE_DIR / "cpu-gloo-demo.json").read_text())
    s = np.array([64, 256, 1024, 4096])
    cfit = fit_compute(s, 2.0 + 0.1 * s + 1e-5 * s * s)
    afits = [fit_alltoall(d, [4096, 65536], [0.5 * d, 0.5 * d + 1.0]) for d in (2, 4)]
    shape = {"num_layers": 2, "hidden_size": 64, "num_heads": 4}
    data = measured_profile(base, hardware="test-cpu", gpus_per_node=2, model_name="gpt-2x64-4h",
                            shape=shape, compute=cfit, alltoall=afits, activation_bytes_per_token=9000.0,
                            num_layers=2, source="unit test")
    prof = parse_profile(data, "measured")
    assert not prof.estimated and [p.group_size for p in prof.inter_node] == [4]
    cm = CostModel.from_profile(prof, ModelSpec("gpt-2x64-4h", 2, 64, 4, ffn_hidden_size=256, vocab_size=384,
                                          dtype_bytes=4, swiglu=True), num_gpus=4,
                                max_seq_len=4096)
    assert cm.coeffs.source == "profile"
    assert cm.group_time_ms([1000], 1) == pytest.approx(2.0 + 0.1 * 1000 + 1e-5 * 1e6, rel=1e-9)


def test_group_excess_and_dispatch_fold_in():
    from megatron_flexsp.cost_model.calibrate import ComputeFit, fit_group_excess, with_dispatch
    sent = np.array([1e4, 1e5, 1e6, 4e6])
    excess = 8 * 0.5 + sent / (2.0 * 2 ** 20)  # 8 calls of 0.5 ms + 2 MiB/ms
    f = fit_group_excess(4, sent, excess, calls=8)
    assert f.latency_ms == pytest.approx(0.5, rel=1e-6)
    assert f.bandwidth_mib_per_ms == pytest.approx(2.0, rel=1e-6)
    with pytest.raises(ValueError, match="calls=0"):
        fit_group_excess(4, sent, excess, calls=0)
    base = ComputeFit(1.0, 0.01, 1e-6, 0.02)
    out, fixed, rate = with_dispatch(base, [64, 1024, 4096], [2.0 + 64e-4, 2.0 + 1024e-4, 2.0 + 4096e-4])
    assert fixed == pytest.approx(2.0, rel=1e-6) and rate == pytest.approx(1e-4, rel=1e-6)
    assert out.overhead_ms == pytest.approx(3.0) and out.a_lin_ms_per_token == pytest.approx(0.0101)
    assert out.a_attn_ms_per_token2 == base.a_attn_ms_per_token2


def test_training_fit_recovers_scale_and_per_micro_batch_cost():
    from megatron_flexsp.cost_model.calibrate import ComputeFit, fit_training, scaled
    pred = np.array([300.0, 500.0, 800.0, 450.0, 1200.0])
    mbs = np.array([2, 3, 4, 2, 5])
    t = fit_training(pred, mbs, 1.2 * pred + 40.0 * mbs)
    assert t.scale == pytest.approx(1.2, rel=1e-6) and t.per_micro_batch_ms == pytest.approx(40.0, rel=1e-6)
    assert t.rel_err < 1e-9 and t.steps == 5 and t.raw_median_ratio > 1.2
    s = scaled(ComputeFit(2.0, 0.1, 1e-5, 0.03), t)
    assert s.overhead_ms == pytest.approx(2.0 * 1.2 + 40.0) and s.a_lin_ms_per_token == pytest.approx(0.12)
    with pytest.raises(ValueError, match="at least 3 steps"):
        fit_training([1.0], [1], [1.0])
