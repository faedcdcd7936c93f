"""Reductions: sums and means over split dims defer their all-reduce as Partial(sum); max/min as
Partial(max/min); everything whose result depends on the order or position of elements along the
reduced dim (indices, sort, softmax, cumsum, var, prod, all/any) needs that dim whole first.
"""
from __future__ import annotations

import math

import torch

from ..dispatch.call import OpCall, Strategy
from ..redistribute import collectives as C
from .base import Rule
from .shape import LINEAR, NONE, derive, dims_arg, main_strategy, nonempty_limit, replicate_all

_LEGACY = "legacy"  # softmax without dim: torch's implicit choice


def reduced_dims(call: OpCall, index: int, default, names=("dim", "axis")) -> tuple:
    """The dims an op reduces, from its dim argument (None: every dim); torch takes numpy's `axis=` too."""
    x = call.inputs[0]
    value = default
    if index is not None and index < len(call.args):
        value = call.args[index]
    else:
        for n in names:
            if n in call.kwargs:
                value = call.kwargs[n]
                break
    if isinstance(value, bool):  # var(x, unbiased) / std(x, unbiased)
        value = None
    if value == _LEGACY:
        value = 0 if x.ndim in (0, 1, 3) else 1
    if isinstance(value, str):  # a named dim
        raise ValueError(f"{call.name}: named dims are not supported on DTensors")
    return dims_arg(value, x.ndim)


def keep_map(ndim: int, dims: tuple, out_ndim: int) -> dict:
    """Where the dims that are not reduced land: in place (keepdim, or same-rank outputs) or compacted."""
    rest = [d for d in range(ndim) if d not in dims]
    if out_ndim == ndim:
        return {d: d for d in rest}
    return {d: i for i, d in enumerate(rest) if i < out_ndim}


class _Axes:
    """Mesh axes a local function reduces over; process groups are looked up only when communicating
    (a single-process census decides and runs forward without any)."""

    def __init__(self, layout, axes):
        self.mesh = layout.mesh
        self.axes = tuple(axes)

    def __iter__(self):
        return iter([(self.mesh.get_group(a), self.mesh.shape[a]) for a in self.axes])


class _Extremum(torch.autograd.Function):
    """Local amax/amin whose result is still pending over some axes (Partial(max/min)).

    Forward needs no communication. Backward must route the gradient only to elements equal to the
    *global* extremum (shared evenly among ties, as torch does), so it all-reduces the extremum and
    the tie count.
    """

    @staticmethod
    def forward(ctx, x, op, dims, keepdim, groups):
        out = torch.amax(x, dims, keepdim) if op == "max" else torch.amin(x, dims, keepdim)
        ctx.save_for_backward(x, out)
        ctx.op, ctx.dims, ctx.keepdim, ctx.groups = op, dims, keepdim, groups
        return out

    @staticmethod
    def backward(ctx, grad):
        x, out = ctx.saved_tensors
        if not ctx.keepdim:
            for d in sorted(ctx.dims):
                out = out.unsqueeze(d)
                grad = grad.unsqueeze(d)
        m = out
        for group, parts in ctx.groups:
            m = C.all_reduce(m, ctx.op, group, parts)
        mask = x == m
        count = mask.sum(ctx.dims, keepdim=True, dtype=grad.dtype)
        for group, parts in ctx.groups:
            count = C.all_reduce(count, "sum", group, parts)
        return grad * mask / count, None, None, None, None


class _AllReduceSum(torch.autograd.Function):
    """Sum over axes inside a local function; the result is replicated, so the gradient passes as is."""

    @staticmethod
    def forward(ctx, t, groups):
        for group, parts in groups:
            t = C.all_reduce(t, "sum", group, parts)
        return t

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Root(torch.autograd.Function):
    """`s ** (1/p)` of a reduced sum of |x|^p, whose gradient is 0 where `s` is 0, as torch's own norm
    backward gives for an all-zero row (the plain chain rule would give 0 * inf = nan there)."""

    @staticmethod
    def forward(ctx, s, p):
        out = s.sqrt() if p == 2 else s.pow(1.0 / p)
        ctx.save_for_backward(s, out)
        ctx.p = p
        return out

    @staticmethod
    def backward(ctx, grad):
        s, out = ctx.saved_tensors
        zero = s == 0
        # d s^(1/p) / ds = s^(1/p) / (p s)
        return torch.where(zero, torch.zeros_like(grad), grad * out / (ctx.p * s.masked_fill(zero, 1))), None


