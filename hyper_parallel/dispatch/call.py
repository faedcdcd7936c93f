"""What a rule sees of one call (on a cache miss) and what it answers."""
from __future__ import annotations

import math

from ..layout.layout import Layout


class TensorSpec:
    """One tensor input: its layout (plain tensors are replicated), global shape and dtype."""

    __slots__ = ("layout", "shape", "dtype", "is_dtensor")

    def __init__(self, layout: Layout, shape: tuple, dtype, is_dtensor: bool):
        self.layout = layout
        self.shape = shape
        self.dtype = dtype
        self.is_dtensor = is_dtensor

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def local_bytes(self) -> float:
        shards = 1
        for a in self.layout.sharded_axes:
            shards *= self.layout.mesh.shape[a]
        itemsize = getattr(self.dtype, "itemsize", 4)
        return math.prod(self.shape) * itemsize / shards

    def __repr__(self):
        return f"{self.layout.alias_entries()}{'' if not self.layout.has_partial else ' partial'} {tuple(self.shape)}"


class OpCall:
    """An op call seen by a rule: the original arguments (DTensors inside), tensor inputs in order, out shapes."""

    __slots__ = ("func", "name", "args", "kwargs", "inputs", "mesh", "out_shapes", "inplace")

    def __init__(self, func, name, args, kwargs, inputs, mesh, out_shapes, inplace):
        self.func = func
        self.name = name
        self.args = args
        self.kwargs = kwargs
        self.inputs = inputs
        self.mesh = mesh
        self.out_shapes = out_shapes
        self.inplace = inplace

    def arg(self, index: int, name: str | None = None, default=None):
        """A positional-or-keyword argument of the op."""
        if index is not None and index < len(self.args):
            return self.args[index]
        if name is not None and name in self.kwargs:
            return self.kwargs[name]
        return default

    def layouts(self) -> str:
        return ", ".join(repr(s) for s in self.inputs)


class LocalReshape:
    """A `Strategy.local_fn` that reshapes the local shard to one fixed local shape (views and reshapes of
    split tensors, whose local output shape differs from the global one the caller passed).

    A small class rather than a closure so that the C twin of the decision path (`_fastpath.c`) recognises it
    and calls `Tensor.reshape` itself, without a Python frame per call; both do exactly `t.reshape(shape)`."""

    __slots__ = ("shape",)

    def __init__(self, shape: tuple):
        self.shape = tuple(shape)

    def __call__(self, t, *args, **kwargs):
        return t.reshape(self.shape)

    def __repr__(self):
        return f"LocalReshape({self.shape})"


class Strategy:
    """A rule's answer: target layout per tensor input, layout per tensor output, optional local function.

    `out_layouts` is one Layout for every output or a list with one per tensor output. `grad_layouts`
    (per input) is needed only by rules whose local function communicates; by default the dispatcher
    derives them from the duality described in dtensor/autograd.py.
    """

    __slots__ = ("in_layouts", "out_layouts", "local_fn", "grad_layouts")
    REPLICATED = "replicated"  # as out_layouts: every output replicated, whatever their number and rank

    def __init__(self, in_layouts, out_layouts, local_fn=None, grad_layouts=None):
        self.in_layouts = list(in_layouts)
        self.out_layouts = out_layouts
        self.local_fn = local_fn
        self.grad_layouts = grad_layouts
