"""Moving sequences into other micro-batches' free memory, where that shortens the step.

* :func:`drain_micro_batches` empties a whole micro-batch into the others (the fastest first).
* :func:`shed_slowest_groups` moves the short sequences off a micro-batch's slowest group down to
  its next slowest group's finish. Memory-bound steps need it: the search stuffs the first
  micro-batch's long documents' groups with short ones while the later micro-batches look full,
  and single moves (:func:`~planner.layout.improve_layout`) cannot take them out, as each raises
  its new micro-batch by more than it saves. On a lognormal step (mean 4K tokens, 512 documents,
  64 GPUs, five memory-full micro-batches) the group of 16 running the 56K-token document held 61
  sequences (78.9K tokens) and set the first micro-batch at 3,456 ms against 3,134 ms for the
  next group; 37 of them moved into free memory elsewhere took 0.65% off the step (12,053 to
  11,975 ms), 1.0% once touched up further.

Both place sequences longest first, each in the fitting group (of a micro-batch other than the
one they leave) that raises its micro-batch's makespan least, and keep the moves only when the
raises sum to less than what leaving saves.
"""

from __future__ import annotations

from megatron_flexsp.planner.layout import Group, GroupIndex, Tables, _head

Layout = list[list[Group]]
#: micro-batches the planner's callers of :func:`drain_micro_batches` try to empty per layout
DRAIN_TRIES = 8


def drain_micro_batches(layout: Layout, tab: Tables, deadline=None, tries: int = 3) -> int:
    """Empty micro-batches into the others' free memory while that shortens the step.

    The ``tries`` micro-batches with the shortest makespans are tried in turn: their sequences,
    longest first, each go to the fitting group of another micro-batch that raises that
    micro-batch's makespan least; the moves are kept when the raises sum to less than the emptied
    micro-batch's makespan, else undone. Returns how many micro-batches were removed.
    """
    removed = 0
    for _ in range(tries):
        if len(layout) < 2 or (deadline is not None and deadline.expired()):
            break
        spans, free = _spans_and_free(layout, tab)
        total_free = sum(free)
        for v in sorted(range(len(layout)), key=lambda j: (spans[j], j))[:3]:
            if total_free - free[v] < sum(g.tokens for g in layout[v]):
                continue  # the others' free memory cannot hold it
            if _drain(layout, tab, v, spans, free, deadline):
                removed += 1
                break
        else:
            break
    return removed


