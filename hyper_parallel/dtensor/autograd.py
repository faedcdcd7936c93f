"""The autograd bridge between DTensors and their local tensors.

Forward values cross with `Unwrap` (DTensor -> local, redistributing to the layout the op needs) and
`Wrap` (local -> DTensor). Backward runs on local tensors; the layouts of local gradients follow a
duality: the gradient of a Shard is the same Shard, of a Partial is Replicate, and of a Replicate
input to a computation that is split over a mesh axis is Partial over that axis (each rank holds its
term). The collectives that this implies (all_gather <-> reduce_scatter, all_reduce <-> identity)
fall out of redistributing gradients, which is why no collective needs its own backward here.

A wrapper made by `Wrap` keeps the local tensor *with* its history as `_local`. A consumer that needs
that local as it is (same layout, and a gradient in that same layout) uses it directly instead of going
through `Unwrap`: both edges end at the same local node, and the pair Unwrap+Wrap would be the identity
there, so gradients are unchanged and a training step makes one Python autograd node per op instead of
one per input and output. Hooks registered on such a wrapper are put on its local (see
`DTensor.register_hook`), which every gradient contribution reaches. In-place updates reset `_local` to a
detached tensor, so later consumers go through the wrapper's new history.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from ..redistribute.planner import redistribute_local
from . import dtensor as _dt  # circular: bound when dtensor.py has finished loading, used at call time


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
        if ctx.is_leaf:
            want = grad_target(ctx.src)
            if want is not ctx.grad_layout:
                return _dt.make_dtensor(redistribute_local(grad, ctx.grad_layout, want, ctx.shape), want,
                                        ctx.shape), None, None, None
        return _dt.make_dtensor(grad, ctx.grad_layout, ctx.shape), None, None, None


class Wrap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, layout, shape):
        ctx.layout = layout
        return _dt.make_dtensor(local, layout, shape)  # with its history: see the module docstring

    @staticmethod
    def backward(ctx, grad):
        return local_grad(grad, ctx.layout), None, None


def local_grad(grad, layout):
    """The local gradient for a local tensor that was wrapped with `layout`."""
    want = grad_target(layout)
    if type(grad) is _dt.DTensor:
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
        base._local = base._local.detach()  # its old history no longer describes it
        return base

    @staticmethod
    def backward(ctx, grad):
        g = local_grad(grad, ctx.layout).clone()
        g_view = ctx.replay(g).clone()
        ctx.replay(g).zero_()
        return _dt.make_dtensor(g, ctx.layout.without_partial(), ctx.shape), g_view, None


# `autograd.Function.apply` is a Python preamble (default-argument binding for setup_context functions, functorch's
# dead-wrapper unwrapping) around the C `_FunctionBase.apply`. Wrap and Unwrap define no setup_context, and outside
# functorch transforms the preamble hands the arguments on unchanged, so the hot path calls the C apply directly.
_c_apply = torch._C._FunctionBase.__dict__["apply"]
_wrap_c_apply = _c_apply.__get__(None, Wrap)
_unwrap_c_apply = _c_apply.__get__(None, Unwrap)
_functorch_active = torch._C._are_functorch_transforms_active


def wrap_local(local, layout, shape):
    """`Wrap.apply(local, layout, shape)` (the DTensor of a local result that requires grad), without the preamble."""
    if _functorch_active():
        return Wrap.apply(local, layout, shape)
    return _wrap_c_apply(local, layout, shape)


def local_input(t, target, grad_layout):
    """The local tensor an op computes with, autograd-connected to the DTensor `t` (which requires grad).

    Directly `t._local` when it carries history and neither the layout nor the gradient's layout changes
    (the identity case, see the module docstring); else through `Unwrap`."""
    local = t._local
    if local.requires_grad and target is t._layout and grad_layout is target:
        return local
    if _functorch_active():
        return Unwrap.apply(t, target, grad_layout, t.grad_fn is None)
    return _unwrap_c_apply(t, target, grad_layout, t.grad_fn is None)


# The Python nodes are the reference; the dispatcher's C module has the same forward and backward for the common
# cases (no redistribution, no gradient to move), which `use_c_nodes` installs. Both keep the same ctx attributes.
_PYTHON_NODES = {cls: (cls.__dict__["forward"], cls.__dict__["backward"]) for cls in (Wrap, Unwrap)}


def use_c_nodes(fastpath) -> None:
    """Run Wrap's and Unwrap's forward and backward, and DTensor.__torch_dispatch__ (the engine's aten.detach of
    every gradient it stores), in C (`fastpath`: the dispatcher's C module, configured) or, with None, in Python.
    torch calls a node's backward as `ctx.apply(*grads)`, a Python frame (BackwardCFunction.apply) before the
    backward's own: the C backward replaces that `apply` on the node class."""
    dt_cls = _dt.DTensor
    dt_cls.__torch_dispatch__ = (dt_cls.__dict__["_python_torch_dispatch"] if fastpath is None
                                 else staticmethod(fastpath.torch_dispatch))
    for cls, name in ((Wrap, "wrap"), (Unwrap, "unwrap")):
        if fastpath is None:
            cls.forward = _PYTHON_NODES[cls][0]
            if "apply" in cls._backward_cls.__dict__:
                del cls._backward_cls.apply
        else:
            cls.forward = staticmethod(getattr(fastpath, name + "_forward"))
            cls._backward_cls.apply = fastpath.as_method(getattr(fastpath, name + "_backward"))


# ---- the autograd API on wrappers whose gradient arrives at their local -----------------------
def _at_local(t) -> bool:
    """Every gradient of `t` passes through its local (see the module docstring): hooks and inputs go there."""
    return type(t) is _dt.DTensor and t._local.requires_grad


def _as_grad(g, t):
    """A gradient of `t`'s local, as a DTensor gradient of `t`."""
    if g is None:
        return None
    layout = grad_target(t._layout)
    return Wrap.apply(g, layout, t._shape) if g.requires_grad else _dt.make_dtensor(g, layout, t._shape)


@contextlib.contextmanager
def _reading_non_leaf_grads():
    """torch warns on reading a non-leaf's .grad; here we are the ones who fill it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def register_hook(t, hook):
    """`t.register_hook(hook)`: on the local when the gradient arrives there, with DTensor gradients either way."""
    if not _at_local(t):
        return torch.Tensor.register_hook(t, hook)
    layout = grad_target(t._layout)

    def on_local(g):
        out = hook(_as_grad(g, t))
        return None if out is None else local_grad(out, layout)
    return t._local.register_hook(on_local)


def retain_grad(t) -> None:
    """`t.retain_grad()`: accumulate the local's gradients into `t.grad`, as torch does for a non-leaf."""
    if not _at_local(t):
        return torch.Tensor.retain_grad(t)
    if getattr(t, "_retains", False):
        return None
    t._retains = True

    def keep(g):
        with torch.no_grad(), _reading_non_leaf_grads():
            dg = _as_grad(g.detach(), t)
            t.grad = dg if t.grad is None else t.grad + dg
    t._local.register_hook(keep)
    return None


def _run_engine(func, args, kwargs):
    """Call the autograd API `func` with DTensor dispatch on for everything the engine runs.

    The dispatcher calls the bridge with subclass torch functions disabled, and the autograd engine
    keeps the caller's torch-function state for the whole backward: hooks and activation-checkpoint
    recomputation would then meet DTensors below the dispatcher. So the state is re-enabled and only
    this one call skips the override (torch.overrides.redispatch_function)."""
    with torch._C._EnableTorchFunction():
        return torch.overrides.redispatch_function(func, (_dt.DTensor,), args, kwargs)


def grad(outputs, inputs, *args, **kwargs):
    """torch.autograd.grad with DTensor inputs: asked of their locals where the gradient arrives there."""
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    asked = [t._local if _at_local(t) else t for t in inputs]
    grads = _run_engine(torch.autograd.grad, (outputs, asked) + args, kwargs)
    return tuple(_as_grad(g, t) if a is not t else g for g, t, a in zip(grads, inputs, asked))


def backward(func, args, kwargs):
    """torch.autograd.backward / Tensor.backward; `inputs=` whose gradient arrives at their local get it there."""
    inputs = kwargs.get("inputs")
    if inputs is None:
        return _run_engine(func, args, kwargs)
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    moved = [t for t in inputs if _at_local(t)]
    kwargs = dict(kwargs, inputs=[t._local if _at_local(t) else t for t in inputs])
    with _reading_non_leaf_grads():
        before = [t._local.grad for t in moved]
    result = _run_engine(func, args, kwargs)
    with torch.no_grad(), _reading_non_leaf_grads():
        for t, old in zip(moved, before):
            g, t._local.grad = t._local.grad, old
            if g is not None:
                g = _as_grad(g - old if old is not None else g, t)
                t.grad = g if t.grad is None else t.grad + g
    return result
