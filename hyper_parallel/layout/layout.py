"""Layout: a device matrix with aliased axes, and how one tensor's dims map onto those axes.

Layouts are interned: equal layouts are the same object, so the dispatcher can hash and compare
them by identity on its hot path.
"""
from __future__ import annotations

from typing import Sequence

from .chunks import piece
from .mesh import DeviceMesh, get_mesh
from .placement import Partial, Placement, Replicate, Shard, REPLICATE

_LAYOUTS: dict = {}


def _intern(mesh: DeviceMesh, tensor_map, partial) -> "Layout":
    key = (mesh, tensor_map, partial)
    layout = _LAYOUTS.get(key)
    if layout is None:   # a new layout: checked once, then interned (the hot paths only look it up)
        _check_axes_used_once(mesh, tensor_map)
        layout = object.__new__(Layout)
        layout._init(mesh, tensor_map, partial)
        _LAYOUTS[key] = layout
    return layout


def _check_axes_used_once(mesh: DeviceMesh, tensor_map) -> None:
    """A mesh axis splits at most one tensor dim: on two, the local pieces would not tile the tensor and every
    rule reading the layout would compute silently wrong values, so such a layout is refused where it is made."""
    seen: dict = {}
    for dim, axes in enumerate(tensor_map or ()):
        for axis in axes:
            if axis in seen:
                name = mesh.mesh_dim_names[axis]
                raise ValueError(f"layout {tensor_map}: mesh axis {name!r} splits tensor dims {seen[axis]} and "
                                 f"{dim}; an axis can split one dim only (take it off one dim first)")
            seen[axis] = dim


