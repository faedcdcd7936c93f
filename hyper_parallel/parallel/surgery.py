"""Model surgery shared by every parallelism: lay parameters out, swap local parameters in, move tensors.

Each parallelism's entry function decides *what* layout each parameter and input gets; this module is
*how* that is done to a transformers model, once for all of them:
- `registrations` / `lay_out_parameters`: every parameter, tied ones once (a tied embedding and head
  stay one Parameter object under every name), real or on the meta device, becomes an
  `nn.Parameter(DTensor)` holding only this rank's piece;
- `swapped_parameters`: a module's own forward run on other tensors than its registered parameters (the
  local block of an experts module; hsdp's unsharded compute parameters);
- `move`: a module input or output put into a layout (a plain tensor is the replicated value it holds);
- `record_applied`, `refuse_foreign_dtensors`, `bind_save_pretrained`: what every entry function does to
  the model besides laying it out.
The model's inputs are split by one forward pre-hook for all parallelisms (feed.py).
"""
from __future__ import annotations

import contextlib
import logging
import types
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..dtensor.dtensor import DTensor, make_dtensor
from ..layout.layout import Layout, replicate_layout
from ..layout.mesh import DeviceMesh
from ..redistribute import collectives
from ..redistribute.planner import redistribute_local

logger = logging.getLogger("hyper_parallel")

# (module, attribute name, full name) of every place one parameter is registered
Registration = tuple[nn.Module, str, str]


# ---- parameters --------------------------------------------------------------------------------------
def registrations(model: nn.Module) -> dict[int, tuple[nn.Parameter, list[Registration]]]:
    """id(param) -> (param, every (module, name, full name) it is registered under), in model order.

    Tied weights appear once with several registrations; a module reachable by two paths counts once."""
    out: dict = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is None:
                continue
            entry = out.setdefault(id(p), (p, []))
            if all(m is not module or n != name for m, n, _ in entry[1]):
                entry[1].append((module, name, f"{mname}.{name}" if mname else name))
    return out


LayoutOf = Callable[[str, nn.Parameter], "Layout | None"]


def lay_out_parameters(model: nn.Module, layout_of: LayoutOf, *, default: LayoutOf | None = None,
                       src_data_rank: int | None = 0, where: str = "parallelize") -> None:
    """Give every parameter the layout `layout_of(full name, param)` says, in place.

    A tied parameter asks once per name: the answers that are not None must agree (else a ValueError naming
    each), and the one new Parameter is registered under every name. Where every name answers None,
    `default(first name, param)` decides (None: left as it is). `src_data_rank`: see `distribute_parameter`.
    """
    for p, regs in registrations(model).values():
        wanted = {full: layout_of(full, p) for _, _, full in regs}
        chosen = {lay for lay in wanted.values() if lay is not None}
        if not chosen and default is not None:
            chosen = {default(regs[0][2], p)} - {None}
        if not chosen:
            continue
        if len(chosen) > 1:
            detail = ", ".join(f"{n} -> {lay.alias_entries()}" for n, lay in wanted.items() if lay is not None)
            raise ValueError(f"{where}: tied parameter planned with different layouts: {detail}")
        layout = chosen.pop()
        if isinstance(p, DTensor) and p.dist_layout is layout:
            continue
        new = distribute_parameter(p, layout, src_data_rank)
        for module, name, _ in regs:
            module._parameters[name] = new


def replicated_elsewhere(mesh: DeviceMesh) -> LayoutOf:
    """`layout_of` for parameters no parallelism split yet: replicated DTensors on `mesh`, so that their
    gradients are summed over the ranks wherever the computation using them is split."""
    return lambda name, p: None if isinstance(p, DTensor) else replicate_layout(mesh, p.ndim)


def distribute_parameter(p: Tensor, layout: Layout, src_data_rank: int | None = 0) -> nn.Parameter:
    """nn.Parameter(DTensor) holding this rank's piece of `p` (a meta `p` gives a meta piece).

    `src_data_rank`: a real full `p` is first broadcast from coordinate 0 of the mesh (as torch does), so
    that ranks that built different random weights agree; None skips it (every rank holds the same)."""
    if isinstance(p, DTensor):
        if p.device_mesh is not layout.mesh:
            raise ValueError(f"parameter already lives on mesh {p.device_mesh}; cannot move it to {layout.mesh}")
        with torch.no_grad():
            dt = p.detach().redistribute(layout)
        return nn.Parameter(dt, requires_grad=p.requires_grad)
    full = p.detach()
    shape = tuple(full.shape)
    if full.is_meta:
        local = torch.empty(layout.local_shape(shape), dtype=full.dtype, device="meta")
    else:
        if src_data_rank is not None and layout.mesh.distributed:
            full = _broadcast_from_first(full.contiguous(), layout.mesh)
        local = redistribute_local(full, replicate_layout(layout.mesh, full.ndim), layout, shape)
        if local is not full:
            local = local.clone(memory_format=torch.contiguous_format)  # own memory: the full tensor can go
    return nn.Parameter(make_dtensor(local, layout, shape), requires_grad=p.requires_grad)


def _broadcast_from_first(t: Tensor, mesh: DeviceMesh) -> Tensor:
    for axis in range(mesh.ndim):
        group = mesh.get_group(axis)
        if group is not None:
            t = collectives.broadcast(t, dist.get_global_rank(group, 0), group=group)
    return t


