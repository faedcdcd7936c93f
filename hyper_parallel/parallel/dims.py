"""`ParallelDims`: the one owner of a run's mesh, its axis names and what each parallelism gets of it.

torchtitan's `ParallelDims`, smaller: it is built from the axis names of the mesh the user made, never
from sizes given again, so the mesh is the single statement of the run's layout. Every parallelism asks
it for its sub-mesh instead of reading axis names itself:

    axis   role                                               who uses it
    "dp"   data parallel: each rank its own micro-batch        hsdp (shards parameters over it)
    "ep"   expert parallel; for everything but the experts,    expert_parallel (whole experts per rank)
           a data-parallel axis (torchtitan, Megatron)
    "tp"   tensor parallel: the group feeds the same batch     shard
    "cp"   context parallel: the group feeds the same batch,   context_parallel
           the library splits the sequence
    "pp"   pipeline parallel: the group feeds the same batch   pipeline

The *data axes* are "dp" and "ep" (API §12): `data_rank` / `data_world` number the data shares.
The model's own parallelisms (tp, ep, cp) lay every parameter out on one mesh, `model_mesh` (the mesh
without "dp" and "pp"), replicated over the axes that do not split it; hsdp adds "dp"; a pipeline stage
is parallelised over `stage_mesh` (the mesh without "pp").
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..layout.layout import Layout, PlacementLayout
from ..layout.mesh import DeviceMesh

DP, TP, EP, CP, PP = "dp", "tp", "ep", "cp", "pp"
AXES = (DP, TP, EP, CP, PP)
DATA_AXES = (DP, EP)          # each rank of these feeds its own share of the global batch
SAME_FEED_AXES = (TP, CP, PP)  # the ranks of these groups feed the same micro-batch
ROLE_ARGUMENT = {DP: "hsdp=", TP: "tp=", EP: "ep=True", CP: "cp=", PP: "hyper_parallel.pipeline"}


@dataclass(frozen=True, eq=False)
class ParallelDims:
    """The parallel layout of one run: a mesh whose axes are named after the parallelisms.

    Build it with `ParallelDims.of(mesh)` (cached on the mesh). Sizes of absent axes are 1.
    """

    mesh: DeviceMesh

    @staticmethod
    def of(mesh: DeviceMesh | Layout | PlacementLayout, where: str = "parallelize",
           allow_other_axes: bool = False) -> "ParallelDims":
        """The dims of `mesh` (a DeviceMesh, or a Layout whose mesh to use), checked once.

        Axis names other than dp/tp/ep/cp/pp are a ValueError naming them (unless `allow_other_axes`: the
        single-parallelism entry functions accept any name for their own axis)."""
        if isinstance(mesh, (Layout, PlacementLayout)):
            mesh = mesh.mesh
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"{where}: mesh must be a DeviceMesh (hp.init_device_mesh), got {type(mesh).__name__}")
        dims = mesh.__dict__.get("_parallel_dims")
        if dims is None:
            dims = ParallelDims(mesh)
            mesh.__dict__["_parallel_dims"] = dims
        if not allow_other_axes:
            unknown = [n for n in mesh.mesh_dim_names if n not in AXES]
            if unknown:
                raise ValueError(f"{where}: mesh axes {unknown} name no parallelism; name them 'dp', 'tp', 'ep', "
                                 f"'cp' or 'pp' (init_device_mesh(..., mesh_dim_names=...))")
        return dims

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def names(self) -> tuple:
        return self.mesh.mesh_dim_names

    def has(self, axis: str) -> bool:
        return axis in self.mesh.mesh_dim_names

    def size(self, axis: str) -> int:
        return self.mesh.size(axis) if axis in self.mesh.mesh_dim_names else 1

    def coordinate(self, axis: str) -> int:
        return self.mesh.get_local_rank(axis) if axis in self.mesh.mesh_dim_names else 0

    def require(self, axis: str, where: str) -> None:
        """ValueError unless the mesh has `axis` (a parallelism asked for on an axis the mesh lacks)."""
        if axis not in self.mesh.mesh_dim_names:
            raise ValueError(f"{where}: {ROLE_ARGUMENT.get(axis, axis)} asks for mesh axis {axis!r}, but the mesh "
                             f"has axes {self.mesh.mesh_dim_names}; add the axis "
                             f"(init_device_mesh(..., mesh_dim_names=...)) or drop the argument")

    # ---- the data convention (API §12) -------------------------------------------------------------
    @cached_property
    def data_axes(self) -> tuple:
        """The mesh's data axes, in mesh order."""
        return tuple(n for n in self.mesh.mesh_dim_names if n in DATA_AXES)

    @cached_property
    def data_world(self) -> int:
        """How many data shares the global batch is cut into (the product of the data axes' sizes)."""
        world = 1
        for axis in self.data_axes:
            world *= self.mesh.size(axis)
        return world

    @cached_property
    def data_rank(self) -> int:
        """This rank's index among the data shares: row-major over the data axes, in mesh order."""
        index = 0
        for axis in self.data_axes:
            index = index * self.mesh.size(axis) + self.mesh.get_local_rank(axis)
        return index

    # ---- sub-meshes ------------------------------------------------------------------------------
    def without(self, *axes: str) -> DeviceMesh | None:
        """The mesh without `axes` (this rank's coordinates on them); None if nothing is left."""
        keep = tuple(n for n in self.mesh.mesh_dim_names if n not in axes)
        if not keep:
            return None
        return self.mesh if keep == self.mesh.mesh_dim_names else self.mesh[keep]

    @cached_property
    def model_mesh(self) -> DeviceMesh | None:
        """Where tp, ep and cp lay parameters out: the mesh without "dp" (hsdp's) and "pp" (stages')."""
        return self.without(DP, PP)

    @cached_property
    def stage_mesh(self) -> DeviceMesh | None:
        """Over which each pipeline stage is parallelised: the mesh without "pp"."""
        return self.without(PP)


def data_world(mesh: DeviceMesh) -> int:
    """How many data shares the global batch is cut into on `mesh`: the product of its "dp" and "ep" sizes.

    Each rank feeds its own share (API §12), e.g.
    `DistributedSampler(ds, num_replicas=hp.data_world(mesh), rank=hp.data_rank(mesh))`; ranks that differ
    only in their "tp", "cp" or "pp" coordinate get the same share."""
    return ParallelDims.of(mesh, "data_world", allow_other_axes=True).data_world


def data_rank(mesh: DeviceMesh) -> int:
    """This rank's index among the `data_world(mesh)` data shares (row-major over "dp" and "ep")."""
    return ParallelDims.of(mesh, "data_rank", allow_other_axes=True).data_rank


__all__ = ["ParallelDims", "data_rank", "data_world", "DP", "TP", "EP", "CP", "PP", "AXES", "DATA_AXES"]