class Layout:
    """`Layout((4, 2), ("dp", "tp"))` is a device matrix; `layout("dp", "None")` a tensor layout on it.

    A tensor layout maps each tensor dim to the mesh axes splitting it (outer first) and records,
    per mesh axis, a pending reduction (Partial) if any.
    """

    __slots__ = ("mesh", "tensor_map", "partial", "placements", "is_replicate", "axis_dim",
                 "has_partial", "sharded_axes")

    def __new__(cls, mesh_shape: Sequence[int] | DeviceMesh, alias_name: Sequence[str] | None = None,
                rank_list: Sequence[int] | None = None) -> "Layout":
        if isinstance(mesh_shape, DeviceMesh):
            mesh = mesh_shape
        else:
            if isinstance(mesh_shape, int):
                mesh_shape = (mesh_shape,)
            if alias_name is None:
                raise ValueError("Layout needs one alias per mesh axis, e.g. Layout((4, 2), ('dp', 'tp'))")
            if isinstance(alias_name, str):
                alias_name = (alias_name,)
            if len(alias_name) != len(mesh_shape):
                raise ValueError(f"Layout mesh_shape {tuple(mesh_shape)} has {len(mesh_shape)} axes but "
                                 f"alias_name {tuple(alias_name)} names {len(alias_name)}")
            mesh = get_mesh(mesh_shape, alias_name, rank_list)
        return _intern(mesh, None, (None,) * mesh.ndim)

    def _init(self, mesh, tensor_map, partial):
        self.mesh = mesh
        self.tensor_map = tensor_map
        self.partial = partial
        self.has_partial = any(p is not None for p in partial)
        axis_dim = [-1] * mesh.ndim
        for d, axes in enumerate(tensor_map or ()):
            for a in axes:
                axis_dim[a] = d
        self.axis_dim = tuple(axis_dim)
        self.sharded_axes = tuple(a for a in range(mesh.ndim) if axis_dim[a] >= 0)
        self.is_replicate = not self.sharded_axes and not self.has_partial
        self.placements = tuple(
            Partial(partial[a]) if partial[a] is not None else (Shard(axis_dim[a]) if axis_dim[a] >= 0 else REPLICATE)
            for a in range(mesh.ndim))

    # ---- construction --------------------------------------------------------------------
    @property
    def mesh_shape(self) -> tuple:
        return self.mesh.shape

    @property
    def alias_name(self) -> tuple:
        return self.mesh.mesh_dim_names

    @property
    def rank_list(self) -> tuple:
        return self.mesh.ranks

    @property
    def ndim(self) -> int | None:
        return None if self.tensor_map is None else len(self.tensor_map)

    def __call__(self, *entries) -> "Layout":
        """Tensor layout from one alias entry per tensor dim, or from one Placement per mesh axis."""
        if len(entries) == 1 and isinstance(entries[0], list):
            entries = tuple(entries[0])
        if entries and all(isinstance(e, Placement) for e in entries):
            return PlacementLayout(self.mesh, entries)
        names = self.mesh.mesh_dim_names
        used: dict = {}
        tensor_map = []
        for d, entry in enumerate(entries):
            group = entry if isinstance(entry, tuple) else (entry,)
            axes = []
            for alias in group:
                if alias == "None" or alias is None:
                    if len(group) > 1:
                        raise ValueError(f"'None' cannot be combined with aliases in {entry!r}")
                    continue
                if not isinstance(alias, str) or alias not in names:
                    raise ValueError(f"unknown alias {alias!r} in layout {entries}; the mesh axes are {names}")
                if alias in used:
                    raise ValueError(f"alias {alias!r} is used twice in layout {entries} (dims {used[alias]} and {d})")
                used[alias] = d
                axes.append(names.index(alias))
            tensor_map.append(tuple(axes))
        return _intern(self.mesh, tuple(tensor_map), (None,) * self.mesh.ndim)

    @staticmethod
    def from_placements(mesh: DeviceMesh, placements: Sequence[Placement], ndim: int | None = None) -> "Layout":
        placements = tuple(placements)
        if len(placements) != mesh.ndim:
            raise ValueError(f"{len(placements)} placements {placements} given for a mesh with {mesh.ndim} axes "
                             f"{mesh.mesh_dim_names}: give one per mesh axis")
        dims = [p.dim for p in placements if isinstance(p, Shard)]
        if ndim is None:
            if any(d < 0 for d in dims):
                raise ValueError(f"negative Shard dims in {placements} need the tensor's rank")
            ndim = max(dims, default=-1) + 1
        tensor_map = [[] for _ in range(ndim)]
        partial = []
        for axis, p in enumerate(placements):
            if isinstance(p, Shard):
                d = p.dim + ndim if p.dim < 0 else p.dim
                if not 0 <= d < ndim:
                    raise ValueError(f"{p} is out of range for a tensor of rank {ndim}")
                tensor_map[d].append(axis)
                partial.append(None)
            elif isinstance(p, Partial):
                partial.append(p.reduce_op)
            elif isinstance(p, Replicate):
                partial.append(None)
            else:
                raise ValueError(f"unknown placement {p!r}")
        return _intern(mesh, tuple(tuple(a) for a in tensor_map), tuple(partial))

    def for_ndim(self, ndim: int, what: str = "tensor") -> "Layout":
        """This layout checked against a tensor of rank `ndim` (placement-built layouts are padded)."""
        if self.tensor_map is None:
            raise ValueError(f"{self} is a device matrix, not a tensor layout: call it with one entry per "
                             f"tensor dim, e.g. layout({', '.join(['None'] * ndim)})")
        n = len(self.tensor_map)
        if n == ndim:
            return self
        raise ValueError(f"layout {self.alias_entries()} has {n} entries but the {what} has {ndim} dims: "
                         f"give one entry per tensor dim")

    def with_partial(self, alias: str, reduce_op: str = "sum") -> "Layout":
        axis = self.mesh.axis_index(alias)
        Partial(reduce_op)  # validates the op
        if self.axis_dim[axis] >= 0:
            raise ValueError(f"mesh axis {alias!r} already shards dim {self.axis_dim[axis]}; it cannot also be Partial")
        partial = list(self.partial)
        partial[axis] = reduce_op
        return _intern(self.mesh, self.tensor_map, tuple(partial))

    def with_map(self, tensor_map, partial=None) -> "Layout":
        return _intern(self.mesh, tuple(tuple(a) for a in tensor_map),
                       self.partial if partial is None else tuple(partial))

    def replicated(self, ndim: int | None = None) -> "Layout":
        n = len(self.tensor_map) if ndim is None else ndim
        return _intern(self.mesh, ((),) * n, (None,) * self.mesh.ndim)

    def without_partial(self) -> "Layout":
        if not self.has_partial:
            return self
        return _intern(self.mesh, self.tensor_map, (None,) * self.mesh.ndim)

    # ---- shard arithmetic ----------------------------------------------------------------
    def splits(self, dim: int, coordinate=None) -> list:
        coord = self.mesh.coordinate if coordinate is None else coordinate
        return [(self.mesh.shape[a], coord[a]) for a in self.tensor_map[dim]]

    def local_shape(self, global_shape, coordinate=None) -> tuple:
        if coordinate is None:
            coordinate = self.mesh.coordinate
        return tuple(piece(n, self.splits(d, coordinate))[1] if self.tensor_map[d] else n
                     for d, n in enumerate(global_shape))

    def local_offset(self, global_shape, coordinate=None) -> tuple:
        return tuple(piece(n, self.splits(d, coordinate))[0] for d, n in enumerate(global_shape))

    def shard_count(self, dim: int) -> int:
        count = 1
        for a in self.tensor_map[dim]:
            count *= self.mesh.shape[a]
        return count

    # ---- display -------------------------------------------------------------------------
    def alias_entries(self) -> tuple:
        if self.tensor_map is None:
            return ()
        names = self.mesh.mesh_dim_names
        out = []
        for axes in self.tensor_map:
            if not axes:
                out.append("None")
            elif len(axes) == 1:
                out.append(names[axes[0]])
            else:
                out.append(tuple(names[a] for a in axes))
        return tuple(out)

    def __repr__(self):
        names = self.mesh.mesh_dim_names
        if self.tensor_map is None:
            return f"Layout({self.mesh.shape}, {names})"
        extra = "".join(f".with_partial({names[a]!r}, {p!r})" for a, p in enumerate(self.partial) if p)
        return f"Layout({self.mesh.shape}, {names})({', '.join(map(repr, self.alias_entries()))}){extra}"

    def __reduce__(self):
        raise TypeError("Layout objects are process-local (they hold process groups)")


