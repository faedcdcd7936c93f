"""Hybrid sharded data parallelism: `hsdp(model, ...)` (see api.py)."""
from .api import HSDPModule, hsdp

__all__ = ["hsdp", "HSDPModule"]
