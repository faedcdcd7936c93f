"""Which slice of a global tensor a rank writes or needs, and reading overlaps out of safetensors.

A piece is (offsets, sizes) in global coordinates; `piece_holders` lists, per piece of a layout,
the ranks holding a copy of it (replicas along the axes that do not split the tensor).
"""
from __future__ import annotations

import itertools
import math

import torch

from ..dtensor.dtensor import DTensor
from ..layout.layout import Layout


def is_writer(layout: Layout, coordinate=None) -> bool:
    coord = layout.mesh.coordinate if coordinate is None else coordinate
    if coord is None:
        return False
    return all(coord[a] == 0 for a in range(layout.mesh.ndim) if a not in layout.sharded_axes)


def writer_pieces(layout: Layout, shape: tuple) -> list:
    """Every writer of a (Partial-free) layout: [(global rank, offsets, sizes)], non-empty pieces only."""
    mesh = layout.mesh
    out = []
    for flat, coord in enumerate(itertools.product(*[range(n) for n in mesh.shape])):
        if not is_writer(layout, coord):
            continue
        sizes = layout.local_shape(shape, coord)
        if math.prod(sizes) == 0 and len(shape):
            continue
        out.append((mesh.ranks[flat], layout.local_offset(shape, coord), sizes))
    return out


def piece_holders(layout: Layout, shape: tuple) -> list:
    """[(offsets, sizes, [global ranks holding it])] for every non-empty piece of a Partial-free layout."""
    mesh = layout.mesh
    groups: dict = {}
    for flat, coord in enumerate(itertools.product(*[range(n) for n in mesh.shape])):
        key = tuple(coord[a] for a in layout.sharded_axes)
        if key not in groups:
            sizes = layout.local_shape(shape, coord)
            if len(shape) and math.prod(sizes) == 0:
                groups[key] = None
                continue
            groups[key] = (layout.local_offset(shape, coord), sizes, [])
        if groups[key] is not None:
            groups[key][2].append(mesh.ranks[flat])
    return [g for g in groups.values() if g is not None]


def region(t: torch.Tensor):
    """(offsets, sizes) of the global tensor this rank holds, or None when the rank is outside its mesh."""
    shape = tuple(t.shape)
    if isinstance(t, DTensor):
        layout = t.dist_layout.without_partial()
        if layout.mesh.coordinate is None:
            return None
        return layout.local_offset(shape), layout.local_shape(shape)
    return (0,) * len(shape), shape


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds this rank's data (the shard of a DTensor)."""
    with torch.no_grad():
        return t.to_local() if isinstance(t, DTensor) else t


def overlap(p_off, p_size, r_off, r_size):
    """(slices into the piece, slices into the region) where they intersect, or None."""
    ps, rs = [], []
    for po, pn, ro, rn in zip(p_off, p_size, r_off, r_size):
        lo, hi = max(po, ro), min(po + pn, ro + rn)
        if hi <= lo:
            return None
        ps.append(slice(lo - po, hi - po))
        rs.append(slice(lo - ro, hi - ro))
    return tuple(ps), tuple(rs)


def covers_whole(slices, sizes) -> bool:
    return all(s.start == 0 and s.stop == n for s, n in zip(slices, sizes))


def layout_info(t: torch.Tensor) -> dict | None:
    """How a tensor was laid out when saved (for `inspect`; loading never needs it)."""
    if not isinstance(t, DTensor):
        return None
    lay = t.dist_layout
    names = lay.mesh.mesh_dim_names
    return {
        "mesh_shape": list(lay.mesh.shape),
        "mesh_axes": list(names),
        "tensor_map": [[names[a] for a in axes] for axes in lay.tensor_map],
        "partial": {names[a]: op for a, op in enumerate(lay.partial) if op},
        "placements": [repr(p) for p in lay.placements],
    }
