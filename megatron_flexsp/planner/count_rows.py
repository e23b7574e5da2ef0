"""Rows of the step LP (:mod:`planner.step_lp`) whose coefficients follow the level of a probe.

* :class:`CountRow`: per (part, group size), the row bounding the number of groups from below by
  a dual feasible function of each sequence's work within a group's time (a slow sequence takes a
  group of its own; one that cannot share a group with the lightest slow one takes its share of a
  group's time); buckets of long sequences count their members' own works through a tangent row.
  It also keeps the level-dependent memory coefficients of its columns.
* :class:`Shares`: per part, how much of each bucket's tokens finishes within the level (a bucket
  may only place that share there).
* :func:`time_dff`: per (part, size), rows bounding the number of groups from below by Fekete and
  Schepers' ``u^(k)`` of each sequence's work within a group's time (at most ``k`` over
  ``1 / (k + 1)`` of it per group), kept by :class:`CountRow` with the counting row.
* :func:`pair_rows`: per (part, size), rows bounding the number of groups from below by Fekete and
  Schepers' ``u^(eps)`` of each sequence's memory, which know that a sequence over half a group's
  memory leaves room only for those shorter than what it leaves (their coefficients do not follow
  the level).

Each probe changes only the coefficients that moved since the last one.
"""

from __future__ import annotations

import math

import highspy
import numpy as np

#: :func:`pair_rows`: ``eps`` from this share of a group's memory up to a half (below it a row
#: differs little from the memory row), at most one row per ``PAIR_EPS_STEP`` of it
PAIR_EPS_LOW, PAIR_EPS_STEP = 0.25, 0.01
#: per (part, size), rows counting groups by :func:`time_dff` with these ``k`` (the counting row's
#: own function covers ``k = 1``: over half a group's time, one per group); ``k`` of 5-8 more
#: raised a bound of 64 uniform documents at 256 GPUs by 0.5% and cost each solve a quarter more time
PER_GROUP_KS = (2, 3, 4)


