"""DeviceMesh: ranks arranged in a named matrix, with one torch.distributed group per axis."""
from __future__ import annotations

import math
import os
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

_MESHES: dict = {}
_NAME_OF_GROUP: dict = {}  # process group -> axis_name_of's answer
_AXIS_OF_RANKS: dict = {}  # sorted ranks of a mesh axis's group -> the axis's name (comm_counter's by-axis books)


def comm_timeout() -> timedelta:
    """Collectives that cannot complete fail after this (env HYPER_PARALLEL_COMM_TIMEOUT, seconds)."""
    return timedelta(seconds=float(os.environ.get("HYPER_PARALLEL_COMM_TIMEOUT", "600")))


def ensure_process_group() -> bool:
    """Initialise the default group from torchrun's environment if the user has not; True if one exists."""
    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=comm_timeout())
        return True
    return False


def _default_device_type() -> str:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return "cuda"
    return "cpu"


class DeviceMesh:
    """A matrix of ranks with named axes.

    Without torch.distributed the mesh is virtual: this process plays coordinate (0, ..., 0) and any
    op that needs communication raises, which is what the single-device census needs.
    """

    def __init__(self, device_type: str, mesh, mesh_dim_names: Sequence[str] | None = None,
                 *, _groups=None):
        ranks = torch.as_tensor(mesh, dtype=torch.long)
        self.device_type = device_type
        self.shape = tuple(ranks.shape)
        self.ndim = len(self.shape)
        names = tuple(mesh_dim_names) if mesh_dim_names is not None else tuple(f"dim{i}" for i in range(self.ndim))
        _check_names(names, self.ndim)
        self.mesh_dim_names = names
        self.ranks = tuple(int(r) for r in ranks.flatten().tolist())
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"DeviceMesh ranks must be distinct, got {self.ranks}")
        self.mesh = ranks
        self._axis_of = {n: i for i, n in enumerate(names)}
        self._submeshes: dict = {}
        self.root = self  # the mesh this one was taken from by name (`mesh["tp"]`), for the parallelisms' owner
        self.replicated_layouts: dict = {}  # ndim -> Layout, filled by layout.replicate_layout
        self.distributed = ensure_process_group()
        if self.distributed:
            world, me = dist.get_world_size(), dist.get_rank()
            if max(self.ranks) >= world:
                raise ValueError(f"DeviceMesh {self.shape} names rank {max(self.ranks)} but only {world} "
                                 f"processes run: launch {len(self.ranks)} ranks or pass rank_list")
            self.coordinate = _coordinate(self.ranks, self.shape, me)
            self.groups = _groups if _groups is not None else self._make_groups()
        else:
            self.coordinate = (0,) * self.ndim
            self.groups = (None,) * self.ndim

    def _make_groups(self) -> tuple:
        """One group per axis, created by every rank in the same order (torch requires it)."""
        grid = torch.tensor(self.ranks).reshape(self.shape) if self.shape else torch.tensor(self.ranks)
        mine = []
        for axis in range(self.ndim):
            if self.shape[axis] == 1:
                mine.append(None)
                continue
            moved = grid.movedim(axis, -1).reshape(-1, self.shape[axis])
            chosen = None
            for row in moved.tolist():
                group = dist.new_group(row, timeout=comm_timeout())
                if self.coordinate is not None and dist.get_rank() in row:
                    chosen = group
                    _NAME_OF_GROUP[group] = _AXIS_OF_RANKS[tuple(sorted(row))] = self.mesh_dim_names[axis]
            mine.append(chosen)
        return tuple(mine)

    # ---- queries -------------------------------------------------------------------------
    def size(self, axis: int | str | None = None) -> int:
        if axis is None:
            return len(self.ranks)
        return self.shape[self.axis_index(axis)]

    def axis_index(self, axis: int | str) -> int:
        if isinstance(axis, str):
            if axis not in self._axis_of:
                raise ValueError(f"mesh has no axis named {axis!r}; its axes are {self.mesh_dim_names}")
            return self._axis_of[axis]
        return int(axis)

    def get_group(self, axis: int | str = 0):
        axis = self.axis_index(axis)
        if not self.distributed and self.shape[axis] > 1:
            raise RuntimeError(
                f"communication over mesh axis {self.mesh_dim_names[axis]!r} needs torch.distributed: "
                f"launch with torchrun (or init_process_group) with {self.size()} ranks")
        return self.groups[axis]

    def get_coordinate(self):
        return self.coordinate

    def get_local_rank(self, axis: int | str = 0) -> int:
        return self.coordinate[self.axis_index(axis)]

    def __getitem__(self, names) -> "DeviceMesh":
        """Sub-mesh over the named axes that contains this rank; it reuses the parent's groups."""
        names = (names,) if isinstance(names, str) else tuple(names)
        if names in self._submeshes:
            return self._submeshes[names]
        axes = [self.axis_index(n) for n in names]
        if self.coordinate is None:
            raise RuntimeError(f"this rank is not in mesh {self}")
        index = tuple(slice(None) if i in axes else c for i, c in enumerate(self.coordinate))
        sub = self.mesh[index]
        if len(axes) > 1:
            sub = sub.permute(*[sorted(axes).index(a) for a in axes])
        groups = tuple(self.groups[a] for a in axes)
        mesh = DeviceMesh(self.device_type, sub, names, _groups=groups)
        mesh.root = self.root
        self._submeshes[names] = mesh
        return mesh

    def __repr__(self):
        return f"DeviceMesh({self.device_type!r}, shape={self.shape}, names={self.mesh_dim_names})"


