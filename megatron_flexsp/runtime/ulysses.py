"""Ulysses attention over one group on packed, load-balanced shards (see :mod:`layout`).

``ulysses_attention`` takes this rank's shard of q, k, v (``[t, N, H]``, ``[t, N_kv, H]``), moves
to a head-sharded layout with one all-to-all for q, k and v together (when K/V heads equal Q heads,
else one per tensor), reorders rows to natural sequence order, runs varlen causal attention and
returns this rank's shard of the output ``[t, N, H]``.
"""

from __future__ import annotations

import torch

from megatron_flexsp.runtime.all_to_all import head_to_seq, seq_to_head
from megatron_flexsp.runtime.attention import varlen_causal_attention
from megatron_flexsp.runtime.layout import GroupLayout


def ulysses_attention(q_tNH: torch.Tensor, k_tKH: torch.Tensor, v_tKH: torch.Tensor, *, group,
                      layout: GroupLayout, backend: str = "sdpa", kv_replication: bool = False,
                      scale: float | None = None) -> torch.Tensor:
    """Attention of the group's packed sequences; ``group`` is this micro-batch's process group.

    ``scale``: softmax scale (default ``1/sqrt(H)``). Give ``layout`` on the inputs' device
    (:meth:`GroupLayout.to`, once per micro-batch) to keep the layers free of host-device copies.
    """
    d = layout.size
    counts = layout.token_counts
    N, K = q_tNH.shape[1], k_tKH.shape[1]
    if N % d:
        raise ValueError(f"num_heads={N} is not divisible by the group size {d}")
    if K % d:
        if not kv_replication:
            raise ValueError(f"num_kv_heads={K} is not divisible by the group size {d}; enable KV-head "
                             f"replication to use groups larger than {K}")
        if d % K:
            raise ValueError(f"KV-head replication needs the group size {d} to be a multiple of {K}")
        k_tKH = k_tKH.repeat_interleave(d // K, dim=1)
        v_tKH = v_tKH.repeat_interleave(d // K, dim=1)
        K = d
    H = q_tNH.shape[2]
    if K == N:  # one all-to-all for q, k and v: heads stay aligned, features concatenated
        qkv_TnH = seq_to_head(torch.cat([q_tNH, k_tKH, v_tKH], dim=2), group=group, token_counts=counts)
        q_TnH, k_TnH, v_TnH = qkv_TnH.split(H, dim=2)
    else:
        q_TnH = seq_to_head(q_tNH, group=group, token_counts=counts)
        k_TnH = seq_to_head(k_tKH, group=group, token_counts=counts)
        v_TnH = seq_to_head(v_tKH, group=group, token_counts=counts)
    nat = [layout.to_natural(x) for x in (q_TnH, k_TnH, v_TnH)]
    o_TnH = varlen_causal_attention(*nat, layout.cu_list, backend=backend, scale=scale,
                                    cu_device=layout.cu_seqlens_i32)
    return head_to_seq(layout.to_gathered(o_TnH), group=group, token_counts=counts)
