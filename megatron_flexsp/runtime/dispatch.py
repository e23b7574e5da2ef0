"""Move each sequence's shards from the rank that loaded it to the ranks that run it.

Sequence ``s`` of the global batch is loaded by rank ``owner(s) = s % world`` (any fixed rule all
ranks agree on works). For one micro-batch of a plan, the owner sends to each member rank of the
sequence's group exactly that rank's shard (load-balanced layout, :mod:`layout`), in one
``all_to_all_single`` over the world group with per-destination split sizes. No rank ever holds a
sequence it neither loaded nor runs.

With tensor parallelism (``tp > 1``) the plan's ranks are devices of ``tp`` ranks (``rank = device *
tp + tp_rank``): sequence ``s`` is loaded by TP rank 0 of device ``s % devices``, the all-to-all moves
shards between TP ranks 0, and each TP rank 0 then broadcasts its rows over its TP group -- Megatron's
``get_batch_on_this_tp_rank`` pattern (one reader per TP group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_flexsp.runtime.layout import padded_length


def owner(seq: int, n: int) -> int:
    """The device (the rank, without tensor parallelism) of ``n`` that loads batch sequence ``seq``."""
    return seq % n


def dispatch(groups: list[tuple[tuple[int, ...], tuple[int, ...]]], lengths: list[int],
             loaded: dict[int, torch.Tensor], *, pad_value=0, trailing: tuple[int, ...] = (),
             dtype: torch.dtype = torch.int64, device: torch.device | str = "cpu", tp: int = 1,
             tp_group=None, pad_multiple: int = 1) -> torch.Tensor:
    """This rank's packed shards for one micro-batch (collective over the world group).

    ``groups``: the micro-batch's (devices, sequences); ``loaded``: the sequences this rank owns,
    ``{s: x[L_s, *trailing]}`` on the host (e.g. tokens and labels stacked as ``[L, 2]``, in one
    all-to-all; empty on TP ranks other than 0). Returns ``[t, *trailing]`` on ``device``: the rank's
    rows in its packing order, padding filled with ``pad_value`` (a scalar or one value per trailing
    column); empty if the rank runs nothing. The send buffer is assembled on the host and copied to
    the device once per micro-batch. ``trailing``, ``dtype``, ``device``, ``tp`` and
    ``pad_multiple`` (:func:`padded_length`) must be given alike on every rank (some ranks load
    nothing); with NCCL the device is the rank's GPU. ``tp_group``: this rank's TP group (needed
    when ``tp > 1``).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(f"world size {world} is not a multiple of tp={tp}")
    if tp > 1 and tp_group is None:
        raise ValueError(f"tp={tp} needs this rank's tensor-parallel group")
    devices = world // tp
    me, tp_rank = divmod(rank, tp)
    reader = tp_rank == 0  # TP rank 0 of each device reads and exchanges; its peers get a broadcast
    row = 1
    for t in trailing:
        row *= t
    send: list[list[torch.Tensor]] = [[] for _ in range(world)]
    recv_counts = [0] * world
    pad = torch.as_tensor(pad_value, dtype=dtype)
    for ranks, seqs in groups:
        d = len(ranks)
        for s in seqs:
            length, src = lengths[s], owner(s, devices) * tp
            chunk = padded_length(length, d, pad_multiple) // (2 * d)
            if rank == src:
                if s not in loaded:
                    raise ValueError(f"rank {rank} should own sequence {s} but did not load it")
                full = torch.empty((2 * d * chunk,) + tuple(trailing), dtype=dtype)
                full[:] = pad
                full[:length] = loaded[s].to(dtype)
                for r, dest in enumerate(ranks):  # chunks r and 2d-1-r (the load-balanced layout)
                    send[dest * tp] += [full[r * chunk:(r + 1) * chunk],
                                        full[(2 * d - 1 - r) * chunk:(2 * d - r) * chunk]]
            if reader and me in ranks:
                recv_counts[src] += 2 * chunk
    send_sizes = [int(sum(len(x) for x in chunks)) for chunks in send]
    flat = (torch.cat([x for chunks in send for x in chunks]) if any(send_sizes)
            else torch.empty((0,) + tuple(trailing), dtype=dtype)).to(device)
    recv = torch.empty((sum(recv_counts),) + tuple(trailing), dtype=dtype, device=device)
    dist.all_to_all_single(recv.view(-1), flat.reshape(-1), output_split_sizes=[c * row for c in recv_counts],
                           input_split_sizes=[c * row for c in send_sizes])
    # reassemble in packing order: for my group, sequences in plan order, each from its owner
    by_src = list(recv.split(recv_counts))
    taken = [0] * world
    out, total = [], 0
    for ranks, seqs in groups:
        if me not in ranks:
            continue
        for s in seqs:
            n = padded_length(lengths[s], len(ranks), pad_multiple) // len(ranks)
            total += n
            if reader:
                src = owner(s, devices) * tp
                out.append(by_src[src][taken[src]:taken[src] + n])
                taken[src] += n
    if reader:
        rows = torch.cat(out) if out else torch.empty((0,) + tuple(trailing), dtype=dtype, device=device)
    else:
        rows = torch.empty((total,) + tuple(trailing), dtype=dtype, device=device)
    if tp > 1 and total:
        dist.broadcast(rows, src=me * tp, group=tp_group)
    return rows
