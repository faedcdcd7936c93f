"""hyper_parallel: run Hugging Face transformers models distributed by laying out DTensors."""
from .dispatch import CheckError, CollectiveError, MissingOpError, record_missing_ops, register_ops, set_check
from .dispatch.registry import load_builtin_rules as _load_builtin_rules
from .dtensor import DTensor, distribute_tensor
from .layout import DeviceMesh, Layout, Partial, Placement, Replicate, Shard, init_device_mesh
from .redistribute import comm_counter
from .parallel.shard import ShardingPlan, init_parameters, load_sharded, shard, shard_module
from .parallel.hsdp import MixedPrecision, hsdp
from .parallel.parallelize import parallelize, summary
from .parallel.custom_shard import custom_shard
from .pretrained import from_pretrained, save_pretrained
from .parallel.dims import data_rank, data_world
from .parallel.feed import FeedError
from .parallel.expert import expert_parallel
from .parallel.context import context_parallel
from .parallel.pipeline import Pipeline, pipeline
from .compiler import compile  # noqa: A004  (hp.compile, as torch.compile)

_load_builtin_rules()


def plan(*args, **kwargs) -> dict:
    """What each rank of a run holds and sends, planned on this CPU (API §13): `hyper_parallel.tools.plan.plan`,
    imported on first use (it pulls in transformers)."""
    from .tools.plan import plan as _plan
    return _plan(*args, **kwargs)

__all__ = [
    "DTensor", "Layout", "DeviceMesh", "init_device_mesh", "Shard", "Replicate", "Partial", "Placement",
    "distribute_tensor", "comm_counter", "MissingOpError", "record_missing_ops", "register_ops",
]
__all__ += ["set_check", "CheckError", "CollectiveError"]
__all__ += ["shard", "shard_module", "ShardingPlan", "init_parameters", "load_sharded"]
__all__ += ["hsdp", "MixedPrecision"]
__all__ += ["parallelize", "summary", "from_pretrained", "save_pretrained", "custom_shard"]
__all__ += ["expert_parallel"]
__all__ += ["context_parallel"]
__all__ += ["pipeline", "Pipeline"]
__all__ += ["data_rank", "data_world", "FeedError"]
__all__ += ["compile", "plan"]
__version__ = "0.1.0"
