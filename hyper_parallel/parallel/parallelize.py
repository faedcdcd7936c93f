"""`parallelize(model, mesh)`: every parallelism the mesh's axis names ask for, in the order that composes.

    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = hp.parallelize(model, mesh, hsdp={"optimizer_level": "level3"})
    print(hp.summary(model))

Order (torchtitan's): `shard` on "tp" (plan `tp`) -> expert parallel on "ep" -> `context_parallel` on
"cp" (method `cp`) -> `hsdp(**hsdp)` on "dp". The mesh's `ParallelDims` hands each its sub-mesh: the model
parallelisms lay parameters out on `model_mesh` (the mesh without "dp"), hsdp shards them over "dp". The
experts modules belong to expert parallelism: tensor parallelism leaves them alone. A model without
experts on a mesh with "ep" uses the axis as a data axis only. Each step records what it did on the model
(`model._hp_applied`), which `summary` prints with the per-group layouts and bytes per rank.
"""
from __future__ import annotations

import logging
import re
from typing import Any

from torch import nn

from ..dtensor.dtensor import DTensor
from ..layout.mesh import DeviceMesh
from .dims import CP, DP, EP, PP, TP, ParallelDims
from .surgery import refuse_foreign_dtensors

logger = logging.getLogger("hyper_parallel")


def parallelize(model: nn.Module, mesh: DeviceMesh, *, tp: Any = "auto", ep: bool = False, cp: str | None = None,
                hsdp: dict | None = None) -> nn.Module:
    """Apply, in place, every parallelism `mesh`'s axis names ask for; returns the model.

    "tp": `shard(model, tp, mesh)` (tp="auto": the model's own tp_plan; None skips it); "ep": expert
    parallel (also when `ep=True`); "cp": `context_parallel` with method `cp` ("ring" by default); "dp":
    `hsdp(model, mesh=mesh, **hsdp)`. Asking for a parallelism whose axis the mesh lacks (tp= other than
    "auto", ep=True, cp=, hsdp=) is a ValueError, raised before anything changes. A mesh with "pp" is
    `hyper_parallel.pipeline`'s (it parallelizes each stage over the other axes).
    """
    dims = ParallelDims.of(mesh, "parallelize")
    check_request(dims, tp=tp, ep=ep, cp=cp, hsdp=hsdp)
    refuse_foreign_dtensors(model, "parallelize")
    apply_parallelisms(model, dims, tp=tp, cp=cp, hsdp=hsdp)
    logger.info("hyper_parallel: parallelize on %s: %s", dict(zip(mesh.mesh_dim_names, mesh.shape)),
                "; ".join(model.__dict__.get("_hp_applied", [])) or "nothing applied")
    return model


def check_request(dims: ParallelDims, *, tp: Any = "auto", ep: bool = False, cp: str | None = None,
                  hsdp: dict | None = None, where: str = "parallelize", pipeline: bool = False) -> None:
    """ValueError unless every parallelism asked for has its axis on the mesh (before anything changes)."""
    if dims.has(PP) and not pipeline:
        raise ValueError(f"{where}: the mesh has a 'pp' axis: pipeline stages are cut by "
                         f"hyper_parallel.pipeline(model, mesh, ...), which parallelizes each stage over the other "
                         f"axes with the same arguments")
    asked = {TP: tp is not None and not (isinstance(tp, str) and tp == "auto"), EP: bool(ep),
             CP: cp is not None, DP: hsdp is not None}
    for axis, wanted in asked.items():
        if wanted:
            dims.require(axis, where)
    if hsdp is not None and not isinstance(hsdp, dict):
        raise TypeError(f"{where}: hsdp= takes a dict of hsdp's arguments, e.g. {{'optimizer_level': 'level3'}}, "
                        f"got {type(hsdp).__name__}")


def apply_parallelisms(model: nn.Module, dims: ParallelDims, *, tp: Any = "auto", cp: str | None = None,
                       hsdp: dict | None = None) -> None:
    """The model parallelisms on `dims.model_mesh` (tp, then ep, then cp), then hsdp over "dp"."""
    from .expert.api import batch_shares_only, expert_parallel, find_experts, unsupported_experts
    inner = dims.model_mesh
    experts = find_experts(model) if dims.has(EP) else {}
    if dims.has(EP):
        refused = unsupported_experts(model, experts)
        if refused:
            raise ValueError(f"parallelize: the mesh's 'ep' axis asks for expert parallel, but "
                             f"{', '.join(list(refused)[:3])} cannot be spread: {next(iter(refused.values()))}; "
                             f"use a 'dp' axis for this model")
    if dims.has(TP) and tp is not None:
        from .shard.api import tensor_parallel
        tensor_parallel(model, tp, dims.stage_mesh, leave=tuple(experts))
    if dims.has(EP):
        if experts:
            expert_parallel(model, inner, EP)
        else:
            batch_shares_only(model, inner, EP)
    if dims.has(CP):
        from .context import context_parallel
        context_parallel(model, inner, axis=CP, method=cp or "ring")
    if dims.has(DP):
        from .hsdp import hsdp as apply_hsdp
        apply_hsdp(model, mesh=dims.stage_mesh, **(hsdp or {}))


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


__all__ = ["parallelize", "summary", "check_request", "apply_parallelisms"]
