"""Moving tensors between layouts: collectives, their cost, and the planner."""
from .collectives import comm_counter
from .planner import RedistributeError, redistribute_local

__all__ = ["comm_counter", "redistribute_local", "RedistributeError"]