@contextlib.contextmanager
def swapped_parameters(module: nn.Module, replacement: dict[str, Tensor],
                       attributes: dict[str, Any] | None = None) -> Iterator[None]:
    """Run `module`'s own forward on `replacement` (name -> tensor) instead of its registered parameters, and
    with `attributes` set (only those the module already has); all are back afterwards, also on error."""
    saved = {name: module._parameters[name] for name in replacement}
    attributes = {k: v for k, v in (attributes or {}).items() if hasattr(module, k)}
    saved_attributes = {k: getattr(module, k) for k in attributes}
    module._parameters.update(replacement)
    for k, v in attributes.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        module._parameters.update(saved)
        for k, v in saved_attributes.items():
            setattr(module, k, v)


def local_experts(module: nn.Module, locals_: dict[str, Tensor], n_total: int, n_local: int,
                  expert_parallel_flag: bool = False):
    """`swapped_parameters` for a MoE experts module computing only its `n_local` local experts: the module's
    `num_experts` (when it counts all `n_total`) says `n_local`, and with `expert_parallel_flag` transformers'
    `_is_expert_parallel` is set, so that its kernels zero the rows routed to experts elsewhere."""
    attributes = {"num_experts": n_local} if getattr(module, "num_experts", None) == n_total else {}
    if expert_parallel_flag:
        attributes["_is_expert_parallel"] = True
    return swapped_parameters(module, locals_, attributes)


# ---- tensors at module boundaries -----------------------------------------------------------------
def move(x: Tensor, layout_fn: Callable[[int], Layout], where: str) -> DTensor:
    """`x` in the layout `layout_fn(x.ndim)`; a plain tensor is the replicated value it holds.

    A layout function carrying `tp_axis` and `placement` (a tensor-parallel style) moves only that axis
    of a DTensor and keeps its other axes' splits (a sequence split over "cp", a batch over "ep")."""
    layout = layout_fn(x.ndim)
    mesh = layout.mesh
    if isinstance(x, DTensor):
        if x.device_mesh is not mesh:
            raise ValueError(f"{where}: the tensor lives on mesh {x.device_mesh}, but the module is laid out "
                             f"on {mesh}; redistribute it onto that mesh first")
        tp_axis = getattr(layout_fn, "tp_axis", None)
        if tp_axis is not None:
            placements = list(x.dist_layout.placements)
            placements[tp_axis] = layout_fn.placement
            layout = Layout.from_placements(mesh, placements, x.ndim)
        return x if x.dist_layout is layout else x.redistribute(layout)
    dt = DTensor.from_local(x, replicate_layout(mesh, x.ndim))
    return dt if layout.is_replicate else dt.redistribute(layout)


# ---- what every entry function does besides laying out -----------------------------------------------
def embeddings(model: nn.Module, which: str) -> nn.Module | None:
    """The model's input (`which="input"`) or output embeddings, or None: transformers raises
    NotImplementedError for models that have none (a vision tower: Gemma4VisionModel, PPFormulaNet)."""
    getter = getattr(model, f"get_{which}_embeddings", None)
    if getter is None:
        return None
    try:
        return getter()
    except NotImplementedError:
        return None


def record_applied(model: nn.Module, text: str) -> None:
    """Note on the root module that a parallelism was applied (for `summary`), and log it at INFO."""
    model.__dict__.setdefault("_hp_applied", []).append(text)
    logger.info("hyper_parallel: %s", text)


def refuse_foreign_dtensors(model: nn.Module, where: str) -> None:
    """ValueError (on every rank: parameters are the same everywhere) if torch's DTensors are in the model:
    its weights are already split by another library whose process groups and ops ours do not know."""
    try:
        from torch.distributed.tensor import DTensor as TorchDTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return
    for name, p in model.named_parameters():
        if isinstance(p, TorchDTensor):
            raise ValueError(f"{where}: parameter {name!r} is a torch.distributed DTensor (the model was loaded "
                             f"with transformers' tp_plan=, or parallelized by torch). Load the folder with "
                             f"hyper_parallel.from_pretrained(path, mesh) instead, which reads each rank's "
                             f"slices straight into hyper_parallel's layouts")


# `hyper_parallel.pretrained` (above both parallel and checkpoint) registers the writer of Hugging Face
# folders here, so that a parallelized model's own `save_pretrained` reaches it without parallel/
# importing checkpoint/.
_EXPORTER: list = []


def set_exporter(save_pretrained: Callable) -> None:
    """Called once by `hyper_parallel.pretrained`: the function `model.save_pretrained(path)` is bound to."""
    _EXPORTER[:] = [save_pretrained]


def bind_save_pretrained(model: nn.Module) -> None:
    """`model.save_pretrained(path, ...)` -> `hyper_parallel.save_pretrained(model, path, ...)` (a collective:
    transformers' own would read the wrappers' storage and fail)."""
    if not hasattr(model, "config"):
        return

    def save_pretrained(self, save_directory, *, max_shard_size="50GB", **kwargs):
        return export(self, save_directory, max_shard_size=max_shard_size, **kwargs)

    model.save_pretrained = types.MethodType(save_pretrained, model)


def export(model, path, **kwargs) -> None:
    """`hyper_parallel.save_pretrained(model, path, **kwargs)`, as registered by `set_exporter`."""
    if not _EXPORTER:
        raise RuntimeError("save_pretrained: import hyper_parallel (not only hyper_parallel.parallel) first")
    return _EXPORTER[0](model, path, **kwargs)


__all__ = ["embeddings", "registrations", "lay_out_parameters", "replicated_elsewhere", "distribute_parameter",
           "swapped_parameters", "local_experts", "move", "record_applied", "refuse_foreign_dtensors", "bind_save_pretrained",
           "set_exporter", "export"]
