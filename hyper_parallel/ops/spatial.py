"""Ops that move or gather values along some dims (rolls, pools, sliding windows, one-hot expansion):
the dims they work along must be whole on every rank, the others may stay split.
"""
from __future__ import annotations

from .base import Partial, REPLICATE, Shard, Signature, SignatureRule

_P = Partial("sum")


class Roll(SignatureRule):
    """`torch.roll(x, shifts, dims)`, `x.flip(dims)` (`dims_index: 1`): the moved dims stay whole, others may
    be split; a pending sum passes (a permutation). Without `dims` the flattened tensor is rolled: every dim
    stays whole."""

    dims_index = 2

    def signatures(self, call) -> list[Signature]:
        x = call.inputs[0]
        dims = call.arg(self.dims_index, "dims", None)
        sigs = [Signature([_P], [_P])]
        if dims is None or dims == ():
            return sigs
        rolled = {d % x.ndim for d in ((dims,) if isinstance(dims, int) else dims)}
        return sigs + [Signature([Shard(d)], [Shard(d)]) for d in range(x.ndim) if d not in rolled and x.shape[d] > 1]


class OneHot(SignatureRule):
    """`F.one_hot(x, num_classes)`: pointwise in x, with a new last dim of size num_classes. With
    num_classes=-1 the size is the global maximum of x: gathered."""

    def out_ndims(self, call) -> list[int]:
        return [call.inputs[0].ndim + 1]

    def signatures(self, call) -> list[Signature]:
        x = call.inputs[0]
        if call.arg(1, "num_classes", -1) in (-1, None):
            return []
        return [Signature([Shard(d)], [Shard(d)]) for d in range(x.ndim) if x.shape[d] > 1]


class TensorUnfold(SignatureRule):
    """`x.unfold(dim, size, step)`: windows along `dim` (which stays whole) in a new last dim; the other dims
    may stay split, and a pending sum passes (windows are copies)."""

    def out_ndims(self, call) -> list[int]:
        return [call.inputs[0].ndim + 1]

    def signatures(self, call) -> list[Signature]:
        x = call.inputs[0]
        dim = call.arg(1, "dimension", 0) % max(x.ndim, 1)
        sigs = [Signature([_P], [_P])]
        return sigs + [Signature([Shard(d)], [Shard(d)]) for d in range(x.ndim) if d != dim and x.shape[d] > 1]


class Unfold(SignatureRule):
    """`F.unfold(x [N, C, H, W], kernel_size, ...)` -> `[N, C * k, L]`: only the batch dim may stay split
    (splitting C would interleave with the kernel positions unless C divides evenly); linear, so pending sums
    pass."""

    def signatures(self, call) -> list[Signature]:
        x = call.inputs[0]
        sigs = [Signature([_P], [_P])]
        if x.ndim == 4 and x.shape[0] > 1:
            sigs.append(Signature([Shard(0)], [Shard(0)]))
        return sigs


class Pool(SignatureRule):
    """Pooling over the last `spatial` dims (max/avg/adaptive, 1-3 d): the leading (batch, channel) dims may
    stay split; average pools are linear, so pending sums pass (`linear: true`)."""

    spatial = 2
    linear = False

    def signatures(self, call) -> list[Signature]:
        x = call.inputs[0]
        n_out = self.n_outputs(call)
        sigs = [Signature([Shard(d)] * n_out, [Shard(d)]) for d in range(max(0, x.ndim - self.spatial))
                if x.shape[d] > 1]
        if self.linear and n_out == 1:
            sigs.append(Signature([_P], [_P]))
        return sigs


class GridSample(SignatureRule):
    """`F.grid_sample(x [N, C, ...], grid [N, ..., k])`: each output point reads x at its grid location, so
    x's spatial dims stay whole; the batch may be split (x and grid alike) and x's channels may be split
    (grid replicated: every channel uses the same locations)."""

    def signatures(self, call) -> list[Signature]:
        if len(call.inputs) != 2:
            return []
        x, grid = call.inputs
        sigs = []
        if x.shape[0] > 1 and grid.shape[0] == x.shape[0]:
            sigs.append(Signature([Shard(0)], [Shard(0), Shard(0)]))
        if x.ndim > 2 and x.shape[1] > 1:
            sigs.append(Signature([Shard(1)], [Shard(1), REPLICATE]))
        return sigs


__all__ = ["Roll", "OneHot", "TensorUnfold", "Unfold", "Pool", "GridSample"]
