"""This rank's micro-batches of one global batch, for Megatron's forward step.

``flexsp_micro_batches``: one per plan micro-batch in which this rank is in a group, with the
group's packed THD shard (:mod:`megatron_flexsp.runtime.layout`), its process group and
:class:`FlexSPPackedSeqParams`. ``plain_micro_batches``: the baseline, Megatron data parallelism
over packed rows (the rank's documents first-fit into rows of ``--seq-length``, a block-diagonal
causal mask, positions restarting at every document). Both give the same tokens, labels and
per-token loss terms, so losses agree up to float rounding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatron_flexsp.integration.attention import FlexSPPackedSeqParams
from megatron_flexsp.integration.data import GlobalBatch
from megatron_flexsp.plan import StepPlan
from megatron_flexsp.runtime.device import synchronize
from megatron_flexsp.runtime.dispatch import dispatch, owner
from megatron_flexsp.runtime.layout import build_group_layout, local_positions, padded_length


@dataclass
class MicroBatch:
    """Inputs of one forward step: ``[b, t]`` tensors (``b`` = 1 for FlexSP's packed THD)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    packed_seq_params: FlexSPPackedSeqParams | None = None
    ranks: tuple[int, ...] = ()
    group: object = None
    placeholder: bool = False  # a rank with no work this step runs 2 masked tokens
    real_lengths: tuple[int, ...] = ()  # the documents' trained lengths (for Megatron's TFLOP/s)


def _flexsp_item(rows: torch.Tensor, lens: list[int], ranks: tuple[int, ...], group, index: int,
                 max_position: int, device, multiple: int = 1, eod: int | None = None) -> MicroBatch:
    """One group's micro-batch on this rank: ``ranks`` are the group's global ranks (this rank's TP
    rank on each device), ``index`` this rank's place among them."""
    d = len(ranks)
    layout = build_group_layout(lens, d, multiple).to(device)  # once per micro-batch: no copies per layer
    pos = local_positions(lens, d, index, multiple).to(device)
    counts = [padded_length(L, d, multiple) // d for L in lens]
    per_row_len = torch.repeat_interleave(torch.tensor(lens), torch.tensor(counts)).to(device)
    mask = pos < per_row_len
    if eod is not None:  # --eod-mask-loss: no loss where the input token is the end of document
        mask &= rows[:, 0] != eod
    mask = mask.float()
    cu = layout.cu_seqlens_i32
    max_len = layout.max_seqlen
    psp = FlexSPPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu, max_seqlen_q=max_len,
                                max_seqlen_kv=max_len, local_cp_size=d, cp_group=group,
                                flexsp_layout=layout)
    return MicroBatch(rows[:, 0].unsqueeze(0), rows[:, 1].unsqueeze(0), mask.unsqueeze(0),
                      pos.clamp(max=max_position - 1).unsqueeze(0), None, psp, ranks, group,
                      real_lengths=tuple(lens))


def placeholder_micro_batch(rank: int, group, device, multiple: int = 1) -> MicroBatch:
    """Fully masked tokens (2, or ``2 multiple`` under sequence parallelism) on a one-device group:
    keeps Megatron's loop and DDP uniform."""
    n = 2 * multiple
    rows = torch.zeros(n, 2, dtype=torch.int64, device=device)
    item = _flexsp_item(rows, [n], (rank,), group, 0, n, device, multiple)
    item.loss_mask.zero_()
    item.placeholder = True
    return item


def flexsp_micro_batches(plan: StepPlan, batch: GlobalBatch, *, pool, rank: int, world: int,
                         max_position: int, device, tp_group=None, pad_multiple: int = 1,
                         eod: int | None = None) -> tuple[list[MicroBatch], float]:
    """This rank's micro-batches of ``plan`` (collective: one dispatch per plan micro-batch).

    Returns the items and the seconds spent in dispatch. ``pool`` maps devices to this rank's
    process groups (one-device groups included; ``pool.tp`` ranks per device); ``max_position``:
    size of a learned position table, if any; ``tp_group``: this rank's tensor-parallel group (TP
    rank 0 reads and broadcasts); ``pad_multiple``: the TP size under sequence parallelism, else 1;
    ``eod``: with ``--eod-mask-loss``, the end-of-document token that trains no loss.
    """
    tp = getattr(pool, "tp", 1)
    me = rank // tp
    lengths = [int(x) for x in plan.seq_lens]
    if lengths != [int(x) for x in batch.lengths]:
        raise ValueError(f"step {batch.step}: the plan's sequence lengths differ from the batch's "
                         f"({lengths[:4]}... vs {batch.lengths[:4].tolist()}...)")
    items, spent = [], 0.0
    for mb in plan.micro_batches:
        groups = [(g.ranks, g.seqs) for g in mb.groups]
        t0 = time.perf_counter()
        rows = dispatch(groups, lengths, batch.loaded, trailing=(2,), device=device, tp=tp,
                        tp_group=tp_group, pad_multiple=pad_multiple)
        synchronize(device)
        spent += time.perf_counter() - t0
        for g in mb.groups:
            if me in g.ranks:
                items.append(_flexsp_item(rows, [lengths[s] for s in g.seqs], pool.global_ranks(g.ranks),
                                          pool.get(g.ranks), g.ranks.index(me), max_position, device,
                                          pad_multiple, eod))
    return items, spent


def _first_fit(lens: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lens`` first-fit into bins of ``capacity`` (longest first, deterministic)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        for b, free in enumerate(room):
            if lens[i] <= free:
                bins[b].append(i)
                room[b] -= lens[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lens[i])
    return bins


def plain_micro_batches(batch: GlobalBatch, *, rank: int, world: int, seq_length: int,
                        micro_batch_size: int, device, eod: int | None = None) -> list[MicroBatch]:
    """This data-parallel rank's documents (``rank`` of ``world`` data-parallel ranks; TP peers
    alike) packed into rows of ``seq_length``, ``micro_batch_size`` rows each."""
    mine = [s for s in range(len(batch.lengths)) if owner(s, world) == rank]
    lens = [int(batch.lengths[s]) for s in mine]
    rows = _first_fit(lens, seq_length)
    items = []
    for start in range(0, len(rows), micro_batch_size):
        chunk = rows[start:start + micro_batch_size]
        b = len(chunk)
        tokens = torch.zeros(b, seq_length, dtype=torch.int64)
        labels = torch.zeros(b, seq_length, dtype=torch.int64)
        loss_mask = torch.zeros(b, seq_length)
        position_ids = torch.zeros(b, seq_length, dtype=torch.int64)
        doc = torch.full((b, seq_length), -1, dtype=torch.int64)
        for r, members in enumerate(chunk):
            at = 0
            for i in members:
                x, n = batch.loaded[mine[i]], lens[i]
                tokens[r, at:at + n], labels[r, at:at + n] = x[:, 0], x[:, 1]
                loss_mask[r, at:at + n] = 1.0 if eod is None else (x[:, 0] != eod).float()
                position_ids[r, at:at + n] = torch.arange(n)
                doc[r, at:at + n] = i
                at += n
            doc[r, at:] = -2 - torch.arange(seq_length - at)  # padding attends only to itself
        causal = torch.ones(seq_length, seq_length, dtype=torch.bool).tril()
        allowed = (doc[:, :, None] == doc[:, None, :]) & causal
        items.append(MicroBatch(tokens.to(device), labels.to(device), loss_mask.to(device),
                                position_ids.to(device), (~allowed).unsqueeze(1).to(device),
                                real_lengths=tuple(lens[i] for members in chunk for i in members)))
    return items
