"""`hp.compile(model)`: torch.compile for models laid out with DTensors, one graph per decoder layer.

Why not `torch.compile(model)` as it is: dynamo would trace into the dispatcher on every op (layout decisions,
caches, the C twin), which gives a graph break per op and recompiles until it gives up. Here the dispatcher is
run once per unit and call signature, at compile time, and what it does to local tensors is the graph:

1. *Lowering.* A unit's forward (each decoder layer, as torchtitan compiles per block) is traced by `make_fx`
   on fake local tensors while the dispatcher runs in Python (`dispatch/lowering.py`): layouts are decided,
   redistributions and gradient moves become `hyper_parallel::redistribute` custom ops
   (`dtensor/traceable.py`), and the ops on local tensors are recorded. The result is a graph on plain
   tensors: this rank's parameters and inputs in, this rank's outputs out, the same on every rank that runs
   the same unit with the same layouts (so the collectives match).
2. *Compiling.* That graph goes to the torch.compile backend (inductor's `compile_fx` by default) with static
   shapes: AOTAutograd derives the backward (the custom ops carry their own), inductor generates code. Dynamo
   is not needed on a graph that is whole by construction, and leaving it out saves its per-call frame
   evaluation and guards. Units whose graphs and inputs are the same (the layers of a model) share one
   compiled function.
3. *Running.* Per call the unit builds a key from what the graph depends on (argument structure; each
   tensor's layout, global shape, dtype, strides, requires_grad; constants; grad mode; autocast; train/eval),
   which is the guard of the compiled function; takes the locals (parameters through one eager bridge node,
   so their gradients land as DTensors as eagerly), calls the compiled function and wraps its outputs in
   their recorded layouts. A new key lowers again (at most `MAX_SIGNATURES` per unit).

The unit's hooks stay outside: the module's `forward` is replaced, not its `__call__`, so hsdp's gather and
reduce hooks, for example, run eagerly around the compiled forward.

A unit that cannot be traced into one graph runs eagerly, loudly (one warning, `unit_report(model)`), and its
children are compiled instead (`fallback=True`): data-dependent shapes (MoE routing counts), `autograd.Function`s
other than the bridge's (their backward would be lost from a recorded forward), tensor hooks, in-place writes into
inputs that require grad, changes of Python state during the forward, non-constant Python arguments.
"""
from __future__ import annotations

import functools
import traceback
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .dispatch.lowering import is_lowering, lowering
from .dtensor.autograd import wrap_local
from .dtensor.dtensor import DTensor, make_dtensor
from .redistribute import check as _check

__all__ = ["compile", "explain", "unit_report", "LoweringError"]


class LoweringError(RuntimeError):
    """A unit's forward cannot be traced into one graph of local ops (the unit then runs eagerly)."""


# Python values a graph may bake in: they are part of the key, so another value traces again.
_CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)
_UNKEYABLE = object()
_DisableTF = torch._C.DisableTorchFunctionSubclass
# Call signatures a unit lowers at most (as dynamo's recompile limit): more means shapes that vary from call to
# call (tokens routed to an expert), where compiling every shape would cost more than it saves.
MAX_SIGNATURES = 8
_EAGER = object()  # an entry for a key the unit runs eagerly


