"""Turn a MILP solution (group counts, long-sequence sizes, bucket token amounts) into real groups.

Deterministic: long sequences in explicit slots go exactly where the MILP put them, the others
longest-first to the least-loaded group of the size the MILP chose; then every bucketed sequence,
longest first, goes where it raises the step time least (optionally preferring the micro-batches the
MILP gave its bucket's tokens to); finally a local search moves sequences off slow groups.
"""

from __future__ import annotations

import numpy as np

from megatron_flexsp.planner.bucketing import Buckets
from megatron_flexsp.planner.layout import Group, GroupIndex, Tables, improve_layout
from megatron_flexsp.planner.milp import MilpResult


def realize(res: MilpResult, tab: Tables, buckets: Buckets, *, use_quota: bool = True,
            deadline=None) -> list[list[Group]] | None:
    """Real layout of ``res``, or ``None`` when ``deadline`` expires before every sequence is
    placed. A sequence that fits in no group opens a micro-batch.

    ``use_quota``: place bucketed sequences preferably in the micro-batches the MILP gave their
    bucket's tokens to; without it, purely where they raise the step time least.

    Per micro-batch: groups of the sizes the MILP gave its long sequences (at most as many as it
    counted, at least one), groups of the other sizes it gave bucket tokens to, the remaining GPUs
    as size-1 groups (or the smallest allowed size).
    """
    n_gpus = tab.cm.cluster.num_gpus
    used = [j for j in range(len(res.counts)) if res.makespans[j] > 0
            and (any(v[0] == j for v in res.long_at.values()) or any(k[1] == j for k in res.tokens))]
    layout, level, deferred = [], [], []
    for j in used:
        groups: list[Group] = []
        longs = sorted((i for i, v in res.long_at.items() if v[0] == j),
                       key=lambda i: (-int(tab.lens[i]), i))
        slot_group: dict[tuple[int, int], Group] = {}
        for i in longs:  # explicit slots: exactly the MILP's groups
            _, d, s = res.long_at[i]
            if s >= 0:
                if (d, s) not in slot_group:
                    slot_group[d, s] = Group(d)
                    groups.append(slot_group[d, s])
                tab.add(slot_group[d, s], i)
        free = n_gpus - sum(g.size for g in groups)
        for d in sorted({res.long_at[i][1] for i in longs if res.long_at[i][2] < 0}, reverse=True):
            mine = [i for i in longs if res.long_at[i][1] == d and res.long_at[i][2] < 0]
            have = sum(1 for g in groups if g.size == d)
            want = min(max(1, res.counts[j][d] - have), len(mine), free // d)
            groups += [Group(d) for _ in range(want)]
            free -= d * want
        for i in longs:
            _, d, s = res.long_at[i]
            if s >= 0:
                continue
            fit = ([g for g in groups if g.size == d and tab.fits(g, i)]
                   or [g for g in groups if tab.fits(g, i)])
            if not fit:  # the MILP's aggregate memory did not pack: place it with the others
                deferred.append(i)
                continue
            g = min(fit, key=lambda g: (tab.finish(g) + float(tab.time[g.size][i]), g.size != d))
            tab.add(g, i)
        free = n_gpus - sum(g.size for g in groups)
        for d in sorted(tab.sizes, reverse=True):
            if d == 1 or not any(k[1] == j and k[2] == d for k in res.tokens):
                continue
            extra = max(0, min(res.counts[j][d] - sum(1 for g in groups if g.size == d), free // d))
            groups += [Group(d) for _ in range(extra)]
            free -= d * extra
        small = tab.sizes[0]
        groups += [Group(small) for _ in range(free // small)]
        layout.append(groups)
        level.append(res.makespans[j])
    quota: dict[tuple[int, int, int], float] = {}
    for (k, j, d), v in res.tokens.items():
        quota[k, used.index(j)] = quota.get((k, used.index(j)), 0.0) + v
    bucket_of = {int(i): k for k, mem in enumerate(buckets.members) for i in mem}
    bucket_of.update({int(i): -1 for i in deferred})
    index = GroupIndex(tab)
    for j, mb in enumerate(layout):
        for g in mb:
            index.add(j, g)
    for n_placed, i in enumerate(sorted(bucket_of, key=lambda i: (-int(tab.lens[i]), i))):
        if deadline is not None and n_placed % 8 == 7 and deadline.expired():
            return None  # unfinished: the caller keeps its other candidates
        k, s = bucket_of[i], int(tab.lens[i])
        best = None
        if use_quota:
            best = _best_group(index, level, tab, i, lambda j: quota.get((k, j), 0.0) >= 0.5 * s)
        if best is None:
            best = _best_group(index, level, tab, i, lambda j: True)
        if best is None:  # memory is fragmented: open one more micro-batch
            layout.append(_fresh_micro_batch(tab, int(tab.min_size[i])))
            level.append(0.0)
            for g in layout[-1]:
                index.add(len(layout) - 1, g)
            best = _best_group(index, level, tab, i, lambda j: j == len(layout) - 1)
        j, g = best
        tab.add(g, i)
        index.touch(g)
        level[j] = max(level[j], tab.finish(g))
        if (k, j) in quota:
            quota[k, j] -= s
    layout = [[g for g in mb if g.seqs] for mb in layout]
    layout = [mb for mb in layout if mb]
    improve_layout(layout, tab, deadline=deadline)
    return layout


def _fresh_micro_batch(tab: Tables, d: int) -> list[Group]:
    """A micro-batch of one group of size ``d`` and the other GPUs as smallest-size groups."""
    small = tab.sizes[0]
    return [Group(d)] + [Group(small) for _ in range((tab.cm.cluster.num_gpus - d) // small)]


def _best_group(index: GroupIndex, level, tab: Tables, i: int, allowed):
    """(micro-batch, group) where sequence i raises its micro-batch's time least; ties -> earliest finish."""
    best, key = None, None
    for j, d in sorted(index.classes()):
        if not allowed(j):
            continue
        g = index.best_fit((j, d), i)
        if g is None:
            continue
        t = tab.fixed[d] + g.load_ms + float(tab.time[d][i])
        k = (max(0.0, t - level[j]), t, d, g.uid)
        if key is None or k < key:
            best, key = (j, g), k
    return best


def bucket_cuts(tab: Tables) -> tuple[int, ...]:
    """Memory thresholds (tokens) at which the set of groups that can hold a sequence changes."""
    return tuple(sorted({int(tab.cap[d]) for d in tab.sizes}))


def select_long(tab: Tables, *, fraction: float, max_long: int) -> tuple[list[int], np.ndarray]:
    """Indices planned individually (longest first, at most ``max_long``) and the rest.

    A sequence is long when it exceeds ``fraction`` of one GPU's token capacity: such sequences
    pack badly as fluid, so the MILP places them one by one.
    """
    order = np.argsort(-tab.lens, kind="stable")
    thresh = fraction * tab.cm.capacity_tokens
    longs = [int(i) for i in order if tab.lens[i] > thresh][:max_long]
    chosen = set(longs)
    rest = np.array([i for i in range(len(tab.lens)) if i not in chosen], dtype=np.int64)
    return longs, rest
