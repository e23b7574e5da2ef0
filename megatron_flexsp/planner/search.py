"""The fast step search: families of whole-step layouts, each in polynomial time.

Six families of candidate layouts, in this order; all but the first and the fifth are built
from the one-micro-batch packing of :class:`~megatron_flexsp.planner.level.LevelPacker` (nothing
branches per micro-batch):

* **groups first** (:mod:`planner.groups_first`): sequences packed into groups by memory, groups
  into micro-batches by time; strong when memory sets the micro-batch count.
* **shelves** (:mod:`planner.shelves`): micro-batches stuffed one after another, each at a level
  chosen for it (the base levels, the hardest sequences' finish times, a grid above), by two
  scores; strong where a few long sequences want slower, denser micro-batches of their own.
* **common level** ``T``: micro-batches are stuffed one after another, hardest sequences first, each
  at the level ``max(T, fastest finish of its hardest remaining sequence)``; ``T`` runs over a
  geometric grid and is then refined around the best point. In good plans every micro-batch but
  the last has about the same makespan, which is what one common level gives.
* **stuffed first, split rest** (or **packed groups first**): the first micro-batch stuffed at a
  level ``T1`` from a small grid above the longest sequence's fastest finish, or at the level where
  the rest first fits one micro-batch fewer than the memory minimum
  (:meth:`~megatron_flexsp.planner.level.LevelPacker.fill_level`), the rest split as below into
  ``m - 1``, or packed by memory as in the first family (where memory sets the count).
* **best fit** (:mod:`planner.best_fit`, only where the batch fits one micro-batch's memory): one
  micro-batch, longest sequences first into the group with the least time left at a common level,
  new groups of one base size; strong with few sequences per GPU.
* **balanced split** into ``m`` micro-batches: sequences heaviest first (least GPU-time over the sizes
  that hold them) to the lightest micro-batch with token room, then each micro-batch packed at its
  smallest level (bisection). This mixes long and short sequences in every micro-batch, so memory
  and time fill together when memory sets the micro-batch count.

Each family gets a share of the time left (a quarter, a third, half, two thirds, a quarter where it
runs, half), and a
layout being built is given up once the micro-batches made and a lower bound on the rest are
:data:`PRUNE` above the best layout so far. Costs: a common level is O(n log n) per level, a shelf
O(candidates x n log n), a split O(n log m) plus one bisection (about 15 packings) per micro-batch,
a best fit O(n x groups) per packing and one bisection per base size;
levels are searched on fixed grids, so the total is polynomial in sequences, micro-batches and group
sizes. Every loop checks the :class:`Deadline`.
"""

from __future__ import annotations

import math
import time

import numpy as np

from megatron_flexsp.planner.best_fit import best_fit_micro_batch
from megatron_flexsp.planner.groups_first import bin_sizes, groups_first, longest_first, opening_sizes, pack_opening
from megatron_flexsp.planner.layout import Group, Tables, drain_micro_batches
from megatron_flexsp.planner.level import LevelPacker
from megatron_flexsp.planner.shelves import SCORES, ShelfPlanner

Layout = list[list[Group]]
#: A layout being built is given up once it is sure to end this much above the best so far (a
#: little above: the best layouts are polished afterwards, which may reorder them).
PRUNE = 0.02
#: :func:`balanced_split` loops in plain Python up to this many micro-batches, with NumPy above
_SPLIT_LOOP_MAX = 16


class Deadline:
    """A wall-clock deadline ``seconds`` from now (``math.inf``: none)."""

    def __init__(self, seconds: float = math.inf) -> None:
        self.start = time.perf_counter()
        self.end = self.start + seconds

    def left(self) -> float:
        """Seconds left (negative once passed)."""
        return self.end - time.perf_counter()

    def expired(self) -> bool:
        return time.perf_counter() >= self.end

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def capped(self, end: float) -> "Deadline":
        """The same clock ending at ``end`` (a ``time.perf_counter()`` value) or at this deadline,
        whichever comes first."""
        sub = Deadline(0.0)
        sub.start, sub.end = self.start, min(self.end, end)
        return sub


