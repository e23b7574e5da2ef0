"""Splitting sequences into micro-batches: one common level, or balanced in GPU-time and tokens.

* :func:`common_level`: micro-batches stuffed one after another at one level (the hardest
  remaining sequence's fastest finish where that is higher);
* :func:`balanced_split`: sequences, the largest share first, to the micro-batch where the larger
  of their GPU-time and token shares stays least; :func:`pack_each` then packs every part at its
  smallest level (:func:`split_pack`), and :func:`best_split` tries micro-batch counts.

The step search (:mod:`planner.search`), the polishing (:mod:`planner.polish`) and the tail
re-planning (:mod:`planner.tail`) build layouts from these.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from megatron_flexsp.planner.layout import Group, Tables
from megatron_flexsp.planner.level import LevelPacker

if TYPE_CHECKING:
    from megatron_flexsp.planner.search import Deadline

Layout = list[list[Group]]
#: A layout being built is given up once it is sure to end this much above the best so far (a
#: little above: the best layouts are polished afterwards, which may reorder them).
PRUNE = 0.02
#: :func:`balanced_split` loops in plain Python up to this many micro-batches, with NumPy above
_SPLIT_LOOP_MAX = 16


def common_level(packer: LevelPacker, items: np.ndarray, level: float, max_mbs: int,
                 give_up_ms: float = math.inf, deadline=None) -> Layout | None:
    """Micro-batches stuffed one after another at ``max(level, hardest remaining fastest finish)``;
    None when more than ``max_mbs`` would be needed, once the micro-batches so far and a lower
    bound on the rest reach ``give_up_ms``, or once ``deadline`` (with ``expired()``) has passed
    (each micro-batch stuffs from all the sequences left: 4,096 documents that each fill a
    micro-batch took 1.2 s)."""
    layout: Layout = []
    left = items
    done = 0.0
    while len(left):
        if len(layout) >= max_mbs or (deadline is not None and deadline.expired()):
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
    if m > _SPLIT_LOOP_MAX:  # in place, and the memory check only where a part could overflow
        load, tokens, share, other = np.zeros(m), np.zeros(m), np.empty(m), np.empty(m)
        fullest = 0.0  # the most tokens of any part
        lens_l, w_l, items_l = lens.tolist(), w.tolist(), items.tolist()
        for k in order.tolist():
            s_k, w_k = lens_l[k], w_l[k]
            np.divide(np.add(load, w_k, out=share), mean_w, out=share)
            np.divide(np.add(tokens, s_k, out=other), mean_s, out=other)
            np.maximum(share, other, out=share)
            if fullest + s_k > cap:
                share[tokens + s_k > cap] = np.inf
            j = int(share.argmin())
            if not math.isfinite(share[j]):
                return None
            out[j].append(items_l[k])
            load[j] += w_k
            tokens[j] += s_k
            fullest = max(fullest, float(tokens[j]))
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
              give_up_ms: float = math.inf) -> tuple[Layout | None, bool]:
    """Each part as one micro-batch at its smallest level. A part that does not pack (its groups'
    memory fragments) keeps its hardest sequences up to a shrinking share of the micro-batch's tokens;
    what it sheds goes into extra micro-batches at the common level of the others. Returns the
    layout (None when the deadline passes, memory refuses, or once the parts packed so far and the
    others' lower bounds reach ``give_up_ms``) and whether it gave up at ``give_up_ms``."""
    layout: Layout = []
    spill: list[np.ndarray] = []
    cap = packer.tab.cm.capacity_tokens * packer.n_gpus
    lens = packer.tab.lens
    ahead = [packer.lower_bound(part, 1) for part in parts]
    done = 0.0
    for k, part in enumerate(parts):
        if deadline.expired():
            return None, False
        if done + sum(ahead[k:]) >= give_up_ms:
            return None, True
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
                return None, False
        layout.append(found[1])
        done += packer.tab.mb_ms(found[1])
    if spill:
        level = float(np.median([packer.tab.mb_ms(mb) for mb in layout])) if layout else 0.0
        extra = common_level(packer, np.concatenate(spill), level, 4 * len(parts) + 4)
        if extra is None:
            return None, False
        layout += extra
    return layout, False


def split_pack(packer: LevelPacker, items: np.ndarray, m: int, deadline: Deadline,
               give_up_ms: float = math.inf) -> Layout | None:
    """:func:`balanced_split` into ``m`` micro-batches, then :func:`pack_each`; None once
    ``deadline`` has passed (the split alone takes 0.1 s for 4,096 documents in 20 parts, which
    had run, and been thrown away, after the search's deadline)."""
    return split_pack_or_give_up(packer, items, m, deadline, give_up_ms)[0]


def split_pack_or_give_up(packer: LevelPacker, items: np.ndarray, m: int, deadline: Deadline,
                          give_up_ms: float = math.inf) -> tuple[Layout | None, bool]:
    """:func:`split_pack`, and whether it was given up once sure to reach ``give_up_ms`` (False
    where it packed, or stopped for memory or the deadline)."""
    if deadline.expired():
        return None, False
    parts = balanced_split(packer.tab, items, m, packer.gpu_time_min)
    return pack_each(packer, parts, deadline, give_up_ms) if parts is not None else (None, False)


def best_split(packer: LevelPacker, items: np.ndarray, deadline: Deadline, around: int = 0,
               prefix_ms: float = 0.0, upper_ms: float = math.inf) -> tuple[float, int, Layout | None]:
    """The best :func:`split_pack` over micro-batch counts: from the memory minimum (or ``around``,
    when given, and its neighbours) upwards in growing steps while it improves, then the neighbours
    of the best count. Returns (step ms including ``prefix_ms``, count, layout)."""
    tab = packer.tab
    if not len(items):
        return prefix_ms, 0, []
    m_lo = packer.memory_minimum(items)
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
