"""Document-length corpora for planner benchmarks (layer 1: numpy only).

Real lengths come from a file (the Wikipedia sample in ``../shared/seqlen/``); the others are
synthetic families with their parameters in the name, so that a benchmark can say exactly what it
ran and nothing is tuned to one corpus:

* ``github`` / ``commoncrawl``: stand-ins that match the corpora's published mean tokens per document
  (a lognormal body and a Pareto tail, :func:`stand_in_lengths`);
* ``lognormal-<mean>``: lognormal lengths with the given mean (``1k``, ``4k``, ``16k``; sigma 1.5, the
  shape of Megatron's own mock variable-length workload);
* ``pareto-<alpha>``: Pareto lengths with index ``alpha`` (1.1 to 1.5) above 128 tokens;
* ``bimodal``: short documents (lognormal, mean 600) plus 0.5% of documents between 128K and 512K.

Lengths are drawn once per corpus (1,000,000 by default, seeded) and batches are then sampled from
them exactly like the real file (:func:`megatron_flexsp.sim.workloads.sample_batches`).
"""

from __future__ import annotations

import re

import numpy as np

#: Stand-in shapes: published mean tokens per document (``../shared/seqlen/README.md``), the tail
#: fraction above ``x_m`` and the Pareto index (Wikipedia's measured tail index is about 2).
STAND_INS = {"commoncrawl": {"mean": 525.0, "tail_fraction": 0.004, "x_m": 8192, "alpha": 2.0},
             "github": {"mean": 1820.0, "tail_fraction": 0.02, "x_m": 8192, "alpha": 1.8}}

#: The synthetic corpora of the planner sweep (``scripts/bench_planner.py --sweep``).
SYNTHETIC = ("github", "commoncrawl", "lognormal-1k", "lognormal-4k", "lognormal-16k",
             "pareto-1.1", "pareto-1.3", "pareto-1.5", "bimodal")

LOGNORMAL_SIGMA = 1.5
PARETO_MIN = 128
BIMODAL = {"short_mean": 600.0, "long_fraction": 0.005, "long_min": 131072, "long_max": 524288}


def stand_in_lengths(name: str, n: int = 1_000_000, seed: int = 0, sigma: float = 1.2) -> np.ndarray:
    """Lognormal body + Pareto tail whose mean matches the corpus' published mean tokens per document.

    A fraction ``tail_fraction`` of documents is Pareto(``alpha``) above ``x_m`` (mean
    ``alpha x_m / (alpha - 1)``); the body is lognormal with ``sigma`` and the median set so that
    the overall mean equals ``mean``. Deterministic for a seed.
    """
    if name not in STAND_INS:
        raise ValueError(f"unknown stand-in {name!r}; known: {sorted(STAND_INS)}")
    p = STAND_INS[name]
    rng = np.random.default_rng(seed)
    tail_mean = p["alpha"] * p["x_m"] / (p["alpha"] - 1)
    body_mean = (p["mean"] - p["tail_fraction"] * tail_mean) / (1 - p["tail_fraction"])
    if body_mean <= 0:
        raise ValueError(f"stand-in {name}: tail mean {tail_mean:.0f} x {p['tail_fraction']} exceeds "
                         f"the corpus mean {p['mean']}")
    mu = np.log(body_mean) - sigma ** 2 / 2
    tail = rng.random(n) < p["tail_fraction"]
    body = rng.lognormal(mu, sigma, n)
    pareto = p["x_m"] * (1 + rng.pareto(p["alpha"], n))
    return np.maximum(np.where(tail, pareto, body), 1).astype(np.int64)


def _lognormal(mean: float, sigma: float, n: int, rng: np.random.Generator) -> np.ndarray:
    mu = np.log(mean) - sigma ** 2 / 2
    return np.maximum(rng.lognormal(mu, sigma, n), 1).astype(np.int64)


def synthetic_lengths(name: str, n: int = 1_000_000, seed: int = 0) -> np.ndarray:
    """Lengths of the synthetic corpus ``name`` (one of :data:`SYNTHETIC`, or any
    ``lognormal-<mean>`` / ``pareto-<alpha>``); ``ValueError`` naming the known families."""
    rng = np.random.default_rng(seed)
    if name in STAND_INS:
        return stand_in_lengths(name, n=n, seed=seed)
    m = re.fullmatch(r"lognormal-(\d+)(k?)", name)
    if m:
        mean = float(m.group(1)) * (1024 if m.group(2) else 1)
        return _lognormal(mean, LOGNORMAL_SIGMA, n, rng)
    m = re.fullmatch(r"pareto-(\d+(?:\.\d+)?)", name)
    if m:
        alpha = float(m.group(1))
        if alpha <= 1.0:
            raise ValueError(f"corpus {name!r}: Pareto index {alpha} must be above 1 (finite mean)")
        return (PARETO_MIN * (1 + rng.pareto(alpha, n))).astype(np.int64)
    if name == "bimodal":
        b = BIMODAL
        long = rng.random(n) < b["long_fraction"]
        short = _lognormal(b["short_mean"], 1.0, n, rng)
        tall = rng.integers(b["long_min"], b["long_max"] + 1, n)
        return np.where(long, tall, short).astype(np.int64)
    raise ValueError(f"unknown corpus {name!r}; synthetic corpora: {list(SYNTHETIC)} "
                     f"(or lognormal-<mean>[k], pareto-<alpha>)")
