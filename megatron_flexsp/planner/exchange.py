"""Exchanges: a micro-batch's slowest group trades sequences with the least-loaded groups of its size.

Where memory is full, no sequence can move alone: a memory-bound micro-batch of short sequences on
single GPUs has its slowest groups holding a few longer ones (attention grows with the square of
the length). Trading one of them for one of a partner's, or for the fewest of the partner's
shortest sequences that make room for it, evens the groups out. Run in every settle and touch-up
of :mod:`planner.polish`.
"""

from __future__ import annotations

import numpy as np

from megatron_flexsp.planner.layout import Group, Tables


def balance_groups(mb: list[Group], tab: Tables, deadline=None, partners: int = 8,
                   max_swaps: int = 400) -> int:
    """Exchange sequences between a micro-batch's slowest group and the ``partners`` least-loaded
    groups of its size while the micro-batch's makespan drops, within both groups' memory: one
    sequence of the slowest group for one of the partner's, or for the fewest of the partner's
    shortest sequences that make room for it (short sequences cost less time per token). Moving
    single sequences cannot do this once memory is full: a memory-bound micro-batch of short
    sequences on single GPUs packs 2% above the makespan a MILP finds for the same sequences, its
    slowest groups holding a few longer sequences. Each exchange strictly lowers the makespan or
    the number of groups at it, so this ends. Returns the exchanges made."""
    swaps = 0
    while swaps < max_swaps and not (deadline is not None and deadline.expired()):
        ends = [tab.finish(g) for g in mb]
        top = max(range(len(mb)), key=lambda k: (ends[k], -mb[k].size))
        slow = mb[top]
        same = sorted((k for k in range(len(mb)) if k != top and mb[k].size == slow.size and mb[k].seqs),
                      key=lambda k: ends[k])[:partners]
        if not same:
            break
        best = _best_exchange(mb, tab, top, same, ends)
        if best is None:
            break
        _, k, out, back = best
        for i in out:
            tab.remove(slow, i)
            tab.add(mb[k], i)
        for j in back:
            tab.remove(mb[k], j)
            tab.add(slow, j)
        swaps += 1
    return swaps


def _best_exchange(mb: list[Group], tab: Tables, top: int, partners: list[int], ends: list[float]):
    """The exchange between ``mb[top]`` (the slowest group) and one of ``partners`` that leaves the
    slower of the two fastest, if below ``ends[top]``: (its finish ms, partner, sequences out of the
    slowest group, sequences into it)."""
    slow, span = mb[top], ends[top]
    d, cap = slow.size, tab.cap[slow.size]
    t_s, l_s = tab.time[d][slow.seqs], tab.lens[slow.seqs]
    best = None
    for k in partners:  # least loaded first
        if best is not None and 0.5 * (span + ends[k]) >= best[0]:
            break  # an exchange leaves the slower of the two at least at their mean, for this and later partners
        h = mb[k]
        t_h, l_h = tab.time[d][h.seqs], tab.lens[h.seqs]
        # one for one
        dt = t_s[:, None] - t_h[None, :]
        ok = (dt > 0) & (slow.tokens - l_s[:, None] + l_h[None, :] <= cap) & \
             (h.tokens - l_h[None, :] + l_s[:, None] <= cap)
        if ok.any():
            new = np.where(ok, np.maximum(span - dt, ends[k] + dt), np.inf)
            a, b = np.unravel_index(int(np.argmin(new)), new.shape)
            if new[a, b] < span * (1 - 1e-9) and (best is None or new[a, b] < best[0]):
                best = (float(new[a, b]), k, [slow.seqs[a]], [h.seqs[b]])
        # one for the fewest shortest that make room for it
        order = np.argsort(l_h, kind="stable")
        room = np.cumsum(l_h[order])
        took = np.cumsum(t_h[order])
        need = l_s - (cap - h.tokens)
        n = np.searchsorted(room, need, side="left") + 1  # how many of the shortest, per sequence
        fine = (need > 0) & (n <= len(order))
        if not fine.any():
            continue
        n_ok = np.minimum(n, len(order))
        back_t, back_l = took[n_ok - 1], room[n_ok - 1]
        new = np.maximum(span - t_s + back_t, ends[k] + t_s - back_t)
        fine &= (slow.tokens - l_s + back_l <= cap) & (back_t < t_s)
        new = np.where(fine, new, np.inf)
        a = int(np.argmin(new))
        if new[a] < span * (1 - 1e-9) and (best is None or new[a] < best[0]):
            best = (float(new[a]), k, [slow.seqs[a]], [h.seqs[q] for q in order[:n_ok[a]].tolist()])
    return best
