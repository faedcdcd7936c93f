"""The few collectives checkpointing needs, on the default group, that degrade to no-ops in one process.

They go through redistribute/collectives.py like every collective (counted, compared in check mode,
CollectiveError on a failure)."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..redistribute import collectives


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world() -> int:
    return dist.get_world_size() if distributed() else 1


def all_gather_object(obj: Any) -> list:
    if not distributed():
        return [obj]
    return collectives.all_gather_object(obj)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not distributed():
        return obj
    return collectives.broadcast_object(obj, src)


def barrier() -> None:
    if distributed():
        collectives.barrier()


def raise_first(errors: list, cls: type) -> None:
    """Raise `cls` on every rank with every rank's messages, if any rank reported one."""
    msgs = []
    for r, errs in enumerate(errors):
        for e in errs or ():
            msgs.append(e if len(errors) == 1 else f"[rank {r}] {e}")
    if msgs:
        shown = "\n  ".join(dict.fromkeys(msgs))  # de-duplicate, keep order
        raise cls(shown if len(msgs) == 1 else f"{len(msgs)} problems:\n  {shown}")
