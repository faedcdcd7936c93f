"""Ops that address a tensor's storage directly: `as_strided` (sliding-window chunking in Longformer / LED).

`x.as_strided(size, stride, storage_offset)` reads elements of x's *storage* at the offsets the strides give.
A DTensor wrapper has no storage of its own: what the program saw of one is `x.stride()`, `x.is_contiguous()`
and `x.storage_offset()`, which the wrapper answers as a contiguous tensor of the global shape at offset 0, and
the program computed its arguments from those. So the call means: those offsets into the row-major elements
of the global value, which is what one device computes for a tensor laid out the way the wrapper reports. The
rule computes exactly that when

- the input holds the whole value on every rank (no mesh axis splits it; a pending reduction passes, as
  picking elements commutes with any elementwise reduce), and
- every offset the call reaches lies inside the tensor's own elements (on one device, reaching past them
  would read a base tensor's storage, which a DTensor does not have);

both decided from global values (the layout in `strategy`; sizes, strides and offset, which may be 0-d tensors
every rank holds whole, when the view is taken), so they raise on every rank or none. Locally, the view is
taken of the local tensor itself when its strides are the reported ones (it is contiguous: no copy), else of a
contiguous copy, which is the reported layout; a write through such a view could not reach the input, and the
dispatcher refuses it loudly. A split input raises with what to do: gather it first, or use `unfold` (which has
a rule that keeps other dims split).
"""
from __future__ import annotations

import torch

from ..dispatch.call import OpCall, Strategy
from .base import Rule


def reached_offsets(size, stride, storage_offset: int) -> tuple[int, int] | None:
    """(lowest, highest) storage offset an as_strided view reaches; None when it is empty (it reaches none)."""
    if any(n == 0 for n in size):
        return None
    low = high = storage_offset
    for n, s in zip(size, stride):
        if s >= 0:
            high += (n - 1) * s
        else:
            low += (n - 1) * s
    return low, high


class AsStrided(Rule):
    """`x.as_strided(size, stride, storage_offset=None)` / `torch.as_strided(x, ...)` on a DTensor that every
    rank holds whole (see the module docstring): a view of the contiguous local at the same offsets.

    Never on the replicated fast path, which would run torch's as_strided on a local whose strides may not be
    the ones the program was told: every call goes through `_local_as_strided`, which checks them."""

    replicated_local = False

    def strategy(self, call: OpCall) -> Strategy:
        x = call.inputs[0]
        lay = x.layout
        if lay.sharded_axes:
            self.fail(call, f"as_strided addresses the storage of the whole single-device tensor, and mesh axes "
                            f"{[lay.mesh.mesh_dim_names[a] for a in lay.sharded_axes]} split it; gather it first "
                            f"(x.redistribute(<replicated layout>) or x.full_tensor()), or express the windows with "
                            f"x.unfold(dim, size, step), which keeps other dims split")
        # sizes given as 0-d tensors (`torch.div(n, w, rounding_mode="trunc") - 1`) are read whole on every rank
        extra = [s.layout.replicated() for s in call.inputs[1:]]
        out = lay.with_map([()] * len(call.arg(1, "size")), lay.partial)
        return Strategy([lay] + extra, [out], local_fn=_local_as_strided)


def _local_as_strided(local, size, stride, storage_offset=None):
    """The view on this rank: of the local itself when it is laid out as reported (contiguous), else of a copy
    that is; offsets count from the local's own start, as they counted from the wrapper's offset 0.

    The offsets reached must lie inside the tensor's elements. They are global values (sizes, strides, and
    0-d tensors that every rank holds whole), so this raises on every rank or none, before any communication
    (the op moves nothing)."""
    size, stride = [int(n) for n in size], [int(s) for s in stride]
    offset = 0 if storage_offset is None else int(storage_offset)
    reached = reached_offsets(size, stride, offset)
    if reached is not None and (reached[0] < 0 or reached[1] >= local.numel()):
        low, high = reached
        raise RuntimeError(f"as_strided: size {size}, stride {stride}, storage_offset {offset} reach storage offsets "
                           f"{low}..{high}, outside the {local.numel()} elements of the {tuple(local.shape)} DTensor; "
                           f"on one device that reads a base tensor's storage, which a DTensor does not have. Take "
                           f"as_strided of the base tensor instead")
    if not local.is_contiguous():
        local = local.contiguous()
    return torch.as_strided(local, size, stride, local.storage_offset() + offset)


# A view it returns may be of a contiguous copy of the local: the dispatcher notes it so a write into it raises.
_local_as_strided.copies_input = True
