import copy
import json

import numpy as np
import pytest

from megatron_flexsp.config import PlannerConfig
from megatron_flexsp.cost_model import CostModel, load_profile
from megatron_flexsp.cost_model.profile import PROFILE_DIR, parse_profile
from megatron_flexsp.model_spec import ModelSpec, get_model


def _raw(name="a100-paper"):
    return json.loads((PROFILE_DIR / f"{name}.json").read_text())


def test_reference_mode_reproduces_paper_alltoall_shares():
    cm = CostModel.from_profile(load_profile("a100-paper"), get_model("gpt-7b"), num_gpus=64,
                                max_seq_len=196608, reference_exact=True)
    expected = {(4096, 8): 0.09, (4096, 16): 0.49, (65536, 8): 0.04, (65536, 16): 0.27,
                (393216, 8): 0.01, (393216, 16): 0.08}
    for (s, d), share in expected.items():
        a = cm.alltoall_ms([s], d)[0]
        c = cm.compute_ms([s], d)[0]
        assert a / (a + c) == pytest.approx(share, abs=0.006), (s, d)
    # reference formula: 4*2*L*H*s*2 bytes / d / bandwidth
    s, d = 10000, 16
    ref = 4 * 2 * 32 * 4096 * s * 2 / 2**20 / d / 10.33
    assert cm.alltoall_ms([s], d)[0] == pytest.approx(ref, rel=1e-12)
    assert cm.group_fixed_ms(16) == pytest.approx(629.3563)


#: The reference's own constants (PKU-DAIR/Hetu-Galvatron, flexsp branch): param_size_B is
#: numel / 2**30, act_per_token in MB (2**20 bytes), a 28 GB budget, ZeRO-3 over all GPUs.
REFERENCE = {"gpt-7b": (4.480441895, {196608: 7.1174468994140625, 393216: 7.8498687744140625}),
             "gpt-13b": (4.220439453, {196608: 13.11605453491211, 393216: 14.03158187866211}),
             "gpt-30b": (3.417381836, {196608: 31.52513885498047, 393216: 32.71532440185547})}


def reference_cap(model: str, max_len: int, n: int = 64) -> int:
    """The reference's tokens per GPU, in its own units: (28 * 1024 - states MB) / MB per token."""
    act_mb, params_b = REFERENCE[model]
    states_mb = params_b[max_len] * 16 * (1 / n) * 1024
    return int((28 * 1024 - states_mb) / act_mb)


def test_paper_capacity_matches_reference_budget(paper_cm):
    assert reference_cap("gpt-7b", 196608) == 5992
    assert paper_cm.capacity_tokens == 5992
    assert paper_cm.min_group_size(196608) == 64  # 196608 / 5992 = 32.8 GPUs
    assert paper_cm.min_group_size(32 * paper_cm.capacity_tokens) == 32
    assert paper_cm.min_group_size(10**7) == 0
    for model, (_, by_len) in REFERENCE.items():
        for max_len in by_len:
            cm = CostModel.from_profile(load_profile("a100-paper"), get_model(model), num_gpus=64,
                                        max_seq_len=max_len, reference_exact=True)
            assert cm.capacity_tokens == reference_cap(model, max_len), (model, max_len)


def test_min_group_sizes_of_many_lengths_follow_the_one_length_rule(paper_cm):
    cap = paper_cm.capacity_tokens
    edges = np.array([cap * d + e for d in paper_cm.sizes for e in (-1, 0, 1)])
    lengths = np.concatenate([edges, np.random.default_rng(0).integers(1, 70 * cap, 500), [1, 10**7]])
    # the rule, written out: the first allowed size (ascending) whose memory holds the length
    expected = [next((d for d in sorted(paper_cm.sizes) if n <= cap * d), 0) for n in lengths.tolist()]
    got = paper_cm.min_group_sizes(lengths)
    assert got.dtype == np.int64 and got.tolist() == expected
    assert [paper_cm.min_group_size(int(n)) for n in lengths[:40]] == expected[:40]


@pytest.mark.parametrize("model,max_len", [("gpt-7b", 196608), ("gpt-13b", 393216), ("gpt-30b", 196608)])
def test_reference_mode_plans_respect_the_reference_cap(wiki_lengths, model, max_len):
    from megatron_flexsp.planner import plan_step

    cm = CostModel.from_profile(load_profile("a100-paper"), get_model(model), num_gpus=64,
                                max_seq_len=max_len, reference_exact=True)
    cap = reference_cap(model, max_len)
    rng = np.random.default_rng(7)
    lens = np.minimum(rng.choice(wiki_lengths, 512), max_len)
    for strategy in ("flexsp", "batchada", "static"):
        plan = plan_step(lens, cm, strategy=strategy, max_seq_len=max_len,
                         config=PlannerConfig(over_length="truncate", time_budget_s=0.5))
        for mb in plan.micro_batches:
            for g in mb.groups:
                tokens = sum(plan.seq_lens[i] for i in g.seqs)
                assert tokens <= cap * g.size, (strategy, g.size, tokens, cap * g.size)


