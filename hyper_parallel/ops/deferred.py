"""A pending sum carried through a product (Partial(sum) x replicated -> Partial(sum)), kept exact for
non-finite factors.

Deferring the sum is exact in real arithmetic: sum_i(p_i) * r == sum_i(p_i * r). In floats it is not when `r`
is infinite or nan (or, dividing, zero): the terms p_i * inf have the signs of the p_i, and +inf + -inf is nan
where one device gives +-inf. The local function below looks at the replicated factors first (`isfinite`, a
local reduction): they hold the same values on every rank, so every rank takes the same branch with no
communication. When all are finite the op runs on the local term as planned; otherwise the pending sum is
reduced first and the product of the reduced value is the first rank's term (the others hold zeros), exactly
what one device computes. The check is one small reduction per call, and only calls that defer a sum through a
product pay it (docs/api.md, "Signed zeros and infinities"). Inside a graph that hp.compile traces there is no
value to look at: the sum is deferred as planned there.
"""
from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from ..dispatch.call import OpCall, Strategy


class _KeepOnFirst(torch.autograd.Function):
    """The value on the first rank of the pending axes, zeros elsewhere (a Partial(sum) whose sum is the
    value); the gradient (replicated, as a pending sum's always is) passes unchanged on every rank."""

    @staticmethod
    def forward(ctx, t, first):
        return t.view_as(t) if first else torch.zeros_like(t)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GradOnFirst(torch.autograd.Function):
    """Identity whose gradient is kept on the first rank only: a replicated factor's gradient is a pending
    sum over the axes, and in the fallback every rank computes the whole of it."""

    @staticmethod
    def forward(ctx, t, first):
        ctx.first = first
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.first else torch.zeros_like(grad)), None


def _factor_ok(value, divisor: bool) -> bool:
    if isinstance(value, Tensor):
        if not (value.is_floating_point() or value.is_complex()):
            return not divisor or bool((value != 0).all())
        ok = torch.isfinite(value).all()
        if divisor:
            ok = ok & (value != 0).all()
        return bool(ok)
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return (math.isfinite(abs(value))) and not (divisor and value == 0)
    return True


class GuardedProduct:
    """The local function of a call that carries the pending sum of input `term` (index among the call's tensor
    inputs) through a product: the op itself when every other factor is finite (and nonzero where it divides),
    else the op on the reduced sum, kept on the first rank of the pending axes."""

    __slots__ = ("func", "term", "axes", "first", "divisor_from", "inplace", "inner")

    def __init__(self, func, term: int, axes, first: bool, divisor_from: int | None, inplace: bool, inner=None):
        self.func, self.term, self.axes, self.first = func, term, axes, first
        self.divisor_from, self.inplace, self.inner = divisor_from, inplace, inner

    def _slots(self, args, kwargs):
        """(container, key) of every tensor argument in call order, and of every number argument."""
        tensors, numbers_ = [], []
        for container in (args, kwargs):
            keys = range(len(container)) if container is args else list(container)
            for k in keys:
                v = container[k]
                if isinstance(v, Tensor):
                    tensors.append((container is args, k))
                elif isinstance(v, (list, tuple)):
                    continue
                else:
                    numbers_.append((container is args, k))
        return tensors, numbers_

    def __call__(self, *args, **kwargs):
        op = self.inner or self.func
        if torch.compiler.is_compiling():  # a graph (hp.compile's lowering) cannot branch on values: plain deferral
            return op(*args, **kwargs)
        tensors, nums = self._slots(args, kwargs)
        get = lambda slot: args[slot[1]] if slot[0] else kwargs[slot[1]]  # noqa: E731
        ok = True
        for i, slot in enumerate(tensors + nums):
            if i == self.term:
                continue
            position = i if i < len(tensors) else len(tensors)  # numbers follow the tensors: a divisor's place
            divisor = self.divisor_from is not None and position >= self.divisor_from
            if not _factor_ok(get(slot), divisor):
                ok = False
                break
        if ok:
            return op(*args, **kwargs)
        from .reduction import _AllReduceSum
        args, kwargs = list(args), dict(kwargs)
        for i, (positional, k) in enumerate(tensors):
            container = args if positional else kwargs
            if i == self.term:
                local = container[k]
                container[k] = _AllReduceSum.apply(local, self.axes)
            else:
                container[k] = _GradOnFirst.apply(container[k], self.first)
        if self.inplace:  # the reduced value is a fresh tensor: compute out of place, write into the local term
            out = self.func(*args, **kwargs)
            return local.copy_(_KeepOnFirst.apply(out, self.first))
        out = op(*args, **kwargs)
        return _KeepOnFirst.apply(out, self.first)


def guard_pending_sum(call: OpCall, strat: Strategy, divisor_from: int | None = None) -> Strategy:
    """`strat` with a GuardedProduct local function if it carries one input's pending sum into the output
    through a product with other factors (the linear signatures of mul, div and the contractions)."""
    outs = strat.out_layouts
    out = outs[0] if isinstance(outs, (list, tuple)) else outs
    if out is None or out is Strategy.REPLICATED or not out.has_partial:
        return strat
    axes = [a for a, q in enumerate(out.partial) if q == "sum"]
    terms = [i for i, lay in enumerate(strat.in_layouts) if any(lay.partial[a] == "sum" for a in axes)]
    if len(terms) != 1 or (len(call.inputs) == 1 and not _has_number_factor(call)):
        return strat  # a sum of pending sums (add) or an op of one tensor: no product to guard
    for i, lay in enumerate(strat.in_layouts):
        if i != terms[0] and any(lay.axis_dim[a] >= 0 or lay.partial[a] is not None for a in axes):
            return strat  # another input split over a pending axis: the output's sum is not this input's
    from .reduction import _Axes
    lay = strat.in_layouts[terms[0]]
    pending = [a for a in axes if lay.partial[a] == "sum"]
    first = all(lay.mesh.coordinate[a] == 0 for a in pending) if lay.mesh.coordinate is not None else True
    strat.local_fn = GuardedProduct(call.func, terms[0], _Axes(lay, pending), first, divisor_from, call.inplace,
                                    strat.local_fn)
    return strat


def _has_number_factor(call: OpCall) -> bool:
    return any(isinstance(v, numbers.Number) and not isinstance(v, bool)
               for v in list(call.args) + list(call.kwargs.values()))


__all__ = ["GuardedProduct", "guard_pending_sum"]
