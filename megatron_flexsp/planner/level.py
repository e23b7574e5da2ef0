"""Level packing of one micro-batch: pack its sequences within a makespan instead of branching.

For a micro-batch and a *level* ``T`` (its makespan, fixed costs included), every sequence takes the
group size with the least GPU-time (size x time) among those that hold it in memory and finish it
within ``T``; each size's sequences are then packed longest first onto as few groups as hold them
within ``T`` and their memory. The micro-batch is feasible at ``T`` when those groups need at most N
GPUs (when memory is tight, the stuffing order below, which also uses other sizes' spare room, gets
a try); its makespan is the smallest feasible ``T`` (bisection, :meth:`LevelPacker.min_level`).

*Stuffing* (:meth:`LevelPacker.stuff`) fills one micro-batch at a level with as much work as fits,
hardest sequences first, and returns what is left: the step search (:mod:`planner.search`) builds
whole layouts from these two operations. No solver; one packing is O(n log n).
"""

from __future__ import annotations

import functools
import heapq
import math

import numpy as np

from megatron_flexsp.planner.layout import Group, Tables, mb_items


_MAX_PROBES = 16    # least-loaded groups tried for memory room before opening a new one
_FULL_AFTER = 64   # a micro-batch without free GPUs that refused this many items in a row is full