def test_flexsp_mode_has_latency_and_d_minus_1_factor():
    cm = CostModel.from_profile(load_profile("h200-estimate"), get_model("gpt-7b"), num_gpus=64,
                                max_seq_len=131072)
    assert cm.coeffs.source == "analytic"
    assert cm.group_fixed_ms(16) > cm.group_fixed_ms(2) > cm.group_fixed_ms(1)
    b2 = cm.alltoall_bytes([1000], 2)[0]
    b4 = cm.alltoall_bytes([1000], 4)[0]
    assert b2 / b4 == pytest.approx((1 / 2 * 1 / 2) / (1 / 4 * 3 / 4))
    assert cm.alltoall_ms([1000], 1)[0] == 0.0
    t = cm.seq_time_ms(np.array([100, 1000, 10000]), 8)
    assert np.all(np.diff(t) > 0)


def test_gqa_alltoall_and_kv_replication():
    prof = load_profile("h200-estimate")
    llama = get_model("llama3-8b")
    cm = CostModel.from_profile(prof, llama, num_gpus=64, max_seq_len=8192)
    assert max(cm.sizes) == 8  # capped at the KV-head count
    cm_rep = CostModel.from_profile(prof, llama, num_gpus=64, max_seq_len=8192,
                                    allow_kv_replication=True)
    assert max(cm_rep.sizes) == 32
    # GQA moves less than MHA: k, v are 8/32 as wide as q
    assert cm.alltoall_bytes([1000], 8)[0] == pytest.approx(
        2 * 32 * (2 * 4096 + 2 * 1024) * 2 * (1000 / 8) * 7 / 8)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("gpus_per_node"), "missing key 'gpus_per_node'"),
    (lambda d: d.__setitem__("version", 99), "unknown version 99"),
    (lambda d: d["alltoall"]["intra_node"][0].__setitem__("bandwidth_mib_per_ms", -5.0),
     "bandwidth_mib_per_ms=-5.0 must be > 0"),
    (lambda d: d.__setitem__("format", "other"), "format='other'"),
    (lambda d: d["alltoall"]["inter_node"][0].__setitem__("group_size", 4), "fits in one node"),
    (lambda d: d.__setitem__("memory_reserve_bytes", 1e12), "leaves no memory"),
])
def test_profile_validation_errors(mutate, message):
    data = copy.deepcopy(_raw())
    mutate(data)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_profile(data, "bad")


def test_unknown_profile_name_lists_shipped():
    with pytest.raises(ValueError, match="a100-paper"):
        load_profile("no-such-profile")


def test_profile_for_another_model_is_refused():
    prof = load_profile("a100-paper")
    other = ModelSpec("gpt-7b", 24, 4096, 64)  # same name, other shape
    with pytest.raises(ValueError, match="another model"):
        CostModel.from_profile(prof, other, num_gpus=64, max_seq_len=196608)
    with pytest.raises(ValueError, match="not for model 'llama3-8b'"):
        CostModel.from_profile(prof, get_model("llama3-8b"), num_gpus=64, max_seq_len=8192,
                               reference_exact=True)


def test_gpus_per_node_mismatch_and_states_overflow():
    prof = load_profile("a100-paper")
    from megatron_flexsp.topology import ClusterSpec
    from megatron_flexsp.cost_model.model import profile_coefficients

    coeffs = profile_coefficients(get_model("gpt-7b"), prof, 196608)
    with pytest.raises(ValueError, match="gpus_per_node=4"):
        CostModel(profile=prof, model=get_model("gpt-7b"), coeffs=coeffs, cluster=ClusterSpec(64, 4))
    with pytest.raises(ValueError, match="above the memory budget"):
        CostModel.from_profile(prof, get_model("gpt-30b"), num_gpus=8, max_seq_len=196608)


def test_analytic_coefficients_close_to_paper_constants():
    from megatron_flexsp.cost_model.model import analytic_coefficients

    prof = load_profile("a100-paper")
    c = analytic_coefficients(get_model("gpt-7b"), prof, 196608)
    # the formula, spelled out: forward+backward = 3 x 2 FLOPs per multiply-add; GPT-7B has
    # 32 layers of 4h^2 (attention) + 2 x h x 4h (MLP) and a 50257 x 4096 output layer
    L, h, vocab = 32, 4096, 50257
    flops_per_ms = 312.0 * 1e9
    assert c.a_lin_ms_per_token == pytest.approx(
        6 * (L * (4 * h * h + 8 * h * h) + vocab * h) / (flops_per_ms * 0.70), rel=1e-12)
    assert c.a_attn_ms_per_token2 == pytest.approx(6 * L * h / (flops_per_ms * 0.49), rel=1e-12)
    # and the paper's measured constants are within a few percent of it
    assert c.a_attn_ms_per_token2 == pytest.approx(5.128e-6, rel=0.05)
    assert c.a_lin_ms_per_token == pytest.approx(0.184, rel=0.02)
    assert c.activation_bytes_per_token == pytest.approx(4.4804 * 2**20, rel=0.06)
