"""The one dispatch path: every torch call that touches a DTensor comes through `torch_function`.

Hot path (cache hit): a flat scan of the arguments, a tuple key, one dict lookup, local redistributions,
the local op, and wrapping. When every input is replicated on one mesh no decision is needed at all:
the op runs on the local tensors and its outputs are replicated.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch._C import _functorch
from torch._functorch.autograd_function import custom_function_call

from ..dtensor import autograd as autograd_bridge
from ..dtensor.autograd import InplaceViewWrap, InplaceWrap, Wrap, _unwrap_c_apply, local_input, wrap_local
from ..dtensor.dtensor import DTensor, make_dtensor
from ..layout.layout import Layout, replicate_layout
from ..redistribute.planner import redistribute_local
from . import registry
from .registry import _RECORDERS
from .call import LocalReshape, OpCall, Strategy, TensorSpec

_DisableTF = torch._C.DisableTorchFunctionSubclass
_is_grad_enabled = torch.is_grad_enabled
_NO_KWARGS: dict = {}  # shared, never mutated
_RULE_OF: dict = {}    # func -> (name, rule or None, inplace)
_CACHE: dict = {}      # call key -> Decision
_FAST: dict = {}       # func -> in-place?, for funcs whose all-replicated calls take _replicated_local
_SLOW_ONLY = [0]       # open python_path_only() contexts: while any is open, _FAST stays empty
_NOT_HANDLED = object()
_make_wrapper = Tensor._make_wrapper_subclass
_strided = torch.strided
STATS = {"hits": 0, "misses": 0, "replicated": 0}

# Metadata of the wrapper itself: answered from the wrapper, never from the shard.
_PASSTHROUGH = {
    Tensor.size, Tensor.dim, Tensor.numel, Tensor.nelement, Tensor.__len__, Tensor.stride,
    Tensor.requires_grad_, Tensor.retain_grad, Tensor.register_hook, Tensor.backward,
    Tensor.register_post_accumulate_grad_hook, Tensor.element_size, Tensor.is_floating_point,
    Tensor.is_complex, Tensor.is_signed, Tensor.get_device, Tensor.is_contiguous, Tensor.__hash__,
    Tensor.dim_order, Tensor.is_inference, Tensor._is_view, Tensor.__dir__,
    Tensor.__reduce_ex__, Tensor.storage_offset, Tensor.is_shared,
    torch.is_complex, torch.is_floating_point,  # metadata queries (optimizers ask them of every param)
}
for _prop in ("shape", "dtype", "device", "layout", "requires_grad", "grad", "grad_fn", "is_leaf", "ndim",
              "_grad", "_grad_fn", "_base", "_version", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
              "is_nested", "output_nr", "_backward_hooks", "_post_accumulate_grad_hooks", "names", "is_mkldnn",
              "is_xpu", "is_mps", "itemsize", "nbytes", "_cdata", "name", "__class__", "__dict__",
              "_post_accumulate_grad_hooks", "_is_param", "__weakref__", "_python_dispatch", "is_sparse_csr",
              "__cuda_array_interface__", "retains_grad", "data"):
    _d = getattr(Tensor, _prop, None)
    for _acc in ("__get__", "__set__", "__delete__"):
        if _d is not None and hasattr(_d, _acc):
            _PASSTHROUGH.add(getattr(_d, _acc))
# The autograd API, where DTensors whose gradient arrives at their local need their locals asked instead.
_AUTOGRAD_API = {
    torch.autograd.grad: lambda func, args, kwargs: autograd_bridge.grad(*args, **kwargs),
    torch.autograd.backward: autograd_bridge.backward,
    Tensor.backward: autograd_bridge.backward,
}
_PASSTHROUGH.discard(Tensor.backward)
# `torch.Tensor.__format__(t, spec)` called by name: what `format(t, spec)` gives (DTensor.__format__)
_AUTOGRAD_API[Tensor.__format__] = lambda func, args, kwargs: DTensor.__format__(*args, **kwargs)


def _set_data(func, args, kwargs):
    """`param.data = new` (how `Module.to/float/half/cpu` convert parameters in place, keeping their
    identity, ties and optimizer references): a DTensor takes the new wrapper's metadata *and* its shard."""
    target, new = args
    if (type(target) is DTensor) != (type(new) is DTensor):
        raise TypeError(f"cannot assign a {type(new).__name__} to the .data of a {type(target).__name__}: "
                        f"both must be DTensors (or both plain tensors)")
    func(target, new)  # the wrapper's own dtype, device and shape
    if type(target) is DTensor:
        target._local, target._layout, target._shape = new._local, new._layout, new._shape


_SET_DATA = Tensor.data.__set__
_PASSTHROUGH.discard(_SET_DATA)
_AUTOGRAD_API[_SET_DATA] = _set_data  # not autograd, but the same kind of whole-tensor API
_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__"}


def clear_caches() -> None:
    _RULE_OF.clear()
    _CACHE.clear()
    _FAST.clear()


def clear_fast_paths() -> None:
    """Forget which funcs take the replicated fast path, so that the next call of each decides again."""
    _RULE_OF.clear()
    _FAST.clear()


@contextlib.contextmanager
def python_path_only():
    """Send every call through `_dispatch`, which keeps the books the fast path skips (census records, STATS)."""
    _SLOW_ONLY[0] += 1
    clear_fast_paths()
    try:
        yield
    finally:
        _SLOW_ONLY[0] -= 1
        clear_fast_paths()