class LevelPacker:
    """Level packing over one batch's :class:`Tables` (times in ms)."""

    def __init__(self, tab: Tables) -> None:
        self.tab = tab
        self.sizes = np.array(tab.sizes, dtype=np.int64)
        self.fixed = np.array([tab.fixed[d] for d in tab.sizes])
        self.time = np.stack([tab.time[d] for d in tab.sizes])            # [sizes, n] ms
        self.ok = np.stack([tab.lens <= tab.cap[d] for d in tab.sizes])    # memory holds it alone
        self.total = self.time + self.fixed[:, None]                       # alone in a group
        self.gpu_time = self.time * self.sizes[:, None]
        self.critical = tab.critical_ms()                                  # fastest finish (ms)
        self.gpu_time_min = np.where(self.ok, self.gpu_time, np.inf).min(axis=0)  # cheapest GPU-time
        self.n_gpus = tab.cm.cluster.num_gpus
        self.f_min = float(self.fixed.min())
        # plain-Python copies for the per-item loops (the per-item ones built when first used: 0.2 s
        # for 65,536 documents, where the search may have no time left to use them)
        self.lens_l = tab.lens.tolist()
        self.sizes_l = self.sizes.tolist()
        self.row_of = {d: r for r, d in enumerate(self.sizes_l)}
        self.fixed_l = self.fixed.tolist()

    @functools.cached_property
    def row_order(self) -> list[list[int]]:
        """Per item, the rows (into ``sizes``) whose memory holds it, cheapest GPU-time first."""
        order = np.argsort(self.gpu_time, axis=0, kind="stable")
        fits = np.take_along_axis(self.ok, order, axis=0)                # [sizes, n], in that order
        return [[r for r, f in zip(rows, oks) if f]
                for rows, oks in zip(order.T.tolist(), fits.T.tolist())]

    @functools.cached_property
    def total_l(self) -> list[list[float]]:
        """Per item, per row: its time alone in a group, fixed cost included (ms)."""
        return self.total.T.tolist()

    @functools.cached_property
    def time_l(self) -> list[list[float]]:
        """Per item, per row: its time (ms)."""
        return self.time.T.tolist()

    def lower_bound(self, items: np.ndarray, m: int) -> float:
        """Valid lower bound (ms) on ``m`` micro-batches running ``items``: every micro-batch pays
        the smallest fixed cost; the longest item's fastest finish and the least GPU-time over N."""
        if len(items) == 0:
            return 0.0
        gt = float(self.gpu_time_min[items].sum())
        return max(float(self.critical[items].max()) + (m - 1) * self.f_min,
                   m * self.f_min + gt / self.n_gpus)

    def memory_minimum(self, items: np.ndarray) -> int:
        """Fewest micro-batches whose memory holds ``items``' tokens (at least 1)."""
        return max(1, math.ceil(int(self.tab.lens[items].sum()) / (self.tab.cm.capacity_tokens * self.n_gpus)))

    def least_ms(self, items: np.ndarray) -> float:
        """Valid lower bound (ms) on any number of micro-batches running ``items``: at least as
        many as their tokens need (:meth:`lower_bound` at that count; bounds grow with the count)."""
        if len(items) == 0:
            return 0.0
        return self.lower_bound(items, self.memory_minimum(items))

    # ------------------------------------------------------------------ one micro-batch
    def choose_sizes(self, items: np.ndarray, level: float) -> np.ndarray | None:
        """Row index (into ``sizes``) of the cheapest size finishing each item within ``level``."""
        allowed = self.ok[:, items] & (self.total[:, items] <= level)
        if not allowed.any(axis=0).all():
            return None
        return np.where(allowed, self.gpu_time[:, items], np.inf).argmin(axis=0)

    def pack(self, items: np.ndarray, level: float) -> list[Group] | None:
        """Groups running ``items`` within ``level`` on at most N GPUs, or None.

        Balanced packing per cheapest size first; when that needs more GPUs than there are (memory
        is tight), the stuffing order, which also uses other sizes' spare room, gets a try."""
        return self._pack_fast(items, level) or self._pack_stuffed(items, level)

    def _backfill(self, mine: np.ndarray, r: int, spare: list, level: float) -> np.ndarray:
        """Place the shortest of ``mine`` (cheapest size row ``r``) into the idle time of larger groups
        already made (``spare``: a heap of (-idle ms, uid, group)); returns the items left."""
        tab = self.tab
        order = mine[np.argsort(self.time[r, mine], kind="stable")]
        for pos, i in enumerate(order.tolist()):
            if not spare:
                return order[pos:]
            _, _, g = spare[0]
            t = self.time_l[i][self.row_of[g.size]]
            idle = level - float(tab.fixed[g.size]) - g.load_ms
            if t > idle + 1e-9 or g.tokens + self.lens_l[i] > tab.cap[g.size]:
                return order[pos:]
            tab.add(g, i)
            heapq.heapreplace(spare, (-(idle - t), g.uid, g))
        return order[:0]

    def _pack_balanced(self, items: np.ndarray, rows: np.ndarray, level: float) -> list[Group] | None:
        tab, groups, used = self.tab, [], 0
        spare: list = []  # larger groups with idle time, most idle first
        lens, time_l = self.lens_l, self.time_l
        for r in np.unique(rows)[::-1].tolist():
            d = self.sizes_l[r]
            mine = self._backfill(items[rows == r], r, spare, level) if spare else items[rows == r]
            if not len(mine):
                continue
            room = level - float(self.fixed[r])
            times = self.time[r, mine]
            order = np.argsort(-times, kind="stable")
            need = max(math.ceil(float(times.sum()) / room - 1e-9),
                       math.ceil(int(tab.lens[mine].sum()) / tab.cap[d]), 1)
            if used + need * d > self.n_gpus:
                return None
            cls = [Group(d) for _ in range(need)]
            heap = [(0.0, k) for k in range(need)]
            cap = tab.cap[d]
            for i in mine[order].tolist():
                t, s_i = time_l[i][r], lens[i]
                popped, placed = [], False
                while heap and len(popped) < _MAX_PROBES:
                    load, k = heapq.heappop(heap)
                    if load + t > room + 1e-9:
                        popped.append((load, k))
                        break  # least-loaded cannot take it: none can
                    g = cls[k]
                    if g.tokens + s_i <= cap:  # Tables.fits and Tables.add, inlined
                        g.seqs.append(i)
                        g.load_ms += t
                        g.tokens += s_i
                        heapq.heappush(heap, (g.load_ms, k))
                        placed = True
                        break
                    popped.append((load, k))
                for item in popped:
                    heapq.heappush(heap, item)
                if not placed:
                    if used + (len(cls) + 1) * d > self.n_gpus:
                        return None
                    g = Group(d, [i], t, s_i)
                    cls.append(g)
                    heapq.heappush(heap, (g.load_ms, len(cls) - 1))
            used += len(cls) * d
            groups += cls
            for g in cls:
                heapq.heappush(spare, (-(room - g.load_ms), g.uid, g))
        return groups

    def min_level(self, items: np.ndarray, hi: float | None = None, rel_tol: float = 5e-3,
                  deadline=None) -> tuple[float, list[Group]] | None:
        """Smallest level (bisection, relative tolerance) at which ``items`` pack; None if none does.

        Bisection with the balanced packing first; then a few probes below its result with the
        stuffing order, which fits lower levels when memory is tight. ``hi``: a level expected to
        be feasible (speeds up the search; checked, not trusted). Past ``deadline`` (if given) the
        bisections stop at the lowest level packed so far (None if none was)."""
        if len(items) == 0:
            return 0.0, []
        if int(self.tab.lens[items].sum()) > self.n_gpus * self.tab.cm.capacity_tokens:
            return None  # more tokens than one micro-batch holds, at any level
        lo = self.lower_bound(items, 1)
        fast = self._bisect(items, lo, hi, rel_tol, self._pack_fast, deadline=deadline)
        if fast is not None and (fast[0] <= lo * (1 + 4 * rel_tol)
                                 or (deadline is not None and deadline.expired())):
            return fast  # at the lower bound already (or out of time): nothing to gain
        stuffed = self._bisect(items, lo, fast[0] if fast else hi, 4 * rel_tol, self._pack_stuffed,
                               max_probes=4, deadline=deadline)
        found = [f for f in (fast, stuffed) if f is not None]
        return min(found, key=lambda f: f[0]) if found else None

    def _pack_fast(self, items: np.ndarray, level: float) -> list[Group] | None:
        rows = self.choose_sizes(items, level)
        return None if rows is None else self._pack_balanced(items, rows, level)

    def _pack_stuffed(self, items: np.ndarray, level: float) -> list[Group] | None:
        if self.choose_sizes(items, level) is None:
            return None
        groups, left = self.stuff(items, level)
        return None if len(left) else groups

    @staticmethod
    def _bisect(items, lo: float, hi: float | None, rel_tol: float, pack, max_probes: int = 64,
                deadline=None):
        best = pack(items, lo)
        if best is not None:
            return lo, best
        hi = hi if hi is not None and hi > lo else 1.2 * lo
        found = pack(items, hi)
        grow = 0
        while found is None:  # grow the bracket by 1.2, 1.44, 1.73, ... (up to 2^9 in all)
            if grow > 12 or (deadline is not None and deadline.expired()):
                return None
            grow += 1
            lo, hi = hi, hi * 1.2 ** grow
            found = pack(items, hi)
        probes = 0
        while hi - lo > rel_tol * hi and probes < max_probes:
            if deadline is not None and deadline.expired():
                break
            mid = 0.5 * (lo + hi)
            g = pack(items, mid)
            probes += 1
            if g is None:
                lo = mid
            else:
                hi, found = mid, g
        return hi, found

    def furthest_first(self, layout: list[list[Group]]) -> list[int]:
        """Indices of ``layout``'s micro-batches, the furthest above their own lower bound
        (:meth:`lower_bound` of their items, one micro-batch) first."""
        return sorted(range(len(layout)), key=lambda j: -self.tab.mb_ms(layout[j]) / max(
            self.lower_bound(mb_items(layout[j]), 1), 1e-9))

    def repack(self, layout: list[list[Group]], deadline, rel_tol: float = 2e-3) -> int:
        """Re-pack micro-batches of ``layout`` in place at their smallest level (:meth:`min_level`),
        those furthest above their own lower bound first, keeping a new packing only when it is
        faster; stops at ``deadline``, within a micro-batch too. Returns how many micro-batches got
        faster."""
        better = 0
        for j in self.furthest_first(layout):
            if deadline.expired():
                break
            items = mb_items(layout[j])
            before = self.tab.mb_ms(layout[j])
            if before <= self.lower_bound(items, 1) * (1 + rel_tol):
                continue
            # (its bisection stops at the deadline too: a micro-batch of 32,768 documents took 1 s)
            found = self.min_level(items, hi=before, rel_tol=rel_tol, deadline=deadline)
            if found is not None and self.tab.mb_ms(found[1]) < before * (1 - 1e-9):
                layout[j] = found[1]
                better += 1
        return better

    def fill_level(self, items: np.ndarray, rest_tokens: int, lo: float, hi: float,
                   rel_tol: float = 2e-3, deadline=None,
                   stuffed: dict[float, tuple[list[Group], np.ndarray]] | None = None) -> float | None:
        """About the smallest level in ``[lo, hi]`` (ms) at which :meth:`stuff` leaves at most
        ``rest_tokens`` tokens of ``items`` out (bisection; a higher level stuffs more), or None
        when even ``hi`` leaves more. Where memory sets the micro-batch count, that is where the
        rest first fits one micro-batch fewer: on a Pareto-tailed step of 2,048 documents at 64
        GPUs (three micro-batches), the rest fit two from 2,420 ms on, which no level of the
        search's grid (2,228 then 2,814 ms) gave, and the plan went from 6.20 to 6.12 s. Past
        ``deadline`` (if given) the bisection stops at the lowest level found that leaves at most
        ``rest_tokens``. ``stuffed``: :meth:`stuff` of ``items`` by level, already made (they
        narrow the bisection's start: most of its probes on 2,048-4,096 documents) and extended
        with the levels probed here, the returned one among them."""
        stuffed = {} if stuffed is None else stuffed
        lens = self.tab.lens

        def fits(level: float) -> bool:
            if level not in stuffed:
                stuffed[level] = self.stuff(items, level)
            return int(lens[stuffed[level][1]].sum()) <= rest_tokens

        if hi <= lo or not fits(hi):
            return None
        if fits(lo):
            return lo
        inside = {level: fits(level) for level in list(stuffed) if lo < level < hi}
        hi = min((level for level, ok in inside.items() if ok), default=hi)
        lo = max((level for level, ok in inside.items() if level < hi and not ok), default=lo)
        while hi - lo > rel_tol * hi and not (deadline is not None and deadline.expired()):
            mid = 0.5 * (lo + hi)
            if fits(mid):
                hi = mid
            else:
                lo = mid
        return hi

    # ------------------------------------------------------------------ stuffing
    def stuff(self, items: np.ndarray, level: float, seed: list[Group] | None = None,
              strict: bool = False, open_first: bool = False) -> tuple[list[Group], np.ndarray]:
        """Fill one micro-batch at ``level`` with as much work as fits, hardest items first.

        Returns its groups and the items left out. Items are taken in decreasing order of their
        fastest finish; each goes to the least-loaded group of its cheapest feasible size that has
        room, else opens a group of that size while GPUs remain, else tries the next sizes.
        ``seed``: groups the micro-batch starts with (they are filled further and returned first);
        ``strict``: stop at the first item left out (it and the items after it are returned left).
        ``open_first``: an item goes to an open group of any size it fits (its cheapest sizes
        first) before it opens a new one: the time a long sequence's group has left within the
        level is paid for whether or not it is used, and the GPUs kept free take later items.
        """
        tab = self.tab
        lens, cap, lens_min = self.lens_l, tab.cap, tab.lens
        order = items[np.argsort(-self.critical[items], kind="stable")].tolist()
        # per size: groups by load (least first) and, once one refused an item for memory, by free
        # tokens (most first); each group leaves the load heap at most once, so this is O(n log n)
        by_load: list[list] = [[] for _ in self.sizes_l]  # per size row
        by_room: list[list] = [[] for _ in self.sizes_l]
        made: list[Group] = list(seed or ())
        for g in made:
            heapq.heappush(by_load[self.row_of[g.size]], (g.load_ms, g.uid, g))
        free = self.n_gpus - sum(g.size for g in made)
        left = []
        refused = 0
        token_room = free * tab.cm.capacity_tokens + sum(tab.cap[g.size] - g.tokens for g in made)
        shortest = int(lens_min[items].min()) if len(items) else 0
        sizes, row_order, total_l, time_l = self.sizes_l, self.row_order, self.total_l, self.time_l
        caps = [cap[d] for d in sizes]
        rooms = [level - f + 1e-9 for f in self.fixed_l]  # each size's time within the level
        for pos, i in enumerate(order):
            if (refused >= _FULL_AFTER and free == 0) or token_room < shortest:
                left += order[pos:]
                break
            tot, tim, s_i = total_l[i], time_l[i], lens[i]
            placed = False
            rows = row_order[i]
            for pos_r, r in enumerate(rows * 2 if open_first else rows):
                if tot[r] > level:
                    continue
                d, c, room, t = sizes[r], caps[r], rooms[r], tim[r]
                heap, side = by_load[r], by_room[r]
                into = None  # the heap whose top group takes the item
                while heap and heap[0][0] + t <= room:
                    if heap[0][2].tokens + s_i <= c:
                        into = heap
                        break
                    g = heapq.heappop(heap)[2]
                    heapq.heappush(side, (g.tokens - c, g.uid, g))
                if into is None and side and -side[0][0] >= s_i and side[0][2].load_ms + t <= room:
                    into = side
                if into is not None:  # Tables.add, inlined; the group stays at its heap's top or sinks
                    g = into[0][2]
                    g.seqs.append(i)
                    g.load_ms += t
                    g.tokens += s_i
                    heapq.heapreplace(into, (g.load_ms if into is heap else g.tokens - c, g.uid, g))
                    placed = True
                    break
                if open_first and pos_r < len(rows):  # open groups of every size first
                    continue
                if free >= d:
                    g = Group(d, [i], t, s_i)
                    made.append(g)
                    heapq.heappush(heap, (g.load_ms, g.uid, g))
                    free -= d
                    placed = True
                    break
            if not placed:
                if strict:
                    left += order[pos:]
                    break
                left.append(i)
                refused += 1
            else:
                refused = 0
                token_room -= lens[i]
        return made, np.array(left, dtype=np.int64)