def could_drain_below(layout: Layout, tab: Tables, target_ms: float, tries: int = DRAIN_TRIES) -> bool:
    """Whether :func:`drain_micro_batches` with ``tries`` could bring ``layout``'s step under
    ``target_ms`` (ms): each micro-batch emptied saves less than its makespan, and at most
    ``tries`` of them, and no more than leave the memory minimum of its tokens, are emptied."""
    spans = sorted(tab.mb_ms(mb) for mb in layout)
    tokens = sum(g.tokens for mb in layout for g in mb)
    m_min = -(-tokens // (tab.cm.cluster.num_gpus * tab.cm.capacity_tokens))
    removable = max(0, min(tries, len(layout) - m_min))
    return sum(spans) - sum(spans[:removable]) < target_ms


def shed_slowest_groups(layout: Layout, tab: Tables, deadline=None, slowest: int = 3) -> int:
    """For each of the ``slowest`` micro-batches, move the shortest sequences of its slowest group
    (all but its longest-running one), as many as it takes to bring that group down to the
    micro-batch's next slowest finish, into the other micro-batches (:func:`_place`); kept when
    the step gets faster, else undone. In place; returns how many micro-batches got faster."""
    faster = 0
    order = sorted(range(len(layout)), key=lambda j: -tab.mb_ms(layout[j]))[:slowest]
    for j in order:
        if deadline is not None and deadline.expired():
            break
        spans, free = _spans_and_free(layout, tab)
        top_ms, nxt, top = _head(layout[j], tab)
        if len(top.seqs) < 2:
            continue
        excess = top_ms - nxt
        if excess <= 0.0:
            continue
        times = tab._time_l[top.size]
        by_time = sorted(top.seqs, key=lambda i: (times[i], i))[:-1]  # the slowest one stays
        take, freed = [], 0.0
        for i in by_time:
            if freed >= excess:
                break
            take.append(i)
            freed += times[i]
        moves, raised = _place(layout, tab, [(i, top) for i in take], j, spans, free, excess, deadline,
                               every=False, probes=None)
        moved = sum(times[i] for i, _, _ in moves)
        saved = spans[j] - max(nxt, tab.finish(top) - moved)
        if moves and raised < saved * (1 - 1e-9):
            for i, src, _ in moves:
                tab.remove(src, i)
            faster += 1
        else:
            _undo(tab, moves)
    return faster


def _spans_and_free(layout: Layout, tab: Tables) -> tuple[list[float], list[int]]:
    """Each micro-batch's makespan (ms) and free memory (tokens)."""
    return ([tab.mb_ms(mb) for mb in layout],
            [sum(int(tab.cap[g.size]) - g.tokens for g in mb) for mb in layout])


def _drain(layout: Layout, tab: Tables, v: int, spans: list[float], free: list[int], deadline) -> bool:
    items = [(i, g) for g in layout[v] for i in g.seqs]
    moves, _ = _place(layout, tab, items, v, spans, free, spans[v], deadline)
    if len(moves) == len(items):  # every move placed, and their raises stayed below its makespan
        for i, src, _ in moves:
            tab.remove(src, i)
        del layout[v]
        return True
    _undo(tab, moves)
    return False


def _place(layout: Layout, tab: Tables, items: list[tuple[int, Group]], v: int, spans: list[float],
           free: list[int], budget_ms: float, deadline, every: bool = True, probes: int | None = 16
           ) -> tuple[list[tuple[int, Group, Group]], float]:
    """Add ``items`` ((sequence, the group it leaves)), longest first, each to the fitting group of
    a micro-batch other than ``v`` that raises that micro-batch's makespan least (``spans``: ms,
    ``free``: tokens, per micro-batch, updated as items are placed), while the raises stay below
    ``budget_ms``; ``every``: stop at the first item that does not fit anywhere or would take the
    raises to ``budget_ms`` (else that item is left out and the next tried); ``probes``: the
    least-loaded groups of a (micro-batch, size) class looked at for room (None: all). The items
    stay in the groups they leave (:func:`_undo` takes the moves back). Returns the moves
    (sequence, source, destination) and the raises' sum (ms); none once ``deadline`` passes
    while it indexes the other micro-batches' groups."""
    index = GroupIndex(tab)
    for j, mb in enumerate(layout):
        if not j & 1023 and deadline is not None and deadline.expired():
            return [], 0.0  # (indexing 65,536 micro-batches takes a tenth of a second)
        if j != v:
            for g in mb:
                index.add(j, g)
    keys = sorted(index.classes())
    level, free = list(spans), list(free)
    moves: list[tuple[int, Group, Group]] = []
    raised = 0.0
    fixed, time_l, lens_l, room = tab.fixed, tab._time_l, tab._lens_l, index.room
    for i, src in sorted(items, key=lambda x: (-lens_l[x[0]], x[0])):
        if deadline is not None and deadline.expired():
            break
        size_i = lens_l[i]
        # each class's least load (its heap's top; a stale entry only understates it) bounds the
        # finish it can offer: classes are probed in the order of that bound until it exceeds the
        # best finish found, which gives the same choice as probing every class
        hopes = []
        for key in keys:
            heap = index.heaps[key]
            if free[key[0]] < size_i or not heap or room[key] < size_i:
                continue  # no group of that micro-batch (or of that class) has room
            t = fixed[key[1]] + heap[0][0] + time_l[key[1]][i]
            hopes.append((max(0.0, t - level[key[0]]), t, key))
        hopes.sort()
        best, best_key = None, None
        for raise_lo, t_lo, key in hopes:
            if best_key is not None and (raise_lo, t_lo) > best_key[:2]:
                break
            g = index.best_fit(key, i, max_probes=probes)
            if g is None:
                continue
            t = fixed[g.size] + g.load_ms + time_l[g.size][i]
            k = (max(0.0, t - level[key[0]]), t, g.uid)
            if best_key is None or k < best_key:
                best, best_key = (key[0], g), k
        if best is None or raised + best_key[0] >= budget_ms:
            if every:
                break
            continue
        j, g = best
        tab.add(g, i)
        index.touch(g)
        free[j] -= size_i
        raised += best_key[0]
        level[j] = max(level[j], tab.finish(g))
        moves.append((i, src, g))
    return moves, raised


def _undo(tab: Tables, moves: list[tuple[int, Group, Group]]) -> None:
    for i, _, g in reversed(moves):
        tab.remove(g, i)