@contextlib.contextmanager
def count_calls():
    """Count the dispatched calls inside: {"replicated", "hits", "misses"} (decision-cache hits and misses).

    Calls run on the Python path meanwhile, so use it to count, not to time."""
    counts = {}
    before = dict(STATS)
    with python_path_only():
        try:
            yield counts
        finally:
            counts.update({k: STATS[k] - before[k] for k in STATS})


def is_inplace_op(name: str) -> bool:
    """Does the op of this qualified name write into its first argument (`Tensor.add_`, `__iadd__`, ...)?
    Dunders end with "_" too (`__and__`), so the trailing underscore alone does not say."""
    short = name.rsplit(".", 1)[-1]
    return short in _INPLACE_DUNDERS or (short.endswith("_") and not short.endswith("__")
                                         and name.startswith("torch.Tensor."))


def _resolve(func):
    name = registry.op_name(func)
    inplace = is_inplace_op(name)
    rule = registry.RULES.get(name)
    entry = (name, rule, inplace)
    _RULE_OF[func] = entry
    if rule is not None and rule.replicated_local and func not in _PASSTHROUGH and not _SLOW_ONLY[0]:
        _FAST[func] = inplace
    return entry


# ---- argument scanning -----------------------------------------------------------------------
def _collect(values, out: list) -> None:
    for a in values:
        if isinstance(a, Tensor):
            out.append(a)
        elif type(a) is list or type(a) is tuple:
            for b in a:
                if isinstance(b, Tensor):
                    out.append(b)
                elif type(b) is list or type(b) is tuple:
                    _collect(b, out)


def _swap(obj, it):
    if isinstance(obj, Tensor):
        return next(it)
    t = type(obj)
    if t is tuple or t is list:
        return t([_swap(b, it) for b in obj])
    return obj


def _swap_args(args, kwargs, new):
    it = iter(new)
    args = tuple([_swap(a, it) for a in args])
    if kwargs:
        kwargs = {k: _swap(v, it) for k, v in kwargs.items()}
    return args, kwargs


def _argkey(a, floats: bool):
    t = type(a)
    if t is DTensor:
        return (a._layout, a._shape, a.dtype)
    if isinstance(a, Tensor):
        return (a.shape, a.dtype)
    if t is tuple or t is list:
        return tuple([_argkey(b, floats) for b in a])
    if t is float and not floats:
        return float
    if t is slice:
        return (slice, a.start, a.stop, a.step)
    return a


def _key(func, args, kwargs, floats):
    try:
        key = (func, tuple([_argkey(a, floats) for a in args]),
               tuple([(k, _argkey(v, floats)) for k, v in kwargs.items()]) if kwargs else None)
        hash(key)
        return key
    except TypeError:
        return None


# ---- the decision for one call ---------------------------------------------------------------
class Decision:
    __slots__ = ("in_layouts", "grad_layouts", "out_layouts", "out_shapes", "local_fn", "moves")

    def __init__(self, in_layouts, grad_layouts, out_layouts, out_shapes, local_fn):
        self.in_layouts = in_layouts
        self.grad_layouts = grad_layouts
        self.out_layouts = out_layouts
        self.out_shapes = None if out_shapes is None else [torch.Size(s) for s in out_shapes]  # as .shape gives
        self.local_fn = local_fn


def _meta(a):
    if isinstance(a, Tensor):
        shape = a._shape if type(a) is DTensor else a.shape
        return torch.empty(shape, dtype=a.dtype, device="meta")
    t = type(a)
    if t is tuple or t is list:
        return t(_meta(b) for b in a)
    return a


def _out_shapes(func, args, kwargs):
    """Global output shapes, by running the op on meta tensors; None if the op cannot run on meta."""
    try:
        with torch.no_grad():
            out = func(*[_meta(a) for a in args], **{k: _meta(v) for k, v in kwargs.items()})
    except Exception:  # data-dependent ops and ops without meta kernels: the rule must know
        return None
    found = []
    _collect([tuple(out) if isinstance(out, tuple) else out], found)  # torch.return_types.* too
    return [tuple(t.shape) for t in found]


def _decide(func, name, rule, inplace, args, kwargs, leaves, mesh) -> Decision:
    specs = [TensorSpec(t._layout, t._shape, t.dtype, True) if type(t) is DTensor
             else TensorSpec(replicate_layout(mesh, t.ndim), tuple(t.shape), t.dtype, False) for t in leaves]
    out_shapes = rule.output_shapes(specs)
    if out_shapes is None:
        out_shapes = _out_shapes(func, args, kwargs)
    call = OpCall(func, name, args, kwargs, specs, mesh, out_shapes, inplace)
    strat: Strategy = rule.strategy(call)
    ins = strat.in_layouts
    if len(ins) != len(specs):
        raise RuntimeError(f"rule {type(rule).__name__} for {name} gave {len(ins)} input layouts for {len(specs)} inputs")
    donors = [i for i in rule.shape_only if i < len(specs)]
    for i in donors:  # a shape or dtype donor is read where it lies
        ins[i] = specs[i].layout
    outs = strat.out_layouts
    if outs is Strategy.REPLICATED:  # every output replicated: global shape = local shape, no meta needed
        return Decision(ins, strat.grad_layouts or _grad_layouts(ins, [], donors), None, None, strat.local_fn)
    n_out = len(out_shapes) if out_shapes is not None else (len(outs) if isinstance(outs, (list, tuple)) else 1)
    if isinstance(outs, Layout) or outs is None:
        outs = [outs] * n_out
    grads = strat.grad_layouts or _grad_layouts(ins, outs, donors)
    return Decision(ins, grads, list(outs), out_shapes, strat.local_fn)