def common_level(packer: LevelPacker, items: np.ndarray, level: float, max_mbs: int,
                 give_up_ms: float = math.inf) -> Layout | None:
    """Micro-batches stuffed one after another at ``max(level, hardest remaining fastest finish)``;
    None when more than ``max_mbs`` would be needed, or once the micro-batches so far and a lower
    bound on the rest reach ``give_up_ms``."""
    layout: Layout = []
    left = items
    done = 0.0
    while len(left):
        if len(layout) >= max_mbs:
            return None
        groups, left = packer.stuff(left, max(level, float(packer.critical[left].max())))
        if not groups:
            return None
        layout.append(groups)
        done += packer.tab.mb_ms(groups)
        if done + packer.least_ms(left) >= give_up_ms:
            return None
    return layout


def balanced_split(tab: Tables, items: np.ndarray, m: int, weight: np.ndarray) -> list[np.ndarray] | None:
    """``items`` into ``m`` micro-batches balanced in both GPU-time (``weight``) and tokens: each
    sequence, the largest share first, goes where the larger of the two shares (load over the mean
    load, tokens over the mean tokens) stays least, within the token capacity of one micro-batch
    (``N x C``). None when some sequence finds no room."""
    cap = tab.cm.capacity_tokens * tab.cm.cluster.num_gpus
    lens = tab.lens[items].astype(np.float64)
    w = weight[items]
    mean_w, mean_s = max(float(w.sum()) / m, 1e-12), max(float(lens.sum()) / m, 1e-12)
    order = np.argsort(-np.maximum(w / mean_w, lens / mean_s), kind="stable")
    out: list[list[int]] = [[] for _ in range(m)]
    if m > _SPLIT_LOOP_MAX:
        load, tokens = np.zeros(m), np.zeros(m)
        for k in order.tolist():
            s_k, w_k = lens[k], w[k]
            share = np.maximum((load + w_k) / mean_w, (tokens + s_k) / mean_s)
            share[tokens + s_k > cap] = np.inf
            j = int(np.argmin(share))
            if not np.isfinite(share[j]):
                return None
            out[j].append(int(items[k]))
            load[j] += w_k
            tokens[j] += s_k
        return [np.array(x, dtype=np.int64) for x in out if x]
    # the same choices in plain Python (NumPy's per-call cost dominates for a few micro-batches)
    load_l, tokens_l = [0.0] * m, [0.0] * m
    lens_l, w_l, items_l = lens.tolist(), w.tolist(), items.tolist()
    for k in order.tolist():
        s_k, w_k = lens_l[k], w_l[k]
        j, least = -1, math.inf
        for q in range(m):
            if tokens_l[q] + s_k <= cap:
                v = max((load_l[q] + w_k) / mean_w, (tokens_l[q] + s_k) / mean_s)
                if v < least:
                    j, least = q, v
        if j < 0 or not math.isfinite(least):
            return None
        out[j].append(items_l[k])
        load_l[j] += w_k
        tokens_l[j] += s_k
    return [np.array(x, dtype=np.int64) for x in out if x]


def pack_each(packer: LevelPacker, parts: list[np.ndarray], deadline: Deadline,
              give_up_ms: float = math.inf) -> Layout | None:
    """Each part as one micro-batch at its smallest level. A part that does not pack (its groups'
    memory fragments) keeps its hardest sequences up to a shrinking share of the micro-batch's tokens;
    what it sheds goes into extra micro-batches at the common level of the others. None when the
    deadline passes, or once the parts packed so far and the others' lower bounds reach
    ``give_up_ms``."""
    layout: Layout = []
    spill: list[np.ndarray] = []
    cap = packer.tab.cm.capacity_tokens * packer.n_gpus
    lens = packer.tab.lens
    ahead = [packer.lower_bound(part, 1) for part in parts]
    done = 0.0
    for k, part in enumerate(parts):
        if deadline.expired() or done + sum(ahead[k:]) >= give_up_ms:
            return None
        found = packer.min_level(part, rel_tol=1e-2)
        if found is None:
            order = part[np.argsort(-packer.critical[part], kind="stable")]
            room = np.cumsum(lens[order])
            for share in (0.95, 0.9, 0.8, 0.65, 0.5):
                keep = order[room <= share * cap]
                found = packer.min_level(keep, rel_tol=1e-2) if len(keep) else None
                if found is not None:
                    spill.append(order[len(keep):])
                    break
            if found is None:
                return None
        layout.append(found[1])
        done += packer.tab.mb_ms(found[1])
    if spill:
        level = float(np.median([packer.tab.mb_ms(mb) for mb in layout])) if layout else 0.0
        extra = common_level(packer, np.concatenate(spill), level, 4 * len(parts) + 4)
        if extra is None:
            return None
        layout += extra
    return layout


