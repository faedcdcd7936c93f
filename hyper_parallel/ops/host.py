"""Values copied out of torch: `x.numpy()`, `x.tolist()` hand the caller the global value, which every rank
holds only when nothing is split or pending. Gathering silently would hide a cost and a layout mistake
(numpy code then runs on every rank), so a split or pending input is refused, naming the op and the layout.
"""
from __future__ import annotations

from ..dispatch.call import OpCall, Strategy
from .base import Rule


class HostCopy(Rule):
    """Replicated input: the local value is the global one (returned as it is). Anything else: loud."""

    def strategy(self, call: OpCall) -> Strategy:
        for spec in call.inputs:
            if not spec.layout.is_replicate:
                self.fail(call, "the value leaves torch here, and this rank holds only a piece of it (or a "
                                "pending sum); call .full_tensor() first if every rank should get the whole value")
        return Strategy([s.layout for s in call.inputs], [])


__all__ = ["HostCopy"]
