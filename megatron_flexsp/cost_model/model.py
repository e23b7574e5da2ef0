"""Time and memory of sequences on sequence-parallel (Ulysses) groups.

For a sequence of ``s`` tokens on a group of ``d`` GPUs (times in ms, per GPU of the group):

* compute: ``(a_attn * s**2 + a_lin * s) / d``;
* all-to-all: bytes each GPU sends for this model shape -- q, k, v and the attention output, forward
  and backward, for every layer, ``(s/d) * (d-1)/d`` tokens' worth -- over the per-device bandwidth of
  a group of ``d`` (inside one node or across nodes); 0 for ``d == 1``;
* per group and micro-batch: a fixed overhead ``group_overhead_ms`` plus the latency of each
  all-to-all call (``4 * num_layers`` calls: fused qkv and out, forward and backward).

Memory per GPU: model and optimizer states (``replicated + sharded / num_gpus`` bytes per parameter,
the distributed optimizer shards over all GPUs) plus ``activation_bytes_per_token * tokens / d``, within
the device memory minus a reserve.

``reference_exact=True`` reproduces the FlexSP reference code's model instead: all-to-all bytes
``4*2*L*H*s*2/d`` (no ``(d-1)/d``, K/V as wide as Q), no latency term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_flexsp.cost_model.profile import AllToAllPoint, Profile
from megatron_flexsp.model_spec import ModelSpec
from megatron_flexsp.topology import ClusterSpec, candidate_group_sizes
from megatron_flexsp.utils.logging import get_logger

log = get_logger(__name__)
MIB = float(2 ** 20)


@dataclass(frozen=True)
class ModelCoefficients:
    """Per-model cost coefficients (ms, bytes); ``source`` says where they came from."""

    a_attn_ms_per_token2: float
    a_lin_ms_per_token: float
    group_overhead_ms: float
    activation_bytes_per_token: float
    num_params: float
    source: str


def analytic_coefficients(model: ModelSpec, profile: Profile, max_seq_len: int) -> ModelCoefficients:
    """Coefficients from the model shape and the profile's peak FLOP/s and stated efficiencies.

    Activation memory per token is ``34 * hidden * layers`` bytes at bf16 (Korthikanti et al. with
    flash attention, no recomputation), scaled by ``dtype_bytes / 2``.
    """
    flops_per_ms = profile.peak_tflops * 1e9  # TFLOP/s -> FLOP/ms
    return ModelCoefficients(
        a_attn_ms_per_token2=model.attention_flops_per_token2() / (flops_per_ms * profile.efficiency_attention),
        a_lin_ms_per_token=model.linear_flops_per_token() / (flops_per_ms * profile.efficiency_linear),
        group_overhead_ms=profile.group_overhead_ms_per_layer * model.num_layers,
        activation_bytes_per_token=34.0 * model.hidden_size * model.num_layers * model.dtype_bytes / 2,
        num_params=model.param_count(max_seq_len), source="analytic")


def profile_coefficients(model: ModelSpec, profile: Profile, max_seq_len: int) -> ModelCoefficients:
    """Coefficients stored in the profile for ``model.name``; the stored shape must match ``model``."""
    entry = profile.models[model.name]
    shape = entry["shape"]
    for key in ("num_layers", "hidden_size", "num_heads"):
        if key in shape and shape[key] != getattr(model, key):
            raise ValueError(f"profile {profile.name!r} was measured for {model.name} with {key}="
                             f"{shape[key]}, but the model has {key}={getattr(model, key)}: "
                             f"this profile is for another model")
    params = model.param_count(max_seq_len)
    table = entry.get("num_params_by_max_seq_len")
    if table:
        keys = sorted(int(k) for k in table)
        fitting = [k for k in keys if k >= max_seq_len] or [keys[-1]]
        params = float(table[str(fitting[0])])
    return ModelCoefficients(float(entry["a_attn_ms_per_token2"]), float(entry["a_lin_ms_per_token"]),
                             float(entry["group_overhead_ms"]),
                             float(entry["activation_bytes_per_token"]), params, "profile")


def _interp(points: tuple[AllToAllPoint, ...], size: int, attr: str) -> float:
    """Geometric interpolation in log2(group size) between measured points; flat outside."""
    xs = [math.log2(p.group_size) for p in points]
    ys = [getattr(p, attr) for p in points]
    x = math.log2(size)
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    k = next(i for i in range(1, len(xs)) if xs[i] >= x)
    w = (x - xs[k - 1]) / (xs[k] - xs[k - 1])
    if ys[k - 1] > 0 and ys[k] > 0:
        return math.exp((1 - w) * math.log(ys[k - 1]) + w * math.log(ys[k]))
    return (1 - w) * ys[k - 1] + w * ys[k]


class CostModel:
    """Predicts time (ms) and memory (bytes) of sequences on groups of a given cluster.

    Built with :meth:`from_profile`. All length arguments are token counts; array arguments are
    1-D ``numpy`` arrays of lengths.
    """

    def __init__(self, *, profile: Profile, model: ModelSpec, coeffs: ModelCoefficients,
                 cluster: ClusterSpec, reference_exact: bool = False,
                 allow_kv_replication: bool = False) -> None:
        if cluster.gpus_per_node != profile.gpus_per_node:
            raise ValueError(f"profile {profile.name!r} describes nodes of {profile.gpus_per_node} "
                             f"GPUs, but the cluster has gpus_per_node={cluster.gpus_per_node}")
        self.profile, self.model, self.coeffs, self.cluster = profile, model, coeffs, cluster
        self.reference_exact = reference_exact
        self.allow_kv_replication = allow_kv_replication
        self.sizes = candidate_group_sizes(cluster, num_heads=model.num_heads,
                                           num_kv_heads=model.num_kv_heads,
                                           allow_kv_replication=allow_kv_replication)
        self._bw = {d: self._bandwidth(d) for d in self.sizes}
        self._lat = {d: self._latency(d) for d in self.sizes}
        states = self.state_bytes_per_gpu
        if states >= profile.memory_budget_bytes:
            raise ValueError(f"model states need {states / 2**30:.1f} GiB per GPU at num_gpus="
                             f"{cluster.num_gpus}, above the memory budget "
                             f"{profile.memory_budget_bytes / 2**30:.1f} GiB of profile {profile.name!r}")
        self.capacity_tokens = int((profile.memory_budget_bytes - states)
                                   // coeffs.activation_bytes_per_token)

    @classmethod
    def from_profile(cls, profile: Profile, model: ModelSpec, *, num_gpus: int, max_seq_len: int,
                     reference_exact: bool = False, allow_analytic: bool = True,
                     allow_kv_replication: bool = False) -> "CostModel":
        """Cost model of ``model`` on ``num_gpus`` GPUs of the profiled hardware.

        Uses the profile's measured coefficients for ``model.name`` when present; otherwise derives
        them from the shape (:func:`analytic_coefficients`) unless ``allow_analytic`` is false or
        ``reference_exact`` is requested (which needs the reference's own constants).
        """
        cluster = ClusterSpec(num_gpus, profile.gpus_per_node)
        if model.name in profile.models:
            coeffs = profile_coefficients(model, profile, max_seq_len)
        elif reference_exact or not allow_analytic:
            raise ValueError(f"profile {profile.name!r} has coefficients for "
                             f"{sorted(profile.models)}, not for model {model.name!r}")
        else:
            log.info("profile %s has no coefficients for %s: deriving them from the model shape "
                     "(%.0f%% attention, %.0f%% GEMM efficiency)", profile.name, model.name,
                     100 * profile.efficiency_attention, 100 * profile.efficiency_linear)
            coeffs = analytic_coefficients(model, profile, max_seq_len)
        return cls(profile=profile, model=model, coeffs=coeffs, cluster=cluster,
                   reference_exact=reference_exact, allow_kv_replication=allow_kv_replication)

    # ----------------------------------------------------------------------------- hardware
    def _bandwidth(self, d: int) -> float:
        if d == 1:
            return math.inf
        points = self.profile.intra_node if self.cluster.is_intra_node(d) else self.profile.inter_node
        if not points:  # fall back to the other table rather than invent a number
            points = self.profile.inter_node or self.profile.intra_node
        return _interp(points, d, "bandwidth_mib_per_ms")

    def _latency(self, d: int) -> float:
        if d == 1 or self.reference_exact:
            return 0.0
        points = self.profile.intra_node if self.cluster.is_intra_node(d) else self.profile.inter_node
        points = points or self.profile.inter_node or self.profile.intra_node
        return _interp(points, d, "latency_ms")

    # ----------------------------------------------------------------------------- time
    def _check_size(self, d: int) -> None:
        if d not in self._bw:
            raise ValueError(f"group size {d} is not allowed for {self.model.name} on "
                             f"{self.cluster.num_gpus} GPUs (allowed: {self.sizes})")

    def compute_ms(self, lens, d: int) -> np.ndarray:
        """Attention + GEMM time per GPU of sequences ``lens`` on a group of ``d``, shape of ``lens``."""
        s = np.asarray(lens, dtype=np.float64)
        return (self.coeffs.a_attn_ms_per_token2 * s * s + self.coeffs.a_lin_ms_per_token * s) / d

    def alltoall_bytes(self, lens, d: int) -> np.ndarray:
        """Bytes each GPU of a group of ``d`` sends in Ulysses all-to-alls (fwd+bwd, all layers)."""
        s = np.asarray(lens, dtype=np.float64)
        m = self.model
        if d == 1:
            return np.zeros_like(s)
        if self.reference_exact:
            return 4.0 * 2.0 * m.num_layers * m.hidden_size * s * 2.0 / d
        kv_heads = max(m.num_kv_heads, d) if (self.allow_kv_replication and d > m.num_kv_heads) else 0
        elems = m.alltoall_elems_per_token(kv_heads)
        return 2.0 * m.num_layers * elems * m.dtype_bytes * (s / d) * (d - 1) / d

    def alltoall_ms(self, lens, d: int) -> np.ndarray:
        """All-to-all time per GPU of sequences ``lens`` on a group of ``d`` (latency excluded)."""
        if d == 1:
            return np.zeros(np.shape(lens))
        self._check_size(d)
        return self.alltoall_bytes(lens, d) / (self._bw[d] * MIB)

    def seq_time_ms(self, lens, d: int) -> np.ndarray:
        """Time per sequence of ``lens`` on a group of ``d``: compute + all-to-all (ms)."""
        return self.compute_ms(lens, d) + self.alltoall_ms(lens, d)

    def group_fixed_ms(self, d: int) -> float:
        """Time a group of ``d`` pays once per micro-batch: fixed overhead + all-to-all latencies."""
        self._check_size(d)
        return self.coeffs.group_overhead_ms + 4 * self.model.num_layers * self._lat[d]

    def group_time_ms(self, lens, d: int) -> float:
        """Time of a group of ``d`` running the packed sequences ``lens`` in one micro-batch (ms)."""
        if len(lens) == 0:
            return 0.0
        return self.group_fixed_ms(d) + float(np.sum(self.seq_time_ms(lens, d)))

    # ----------------------------------------------------------------------------- memory
    @property
    def state_bytes_per_gpu(self) -> float:
        """Parameters, gradients and optimizer states per GPU (distributed optimizer over all GPUs)."""
        p = self.profile
        return self.coeffs.num_params * (p.state_bytes_replicated
                                         + p.state_bytes_sharded / self.cluster.num_gpus)

    def memory_bytes(self, tokens: float, d: int) -> float:
        """Peak memory per GPU of a group of ``d`` holding ``tokens`` tokens in one micro-batch."""
        return self.state_bytes_per_gpu + self.coeffs.activation_bytes_per_token * tokens / d

    def group_capacity_tokens(self, d: int) -> int:
        """Most tokens a group of ``d`` GPUs can hold in one micro-batch."""
        return self.capacity_tokens * d

    def min_group_size(self, length: int) -> int:
        """Smallest allowed group size whose memory holds one sequence of ``length`` (0 if none)."""
        for d in self.sizes:
            if length <= self.capacity_tokens * d:
                return d
        return 0

    @property
    def max_tokens(self) -> int:
        """Longest sequence the cluster can hold: capacity of the largest allowed group."""
        return self.capacity_tokens * self.sizes[-1]

    def describe(self) -> dict:
        """Summary for logs and JSON outputs."""
        c = self.coeffs
        return {"profile": self.profile.name, "hardware": self.profile.hardware,
                "estimated": self.profile.estimated, "model": self.model.name,
                "coefficients_source": c.source, "reference_exact": self.reference_exact,
                "a_attn_ms_per_token2": c.a_attn_ms_per_token2, "a_lin_ms_per_token": c.a_lin_ms_per_token,
                "group_overhead_ms": c.group_overhead_ms, "num_params": c.num_params,
                "capacity_tokens_per_gpu": self.capacity_tokens, "group_sizes": self.sizes}
