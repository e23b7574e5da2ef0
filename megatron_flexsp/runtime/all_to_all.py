"""Ulysses all-to-alls as autograd functions; the group is an argument and lives on ``ctx``.

``seq_to_head``: ``x_tNH`` (this rank's tokens, all heads) -> ``x_TnH`` (the group's tokens, in rank
order, this rank's heads). ``head_to_seq`` is its inverse; each one's backward is the other on the
same group, so backward never looks at a global "current group". ``token_counts[q]`` is the number
of tokens rank q of the group holds (uneven counts are fine); every member must pass the same list.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _check(x: torch.Tensor, group, token_counts: list[int], heads_dim_size: int) -> tuple[int, int]:
    d = len(token_counts)
    size = 1 if group is None else dist.get_world_size(group)
    if size != d:
        raise ValueError(f"token_counts has {d} entries but the group has {size} ranks")
    if heads_dim_size % d:
        raise ValueError(f"{heads_dim_size} heads are not divisible by the group size {d}")
    me = 0 if group is None else dist.get_rank(group)
    return d, me


def _seq_to_head(x_tNH: torch.Tensor, group, counts: list[int]) -> torch.Tensor:
    d, me = _check(x_tNH, group, counts, x_tNH.shape[1])
    if x_tNH.shape[0] != counts[me]:
        raise ValueError(f"this rank holds {x_tNH.shape[0]} tokens, token_counts says {counts[me]}")
    if d == 1:
        return x_tNH
    t, N, H = x_tNH.shape
    n = N // d
    send = x_tNH.reshape(t, d, n, H).permute(1, 0, 2, 3).contiguous()  # [d, t, n, H]
    recv = x_tNH.new_empty(sum(counts) * n * H)
    dist.all_to_all_single(recv, send.reshape(-1), output_split_sizes=[c * n * H for c in counts],
                           input_split_sizes=[t * n * H] * d, group=group)
    return recv.reshape(sum(counts), n, H)  # [T, n, H], rows grouped by source rank


def _head_to_seq(x_TnH: torch.Tensor, group, counts: list[int]) -> torch.Tensor:
    d, me = _check(x_TnH, group, counts, x_TnH.shape[1] * len(counts))
    if x_TnH.shape[0] != sum(counts):
        raise ValueError(f"got {x_TnH.shape[0]} tokens, token_counts sum to {sum(counts)}")
    if d == 1:
        return x_TnH
    T, n, H = x_TnH.shape
    t = counts[me]
    recv = x_TnH.new_empty(d * t * n * H)
    dist.all_to_all_single(recv, x_TnH.contiguous().reshape(-1),
                           output_split_sizes=[t * n * H] * d,
                           input_split_sizes=[c * n * H for c in counts], group=group)
    return recv.reshape(d, t, n, H).permute(1, 0, 2, 3).reshape(t, d * n, H)  # [t, N, H]


class SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_tNH, group, token_counts):
        ctx.group, ctx.counts = group, list(token_counts)
        return _seq_to_head(x_tNH, group, ctx.counts)

    @staticmethod
    def backward(ctx, grad_TnH):
        return _head_to_seq(grad_TnH, ctx.group, ctx.counts), None, None


class HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TnH, group, token_counts):
        ctx.group, ctx.counts = group, list(token_counts)
        return _head_to_seq(x_TnH, group, ctx.counts)

    @staticmethod
    def backward(ctx, grad_tNH):
        return _seq_to_head(grad_tNH, ctx.group, ctx.counts), None, None


def seq_to_head(x_tNH: torch.Tensor, *, group, token_counts: list[int]) -> torch.Tensor:
    """[t, N, H] on each rank -> [sum(token_counts), N/d, H]; differentiable."""
    return SeqToHead.apply(x_tNH, group, token_counts)


def head_to_seq(x_TnH: torch.Tensor, *, group, token_counts: list[int]) -> torch.Tensor:
    """[sum(token_counts), n, H] -> [t, n*d, H] on each rank; differentiable."""
    return HeadToSeq.apply(x_TnH, group, token_counts)
