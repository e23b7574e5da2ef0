"""FlexSP core attention for Megatron's layer spec: Ulysses over the micro-batch's group.

Installed as ``self_attention.submodules.core_attention`` (:func:`flexsp_layer_spec`). Megatron's
``SelfAttention`` hands it q, k, v of this rank's packed shard in THD (``[t, np, hn]``) with the
:class:`FlexSPPackedSeqParams` of the micro-batch, whose ``cp_group`` is the group running these
sequences and whose ``flexsp_layout`` says which rows this rank holds. It returns ``[t, np*hn]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_flexsp.runtime.attention import varlen_causal_attention
from megatron_flexsp.runtime.layout import GroupLayout
from megatron_flexsp.runtime.ulysses import ulysses_attention


@dataclass
class FlexSPPackedSeqParams(PackedSeqParams):
    """Megatron's THD parameters plus the layout of the group's packed sequences."""

    flexsp_layout: GroupLayout | None = None


class FlexSPCoreAttention(MegatronModule):
    """Causal attention inside each document, heads exchanged over the group (no parameters)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, *, backend: str = "sdpa",
                 kv_replication: bool = False) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout={dropout}: FlexSP core attention has no dropout; "
                             f"use --attention-dropout 0")
        if attention_type != "self":
            raise ValueError(f"FlexSP core attention supports self-attention, not {attention_type!r}")
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.backend = backend
        self.kv_replication = kv_replication

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        """q ``[t, np, hn]``, k/v ``[t, nkv, hn]`` -> ``[t, np*hn]`` (this rank's rows)."""
        layout = getattr(packed_seq_params, "flexsp_layout", None)
        if layout is None:
            raise RuntimeError("FlexSP core attention needs FlexSPPackedSeqParams with a layout "
                               "(is the --flexsp data path active?)")
        if layout.size == 1:
            out = varlen_causal_attention(query, key, value, layout.cu_list, backend=self.backend,
                                          scale=self.scale, cu_device=layout.cu_seqlens_i32)
        else:
            out = ulysses_attention(query, key, value, group=packed_seq_params.cp_group, layout=layout,
                                    backend=self.backend, kv_replication=self.kv_replication,
                                    scale=self.scale)
        return out.reshape(out.shape[0], -1)


def flexsp_layer_spec(*, backend: str, kv_replication: bool = False, normalization: str | None = None,
                      qk_layernorm: bool = False, transformer_impl: str = "local") -> ModuleSpec:
    """Megatron's GPT layer spec with :class:`FlexSPCoreAttention` as core attention.

    ``transformer_impl``: ``transformer_engine`` (Megatron's default; Transformer Engine's fused
    layer norms, linears and MLP) or ``local`` (Megatron's own modules, also on the host)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if transformer_impl == "transformer_engine":
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    elif transformer_impl == "local":
        spec = specs.get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    else:
        raise ValueError(f"--transformer-impl {transformer_impl}: --flexsp builds 'transformer_engine' "
                         f"or 'local' layers")
    attn = spec.submodules.self_attention
    if not hasattr(attn, "submodules") or not hasattr(attn.submodules, "core_attention"):
        raise RuntimeError(f"Megatron's {transformer_impl} GPT layer spec has no self_attention."
                           f"submodules.core_attention; this plugin was written for megatron-core 0.19")
    attn.submodules.core_attention = ModuleSpec(
        module=FlexSPCoreAttention, params={"backend": backend, "kv_replication": kv_replication})
    return spec
