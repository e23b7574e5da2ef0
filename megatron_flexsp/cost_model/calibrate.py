"""Fit cost-model coefficients to measurements and write them as a profile (numpy only).

The profiler (:mod:`megatron_flexsp.runtime.profiler`) measures; this module turns its numbers into
the profile JSON the planner loads (:func:`megatron_flexsp.cost_model.profile.parse_profile`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ComputeFit:
    """``time_ms(s) = overhead_ms + a_lin * s + a_attn * s**2`` for one sequence of ``s`` tokens on
    one GPU (forward + backward, whole model); ``rel_err``: RMS relative error of the fit."""

    overhead_ms: float
    a_lin_ms_per_token: float
    a_attn_ms_per_token2: float
    rel_err: float

    def time_ms(self, tokens, group_size: int = 1):
        """Fitted time (ms) of sequences of ``tokens`` (scalar or array): the fixed cost plus the
        compute, split over ``group_size`` ranks (no communication)."""
        s = np.asarray(tokens, dtype=np.float64)
        return self.overhead_ms + (self.a_lin_ms_per_token * s + self.a_attn_ms_per_token2 * s * s) / group_size


@dataclass(frozen=True)
class AllToAllFit:
    """``time_ms(bytes) = latency_ms + bytes / (bandwidth_mib_per_ms * 2**20)`` per all-to-all call
    on a group of ``group_size``; ``rel_err``: RMS relative error of the fit."""

    group_size: int
    latency_ms: float
    bandwidth_mib_per_ms: float
    rel_err: float


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (drops negative ones and refits; few columns)."""
    cols = list(range(a.shape[1]))
    while True:
        coef = np.linalg.lstsq(a[:, cols] * weights[:, None], y * weights, rcond=None)[0]
        if (coef >= 0).all() or len(cols) == 1:
            out = np.zeros(a.shape[1])
            out[cols] = np.maximum(coef, 0.0)
            return out
        cols.pop(int(np.argmin(coef)))


def _rel_err(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.sqrt(np.mean(((pred - y) / y) ** 2)))


def _bandwidth_mib_per_ms(ms_per_byte: float) -> float:
    """Bandwidth of a fitted per-byte slope; a zero slope (too fast to see) is floored at 1e-15."""
    return 1.0 / (max(ms_per_byte, 1e-15) * 2 ** 20)


def fit_compute(lengths, times_ms) -> ComputeFit:
    """Fit measured forward+backward times (ms) of single sequences of ``lengths`` tokens.

    Relative least squares (each point weighted by 1/time) so short and long sequences count alike.
    """
    s = np.asarray(lengths, dtype=np.float64)
    y = np.asarray(times_ms, dtype=np.float64)
    if len(s) < 3 or len(s) != len(y):
        raise ValueError(f"need at least 3 (length, time) points of equal count, got {len(s)} and {len(y)}")
    if (y <= 0).any():
        raise ValueError(f"measured times must be positive, got min {y.min()}")
    a = np.stack([np.ones_like(s), s, s * s], axis=1)
    c = _nonneg_lstsq(a, y, 1.0 / y)
    return ComputeFit(float(c[0]), float(c[1]), float(c[2]), _rel_err(a @ c, y))


def fit_alltoall(group_size: int, nbytes, times_ms) -> AllToAllFit:
    """Fit measured all-to-all times (ms) against bytes sent per GPU for one group size."""
    b = np.asarray(nbytes, dtype=np.float64)
    y = np.asarray(times_ms, dtype=np.float64)
    if len(b) < 2 or len(b) != len(y):
        raise ValueError(f"need at least 2 (bytes, time) points of equal count, got {len(b)} and {len(y)}")
    a = np.stack([np.ones_like(b), b], axis=1)
    c = _nonneg_lstsq(a, y, 1.0 / y)
    return AllToAllFit(group_size, float(c[0]), _bandwidth_mib_per_ms(float(c[1])), _rel_err(a @ c, y))


