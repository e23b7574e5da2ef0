"""Megatron integration (layer 3): the only package of megatron_flexsp that imports Megatron."""
