"""megatron-flexsp: heterogeneous (flexible) sequence parallelism for Megatron-LM.

This package root imports nothing heavy: no torch, no megatron, no numpy.
Layers (each imports only downward, enforced by ``tests/unit/test_layering.py``):

0. ``model_spec``, ``plan``, ``topology``, ``utils``      -- stdlib only
1. ``cost_model``, ``planner``, ``sim``                  -- + numpy, highspy
2. ``runtime``                                           -- + torch
3. ``integration`` and the top-level ``patches`` package -- + megatron
"""

__version__ = "0.1.0"
