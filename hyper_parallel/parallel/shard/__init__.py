"""Tensor parallelism: shard a model's parameters from a plan; deferred init and sharded loading."""
from .api import shard, shard_module
from .init import init_parameters, load_sharded
from .plan import STYLES, ShardingPlan

__all__ = ["shard", "shard_module", "ShardingPlan", "init_parameters", "load_sharded", "STYLES"]
