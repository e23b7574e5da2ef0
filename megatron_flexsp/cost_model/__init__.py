"""Cost model (layer 1: numpy only): time and memory of sequences on sequence-parallel groups."""

from megatron_flexsp.cost_model.model import CostModel, ModelCoefficients
from megatron_flexsp.cost_model.profile import Profile, load_profile

__all__ = ["CostModel", "ModelCoefficients", "Profile", "load_profile"]
