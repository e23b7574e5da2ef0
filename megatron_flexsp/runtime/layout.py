"""Token layout of the sequences a group runs: load-balanced causal sharding (Megatron THD style).

Each sequence of length L on a group of d ranks is padded to a multiple of 2d and cut into 2d equal
chunks; rank r holds chunks r and 2d-1-r (so every rank gets the same causal work, the layout
Megatron's THD RoPE assumes under context parallelism). Padding sits at the end of each sequence,
where causal attention never lets a real token see it; it is masked out of the loss.

``multiple`` (default 1) pads further, to a multiple of ``2 d multiple``: with tensor parallelism's
sequence parallelism (``multiple = tp``) every rank's shard then splits evenly over its TP ranks,
the rule Megatron applies to THD batches under context and sequence parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


def padded_length(length: int, d: int, multiple: int = 1) -> int:
    """``length`` rounded up to a multiple of ``2 d multiple`` (ValueError for non-positive inputs)."""
    if length <= 0 or d <= 0 or multiple <= 0:
        raise ValueError(f"length={length}, group size d={d} and multiple={multiple} must be positive")
    step = 2 * d * multiple
    return -(-length // step) * step


def shard_positions(length: int, d: int, r: int, multiple: int = 1) -> torch.Tensor:
    """Positions (in the padded sequence) that rank ``r`` of a group of ``d`` holds, ascending."""
    if not 0 <= r < d:
        raise ValueError(f"rank {r} outside a group of {d}")
    chunk = padded_length(length, d, multiple) // (2 * d)
    first = torch.arange(r * chunk, (r + 1) * chunk)
    second = torch.arange((2 * d - 1 - r) * chunk, (2 * d - r) * chunk)
    return torch.cat([first, second])


def local_positions(lengths: list[int], size: int, r: int, multiple: int = 1) -> torch.Tensor:
    """Positions within their own sequences of rank r's packed tokens (padding beyond each length)."""
    return torch.cat([shard_positions(L, size, r, multiple) for L in lengths])


@dataclass(frozen=True)
class GroupLayout:
    """Layout of the packed sequences of one group.

    Natural order: the padded sequences one after another (``cu_seqlens`` over padded lengths).
    ``local_index[r]``: natural-order rows rank r holds, in its packing order.
    ``gather_index``: natural-order row of every row after :func:`seq_to_head` (ranks in order).
    ``natural_index``: its inverse (gathered row of every natural-order row).
    ``valid``: natural-order rows that are real tokens (not padding).
    ``cu_list`` / ``max_seqlen``: the boundaries and the longest padded sequence as Python ints, so
    attention never reads them back from a device. :meth:`to` moves the index tensors to a device
    once per micro-batch (and adds the int32 boundaries the GPU kernels take, ``cu_seqlens_i32``).
    """

    lengths: tuple[int, ...]
    size: int
    cu_seqlens: torch.Tensor
    local_index: tuple[torch.Tensor, ...]
    gather_index: torch.Tensor
    natural_index: torch.Tensor
    valid: torch.Tensor
    cu_list: tuple[int, ...] = ()
    max_seqlen: int = 0
    cu_seqlens_i32: torch.Tensor | None = None

    @property
    def token_counts(self) -> list[int]:
        return [len(ix) for ix in self.local_index]

    def to(self, device: torch.device | str) -> "GroupLayout":
        """This layout with the tensors attention uses on ``device`` (the host copies stay for
        dispatch); a no-op copy when they are there already."""
        device = torch.device(device)
        if self.gather_index.device == device and self.cu_seqlens_i32 is not None:
            return self
        return replace(self, cu_seqlens=self.cu_seqlens.to(device),
                       gather_index=self.gather_index.to(device), natural_index=self.natural_index.to(device),
                       valid=self.valid.to(device),
                       cu_seqlens_i32=self.cu_seqlens.to(device=device, dtype=torch.int32))

    def to_natural(self, x_T: torch.Tensor) -> torch.Tensor:
        """Rows in gathered order -> natural order (first dimension)."""
        return x_T[self.natural_index.to(x_T.device)]

    def to_gathered(self, x_T: torch.Tensor) -> torch.Tensor:
        """Rows in natural order -> gathered order (inverse of :meth:`to_natural`)."""
        return x_T[self.gather_index.to(x_T.device)]


def build_group_layout(lengths: list[int], size: int, multiple: int = 1) -> GroupLayout:
    """Layout of sequences ``lengths`` packed on a group of ``size`` ranks (host tensors)."""
    if not lengths:
        raise ValueError("a group must run at least one sequence")
    padded = [padded_length(L, size, multiple) for L in lengths]
    starts = [0]
    for p in padded:
        starts.append(starts[-1] + p)
    local = []
    for r in range(size):
        local.append(torch.cat([shard_positions(L, size, r, multiple) + s
                                for L, s in zip(lengths, starts)]))
    valid = torch.zeros(starts[-1], dtype=torch.bool)
    for L, s in zip(lengths, starts):
        valid[s:s + L] = True
    gather = torch.cat(local)
    return GroupLayout(tuple(lengths), size, torch.tensor(starts, dtype=torch.int64), tuple(local),
                       gather, torch.argsort(gather), valid, tuple(starts), max(padded))
