"""A tiny, hand-checkable cost model for planner tests (no files needed)."""

from megatron_flexsp.cost_model import CostModel
from megatron_flexsp.cost_model.profile import parse_profile
from megatron_flexsp.model_spec import ModelSpec

TINY_MODEL = ModelSpec("toy", 2, 64, 8, vocab_size=128)


def tiny_cost_model(num_gpus: int = 4, gpus_per_node: int = 2, capacity_tokens: int = 100,
                    overhead_ms: float = 5.0) -> CostModel:
    """Cost model where one GPU holds ``capacity_tokens`` tokens and every group pays ``overhead_ms``."""
    act = 1000.0
    data = {
        "format": "megatron-flexsp-profile", "version": 1, "hardware": "toy",
        "gpus_per_node": gpus_per_node, "device_memory_bytes": act * capacity_tokens + 1.0,
        "memory_reserve_bytes": 0, "peak_tflops": 1.0,
        "efficiency": {"attention": 1.0, "linear": 1.0},
        "state_bytes_per_param": {"replicated": 0, "sharded": 0},
        "group_overhead_ms_per_layer": 0.0,
        "alltoall": {"intra_node": [{"group_size": 2, "bandwidth_mib_per_ms": 0.05, "latency_ms": 0.01}],
                     "inter_node": [{"group_size": 2 * gpus_per_node, "bandwidth_mib_per_ms": 0.01,
                                     "latency_ms": 0.05}]},
        "models": {"toy": {"shape": {"num_layers": 2, "hidden_size": 64, "num_heads": 8},
                           "a_attn_ms_per_token2": 2e-4, "a_lin_ms_per_token": 0.05,
                           "group_overhead_ms": overhead_ms, "activation_bytes_per_token": act,
                           "num_params": 1000}},
    }
    return CostModel.from_profile(parse_profile(data, "toy"), TINY_MODEL, num_gpus=num_gpus,
                                  max_seq_len=10_000)
