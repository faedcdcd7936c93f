"""Which ranks are data-parallel, how they split into shard groups and replica groups, and the meshes.

Three meshes can be involved:
- the *compute* mesh: where the model's activations live. `None` for a plain model (compute runs on
  plain tensors); the mesh of the parameters for a model already laid out by `shard` (e.g. ("dp", "tp")).
- the *storage* mesh: where the sharded parameters (what the optimizer sees) live. It is the compute
  mesh when every data-parallel rank shards (`shard_size` = dp size); for hybrid sharding the dp axis
  is split in place into ("<dp>_replicate", "<dp>_shard"), so a parameter is Shard on the inner axis
  and Replicate on the outer one.
- process groups: the mesh's own groups carry the parameter all-gathers; gradient reductions get
  groups of their own, so an asynchronous reduction never interleaves with a gather on one group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...layout.layout import Layout
from ...layout.mesh import DeviceMesh, comm_timeout, ensure_process_group, get_mesh, name_group
from ..dims import DP


class Topology:
    """Data-parallel geometry of one `hsdp` call (see module docstring)."""

    def __init__(self, compute_mesh: DeviceMesh | None, storage_mesh: DeviceMesh, shard_axis: int,
                 replicate_axis: int | None, axis_map: dict):
        self.compute_mesh = compute_mesh
        self.storage_mesh = storage_mesh
        self.shard_axis = shard_axis
        self.replicate_axis = replicate_axis
        self.axis_map = axis_map  # compute-mesh axis -> storage-mesh axis (non-dp axes only)
        self.shard_size = storage_mesh.shape[shard_axis]
        self.replicate_size = storage_mesh.shape[replicate_axis] if replicate_axis is not None else 1
        self.dp_size = self.shard_size * self.replicate_size
        self.shard_rank = storage_mesh.coordinate[shard_axis]
        self.gather_group = storage_mesh.get_group(shard_axis) if self.shard_size > 1 else None
        self.reduce_shard_group = _axis_group(storage_mesh, shard_axis)
        # check mode compares the shard group's gathers and reductions over one group (see collectives._issue)
        self.check_group = self.gather_group
        self.reduce_replicate_group = (_axis_group(storage_mesh, replicate_axis)
                                       if replicate_axis is not None else None)

    def storage_layout(self, compute_layout: Layout | None, ndim: int, shard: bool) -> Layout:
        """The parameter's layout on the storage mesh: its own (tp) splits, plus dim 0 on the shard axis."""
        tensor_map = [[] for _ in range(ndim)]
        if compute_layout is not None:
            for d, axes in enumerate(compute_layout.tensor_map):
                tensor_map[d] = [self.axis_map[a] for a in axes]
        if shard:
            tensor_map[0].append(self.shard_axis)  # inner-most: dp splits this rank's tp piece further
        return Layout(self.storage_mesh).with_map(tensor_map, (None,) * self.storage_mesh.ndim)


def _axis_group(mesh: DeviceMesh, axis: int):
    """A fresh process group along `axis` containing this rank.

    Created with local synchronisation (only its members call new_group): `mesh` may be a sub-mesh whose
    siblings on other ranks create their own groups at the same time (hsdp inside each pipeline stage),
    which a world-wide new_group sequence would mismatch.
    """
    if not mesh.distributed or mesh.shape[axis] == 1:
        return None
    rows = torch.tensor(mesh.ranks).reshape(mesh.shape).movedim(axis, -1).reshape(-1, mesh.shape[axis]).tolist()
    row = next(r for r in rows if dist.get_rank() in r)
    group = dist.new_group(row, timeout=comm_timeout(), use_local_synchronization=True)
    name_group(group, mesh.mesh_dim_names[axis])   # comm_counter books its traffic under the axis's name
    return group


def _as_mesh(mesh) -> DeviceMesh:
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, Layout):
        return mesh.mesh
    raise TypeError(f"hsdp(mesh=...) takes a DeviceMesh or a Layout device matrix, got {type(mesh).__name__}")


