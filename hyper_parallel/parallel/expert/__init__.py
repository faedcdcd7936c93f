"""Expert parallelism: MoE experts spread over a mesh axis, tokens sent to them by all_to_all."""
from .api import expert_parallel, find_experts, unsupported_experts

__all__ = ["expert_parallel", "find_experts", "unsupported_experts"]