def measured_profile(base: dict, *, hardware: str, gpus_per_node: int, model_name: str, shape: dict,
                     compute: ComputeFit, alltoall: list[AllToAllFit], activation_bytes_per_token: float,
                     num_layers: int, source: str) -> dict:
    """A profile dict: ``base``'s device and state fields, with measured coefficients for
    ``model_name`` and measured all-to-all tables (intra-node: size <= ``gpus_per_node``); with no
    all-to-all fits (one rank) the base's node size and tables are kept and ``source`` says so.

    The per-group-per-micro-batch overhead is the fit's intercept; the profile's per-layer overhead
    (used for other models) is that divided by ``num_layers``.
    """
    out = copy.deepcopy(base)
    out.update({"hardware": hardware, "estimated": False, "source": source,
                "group_overhead_ms_per_layer": compute.overhead_ms / num_layers})
    if not alltoall:  # one rank: nothing to measure; keep the base's node size and tables, say so
        out["source"] += "; all-to-all tables NOT measured (one rank), copied from the base profile"
        return _with_model(out, model_name, shape, compute, activation_bytes_per_token, alltoall)
    out["gpus_per_node"] = int(gpus_per_node)
    intra = [f for f in alltoall if f.group_size <= gpus_per_node]
    inter = [f for f in alltoall if f.group_size > gpus_per_node]
    out["alltoall"] = {name: [{"group_size": f.group_size, "bandwidth_mib_per_ms": f.bandwidth_mib_per_ms,
                               "latency_ms": f.latency_ms} for f in fits]
                       for name, fits in (("intra_node", intra), ("inter_node", inter))}
    return _with_model(out, model_name, shape, compute, activation_bytes_per_token, alltoall)


def _with_model(out: dict, model_name: str, shape: dict, compute: ComputeFit, act: float,
                alltoall: list[AllToAllFit]) -> dict:
    out["models"] = {model_name: {
        "shape": shape, "a_attn_ms_per_token2": compute.a_attn_ms_per_token2,
        "a_lin_ms_per_token": compute.a_lin_ms_per_token, "group_overhead_ms": compute.overhead_ms,
        "activation_bytes_per_token": float(act),
        "fit": {"compute_rel_err": compute.rel_err,
                "alltoall_rel_err": {str(f.group_size): f.rel_err for f in alltoall}}}}
    return out


def fit_group_excess(group_size: int, nbytes, excess_ms, calls: int) -> AllToAllFit:
    """Effective all-to-all parameters of a group size from end-to-end Ulysses timings.

    ``excess_ms``: measured time of a sequence on a group of ``group_size`` minus its compute share
    (the size-1 fit divided by the size); ``nbytes``: the bytes the cost model says each GPU sends
    for it; ``calls``: all-to-all calls per group and micro-batch (``4 * num_layers``). The fit
    ``excess = calls * latency + bytes / bandwidth`` absorbs what the cost model does not name
    (synchronisation, layout copies), so predictions use what a group of that size really costs.
    ``rel_err``: RMS error of the fit over the mean excess.
    """
    b = np.asarray(nbytes, dtype=np.float64)
    y = np.asarray(excess_ms, dtype=np.float64)
    if len(b) < 2 or len(b) != len(y):
        raise ValueError(f"need at least 2 (bytes, excess) points of equal count, got {len(b)} and {len(y)}")
    if calls < 1:
        raise ValueError(f"calls={calls} must be >= 1")
    a = np.stack([np.ones_like(b), b], axis=1)
    c = _nonneg_lstsq(a, y, np.ones_like(y))
    scale = max(float(np.mean(np.abs(y))), 1e-12)
    err = float(np.sqrt(np.mean((a @ c - y) ** 2)) / scale)
    return AllToAllFit(group_size, float(c[0]) / calls, _bandwidth_mib_per_ms(float(c[1])), err)