@dataclass
class _Settings:
    backend: Any
    mode: str | None
    options: dict | None
    fallback: bool
    compiled: dict = field(default_factory=dict)   # graph and inputs -> compiled function, shared by units

    def compiled_fn(self, gm: torch.fx.GraphModule, inputs: list) -> Callable:
        """The graph compiled by the torch.compile backend, called directly: the graph is already whole (dynamo
        would find nothing to split) and the unit's key guards what the backend specialised on, so dynamo's
        frame evaluation and guards (tens of microseconds a call) are left out. Units with the same graph and
        inputs (the layers of a model) share one compiled function."""
        key = (gm.code, _constants_fingerprint(gm), torch.is_grad_enabled(),
               tuple([(t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in inputs]))
        fn = self.compiled.get(key)
        if fn is None:
            backend = self.backend
            if backend == "inductor":
                from torch._inductor import list_mode_options
                from torch._inductor.compile_fx import compile_fx
                patches = {**(list_mode_options(self.mode, False) if self.mode else {}), **(self.options or {})}
                fn = compile_fx(gm, inputs, config_patches=patches)
            else:
                if self.mode is not None or self.options:
                    raise ValueError(f"hyper_parallel.compile: mode and options are inductor's; backend {backend!r} "
                                     f"takes neither")
                fn = torch._dynamo.lookup_backend(backend)(gm, inputs) if isinstance(backend, str) \
                    else backend(gm, inputs)
            self.compiled[key] = fn
        return fn


def compile(model: nn.Module, *, units: str | Callable | Iterable[nn.Module] = "layers", backend="inductor",
            mode: str | None = None, options: dict | None = None, fallback: bool = True) -> nn.Module:
    """Compile `model`'s units in place (each unit's forward becomes one compiled graph) and return `model`.

    units: "layers" (default): the decoder layers, i.e. modules whose class is in the model's `_no_split_modules`
    (Hugging Face), else the blocks of its largest `nn.ModuleList`, else the whole model; "model": the whole
    forward as one unit; a callable `(name, module) -> bool`; or the modules themselves. Units do not nest
    (the outermost match wins). backend / mode / options: as for `torch.compile`. fallback: a unit that cannot
    be traced into one graph has its children compiled instead (it runs eagerly either way, with a warning).

    Works the same on plain tensors and DTensors of any layout (shard, hsdp, expert/context parallel), on every
    rank of the mesh; every rank must call the same units with the same layouts, as eagerly.
    """
    settings = _Settings(backend, mode, options, fallback)
    for name, module in _select_units(model, units):
        _install(module, name, settings)
    return model


def explain(module: nn.Module, *args, **kwargs):
    """`torch._dynamo.explain` of the graph `hp.compile` makes of `module(*args, **kwargs)`'s forward (graphs,
    graph breaks, ops): how a unit compiles. Raises LoweringError, with the reason, when the forward cannot be
    traced into one graph (`hp.compile` would then run it eagerly and compile its children). It runs the graph,
    collectives included: call it on every rank of the mesh."""
    unit = _Unit(module, "", _Settings("eager", None, None, False))
    leaves: list = []
    structure = _flatten((args, kwargs), leaves)
    bad = [type(x).__name__ for x in leaves if _leaf_key(x) is _UNKEYABLE]
    if bad:
        raise LoweringError(f"an argument of type {bad[0]} (not a tensor or a constant) is passed")
    state = unit._state()
    grad = torch.is_grad_enabled()
    try:
        gm, tensor_leaves, _, _ = unit.trace(leaves, structure, state, grad)
    except LoweringError:
        raise
    except Exception as e:
        raise LoweringError(_describe(e)) from e
    inputs = state + [leaves[i] for i in tensor_leaves]
    return torch._dynamo.explain(gm)(*_graph_inputs(inputs, grad))


def unit_report(model: nn.Module) -> list[dict]:
    """Per compiled unit (in module order): its name, graphs lowered (one per call signature), and why it or a
    call signature ran eagerly (empty when everything compiled)."""
    out = []
    for name, module in model.named_modules():
        unit = module.__dict__.get("forward")
        unit = getattr(unit, "_hp_unit", None)
        if unit is not None:
            out.append({"name": name or type(model).__name__, "graphs": len(unit.graphs()),
                        "eager": list(unit.reasons)})
    return out


# ---- choosing units ---------------------------------------------------------------------------------------
def _select_units(model: nn.Module, units) -> list[tuple[str, nn.Module]]:
    if units == "model":
        return [("", model)]
    if units == "layers":
        names = set(getattr(model, "_no_split_modules", None) or ())
        pick = (lambda n, m: type(m).__name__ in names) if names else None
        if pick is None:
            lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
            if not lists:
                return [("", model)]
            blocks = {id(b) for b in max(lists, key=len)}
            pick = lambda n, m: id(m) in blocks  # noqa: E731
    elif callable(units):
        pick = units
    else:
        wanted = {id(m) for m in units}
        pick = lambda n, m: id(m) in wanted  # noqa: E731
    chosen: list = []
    for name, module in model.named_modules():
        if any(name.startswith(c + ".") or c == "" for c, _ in chosen):
            continue  # inside a unit already chosen
        if pick(name, module):
            chosen.append((name, module))
    if not chosen:
        raise ValueError(f"hyper_parallel.compile: no module of {type(model).__name__} matches units={units!r}; "
                         f"pass units='model' to compile the whole forward as one unit")
    return chosen


def _install(module: nn.Module, name: str, settings: _Settings) -> None:
    current = module.__dict__.get("forward")
    if getattr(current, "_hp_unit", None) is not None:
        return
    unit = _Unit(module, name, settings)

    @functools.wraps(unit.original)
    def forward(*args, **kwargs):
        return unit(args, kwargs)

    forward._hp_unit = unit
    module.forward = forward


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}{'' if isinstance(e, LoweringError) else _where(e)}"


