"""Fast plans: homogeneous packing (static / BatchAda), the FlexSP greedy, and Megatron's DCP greedy.

All return a layout (see :mod:`layout`) or ``None`` when the heuristic finds no memory-feasible
layout. They are the baselines of the simulator and the fallbacks of the MILP planner.
"""

from __future__ import annotations

import bisect
import heapq
import math

import numpy as np

from megatron_flexsp.planner.layout import Group, Tables, improve_layout, pack_lpt


def min_micro_batches(tab: Tables) -> int:
    """Fewest micro-batches memory allows: total tokens over the cluster's token capacity."""
    n = tab.cm.cluster.num_gpus
    return max(1, math.ceil(int(tab.lens.sum()) / (tab.cm.capacity_tokens * n)))


def _lpt(tab: Tables, d: int, count: int, order: list[int]) -> tuple[list[list[int]], list[float]] | None:
    """Sequences ``order`` (longest first) onto ``count`` groups of size ``d``, each onto the
    least-loaded group with memory room; (sequences, load ms) per group, or None when one finds no room."""
    cap = tab.cap[d]
    lens, times = tab.lens.tolist(), tab.time[d].tolist()
    tok = [0] * count
    owner: list[list[int]] = [[] for _ in range(count)]
    heap = [(0.0, k) for k in range(count)]  # by load; already a heap
    short: list[tuple[int, float, int]] = []  # groups without room for the last item, most room first
    for i in order:  # longest first, so a group set aside fits again once items are short enough
        s = lens[i]
        while short and -short[0][0] >= s:
            _, load, k = heapq.heappop(short)
            heapq.heappush(heap, (load, k))
        while heap and tok[heap[0][1]] + s > cap:
            load, k = heapq.heappop(heap)
            heapq.heappush(short, (-(cap - tok[k]), load, k))
        if not heap:
            return None
        load, k = heap[0]
        tok[k] += s
        owner[k].append(i)
        heapq.heapreplace(heap, (load + times[i], k))
    heap += [(load, k) for _, load, k in short]
    loads = [0.0] * count
    for load, k in heap:
        loads[k] = load
    return owner, loads


