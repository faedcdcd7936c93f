"""The autograd bridge between DTensors and their local tensors.

Forward values cross with `Unwrap` (DTensor -> local, redistributing to the layout the op needs) and
`Wrap` (local -> DTensor). Backward runs on local tensors; the layouts of local gradients follow a
duality: the gradient of a Shard is the same Shard, of a Partial is Replicate, and of a Replicate
input to a computation that is split over a mesh axis is Partial over that axis (each rank holds its
term). The collectives that this implies (all_gather <-> reduce_scatter, all_reduce <-> identity)
fall out of redistributing gradients, which is why no collective needs its own backward here.
"""
from __future__ import annotations

import torch

from ..redistribute.planner import redistribute_local


def grad_target(layout):
    """What a gradient must look like to be handed to a tensor of `layout`: its Partials become Replicate."""
    return layout.without_partial()


class Unwrap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt, target, grad_layout, is_leaf):
        ctx.src = dt._layout
        ctx.shape = dt._shape
        ctx.grad_layout = grad_layout
        ctx.is_leaf = is_leaf
        local = dt._local
        if target is not dt._layout:
            local = redistribute_local(local, dt._layout, target, dt._shape)
        return local.detach()

    @staticmethod
    def backward(ctx, grad):
        from .dtensor import make_dtensor
        g = make_dtensor(grad, ctx.grad_layout, ctx.shape)
        if ctx.is_leaf:
            want = grad_target(ctx.src)
            if want is not ctx.grad_layout:
                g = make_dtensor(redistribute_local(grad, ctx.grad_layout, want, ctx.shape), want, ctx.shape)
        return g, None, None, None


class Wrap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, layout, shape):
        from .dtensor import make_dtensor
        ctx.layout = layout
        return make_dtensor(local.detach(), layout, shape)

    @staticmethod
    def backward(ctx, grad):
        return local_grad(grad, ctx.layout), None, None


def local_grad(grad, layout):
    """The local gradient for a local tensor that was wrapped with `layout`."""
    from .dtensor import DTensor
    want = grad_target(layout)
    if type(grad) is DTensor:
        if grad._layout is want:
            return grad._local
        return redistribute_local(grad._local, grad._layout, want, grad._shape)
    # a plain tensor (from a hook, say) is a replicated value
    return redistribute_local(grad, want.replicated(), want, tuple(grad.shape))


class InplaceWrap(torch.autograd.Function):
    """Give an in-place-updated DTensor the history of its new local value."""

    @staticmethod
    def forward(ctx, dt, new_local):
        ctx.mark_dirty(dt)
        ctx.layout = dt._layout
        dt._local = new_local.detach()
        return dt

    @staticmethod
    def backward(ctx, grad):
        return None, local_grad(grad, ctx.layout)


class InplaceViewWrap(torch.autograd.Function):
    """A write through a view reaches the base: give the base the history torch's CopySlices would.

    `replay` re-takes the view from a local tensor laid out like the base, so backward can split the
    base's gradient into the written region (to the new values) and the rest (to the old base).
    """

    @staticmethod
    def forward(ctx, base, view_local, replay):
        ctx.mark_dirty(base)
        ctx.layout, ctx.shape, ctx.replay = base._layout, base._shape, replay
        return base

    @staticmethod
    def backward(ctx, grad):
        from .dtensor import make_dtensor
        g = local_grad(grad, ctx.layout).clone()
        g_view = ctx.replay(g).clone()
        ctx.replay(g).zero_()
        return make_dtensor(g, ctx.layout.without_partial(), ctx.shape), g_view, None