def _grad_layouts(ins, outs, donors=()):
    """Layouts of the local gradients of each input (the duality in dtensor/autograd.py).

    A mesh axis that splits some input or output splits the computation: an input replicated over it
    gets a pending-sum gradient. `donors` (inputs that only lend a shape or dtype) split nothing."""
    split = set()
    for lay in [lay for i, lay in enumerate(ins) if i not in donors] + [o for o in outs if o is not None]:
        split.update(lay.sharded_axes)
        split.update(a for a, p in enumerate(lay.partial) if p is not None)
    out = []
    for lay in ins:
        partial = tuple("sum" if (a in split and lay.axis_dim[a] < 0 and p is None) else None
                        for a, p in enumerate(lay.partial))
        out.append(lay.with_map(lay.tensor_map, partial))
    return out


# ---- running ---------------------------------------------------------------------------------
def _wrap_out(out, layouts, shapes, grad, it):
    if isinstance(out, Tensor):
        i = next(it)
        layout = layouts[i]
        if shapes is not None:
            shape = shapes[i]
        else:  # no meta kernel: even splits assumed, which rules for such ops guarantee
            shape = tuple(n * layout.shard_count(d) for d, n in enumerate(out.shape))
        if grad and out.requires_grad:
            return wrap_local(out, layout, shape)
        return make_dtensor(out, layout, shape)
    t = type(out)
    if t is tuple or t is list:
        return t([_wrap_out(o, layouts, shapes, grad, it) for o in out])
    if isinstance(out, tuple) and hasattr(out, "n_fields"):  # torch.return_types.*
        return t([_wrap_out(o, layouts, shapes, grad, it) for o in out])
    return out


def _wrap_outs(out, layouts, shapes, grad):
    """A decision's outputs wrapped with their layouts (what `_dispatch` does for several outputs; the C twin's)."""
    return _wrap_out(out, layouts, shapes, grad, iter(range(len(layouts))))


def _wrap_replicated(out, mesh, grad):
    if isinstance(out, Tensor):
        if type(out) is DTensor:
            return out
        layout = replicate_layout(mesh, out.ndim)
        if grad and out.requires_grad:
            return wrap_local(out, layout, tuple(out.shape))
        return make_dtensor(out, layout, tuple(out.shape))
    t = type(out)
    if t is tuple or t is list:
        return t([_wrap_replicated(o, mesh, grad) for o in out])
    if isinstance(out, tuple) and hasattr(out, "n_fields"):
        return t([_wrap_replicated(o, mesh, grad) for o in out])
    return out


def _returns_first_list(out: list, a0, loc0) -> bool:
    """An in-place list-wise op (`torch._foreach_mul_`) returns the tensors of its first list: the caller gets that
    list's own DTensors back, as torch gives back the same tensors (no new wrappers, no aliasing copies)."""
    if (type(a0) is not list and type(a0) is not tuple) or len(out) != len(a0) or len(loc0) != len(a0):
        return False
    for o, loc in zip(out, loc0):
        if o is not loc:
            return False
    return True


def _note_view(result, args, loc0, out, func, largs, lkwargs, copied: bool = False):
    """Remember what `result` (a torch view, `out._base` set) was taken of, for in-place writes into it.

    `loc0` is args[0]'s own local when the op ran on it (directly, or through a `LocalReshape`, passed as `func`),
    None when it ran on a moved copy (or through another `local_fn`), which is then `largs[0]`. A view of args[0]'s local notes (args[0], func, args) so a write can give
    the base its history (torch's CopySlices); a view of a moved copy notes False, so a write into it raises (it would
    not reach the original), as does a view of another input, and a view made by a rule's `local_fn` that declares
    `copies_input` (`as_strided` of a non-contiguous local views a contiguous copy: `copied`). A view of none of the
    inputs is a view of a tensor the op made itself (`F.linear` with a bias on a 3-d input returns its 2-d `addmm`
    result reshaped; `rand_like` on a split input slices this rank's piece of a fresh tensor): a write into it
    reaches no input, exactly as on one device, so it needs no note."""
    base = out._base
    if base is not None and type(args[0]) is DTensor and type(result) is DTensor and result is not args[0]:
        ran_on = largs[0] if loc0 is None else loc0
        if base is ran_on or (ran_on._base is not None and base is ran_on._base):  # inline: grad-mode views
            if loc0 is None:
                result._view_of = False
                own = args[0]._local
                if ran_on is not own and base is not own and base is not own._base:  # a redistributed copy
                    base._hp_copy = True  # views of this view are refused too (`_views_a_copy`)
                    _note_write_back(result, func, args)
            else:
                result._view_of = (args[0], func, largs[1:], lkwargs)
        elif copied or any(_is_view_of(base, t) for t in list(largs[1:]) + list(lkwargs.values())):
            result._view_of = False
    return result


def _is_view_of(base, t) -> bool:
    """Does a view whose `_base` is `base` share memory with tensor `t` (torch points every view at its root)?"""
    return isinstance(t, Tensor) and (base is t or (t._base is not None and base is t._base))


def _basic_index(index) -> bool:
    """Is `index` made of ints, slices, None and Ellipsis only (what `__setitem__` can write back exactly)?"""
    for e in (index if type(index) is tuple else (index,)):
        if not (e is None or e is Ellipsis or type(e) is slice or type(e) is int):
            return False
    return True


def _select_index(dim, i):
    return (slice(None),) * dim + (i,) if dim >= 0 else (Ellipsis, i) + (slice(None),) * (-dim - 1)