class CountRow:
    """The columns of one (part, size) whose coefficients depend on the level: in the row
    counting slow ones one per group (``row``) and in the part's memory rows; ``update`` changes
    only the coefficients that differ from the last probe. Per column: ``work`` (ms; a bucket's
    shortest member's), ``tokens`` (the column's), ``span`` (its longest sequence) and ``scale``
    (sequences per unit of the column at least: 1 for a single, ``tokens / longest`` for a
    bucket). ``tails``: the buckets of long sequences, as (column position, its members' works in
    ms, their finish times alone with the group's fixed cost and their lengths, all by work, the
    row ``z >= a x + b`` of the column ``z`` it adds to the counting row). ``per_group_rows``:
    (row, ``k``) of rows counting groups by :func:`time_dff`, set with the counting row."""

    def __init__(self, row: int, cols: np.ndarray, work: np.ndarray, tokens: np.ndarray,
                 span: np.ndarray, scale: np.ndarray,
                 tails: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, int]],
                 per_group_rows: tuple[tuple[int, int], ...] = ()) -> None:
        self.row, self.cols, self.work, self.tokens = row, cols.astype(np.int64), work, tokens
        self.span, self.scale = span, scale
        self.tails = tails
        self.per_group_rows = per_group_rows
        self.last = {"slow": np.zeros(len(cols)), "mem": tokens.copy(), "total": tokens.copy(),
                     "tail": np.zeros(len(tails)), "tail_rhs": np.full(len(tails), math.inf)}
        self.last.update({f"per{k}": np.zeros(len(cols)) for _, k in per_group_rows})
        # the tails' members end to end, so that one level is looked up in all of them at once
        # (a loop over them took a third of the bound's time on 64-GPU steps)
        if tails:
            if min(len(t[1]) for t in tails) < 1:
                raise ValueError("a tail bucket without members")
            self._pos = np.array([t[0] for t in tails], dtype=np.int64)
            self._tokens = tokens[self._pos]  # each tail's column tokens
            self._works = np.concatenate([t[1] for t in tails])
            self._fin = np.concatenate([t[2] for t in tails])
            self._lens = np.concatenate([t[3] for t in tails]).astype(np.float64)
            self._starts = np.cumsum([0] + [len(t[1]) for t in tails[:-1]]).astype(np.int64)
            self._rows = [t[4] for t in tails]

    def update(self, h: highspy.Highs, row: int, values: np.ndarray, key: str) -> None:
        for k in (values != self.last[key]).nonzero()[0].tolist():
            h.changeCoeff(row, int(self.cols[k]), float(values[k]))
        self.last[key] = values

    def count(self, h: highspy.Highs, level: float, room: float, heavy: np.ndarray) -> None:
        """Set the counting row for a level of ``level`` ms (a group's time ``room``, less its
        fixed cost; ``heavy``: the columns whose work is over half of it), one dual feasible
        function of the work for every sequence there (:func:`_groups_needed`: 1 if over half the
        room, ``w / room`` if it cannot share a group with the lightest of those, else 0); a
        bucket at its shortest member's work per unit
        ``scale``. A bucket of ``tails`` counts its members' own works instead: its share ``x``
        of their tokens counts at least the least its members that may run there (finish within
        the level) can count for that many tokens, members taken by count per token, lowest
        first, a convex function of ``x``: at least ``low x`` (``low``: its lowest count per
        token, in the row) and the tangent at its whole share (slope: the highest count per
        token, through the count of all of them), by ``z`` in the row."""
        if self.per_group_rows:  # at most k of a work over room / (k + 1) per group
            frac = np.minimum(self.work / room, 1.0)
            for row, k in self.per_group_rows:
                self.update(h, row, _capped_time_dff(frac, k) * self.scale, f"per{k}")
        fits = heavy & (self.work <= room)
        stars = [float(self.work[fits].min())] if fits.any() else []
        if self.tails:
            ok = self._fin <= level  # members that may run there (each tail's by work: a prefix)
            slow = ok & (2.0 * self._works > room)
            if slow.any():
                stars.append(float(self._works[slow].min()))
        w_star = min(stars) if stars else None
        coef = _groups_needed(self.work, room, heavy, w_star) * self.scale
        if not self.tails:
            self.update(h, self.row, coef, "slow")
            return
        tokens = self._tokens
        if w_star is None:  # no slow sequence anywhere: none counts
            g = np.zeros(len(self._works))
        else:
            g = _groups_needed(self._works, room, slow, w_star) / self._lens  # count per token
        some = np.add.reduceat(ok.astype(np.int64), self._starts) > 0  # a tail with members there
        low = np.where(some, np.minimum.reduceat(np.where(ok, g, np.inf), self._starts), 0.0) * tokens
        high = np.where(some, np.maximum.reduceat(np.where(ok, g, -np.inf), self._starts), 0.0) * tokens
        total = np.add.reduceat(np.where(ok, g * self._lens, 0.0), self._starts)
        share = np.add.reduceat(np.where(ok, self._lens, 0.0), self._starts) / tokens
        coef[self._pos] = low
        tangent = some & (total > 0.0) & (high > low)  # z >= (high - low) x + total - high share
        slope = np.where(tangent, high - low, 0.0)
        rhs = np.where(tangent, high * share - total, math.inf)
        self.update(h, self.row, coef, "slow")
        for k in (slope != self.last["tail"]).nonzero()[0].tolist():
            h.changeCoeff(self._rows[k], int(self.cols[self._pos[k]]), float(slope[k]))
        for k in (rhs != self.last["tail_rhs"]).nonzero()[0].tolist():
            h.changeRowBounds(self._rows[k], -math.inf, float(rhs[k]))
        self.last["tail"], self.last["tail_rhs"] = slope, rhs


