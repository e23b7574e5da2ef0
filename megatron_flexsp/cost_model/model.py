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

With tensor parallelism (:class:`~megatron_flexsp.parallelism.Parallelism`, ``tp = t``) the model
plans over *devices* of ``t`` GPUs: ``cluster`` has ``num_gpus / t`` devices, ``gpus_per_node / t``
per node, and ``d`` above counts devices. Compute is split by ``t`` (plus recomputation), each GPU
sends ``1/t`` of its device's all-to-all bytes (its heads), looked up at the ``d t`` GPUs the group
spans, and every sequence pays TP's collectives: per layer two all-reduces (or all-gather +
reduce-scatter pairs with sequence parallelism) forward and two backward, ``2 (t-1)/t`` of the
device's ``s/d`` tokens' hidden states each, at the profile's ``tensor_parallel`` bandwidth (or, if
not profiled, its intra-node all-to-all bandwidth of ``t`` GPUs). States are ``replicated / t +
sharded / num_gpus`` bytes per parameter; activations per token follow
:meth:`Parallelism.activation_bytes_per_token`.

``reference_exact=True`` reproduces the FlexSP reference code's model instead: all-to-all bytes
``4*2*L*H*s*2/d`` (no ``(d-1)/d``, K/V as wide as Q), no latency term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_flexsp.cost_model.profile import AllToAllPoint, Profile
from megatron_flexsp.model_spec import ModelSpec
from megatron_flexsp.parallelism import Parallelism
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
                 allow_kv_replication: bool = False, parallel: Parallelism | None = None) -> None:
        parallel = parallel or Parallelism()
        tp = parallel.tp
        if cluster.gpus_per_node * tp != profile.gpus_per_node:
            raise ValueError(f"profile {profile.name!r} describes nodes of {profile.gpus_per_node} "
                             f"GPUs, but the cluster has gpus_per_node={cluster.gpus_per_node} "
                             f"devices of tp={tp}")
        parallel.check_heads(model.num_heads, model.num_kv_heads)
        self.profile, self.model, self.coeffs, self.cluster = profile, model, coeffs, cluster
        self.parallel = parallel
        self.num_gpus = cluster.num_gpus * tp
        self.reference_exact = reference_exact
        self.allow_kv_replication = allow_kv_replication
        self.sizes = candidate_group_sizes(cluster, num_heads=model.num_heads // tp,
                                           num_kv_heads=model.num_kv_heads // tp,
                                           allow_kv_replication=allow_kv_replication)
        self._bw = {d: self._bandwidth(d) for d in self.sizes}
        self._lat = {d: self._latency(d) for d in self.sizes}
        self._tp_bw, self._tp_lat, self.tp_comm_source = self._tensor_parallel_link()
        self._compute_factor = parallel.compute_factor(model.num_layers)
        self._comm_extra = parallel.forward_comm_extra(model.num_layers)
        self.activation_bytes_per_token = parallel.activation_bytes_per_token(
            coeffs.activation_bytes_per_token, num_layers=model.num_layers,
            hidden_size=model.hidden_size, dtype_bytes=model.dtype_bytes)
        states = self.state_bytes_per_gpu
        if states >= profile.memory_budget_bytes:
            raise ValueError(f"model states need {states / 2**30:.1f} GiB per GPU at num_gpus="
                             f"{self.num_gpus} and tp={tp}, above the memory budget "
                             f"{profile.memory_budget_bytes / 2**30:.1f} GiB of profile {profile.name!r}")
        self.capacity_tokens = int((profile.memory_budget_bytes - states)
                                   // self.activation_bytes_per_token)

    @classmethod
    def from_profile(cls, profile: Profile, model: ModelSpec, *, num_gpus: int, max_seq_len: int,
                     reference_exact: bool = False, allow_analytic: bool = True,
                     allow_kv_replication: bool = False,
                     parallel: Parallelism | None = None) -> "CostModel":
        """Cost model of ``model`` on ``num_gpus`` GPUs of the profiled hardware.

        Uses the profile's measured coefficients for ``model.name`` when present (measured without
        tensor parallelism; ``parallel`` scales them); otherwise derives them from the shape
        (:func:`analytic_coefficients`) unless ``allow_analytic`` is false or ``reference_exact`` is
        requested (which needs the reference's own constants). With ``parallel.tp = t`` the cost
        model's ``cluster`` counts devices of ``t`` GPUs.
        """
        parallel = parallel or Parallelism()
        cluster = ClusterSpec(parallel.devices(num_gpus), parallel.devices_per_node(profile.gpus_per_node))
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
                   reference_exact=reference_exact, allow_kv_replication=allow_kv_replication,
                   parallel=parallel)

    # ----------------------------------------------------------------------------- hardware
    def _points(self, d: int) -> tuple[AllToAllPoint, ...]:
        """The all-to-all table for a group of ``d`` devices (``d * tp`` GPUs)."""
        points = self.profile.intra_node if self.cluster.is_intra_node(d) else self.profile.inter_node
        return points or self.profile.inter_node or self.profile.intra_node  # never invent a number

    def _bandwidth(self, d: int) -> float:
        if d == 1:
            return math.inf
        return _interp(self._points(d), d * self.parallel.tp, "bandwidth_mib_per_ms")

    def _latency(self, d: int) -> float:
        if d == 1 or self.reference_exact:
            return 0.0
        return _interp(self._points(d), d * self.parallel.tp, "latency_ms")

    def _tensor_parallel_link(self) -> tuple[float, float, str]:
        """Bandwidth (MiB/ms per GPU) and latency (ms per call) of TP's collectives, and where they
        come from: the profile's ``tensor_parallel`` table, else its intra-node all-to-all."""
        tp = self.parallel.tp
        if tp == 1:
            return math.inf, 0.0, "none"
        if self.profile.tensor_parallel:
            pts, source = self.profile.tensor_parallel, "profiled"
        elif self.profile.intra_node:
            pts, source = self.profile.intra_node, "intra-node all-to-all (not profiled)"
            log.info("profile %s has no tensor_parallel table: TP collectives priced at its "
                     "intra-node all-to-all bandwidth of %d GPUs", self.profile.name, tp)
        else:
            raise ValueError(f"profile {self.profile.name!r} has neither a tensor_parallel nor an "
                             f"intra_node table to price tensor parallelism of size {tp}")
        return (_interp(pts, tp, "bandwidth_mib_per_ms"), _interp(pts, tp, "latency_ms"), source)

    # ----------------------------------------------------------------------------- time
    def _check_size(self, d: int) -> None:
        if d not in self._bw:
            raise ValueError(f"group size {d} is not allowed for {self.model.name} on "
                             f"{self.cluster.num_gpus} GPUs (allowed: {self.sizes})")

    def compute_ms(self, lens, d: int) -> np.ndarray:
        """Attention + GEMM time per GPU of sequences ``lens`` on a group of ``d``, shape of ``lens``."""
        s = np.asarray(lens, dtype=np.float64)
        c = self.coeffs
        return (c.a_attn_ms_per_token2 * s * s + c.a_lin_ms_per_token * s) * (self._compute_factor / d)

    def alltoall_bytes(self, lens, d: int) -> np.ndarray:
        """Bytes each GPU of a group of ``d`` sends in Ulysses all-to-alls (fwd+bwd, all layers)."""
        s = np.asarray(lens, dtype=np.float64)
        m = self.model
        if d == 1:
            return np.zeros_like(s)
        if self.reference_exact:
            return 4.0 * 2.0 * m.num_layers * m.hidden_size * s * 2.0 / d
        tp = self.parallel.tp
        local_kv = m.num_kv_heads // tp
        kv_heads = d * tp if (self.allow_kv_replication and d > local_kv) else 0
        elems = m.alltoall_elems_per_token(kv_heads) / tp  # this GPU's heads
        return 2.0 * m.num_layers * elems * m.dtype_bytes * (s / d) * (d - 1) / d * self._comm_extra

    def tensor_parallel_bytes(self, lens, d: int) -> np.ndarray:
        """Bytes each GPU sends in TP's collectives for sequences ``lens`` on ``d`` devices: per
        layer four all-reduce-sized exchanges of ``2 (t-1)/t`` of ``s/d`` tokens' hidden states."""
        s = np.asarray(lens, dtype=np.float64)
        tp, m = self.parallel.tp, self.model
        if tp == 1:
            return np.zeros_like(s)
        return (4.0 * m.num_layers * 2.0 * (tp - 1) / tp * (s / d) * m.hidden_size * m.dtype_bytes
                * self._comm_extra)

    def tensor_parallel_ms(self, lens, d: int) -> np.ndarray:
        """TP collective time per GPU of sequences ``lens`` on ``d`` devices (latency excluded)."""
        if self.parallel.tp == 1:
            return np.zeros(np.shape(lens))
        return self.tensor_parallel_bytes(lens, d) / (self._tp_bw * MIB)

    def alltoall_ms(self, lens, d: int) -> np.ndarray:
        """All-to-all time per GPU of sequences ``lens`` on a group of ``d`` (latency excluded)."""
        if d == 1:
            return np.zeros(np.shape(lens))
        self._check_size(d)
        return self.alltoall_bytes(lens, d) / (self._bw[d] * MIB)

    def seq_time_ms(self, lens, d: int) -> np.ndarray:
        """Time per sequence of ``lens`` on a group of ``d``: compute + all-to-all + TP (ms)."""
        out = self.compute_ms(lens, d) + self.alltoall_ms(lens, d)
        return out + self.tensor_parallel_ms(lens, d) if self.parallel.tp > 1 else out

    def group_fixed_ms(self, d: int) -> float:
        """Time a group of ``d`` pays once per micro-batch: fixed overhead + all-to-all latencies."""
        self._check_size(d)
        calls = 4 * self.model.num_layers * self._comm_extra
        return self.coeffs.group_overhead_ms + calls * (self._lat[d] + self._tp_lat)

    def group_time_ms(self, lens, d: int) -> float:
        """Time of a group of ``d`` running the packed sequences ``lens`` in one micro-batch (ms)."""
        if len(lens) == 0:
            return 0.0
        return self.group_fixed_ms(d) + float(np.sum(self.seq_time_ms(lens, d)))

    # ----------------------------------------------------------------------------- memory
    @property
    def state_bytes_per_gpu(self) -> float:
        """Parameters, gradients and optimizer states per GPU (split by TP, distributed optimizer
        over all GPUs)."""
        p = self.profile
        return self.coeffs.num_params * self.parallel.state_bytes_per_param(
            p.state_bytes_replicated, p.state_bytes_sharded, self.num_gpus)

    def memory_bytes(self, tokens: float, d: int) -> float:
        """Peak memory per GPU of a group of ``d`` devices holding ``tokens`` tokens in one
        micro-batch."""
        return self.state_bytes_per_gpu + self.activation_bytes_per_token * tokens / d

    def group_capacity_tokens(self, d: int) -> int:
        """Most tokens a group of ``d`` GPUs can hold in one micro-batch."""
        return self.capacity_tokens * d

    def min_group_size(self, length: int) -> int:
        """Smallest allowed group size whose memory holds one sequence of ``length`` (0 if none)."""
        return int(self.min_group_sizes(np.array([length]))[0])

    def min_group_sizes(self, lengths: np.ndarray) -> np.ndarray:
        """:meth:`min_group_size` of each of ``lengths`` (tokens, 1-D), as int64 (0: none holds it)."""
        sizes = np.sort(np.array(self.sizes, dtype=np.int64))  # ascending, so capacities are too
        k = np.searchsorted(self.capacity_tokens * sizes, np.asarray(lengths, dtype=np.int64), side="left")
        return np.where(k < len(sizes), sizes[np.minimum(k, len(sizes) - 1)], 0).astype(np.int64)

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
                "capacity_tokens_per_gpu": self.capacity_tokens, "group_sizes": self.sizes,
                "parallel": self.parallel.to_dict(), "num_gpus": self.num_gpus,
                "devices": self.cluster.num_gpus, "tp_comm": self.tp_comm_source}