def _narrow_index(dim, start, length):
    if type(start) is not int or type(length) is not int or start < 0:
        return None  # a tensor start, or a negative one (torch wraps it by the size, a slice would not)
    return _select_index(dim, slice(start, start + length))


# View ops whose result, taken of a redistributed copy, is `base[index]` for a basic index: the op's arguments
# after the tensor -> that index, or None where it is not basic (those writes stay refused).
_WRITE_BACK_INDEX = {
    Tensor.__getitem__: lambda index: index if _basic_index(index) else None,
    Tensor.select: _select_index, torch.select: _select_index,
    Tensor.narrow: _narrow_index, torch.narrow: _narrow_index,
}


def _note_write_back(result, func, args) -> None:
    """`result` views a redistributed copy of `args[0]` (`x[0]` of a batch-split x gathers the rows first): if it
    is `args[0][index]` for a basic index, remember how to write it back, so that an in-place op on it
    (`x[0] |= m`) reaches x as on one device. The record holds x's local and its version: once x has been written
    since, the copy is compared with x[index] again (`_copy_is_current`), and a copy that no longer holds it (x was
    written where the view lies) is refused rather than written back over that write."""
    to_index = _WRITE_BACK_INDEX.get(func)
    if to_index is None or len(args) < 2:
        return
    try:
        index = to_index(*args[1:])
    except TypeError:  # keyword or unusual arguments: no write-back, the write stays refused
        return
    if index is not None:
        base = args[0]
        result._write_back = (base, index, base._local, base._local._version)


def _views_a_copy(local) -> bool:
    """Is `local` a torch view of a redistributed copy that `_note_view` marked? A DTensor view of a view of a
    copy (`v = x[0]; v[1:]`, `v.view(...)`) has no note of its own when made without grad, so an in-place write
    into it is caught here, by its local's root, rather than lost."""
    base = local._base
    return base is not None and getattr(base, "_hp_copy", False)


def _refuse_lost_write(target, name="an in-place op"):
    """Raise, before anything runs (the local shard may be a real view of the original's), when `target` is a view
    that was taken of a redistributed copy (or of another input, or through a local reshape), or a view of such a
    view: the write would not reach the original. Unless it can be written back (`_note_write_back`): then its
    record (base, index, ...)."""
    if getattr(target, "_view_of", None) is not False:
        if _views_a_copy(target._local) and getattr(target, "_write_back", None) is None:
            raise RuntimeError(f"{name} writes into a view of a view that an op took of a redistributed copy of a "
                               f"DTensor, so the write would not reach the original tensor ({target._layout}). "
                               f"Write into the original with one index (x[i, j] op= v) or redistribute it first.")
        return None
    record = getattr(target, "_write_back", None)
    if record is not None:
        base = record[0]
        if (base._local is record[2] and base._local._version == record[3]) or _copy_is_current(target, record):
            return record
        raise RuntimeError(f"{name} writes into a view that an op took of a redistributed copy of a DTensor "
                           f"({base._layout}), and that DTensor has been written where the view lies since, so the "
                           f"copy is stale and writing it back would undo that write. Take the view again after "
                           f"writing the original.")
    raise RuntimeError(f"{name} writes into a view that an op took of a redistributed copy of a DTensor (or of "
                       f"another of its inputs), so the write would not reach the original tensor "
                       f"({target._layout}). Write into the original with index assignment (x[...] = v) or "
                       f"redistribute it first.")


def _copy_is_current(target, record) -> bool:
    """Does the copy `target` still hold `base[index]`, now that base has been written since it was taken? Written
    elsewhere (`a, b = x[0], x[1]; a += 1; b += 1`: a's write-back is such a write) it does, and writing it back is
    what one device does; written where it lies, the view on one device would show that write and the copy does
    not. Compared on full values (gathered, so every rank decides alike); only reached once base was written."""
    base, index = record[0], record[1]
    with torch.no_grad():
        now = _dispatch(Tensor.__getitem__, (base, index), _NO_KWARGS)
        if type(now) is not DTensor or now._shape != target._shape or now.dtype != target.dtype:
            return False
        full = [redistribute_local(t._local, t._layout, replicate_layout(t._layout.mesh, t.ndim), t._shape)
                for t in (now, target)]
    return torch.equal(full[0], full[1])


def _write_through(func, args, kwargs, record):
    """An in-place op on a view of a redistributed copy, `v = x[index]` (the copy every rank holds): run it on the
    copy, then write the copy back with `x[index] = v`, which lands each position in the shard that owns it (and,
    if x is itself such a view, writes x back in turn). Values and gradients are then those of one device, where
    the op writes through the view into x."""
    target = args[0]
    target._view_of = None  # the op itself runs on the copy as on any replicated tensor
    try:
        out = _dispatch(func, args, kwargs)
    finally:
        target._view_of = False
    base, index = record[0], record[1]
    _dispatch(Tensor.__setitem__, (base, index, target), _NO_KWARGS)
    target._write_back = (base, index, base._local, base._local._version)
    return out


def _finish_inplace(target, local_out, grad, name="an in-place op"):
    """Give `target` the written local and its history; `_dispatch` has already refused a lost write (every caller
    runs under it, before anything was written).

    A write into a view reaches every tensor it views, up the chain (`y.reshape(...)[..., :1].mul_(3)` writes into
    the reshape and into y): each gets the history torch's CopySlices gives the root, its view of the written
    values re-taken by the chain's view functions from it down to the target."""
    view = getattr(target, "_view_of", None)
    if grad and (target.requires_grad or local_out.requires_grad):
        out = InplaceWrap.apply(target, local_out)
        replay = None
        while view:
            base, vfunc, vargs, vkwargs = view
            replay = _then(vfunc, vargs, vkwargs, replay)
            InplaceViewWrap.apply(base, local_out, replay)
            view = getattr(base, "_view_of", None)
        return out
    if local_out is not target._local and isinstance(local_out, Tensor):
        target._local = local_out
    return target