def resolve(params: list, mesh, shard_size: int) -> Topology:
    """Find the dp ranks (see API.md §2: `mesh` or its "dp" axis, else the ranks parameters do not use)."""
    from ...dtensor.dtensor import DTensor
    meshes = {p._layout.mesh for p in params if type(p) is DTensor}
    if len(meshes) > 1:
        raise ValueError(f"hsdp: parameters live on several meshes {sorted(map(repr, meshes))}; lay them out "
                         f"on one mesh first")
    compute = next(iter(meshes)) if meshes else None
    used = {compute.mesh_dim_names[a] for p in params if type(p) is DTensor for a in p._layout.sharded_axes}
    full = _full_mesh(compute, mesh)
    axis = _dp_axis(full, compute, used)
    dp = full.shape[axis]
    if shard_size == -1:
        shard_size = dp
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1 or dp % shard_size:
        raise ValueError(f"hsdp: shard_size={shard_size!r} must be -1 or a positive divisor of the "
                         f"data-parallel size {dp} (axis {full.mesh_dim_names[axis]!r})")
    if shard_size == dp:
        storage, shard_axis, rep_axis = full, axis, None
    else:
        names = full.mesh_dim_names
        base = names[axis]
        rep_name, shard_name = _fresh(f"{base}_replicate", names), _fresh(f"{base}_shard", names)
        shape = full.shape[:axis] + (dp // shard_size, shard_size) + full.shape[axis + 1:]
        new_names = names[:axis] + (rep_name, shard_name) + names[axis + 1:]
        storage = get_mesh(shape, new_names, full.ranks, full.device_type)
        shard_axis, rep_axis = axis + 1, axis
    axis_map = {}
    if compute is not None:
        axis_map = {a: storage.mesh_dim_names.index(n) for a, n in enumerate(compute.mesh_dim_names)}
    return Topology(compute, storage, shard_axis, rep_axis, axis_map)


def _full_mesh(compute: DeviceMesh | None, mesh) -> DeviceMesh:
    """The mesh holding the dp axis together with the parameters' own axes."""
    if mesh is not None:
        mesh = _as_mesh(mesh)
        if compute is None and mesh.ndim > 1:
            if DP not in mesh.mesh_dim_names:
                raise ValueError(f"hsdp(mesh=...) with axes {mesh.mesh_dim_names}: name the data-parallel axis 'dp'")
            return mesh[DP]
        if compute is not None and compute is not mesh:
            missing = [n for n in compute.mesh_dim_names if n not in mesh.mesh_dim_names]
            if missing:
                raise ValueError(f"hsdp(mesh={mesh}): the parameters' mesh {compute} has axes {missing} that "
                                 f"this mesh lacks; pass the mesh the parameters' mesh was taken from")
        return mesh
    world = dist.get_world_size() if ensure_process_group() else 1
    if compute is None:
        return get_mesh((world,), (DP,))
    if len(compute.ranks) == world:
        return compute
    # the parameters live on a sub-mesh taken by name (mesh["tp"]): the mesh it was taken from holds the dp
    # axis; no rank guesses the others' ranks
    root = compute.root
    if root is compute or len(root.ranks) != world or DP not in root.mesh_dim_names:
        raise ValueError(f"hsdp: the parameters live on {compute}, which covers {len(compute.ranks)} of the {world} "
                         f"ranks, and no mesh it was taken from has a data-parallel axis 'dp'; pass mesh= (the mesh "
                         f"with the 'dp' axis the parameters' mesh was taken from)")
    keep = tuple(n for n in root.mesh_dim_names if n in compute.mesh_dim_names or n == DP)
    return root if keep == root.mesh_dim_names else root[keep]


def _dp_axis(mesh: DeviceMesh, compute: DeviceMesh | None, used: set) -> int:
    names = mesh.mesh_dim_names
    if mesh.ndim == 1:
        axis = 0
    elif DP in names:
        axis = names.index(DP)
    else:
        taken = set(compute.mesh_dim_names) if compute is not None and compute is not mesh else used
        free = [a for a in range(mesh.ndim) if names[a] not in taken]
        if len(free) != 1:
            raise ValueError(f"hsdp: cannot tell the data-parallel axis of mesh {names}: name it 'dp' or pass "
                             f"mesh= (axes not used by any parameter: {[names[a] for a in free]})")
        axis = free[0]
    if names[axis] in used or (compute is not None and compute is not mesh and names[axis] in compute.mesh_dim_names):
        raise ValueError(f"hsdp: parameters are already split over the data-parallel axis {names[axis]!r}; "
                         f"hsdp shards them over that axis itself")
    return axis


def _fresh(name: str, taken: tuple) -> str:
    while name in taken:
        name += "_"
    return name
