"""Hybrid sharded data parallelism: `hsdp(model, ...)` (see api.py)."""
from .api import HSDPModule, hsdp
from .policy import MixedPrecision

__all__ = ["hsdp", "HSDPModule", "MixedPrecision"]
