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
dispatcher refuses it loudly. An input split on its leading dim only, read in windows that stay inside each
sample (that dim's size kept, its stride one sample: Longformer's chunking under a batch split), runs on each
rank's own samples with the output split the same way. Any other split raises with what to do: gather it first,
or use `unfold` (which has a rule that keeps other dims split).
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


def _whole_samples(shape: tuple, size, stride, offset) -> bool:
    """Does an as_strided call on a tensor of global `shape` keep its leading dim whole (its size, the stride of one
    sample) while every other dim's offsets stay inside one sample? Then the windows of sample i are those of
    rank-local sample i, and a split of the leading dim (a batch split of Longformer's chunking) carries over."""
    if not size or len(size) != len(stride) or size[0] != shape[0]:
        return False
    inner = 1
    for n in shape[1:]:
        inner *= n
    if stride[0] != inner:
        return False
    reached = reached_offsets(size[1:], stride[1:], offset)
    return reached is None or (reached[0] >= 0 and reached[1] < inner)


class _SamplesAsStrided:
    """The local function for an input split on its leading dim only: checks `_whole_samples` on the call's global
    values (sizes may be 0-d tensors every rank holds whole, so this is decided when the call runs, identically on
    every rank, before anything is read), then takes the windows of this rank's samples."""

    copies_input = True  # a view of a contiguous copy of the local: a write into it must raise

    def __init__(self, shape: tuple, refusal: str):
        self.shape, self.refusal = shape, refusal

    def __call__(self, local, size, stride, storage_offset=None):
        size, stride = [int(n) for n in size], [int(s) for s in stride]
        offset = 0 if storage_offset is None else int(storage_offset)
        if not _whole_samples(self.shape, size, stride, offset):
            raise RuntimeError(self.refusal)
        return _local_as_strided(local, [local.shape[0], *size[1:]], stride, offset)


class AsStrided(Rule):
    """`x.as_strided(size, stride, storage_offset=None)` / `torch.as_strided(x, ...)` on a DTensor that every
    rank holds whole (see the module docstring): a view of the contiguous local at the same offsets.

    Never on the replicated fast path, which would run torch's as_strided on a local whose strides may not be
    the ones the program was told: every call goes through `_local_as_strided`, which checks them."""

    replicated_local = False

    def strategy(self, call: OpCall) -> Strategy:
        x = call.inputs[0]
        lay = x.layout
        extra = [s.layout.replicated() for s in call.inputs[1:]]  # 0-d sizes: read whole on every rank
        n_out = len(call.arg(1, "size"))
        if lay.sharded_axes:
            refusal = (f"{call.name} cannot run on inputs laid out as [{call.layouts()}]: as_strided addresses the "
                       f"storage of the whole single-device tensor, and mesh axes "
                       f"{[lay.mesh.mesh_dim_names[a] for a in lay.sharded_axes]} split it; gather it first "
                       f"(x.redistribute(<replicated layout>) or x.full_tensor()), or express the windows with "
                       f"x.unfold(dim, size, step), which keeps other dims split")
            if not x.ndim or not n_out or any(lay.tensor_map[d] for d in range(1, x.ndim)):
                raise RuntimeError(refusal)
            # split on the leading dim only: windows inside each sample run on this rank's samples (checked when
            # the call runs, on its global values: `_SamplesAsStrided`), the output split like that dim
            out = lay.with_map([lay.tensor_map[0]] + [()] * (n_out - 1), lay.partial)
            return Strategy([lay] + extra, [out], local_fn=_SamplesAsStrided(tuple(x.shape), refusal))
        out = lay.with_map([()] * n_out, lay.partial)
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