class Shares:
    """The bucket columns of one part: per column, its members' finish times alone (ascending) and
    the token share of the members finishing by each, flattened so that one level is looked up in
    all of them at once."""

    def __init__(self, columns: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        self.pos = np.array([c[0] for c in columns], dtype=np.int64)
        self.fin = np.concatenate([c[1] for c in columns]) if columns else np.zeros(0)
        self.share = np.concatenate([c[2] for c in columns]) if columns else np.zeros(0)
        self.starts = np.cumsum([0] + [len(c[1]) for c in columns[:-1]]).astype(np.int64)

    def within(self, level: float, upper: np.ndarray) -> None:
        """Set ``upper[pos]`` of each bucket column to the token share of its members finishing
        within ``level`` (ms)."""
        if not len(self.pos):
            return
        done = np.add.reduceat((self.fin <= level).astype(np.int64), self.starts)
        upper[self.pos] = np.where(done > 0, self.share[self.starts + np.maximum(done, 1) - 1], 0.0)


def _groups_needed(work: np.ndarray, room: float, heavy: np.ndarray,
                   w_star: float | None = None) -> np.ndarray:
    """Coefficients of sequences in their (part, size)'s group-count row, a dual feasible
    function of their work (ms) within a group's ``room`` (ms): 1 for a slow one (``heavy``, over
    half the room; the lightest that can run takes ``w*``), ``w / room`` for one over ``room - w*``
    (it cannot share a group with a slow one), 0 for the rest. A group holds at most one slow
    sequence and then only sequences of 0; else their works sum to at most ``room``: every group's
    coefficients sum to at most 1, so the count of groups is at least their sum. ``w_star``: the
    lightest slow work that can run among all sequences of the row (default: among these)."""
    if w_star is None:
        fits = heavy & (work <= room)
        if not fits.any():
            return heavy.astype(np.float64)
        w_star = float(work[fits].min())
    middle = ~heavy & (work > room - w_star + 1e-9 * room)
    return np.where(heavy, 1.0, np.where(middle, work / room, 0.0))


def time_dff(frac: np.ndarray, k: int) -> np.ndarray:
    """Fekete and Schepers' ``u^(k)`` (``k >= 1``) of work shares ``frac`` (a sequence's work
    over a group's time within the level, capped at 1), taken just below where ``(k + 1) frac`` is
    a whole number (there ``u^(k)`` is ``frac``, at most what this gives): ``floor((k + 1) frac) /
    k``. Works sharing a group sum to at most its time, so their values sum to at most 1: a
    group holds at most ``k`` works over ``1 / (k + 1)`` of it, ``j`` such works count ``1 / k``
    each. Sequences of alike lengths, a few per group, then need whole groups (three works of
    0.29 of the time fill a group: the work row alone would fit 3.4)."""
    return _capped_time_dff(np.minimum(np.asarray(frac, dtype=np.float64), 1.0), k)


def _capped_time_dff(x: np.ndarray, k: int) -> np.ndarray:
    """:func:`time_dff` of shares ``x`` already capped at 1 (the LP's probes call it per ``k``)."""
    out = np.floor((k + 1) * x - 1e-9)
    np.maximum(out, 0.0, out=out)
    out /= k
    return out


def pair_dff(frac: np.ndarray, eps: float) -> np.ndarray:
    """Fekete and Schepers' ``u^(eps)`` (``0 <= eps <= 1/2``) of memory shares ``frac`` (a
    sequence's tokens over a group's capacity): 1 above ``1 - eps``, ``frac`` within
    ``[eps, 1 - eps]``, 0 below ``eps``. Sequences sharing a group (shares summing to at most 1)
    sum to at most 1: a group holding one above ``1 - eps`` holds only others below ``eps``."""
    frac = np.asarray(frac, dtype=np.float64)
    return np.where(frac > 1.0 - eps, 1.0, np.where(frac >= eps, frac, 0.0))


def pair_rows(units: list[tuple[np.ndarray, bool]], lens: np.ndarray, cap: int) -> list[np.ndarray]:
    """Coefficients of the given units' columns at one group size of ``cap`` tokens in rows
    ``sum coef x <= groups``, one per ``eps``: a single's :func:`pair_dff`; a bucket's (its columns
    place a share of its tokens, any of its members) ``tokens / cap`` where its shortest member is
    at least ``eps`` of the memory (each member counts its share or 1), ``tokens / longest`` more
    where that member is over ``1 - eps`` (each counts 1, and the share holds that many), else 0.
    ``eps``: each single's share, just above one less each single's share (which then counts 1,
    with the sequences it cannot share a group with at their shares) and each bucket's shortest
    member's, within ``[PAIR_EPS_LOW, 1/2]``, at least ``PAIR_EPS_STEP`` apart. Shares, not
    lengths against ``eps * cap``, are compared (a bucket's own ``eps`` times ``cap`` rounds above
    its shortest length for one length in twenty). A row is kept only where one unit counts 1 per
    member and another counts its members by their shares (a bucket's coefficient sums its
    members', so it may be over 1 either way): else the memory row or the one counting sequences
    over half the memory one per group is as strong."""
    single = np.array([is_single for _, is_single in units], dtype=bool)
    lo = np.array([lens[m].min() for m, _ in units], dtype=np.float64)  # a single's own length
    tokens = np.array([lens[m].sum() for m, _ in units], dtype=np.float64)
    longest = np.array([lens[m].max() for m, _ in units], dtype=np.float64)
    share = lo / cap
    candidates = np.concatenate([share[single], 1.0 - share[single] + 1e-9, share[~single]])
    candidates = np.sort(candidates[(candidates >= PAIR_EPS_LOW) & (candidates <= 0.5)])
    out: list[np.ndarray] = []
    last = -math.inf
    for eps in candidates.tolist():
        if eps - last < PAIR_EPS_STEP:
            continue
        last = eps
        whole = share > 1.0 - eps  # every member counts 1
        partial = (share >= eps) & ~whole  # members count their shares
        if not (whole.any() and partial.any()):
            continue
        bucket = np.where(share >= eps, tokens / cap, 0.0)
        bucket = np.where(whole, np.maximum(bucket, tokens / longest), bucket)
        out.append(np.where(single, pair_dff(share, eps), bucket))
    return out