def _then(vfunc, vargs, vkwargs, inner):
    """The view function `vfunc(g, *vargs, **vkwargs)` followed by `inner` (the views below it), as one replay."""
    if inner is None:
        return lambda g: vfunc(g, *vargs, **vkwargs)
    return lambda g: inner(vfunc(g, *vargs, **vkwargs))


def torch_function(func, types, args=(), kwargs=None):
    inplace = _FAST.get(func)
    grad_mode = _is_grad_enabled()
    if inplace is not None and not grad_mode:
        out = _replicated_local(func, args, kwargs, False, inplace)
        if out is not _NOT_HANDLED:
            return out
    return _after_no_grad_path(func, args, kwargs, inplace, grad_mode)


def torch_function_after_c(func, types, args=(), kwargs=None):
    """Where the C twin hands a call on: it has tried exactly what `_replicated_local` tries without grad."""
    return _after_no_grad_path(func, args, kwargs, _FAST.get(func), _is_grad_enabled())


def torch_function_after_c_grad(func, types, args=(), kwargs=None):
    """Where the C twin hands a grad-mode call of a `_FAST` func that it declined, before running anything, for
    exactly the reasons `_replicated_local(..., grad=True, inplace=False)` would: the general path."""
    with _DisableTF():
        return _dispatch(func, args, kwargs or _NO_KWARGS, False)


def _after_no_grad_path(func, args, kwargs, inplace, grad_mode):
    with _DisableTF():  # from here on, reads of the wrappers' properties (requires_grad) are the wrappers'
        if inplace is not None:
            if grad_mode:
                out = _replicated_local(func, args, kwargs, True, inplace)
                if out is not _NOT_HANDLED:
                    return out
            return _dispatch(func, args, kwargs or _NO_KWARGS, False)
        if func in _PASSTHROUGH:
            return func(*args, **kwargs) if kwargs else func(*args)
        if func in _AUTOGRAD_API:
            return _AUTOGRAD_API[func](func, args, kwargs or _NO_KWARGS)
        return _dispatch(func, args, kwargs or _NO_KWARGS)


def _same_replicated_mesh(t, mesh):
    """`t`'s mesh if `t` is replicated and on `mesh` (any mesh when None); None otherwise."""
    lay = t._layout
    if not lay.is_replicate or (mesh is not None and lay.mesh is not mesh):
        return None
    return lay.mesh


def _replicated_local(func, args, kwargs, grad, inplace):
    """The hottest path: every input replicated on one mesh, so no decision and no redistribution.

    `grad` is grad mode. Without it, the path reads only the wrappers' own attributes and calls the op on
    plain tensors, so it needs no DisableTorchFunctionSubclass (and has a C twin, _fastpath.c). With it,
    inputs that require grad enter through `local_input` and a result that requires grad is wrapped by
    `Wrap`. DTensors are looked for among the positional arguments, one level into their lists and tuples,
    and among keyword arguments. Anything it does not cover (a split or mixed-mesh input, a list in kwargs,
    deeper nesting, an in-place op that autograd must see) returns _NOT_HANDLED before running anything."""
    mesh = None
    locs = []
    needs = None  # (position, index in a list or -1) of the DTensor inputs that require grad
    for i, a in enumerate(args):
        t = type(a)
        if t is DTensor:
            mesh = _same_replicated_mesh(a, mesh)
            if mesh is None:
                return _NOT_HANDLED
            locs.append(a._local)
            if grad and a.requires_grad:
                needs = [(i, -1)] if needs is None else needs + [(i, -1)]
        elif t is list or t is tuple:
            seq = []
            for j, b in enumerate(a):
                if type(b) is DTensor:
                    mesh = _same_replicated_mesh(b, mesh)
                    if mesh is None:
                        return _NOT_HANDLED
                    seq.append(b._local)
                    if grad and b.requires_grad:
                        needs = [(i, j)] if needs is None else needs + [(i, j)]
                elif type(b) is list or type(b) is tuple:
                    return _NOT_HANDLED
                else:
                    if grad and inplace and isinstance(b, Tensor) and b.requires_grad:
                        return _NOT_HANDLED
                    seq.append(b)
            locs.append(t(seq))
        else:
            if grad and inplace and isinstance(a, Tensor) and a.requires_grad:
                return _NOT_HANDLED
            locs.append(a)
    given_kwargs = kwargs
    if kwargs:
        local_kwargs = None
        for k, v in kwargs.items():
            t = type(v)
            if t is DTensor:
                mesh = _same_replicated_mesh(v, mesh)
                if mesh is None:
                    return _NOT_HANDLED
                if local_kwargs is None:
                    local_kwargs = dict(kwargs)
                local_kwargs[k] = v._local
                if grad and v.requires_grad:
                    needs = [(k, -1)] if needs is None else needs + [(k, -1)]
            elif t is list or t is tuple or (grad and inplace and isinstance(v, Tensor) and v.requires_grad):
                return _NOT_HANDLED
        if local_kwargs is not None:
            kwargs = local_kwargs
    if mesh is None or not args:  # no DTensor where we looked, or only in kwargs: the general path
        return _NOT_HANDLED
    a0 = args[0]
    if inplace and (needs is not None or getattr(a0, "_view_of", None) is False or
                    (type(a0) is DTensor and locs[0]._base is not None and _views_a_copy(locs[0]))):
        return _NOT_HANDLED  # autograd must see the write, or it would not reach the original (_dispatch decides)
    if needs is not None:
        for i, j in needs:
            if type(i) is str:  # a keyword argument (kwargs is already this call's own copy)
                b = given_kwargs[i]
                kwargs[i] = local_input(b, b._layout, b._layout)
            elif j < 0:
                locs[i] = local_input(args[i], args[i]._layout, args[i]._layout)
            else:
                b = args[i][j]
                seq = list(locs[i])
                seq[j] = local_input(b, b._layout, b._layout)
                locs[i] = type(locs[i])(seq)
    out = func(*locs, **kwargs) if kwargs else func(*locs)
    if type(out) is not Tensor:
        if type(out) is list and _returns_first_list(out, a0, locs[0]):
            return list(a0)
        return _wrap_replicated(out, mesh, grad)
    if type(a0) is DTensor and out is locs[0]:  # in-place ops, `x.to(x.dtype)`: the same tensor, as in torch
        return a0
    shape = out.shape
    layout = mesh.replicated_layouts.get(len(shape)) or replicate_layout(mesh, len(shape))
    if grad and out.requires_grad:
        res = wrap_local(out, layout, shape)
    else:
        res = _make_wrapper(DTensor, shape, None, None, None, out.dtype, _strided, out.device)
        res._local = out
        res._layout = layout
        res._shape = shape
    # A view made without grad needs no note: its local is a torch view made without grad, and torch itself
    # refuses an in-place write into it with grad mode on, as it would on one device.
    if grad and out._base is not None and type(a0) is DTensor:
        _note_view(res, args, locs[0], out, func, locs, kwargs or _NO_KWARGS)
    return res