def split_pack(packer: LevelPacker, items: np.ndarray, m: int, deadline: Deadline,
               give_up_ms: float = math.inf) -> Layout | None:
    """:func:`balanced_split` into ``m`` micro-batches, then :func:`pack_each`."""
    parts = balanced_split(packer.tab, items, m, packer.gpu_time_min)
    return pack_each(packer, parts, deadline, give_up_ms) if parts is not None else None


def best_split(packer: LevelPacker, items: np.ndarray, deadline: Deadline, around: int = 0,
               prefix_ms: float = 0.0, upper_ms: float = math.inf) -> tuple[float, int, Layout | None]:
    """The best :func:`split_pack` over micro-batch counts: from the memory minimum (or ``around``,
    when given, and its neighbours) upwards in growing steps while it improves, then the neighbours
    of the best count. Returns (step ms including ``prefix_ms``, count, layout)."""
    tab = packer.tab
    if not len(items):
        return prefix_ms, 0, []
    m_lo = max(1, math.ceil(int(tab.lens[items].sum()) / (tab.cm.capacity_tokens * packer.n_gpus)))
    area = float(packer.gpu_time_min[items].sum()) / packer.n_gpus
    seen: dict[int, tuple[float, Layout | None]] = {}

    def evaluate(m: int) -> float:
        if m < m_lo or m in seen:
            return seen[m][0] if m in seen else math.inf
        if deadline.expired() or prefix_ms + m * packer.f_min + area >= upper_ms:
            seen[m] = (math.inf, None)
            return math.inf
        layout = split_pack(packer, items, m, deadline, give_up_ms=upper_ms * (1 + PRUNE) - prefix_ms)
        seen[m] = (prefix_ms + tab.step_ms(layout) if layout is not None else math.inf, layout)
        return seen[m][0]

    if around:
        for m in (around - 1, around, around + 1):
            evaluate(m)
    else:
        step, m, worse = 1, m_lo, 0
        while worse < 2 and not deadline.expired():
            before = min((v[0] for v in seen.values()), default=math.inf)
            if evaluate(m) >= before:
                worse += 1
            else:
                worse = 0
            m, step = m + step, step * 2
    if not seen:
        return math.inf, 0, None
    best = min(seen, key=lambda k: seen[k][0])
    for m in (best - 1, best + 1, best - 2, best + 2):
        evaluate(m)
    best = min(seen, key=lambda k: seen[k][0])
    return seen[best][0], best, seen[best][1]


def level_grid(lo: float, hi: float, points: int) -> list[float]:
    """``points`` levels spaced geometrically from ``lo`` to ``hi``."""
    if hi <= lo * (1 + 1e-9) or points < 2:
        return [lo]
    return [lo * (hi / lo) ** (k / (points - 1)) for k in range(points)]


def base_range(packer: LevelPacker, m_min: int) -> tuple[float, float]:
    """The range (ms) of the search's base levels: from the level of 1.4x the memory minimum
    ``m_min`` of balanced micro-batches to 1.25x the level of the memory minimum (or of the hardest
    sequence's fastest finish, if higher)."""
    n_gpus, f_min = packer.n_gpus, packer.f_min
    area = float(packer.gpu_time_min.sum())
    lo = f_min + area / (n_gpus * (1.4 * m_min + 2))
    return lo, max(float(packer.critical.max()), f_min + area / (n_gpus * m_min)) * 1.25


