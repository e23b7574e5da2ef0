"""Groups first: pack sequences into groups by memory, then groups into micro-batches by time.

When memory sets the number of micro-batches, the step time is mostly ``m`` times the fixed cost
plus the GPU-time, and ``m`` is set by how much memory the groups leave unused. Giving every
sequence the size with the least GPU-time wastes memory: a sequence over half of its group's memory
runs alone there. Here sequences (longest first) go by best fit into open groups of ``bin_size``
GPUs inside one node, where a larger group costs little GPU-time; each group then shrinks to the
smallest size that holds its tokens. Sequences longer than ``bin_size`` GPUs hold open a group of
their smallest size (which shorter ones may join while it is inside a node).

Two variations: under a ``level``, a sequence too slow alone at its size takes the cheapest larger
size that finishes it within the level (long sequences then need not set a slow micro-batch); with
``fill`` below 1, later sequences fill only that share of a group's memory, which spreads the
tokens, and so the work, evenly over the micro-batches memory needs.

:func:`pack_at_sizes` packs the same way with a size given per sequence (the slot bound's LP
placement, rounded): sequences by best fit into open groups of their size, so short sequences the
LP put on large sizes fill the memory that long ones leave there.

Groups are then placed, slowest first, into the first micro-batch with enough free GPUs: a group
joining a micro-batch of slower groups costs nothing, so micro-batches are only opened when the
earlier ones are full. O(n log n) for the packing, O(groups x micro-batches) for the placement.
"""

from __future__ import annotations

import bisect
import itertools
import math

import numpy as np

from megatron_flexsp.planner.layout import Group, Tables

Layout = list[list[Group]]


def bin_sizes(tab: Tables) -> list[int]:
    """The group sizes that lie inside one node, where a larger group costs little GPU-time (the
    smallest size when none does)."""
    node = tab.cm.cluster.gpus_per_node
    return [d for d in tab.sizes if d <= node] or [min(tab.sizes)]


def groups_first(tab: Tables, bin_size: int, level: float = float("inf"), fill: float = 1.0,
                 items: np.ndarray | None = None) -> Layout:
    """A layout of ``tab``'s batch (or of the sequences ``items`` only) built as described in the
    module docstring.

    ``bin_size``: GPUs of the open groups that sequences of at most that many GPUs' memory share
    (one of :func:`bin_sizes`). ``level`` (ms): a sequence that would not finish within it alone
    at its size takes the larger size with the least GPU-time that does (the largest when none
    does). ``fill`` (0-1]: share of a group's memory that later sequences may fill (below 1, the
    tokens spread over more groups: the micro-batches' work evens out when memory sets their
    number). Every sequence must fit some size (checked by :class:`Tables`).
    """
    if not 0.0 < fill <= 1.0:
        raise ValueError(f"fill={fill} must be in (0, 1]")
    if bin_size not in tab.sizes:
        raise ValueError(f"bin_size={bin_size} is not an allowed group size {tab.sizes}")
    items = np.arange(len(tab.lens)) if items is None else np.asarray(items, dtype=np.int64)
    order = longest_first(tab, items)
    return pack_opening(tab, order, opening_sizes(tab, bin_size, level, order), fill)


def spread_evenly(tab: Tables, items: np.ndarray, micro_batches: int) -> Layout:
    """:func:`groups_first` of ``items`` with their tokens spread evenly over the memory of
    ``micro_batches`` micro-batches (``fill`` their share of it, at most 1), groups of the first
    :func:`bin_sizes`: where memory sets the count, the micro-batches' work evens out."""
    room = micro_batches * tab.cm.cluster.num_gpus * tab.cm.capacity_tokens
    fill = min(1.0, int(tab.lens[items].sum()) / room)
    return groups_first(tab, bin_sizes(tab)[0], fill=fill, items=items)


def longest_first(tab: Tables, items: np.ndarray) -> np.ndarray:
    """``items`` longest first (ties in their given order): the order :func:`groups_first` packs."""
    return items[np.argsort(-tab.lens[items], kind="stable")]


def pack_opening(tab: Tables, order: np.ndarray, opens: np.ndarray, fill: float = 1.0) -> Layout:
    """The packing of :func:`groups_first` for sequences ``order`` (longest first) whose groups
    open at ``opens`` GPUs (:func:`opening_sizes`): each by best fit into an open group inside
    one node with room, else into a new group of its opening size."""
    node = tab.cm.cluster.gpus_per_node
    contents: list[list[int]] = []
    room: list[int] = []      # free tokens per open group
    size: list[int] = []      # GPUs per open group before shrinking
    key = len(order) + 1      # open groups inside one node as free tokens * key + group, ascending
    open_rooms: list[int] = []  # (one int: compared faster than a tuple, in the same order)
    lens_l = tab._lens_l
    for i, d in zip(order.tolist(), opens.tolist()):
        s = lens_l[i]
        k = bisect.bisect_left(open_rooms, s * key)
        if k < len(open_rooms):
            g = open_rooms.pop(k) % key
            contents[g].append(i)
            room[g] -= s
            bisect.insort(open_rooms, room[g] * key + g)
            continue
        g = len(contents)
        contents.append([i])
        room.append(max(int(fill * tab.cap[d]) - s, 0))
        size.append(d)
        if d <= node:
            bisect.insort(open_rooms, room[g] * key + g)
    return place_by_time(tab, _shrunk(tab, contents, size))