def with_dispatch(fit: ComputeFit, tokens, dispatch_ms) -> tuple[ComputeFit, float, float]:
    """``fit`` with the runtime's measured token dispatch folded in: its per-micro-batch intercept
    joins the fixed cost, its per-token slope the linear rate. Returns the new fit and the
    dispatch intercept (ms) and slope (ms/token) that were added."""
    x = np.asarray(tokens, dtype=np.float64)
    y = np.asarray(dispatch_ms, dtype=np.float64)
    if len(x) < 2 or len(x) != len(y):
        raise ValueError(f"need at least 2 (tokens, ms) dispatch points of equal count, got {len(x)} and {len(y)}")
    c = _nonneg_lstsq(np.stack([np.ones_like(x), x], axis=1), y, np.ones_like(y))
    return (ComputeFit(fit.overhead_ms + float(c[0]), fit.a_lin_ms_per_token + float(c[1]),
                       fit.a_attn_ms_per_token2, fit.rel_err), float(c[0]), float(c[1]))


@dataclass(frozen=True)
class TrainingFit:
    """``measured ~ scale * predicted + per_micro_batch_ms * micro-batches`` over a training run's
    steps; ``rel_err``: RMS relative error of that fit; ``raw_median_ratio``: measured / predicted
    before it."""

    scale: float
    per_micro_batch_ms: float
    rel_err: float
    raw_median_ratio: float
    steps: int


def fit_training(predicted_ms, micro_batches, measured_ms) -> TrainingFit:
    """Fit how a real training loop's steps relate to the profile's predictions (both >= 0).

    A layer stack measures kernels; the framework around them (its layers' own implementation,
    per-micro-batch bookkeeping, gradient synchronisation) adds a factor and a per-micro-batch cost
    that this fit captures, from the steps of a run with known plans.
    """
    p = np.asarray(predicted_ms, dtype=np.float64)
    n = np.asarray(micro_batches, dtype=np.float64)
    y = np.asarray(measured_ms, dtype=np.float64)
    if len(p) < 3 or not len(p) == len(n) == len(y):
        raise ValueError(f"need at least 3 steps with predicted, micro-batch and measured values, got "
                         f"{len(p)}, {len(n)}, {len(y)}")
    a = np.stack([p, n], axis=1)
    c = _nonneg_lstsq(a, y, 1.0 / y)
    return TrainingFit(float(c[0]), float(c[1]), _rel_err(a @ c, y), float(np.median(y / p)), len(p))


def scaled(fit: ComputeFit, training: TrainingFit) -> ComputeFit:
    """``fit`` with its compute coefficients and fixed cost scaled and the per-micro-batch cost added."""
    return ComputeFit(fit.overhead_ms * training.scale + training.per_micro_batch_ms,
                      fit.a_lin_ms_per_token * training.scale, fit.a_attn_ms_per_token2 * training.scale,
                      fit.rel_err)


def layer_stack_entry(entry: dict) -> dict:
    """A profile's model entry as its layer stack measured it: the Megatron-run fit
    (``fit.megatron_run``: compute x ``scale`` + ``per_micro_batch_ms``, see :func:`scaled`) undone.
    For comparing predictions with the runtime's own layer stack, which lacks Megatron's costs;
    an entry without that fit is returned as it is."""
    run = entry.get("fit", {}).get("megatron_run")
    if not run:
        return entry
    k = float(run["scale"])
    if k <= 0:
        raise ValueError(f"megatron_run fit has scale={k}; cannot undo it")
    out = copy.deepcopy(entry)
    out["a_attn_ms_per_token2"] = entry["a_attn_ms_per_token2"] / k
    out["a_lin_ms_per_token"] = entry["a_lin_ms_per_token"] / k
    out["group_overhead_ms"] = max(0.0, (entry["group_overhead_ms"] - float(run["per_micro_batch_ms"])) / k)
    return out
