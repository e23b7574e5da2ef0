"""Which of the search families' layouts the polishing works on.

The search (:mod:`planner.search`) yields layouts from several families; the polishing
(:mod:`planner.polish`) settles a few of them. Each layout is taken once (:func:`distinct`), and
every family's best is ranked by a copy given the local search (:func:`searched_copies`): the
local search moves some families far, and settling (re-packing first) takes tenths of a second a
layout at 1,024 GPUs, so only the layouts that rank first are settled.
"""

from __future__ import annotations

from megatron_flexsp.planner.layout import Group, Tables, improve_layout

__all__ = ["distinct", "family", "family_bests", "kept", "searched_copies"]

Layout = list[list[Group]]
#: Polishing settles another family's best layout (after the two best) only within this share of
#: the best layout's step time: on the paired benchmark's 56 batches at 4 s the layouts that came
#: out best were at most 1.6% behind before it (0.6% and 1.4% where settling moved a third family
#: to the front), while settling one takes tenths of a second at 1,024 GPUs
SETTLE_WITHIN = 0.05


def searched_copies(found: list[tuple[float, str, Layout]], tab: Tables, deadline, skip_first: int = 0
                    ) -> dict[int, tuple[float, Layout]]:
    """The local search (:func:`improve_layout`) on a copy of each family's best layout in
    ``found`` (sorted) within :data:`SETTLE_WITHIN` of the first, but the ``skip_first`` best
    families', until ``deadline``: {id of the layout: (the copy's step ms, the copy)}."""
    limit = found[0][0] * (1 + SETTLE_WITHIN) if found else 0.0
    out: dict[int, tuple[float, Layout]] = {}
    for ms, name, layout in family_bests(found, exclude=set())[skip_first:]:
        if ms > limit or deadline.expired():
            break
        copy = tab.clone_layout(layout)
        improve_layout(copy, tab, deadline=deadline)
        out[id(layout)] = (tab.step_ms(copy), copy)
    return out


def kept(settled: tuple[float, str, Layout], copy: tuple[float, Layout] | None) -> tuple[float, str, Layout]:
    """The settled layout, or the searched copy of it from before settling where that is faster."""
    if copy is not None and copy[0] < settled[0]:
        return copy[0], settled[1], copy[1]
    return settled


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
