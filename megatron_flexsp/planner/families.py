"""The search families' layouts as the polishing (:mod:`planner.polish`) takes them: each layout
once (:func:`distinct`), each family's best (:func:`family_bests`), a family's name without its
variant (:func:`family`).
"""

from __future__ import annotations

from megatron_flexsp.planner.layout import Group

__all__ = ["SETTLE_WITHIN", "distinct", "family", "family_bests"]

Layout = list[list[Group]]
#: Polishing settles another family's best layout (after the two best) only within this share of
#: the best layout's step time: on the paired benchmark's 56 batches at 4 s the layouts that came
#: out best were at most 1.6% behind before it (0.6% and 1.4% where settling moved a third family
#: to the front), while settling one takes tenths of a second at 1,024 GPUs
SETTLE_WITHIN = 0.05


def distinct(found: list[tuple[float, str, Layout]]) -> list[tuple[float, str, Layout]]:
    """``found`` (step ms, family, layout) sorted by step time, each layout once: a family may
    yield the same layout twice and two families the same one (both shelves scores; groups first
    and a stuffed first micro-batch of nothing but groups), and settling a copy again cost half a
    second of a 9 s budget at 1,024 GPUs. Only layouts whose step times agree (within 1e-9 of
    them: the same plan summed in another order) are compared, by :func:`_layout_key`."""
    out: list[tuple[float, str, Layout]] = []
    run: list[tuple] = []  # keys of the kept layouts with the last one's step time
    for c in sorted(found, key=lambda c: c[0]):
        if out and c[0] <= out[-1][0] * (1 + 1e-9):
            run = run or [_layout_key(out[-1][2])]
            key = _layout_key(c[2])
            if key in run:
                continue
            run.append(key)
        else:
            run = []
        out.append(c)
    return out


def family(name: str) -> str:
    """A search family's name without its variant (``stuffed+split`` and ``stuffed+groups`` share
    their first micro-batch)."""
    return name.split("+")[0]


def _layout_key(layout: Layout) -> tuple:
    """What makes two layouts the same plan: each micro-batch's groups (size, sequences), in any
    order of groups and of micro-batches."""
    return tuple(sorted(tuple(sorted((g.size, tuple(sorted(g.seqs))) for g in mb)) for mb in layout))


def family_bests(found: list[tuple[float, str, Layout]], exclude: set[str]) -> list[tuple[float, str, Layout]]:
    """The fastest layout of each family in ``found`` (sorted, fastest first) not in ``exclude``."""
    seen = set(exclude)
    out = []
    for c in found:
        if c[1] not in seen:
            seen.add(c[1])
            out.append(c)
    return out