class PlacementLayout:
    """`layout(Shard(0), Replicate())`: placements wait for the tensor's rank to become a Layout."""

    __slots__ = ("mesh", "placements")

    def __init__(self, mesh: DeviceMesh, placements: Sequence[Placement]):
        if len(placements) != mesh.ndim:
            raise ValueError(f"{len(placements)} placements {tuple(placements)} given for a mesh with "
                             f"{mesh.ndim} axes {mesh.mesh_dim_names}: give one per mesh axis")
        self.mesh = mesh
        self.placements = tuple(placements)

    def for_ndim(self, ndim: int, what: str = "tensor") -> Layout:
        return Layout.from_placements(self.mesh, self.placements, ndim)

    def __repr__(self):
        return f"Layout({self.mesh.shape}, {self.mesh.mesh_dim_names}){self.placements}"


def replicate_layout(mesh: DeviceMesh, ndim: int) -> Layout:
    """The fully replicated layout of a rank-`ndim` tensor on `mesh` (plain tensors mixed into ops)."""
    layout = mesh.replicated_layouts.get(ndim)  # on the hot path: one dict lookup
    if layout is None:
        layout = mesh.replicated_layouts[ndim] = _intern(mesh, ((),) * ndim, (None,) * mesh.ndim)
    return layout
