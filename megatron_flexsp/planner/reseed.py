"""Re-packing one micro-batch with its longest sequences opened first on groups of a chosen size.

The level packer (:mod:`planner.level`) gives each sequence the size with the least GPU-time that
finishes it within the level. Where memory is tight that leaves a long sequence on the smallest
group that holds it, full to the token, while the medium sequences fill groups of one or two GPUs
on their own; a larger group for the long one has room for medium ones beside it, and the
micro-batch as a whole finishes sooner. On a lognormal step of 512 documents (mean 4K tokens) at
64 GPUs, a micro-batch of 21K-token documents on groups of 4 and 10-12K ones on groups of 2 ran
2,343 ms; with its six longest opened on groups of 8 and the rest stuffed beside them, 2,233 ms.

:func:`reseed_micro_batches` tries, per micro-batch, its ``q`` longest sequences each opened alone
on a group of their cheapest size (least GPU-time) or one or two sizes up, the rest stuffed
(:meth:`LevelPacker.stuff`) at the lowest level that leaves nothing out; a packing is kept only
when faster. A try is given up after one stuffing when it cannot beat the best level found, so
most cost one stuffing. Where seedings won on the finished plans of 28 hard 64-GPU batches, 60
went one size up, 25 stayed at the cheapest (the order alone) and 5 went two up; none further.
"""

from __future__ import annotations

import numpy as np

from megatron_flexsp.planner.layout import Group, mb_items
from megatron_flexsp.planner.level import LevelPacker

Layout = list[list[Group]]

#: how many of a micro-batch's longest sequences are opened first
SEED_COUNTS = (1, 2, 3, 4, 6, 8)
#: bisection steps on the level of a seeding that beats the best found
_PROBES = 8


def seeded_pack(packer: LevelPacker, items: np.ndarray, seeds: list[int], size: int,
                level: float) -> list[Group] | None:
    """Groups running ``items`` within ``level`` (ms) on at most N GPUs with each of ``seeds`` (a
    subset of ``items``) first alone on a group of ``size`` GPUs, the rest stuffed; None when
    something is left out."""
    tab = packer.tab
    if len(seeds) * size > packer.n_gpus:
        return None
    groups = []
    for i in seeds:
        g = Group(size)
        tab.add(g, i)
        if tab.finish(g) > level or g.tokens > tab.cap[size]:
            return None
        groups.append(g)
    rest = np.setdiff1d(items, np.asarray(seeds, dtype=np.int64), assume_unique=True)
    made, left = packer.stuff(rest, level, seed=groups, strict=True)
    return None if len(left) else made


def reseed(packer: LevelPacker, items: np.ndarray, upper: float, deadline=None,
           rel_tol: float = 2e-3) -> tuple[float, list[Group]] | None:
    """The fastest seeded packing (:func:`seeded_pack`) of one micro-batch's ``items`` below
    ``upper * (1 - rel_tol)`` (ms), with its makespan; None when none is. Seeds: the ``q``
    longest (by fastest finish) for ``q`` in :data:`SEED_COUNTS`, on the largest of their
    cheapest sizes and one or two sizes up, where those hold them."""
    tab = packer.tab
    order = items[np.argsort(-packer.critical[items], kind="stable")]
    floor = packer.lower_bound(items, 1)
    best: tuple[float, list[Group]] | None = None
    target = upper * (1 - rel_tol)
    # GPU-time (ms x GPUs) of the items after the q longest, each at its cheapest size: the
    # micro-batch's N x level must hold the seeds' groups and at least that
    rest_area = np.cumsum(packer.gpu_time_min[order][::-1])[::-1].tolist() + [0.0]
    # each seed's cheapest size (least GPU-time, the packer's first row): seeds go there or one
    # or two sizes up
    own = [packer.sizes_l[packer.row_order[i][0]] for i in order[:SEED_COUNTS[-1]].tolist()]
    for q in SEED_COUNTS:
        if q > len(order):
            break
        seeds = order[:q].tolist()
        cheapest = max(own[:q])
        for size in (cheapest, 2 * cheapest, 4 * cheapest):
            if deadline is not None and deadline.expired():
                return best
            if (size not in tab.cap or q * size > packer.n_gpus
                    or int(tab.lens[seeds].max()) > tab.cap[size]):
                continue
            times = tab.time[size][seeds] + tab.fixed[size]
            alone = float(times.max())
            if alone >= target or size * float(times.sum()) + rest_area[q] > packer.n_gpus * target:
                continue
            found = seeded_pack(packer, items, seeds, size, target)
            if found is None:
                continue
            lo, hi = max(floor, alone), tab.mb_ms(found)
            for _ in range(_PROBES):  # bisect the level of this seeding down
                if hi - lo <= rel_tol * hi or (deadline is not None and deadline.expired()):
                    break
                mid = 0.5 * (lo + hi)
                probe = seeded_pack(packer, items, seeds, size, mid)
                if probe is None:
                    lo = mid
                else:
                    found, hi = probe, tab.mb_ms(probe)
            best = (hi, found)
            target = hi * (1 - rel_tol)
    return best


def reseed_micro_batches(layout: Layout, packer: LevelPacker, deadline) -> int:
    """Each micro-batch of ``layout``, furthest above its own lower bound first, replaced by its
    fastest seeded packing (:func:`reseed`) where that is faster, in place, until ``deadline``.
    Returns how many micro-batches got faster."""
    tab = packer.tab
    better = 0
    for j in packer.furthest_first(layout):
        if deadline.expired():
            break
        found = reseed(packer, mb_items(layout[j]), tab.mb_ms(layout[j]), deadline)
        if found is not None:
            layout[j] = found[1]
            better += 1
    return better
