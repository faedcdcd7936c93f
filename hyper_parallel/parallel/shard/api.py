"""shard(): lay out a model's parameters as DTensors from a plan and move module inputs/outputs by hooks.

Because DTensor gives single-device semantics, the model's own code runs unchanged; the plan only
chooses layouts so that the op rules produce Megatron-style communication: column-parallel
projections leave activations split on their last dim, row-parallel ones leave a pending sum that
the module's output hook reduces once. Reading order: `shard` -> `_resolve` -> `_lay_out_parameters`
-> `_install_boundaries` -> `_install_experts`.
"""
from __future__ import annotations

import inspect
import re
import warnings
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...dtensor.autograd import Wrap, local_input
from ...dtensor.dtensor import DTensor, make_dtensor
from ...layout.layout import Layout, PlacementLayout, replicate_layout
from ...layout.mesh import DeviceMesh, ensure_process_group, get_mesh
from .. import feed
from ..dims import TP, ParallelDims
from ..surgery import (bind_save_pretrained, distribute_parameter, embeddings, lay_out_parameters, move,
                       record_applied, refuse_foreign_dtensors, replicated_elsewhere, local_experts)
from .plan import (Boundary, Resolved, ShardingPlan, auto_plan, check_heads, replicate_below,
                   resolve_sharding_plan, resolve_styles, tp_size)
from .structure import structure_plan


def shard(model: nn.Module, plan: Any, mesh: DeviceMesh | Layout | None = None, *,
          src_data_rank: int | None = 0) -> nn.Module:
    """Tensor-parallelise `model` in place and return it (also on one rank).

    Every parameter becomes an nn.Parameter(DTensor) holding only its shard (unplanned ones are
    replicated, so their gradients are summed wherever the computation using them is split); module
    inputs and outputs named by the plan are moved by forward pre-hooks and hooks.
    `plan`: a `ShardingPlan`, a Hugging Face style dict (path -> style name), a dict of path -> layout
    spec (taken as `ShardingPlan(plan=...)`), or "auto" (the model's own tp_plan).
    `mesh`: the device mesh (or a Layout whose mesh to use); by default a 1-D mesh named "tp" over all
    ranks. Style plans use the mesh's "tp" axis. `src_data_rank`: parameters are first broadcast
    from coordinate 0 of the mesh (as torch does) so that ranks that built different random weights
    agree; None skips it (every rank already holds the same weights, or they are on the meta device).
    """
    refuse_foreign_dtensors(model, "shard")
    return tensor_parallel(model, plan, mesh, src_data_rank=src_data_rank)


def tensor_parallel(model: nn.Module, plan: Any, mesh: DeviceMesh | Layout | None, *,
                    src_data_rank: int | None = 0, leave: tuple = ()) -> nn.Module:
    """`shard`'s body; `leave`: module names another parallelism owns (expert parallel's experts modules),
    whose plan entries are dropped: their parameters stay replicated for that parallelism to lay out."""
    mesh, tp_mesh = _resolve_mesh(plan, mesh)
    res = _resolve(model, plan, mesh, tp_mesh)
    for name in leave:
        replicate_below(res, name)
    _lay_out_parameters(model, res, src_data_rank)
    _install_boundaries(model, res)
    _install_experts(model, res)
    tp_axes = (TP,) if TP in mesh.mesh_dim_names else mesh.mesh_dim_names if mesh.ndim == 1 else ()
    feed.register(model, tp_mesh or mesh, same_feed=tp_axes)
    _report(model, plan, tp_mesh or mesh)
    bind_save_pretrained(model)
    return model


def shard_module(model: nn.Module, mesh: DeviceMesh | Layout | None, plan: Any, *,
                 src_data_rank: int | None = 0) -> nn.Module:
    """`shard` with torch's argument order (`parallelize_module(module, mesh, plan)`)."""
    return shard(model, plan, mesh, src_data_rank=src_data_rank)