def _where(e: BaseException) -> str:
    """' at file:line' of the innermost frame outside torch where `e` was raised (the model's or ours)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f"{os.sep}torch{os.sep}" not in f.filename
              and not f.filename.endswith(f"hyper_parallel{os.sep}compiler.py") and not f.filename.startswith("<")]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _parts(module: nn.Module, name: str) -> list:
    """The children to compile instead of `module`: those holding parameters (a module without any, an
    activation say, is a few ops that a graph call would not make cheaper), containers looked through."""
    out = []
    for cname, child in module.named_children():
        full = f"{name}.{cname}"
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):  # never called: their members are
            out += _parts(child, full)
        elif any(True for _ in child.parameters()):
            out.append((full, child))
    return out


# ---- flattening arguments and results ---------------------------------------------------------------------
def _flatten(obj, leaves: list, containers: bool = False):
    """A hashable structure of `obj` (tuples, lists, dicts; with `containers`, any pytree container, as a result
    may be a `ModelOutput`), its leaves appended to `leaves`. An argument of another type is a leaf: a container
    the forward could change in place (a cache object) must not be rebuilt for the trace, whose changes would be
    lost; as a leaf it is refused (neither a tensor nor a constant)."""
    t = type(obj)
    if t is tuple or t is list:
        return (t, tuple([_flatten(x, leaves, containers) for x in obj]))
    if t is dict:
        return (dict, tuple(obj), tuple([_flatten(v, leaves, containers) for v in obj.values()]))
    if containers and t in pytree.SUPPORTED_NODES and not isinstance(obj, Tensor):
        sub, spec = pytree.tree_flatten(obj)
        leaves.extend(sub)
        return ("pytree", spec, len(sub))
    leaves.append(obj)
    return None


def _unflatten(structure, it):
    if structure is None:
        return next(it)
    kind = structure[0]
    if kind is tuple or kind is list:
        return kind([_unflatten(s, it) for s in structure[1]])
    if kind is dict:
        return {k: _unflatten(s, it) for k, s in zip(structure[1], structure[2])}
    return pytree.tree_unflatten([next(it) for _ in range(structure[2])], structure[1])


def _leaf_key(x):
    t = type(x)
    if t is DTensor:
        local = x._local
        return (x._layout, x._shape, local.dtype, local.stride(), x.requires_grad)
    if isinstance(x, Tensor):
        return (t, x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
    if t in _CONSTANT_TYPES:
        return (t, x)
    return _UNKEYABLE


class _Enter(torch.autograd.Function):
    """The locals of the DTensors entering a compiled graph whose gradients must come back to the DTensors (leaf
    parameters, pending sums): `Unwrap`'s forward and backward for all of them in one node instead of one each.
    The graph hands each gradient back laid out as `grad_target(layout)`, so nothing moves here."""

    @staticmethod
    def forward(ctx, *dts):
        ctx.set_materialize_grads(False)  # an unused parameter keeps grad None, as eagerly
        ctx.specs = [(t._layout.without_partial(), t._shape) for t in dts]
        return tuple([t._local.detach() for t in dts])

    @staticmethod
    def backward(ctx, *grads):
        return tuple([None if g is None else make_dtensor(g, layout, shape)
                      for g, (layout, shape) in zip(grads, ctx.specs)])


_enter = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Enter)  # without Function.apply's preamble


def _graph_inputs(inputs: list, grad: bool) -> list:
    """What the graph takes for each input tensor: a DTensor's local, connected to it for autograd where the
    gradient must reach the DTensor itself (through one `_Enter` node), a plain tensor as it is."""
    locs = []
    entering = None
    for i, t in enumerate(inputs):
        if type(t) is DTensor:
            local = t._local
            if grad and t.requires_grad and not (local.requires_grad and not t._layout.has_partial):
                entering = [i] if entering is None else entering + [i]
            locs.append(local)
        else:
            locs.append(t)
    if entering is not None:
        for i, local in zip(entering, _enter(*[inputs[i] for i in entering])):
            locs[i] = local
    return locs


def _constants_fingerprint(gm: torch.fx.GraphModule) -> tuple:
    out = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            if isinstance(value, Tensor):
                raw = value.detach().contiguous().reshape(-1).view(torch.uint8) if value.numel() else value
                out.append((node.target, tuple(value.shape), value.dtype, bytes(raw.numpy()) if value.numel() else b""))
            else:
                out.append((node.target, id(value)))
    return tuple(out)


# ---- what a trace must not do ------------------------------------------------------------------------------
_REFUSED = {
    Tensor.register_hook: "a tensor hook", Tensor.retain_grad: "retain_grad()",
    Tensor.register_post_accumulate_grad_hook: "a post-accumulate-grad hook",
    torch.autograd.grad: "torch.autograd.grad", torch.autograd.backward: "a backward pass",
    Tensor.backward: "a backward pass",
}


class _RefuseInTrace(TorchFunctionMode):
    """Hooks registered on (and backward passes through) traced tensors would be lost from a graph."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = _REFUSED.get(func)
        if what is not None:
            raise LoweringError(f"the forward registers {what} on an intermediate tensor, which a compiled graph "
                                f"would not keep")
        return func(*args, **(kwargs or {}))


