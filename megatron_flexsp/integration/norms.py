"""Torch layer norms that work under tensor parallelism's sequence parallelism (local layer spec).

Without apex or Transformer Engine, Megatron's local layer spec builds its norms with
``WrappedTorchNorm``, which refuses ``--sequence-parallel``. Under sequence parallelism each TP rank
normalises its own slice of the tokens with a full copy of the norm's weights, so the weights'
gradients must be summed over the TP group; Megatron's ``finalize_model_grads`` does that for every
parameter marked ``sequence_parallel = True``. :class:`SequenceParallelTorchNorm` is torch's
``LayerNorm`` / ``RMSNorm`` with that mark, and :func:`sequence_parallel_block` puts it in place of
``WrappedTorchNorm`` in a layer spec and as the final norm of the block.
"""

from __future__ import annotations

import copy

import torch


class SequenceParallelTorchNorm:
    """Megatron's norm builder signature; returns ``torch.nn.LayerNorm`` or ``RMSNorm`` whose weights
    (and bias) carry ``sequence_parallel = config.sequence_parallel``."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm",
                mark: bool = True) -> torch.nn.Module:
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                raise ValueError(f"--{flag.replace('_', '-')} is not supported by torch's norms "
                                 f"(install apex or Transformer Engine for it)")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"--normalization {config.normalization}: torch's norms offer {sorted(kinds)}")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel) and mark
        return norm


class _HeadNorm(SequenceParallelTorchNorm):
    """q/k layer norms act on heads, not on sequence slices: Megatron sums their gradients over TP
    by name, so they are not marked."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs) -> torch.nn.Module:
        return SequenceParallelTorchNorm.__new__(cls, config, hidden_size, eps, mark=False)


def sequence_parallel_block(layer_spec, num_layers: int, *, mark: bool = True):
    """``layer_spec`` with every ``WrappedTorchNorm`` replaced, as Megatron block submodules of
    ``num_layers`` layers with a :class:`SequenceParallelTorchNorm` final norm (a spec that uses
    apex or Transformer Engine norms is left as it is). ``mark=False`` leaves the weights unmarked,
    so their gradients are not summed over TP: wrong, and only for the tests' negative control."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = copy.deepcopy(layer_spec)
    sub = spec.submodules
    replaced = False
    norm = SequenceParallelTorchNorm if mark else _HeadNorm
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, name, None) is WrappedTorchNorm:
            setattr(sub, name, norm)
            replaced = True
    attn = getattr(getattr(sub, "self_attention", None), "submodules", None)
    for name in ("q_layernorm", "k_layernorm"):
        if attn is not None and getattr(attn, name, None) is WrappedTorchNorm:
            setattr(attn, name, _HeadNorm)
    if not replaced:
        return layer_spec
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=norm)
