"""Simulator (layer 1: numpy only): evaluates any plan under a cost model."""

from megatron_flexsp.sim.simulate import SimResult, simulate

__all__ = ["SimResult", "simulate"]
