"""One micro-batch packed best fit at a common level: a search family for batches whose tokens
fit one micro-batch's memory (:func:`~planner.search.search_step`).

Sequences, longest first, go to the group with the least time left that still finishes them
within the level ``T`` (any size, memory allowing); a sequence no group takes opens a group of a
*base* size when it finishes there within ``T``, else of the size nearest the base where it
does. ``T`` is bisected per base size (the least level at which all sequences fit the GPUs).

The level families stuff the least-loaded group of each sequence's cheapest size, which spreads
the load: with few sequences per GPU every group keeps some time it cannot use. Best fit with
groups of one node fills them: 64 documents of about 8K tokens on 256 GPUs (H200 estimate,
GPT-7B) in 238.5 ms against 254.7 ms.
"""

from __future__ import annotations

import numpy as np

from megatron_flexsp.planner.layout import Group, Tables

__all__ = ["best_fit_micro_batch"]


def _pack(tab: Tables, order: np.ndarray, level: float, base_row: int, rows_near: list[list[int]],
          tmat: np.ndarray, fixed: np.ndarray, caps: np.ndarray, sizes: np.ndarray) -> list[Group] | None:
    """The groups of one micro-batch at ``level`` ms (None when the GPUs run out)."""
    n_gpus = tab.cm.cluster.num_gpus  # at most this many groups
    row = np.zeros(n_gpus, dtype=np.int64)  # per group: its size's row, load (ms), tokens
    load = np.zeros(n_gpus)
    tokens = np.zeros(n_gpus, dtype=np.int64)
    seqs: list[list[int]] = []
    k, free = 0, n_gpus
    for i in order.tolist():
        length = int(tab.lens[i])
        if k:
            r = row[:k]
            end = fixed[r] + load[:k] + tmat[r, i]
            fits = (end <= level) & (tokens[:k] + length <= caps[r])
            if fits.any():
                g = int(np.argmax(np.where(fits, end, -np.inf)))  # least time left after it
                load[g] += tmat[row[g], i]
                tokens[g] += length
                seqs[g].append(i)
                continue
        for r in rows_near[base_row]:  # the base size, then the sizes nearest it
            if length <= caps[r] and fixed[r] + tmat[r, i] <= level and sizes[r] <= free:
                row[k], load[k], tokens[k] = r, tmat[r, i], length
                seqs.append([i])
                free -= int(sizes[r])
                k += 1
                break
        else:
            return None
    groups = []
    for g in range(k):
        group = Group(int(sizes[row[g]]))
        for i in seqs[g]:
            tab.add(group, i)
        groups.append(group)
    return groups


def best_fit_micro_batch(tab: Tables, items: np.ndarray, deadline, upper_ms: float,
                         rel_tol: float = 1e-3) -> list[Group] | None:
    """The fastest one-micro-batch layout of ``items`` over the base sizes (see the module
    docstring) faster than ``upper_ms``, or None; stops at ``deadline`` with the best so far.
    The level is bisected between the slowest sequence's fastest finish and ``upper_ms`` to within
    ``rel_tol``."""
    sizes = np.array(tab.sizes, dtype=np.int64)
    tmat = np.stack([tab.time[int(d)] for d in sizes])
    fixed = np.array([tab.fixed[int(d)] for d in sizes])
    caps = np.array([tab.cap[int(d)] for d in sizes], dtype=np.int64)
    logs = np.log2(sizes)
    rows_near = [sorted(range(len(sizes)), key=lambda r: (abs(logs[r] - logs[b]), logs[r] < logs[b]))
                 for b in range(len(sizes))]
    order = items[np.argsort(-tab.lens[items], kind="stable")]
    floor = float(tab.critical_ms()[items].max())
    best, best_ms = None, upper_ms
    # the node's size first (groups that fill one node balance best), then outwards
    gpn = tab.cm.cluster.gpus_per_node
    bases = sorted(range(len(sizes)), key=lambda r: (abs(logs[r] - np.log2(gpn)), logs[r]))
    for b in bases:
        lo, hi = floor, best_ms
        found = None
        while not np.isfinite(hi) and not deadline.expired():  # a level that packs
            found = _pack(tab, order, 2 * lo, b, rows_near, tmat, fixed, caps, sizes)
            lo, hi = (lo, tab.mb_ms(found)) if found is not None else (2 * lo, hi)
            if lo > 1e12:
                break
        while hi - lo > rel_tol * hi and not deadline.expired():
            mid = 0.5 * (lo + hi)
            groups = _pack(tab, order, mid, b, rows_near, tmat, fixed, caps, sizes)
            if groups is None:
                lo = mid
            else:
                hi, found = tab.mb_ms(groups), groups
        if found is not None and hi < best_ms:  # hi: the makespan of ``found``
            best, best_ms = found, hi
        if deadline.expired():
            break
    return best
