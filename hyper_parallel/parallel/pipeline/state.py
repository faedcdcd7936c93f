"""The whole model's state dict seen from one pipeline rank, for `hyper_parallel.checkpoint`.

Each rank holds only its stages' tensors, but a checkpoint needs the same keys on every rank. Every key
is therefore given as a DTensor whose mesh holds exactly the ranks that own the tensor (the ranks at
the owning pp coordinate): the owners' DTensors wrap their tensors (or are the `shard`/`hsdp`
parameters themselves, whose meshes are already those ranks), the others' are metadata-only
placeholders on a mesh that does not contain them. `checkpoint.save` then writes each tensor once from
its owners and `checkpoint.load` fills only what a rank owns, with the resharding it already does
(pp=2 -> one process, or -> another pp/dp/tp layout).
"""
from __future__ import annotations

import torch

from ...dtensor.dtensor import DTensor, make_dtensor
from ...layout.layout import replicate_layout
from ...layout.mesh import DeviceMesh


def stage_owner_meshes(mesh: DeviceMesh, pp_axis: int) -> list[DeviceMesh]:
    """Per pp coordinate, a 1-D mesh over the global ranks at that coordinate (no groups: no collectives)."""
    out = []
    grid = mesh.mesh.movedim(pp_axis, 0)
    for c in range(mesh.shape[pp_axis]):
        ranks = grid[c].reshape(-1)
        out.append(DeviceMesh(mesh.device_type, ranks, ("pp_stage",), _groups=(None,)))
    return out


def whole_state_dict(pipe) -> dict:
    """Every key of the whole model, in the original order: see the module docstring."""
    own = pipe.model.state_dict()
    out = {}
    for key, (shape, dtype) in pipe._whole_meta.items():
        owner_mesh = pipe._owner_meshes[pipe._key_owner[key]]
        layout = replicate_layout(owner_mesh, len(shape))
        if key in own:
            t = own[key]
            out[key] = t if isinstance(t, DTensor) else make_dtensor(t, layout, shape)
        else:
            out[key] = make_dtensor(torch.empty(shape, dtype=dtype, device="meta"), layout, shape)
    return out
