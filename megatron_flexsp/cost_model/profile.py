"""Versioned hardware/model profiles stored as JSON (schema in README.md).

A profile describes one kind of cluster (GPUs per node, device memory, all-to-all bandwidth and
latency by group size, inside or across nodes) and, optionally, measured cost coefficients per model.
``load_profile`` accepts a shipped name (``configs/profiles/<name>.json``) or a path, and validates
everything with errors that name the key and the value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

PROFILE_FORMAT = "megatron-flexsp-profile"
PROFILE_VERSION = 1
PROFILE_DIR = Path(__file__).resolve().parents[2] / "configs" / "profiles"


@dataclass(frozen=True)
class AllToAllPoint:
    """Measured all-to-all of one group size: per-device bandwidth (MiB/ms) and latency per call (ms)."""

    group_size: int
    bandwidth_mib_per_ms: float
    latency_ms: float


@dataclass(frozen=True)
class Profile:
    """A validated profile (see :func:`load_profile`)."""

    name: str
    hardware: str
    estimated: bool
    gpus_per_node: int
    device_memory_bytes: float
    memory_reserve_bytes: float
    peak_tflops: float
    efficiency_attention: float
    efficiency_linear: float
    state_bytes_replicated: float
    state_bytes_sharded: float
    group_overhead_ms_per_layer: float
    intra_node: tuple[AllToAllPoint, ...]
    inter_node: tuple[AllToAllPoint, ...]
    models: dict = field(default_factory=dict)
    source: str = ""
    tensor_parallel: tuple[AllToAllPoint, ...] = ()  # all-reduce of a TP group, by TP size

    @property
    def memory_budget_bytes(self) -> float:
        return self.device_memory_bytes - self.memory_reserve_bytes

    def on_partial_node(self, num_gpus: int) -> "Profile":
        """This profile for a run on fewer GPUs than one node (``num_gpus`` a power of two below
        ``gpus_per_node``): one node of ``num_gpus``, intra-node all-to-all points up to that size."""
        if not 0 < num_gpus < self.gpus_per_node or num_gpus & (num_gpus - 1):
            raise ValueError(f"num_gpus={num_gpus} must be a power of two below the profile's "
                             f"gpus_per_node={self.gpus_per_node}")
        points = tuple(p for p in self.intra_node if p.group_size <= num_gpus)
        if num_gpus > 1 and not points:
            points = self.intra_node[:1]
        tp = tuple(p for p in self.tensor_parallel if p.group_size <= num_gpus)
        return replace(self, gpus_per_node=num_gpus, intra_node=points, inter_node=(), tensor_parallel=tp)


def _require(data: dict, key: str, where: str):
    if key not in data:
        raise ValueError(f"profile {where}: missing key {key!r}")
    return data[key]


def _number(data: dict, key: str, where: str, *, minimum: float = 0.0, strict: bool = False) -> float:
    value = _require(data, key, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"profile {where}: {key}={value!r} is not a finite number")
    if value < minimum or (strict and value == minimum):
        rel = ">" if strict else ">="
        raise ValueError(f"profile {where}: {key}={value} must be {rel} {minimum}")
    return float(value)


def _points(entries, where: str) -> tuple[AllToAllPoint, ...]:
    if not isinstance(entries, list):
        raise ValueError(f"profile {where}: expected a list of measurements, got {type(entries).__name__}")
    out = []
    for k, e in enumerate(entries):
        w = f"{where}[{k}]"
        size = int(_number(e, "group_size", w, minimum=2))
        bw = _number(e, "bandwidth_mib_per_ms", w, minimum=0.0, strict=True)
        lat = _number(e, "latency_ms", w, minimum=0.0)
        out.append(AllToAllPoint(size, bw, lat))
    sizes = [p.group_size for p in out]
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"profile {where}: duplicate group sizes {sizes}")
    return tuple(sorted(out, key=lambda p: p.group_size))


def parse_profile(data: dict, name: str = "<dict>") -> Profile:
    """Validate a profile dictionary and return a :class:`Profile`."""
    where = repr(name)
    if data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"profile {where}: format={data.get('format')!r}, expected {PROFILE_FORMAT!r}")
    version = _require(data, "version", where)
    if version != PROFILE_VERSION:
        raise ValueError(f"profile {where}: unknown version {version!r} (this build reads "
                         f"version {PROFILE_VERSION})")
    gpn = int(_number(data, "gpus_per_node", where, minimum=1))
    eff = _require(data, "efficiency", where)
    states = _require(data, "state_bytes_per_param", where)
    a2a = _require(data, "alltoall", where)
    intra = _points(_require(a2a, "intra_node", where + ".alltoall"), where + ".alltoall.intra_node")
    inter = _points(_require(a2a, "inter_node", where + ".alltoall"), where + ".alltoall.inter_node")
    for p in intra:
        if p.group_size > gpn:
            raise ValueError(f"profile {where}: intra_node entry for group_size={p.group_size} "
                             f"exceeds gpus_per_node={gpn}")
    for p in inter:
        if p.group_size <= gpn:
            raise ValueError(f"profile {where}: inter_node entry for group_size={p.group_size} "
                             f"fits in one node (gpus_per_node={gpn})")
    tp_points = _points(data.get("tensor_parallel", []), where + ".tensor_parallel")
    for p in tp_points:
        if p.group_size > gpn:
            raise ValueError(f"profile {where}: tensor_parallel entry for group_size={p.group_size} "
                             f"exceeds gpus_per_node={gpn} (tensor parallelism stays inside a node)")
    prof = Profile(
        name=name, hardware=str(_require(data, "hardware", where)),
        estimated=bool(data.get("estimated", False)), gpus_per_node=gpn,
        device_memory_bytes=_number(data, "device_memory_bytes", where, strict=True),
        memory_reserve_bytes=_number(data, "memory_reserve_bytes", where),
        peak_tflops=_number(data, "peak_tflops", where, strict=True),
        efficiency_attention=_number(eff, "attention", where + ".efficiency", strict=True),
        efficiency_linear=_number(eff, "linear", where + ".efficiency", strict=True),
        state_bytes_replicated=_number(states, "replicated", where + ".state_bytes_per_param"),
        state_bytes_sharded=_number(states, "sharded", where + ".state_bytes_per_param"),
        group_overhead_ms_per_layer=_number(data, "group_overhead_ms_per_layer", where),
        intra_node=intra, inter_node=inter, models=dict(data.get("models", {})),
        source=str(data.get("source", "")), tensor_parallel=tp_points)
    if prof.memory_budget_bytes <= 0:
        raise ValueError(f"profile {where}: memory_reserve_bytes={prof.memory_reserve_bytes:.0f} "
                         f"leaves no memory of device_memory_bytes={prof.device_memory_bytes:.0f}")
    for model_name, coeffs in prof.models.items():
        w = f"{where}.models[{model_name!r}]"
        for key in ("a_attn_ms_per_token2", "a_lin_ms_per_token", "group_overhead_ms",
                    "activation_bytes_per_token"):
            _number(coeffs, key, w)
        _require(coeffs, "shape", w)
    return prof


def load_profile(name_or_path: str) -> Profile:
    """Load a profile by shipped name (``configs/profiles/<name>.json``) or by file path."""
    path = Path(name_or_path)
    if not path.suffix:
        candidate = PROFILE_DIR / f"{name_or_path}.json"
        if candidate.exists():
            path = candidate
    if not path.exists():
        shipped = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
        raise ValueError(f"profile {name_or_path!r} not found (not a file; shipped profiles: {shipped})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {str(path)!r} is not valid JSON: {exc}") from None
    return parse_profile(data, name=path.stem)
