"""The few aten ops that reach DTensor below __torch_function__: the autograd engine's own calls.

Seen in training: gradient accumulation (add), nn.Parameter (detach/alias), the backward seed
(ones_like), optimizers' state (zeros_like/empty_like), grad clones; and functorch's `torch.vmap` exit,
which expands an output it does not see as batched (see `_vmap_exit`). Anything else is a path the
dispatcher missed, and it fails loudly.
"""
from __future__ import annotations

import torch
from torch._C import _functorch

from ..dtensor.dtensor import DTensor, make_dtensor
from ..layout.layout import replicate_layout
from ..redistribute.planner import redistribute_local

aten = torch.ops.aten


def _as_layout(x, layout, shape):
    if type(x) is DTensor:
        return x._local if x._layout is layout else redistribute_local(x._local, x._layout, layout, x._shape)
    if isinstance(x, torch.Tensor):
        return redistribute_local(x, replicate_layout(layout.mesh, x.ndim), layout, tuple(x.shape))
    return x


def _same_layout(func, args, kwargs):
    """Elementwise on the first DTensor's layout: other tensor args are moved to it."""
    first = next(a for a in args if type(a) is DTensor)
    layout, shape = first._layout, first._shape
    local_args = [_as_layout(a, layout, shape) for a in args]
    out = func(*local_args, **kwargs)
    if func is aten.add_.Tensor:
        return args[0]
    return make_dtensor(out, layout, shape)


def _alias(func, args, kwargs):
    x = args[0]
    return make_dtensor(func(x._local), x._layout, x._shape)


def _like(func, args, kwargs):
    """New values shaped like x (ones, zeros, empty): nothing is pending on them."""
    x = args[0]
    layout = x._layout.without_partial()
    return make_dtensor(func(x._local, **kwargs), layout, x._shape)


def _clone(func, args, kwargs):
    """A copy of x's values, pending reductions included (a gradient the engine copies may be a pending sum)."""
    x = args[0]
    return make_dtensor(func(x._local, **kwargs), x._layout, x._shape)


def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    dst._local.copy_(_as_layout(src, dst._layout, dst._shape))
    return dst


def _scalar(func, args, kwargs):
    """A DTensor used where torch wants a Python number (`torch.arange(t.sum())`): the global value."""
    x = args[0]
    local = x._local if x._layout.is_replicate else redistribute_local(x._local, x._layout, x._layout.replicated(),
                                                                        x._shape)
    return func(local)


def _vmap_exit(func, args, kwargs):
    """`aten.expand` on a DTensor: what `torch.vmap`'s exit (`_remove_batch_dim`) does to an output it takes for
    unbatched, broadcasting it over the batch (`sizes` is the shape with the batch size inserted).

    A DTensor computed inside the vmapped function only from DTensors (captured, unbatched) really is unbatched:
    its expand goes through the dispatcher as `Tensor.expand`, where its rule runs it. A DTensor whose *local* is
    a functorch tensor was computed from the transform's batched tensors by an op that ran on its local; functorch
    sees only the wrapper, and which vmap level and output dim the local's batch belongs to is not visible here
    (functorch's state is hidden below `__torch_function__`), so the result would be a guess: it raises, naming
    the fix. (An autograd.Function under a transform, as transformers' vmapped masks index captured tensors, is
    run on global values with plain outputs by the dispatcher, so its batch stays visible to functorch.)
    """
    x, sizes = args[0], args[1]
    if _functorch.is_functorch_wrapped_tensor(x._local):
        raise RuntimeError(
            f"hyper_parallel: a DTensor ({x._layout}, global shape {tuple(x._shape)}) computed inside torch.vmap (or "
            f"another torch.func transform) from the transform's batched tensors left the transform: functorch "
            f"sees only the DTensor wrapper, not the batch of its local, so it cannot be unbatched correctly. "
            f"Capture `t.full_tensor()` (a plain tensor holding the global value) instead of the DTensor `t` in the "
            f"transformed function.")
    if kwargs.get("implicit"):
        raise RuntimeError(f"hyper_parallel: aten.expand(implicit=True) reached a DTensor ({x._layout}) below "
                           f"__torch_function__; please report the code that called it")
    return torch.Tensor.expand(x, [int(n) for n in sizes])  # __torch_function__ is on here: the dispatcher's rule


_HANDLERS = {
    aten.expand.default: _vmap_exit,
    aten._local_scalar_dense.default: _scalar,
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.ones_like.default: _like,
    aten.zeros_like.default: _like,
    aten.empty_like.default: _like,
    aten.clone.default: _clone,
    aten.add.Tensor: _same_layout,
    aten.add_.Tensor: _same_layout,
    aten.mul.Tensor: _same_layout,
    aten.div.Tensor: _same_layout,
    aten.copy_.default: _copy,
}


def engine_dispatch(func, args, kwargs):
    handler = _HANDLERS.get(func)
    if handler is None:
        raise RuntimeError(
            f"hyper_parallel: aten op {func} reached DTensor below __torch_function__ (args: "
            f"{[type(a).__name__ for a in args]}). {_why_bypassed()}")
    return handler(func, args, kwargs)


def _why_bypassed() -> str:
    """What to do, for the one bypass we can name: a backward (a custom autograd.Function's, a hook, a checkpoint
    recomputation) run by an engine that inherited a caller's disabled torch-function state."""
    if torch._C._current_autograd_node() is not None and not torch._C._is_torch_function_enabled():
        return ("It ran inside a backward that was started with subclass torch functions disabled (the autograd "
                "engine keeps the caller's state), so the backward's own ops could not reach the dispatcher: start "
                "the backward outside torch._C.DisableTorchFunctionSubclass (DTensor's .backward(), "
                "torch.autograd.backward and torch.autograd.grad on DTensors re-enable it for the engine).")
    return "This path bypassed the dispatcher; please report it with the code that called it."