def _report(model: nn.Module, plan: Any, mesh: DeviceMesh) -> None:
    """Record what was split (for `summary` and the INFO log) and warn when the plan had little effect."""
    params = dict(model.named_parameters())
    split = [n for n, p in params.items() if isinstance(p, DTensor) and p.dist_layout.sharded_axes]
    axes = "x".join(f"{a!r}" for a in mesh.mesh_dim_names)
    ways = tp_size(mesh) if TP in mesh.mesh_dim_names else mesh.size()
    found = model.__dict__.pop("_hp_structure_entries", 0)
    by_structure = f" (+{found} module entries found by structure)" if found else ""
    notes = list(dict.fromkeys(re.sub(r"\.\d+(?=\.|:)", ".*", n) for n in model.__dict__.get("_hp_tp_notes", [])))
    kept = f"; notes: {'; '.join(notes)}" if notes else ""
    record_applied(model, f"tp: {len(split)} of {len(params)} parameters split over {axes} "
                          f"({ways}-way), plan {plan if isinstance(plan, str) else type(plan).__name__}"
                          f"{by_structure}{kept}")
    ends = set()
    for which in ("input", "output"):
        module = embeddings(model, which)
        if module is not None and getattr(module, "weight", None) is not None:
            ends.add(id(module.weight))
    if ways > 1 and not split:
        warnings.warn(f"shard: the plan split no parameter of {type(model).__name__}: every rank holds and "
                      f"computes the whole model; give a plan that names its projections", stacklevel=3)
    elif ways > 1 and all(id(params[n]) in ends for n in split):
        warnings.warn(f"shard: the plan splits only the embedding and the head of {type(model).__name__} "
                      f"(that is all its tp_plan holds): the layers run replicated on every rank; give a plan "
                      f"for the layers' projections (ShardingPlan or a style dict) to split them", stacklevel=3)


# ---- mesh and plan ------------------------------------------------------------------------------
def _resolve_mesh(plan, mesh):
    if isinstance(mesh, (Layout, PlacementLayout)):
        mesh = mesh.mesh
    if mesh is None:
        mesh = _mesh_in_plan(plan)
    if mesh is None:
        world = dist.get_world_size() if ensure_process_group() else 1
        mesh = get_mesh((world,), (TP,))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"shard: mesh must be a DeviceMesh or a Layout, got {type(mesh).__name__}")
    if TP in mesh.mesh_dim_names:
        tp_mesh = ParallelDims.of(mesh, "shard", allow_other_axes=True).model_mesh
    elif mesh.ndim == 1:
        tp_mesh = mesh  # any 1-D mesh is the tensor-parallel axis, as for torch's parallelize_module
    else:
        tp_mesh = None
    return mesh, tp_mesh


def _mesh_in_plan(plan):
    if isinstance(plan, ShardingPlan):
        for group in (plan.plan, plan.input_plan, plan.output_plan):
            for spec in (group or {}).values():
                for s in (spec.values() if isinstance(spec, dict) else spec if isinstance(spec, list) else [spec]):
                    if isinstance(s, (Layout, PlacementLayout)):
                        return s.mesh
    return None


def _resolve(model: nn.Module, plan: Any, mesh: DeviceMesh, tp_mesh) -> Resolved:
    notes: list[str] = []
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(f"shard: plan must be a ShardingPlan, a dict or 'auto', got {plan!r}")
        plan, strict = auto_plan(model), False
        if tp_mesh is not None:
            found = structure_plan(model, tp_size(tp_mesh), plan)
            plan = {**found.styles, **plan}
            notes += [f"{path or '<root>'}: {why}" for path, why in found.notes.items()]
            model.__dict__["_hp_structure_entries"] = len(found.styles)
        if not plan:
            raise ValueError(f"plan='auto': {type(model).__name__} declares no tensor-parallel plan "
                             f"(config.base_model_tp_plan / _tp_plan) and no module of it looks like an attention "
                             f"or an MLP (q/k/v/o or up/down projections); pass a plan")
    else:
        strict = True
    if isinstance(plan, Mapping) and plan and all(isinstance(v, str) for v in plan.values()):
        if tp_mesh is None:
            raise ValueError(f"shard: a style plan needs a mesh axis named 'tp'; the mesh has axes "
                             f"{mesh.mesh_dim_names}")
        res = resolve_styles(model, plan, tp_mesh, strict)
    elif isinstance(plan, Mapping):
        res = resolve_sharding_plan(model, ShardingPlan(plan=plan), mesh, tp_mesh)
    elif isinstance(plan, ShardingPlan):
        res = resolve_sharding_plan(model, plan, mesh, tp_mesh)
    else:
        raise TypeError(f"shard: plan must be a ShardingPlan, a dict or 'auto', got {type(plan).__name__}")
    notes += res.notes + check_heads(model, res, strict)
    model.__dict__["_hp_tp_notes"] = notes
    return res


