"""What each parallelism applied to a model, for `summary` and the log."""
from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger("hyper_parallel")


def record_applied(model: nn.Module, text: str) -> None:
    """Note on the root module that a parallelism was applied, and log it at INFO."""
    applied = model.__dict__.setdefault("_hp_applied", [])
    applied.append(text)
    logger.info("hyper_parallel: %s", text)
