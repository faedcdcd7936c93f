"""`parallelize(model, mesh)`: every parallelism the mesh's axis names ask for, in the order that composes.

    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = hp.parallelize(model, mesh, hsdp={"optimizer_level": "level3"})
    print(hp.summary(model))

Order (torchtitan's): `shard` on "tp" (plan `tp`) -> `expert_parallel` on "ep" -> `context_parallel` on
"cp" (method `cp`) -> `hsdp(**hsdp)` on "dp". Each step records what it did on the model
(`model._hp_applied`), which `summary` prints with the per-group layouts and bytes per rank.
"""
from __future__ import annotations

import logging
import re
from typing import Any

from torch import nn

from ..dtensor.dtensor import DTensor
from ..layout.mesh import DeviceMesh
from ._model import refuse_foreign_dtensors

logger = logging.getLogger("hyper_parallel")


def parallelize(model: nn.Module, mesh: DeviceMesh, *, tp: Any = "auto", ep: bool = False, cp: str | None = None,
                hsdp: dict | None = None) -> nn.Module:
    """Apply, in place, every parallelism `mesh`'s axis names ask for; returns the model.

    "tp": `shard(model, tp, mesh)` (tp="auto": the model's own tp_plan; None skips it); "ep":
    `expert_parallel` (also when `ep=True`); "cp": `context_parallel` with method `cp` ("ring" by
    default); "dp": `hsdp(model, mesh=mesh, **hsdp)`. Asking for a parallelism whose axis the mesh lacks
    (tp= other than "auto", ep=True, cp=, hsdp=) is a ValueError, raised before anything changes.
    """
    check_request(mesh, tp=tp, ep=ep, cp=cp, hsdp=hsdp)
    refuse_foreign_dtensors(model, "parallelize")
    model_parallel(model, mesh, tp=tp, ep=ep, cp=cp)
    data_parallel(model, mesh, hsdp)
    logger.info("hyper_parallel: parallelize on %s: %s", dict(zip(mesh.mesh_dim_names, mesh.shape)),
                "; ".join(model.__dict__.get("_hp_applied", [])) or "nothing applied")
    return model


def check_request(mesh: DeviceMesh, *, tp: Any = "auto", ep: bool = False, cp: str | None = None,
                  hsdp: dict | None = None) -> None:
    """ValueError unless every parallelism asked for has its axis on the mesh (before anything changes)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"parallelize: mesh must be a DeviceMesh (hp.init_device_mesh), got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    asked = {"tp": tp is not None and not (isinstance(tp, str) and tp == "auto"), "ep": bool(ep),
             "cp": cp is not None, "dp": hsdp is not None}
    for axis, wanted in asked.items():
        if wanted and axis not in names:
            arg = {"tp": "tp=", "ep": "ep=True", "cp": "cp=", "dp": "hsdp="}[axis]
            raise ValueError(f"parallelize: {arg} asks for mesh axis {axis!r}, but the mesh has axes {names}; "
                             f"add the axis (init_device_mesh(..., mesh_dim_names=...)) or drop the argument")
    unknown = [n for n in names if n not in asked]
    if unknown:
        raise ValueError(f"parallelize: mesh axes {unknown} name no parallelism; use 'dp', 'tp', 'ep' or 'cp' "
                         f"(pipeline stages: hyper_parallel.pipeline)")


def model_parallel(model: nn.Module, mesh: DeviceMesh, *, tp: Any = "auto", ep: bool = False,
                   cp: str | None = None) -> None:
    """The parallelisms that split the model itself: shard on "tp", experts on "ep", sequence on "cp".

    All three lay parameters out on one mesh, `mesh` without "dp" (shard's `model_mesh`), e.g. the
    whole ("cp", "tp") mesh with tp's splits replicated over "cp"; hsdp then adds "dp" itself."""
    from .shard.api import model_mesh
    names = mesh.mesh_dim_names
    inner = model_mesh(mesh)
    if "tp" in names and tp is not None:
        from .shard import shard
        shard(model, tp, mesh)
    if "ep" in names:
        from .expert import expert_parallel  # imported here: optional parts of the package
        expert_parallel(model, inner, axis="ep")
    if "cp" in names:
        from .context import context_parallel
        context_parallel(model, inner, axis="cp", method=cp or "ring")


def data_parallel(model: nn.Module, mesh: DeviceMesh, hsdp: dict | None) -> None:
    """hsdp over the "dp" axis (last: it shards whatever layouts the model parallelisms left)."""
    if "dp" in mesh.mesh_dim_names:
        from .hsdp import hsdp as apply_hsdp
        apply_hsdp(model, mesh=mesh, **(hsdp or {}))


def _group_name(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def summary(model: nn.Module) -> str:
    """What was laid out how: one line per parameter group (layer indices folded into `*`), with its
    layout, dtype and bytes held by this rank, then the parallelisms applied and the totals."""
    groups: dict = {}
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if isinstance(p, DTensor):
            local = p._local
            layout = "(" + ", ".join(map(str, p.dist_layout.alias_entries())) + ")"
        else:
            local, layout = p, "plain"
        key = (_group_name(name), layout, str(p.dtype).replace("torch.", ""), tuple(p.shape))
        count, nbytes, total = groups.get(key, (0, 0, 0))
        groups[key] = (count + 1, nbytes + local.numel() * local.element_size(), total + p.numel() * p.element_size())
    width = max((len(k[0]) for k in groups), default=10)
    lines = [f"{'parameters':<{width}}  {'n':>3}  {'shape':<14} {'dtype':<8} {'layout':<24} {'bytes/rank':>11}"]
    local_sum = full_sum = 0
    for (name, layout, dtype, shape), (count, nbytes, total) in groups.items():
        lines.append(f"{name:<{width}}  {count:>3}  {str(list(shape)):<14} {dtype:<8} {layout:<24} {nbytes:>11,}")
        local_sum += nbytes
        full_sum += total
    lines.append(f"total: {local_sum:,} bytes of parameters on this rank ({full_sum:,} in the whole model)")
    applied = model.__dict__.get("_hp_applied", [])
    lines.append("applied: " + ("; ".join(applied) if applied else "nothing (a plain model)"))
    return "\n".join(lines)


__all__ = ["parallelize", "summary"]
