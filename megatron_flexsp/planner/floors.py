"""Simple bounds on the step time (ms), valid for any plan with at least a given number of
micro-batches; they cost a sort, and stand for the counts the LP bound (:mod:`planner.bound`)
does not search.

* Every micro-batch costs at least the smallest fixed cost ``f_min`` plus its GPU-time over N.
* The slowest micro-batches, by the slowest sequence each holds (its *head*): the i+1-th slowest
  head is at least the fastest finish of sequence ``J_i``, the first of the sequences (slowest
  first) whose tokens together exceed i micro-batches' memory (``i N C``): those cannot all share
  the i micro-batches with the slowest heads. The other micro-batches hold at least the batch's
  tokens less ``k N C`` and cost at least the least GPU-time of that many tokens (cheapest per
  token first, fractionally, the slowest sequence left out: it is in the slowest micro-batch)
  plus their fixed costs.

Where many micro-batches cost little each (a small fixed cost) the second kind is what makes
more of them slow: a 144,640-token document filling a 64-GPU micro-batch of 8-GPU groups for
6.07 s leaves 1.33M tokens, at least 1.58 s of GPU-time over N, to the others, where the fixed
costs alone gave 16 ms each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_flexsp.planner.heuristics import min_micro_batches
from megatron_flexsp.planner.layout import Tables

__all__ = ["StepFloors", "step_floors"]


@dataclass(frozen=True)
class StepFloors:
    """``f_min`` (ms): the smallest fixed cost; ``area`` (ms): the least GPU-time of the batch
    over N; ``heads[k-1]`` (ms): the k slowest micro-batches' heads together plus the least
    GPU-time over N of the tokens the others hold, for k = 1 up to the memory minimum."""

    f_min: float
    area: float
    heads: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_heads", np.asarray(self.heads, dtype=np.float64))

    def at_least(self, m: int) -> float:
        """A valid lower bound (ms) on the step time of plans with ``m`` or more micro-batches."""
        best = m * self.f_min + self.area
        heads = self._heads[:max(m, 0)]
        if len(heads):  # the k slowest heads, the others at their fixed costs at least
            best = max(best, float((heads + (m - np.arange(1, len(heads) + 1)) * self.f_min).max()))
        return best


def step_floors(tab: Tables) -> StepFloors:
    """The floors of ``tab``'s batch (see the module docstring)."""
    n = tab.cm.cluster.num_gpus
    f_min = min(tab.fixed.values())
    gpu_ms = tab.least_gpu_time_ms()
    crit = tab.critical_ms()
    lens = tab.lens.astype(np.float64)
    mb_tokens = float(n) * tab.cm.capacity_tokens
    by_crit = np.argsort(-crit, kind="stable")
    held = np.cumsum(lens[by_crit])  # tokens of the slowest sequences, slowest first
    slowest = int(by_crit[0])
    others = np.delete(np.arange(len(lens)), slowest)
    by_rate = others[np.argsort(gpu_ms[others] / lens[others], kind="stable")]
    cheap_tokens = np.concatenate(([0.0], np.cumsum(lens[by_rate])))
    cheap_ms = np.concatenate(([0.0], np.cumsum(gpu_ms[by_rate])))

    # the k-th head (k >= 2): the first sequence whose slowest-first prefix overflows k-1
    # micro-batches; k runs up to the memory minimum, or while such a sequence exists
    k = np.arange(1, min_micro_batches(tab) + 1)
    j = np.searchsorted(held, (k[1:] - 1) * mb_tokens, side="right")
    stop = np.flatnonzero(j >= len(held))
    j = j[:stop[0]] if len(stop) else j
    k = k[:len(j) + 1]
    total_heads = np.cumsum(np.concatenate(([float(crit[slowest])], crit[by_crit[j]])))
    # and the cheapest tokens the other micro-batches hold (GPU-ms): the cheapest ``prev`` whole,
    # then a share of the next
    tokens = float(lens.sum()) - k * mb_tokens
    cheap = np.zeros(len(k))
    if len(by_rate):
        pos = tokens > 0.0
        whole = np.minimum(np.searchsorted(cheap_tokens, tokens[pos]), len(by_rate))
        prev = whole - 1
        share = (tokens[pos] - cheap_tokens[prev]) / lens[by_rate[prev]]
        cheap[pos] = cheap_ms[prev] + np.minimum(share, 1.0) * gpu_ms[by_rate[prev]]
    heads = total_heads + cheap / n
    return StepFloors(f_min, float(gpu_ms.sum()) / n, tuple(heads.tolist()))
