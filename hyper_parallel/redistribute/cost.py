"""Communication cost of moving one mesh axis from one placement to another (bytes on the wire)."""
from __future__ import annotations

from ..layout.placement import Partial, Placement, Replicate, Shard

LOCAL = 1e-6  # local slicing/zeroing: nearly free, but not preferred over doing nothing


def axis_cost(src: Placement, dst: Placement, nbytes: float, parts: int) -> float:
    if src == dst:
        return 0.0
    frac = (parts - 1) / parts
    if isinstance(dst, Replicate):
        return nbytes * frac * (2.0 if isinstance(src, Partial) else 1.0)
    if isinstance(dst, Shard):
        if isinstance(src, Replicate):
            return LOCAL * nbytes
        if isinstance(src, Partial):
            return nbytes * frac
        return nbytes * frac / parts  # all_to_all
    # dst Partial
    if isinstance(src, Replicate):
        return LOCAL * nbytes
    if isinstance(src, Shard):
        return nbytes * frac + LOCAL * nbytes
    return 2.0 * nbytes * frac  # another reduce op: all_reduce first
