"""Op dispatch: one path from a torch call on DTensors to local ops plus redistribution."""
from ..dtensor.dtensor import DTensor
from .dispatcher import STATS, clear_caches, torch_function
from .registry import MissingOpError, load_builtin_rules, record_missing_ops, register_ops

DTensor.__torch_function__ = classmethod(torch_function)

__all__ = ["MissingOpError", "record_missing_ops", "register_ops", "load_builtin_rules", "STATS", "clear_caches"]
