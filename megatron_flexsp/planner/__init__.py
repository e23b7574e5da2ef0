"""Planner (layer 1: numpy + highspy): turns a global batch's lengths into a :class:`StepPlan`."""

from megatron_flexsp.planner.api import plan_step

__all__ = ["plan_step"]