def _dispatch(func, args, kwargs, try_replicated=True):
    """The general path; `try_replicated=False` when `_replicated_local` has already declined this call."""
    entry = _RULE_OF.get(func)
    if entry is None:
        entry = _resolve(func)
    name, rule, inplace = entry
    if inplace and args and type(args[0]) is DTensor:
        record = _refuse_lost_write(args[0], name)
        if record is not None:
            return _write_through(func, args, kwargs, record)
    leaves = []
    flat = True  # tensors only directly among positional args: the hot path can skip rebuilding structure
    for a in args:
        t = type(a)
        if t is DTensor or isinstance(a, Tensor):
            leaves.append(a)
        elif t is list or t is tuple:
            flat = False
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, Tensor) or type(v) is list or type(v) is tuple:
                flat = False
    if not flat:
        if rule is not None and rule.listwise and not _RECORDERS and not _is_grad_enabled():
            out = _listwise_local(func, args, kwargs)
            if out is not _NOT_HANDLED:
                return out
        leaves = []
        _collect(args, leaves)
        if kwargs:
            _collect(kwargs.values(), leaves)
    mesh = None
    replicated = True
    grad_mode = _is_grad_enabled()
    grad = False  # does autograd see this call: grad mode and an input that requires grad
    for t in leaves:
        if type(t) is DTensor:
            lay = t._layout
            if mesh is None:
                mesh = lay.mesh
            elif lay.mesh is not mesh:
                raise ValueError(f"{name}: inputs live on different meshes ({mesh} and {lay.mesh}); "
                                 f"redistribute them onto one mesh first")
            if not lay.is_replicate:
                replicated = False
        if grad_mode and not grad and t.requires_grad:
            grad = True
    if _RECORDERS:
        registry.note_op(name, missing=rule is None)
    if rule is None:
        return _missing(func, name, inplace, args, kwargs, leaves, mesh)
    if mesh is None:  # only reachable through odd paths (e.g. a DTensor nested deeper than we scan)
        raise RuntimeError(f"{name}: no DTensor found among the arguments that reached hyper_parallel")

    if replicated and rule.replicated_local:
        STATS["replicated"] += 1
        if try_replicated:
            out = _replicated_local(func, args, kwargs, grad_mode, inplace)
            if out is not _NOT_HANDLED:
                return out
        if grad:
            locs = [local_input(t, t._layout, t._layout) if type(t) is DTensor and t.requires_grad
                    else (t._local if type(t) is DTensor else t) for t in leaves]
        else:
            locs = [t._local if type(t) is DTensor else t for t in leaves]
        largs, lkwargs = _swap_args(args, kwargs, locs)
        out = func(*largs, **lkwargs)
        if inplace:
            return _finish_inplace(args[0], out if isinstance(out, Tensor) else locs[0], grad, name) \
                if type(args[0]) is DTensor else out
        if isinstance(out, Tensor):
            same = _returned_input(out, locs, leaves)
            if same is not None:
                return same
            res = _wrap_replicated(out, mesh, grad)
            if out._base is not None and leaves and leaves[0] is args[0] and _is_grad_enabled():
                _note_view(res, args, locs[0], out, func, largs, lkwargs)
            return res
        return _wrap_replicated(out, mesh, grad)

    if flat and not kwargs:  # the common call: its key without a function call per tensor argument
        floats = rule.float_args_matter
        parts = []
        for a in args:  # a loop, not a comprehension: on Python 3.11 that would make a function per call
            parts.append((a._layout, a._shape, a._local.dtype) if type(a) is DTensor else _argkey(a, floats))
        key = (func, tuple(parts), None)
        try:
            dec = _CACHE.get(key)
        except TypeError:  # an unhashable argument: decide every time
            key = dec = None
    else:
        key = _key(func, args, kwargs, rule.float_args_matter)
        dec = _CACHE.get(key) if key is not None else None
    if dec is None:
        STATS["misses"] += 1
        dec = _decide(func, name, rule, inplace, args, kwargs, leaves, mesh)
        if key is not None:
            _CACHE[key] = dec
    else:
        STATS["hits"] += 1
    locs = []
    for t, target, glay in zip(leaves, dec.in_layouts, dec.grad_layouts):
        if type(t) is DTensor:
            if grad and t.requires_grad:
                locs.append(local_input(t, target, glay))
            elif target is t._layout:
                locs.append(t._local)
            else:
                locs.append(redistribute_local(t._local, t._layout, target, t._shape))
        elif grad and t.requires_grad:
            # a plain tensor is a replicated value: its gradient must be reduced like a DTensor's
            rep = replicate_layout(mesh, t.ndim)
            locs.append(local_input(Wrap.apply(t, rep, tuple(t.shape)), target, glay))
        elif target.is_replicate:
            locs.append(t)
        else:
            locs.append(redistribute_local(t, replicate_layout(mesh, t.ndim), target, tuple(t.shape)))
    if flat:
        largs, lkwargs, k = [], kwargs, 0
        for a in args:
            if type(a) is DTensor or isinstance(a, Tensor):
                largs.append(locs[k])
                k += 1
            else:
                largs.append(a)
    else:
        largs, lkwargs = _swap_args(args, kwargs, locs)
    fn = dec.local_fn or func
    out = fn(*largs, **lkwargs) if lkwargs else fn(*largs)
    if inplace and type(args[0]) is DTensor:
        target = args[0]
        if dec.in_layouts[0] is not target._layout:
            raise RuntimeError(f"{name} is in-place but its rule moved the tensor from {target._layout} to "
                               f"{dec.in_layouts[0]}; an in-place op must keep its layout")
        return _finish_inplace(target, out if isinstance(out, Tensor) else locs[0], grad, name)
    if dec.out_layouts is None:
        return _wrap_replicated(out, mesh, grad)
    if type(out) is Tensor and dec.out_shapes is not None:
        layout, shape = dec.out_layouts[0], dec.out_shapes[0]
        res = wrap_local(out, layout, shape) if grad and out.requires_grad else make_dtensor(out, layout, shape)
    else:
        res = _wrap_outs(out, dec.out_layouts, dec.out_shapes, grad)
    if type(out) is Tensor and out._base is not None and leaves and leaves[0] is args[0] and type(args[0]) is DTensor:
        # A LocalReshape is `t.reshape(local shape)` of the input's own local: its view is one of the input, and a
        # write into it reaches the input as on one device (the view's history replays the LocalReshape).
        reshaped = type(dec.local_fn) is LocalReshape
        moved = dec.in_layouts[0] is not args[0]._layout or (dec.local_fn is not None and not reshaped)
        # A view of the unmoved input made without grad needs no note, as on the replicated path: its local is a
        # torch view made without grad, which torch itself refuses to write into with grad mode on.
        if moved or grad_mode:
            _note_view(res, args, None if moved else locs[0], out, dec.local_fn if reshaped else func, largs,
                       lkwargs, getattr(dec.local_fn, "copies_input", False))
    return res