# ---- parameters ----------------------------------------------------------------------------------
def _lay_out_parameters(model: nn.Module, res: Resolved, src_data_rank: int | None) -> None:
    """Every parameter becomes nn.Parameter(DTensor): planned ones split, the rest replicated.

    Replicated ones matter too: their gradients are then summed over the ranks wherever the
    computation using them is split (e.g. Qwen3's per-head q_norm), with no special style.
    """
    def layout_of(name: str, p: nn.Parameter):
        planned = res.params.get(name)
        return planned(p.ndim) if planned is not None else None

    lay_out_parameters(model, layout_of, default=replicated_elsewhere(res.mesh), src_data_rank=src_data_rank,
                       where="shard")


# ---- module boundaries --------------------------------------------------------------------------
def _install_boundaries(model: nn.Module, res: Resolved) -> None:
    modules = dict(model.named_modules())
    for name, boundary in res.inputs.items():
        modules[name].register_forward_pre_hook(_input_hook(boundary, name or "<root>"), with_kwargs=True)
    for name, boundary in res.outputs.items():
        modules[name].register_forward_hook(_output_hook(boundary, name or "<root>"))


def _input_hook(b: Boundary, where: str):
    def hook(module, args, kwargs):
        args = list(args)
        if b.first is not None:
            if args and isinstance(args[0], Tensor):
                args[0] = move(args[0], b.first, f"input of {where}")
            else:
                for k, v in kwargs.items():
                    if isinstance(v, Tensor):
                        kwargs[k] = move(v, b.first, f"input {k!r} of {where}")
                        break
        for i, fn in b.positional.items():
            if i < len(args) and isinstance(args[i], Tensor):
                args[i] = move(args[i], fn, f"input {i} of {where}")
        for k, fn in b.named.items():
            if isinstance(kwargs.get(k), Tensor):
                kwargs[k] = move(kwargs[k], fn, f"input {k!r} of {where}")
        return tuple(args), kwargs
    return hook


def _output_hook(b: Boundary, where: str):
    def out_one(t, fn, label):
        if fn is not None:
            t = move(t, fn, f"output {label}of {where}")
        if isinstance(t, DTensor) and (b.local or (b.local_if_replicated and t.dist_layout.is_replicate)):
            t = t.to_local()
        return t

    def hook(module, args, output):
        if isinstance(output, Tensor):
            return out_one(output, b.first, "")
        if isinstance(output, (tuple, list)):
            items = list(output)
            first_done = b.first is None
            for i, v in enumerate(items):
                if not isinstance(v, Tensor):
                    continue
                fn = b.positional.get(i)
                if fn is None and not first_done:
                    fn, first_done = b.first, True
                items[i] = out_one(v, fn, f"{i} ")
            return type(output)(items) if type(output) in (tuple, list) else type(output)(*items)
        if isinstance(output, Mapping):
            for k in list(output.keys()):
                v = output[k]
                if isinstance(v, Tensor) and (k in b.named or b.local):
                    output[k] = out_one(v, b.named.get(k), f"{k!r} ")
            return output
        return output
    return hook