def _check_names(names: tuple, ndim: int) -> None:
    if len(names) != ndim:
        raise ValueError(f"mesh has {ndim} axes but {len(names)} names were given: {names}")
    for n in names:
        if not isinstance(n, str) or n == "None":
            raise ValueError(f"mesh axis names must be strings other than 'None', got {n!r}")
    dup = [n for n in names if names.count(n) > 1]
    if dup:
        raise ValueError(f"mesh axis name {dup[0]!r} is used twice in {names}")


def _coordinate(ranks: tuple, shape: tuple, rank: int):
    if rank not in ranks:
        return None
    flat = ranks.index(rank)
    coord = []
    for size in reversed(shape):
        coord.append(flat % size)
        flat //= size
    return tuple(reversed(coord))


def axis_name_of(group) -> str:
    """The mesh axis whose ranks `group` spans ("world" for the default group): a group made elsewhere over
    the same ranks (hsdp's own groups) gets the axis's name too; any other, "group<ranks>". Called by
    `comm_counter` only while one is active."""
    if group is None or group is dist.group.WORLD:
        return "world"
    name = _NAME_OF_GROUP.get(group)
    if name is None:
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        name = _NAME_OF_GROUP[group] = _AXIS_OF_RANKS.get(ranks) or f"group{list(ranks)}"
    return name


def name_group(group, name: str) -> None:
    """Tell `comm_counter`'s by-axis books that `group` (made outside a DeviceMesh, e.g. hsdp's own groups
    along an axis) runs mesh axis `name`."""
    if group is not None:
        _NAME_OF_GROUP[group] = name


def clear_caches() -> None:
    """Forget every interned mesh and axis name: `hp.plan` re-initialises torch.distributed (another rank, another
    world) in one process, and a mesh interned under the old group would hold stale groups and coordinates."""
    _MESHES.clear()
    _AXIS_OF_RANKS.clear()
    _NAME_OF_GROUP.clear()


def get_mesh(shape: Sequence[int], names: Sequence[str], rank_list: Sequence[int] | None = None,
             device_type: str | None = None) -> DeviceMesh:
    """The interned mesh for these arguments (groups are created once per distinct mesh)."""
    shape = tuple(int(s) for s in shape)
    names = tuple(names)
    _check_names(names, len(shape))
    if any(s < 1 for s in shape):
        raise ValueError(f"mesh sizes must be positive, got {shape}")
    total = math.prod(shape)
    if rank_list is None:
        ensure_process_group()
        if dist.is_initialized() and dist.get_world_size() != total:
            raise ValueError(f"mesh {shape} holds {total} ranks but {dist.get_world_size()} processes run: "
                             f"make the mesh size equal the world size or pass rank_list")
        rank_list = tuple(range(total))
    else:
        rank_list = tuple(int(r) for r in rank_list)
        if len(rank_list) != total:
            raise ValueError(f"mesh {shape} holds {total} ranks but rank_list has {len(rank_list)}: {rank_list}")
    device_type = device_type or _default_device_type()
    key = (device_type, shape, names, rank_list, dist.is_initialized())
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = DeviceMesh(device_type, torch.tensor(rank_list).reshape(shape), names)
        _MESHES[key] = mesh
    return mesh


def init_device_mesh(device_type: str, mesh_shape: Sequence[int],
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """Same call as torch's: a mesh over all ranks, row-major."""
    mesh_shape = tuple(mesh_shape)
    names = tuple(mesh_dim_names) if mesh_dim_names else tuple(f"dim{i}" for i in range(len(mesh_shape)))
    return get_mesh(mesh_shape, names, None, device_type)