def first_levels(packer: LevelPacker, items: np.ndarray, lo: float, hi: float, grid: int = 5,
                 hardest: int = 4) -> list[float]:
    """Levels for a stuffed first micro-batch: a geometric grid from ``lo`` to ``hi`` plus every
    size's finish time of the ``hardest`` sequences within it (where their cheapest size changes)."""
    top = items[np.argsort(-packer.critical[items], kind="stable")[:hardest]]
    times = packer.total[:, top][packer.ok[:, top]]
    return sorted(set(level_grid(lo, hi, grid)) | {float(t) for t in times if t >= lo})


def groups_first_layouts(tab: Tables, items: np.ndarray, deadline: Deadline) -> list[Layout]:
    """Groups-first layouts of the sequences ``items`` (:mod:`planner.groups_first`), drained: the
    best of open groups of one or two GPUs with sequences at their smallest size or, under a level
    from a short grid above the hardest one's fastest finish, at the cheapest size finishing them
    within it; and one with memory spread evenly over as many micro-batches as the plain packing
    needed (when that leaves over 2% free). Milliseconds each; none once ``deadline`` has passed."""
    crit = float(tab.critical_ms()[items].max())
    packed = []
    order = longest_first(tab, items)
    seen = set()  # the groups' opening sizes: equal ones give the same layout (packed once)
    for level in [math.inf] + level_grid(crit, 3 * crit, 4):
        for bin_size in bin_sizes(tab)[:2]:
            if deadline.expired():
                break
            opens = opening_sizes(tab, bin_size, level, order)
            key = opens.tobytes()
            if key in seen:
                continue
            seen.add(key)
            layout = pack_opening(tab, order, opens)
            packed.append((tab.step_ms(layout), len(packed), layout))
    if not packed:
        return []
    chosen = [min(packed)[2]]
    room = len(packed[0][2]) * tab.cm.cluster.num_gpus * tab.cm.capacity_tokens
    fill = int(tab.lens[items].sum()) / room
    if fill < 0.98 and not deadline.expired():
        chosen.append(groups_first(tab, bin_sizes(tab)[0], fill=fill, items=items))
    for layout in chosen:
        drain_micro_batches(layout, tab, deadline=deadline, tries=8)
    return chosen


