"""The LP bound's group-counting rows (:class:`~megatron_flexsp.planner.count_rows.CountRow`): a bucket of
long sequences counts, for any share of its tokens, no more groups than the members making up that
share need, and all of them when all are placed. The memory rows (:func:`pair_rows`): no set of
sequences that fits one group counts more than one group."""

import itertools
import math

import numpy as np
import pytest

from megatron_flexsp.planner.count_rows import CountRow, pair_rows


class _Recorder:
    """Stands in for HiGHS: keeps the coefficients and row upper bounds that are set."""

    def __init__(self) -> None:
        self.coef: dict[tuple[int, int], float] = {}
        self.upper: dict[int, float] = {}

    def changeCoeff(self, row: int, col: int, value: float) -> None:  # noqa: N802 (HiGHS's name)
        self.coef[row, col] = value

    def changeRowBounds(self, row: int, lo: float, hi: float) -> None:  # noqa: N802
        self.upper[row] = hi


def _needed(works, room: float, w_star: float | None) -> np.ndarray:
    """Groups each sequence needs by the dual feasible function, written out: a sequence over half
    the room takes a group of its own; one that cannot share a group with the lightest of those
    takes its share of a group's time; the rest count nothing."""
    out = []
    for w in works:
        if 2 * w > room:
            out.append(1.0)
        elif w_star is not None and w > room - w_star + 1e-9 * room:
            out.append(w / room)
        else:
            out.append(0.0)
    return np.array(out)


@pytest.mark.parametrize("seed", range(12))
def test_a_bucket_counts_no_more_groups_than_the_members_placed_need(seed):
    rng = np.random.default_rng(seed)
    fixed = 5.0
    k = int(rng.integers(3, 10))
    works = np.sort(rng.uniform(1.0, 60.0, size=k))
    lens = rng.uniform(10.0, 100.0, size=k)  # any lengths: the rows must not assume an order
    single_work = float(rng.uniform(1.0, 60.0))
    level = fixed + float(rng.uniform(0.6, 1.4)) * float(works.max())
    room = level - fixed
    tokens = np.array([lens.sum(), 50.0])
    work = np.array([works[0], single_work])
    sl = CountRow(0, np.array([10, 11]), work, tokens, np.array([lens.max(), 50.0]),
                  np.array([lens.sum() / lens.max(), 1.0]), [(0, works, works + fixed, lens, 1)])
    h = _Recorder()
    sl.count(h, level, room, 2.0 * work > room)
    low = h.coef.get((0, 10), 0.0)
    slope, rhs = h.coef.get((1, 10), 0.0), h.upper.get(1, math.inf)
    runs = works + fixed <= level  # the members that may run at this level
    heavy_works = [float(w) for w in works[runs] if 2 * w > room]
    if 2 * single_work > room and single_work <= room:
        heavy_works.append(single_work)
    need = _needed(works, room, min(heavy_works) if heavy_works else None)
    members = np.flatnonzero(runs)
    for r in range(len(members) + 1):
        for subset in itertools.combinations(members.tolist(), r):
            x = lens[list(subset)].sum() / tokens[0]
            counted = low * x + max(0.0, slope * x - rhs)
            assert counted <= need[list(subset)].sum() + 1e-9, (subset, counted, need)
    if len(members):  # and every one of them when all are placed
        x = lens[members].sum() / tokens[0]
        assert low * x + max(0.0, slope * x - rhs) >= need[members].sum() - 1e-9