def homogeneous(tab: Tables, d: int, m: int, items=None) -> list[list[Group]] | None:
    """All groups of size ``d`` (``num_gpus / d`` per micro-batch), ``m`` micro-batches: longest
    sequence first onto the least-loaded group with memory room (LPT). None when one finds no room."""
    items = np.arange(len(tab.lens)) if items is None else np.asarray(items)
    packed = _lpt(tab, d, m * (tab.cm.cluster.num_gpus // d),
                  items[np.argsort(-tab.lens[items], kind="stable")].tolist())
    return None if packed is None else _as_layout(tab, d, m, packed[0])


def _as_layout(tab: Tables, d: int, m: int, owner: list[list[int]]) -> list[list[Group]]:
    """Groups of size ``d`` holding ``owner``'s sequences, ``num_gpus / d`` to each of ``m`` micro-batches."""
    per_mb = tab.cm.cluster.num_gpus // d
    groups = []
    for seqs in owner:
        g = Group(d)
        for i in seqs:
            tab.add(g, i)
        groups.append(g)
    return [groups[j * per_mb:(j + 1) * per_mb] for j in range(m)]


def _homogeneous_ms(tab: Tables, d: int, m: int, order: list[int]) -> tuple[float, list[list[int]] | None]:
    """Step time of :func:`homogeneous` without building its groups (inf when it fails), and its
    sequences per group (None when it fails)."""
    per_mb = tab.cm.cluster.num_gpus // d
    packed = _lpt(tab, d, m * per_mb, order)
    if packed is None:
        return math.inf, None
    spans = np.array(packed[1]).reshape(m, per_mb).max(axis=1)
    return float(np.where(spans > 0, spans + tab.fixed[d], 0.0).sum()), packed[0]


def _groups_needed(ascending: np.ndarray, cap: float, orders: int = 64) -> int:
    """Fewest groups of ``cap`` tokens any packing of sequences of lengths ``ascending`` (sorted)
    needs, by Fekete and Schepers' dual-feasible functions ``u^(k)`` (k = 1 to ``orders``) taken
    just below their steps: a sequence over ``j / (k + 1)`` of a group's memory (and no more than
    ``j + 1``) counts ``j / k``, and a group's counts sum to at most 1, so the groups are at least
    the counts' sum. It holds the rule that a group takes at most k sequences over ``cap / (k + 1)``
    (65,536 documents of 4,096 tokens in groups of 23,968: five each, 13,108 groups, where the
    tokens alone need 11,200) and counts the shorter ones too (65,536 documents packed to 8K on
    groups of one H200: 26,724 groups where that rule gave 25,507; LPT needs 26,880)."""
    out = 0
    for k in range(1, orders + 1):
        steps = cap * np.arange(1, k + 1) / (k + 1)
        over = len(ascending) - np.searchsorted(ascending, steps, side="right")  # per j: over j/(k+1)
        out = max(out, -(-int(over.sum()) // k))
    return out


def best_homogeneous(tab: Tables, sizes: list[int], extra_micro_batches: int = 3, deadline=None,
                     faster_than: float = math.inf, tried: dict[tuple[int, int], float] | None = None,
                     resume: bool = False):
    """Best (step time) homogeneous layout over ``sizes`` and micro-batch counts; (layout, d) or None.

    Per size, micro-batch counts from the memory minimum (or, when more, the groups every packing
    needs: :func:`_groups_needed`) up, until ``extra_micro_batches`` counts in a row do not
    improve on that size's best (or 64 counts find no room); a (size, count) whose lower bound
    (fixed costs plus GPU-time over N, or the longest sequence) cannot beat the best so far ends
    that size's counts. Counts where LPT finds no room are stepped over 1, 2, 4, ... at a time
    (back towards the last without room where a step passes that bound), then bisected back to
    the fewest with room (a batch needing 397 micro-batches of 16 had 43 counts without room from
    the memory minimum on); no count is packed twice. Sizes are tried by that lower bound at their
    first count, least first. ``deadline`` (with ``expired()``): no
    further count is tried once it has passed and a layout was found (each try packs the whole
    batch: 20 ms for 4,096 documents at 64 GPUs, 0.1 s for 65,536, and a batch needing 470
    micro-batches tried 49 counts). ``faster_than`` (ms): a plan already in hand; only layouts
    faster than it are searched for (None when the lower bounds show there is none), so a size
    whose bound is above it packs nothing (65,536 documents of up to 64K tokens at 64 GPUs: 23
    packings, 2 s, where the slot LP's rounded plan is 8% below every size's bound). ``tried``:
    step ms by (size, count), filled with the counts packed and read before packing one again, so
    a later call with ``resume`` goes on where a call cut short by its deadline stopped (with
    ``faster_than`` that call's best), stopping at its own deadline whatever it has found."""
    best_ms, best_d, best_m, best_owner = faster_than, 0, 0, None
    tried = {} if tried is None else tried  # (size, count) -> step ms: no count is packed twice
    m0 = min_micro_batches(tab)
    longest = int(tab.lens.max())
    n_gpus = tab.cm.cluster.num_gpus
    by_length = np.argsort(-tab.lens, kind="stable").tolist()

    ascending = np.sort(tab.lens)
    starts = {d: max(m0, -(-_groups_needed(ascending, tab.cap[d]) // (n_gpus // d)))
              for d in sizes if longest <= tab.cap[d]}
    gpu_time = {d: float(tab.time[d].sum()) * d for d in starts}  # ms, every sequence on size d
    alone = {d: float(tab.time[d].max()) + tab.fixed[d] for d in starts}

    def floor(d: int, m: int) -> float:  # no homogeneous layout of size d with m micro-batches is faster
        return max(m * tab.fixed[d] + gpu_time[d] / n_gpus, alone[d] + (m - 1) * tab.fixed[d])

    # the most promising size first (least floor at its first count, then least GPU-time): what it
    # finds prunes the others' counts, and a deadline leaves the best (65,536 documents of 4,096
    # tokens at 64 GPUs: groups of one GPU, the least GPU-time, need 1,024 micro-batches, groups
    # of 8 about 745; tried first, one GPU's 0.2 s plan was 7% slower than the untimed search's)
    order = sorted(starts, key=lambda d: (floor(d, starts[d]), gpu_time[d]))
    for d in order:
        misses, own = 0, math.inf  # counts in a row that did not improve on this size's best
        m, step, failed = starts[d], 1, 0  # failed: the last count LPT found no room at (0: none)
        start = m
        # the sequences per group of the counts packed faster than the best (a count met again in
        # a resumed call is packed again)
        packed: dict[int, list[list[int]]] = {}

        def step_ms(count: int) -> float:
            if (d, count) not in tried:
                tried[(d, count)], owner = _homogeneous_ms(tab, d, count, by_length)
                if tried[(d, count)] < best_ms - 1e-9:
                    packed[count] = owner
            return tried[(d, count)]

        while m <= len(tab.lens):
            if floor(d, m) >= best_ms:
                if failed and m - failed > 1:  # galloped past the counts that could beat the best:
                    m = (failed + m) // 2      # back towards the last count without room
                    continue
                break
            if (best_m or resume) and deadline is not None and deadline.expired():
                break
            ms = step_ms(m)
            if not math.isfinite(ms):
                if m - start >= 64:  # LPT still finds no room: this size is left out
                    break
                failed, m, step = m, m + step, 2 * step  # counts without room: galloping
                continue
            if failed and m - failed > 1:  # back to the fewest counts with room, by bisection
                lo, hi = failed, m
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if math.isfinite(step_ms(mid)) else (mid, hi)
                if hi < m:
                    failed, step, m = 0, 1, hi
                    continue
            failed, step = 0, 1
            if ms < best_ms - 1e-9:
                if m not in packed:
                    packed[m] = _homogeneous_ms(tab, d, m, by_length)[1]
                best_ms, best_d, best_m, best_owner = ms, d, m, packed[m]
                for c in [c for c in packed if tried[(d, c)] >= best_ms - 1e-9]:
                    del packed[c]
            if ms < own - 1e-9:  # (against the size's own best, so the order of sizes does not cut
                own, misses = ms, 0  # a size short: lognormal documents at 256 H200 GPUs, groups of
            else:                    # 8 tried first, had ended those of 4 1.6% above their best)
                misses += 1
                if misses > extra_micro_batches:
                    break
            m += 1
    if not best_m:
        return None
    return _as_layout(tab, best_d, best_m, best_owner), best_d


def _blast(tab: Tables, m: int) -> list[list[int]] | None:
    """Sequence blaster: split the batch into ``m`` micro-batches balanced by predicted GPU-time.

    Each sequence weighs its smallest feasible GPU-time (size x time); heaviest first onto the
    lightest micro-batch with token room (cluster capacity). None if some sequence has no room.
    """
    n = tab.cm.cluster.num_gpus
    cap = tab.cm.capacity_tokens * n
    weight = np.array([tab.min_size[i] * tab.time[int(tab.min_size[i])][i] for i in range(len(tab.lens))])
    area, tokens = [0.0] * m, [0] * m
    out: list[list[int]] = [[] for _ in range(m)]
    for i in sorted(range(len(tab.lens)), key=lambda i: (-weight[i], i)):
        ok = [j for j in range(m) if tokens[j] + tab.lens[i] <= cap]
        if not ok:
            return None
        j = min(ok, key=lambda j: (area[j], j))
        out[j].append(i)
        area[j] += weight[i]
        tokens[j] += int(tab.lens[i])
    return out


def _greedy_micro_batch(tab: Tables, items: list[int]) -> tuple[list[Group], list[int]]:
    """Groups for one micro-batch: long sequences get the smallest size meeting a time target; the
    rest of the GPUs become size-1 groups; then everything is packed longest-first.

    Returns the groups and the sequences that did not fit (memory or GPUs), for a later micro-batch.
    """
    n = tab.cm.cluster.num_gpus
    f_min = min(tab.fixed.values())
    area = sum(tab.min_size[i] * tab.time[int(tab.min_size[i])][i] for i in items)
    fastest = [min(tab.time[d][i] + tab.fixed[d] for d in tab.sizes if d >= tab.min_size[i])
               for i in items]
    target = max([area / n + f_min] + fastest)
    groups: list[Group] = []
    left: list[int] = []
    free = n
    longs = sorted((i for i in items if tab.min_size[i] > 1), key=lambda i: (-tab.lens[i], i))
    for i in longs:
        chosen = None
        for d in tab.sizes:
            if d < tab.min_size[i] or d > free:
                continue
            chosen = d
            if tab.time[d][i] + tab.fixed[d] <= target:
                break
        if chosen is not None:
            g = Group(chosen)
            tab.add(g, i)
            groups.append(g)
            free -= chosen
            continue
        fits = [g for g in groups if tab.fits(g, i)]
        if not fits:
            left.append(i)
            continue
        g = min(fits, key=lambda g: (tab.finish(g) + tab.time[g.size][i], g.size))
        tab.add(g, i)
    groups += [Group(1) for _ in range(free)] if 1 in tab.sizes else []
    left += pack_lpt([i for i in items if tab.min_size[i] <= 1], groups, tab)
    return [g for g in groups if g.seqs], left


def greedy(tab: Tables, extra_micro_batches: int = 3) -> list[list[Group]] | None:
    """FlexSP greedy: blaster by GPU-time, per-micro-batch grouping, LPT; the best micro-batch count
    is then improved by local search."""
    best, best_ms = None, math.inf
    m0 = min_micro_batches(tab)
    for m in range(m0, m0 + extra_micro_batches + 1):
        split = _blast(tab, m)
        if split is None:
            continue
        layout, queue, carry = [], list(split), []
        while queue or carry:
            items = (queue.pop(0) if queue else []) + carry
            mb, carry = _greedy_micro_batch(tab, items)
            if not mb:  # nothing fits even in an empty micro-batch: cannot happen for valid input
                break
            layout.append(mb)
        if carry:
            continue
        ms = tab.step_ms(layout)
        if ms < best_ms - 1e-9:
            best, best_ms = layout, ms
    if best is not None:
        improve_layout(best, tab)
    return best


def megatron_dcp(tab: Tables, items: np.ndarray | None = None, deadline=None) -> list[list[Group]] | None:
    """Megatron dynamic-CP greedy (``../shared/notes/peers.md``), evaluated under our cost model,
    of the sequences ``items`` (indices into ``tab``; default all of them). ``deadline`` (with
    ``expired()``): None once it has passed before the layout is complete (the greedy is a Python
    loop over the sequences, each micro-batch passing over those still waiting: 0.15-0.6 s for
    65,536 documents at 64 GPUs, several seconds where they need thousands of micro-batches).

    Sequences sorted by length; each gets the smallest power-of-two size with ``len/size`` within the
    per-rank token cap (here the memory capacity); it opens a group on free ranks (zero workload) or
    else joins the group of that size with room and the least ``sum(len^2)/size`` workload, else
    waits for the next micro-batch.
    Then groups are doubled while free ranks remain and doubling lowers the critical rank's
    workload. The workload proxy has no communication or linear term (as in Megatron).
    """
    n = tab.cm.cluster.num_gpus
    all_lens, all_sizes = tab.lens.tolist(), tab.min_size.tolist()
    chosen = range(len(all_lens)) if items is None else np.asarray(items).tolist()
    remaining = sorted(chosen, key=lambda i: (-all_lens[i], i))
    start = 0  # ``remaining[start:]`` is still to place
    layout: list[list[Group]] = []
    while start < len(remaining):
        free, groups, left = n, [], []
        tail = None  # where the rest of ``remaining``, all left, begins when nothing else was left
        work: dict[int, float] = {}
        by_work: dict[int, list] = {}  # per size: groups by workload, least first
        short: dict[int, list] = {}    # per size: groups without room for a longer sequence, most room first
        # ``remaining`` is longest first, so sizes do not increase along it; searched by key in
        # place (copies of its lengths and sizes per micro-batch made this quadratic: 1.2 s for
        # 4,096 documents that each fill a micro-batch)
        pos = start
        if deadline is not None and deadline.expired():
            return None
        while pos < len(remaining):  # longest first: a group set aside fits again once shorter
            if not pos & 4095 and deadline is not None and deadline.expired():
                return None
            i = remaining[pos]
            d, s = all_sizes[i], all_lens[i]
            pos += 1
            if d == 0:
                return None
            heap, aside = by_work.setdefault(d, []), short.setdefault(d, [])
            while aside and -aside[0][0] >= s:
                _, uid, g = heapq.heappop(aside)
                heapq.heappush(heap, (work[id(g)], uid, g))
            if free >= d:  # free ranks carry no workload: the least-loaded choice
                g = Group(d)
                groups.append(g)
                work[id(g)] = 0.0
                free -= d
            else:
                while heap and heap[0][2].tokens + s > tab.cap[d]:
                    _, uid, g = heapq.heappop(heap)
                    heapq.heappush(aside, (-(tab.cap[d] - g.tokens), uid, g))
                if not heap:  # every group of size d lacks room; so do the next ones needing d
                    room = -aside[0][0] if aside else -1  # and longer than the most room left
                    end = bisect.bisect_right(remaining, -d, lo=pos, key=lambda j: -all_sizes[j])
                    skip = bisect.bisect_left(remaining, -room, lo=pos, hi=end, key=lambda j: -all_lens[j])
                    # all the rest waits as it is: kept in place (a copy per micro-batch made
                    # 4,096 documents that each fill one quadratic: 0.15-0.4 s)
                    if skip == len(remaining) and not left:
                        tail = pos - 1
                    else:
                        left += remaining[pos - 1:skip]
                    pos = skip
                    continue
                g = heapq.heappop(heap)[2]
            g.seqs.append(int(i))
            g.tokens += s
            work[id(g)] += float(s) ** 2 / d
            heapq.heappush(heap, (work[id(g)], g.uid, g))
        if not groups:
            return None
        while True:
            crit = max(groups, key=lambda g: work[id(g)])
            bigger = crit.size * 2
            if bigger > free + crit.size or bigger not in tab.cap:
                break
            others = max((work[id(g)] for g in groups if g is not crit), default=0.0)
            if max(others, work[id(crit)] / 2) >= work[id(crit)]:
                break
            free -= crit.size
            crit.size = bigger
            work[id(crit)] /= 2
        for g in groups:
            g.load_ms = float(sum(tab.time[g.size][i] for i in g.seqs))
        layout.append(groups)
        if tail is not None:
            start = tail
        else:
            remaining, start = left, 0
    return layout