def search_step(tab: Tables, packer: LevelPacker, *, m_min: int, upper_ms: float, deadline: Deadline,
                grid: int = 8, times: dict | None = None) -> list[tuple[float, str, Layout]]:
    """Candidate layouts of the whole batch (see the module docstring), each with its step time
    (ms) and family name; only those faster than ``upper_ms``. Each family is capped so that a
    short deadline still leaves time to the next. ``times`` (if given) gets the seconds each
    family took."""
    n_gpus = tab.cm.cluster.num_gpus
    items = np.arange(len(tab.lens))
    f_min = packer.f_min
    area = float(packer.gpu_time_min.sum())
    crit = float(packer.critical.max())
    out: list[tuple[float, str, Layout]] = []
    best = upper_ms

    clock = [time.perf_counter()]

    def keep(layout: Layout | None, name: str) -> None:
        nonlocal best
        now = time.perf_counter()
        if times is not None:
            times[name] = times.get(name, 0.0) + now - clock[0]
        clock[0] = now
        if layout is None:
            return
        ms = tab.step_ms(layout)
        if ms < upper_ms:
            out.append((ms, name, layout))
            best = min(best, ms)

    # 0. groups first (milliseconds each): open groups of one or two GPUs, sequences at their
    #    smallest size or, under a level from a short grid above the hardest sequence's fastest
    #    finish, the cheapest size that finishes them within it. The best of these, and one with
    #    memory spread evenly over as many micro-batches as the plain packing needed, then empty
    #    their shortest micro-batches into the others' free memory
    #    (a quarter of the search's time at most, so the other families always get the rest)
    own = deadline.capped(time.perf_counter() + deadline.left() / 4)
    for layout in groups_first_layouts(tab, items, own):
        keep(layout, "groups-first")
    lo, hi = base_range(packer, m_min)
    # 1. shelves: each micro-batch at its own level, by both scores (a third of the time left)
    shelf = ShelfPlanner(packer)
    own = deadline.capped(time.perf_counter() + deadline.left() / 3)
    for score in SCORES:
        keep(shelf.layout(items, level_grid(lo, hi, grid), score, own, give_up_ms=best * (1 + PRUNE)), "shelves")
    # 2. common level: every micro-batch at one of the base levels (then refined around the best;
    #    half the time left)
    tried: dict[float, float] = {}
    cap_mbs = 4 * m_min + 8
    own = deadline.capped(time.perf_counter() + deadline.left() / 2)
    for level in level_grid(lo, hi, grid):
        if own.expired():
            break
        layout = common_level(packer, items, level, cap_mbs, give_up_ms=best * (1 + PRUNE))
        tried[level] = tab.step_ms(layout) if layout is not None else math.inf
        keep(layout, "level")
    if tried and math.isfinite(min(tried.values())):  # refine around the best grid point
        levels = sorted(tried)
        k = min(range(len(levels)), key=lambda j: tried[levels[j]])
        a, b = levels[max(k - 1, 0)], levels[min(k + 1, len(levels) - 1)]
        for level in level_grid(a, b, 6)[1:-1]:
            if own.expired():
                break
            keep(common_level(packer, items, level, cap_mbs, give_up_ms=best * (1 + PRUNE)), "level")
    # 3. the first micro-batch stuffed at a level where the hardest sequences' sizes change, the
    #    rest packed groups first and split at its memory minimum (one more when that does not
    #    pack); the levels are tried
    #    in the order of a cheap estimate (the first micro-batch plus the rest's simple bound);
    #    two thirds of the time left, the rest for the balanced split
    own = deadline.capped(time.perf_counter() + deadline.left() * 2 / 3)
    firsts = []
    top = max(crit, 2 * (f_min + area / (n_gpus * m_min)))
    levels = set(first_levels(packer, items, crit, top))
    mb_tokens = tab.cm.capacity_tokens * n_gpus
    if m_min > 1:  # where the rest first fits one micro-batch fewer (memory full, or 2% free)
        for share in (1.0, 0.98):
            fits = packer.fill_level(items, int(share * (m_min - 1) * mb_tokens), crit, top, deadline=own)
            if fits is not None:
                levels.add(fits)
    for t1 in sorted(levels):
        if own.expired():
            break
        first, left = packer.stuff(items, t1)
        if not first or not len(left):
            continue
        m_rest = max(1, math.ceil(int(tab.lens[left].sum()) / mb_tokens))
        estimate = tab.mb_ms(first) + m_rest * f_min + float(packer.gpu_time_min[left].sum()) / n_gpus
        firsts.append((estimate, t1, first, left, m_rest))
    for estimate, t1, first, left, m_rest in sorted(firsts, key=lambda f: f[:2]):
        if own.expired():
            break
        if estimate >= best:
            continue
        for tail in groups_first_layouts(tab, left, own):  # the rest packed by memory
            keep([[tab.clone(g) for g in first]] + tail, "stuffed+groups")
        for m in (m_rest, m_rest + 1):
            rest = split_pack(packer, left, m, own, give_up_ms=best * (1 + PRUNE) - tab.mb_ms(first))
            if rest is not None:
                keep([first] + rest, "stuffed+split")
                break
    # 4. one micro-batch packed best fit, where memory allows one (a quarter of the time left)
    if m_min == 1:
        own = deadline.capped(time.perf_counter() + deadline.left() / 4)
        mb = best_fit_micro_batch(tab, items, own, best)
        keep([mb] if mb else None, "best-fit")
    # 5. balanced split over micro-batch counts (half the time left: the rest goes to polishing)
    own = deadline.capped(time.perf_counter() + deadline.left() / 2)
    _, _, layout = best_split(packer, items, own, upper_ms=best)
    keep(layout, "split")
    return out
