"""Adaptive length bucketing: few buckets for the MILP and the LP bound, chosen by dynamic programming.

Short sequences enter the MILP as fluid token amounts per bucket, priced at the bucket's cheapest
time per token (its shortest member), which keeps the MILP a valid relaxation. The DP picks bucket
boundaries that minimise the work this under-pricing hides:
``sum_i (rate(len_i) - rate(min of bucket)) * len_i = a_attn * sum_i (len_i - lo) * len_i`` at size 1.
The real sequences are placed afterwards, so bucketing never changes what is trained.
:func:`bound_units` gives the LP bound (:mod:`planner.bound`) its units: the slowest sequences one
by one, the others in such buckets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from megatron_flexsp.planner.layout import Tables


@dataclass(frozen=True)
class Buckets:
    """``members[k]``: indices (into the batch) of bucket k, ascending by length.
    ``error``: under-priced work / total work of the bucketed sequences (0 = exact)."""

    members: tuple[np.ndarray, ...]
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    error: float


def make_buckets(lens: np.ndarray, idx: np.ndarray, *, num_buckets: int, a_attn: float, a_lin: float,
                 max_candidates: int = 256, cuts: tuple[int, ...] = ()) -> Buckets:
    """Bucket the sequences ``idx`` of ``lens`` into at most ``num_buckets`` contiguous length ranges.

    ``cuts``: lengths that must start a new bucket (e.g. memory-capacity thresholds), so a bucket
    never mixes sequences that different group sizes can hold. ``max_candidates`` bounds the DP
    (boundaries are restricted to that many length quantiles).
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets={num_buckets} must be >= 1")
    idx = np.asarray(idx, dtype=np.int64)
    if len(idx) == 0:
        return Buckets((), (), (), 0.0)
    order = idx[np.argsort(lens[idx], kind="stable")]
    x = lens[order].astype(np.float64)
    n = len(x)
    # candidate bucket starts: first index of each distinct length, thinned to quantiles, plus cuts
    starts = np.flatnonzero(np.r_[True, x[1:] != x[:-1]])
    if len(starts) > max_candidates:
        starts = np.unique(starts[np.linspace(0, len(starts) - 1, max_candidates).astype(int)])
    forced = sorted({int(np.searchsorted(x, c, side="right")) for c in cuts} - {0, n})
    starts = np.unique(np.r_[starts, forced, 0]).astype(np.int64)
    c = len(starts)
    bounds = np.r_[starts, n]
    s1 = np.r_[0.0, np.cumsum(x)]
    s2 = np.r_[0.0, np.cumsum(x * x)]

    # seg[a, b]: the under-priced work of a bucket covering x[bounds[a]:bounds[b]], for a < b, where
    # it holds no forced start strictly inside (a bucket starts at every cut)
    a_idx = np.arange(c)[:, None]
    b_idx = np.arange(c + 1)[None, :]
    lo_i, hi_i = bounds[:c][:, None], bounds[None, :]
    seg = (s2[hi_i] - s2[lo_i]) - x[lo_i] * (s1[hi_i] - s1[lo_i])
    forced_pos = np.array(sorted({int(np.searchsorted(starts, f)) for f in forced}), dtype=np.int64)
    last_forced = np.zeros(c + 1, dtype=np.int64)  # the last forced start before each b (0: none)
    if len(forced_pos):
        k_f = np.searchsorted(forced_pos, np.arange(c + 1), side="left")
        last_forced = np.where(k_f > 0, forced_pos[np.maximum(k_f - 1, 0)], 0)
    seg = np.where((a_idx < b_idx) & (a_idx >= last_forced[None, :]), seg, np.inf)
    k_max = max(num_buckets, len(forced_pos) + 1)
    cost = np.full((k_max + 1, c + 1), np.inf)
    arg = np.zeros((k_max + 1, c + 1), dtype=np.int64)
    cost[0, 0] = 0.0
    for k in range(1, k_max + 1):  # cost[k, b]: best k buckets covering x[:bounds[b]]
        cand = cost[k - 1, :c][:, None] + seg
        arg[k] = np.argmin(cand, axis=0)
        cost[k] = cand[arg[k], np.arange(c + 1)]
    k_best = int(np.argmin(cost[:, c]))
    edges, b = [c], c
    for k in range(k_best, 0, -1):
        b = int(arg[k, b])
        edges.append(b)
    edges = edges[::-1]
    members, lo, hi = [], [], []
    for a, b in zip(edges[:-1], edges[1:]):
        seg = order[bounds[a]:bounds[b]]
        members.append(seg)
        lo.append(int(lens[seg[0]]))
        hi.append(int(lens[seg[-1]]))
    hidden = a_attn * float(cost[k_best, c])
    total = float(a_attn * s2[n] + a_lin * s1[n])
    return Buckets(tuple(members), tuple(lo), tuple(hi), hidden / total if total > 0 else 0.0)


def bound_units(tab: Tables, *, num_buckets: int = 8, max_single: int = 12) -> list[tuple[np.ndarray, bool]]:
    """What the LP places: the ``max_single`` sequences with the slowest fastest finish one by one,
    the others as length buckets (cut at every size's memory capacity). The defaults keep the LP
    small (about 630 rows at 64 GPUs, twice the solves of :data:`WIDE_UNITS` in the same time)."""
    order = np.argsort(-tab.critical_ms(), kind="stable")
    singles = [int(i) for i in order[:max_single]]
    rest = np.array(sorted(set(range(len(tab.lens))) - set(singles)), dtype=np.int64)
    cm = tab.cm
    buckets = make_buckets(tab.lens, rest, num_buckets=num_buckets, a_attn=cm.coeffs.a_attn_ms_per_token2,
                           a_lin=cm.coeffs.a_lin_ms_per_token,
                           cuts=_heavy_cuts(tab))
    return [(np.array([i]), True) for i in singles] + [(mem, False) for mem in buckets.members]


#: :func:`bound_units` of :func:`~planner.bound.lp_step_bound`'s second pass: more sequences placed one by one
#: see which long ones cannot share a group (the memory pair rows), at about 1.6x the LP's rows
WIDE_UNITS = {"num_buckets": 12, "max_single": 24}


def _heavy_cuts(tab: Tables) -> tuple[int, ...]:
    """Bucket boundaries: every size's memory capacity and half of it (a bucket of sequences over
    half a group's memory then counts at least ``tokens / longest`` sequences needing a group each)."""
    return tuple(sorted({int(tab.cap[d]) // k for d in tab.sizes for k in (1, 2)}))
