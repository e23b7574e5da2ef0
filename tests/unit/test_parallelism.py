"""Tensor parallelism in the cost model and planner: devices of TP GPUs, every term checked against
numbers written out here from the formulas (Korthikanti et al. 2022 for activations)."""

import numpy as np
import pytest

from megatron_flexsp.config import PlannerConfig
from megatron_flexsp.cost_model import CostModel, load_profile
from megatron_flexsp.model_spec import ModelSpec, get_model
from megatron_flexsp.parallelism import Parallelism
from megatron_flexsp.plan import StepPlan, validate_plan
from megatron_flexsp.planner import plan_step
from megatron_flexsp.sim import simulate

H200 = load_profile("h200-estimate")
A100 = load_profile("a100-80g-estimate")


def _cm(model="llama3-8b", n=64, profile=H200, **par):
    return CostModel.from_profile(profile, get_model(model), num_gpus=n, max_seq_len=1 << 20,
                                  allow_kv_replication=par.pop("kv", False), parallel=Parallelism(**par))


@pytest.mark.parametrize("name,published", [("llama3-8b", 8.03e9), ("llama2-13b", 13.0e9),
                                            ("codellama-34b", 33.7e9), ("llama3-70b", 70.6e9)])
def test_llama_presets_have_their_published_parameter_counts(name, published):
    assert abs(get_model(name).param_count() / published - 1) < 0.01


def test_devices_are_tp_groups_and_sizes_are_capped_by_heads_per_tp():
    base, tp4 = _cm(), _cm(tp=4, sequence_parallel=True)
    assert (tp4.cluster.num_gpus, tp4.cluster.gpus_per_node, tp4.num_gpus) == (16, 2, 64)
    assert base.sizes == [1, 2, 4, 8]  # 8 KV heads cap Ulysses at 8
    assert tp4.sizes == [1, 2]  # 8 KV heads / tp 4 = 2 per rank
    with_rep = _cm(tp=4, sequence_parallel=True, kv=True)
    assert with_rep.sizes == [1, 2, 4, 8]  # 32 heads / 4 = 8 query heads per rank
    assert _cm("llama2-13b", tp=8).sizes == [1]  # 40 heads / 8 = 5: no Ulysses group is possible


def test_tp_splits_compute_alltoall_and_states_and_adds_its_collectives():
    m = get_model("llama3-8b")
    one, two = _cm(), _cm(tp=2)
    s = np.array([4096.0, 32768.0])
    # compute: half per GPU, same coefficients
    assert np.allclose(two.compute_ms(s, 2), one.compute_ms(s, 2) / 2, rtol=1e-12)
    # Ulysses bytes: each GPU sends its own heads (q, out: h/2; k, v: kv/2), forward and backward
    elems = (2 * m.hidden_size + 2 * m.kv_hidden_size) / 2
    want = 2 * m.num_layers * elems * 2 * (s / 4) * 3 / 4
    assert np.allclose(two.alltoall_bytes(s, 4), want, rtol=1e-12)
    # TP collectives: four exchanges of 2(t-1)/t of the device's s/d tokens per layer
    want_tp = 4 * m.num_layers * 2 * 0.5 * (s / 4) * m.hidden_size * 2
    assert np.allclose(two.tensor_parallel_bytes(s, 4), want_tp, rtol=1e-12)
    tp_bw = H200.tensor_parallel[0].bandwidth_mib_per_ms
    assert np.allclose(two.tensor_parallel_ms(s, 4), want_tp / (tp_bw * 2**20), rtol=1e-12)
    assert np.allclose(two.seq_time_ms(s, 4), two.compute_ms(s, 4) + two.alltoall_ms(s, 4)
                       + two.tensor_parallel_ms(s, 4), rtol=1e-12)
    assert not np.any(one.tensor_parallel_bytes(s, 4))
    # a group of 4 devices of 2 spans 8 GPUs: the intra-node table at 8
    assert two._bw[4] == H200.intra_node[2].bandwidth_mib_per_ms
    # states: 6 B/param split by TP, 12 B/param over all 64 GPUs
    p = m.param_count()
    assert two.state_bytes_per_gpu == pytest.approx(p * (6 / 2 + 12 / 64), rel=1e-12)


def test_activation_memory_follows_korthikanti():
    full = _cm().activation_bytes_per_token
    assert _cm(tp=4).activation_bytes_per_token == pytest.approx(full * (10 + 24 / 4) / 34)
    assert _cm(tp=4, sequence_parallel=True).activation_bytes_per_token == pytest.approx(full / 4)
    m = get_model("llama3-8b")
    rec = _cm(tp=4, sequence_parallel=True, recompute="full")
    # every layer keeps its input (h bf16 values, split by SP) plus one layer recomputed at a time
    assert rec.activation_bytes_per_token == pytest.approx(
        m.num_layers * m.hidden_size * 2 / 4 + full / 4 / m.num_layers)
    # full recomputation runs the forward twice: 4/3 of the compute
    s = np.array([8192.0])
    assert rec.compute_ms(s, 1)[0] == pytest.approx(_cm(tp=4, sequence_parallel=True).compute_ms(s, 1)[0] * 4 / 3)
    assert rec.capacity_tokens > 5 * _cm(tp=4, sequence_parallel=True).capacity_tokens


def test_bad_parallel_settings_name_the_value():
    with pytest.raises(ValueError, match="power of two"):
        Parallelism(tp=3)
    with pytest.raises(ValueError, match="needs tensor parallelism"):
        Parallelism(sequence_parallel=True)
    with pytest.raises(ValueError, match="recompute='some'"):
        Parallelism(recompute="some")
    with pytest.raises(ValueError, match="must divide num_heads=12"):
        CostModel.from_profile(H200, ModelSpec("odd", 2, 768, 12), num_gpus=64, max_seq_len=4096,
                               parallel=Parallelism(tp=8))
    with pytest.raises(ValueError, match="tensor parallelism must stay inside a node"):
        CostModel.from_profile(H200, get_model("llama3-70b"), num_gpus=64, max_seq_len=4096,
                               parallel=Parallelism(tp=16))
    with pytest.raises(ValueError, match="model states need .* tp=2"):
        _cm("llama3-70b", tp=2)


def _long_batch(max_len: int, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lens = np.minimum(rng.lognormal(8.5, 1.6, n).astype(int) + 64, max_len)
    lens[0] = max_len
    return lens


@pytest.mark.parametrize("model,profile,n,tp,max_len", [
    ("llama3-70b", H200, 64, 8, 1 << 20), ("llama3-70b", A100, 64, 8, 192 << 10),
    ("codellama-34b", A100, 64, 8, 1 << 20), ("llama2-13b", H200, 64, 2, 1 << 20)])
def test_large_models_plan_at_long_lengths_with_tp(model, profile, n, tp, max_len):
    cm = CostModel.from_profile(profile, get_model(model), num_gpus=n, max_seq_len=max_len,
                                allow_kv_replication=True,
                                parallel=Parallelism(tp, True, "full"))
    lens = _long_batch(max_len, 64)
    plan = plan_step(lens, cm, strategy="flexsp", config=PlannerConfig(time_budget_s=0.5),
                     max_seq_len=max_len)
    validate_plan(plan)
    assert plan.tensor_parallel == tp and plan.num_gpus == n // tp
    again = StepPlan.from_json(plan.to_json())
    assert again.tensor_parallel == tp and again == plan
    res = simulate(plan, cm)
    assert res.memory_ok, res
    static = plan_step(lens, cm, strategy="static", max_seq_len=max_len)
    assert plan.predicted_step_ms <= static.predicted_step_ms * 1.0001