class Reduce(Rule):
    """A reduction over the dims named by argument `dim_index` (keyword `dim`).

    `kind`: "sum" (split dims -> Partial(sum)), "mean" (the same, dividing by the global count),
    "max"/"min" (split dims -> Partial(max/min)), "gather" (reduced dims must be whole: indices,
    sorts, softmax, cumsum, prod, var, all/any). `linear`: pending sums pass through a "gather" op.
    """

    kind = "gather"
    linear = False
    dim_index = 1
    dim_default = None

    def strategy(self, call: OpCall) -> Strategy:
        x = call.inputs[0]
        dims = reduced_dims(call, self.dim_index, self.dim_default)
        out_ndims = [len(s) for s in call.out_shapes] if call.out_shapes is not None else [x.ndim]
        keep = keep_map(x.ndim, dims, out_ndims[0])
        kind = self.kind
        if kind == "gather":
            return main_strategy(call, keep, passes=LINEAR if self.linear else NONE)
        if kind in ("sum", "mean"):
            return self._sum(call, x, dims, keep, out_ndims)
        return self._extremum(call, x, dims, keep, out_ndims, kind)

    def _sum(self, call, x, dims, keep, out_ndims):
        reduced = {d: "sum" for d in dims}
        in_lay, out_lay = derive(x.layout, out_ndims[0], keep, reduced, LINEAR)
        local_fn = None
        split = [d for d in dims if in_lay.tensor_map[d]]
        if self.kind == "mean" and split:
            count = math.prod(x.shape[d] for d in dims)
            keepdim = bool(call.arg(2, "keepdim", False))
            dtype = call.kwargs.get("dtype")

            def local_fn(t, *args, **kwargs):
                return torch.sum(t, dims, keepdim, dtype=dtype) / count
        return Strategy([in_lay], [out_lay], local_fn)

    def _extremum(self, call, x, dims, keep, out_ndims, op):
        reduced = {d: op for d in dims}
        in_lay, out_lay = derive(x.layout, out_ndims[0], keep, reduced, (op,),
                                 reduced_limit=nonempty_limit(x.layout, x.shape))
        pending = [a for a, p in enumerate(out_lay.partial) if p is not None]
        local_fn = None
        if pending:
            groups = _Axes(x.layout, pending)
            keepdim = out_ndims[0] == x.ndim

            def local_fn(t, *args, **kwargs):
                return _Extremum.apply(t, op, dims, keepdim, groups)
        return Strategy([in_lay] + [s.layout.replicated() for s in call.inputs[1:]], [out_lay], local_fn)


class MaxMin(Rule):
    """torch.max / torch.min: elementwise with a tensor, (values, indices) with a dim, a value without."""

    op = "max"

    def strategy(self, call: OpCall) -> Strategy:
        other = call.arg(1, "other")
        if other is None and "dim" not in call.kwargs and len(call.inputs) > 1:
            other = call.inputs[1]
        if isinstance(other, torch.Tensor) or len(call.inputs) > 1:
            from .elementwise import Elementwise
            return Elementwise(self.name).strategy(call)
        dim = call.arg(1, "dim")
        if dim is None:
            return Reduce(self.name, kind=self.op).strategy(call)
        return Reduce(self.name, kind="gather").strategy(call)


class Norm(Rule):
    """norm / linalg.vector_norm: a p-norm over split dims sums |x|^p locally, all-reduces, takes the root.

    Other orders (inf, 0, nuclear, negative) need the reduced dims whole.
    """

    p_name = "p"
    p_default = "fro"
    float_args_matter = True  # the order p is captured by the local function

    def strategy(self, call: OpCall) -> Strategy:
        x = call.inputs[0]
        p = self.order(call)
        dims = reduced_dims(call, 2, None)
        if call.out_shapes is None:
            return replicate_all(call)
        out_nd = len(call.out_shapes[0])
        keep = keep_map(x.ndim, dims, out_nd)
        if p in ("fro", None):
            p = 2
        if isinstance(p, str) or not (isinstance(p, (int, float)) and 0 < p < math.inf):
            return main_strategy(call, keep, passes=NONE)
        in_lay, out_lay = derive(x.layout, out_nd, keep, {d: "sum" for d in dims}, NONE)
        pending = [a for a, q in enumerate(out_lay.partial) if q is not None]
        if not pending:
            return Strategy([in_lay], [out_lay])
        out_lay = out_lay.without_partial()
        groups = _Axes(x.layout, pending)
        keepdim = out_nd == x.ndim
        dtype = call.kwargs.get("dtype")

        def local_fn(t, *args, **kwargs):
            if dtype is not None:
                t = t.to(dtype)
            s = (t * t if p == 2 else t.abs().pow(p)).sum(dims, keepdim=keepdim)
            return _Root.apply(_AllReduceSum.apply(s, groups), p)
        return Strategy([in_lay], [out_lay], local_fn, grad_layouts=[in_lay])

    def order(self, call: OpCall):
        """The p of an elementwise p-norm, or a string for any other norm (computed on whole dims)."""
        return call.arg(1, self.p_name, self.p_default)


class LinalgNorm(Norm):
    """`torch.linalg.norm`: a vector norm (one dim, or every dim when neither `ord` nor `dim` is given) or,
    over two dims (`dim` a pair, or `ord` given for a 2D input), a matrix norm. Of the matrix norms only
    'fro' is elementwise (a 2-norm); 'nuc', spectral and the max-row/column norms need both dims whole."""

    p_name = "ord"
    p_default = None

    def order(self, call: OpCall):
        p = super().order(call)
        x = call.inputs[0]
        dim = call.arg(2, "dim", None)
        matrix = (isinstance(dim, (tuple, list)) and len(dim) == 2) or (dim is None and p is not None and x.ndim == 2)
        if matrix and p not in ("fro", None):
            return "matrix"
        return p


__all__ = ["Reduce", "MaxMin", "Norm", "LinalgNorm", "reduced_dims", "keep_map"]
