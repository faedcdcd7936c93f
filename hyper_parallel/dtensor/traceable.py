"""The autograd bridge in a form a graph tracer can record (what `hyper_parallel.compile` lowers with).

Eagerly, layouts cross autograd through Python `autograd.Function` nodes (`Wrap`, `Unwrap`, `InplaceWrap`, see
autograd.py): their backward moves each local gradient to the layout its producer needs. A tracer that records
the ops run on local tensors (`make_fx`) sees only their forward, so a compiled graph built from such a trace
would lose every gradient move. Here the same bridge is expressed without Python nodes:

- the gradient arriving at the local of a DTensor laid out as `L` is always laid out as `grad_target(L)` (what
  `Wrap`'s backward hands on eagerly), so wrapping a local result needs no node at all (`wrap_local`);
- a consumer that takes a DTensor's local under another layout, or whose gradient comes back in another layout
  (`local_input(t, target, grad_layout)`, eagerly `Unwrap`), calls the `hyper_parallel::redistribute` custom op:
  forward `redistribute_local(local, src -> target)`, backward `redistribute_local(grad, grad_layout ->
  grad_target(src))`, exactly the two moves `Unwrap` makes. It is one opaque node in the graph (torch.compile
  keeps it as a call into this module at run time, collectives and accounting included), and its backward is
  known to AOTAutograd, which derives the rest of the backward from the local ops.

Layouts are passed to the op as small integers (`layout_id`): custom ops take numbers, not Python objects, and
layouts are interned, so one id per layout object is stable for the process.
"""
from __future__ import annotations

import contextlib

import torch
from torch._library.effects import EffectType

from ..redistribute.planner import redistribute_local
from . import autograd as _bridge
from . import dtensor as _dt
from .autograd import grad_target

_LAYOUTS: list = []   # id -> layout
_IDS: dict = {}       # id(layout) -> id


def layout_id(layout) -> int:
    """A process-wide integer for an (interned) layout, for the custom op's arguments."""
    i = _IDS.get(id(layout))
    if i is None:
        i = _IDS[id(layout)] = len(_LAYOUTS)
        _LAYOUTS.append(layout)  # keeps the layout alive, so its id() is never reused
    return i


@torch.library.custom_op("hyper_parallel::redistribute", mutates_args=())
def redistribute_op(local: torch.Tensor, src: int, dst: int, grad_src: int, grad_dst: int,
                    shape: list[int]) -> torch.Tensor:
    """This rank's shard moved from layout `src` to `dst` (ids); its gradient moves from `grad_src` to `grad_dst`."""
    out = redistribute_local(local, _LAYOUTS[src], _LAYOUTS[dst], tuple(shape))
    if out.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        out = out.clone()  # a custom op's output must not alias its input (a slice is a view)
    return out.contiguous()


@redistribute_op.register_fake
def _(local, src, dst, grad_src, grad_dst, shape):
    return local.new_empty(_LAYOUTS[dst].local_shape(tuple(shape)))


def _setup(ctx, inputs, output):
    ctx.moves = inputs[1:]


def _backward(ctx, grad):
    src, dst, grad_src, grad_dst, shape = ctx.moves
    if grad is not None and grad_src != grad_dst:
        grad = redistribute_op(grad, grad_src, grad_dst, grad_dst, grad_dst, shape)
    return grad, None, None, None, None, None


redistribute_op.register_autograd(_backward, setup_context=_setup)
# Ordered: the compiled graph keeps every redistribution, in the order traced (no reordering, merging or dropping by
# graph passes), so the collectives inside run in the same order on every rank, whatever each rank's shard sizes
# make of the rest of its graph.
redistribute_op.register_effect(EffectType.ORDERED)


def move(local: torch.Tensor, src, dst, grad_src, grad_dst, shape) -> torch.Tensor:
    """`local` (laid out as `src`) as `dst` in the forward; its gradient (laid out as `grad_src`) as `grad_dst`."""
    if src is dst and grad_src is grad_dst:
        return local
    return redistribute_op(local, layout_id(src), layout_id(dst), layout_id(grad_src), layout_id(grad_dst),
                           list(shape))


# ---- the bridge's entry points, traceable ---------------------------------------------------
def local_input(t, target, grad_layout):
    """`autograd.local_input`: the local an op computes with, its gradient moved back through the graph."""
    node = t.grad_fn
    if node is not None:  # wrappers made here are leaves: this one is an autograd.Function's output
        raise RuntimeError(f"a DTensor made by {type(node).__name__} (an autograd.Function applied to DTensors) "
                           f"is used: a recorded forward would lose that Function's backward")
    return move(t._local, t._layout, target, grad_layout, grad_target(t._layout), t._shape)


def wrap_local(local, layout, shape):
    """`autograd.wrap_local`: no node (the gradient reaching `local` is already in `grad_target(layout)`)."""
    return _dt.make_dtensor(local, layout, shape, local.requires_grad)


class Wrap:
    apply = staticmethod(wrap_local)


class Unwrap:
    @staticmethod
    def apply(dt, target, grad_layout, is_leaf):
        return local_input(dt, target, grad_layout)


class InplaceWrap:
    """The DTensor takes its new local; the local carries the history."""

    @staticmethod
    def apply(dt, new_local):
        dt._local = new_local
        if new_local.requires_grad and not dt.requires_grad:
            dt.requires_grad_(True)  # a wrapper made here is a leaf of no graph: only its flag matters
        return dt


class InplaceViewWrap:
    """A write through a view reaches the base's local through memory (a torch view of it), which the recorded
    graph holds as a view and an in-place op; nothing is left to do for autograd."""

    @staticmethod
    def apply(base, view_local, replay):
        return base


_SUBSTITUTES = {_bridge.Wrap: Wrap, _bridge.Unwrap: Unwrap, _bridge.InplaceWrap: InplaceWrap,
                _bridge.InplaceViewWrap: InplaceViewWrap}


def _always() -> bool:
    return True


@contextlib.contextmanager
def tracing_bridge():
    """Inside: every `Wrap/Unwrap/InplaceWrap/InplaceViewWrap.apply` (whoever imported the classes) is the
    traceable version above, and so are `autograd.local_input` / `wrap_local`, which take the route they take
    under functorch transforms, through `Unwrap.apply` / `Wrap.apply`. Swapped, not tested per call: the eager
    bridge pays nothing for it. A Python node of the bridge made anyway (through `_unwrap_c_apply` held
    elsewhere) is found afterwards in the autograd graph of what was traced, and `hyper_parallel.compile`
    refuses such a trace."""
    if _bridge._functorch_active is _always:  # nested: already on
        yield
        return
    saved = {cls: cls.__dict__.get("apply") for cls in _SUBSTITUTES}
    _bridge._functorch_active = _always
    for cls, sub in _SUBSTITUTES.items():
        cls.apply = staticmethod(sub.apply)
    try:
        yield
    finally:
        _bridge._functorch_active = torch._C._are_functorch_transforms_active
        for cls, old in saved.items():
            if old is None:
                del cls.apply  # back to autograd.Function.apply
            else:
                cls.apply = old