# ---- MoE experts: whole experts per rank, run locally -----------------------------------------------
def _install_experts(model: nn.Module, res: Resolved) -> None:
    modules = dict(model.named_modules())
    for name in res.experts:
        module = modules[name]
        module.forward = _experts_forward(module, module.forward, name)
        module.__dict__["_hp_experts_split"] = TP


def _experts_forward(module: nn.Module, original, where: str):
    """Each rank holds a contiguous block of experts (Shard(0)) and runs only the routes that reach them.

    Routes to other ranks' experts get the out-of-range id `n_local` (which the transformers experts
    code skips) and weight 0; the local outputs are partial sums, reduced by one all-reduce. The
    shared inputs (hidden states, routing weights) get Partial gradient layouts, since each rank
    back-propagates through its own experts only.
    """
    sig = inspect.signature(original)

    def forward(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        names = list(bound.arguments)
        hidden_name, index_name, weight_name = (names + [None, None, None])[:3]
        params = {pn: p for pn, p in module._parameters.items() if p is not None}
        some = next(iter(params.values()))
        mesh = some.device_mesh
        if index_name is None:
            return _grouped_experts(original, bound, hidden_name, mesh, where)
        axis = some.dist_layout.sharded_axes[0] if some.dist_layout.sharded_axes else None
        hidden = _local_input(bound.arguments[hidden_name], mesh, axis)
        n_total = some.shape[0]
        offset = some.dist_layout.local_offset(some.shape)[0]
        n_local = some._local.shape[0]
        index = bound.arguments[index_name]
        index = index.full_tensor() if isinstance(index, DTensor) else index
        off = (index < offset) | (index >= offset + n_local)
        bound.arguments[index_name] = torch.where(off, torch.full_like(index, n_local), index - offset)
        if weight_name is not None:
            weights = _local_input(bound.arguments[weight_name], mesh, axis)
            bound.arguments[weight_name] = weights.masked_fill(off, 0)
        bound.arguments[hidden_name] = hidden
        locals_ = {pn: p.to_local() if isinstance(p, DTensor) else p for pn, p in params.items()}
        with local_experts(module, locals_, n_total, n_local, expert_parallel_flag=True):
            out = original(*bound.args, **bound.kwargs)
        rep = replicate_layout(mesh, out.ndim)
        partial = rep.with_partial(mesh.mesh_dim_names[axis]) if axis is not None else rep
        if torch.is_grad_enabled() and out.requires_grad:
            dt = Wrap.apply(out, partial, tuple(out.shape))
        else:
            dt = make_dtensor(out, partial, tuple(out.shape))
        return dt.redistribute(rep).to_local()

    return forward


def _grouped_experts(original, bound, hidden_name: str, mesh: DeviceMesh, where: str) -> Tensor:
    """Experts fed their rows already grouped expert by expert, with no routing ids (Llama 4's
    `experts(hidden)`: one [E, tokens, hidden] block, multiplied batch by batch with the [E, ...] weights): on
    DTensors the batched matmuls run each rank's own experts on its own block of rows, and the output's
    blocks are gathered once, handed on as the full local tensor the code after it expects."""
    replicated = lambda nd: replicate_layout(mesh, nd)  # noqa: E731
    bound.arguments[hidden_name] = move(bound.arguments[hidden_name], replicated, f"input of {where}")
    out = original(*bound.args, **bound.kwargs)
    if not isinstance(out, DTensor):
        raise TypeError(f"{where}: the experts module returned {type(out).__name__}, not one tensor; its "
                        f"forward takes no routing ids, so its experts run on DTensors and must return one")
    return move(out, replicated, f"output of {where}").to_local()


def _local_input(x: Tensor, mesh: DeviceMesh, axis) -> Tensor:
    """The full value of a shared input as a local tensor whose gradient is a partial sum over `axis`."""
    dt = move(x, lambda nd: replicate_layout(mesh, nd), "experts input")
    if not (torch.is_grad_enabled() and dt.requires_grad):
        return dt._local
    grad_layout = dt.dist_layout if axis is None else dt.dist_layout.with_partial(mesh.mesh_dim_names[axis])
    return local_input(dt, dt.dist_layout, grad_layout)