# ---- list-wise ops (the optimizers' _foreach_* and _fused_* kernels) -----------------------------------------
def _listwise_arg(a, first, layouts, mesh):
    """One argument of a list-wise call on local shards, or _NOT_HANDLED: a list (of the first list's length)
    whose DTensors are laid out and shaped like the first list's element at the same index, a 0-d tensor (a
    replicated value: a step count, a learning rate, a grad scale), or a value that is not a tensor."""
    t = type(a)
    if t is list or t is tuple:
        if not a:
            return a
        if len(a) != len(first):
            return _NOT_HANDLED
        seq = []
        for b, f, lay in zip(a, first, layouts):
            if type(b) is DTensor:
                if b._layout is not lay or b._shape != f._shape:
                    return _NOT_HANDLED
                seq.append(b._local)
            elif isinstance(b, Tensor) and b.ndim != 0:
                return _NOT_HANDLED
            else:
                seq.append(b)
        return seq
    if t is DTensor:
        lay = a._layout
        return a._local if a.ndim == 0 and lay.is_replicate and lay.mesh is mesh else _NOT_HANDLED
    if isinstance(a, Tensor) and a.ndim != 0:
        return _NOT_HANDLED
    return a


def _listwise_local(func, args, kwargs):
    """A list-wise op (`Rule.listwise`: element i of every list is laid out like element i of the first, the
    update is elementwise on the shards) whose arguments are already so, without grad: it runs once on the lists
    of local shards, with no decision, no cache key and no per-tensor redistribution check beyond one `is` per
    tensor; outputs take the first list's layouts and global shapes. An optimizer step with `foreach=True` or
    `fused=True` makes a dozen such calls per parameter group instead of a dozen dispatched ops per parameter.
    Anything else (pending sums, other layouts, broadcast shapes, mixed meshes) returns _NOT_HANDLED before
    running anything, for the general path to decide."""
    first = args[0] if args else None
    if (type(first) is not list and type(first) is not tuple) or not first:
        return _NOT_HANDLED
    layouts = []
    locs = []
    mesh = None
    for t in first:
        if type(t) is not DTensor:
            return _NOT_HANDLED
        lay = t._layout
        if lay.has_partial or (mesh is not None and lay.mesh is not mesh):
            return _NOT_HANDLED
        mesh = lay.mesh
        layouts.append(lay)
        locs.append(t._local)
    largs = [locs]
    for a in args[1:]:
        la = _listwise_arg(a, first, layouts, mesh)
        if la is _NOT_HANDLED:
            return _NOT_HANDLED
        largs.append(la)
    lkwargs = _NO_KWARGS
    if kwargs:
        lkwargs = {}
        for k, v in kwargs.items():
            lv = _listwise_arg(v, first, layouts, mesh)
            if lv is _NOT_HANDLED:
                return _NOT_HANDLED
            lkwargs[k] = lv
    out = func(*largs, **lkwargs)
    if type(out) is list or type(out) is tuple:  # one shard per element of the first list (in place: the same)
        return type(out)([f if o is loc else make_dtensor(o, lay, f._shape)
                          for o, loc, lay, f in zip(out, locs, layouts, first)])
    return out


