"""Branch and bound over boxes of the slowest micro-batches' makespans, for one micro-batch count.

A box holds intervals for the ``k`` slowest makespans ``T_1 >= ... >= T_k`` of plans with ``m``
micro-batches; the LP of :mod:`planner.step_lp` over a box bounds every plan whose makespans lie in
it. :class:`CountSearch` keeps the open boxes in a heap by bound, refines the lowest one's pooled
cap once, then splits it along its widest interval (:func:`children`); its lowest bound is valid
at any time. :mod:`planner.bound` runs one search per count.
"""

from __future__ import annotations

import heapq

from megatron_flexsp.planner.layout import Tables
from megatron_flexsp.planner.step_lp import Box, Hint, SolverTrouble, _StepLP

__all__ = ["CountSearch", "children"]


def children(box: Box, p: int) -> list[Box]:
    """``box`` split in half along dimension ``p``, each half tightened to sorted makespans
    (``T_q >= T_q+1``); empty halves are left out."""
    a, b = box[p]
    mid = 0.5 * (a + b)
    out = []
    for half in ((a, mid), (mid, b)):
        dims = list(box)
        dims[p] = half
        for q in range(1, len(dims)):  # T_q <= T_q-1
            dims[q] = (dims[q][0], min(dims[q][1], dims[q - 1][1]))
        for q in range(len(dims) - 2, -1, -1):  # T_q >= T_q+1
            dims[q] = (max(dims[q][0], dims[q + 1][0]), dims[q][1])
        if all(lo <= hi for lo, hi in dims):
            out.append(tuple(dims))
    return out


class CountSearch:
    """Branch and bound over boxes of the ``explicit`` slowest makespans, for plans with exactly
    ``m`` micro-batches faster than ``target_ms`` whose slowest micro-batch lies in
    ``[t1_lo, t1_hi]``. ``bound`` is valid at any time; ``floor`` is a bound already proven."""

    def __init__(self, tab: Tables, m: int, units, *, target_ms: float, t1_lo: float, t1_hi: float,
                 rel_tol: float, explicit: int, floor: float = 0.0, deadline=None,
                 open_ended: bool = False) -> None:
        self.lp = _StepLP(tab, m, units, k=explicit, open_ended=open_ended)
        self.lp.deadline = deadline
        self.m, self.k, self.target, self.rel_tol, self.floor = m, self.lp.k, target_ms, rel_tol, floor
        f = self.lp.f_min
        # the p-th slowest micro-batch of a plan faster than the target: p T_p + (m - p) f_min <= target
        box = tuple((t1_lo if p == 0 else f, (target_ms - (m - p - 1) * f) / (p + 1)) for p in range(self.k))
        box = ((t1_lo, min(box[0][1], t1_hi)),) + box[1:]
        self.heap: list[tuple[float, int, Box]] = []
        self.made = 0
        self._bases: dict[int, object] = {}  # an open box's LP basis, by its heap id
        # open boxes whose pooled cap is not yet refined -> their own first solve (the refinement's start)
        self._pending: dict[int, float] = {}
        if box[0][1] > t1_lo:
            self._push(box, deadline)

    def _push(self, box: Box, deadline, parent_ms: float = 0.0) -> None:
        """Bound ``box`` by one solve; its refinement (:meth:`_StepLP.refine`) waits until it is
        the lowest box (most boxes never are). ``parent_ms``: a bound proven for a box holding
        this one (its parent's, often refined above what one solve here proves), kept as a floor."""
        first, settled = self.lp.first_probe(box, self._r_cap(box))
        val = max(first, parent_ms)
        if val < self.target:
            self._bases[self.made] = self.lp.basis()
            if not settled:
                self._pending[self.made] = first
            heapq.heappush(self.heap, (val, self.made, box))
            self.made += 1

    def _r_cap(self, box: Box) -> float:
        return self.target - sum(a for a, _ in box)

    @property
    def solves(self) -> int:
        return self.lp.solves

    @property
    def bound(self) -> float:
        """Valid lower bound (ms) on these plans' step time (the target when none is left)."""
        return max(self.floor, min(self.heap[0][0], self.target)) if self.heap else self.target

    def done(self) -> bool:
        """True once no box can raise the bound (converged, or the lowest box is narrow)."""
        if not self.heap or self.bound >= self.target * (1 - self.rel_tol):
            return True
        _, top, bx = self.heap[0]
        return top not in self._pending and all(b - a <= self.rel_tol * a for a, b in bx)

    def step(self, deadline=None) -> None:
        """Refine the box with the lowest bound, or split it along its widest makespan range
        once refined."""
        top = heapq.heappop(self.heap)
        bx = top[2]
        if top[1] in self._pending:
            self.lp.start_from(self._bases[top[1]])
            try:
                val = max(top[0], self.lp.refine(bx, self._r_cap(bx), self._pending[top[1]], self.rel_tol,
                                                 deadline))
            except SolverTrouble:
                heapq.heappush(self.heap, top)
                raise
            del self._pending[top[1]]
            if val < self.target:
                self._bases[top[1]] = self.lp.basis()
                heapq.heappush(self.heap, (val, top[1], bx))
            else:
                del self._bases[top[1]]
            return
        p = max(range(self.k), key=lambda q: bx[q][1] - bx[q][0])
        basis = self._bases.pop(top[1])
        try:
            for child in children(bx, p):
                self.lp.start_from(basis)
                self._push(child, deadline, top[0])
        except SolverTrouble:
            self._bases[top[1]] = basis
            heapq.heappush(self.heap, top)  # its children may be missing: keep it whole
            raise

    def hint(self) -> Hint | None:
        """The relaxed placement in the lowest open box (one LP solve; None when none is open)."""
        if not self.heap:
            return None
        box = self.heap[0][2]
        return self.lp.hint(box, self._r_cap(box))

    def t1_range(self) -> tuple[float, float]:
        """Slowest makespans (ms) the open boxes span: a plan faster than the target is there."""
        if not self.heap:
            return (0.0, 0.0)
        return min(bx[0][0] for _, _, bx in self.heap), max(bx[0][1] for _, _, bx in self.heap)
