"""Mutable working layout shared by every strategy, and its conversion to a :class:`StepPlan`.

A layout is a list of micro-batches, each a list of :class:`Group` (size, sequences, load). All
strategies build layouts with the same helpers, so the baselines get the same packing care as ours.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np

from megatron_flexsp.cost_model import CostModel
from megatron_flexsp.plan import GroupPlan, MicroBatchPlan, StepPlan
from megatron_flexsp.topology import place_groups


_uid = itertools.count()


@dataclass(eq=False)
class Group:
    """A group being filled: ``load_ms`` excludes the fixed per-group cost.

    ``uid`` orders groups by creation and breaks ties deterministically.
    """

    size: int
    seqs: list[int] = field(default_factory=list)
    load_ms: float = 0.0
    tokens: int = 0
    uid: int = field(default_factory=lambda: next(_uid))


class GroupIndex:
    """Groups indexed by (micro-batch, size), least-loaded first (heaps with lazy invalidation).

    Call :meth:`touch` after a group's load changes. ``best_fit`` returns the least-loaded group of a
    (micro-batch, size) class with memory room for a sequence, in O(log n) amortised when memory is
    not the binding constraint. Each class keeps an upper bound on its groups' free memory
    (raised by :meth:`touch`, set exactly when a search has seen every group), so a class with no
    room for a sequence is passed over without a probe: on memory-bound steps most probes found
    none (27-38 thousand of 46-58 thousand in a 64-GPU plan at 1 s).
    """

    def __init__(self, tab: "Tables") -> None:
        self.tab = tab
        self.heaps: dict[tuple[int, int], list] = {}
        self.version: dict[int, int] = {}
        self.where: dict[int, int] = {}
        self.room: dict[tuple[int, int], int] = {}  # tokens: at least any live group's free memory

    def add(self, j: int, g: Group) -> None:
        self.where[g.uid] = j
        self.touch(g)

    def touch(self, g: Group) -> None:
        v = self.version.get(g.uid, 0) + 1
        self.version[g.uid] = v
        key = (self.where[g.uid], g.size)
        free = self.tab.cap[g.size] - g.tokens
        if free > self.room.get(key, free - 1):  # (a group over its memory has none: negative)
            self.room[key] = free
        heapq.heappush(self.heaps.setdefault(key, []), (g.load_ms, g.uid, v, g))

    def classes(self):
        return self.heaps.keys()

    def best_fit(self, key: tuple[int, int], i: int, exclude: Group | None = None,
                 max_probes: int | None = None) -> Group | None:
        """``max_probes``: give up (None) after that many live groups without room."""
        heap = self.heaps.get(key)
        if not heap or self.room[key] < self.tab._lens_l[i]:
            return None
        popped, found = [], None
        while heap and (max_probes is None or len(popped) < max_probes):
            item = heapq.heappop(heap)
            _, uid, v, g = item
            if self.version.get(uid) != v:
                continue  # stale entry
            popped.append(item)
            if g is not exclude and self.tab.fits(g, i):
                found = g
                break
        if not heap and found is None:  # every live group seen: the class's room is known
            cap = self.tab.cap[key[1]]
            self.room[key] = max((cap - item[3].tokens for item in popped), default=-1)
        for item in popped:
            heapq.heappush(heap, item)
        return found


#: seconds one pass over a layout takes per sequence and per micro-batch (its spans and free
#: memory, the local search's classes: 0.1 s for 65,536 micro-batches of one document each on a
#: 2-core Xeon): the phases after the search start no step over a whole layout with less time left
PASS_S_PER_ITEM = 2e-6


class Tables:
    """Per-size sequence times and per-size fixed costs for one batch (ms)."""

    def __init__(self, lens: np.ndarray, cm: CostModel) -> None:
        self.lens = np.asarray(lens, dtype=np.int64)
        self.cm = cm
        self.sizes = list(cm.sizes)
        self.time = {d: cm.seq_time_ms(self.lens, d) for d in self.sizes}
        self.fixed = {d: cm.group_fixed_ms(d) for d in self.sizes}
        self.cap = {d: cm.group_capacity_tokens(d) for d in self.sizes}
        self.min_size = cm.min_group_sizes(self.lens)
        self._critical: np.ndarray | None = None
        # plain-Python copies for the per-sequence updates below (a NumPy scalar read costs more
        # than the rest of an update)
        self._time_l = {d: self.time[d].tolist() for d in self.sizes}
        self._lens_l = self.lens.tolist()

    def critical_ms(self) -> np.ndarray:
        """Fastest finish of each sequence alone (ms): the least time + fixed cost over the sizes
        whose memory holds it (inf when none does)."""
        if self._critical is None:
            best = np.full(len(self.lens), np.inf)
            for d in self.sizes:
                ok = self.lens <= self.cap[d]
                best = np.where(ok, np.minimum(best, self.time[d] + self.fixed[d]), best)
            self._critical = best
        return self._critical

    def least_gpu_time_ms(self) -> np.ndarray:
        """Per sequence, the smallest GPU-time (size x time, GPU-ms) any feasible group gives."""
        best = np.full(len(self.lens), np.inf)
        for d in self.sizes:
            ok = self.lens <= self.cap[d]
            best = np.where(ok, np.minimum(best, d * self.time[d]), best)
        return best

    def area_min_ms(self) -> float:
        """Sum over sequences of the smallest GPU-time (size x time) any feasible group gives."""
        return float(self.least_gpu_time_ms().sum())

    def finish(self, g: Group) -> float:
        return self.fixed[g.size] + g.load_ms if g.seqs else 0.0

    def fits(self, g: Group, i: int) -> bool:
        return g.tokens + self._lens_l[i] <= self.cap[g.size]

    def add(self, g: Group, i: int) -> None:
        i = int(i)
        g.seqs.append(i)
        g.load_ms += self._time_l[g.size][i]
        g.tokens += self._lens_l[i]

    def remove(self, g: Group, i: int) -> None:
        i = int(i)
        g.seqs.remove(i)
        g.load_ms -= self._time_l[g.size][i]
        g.tokens -= self._lens_l[i]

    def clone(self, g: Group) -> Group:
        """A new group of the same size holding the same sequences (its load and tokens summed
        afresh, in the same order as :meth:`add` would; not ``sum()``, whose compensated float
        sum in Python 3.12 can differ from :meth:`add`'s in the last bit)."""
        c = Group(g.size)
        times, lens = self._time_l[g.size], self._lens_l
        load, tokens = 0.0, 0
        for i in g.seqs:
            i = int(i)
            c.seqs.append(i)
            load += times[i]
            tokens += lens[i]
        c.load_ms, c.tokens = load, tokens
        return c

    def clone_layout(self, layout: list[list[Group]]) -> list[list[Group]]:
        """A copy of ``layout`` whose groups (:meth:`clone`) can change without touching it."""
        return [[self.clone(g) for g in mb] for mb in layout]

    def mb_ms(self, groups: list[Group]) -> float:
        return max((self.finish(g) for g in groups), default=0.0)

    def step_ms(self, layout: list[list[Group]]) -> float:
        return float(sum(self.mb_ms(mb) for mb in layout))


def room_for_a_pass(deadline, tab: Tables, layout: list[list[Group]]) -> bool:
    """Whether ``deadline`` leaves the time one pass over ``layout`` takes
    (:data:`PASS_S_PER_ITEM` per sequence of ``tab`` and per micro-batch): a step that passes over
    the whole layout is not started without it."""
    return deadline.left() >= PASS_S_PER_ITEM * (len(tab.lens) + len(layout))


def mb_items(mb: list[Group]) -> np.ndarray:
    """The sequence indices one micro-batch's groups run (int64, group by group)."""
    return np.array([i for g in mb for i in g.seqs], dtype=np.int64)


def pack_lpt(items, groups: list[Group], tab: Tables) -> list[int]:
    """Place ``items`` longest-first, each on the group where it finishes earliest and fits in memory.

    Ties go to the earlier-created group (deterministic). Returns the items that fit nowhere
    (empty when all were placed).
    """
    left = []
    index = GroupIndex(tab)
    for g in groups:
        index.add(0, g)
    keys = sorted(index.classes())
    for i in sorted(items, key=lambda i: (-int(tab.lens[i]), i)):
        best, best_key = None, None
        for key in keys:
            g = index.best_fit(key, i)
            if g is not None:
                k = (tab.fixed[g.size] + g.load_ms + float(tab.time[g.size][i]), g.uid)
                if best_key is None or k < best_key:
                    best, best_key = g, k
        if best is None:
            left.append(i)
            continue
        tab.add(best, i)
        index.touch(best)
    return left


def improve_layout(layout: list[list[Group]], tab: Tables, max_moves: int = 400, deadline=None,
                   sources: int = 8, items_per_group: int = 6, targets: int | None = None) -> None:
    """Local search: move sequences off the slowest group of a micro-batch while the step time drops.

    Each round looks at the ``sources`` micro-batches whose slowest group stands out most above
    their next slowest, the ``items_per_group`` longest-running sequences of that group, and as
    destinations the least-loaded fitting group of every (micro-batch, size) class of the same
    micro-batch and of the ``targets`` micro-batches with the shortest makespan (None: every
    micro-batch); the move with the largest step-time reduction is applied. A class is probed for
    room only when its least load could beat the best move so far, so a round costs
    O(sources x items x classes) cheap bounds and few probes; each micro-batch's two slowest
    finishes are kept and recomputed only for the two micro-batches a move changes (2.6x faster
    on 15 common-level layouts, the same moves). Each move strictly lowers the step
    time, so this terminates; ``deadline`` (an object with ``expired()``) stops it early. Empty
    groups and micro-batches are removed. Every micro-batch as a destination instead of the four
    shortest: on the paired benchmark's 56 batches at 64 GPUs, plans -0.06% to -0.22% at 1 s and
    -0.17% to -0.21% at 4 s over two runs (31-37 faster, 5-11 slower).
    """
    for mb in layout:
        mb[:] = [g for g in mb if g.seqs]
    layout[:] = [mb for mb in layout if mb]
    index = GroupIndex(tab)
    for j, mb in enumerate(layout):
        for g in mb:
            index.add(j, g)
    sizes = sorted(tab.sizes)
    spans = [tab.mb_ms(mb) for mb in layout]
    time_l, fixed = tab._time_l, tab.fixed
    # groups never change micro-batch here, so each micro-batch's classes (and their heaps, updated
    # in place) are fixed: (micro-batch, size, fixed cost, times on that size, heap) by micro-batch
    classes = [[(b, d, fixed[d], time_l[d], index.heaps[(b, d)]) for d in sizes if (b, d) in index.heaps]
               for b in range(len(layout))]
    heads = [_head(mb, tab) for mb in layout]  # (slowest finish, next slowest, slowest group)
    for _ in range(max_moves):
        if deadline is not None and deadline.expired():
            break
        order = sorted(((h[0] - h[1], a) for a, h in enumerate(heads)), reverse=True)
        light = sorted(range(len(layout)), key=lambda b: (spans[b], b))[:targets]  # None: all
        best = None  # (gain, item, from_group, to_group, from_mb, to_mb)
        for _, a in order[:sources]:
            if deadline is not None and deadline.expired():
                break  # a round over thousands of micro-batches takes 0.1 s: the best move so far
            _, others_a, slow = heads[a]
            span_a, slow_end, slow_time = spans[a], tab.finish(slow), time_l[slow.size]
            moved = sorted(slow.seqs, key=lambda i: -slow_time[i])[:items_per_group]
            dests = [c for b in dict.fromkeys([a] + light) for c in classes[b]]
            for i in moved:
                rest = slow_end - slow_time[i] if len(slow.seqs) > 1 else 0.0
                new_a = max(others_a, rest)
                for b, d, f_d, times, heap in dests:
                    if not heap:
                        continue
                    # the heap's top load is at most any group's of the class (every group has an
                    # entry with its current load): a bound on the gain, to skip classes that
                    # cannot beat the best move so far without probing their groups for room
                    t = f_d + heap[0][0] + times[i]
                    bound = span_a - max(new_a, t) if b == a else span_a - new_a - max(0.0, t - spans[b])
                    if bound <= 1e-9 or (best is not None and bound <= best[0] + 1e-12):
                        continue
                    g = index.best_fit((b, d), i, exclude=slow)
                    if g is None:
                        continue
                    t = f_d + g.load_ms + times[i]
                    gain = span_a - max(new_a, t) if b == a else span_a - new_a - max(0.0, t - spans[b])
                    if gain > 1e-9 and (best is None or gain > best[0] + 1e-12):
                        best = (gain, i, slow, g, a, b)
        if best is None:
            break
        _, i, src, dst, a, b = best
        tab.remove(src, i)
        tab.add(dst, i)
        index.touch(src)
        index.touch(dst)
        for j in {a, b}:
            heads[j] = _head(layout[j], tab)
            spans[j] = heads[j][0]
    for mb in layout:
        mb[:] = [g for g in mb if g.seqs]
    layout[:] = [mb for mb in layout if mb]


def _head(mb: list[Group], tab: Tables) -> tuple[float, float, Group]:
    """A micro-batch's slowest finish (ms), the next slowest (ms; 0 for one group) and its slowest
    group (the first of the largest finish, the smaller size first among equal finishes)."""
    top, second, slow = -1.0, 0.0, None
    for g in mb:
        f = tab.finish(g)
        if slow is None or f > top or (f == top and g.size < slow.size):
            if slow is not None:
                second = max(second, top)
            top, slow = f, g
        else:
            second = max(second, f)
    return top, second, slow


def to_step_plan(layout: list[list[Group]], tab: Tables, *, strategy: str, method: str,
                 lower_bound_ms: float = 0.0, solve_time_s: float = 0.0, info: dict | None = None,
                 **extra) -> StepPlan:
    """Place every micro-batch's groups on ranks (node-aligned) and attach predicted times."""
    mbs = []
    placed: dict[tuple[int, ...], tuple[list, list[int]]] = {}  # group sizes -> ranks, rank order
    for mb in layout:
        groups = [g for g in mb if g.seqs]
        if not groups:
            continue
        sizes = tuple([g.size for g in groups])
        if sizes not in placed:  # (65,536 micro-batches of one group: 0.5 s placed one by one)
            ranks = place_groups(list(sizes), tab.cm.cluster)
            placed[sizes] = ranks, sorted(range(len(groups)), key=lambda k: ranks[k][0])
        ranks, order = placed[sizes]
        mbs.append(MicroBatchPlan(tuple([GroupPlan(ranks[k], tuple(map(int, groups[k].seqs)),
                                                   tab.finish(groups[k])) for k in order])))
    step = float(sum(mb.predicted_ms for mb in mbs))
    return StepPlan(num_gpus=tab.cm.cluster.num_gpus, gpus_per_node=tab.cm.cluster.gpus_per_node,
                    seq_lens=tuple(tab.lens.tolist()), micro_batches=tuple(mbs),
                    strategy=strategy, method=method, predicted_step_ms=step,
                    lower_bound_ms=lower_bound_ms, solve_time_s=solve_time_s, info=info or {},
                    tensor_parallel=tab.cm.parallel.tp, **extra)