def _foreign_function(outputs) -> str | None:
    """The name of an `autograd.Function` (other than the bridge's custom op) in the traced outputs' history:
    a recorded forward keeps only its forward ops, so its own backward would be lost."""
    seen = set()
    stack = [o.grad_fn for o in outputs if isinstance(o, Tensor) and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and "hyper_parallel_redistribute" not in cls.__name__:
            return f"{cls.__module__}.{cls.__qualname__}"
        stack.extend(n for n, _ in node.next_functions)
    return None


# Module hooks that communicate and swap parameters (hsdp's gather/reduce): they must run eagerly around a
# compiled forward, so they may sit on a unit itself (outside its graph) but not on a module inside one.
_HOOKS_OUTSIDE_GRAPH = ("hyper_parallel.parallel.hsdp",)


def _refuse_hooks_outside_graph(unit: nn.Module) -> None:
    for name, m in unit.named_modules():
        if not name:
            continue
        for hook in list(m._forward_pre_hooks.values()) + list(m._forward_hooks.values()):
            where = getattr(getattr(hook, "__func__", hook), "__module__", "") or ""
            if where.startswith(_HOOKS_OUTSIDE_GRAPH):
                raise LoweringError(f"{name} has hooks of {where} (gathers, reductions), which must run eagerly "
                                    f"around a compiled forward: compile units that carry them (hsdp's units are "
                                    f"the decoder layers: units='layers')")


def _python_state(modules: list) -> list:
    return [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in modules]


def _same(a, b) -> bool:
    return a is b or (type(a) in _CONSTANT_TYPES and type(a) is type(b) and a == b)


def _restore_python_state(saved: list) -> str | None:
    """Put every module's attributes back as they were before the trace (the trace swapped parameters in and
    may have assigned attributes); say which attribute or submodule the forward itself changed, if any."""
    changed = None
    for m, attrs, params, buffers, children in saved:
        for now, before in ((m.__dict__, attrs), (m._modules, children)):
            if changed is None:
                diff = sorted(k for k in set(now) | set(before)
                              if k not in now or k not in before or not _same(now[k], before[k]))
                if diff:
                    changed = f"{type(m).__name__}.{diff[0]}"
        m.__dict__.clear()
        m.__dict__.update(attrs)
        for live, before in ((m._parameters, params), (m._buffers, buffers), (m._modules, children)):
            live.clear()
            live.update(before)
    return changed


# ---- a unit ------------------------------------------------------------------------------------------------
@dataclass
class _Entry:
    """One lowered call signature: the compiled graph and how to rebuild the unit's result from its outputs."""

    fn: Callable
    gm: torch.fx.GraphModule
    tensor_leaves: list          # positions among the argument leaves of the tensors the graph takes
    out_structure: Any
    out_specs: list              # per result leaf: ("D", layout, shape) | ("T",) | ("I", input index) | ("C", value)


class _Unit:
    def __init__(self, module: nn.Module, name: str, settings: _Settings):
        self.module = module
        self.name = name or type(module).__name__
        self.settings = settings
        installed = getattr(module.forward, "_hp_unit", None)  # explain() of a compiled unit: its own forward
        self.original = installed.original if installed is not None else module.forward
        self.modules = list(module.modules())
        self.entries: dict = {}
        self.reasons: list = []
        self.children_compiled = False

    def graphs(self) -> list:
        return [e.gm for e in self.entries.values() if e is not _EAGER]

    # ---- per call ----------------------------------------------------------------------------------
    def _state(self) -> list:
        """Parameters and buffers the forward reads (as registered now: hsdp swaps its compute parameters in)."""
        state = []
        for m in self.modules:
            for p in m._parameters.values():
                if p is not None:
                    state.append(p)
            for b in m._buffers.values():
                if b is not None:
                    state.append(b)
        return state

    def __call__(self, args: tuple, kwargs: dict):
        if (is_lowering() or torch.compiler.is_compiling() or _check.CHECK[0]
                or torch._C._are_functorch_transforms_active()):
            return self.original(*args, **kwargs)  # inside an enclosing unit's trace, check mode, transforms
        leaves: list = []
        structure = _flatten((args, kwargs), leaves)
        state = self._state()
        grad = torch.is_grad_enabled()
        with _DisableTF():  # the wrappers' own requires_grad, read without a __torch_function__ round trip
            keys = [_leaf_key(x) for x in leaves]
            state_keys = tuple([_leaf_key(t) for t in state])
        if _UNKEYABLE in keys:
            bad = type(leaves[keys.index(_UNKEYABLE)]).__name__
            self._note(f"an argument of type {bad} (not a tensor or a constant) is passed")
            return self.original(*args, **kwargs)
        key = (structure, tuple(keys), state_keys, grad, torch.is_autocast_enabled(),
               tuple([m.training for m in self.modules]))
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= MAX_SIGNATURES:
                self._note(f"it was called with more than {MAX_SIGNATURES} different signatures (argument "
                           f"shapes, layouts or constants): new ones run eagerly", children=False)
                return self.original(*args, **kwargs)
            entry = self.entries[key] = self._lower(args, kwargs, leaves, structure, state, grad)
        if entry is _EAGER:
            return self.original(*args, **kwargs)
        inputs = state + [leaves[i] for i in entry.tensor_leaves]
        outs = entry.fn(*_graph_inputs(inputs, grad))
        it = iter(outs)
        result = []
        for spec in entry.out_specs:
            kind = spec[0]
            if kind == "D":
                o = next(it)
                result.append(wrap_local(o, spec[1], spec[2]) if grad and o.requires_grad
                              else make_dtensor(o, spec[1], spec[2]))
            elif kind == "T":
                result.append(next(it))
            elif kind == "I":
                result.append(inputs[spec[1]])
            else:
                result.append(spec[1])
        return _unflatten(entry.out_structure, iter(result))

    def _note(self, reason: str, children: bool = True) -> None:
        if reason in self.reasons:
            return
        self.reasons.append(reason)
        also = ""
        if children and self.settings.fallback and not self.children_compiled:
            self.children_compiled = True
            parts = _parts(self.module, self.name)
            for name, part in parts:
                _install(part, name, self.settings)
            if parts:
                also = "; its submodules are compiled separately"
        warnings.warn(f"hyper_parallel.compile: {self.name} ({type(self.module).__name__}) runs eagerly: "
                      f"{reason}{also}", stacklevel=4)

    # ---- lowering ----------------------------------------------------------------------------------
    def _lower(self, args, kwargs, leaves, structure, state, grad):
        try:
            gm, tensor_leaves, out_structure, out_specs = self.trace(leaves, structure, state, grad)
        except Exception as e:  # any failure to trace: the unit runs eagerly, which raises real errors itself
            self._note(f"it cannot be traced into one graph ({_describe(e)})")
            return _EAGER
        inputs = _graph_inputs(state + [leaves[i] for i in tensor_leaves], grad)
        try:
            fn = self.settings.compiled_fn(gm, inputs)
        except Exception as e:
            self._note(f"the backend failed to compile its graph ({_describe(e)})", children=False)
            return _EAGER
        return _Entry(fn, gm, tensor_leaves, out_structure, out_specs)

    def trace(self, leaves: list, structure, state: list, grad: bool) -> tuple:
        """The unit's forward on these arguments as a graph of local ops: (graph, positions of the tensor leaves it
        takes after the state, result structure, result specs). Raises LoweringError (or the tracer's error)."""
        from torch.fx.experimental.proxy_tensor import make_fx
        _refuse_hooks_outside_graph(self.module)
        tensor_leaves = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        inputs = state + [leaves[i] for i in tensor_leaves]
        n_state = len(state)
        slots = [(m, d, k) for m in self.modules for d in (m._parameters, m._buffers) for k, v in d.items()
                 if v is not None]

        def example(t):
            local = (t._local if type(t) is DTensor else t).detach()
            if grad and t.requires_grad and local.is_floating_point():
                local.requires_grad_(True)
            return local

        found: dict = {}

        def traced(*locs):
            found["versions"] = [loc._version for loc in locs]
            rebuilt = [make_dtensor(loc, t._layout, t._shape, loc.requires_grad) if type(t) is DTensor else loc
                       for loc, t in zip(locs, inputs)]
            for (m, d, k), v in zip(slots, rebuilt[:n_state]):
                d[k] = v
            arg_leaves = list(leaves)
            for i, v in zip(tensor_leaves, rebuilt[n_state:]):
                arg_leaves[i] = v
            args, kwargs = _unflatten(structure, iter(arg_leaves))
            with torch.set_grad_enabled(grad):
                out = self.original(*args, **kwargs)
            again: list = []
            if _flatten((args, kwargs), again) != structure or any(a is not b for a, b in zip(again, arg_leaves)):
                raise LoweringError("the forward changes a list or dict it was given, which the compiled graph "
                                    "would not do to the caller's")
            out_leaves: list = []
            found["structure"] = _flatten(out, out_leaves, containers=True)
            specs, result = [], []
            for o in out_leaves:
                if type(o) is DTensor and o.grad_fn is not None:  # see traceable.local_input
                    raise LoweringError(f"the forward returns a DTensor made by {type(o.grad_fn).__name__} (an "
                                        f"autograd.Function applied to DTensors), whose backward a recorded forward "
                                        f"would lose")
                same = next((k for k, r in enumerate(rebuilt) if o is r), None)
                if same is not None:
                    specs.append(("I", same))
                elif type(o) is DTensor:
                    specs.append(("D", o._layout, o._shape))
                    result.append(o._local)
                elif isinstance(o, Tensor):
                    specs.append(("T",))
                    result.append(o)
                else:
                    specs.append(("C", o))
            found.update(specs=specs, result=result, rebuilt=rebuilt, locs=locs)
            return result

        examples = [example(t) for t in inputs]
        saved = _python_state(self.modules)
        compiling = torch.compiler._is_compiling_flag
        # what torch.export's make_fx tracing says too: model code then skips its data-dependent shortcuts (a mask
        # left out when it is all ones), which a graph cannot take, exactly as under torch.compile
        torch.compiler._is_compiling_flag = True
        try:
            with lowering(), _RefuseInTrace():
                gm = make_fx(traced, tracing_mode="fake", _allow_non_fake_inputs=False)(*examples)
        finally:
            torch.compiler._is_compiling_flag = compiling
            changed = _restore_python_state(saved)
        if changed is not None:
            raise LoweringError(f"the forward changes Python state ({changed}), which a compiled graph would not")
        for k, (w, loc, v) in enumerate(zip(found["rebuilt"], found["locs"], found["versions"])):
            if type(w) is DTensor and w._local is not loc:
                raise LoweringError(f"an in-place op replaces the local tensor of input {k}")
            if loc.requires_grad and loc._version != v:
                raise LoweringError(f"the forward writes in place into input {k}, which requires grad")
        foreign = _foreign_function(found["result"])
        if foreign is not None:
            raise LoweringError(f"autograd.Function {foreign} runs inside the forward (a recorded forward would "
                                f"lose its backward)")
        for spec in found["specs"]:
            if spec[0] == "C" and type(spec[1]) not in _CONSTANT_TYPES:
                raise LoweringError(f"the forward returns a {type(spec[1]).__name__}, which a graph cannot rebuild")
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm, tensor_leaves, found["structure"], found["specs"]