def _returned_input(out, locs, leaves):
    """An op that hands back its input unchanged (`x.to(x.dtype)`, `x.contiguous()`) returns the same DTensor,
    as torch returns the same tensor: no new autograd node, so gradients accumulate exactly as without DTensor."""
    for loc, leaf in zip(locs, leaves):
        if out is loc and type(leaf) is DTensor:
            return leaf
    return None


def _missing(func, name, inplace, args, kwargs, leaves, mesh):
    """No rule: raise, or (inside record_missing_ops) record the op and run it on full values."""
    if not registry.recording():
        specs = ", ".join(f"{t._layout.alias_entries()}{' partial' if t._layout.has_partial else ''}"
                          if type(t) is DTensor else f"plain {tuple(t.shape)}" for t in leaves)
        raise registry.missing_op_error(name, specs)
    grad = _is_grad_enabled() and any(t.requires_grad for t in leaves)
    locs = _full_locals(leaves, grad)
    largs, lkwargs = _swap_args(args, kwargs, locs)
    out = func(*largs, **lkwargs)
    if mesh is None:
        return out
    if isinstance(out, Tensor) and all(type(t) is not DTensor or t._layout.is_replicate for t in leaves):
        same = _returned_input(out, locs, leaves)
        if same is not None:
            return same
    if inplace and type(args[0]) is DTensor:
        target = args[0]
        new = out if isinstance(out, Tensor) else locs[0]
        if not target._layout.is_replicate:
            new = redistribute_local(new, target._layout.replicated(), target._layout, target._shape)
        return _finish_inplace(target, new, grad)
    return _wrap_replicated(out, mesh, grad)


def _full_locals(leaves, grad, unwrap=local_input):
    """The global value of each tensor leaf as a plain tensor (split and pending ones gathered), autograd-connected
    to its DTensor through `unwrap` when `grad`."""
    locs = []
    for t in leaves:
        if type(t) is not DTensor:
            locs.append(t)
        elif t._layout.is_replicate:
            locs.append(unwrap(t, t._layout, t._layout) if grad and t.requires_grad else t._local)
        else:
            full = t._layout.replicated()
            locs.append(unwrap(t, full, full) if grad and t.requires_grad
                        else redistribute_local(t._local, t._layout, full, t._shape))
    return locs


def _unwrap_outside_transforms(t, target, grad_layout):
    """`local_input` for a DTensor a functorch transform captured, called with functorch disabled."""
    local = t._local
    if local.requires_grad and target is t._layout and grad_layout is target:
        return local
    allowed = _functorch.get_single_level_autograd_function_allowed()
    _functorch.set_single_level_autograd_function_allowed(True)  # as functorch's own custom_function_call does
    try:
        return _unwrap_c_apply(t, target, grad_layout, t.grad_fn is None)
    finally:
        _functorch.set_single_level_autograd_function_allowed(allowed)


def _function_under_transform(func, args, kwargs):
    """`autograd.Function.apply` under a functorch transform (`torch.vmap`, `torch.func.grad`), which torch turns
    into the `custom_function_call` higher-order op, with DTensor arguments: transformers' vmapped attention masks
    index the tensors they capture this way (`TransformGetItemToIndex` makes `t[b, kv]` a `ModIndex.apply`).

    Its outputs are functorch tensors (batched at the transform's level). Wrapped in a DTensor they would hide that
    batch from functorch, which sees only the wrapper (and would broadcast it at the exit instead of unbatching it),
    so the Function runs on the global values of its DTensor arguments (split or pending ones gathered: the same
    collectives on every rank, decided from layouts) and its outputs stay plain tensors: global values, which the
    dispatcher treats as replicated wherever they later meet DTensors. Gradients reach DTensor arguments through
    their locals, as on the replicated path."""
    leaves = []
    _collect(args, leaves)
    if kwargs:
        _collect(kwargs.values(), leaves)
    if _RECORDERS:
        registry.note_op(registry.op_name(func), missing=False)
    grad = _is_grad_enabled() and any(t.requires_grad for t in leaves)
    # The DTensors are values the transformed function captured, not the transform's own tensors: their locals
    # are taken outside the transform (functorch would refuse Unwrap, which has no setup_context for it).
    with torch._C._DisableFuncTorch():
        locs = _full_locals(leaves, grad, unwrap=_unwrap_outside_transforms)
    largs, lkwargs = _swap_args(args, kwargs, locs)
    return func(*largs, **lkwargs)


_AUTOGRAD_API[custom_function_call] = _function_under_transform