@pytest.mark.parametrize("seed", range(8))
def test_each_of_several_buckets_in_a_row_counts_what_its_own_members_need(seed):
    """Three buckets of long sequences in one row, one whose members all finish past the level:
    each bucket's coefficients follow its own members (looked up for all buckets at once), with the
    lightest slow work among every bucket's members and the row's singles."""
    rng = np.random.default_rng(100 + seed)
    fixed = 5.0
    tails, works_all, lens_all = [], [], []
    for b in range(3):
        k = int(rng.integers(2, 7))
        works = np.sort(rng.uniform(1.0, 60.0, size=k)) + (200.0 if b == 2 else 0.0)  # b=2: too slow
        lens = rng.uniform(10.0, 100.0, size=k)
        works_all.append(works)
        lens_all.append(lens)
        tails.append((b, works, works + fixed, lens, 10 + b))
    single_work = float(rng.uniform(1.0, 60.0))
    # from seed 6 on, no sequence that may run is over half a group's time (none counts)
    factor = float(rng.uniform(0.6, 1.4)) if seed < 6 else 2.5
    level = fixed + factor * float(max(w.max() for w in works_all[:2] + [np.array([single_work])]))
    room = level - fixed
    tokens = np.array([lens.sum() for lens in lens_all] + [50.0])
    work = np.array([w[0] for w in works_all] + [single_work])
    span = np.array([lens.max() for lens in lens_all] + [50.0])
    scale = np.array([lens.sum() / lens.max() for lens in lens_all] + [1.0])
    sl = CountRow(0, np.array([20, 21, 22, 23]), work, tokens, span, scale, tails)
    h = _Recorder()
    sl.count(h, level, room, 2.0 * work > room)
    heavy_works = [float(w) for works in works_all for w in works if w + fixed <= level and 2 * w > room]
    if 2 * single_work > room and single_work <= room:
        heavy_works.append(single_work)
    w_star = min(heavy_works) if heavy_works else None
    for b, (works, lens) in enumerate(zip(works_all, lens_all)):
        low = h.coef.get((0, 20 + b), 0.0)
        slope, rhs = h.coef.get((10 + b, 20 + b), 0.0), h.upper.get(10 + b, math.inf)
        members = np.flatnonzero(works + fixed <= level)
        if b == 2:
            assert len(members) == 0 and low == 0.0 and slope == 0.0 and rhs == math.inf
            continue
        need = _needed(works, room, w_star)
        for r in range(len(members) + 1):
            for subset in itertools.combinations(members.tolist(), r):
                x = lens[list(subset)].sum() / tokens[b]
                assert low * x + max(0.0, slope * x - rhs) <= need[list(subset)].sum() + 1e-9
        if len(members):
            x = lens[members].sum() / tokens[b]
            assert low * x + max(0.0, slope * x - rhs) >= need[members].sum() - 1e-9
            per_token = need[members] / lens[members]
            assert low == pytest.approx(per_token.min() * tokens[b], rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_no_group_counts_more_than_one_in_the_memory_pair_rows(seed):
    """Every set of sequences that fits a group's memory, singles and any members of two buckets
    (a bucket's column counting the share of its tokens those members make up), sums to at most 1
    in every row: the rows only count groups that every plan needs."""
    rng = np.random.default_rng(seed)
    cap = 1000
    singles = rng.integers(150, 900, size=6)
    buckets = [np.sort(rng.integers(250, 420, size=3)), np.sort(rng.integers(610, 700, size=3))]
    lens = np.concatenate([singles] + buckets).astype(np.int64)
    units = [(np.array([i]), True) for i in range(6)] + [(np.arange(6, 9), False), (np.arange(9, 12), False)]
    rows = pair_rows(units, lens, cap)
    assert rows, "the instance has sequences over half the memory and ones they cannot pair with"
    owner = [j for j, (members, _) in enumerate(units) for _ in members]
    tokens = [float(lens[members].sum()) for members, _ in units]
    for coef in rows:
        for r in range(1, len(lens) + 1):
            for subset in itertools.combinations(range(len(lens)), r):
                if lens[list(subset)].sum() > cap:
                    continue
                total = sum(coef[owner[i]] * lens[i] / tokens[owner[i]] for i in subset)
                assert total <= 1.0 + 1e-9, (coef, subset, total)


def test_a_sequence_over_half_the_memory_counts_whole_beside_those_it_cannot_pair_with():
    """Shares 0.6 and 0.45 of a group: no two 0.6 share a group, nor a 0.6 and a 0.45. Memory alone
    counts 2.1 groups for two of each; some row counts 1 + 1 + 0.45 + 0.45 = 2.9 (three groups)."""
    lens = np.array([600, 600, 450, 450], dtype=np.int64)
    units = [(np.array([i]), True) for i in range(4)]
    best = max(float(coef.sum()) for coef in pair_rows(units, lens, 1000))
    assert best == pytest.approx(2.9)


@pytest.mark.parametrize("cap", [1000, 201504])
def test_a_bucket_beside_a_sequence_filling_the_memory_is_counted_in_some_pair_row(cap):
    """A sequence over 97% of a group's memory leaves no room for any member of a bucket whose
    shortest is a quarter of it, so one group cannot hold both: some row counts the sequence 1 and
    the bucket's column (three members, 1.05 groups of memory in all) at least its memory share. A
    bucket's coefficient sums its members' and is over 1 here; and at 201,504 tokens the shortest
    member's share times the capacity rounds above its length (the bucket's own ``eps``)."""
    shortest = 50461 if cap == 201504 else 251
    lens = np.array([int(0.976 * cap), shortest, int(0.38 * cap), int(0.42 * cap)], dtype=np.int64)
    units = [(np.array([0]), True), (np.arange(1, 4), False)]
    share = lens[1:].sum() / cap
    rows = pair_rows(units, lens, cap)
    assert any(coef[0] == 1.0 and coef[1] >= share - 1e-12 for coef in rows), rows