def opening_sizes(tab: Tables, bin_size: int, level: float, items: np.ndarray) -> np.ndarray:
    """GPUs of the group each of ``items`` opens in :func:`groups_first` when no open group has room
    for it: ``bin_size`` when that holds it, else its smallest size; when that does not finish it
    alone within ``level`` (ms), the larger size with the least GPU-time that does (the largest
    when none does). Two calls with the same result (for the same ``items`` and ``fill``) give the
    same layout. int64, shape ``items.shape``."""
    sizes = np.array(tab.sizes, dtype=np.int64)
    d0 = np.where(tab.lens[items] <= tab.cap[bin_size], bin_size, tab.min_size[items])
    out = d0.copy()
    if not math.isfinite(level) or not len(items):
        return out
    finish = np.stack([tab.fixed[d] + tab.time[d][items] for d in tab.sizes])   # [sizes, n] ms
    row0 = np.searchsorted(sizes, d0)
    slow = finish[row0, np.arange(len(items))] > level
    if slow.any():
        cols = np.flatnonzero(slow)
        ok = (sizes[:, None] > d0[None, cols]) & (finish[:, cols] <= level)
        work = np.stack([d * tab.time[d][items[cols]] for d in tab.sizes])
        pick = np.where(ok, work, np.inf).argmin(axis=0)
        out[cols] = np.where(ok.any(axis=0), sizes[pick], sizes.max())
    return out


def pack_at_sizes(tab: Tables, sizes: np.ndarray) -> Layout:
    """A layout with each sequence ``i`` in a group of ``sizes[i]`` GPUs (raised to its smallest
    size): longest first, by best fit into an open group of that size with memory room, else a new
    one; each group then shrinks to the smallest size holding its tokens; groups placed by
    :func:`place_by_time`."""
    sizes = np.maximum(np.asarray(sizes, dtype=np.int64), tab.min_size)
    if sizes.shape != tab.lens.shape or not set(sizes.tolist()) <= set(tab.sizes):
        raise ValueError(f"sizes must give one allowed group size {tab.sizes} per sequence "
                         f"({len(tab.lens)}); got {len(sizes)} with {sorted(set(sizes.tolist()))}")
    key = len(tab.lens) + 1  # open groups per size as free tokens * key + group, ascending
    open_rooms: dict[int, list[int]] = {d: [] for d in tab.sizes}
    contents: list[list[int]] = []
    room: list[int] = []
    lens_l, sizes_l = tab._lens_l, sizes.tolist()
    for i in np.argsort(-tab.lens, kind="stable").tolist():
        s, rooms = lens_l[i], open_rooms[sizes_l[i]]
        k = bisect.bisect_left(rooms, s * key)
        if k < len(rooms):
            g = rooms.pop(k) % key
            contents[g].append(i)
        else:
            g = len(contents)
            contents.append([i])
            room.append(int(tab.cap[sizes_l[i]]))
        room[g] -= s
        bisect.insort(rooms, room[g] * key + g)
    return place_by_time(tab, _shrunk(tab, contents, [int(sizes[c[0]]) for c in contents]))


def _shrunk(tab: Tables, contents: list[list[int]], size: list[int]) -> list[Group]:
    """Groups of the given members, each at the smallest size up to ``size`` holding its tokens
    (loads summed in member order, as :meth:`Tables.add` does)."""
    if not contents:
        return []
    counts = np.fromiter(map(len, contents), dtype=np.int64, count=len(contents))
    flat = np.fromiter(itertools.chain.from_iterable(contents), dtype=np.int64, count=int(counts.sum()))
    gid = np.repeat(np.arange(len(contents)), counts)
    tokens = np.bincount(gid, weights=tab.lens[flat], minlength=len(contents))  # exact below 2^53
    sizes = np.array(sorted(tab.sizes), dtype=np.int64)
    caps = np.array([tab.cap[d] for d in sizes.tolist()])
    fits = (caps[:, None] >= tokens[None, :]) & (sizes[:, None] <= np.asarray(size)[None, :])
    if not fits.any(axis=0).all():
        g = int(np.flatnonzero(~fits.any(axis=0))[0])
        raise ValueError(f"group {g} holds {int(tokens[g])} tokens, more than any size up to "
                         f"{size[g]} GPUs holds ({ {int(d): int(c) for d, c in zip(sizes, caps)} })")
    row = fits.argmax(axis=0)  # the smallest such size
    seq_ms, seq_row = np.empty(len(flat)), row[gid]
    for r, d in enumerate(sizes.tolist()):
        mine = seq_row == r
        seq_ms[mine] = tab.time[d][flat[mine]]
    loads = np.bincount(gid, weights=seq_ms, minlength=len(contents))  # in member order
    d_l, load_l, tok_l = sizes[row].tolist(), loads.tolist(), tokens.astype(np.int64).tolist()
    return [Group(d_l[g], list(members), load_l[g], tok_l[g]) for g, members in enumerate(contents)]


def place_by_time(tab: Tables, groups: list[Group]) -> Layout:
    """Groups, slowest first, each into the first micro-batch with enough free GPUs."""
    n_gpus = tab.cm.cluster.num_gpus
    layout: Layout = []
    free: list[int] = []
    open_mbs: list[int] = []  # micro-batches with free GPUs, in creation order
    for g in sorted(groups, key=lambda g: (-tab.finish(g), g.uid)):
        for pos, j in enumerate(open_mbs):
            if free[j] >= g.size:
                break
        else:
            j, pos = len(layout), len(open_mbs)
            layout.append([])
            free.append(n_gpus)
            open_mbs.append(j)
        layout[j].append(g)
        free[j] -= g.size
        if free[j] == 0:
            open_mbs.pop(pos)
    return layout
