"""Move a local shard from one layout to another with the cheapest collectives.

Plans are per (source, target, global shape) and cached. Order: pending reductions first
(reduce_scatter when the target shards that axis next, else all_reduce), then unsharding innermost
axes first (all_to_all when the axis moves straight to another dim, else all_gather), then local
slicing for new splits, then Replicate -> Partial locally.
"""
from __future__ import annotations

import torch

from ..layout.chunks import chunk_sizes
from ..layout.layout import Layout
from . import check as _check
from . import collectives as C

_PLANS: dict = {}


class RedistributeError(RuntimeError):
    pass


def _local_len(layout_map, mesh, shape, dim):
    size = shape[dim]
    for a in layout_map[dim]:
        size = chunk_sizes(size, mesh.shape[a])[mesh.coordinate[a]]
    return size


def _even(axes, mesh, length) -> bool:
    """Every piece equal at every level, on every rank (plans must agree across ranks)."""
    total = 1
    for a in axes:
        total *= mesh.shape[a]
    return length % total == 0


def plan(src: Layout, dst: Layout, shape: tuple) -> list:
    key = (src, dst, shape)
    steps = _PLANS.get(key)
    if steps is None:
        steps = _PLANS[key] = _plan(src, dst, shape)
    return steps


def _plan(src: Layout, dst: Layout, shape: tuple) -> list:
    if src.mesh is not dst.mesh:
        raise RedistributeError(f"cannot redistribute between different meshes: {src} -> {dst}")
    if len(src.tensor_map) != len(dst.tensor_map):
        raise ValueError(f"layout {dst.alias_entries()} has {len(dst.tensor_map)} entries but the tensor has "
                         f"{len(src.tensor_map)} dims")
    mesh = dst.mesh
    coord = mesh.coordinate
    cur = [list(a) for a in src.tensor_map]
    partial = list(src.partial)
    steps = []

    def can_append(axis):  # the dim that `axis` should split next in dst, or -1
        d = dst.axis_dim[axis]
        if d < 0:
            return -1
        want = dst.tensor_map[d]
        pos = len(cur[d])
        return d if pos < len(want) and want[pos] == axis and list(want[:pos]) == cur[d] else -1

    # 1. pending reductions
    for a, op in enumerate(src.partial):
        if op is None or dst.partial[a] == op:
            continue
        n = mesh.shape[a]
        d = can_append(a)
        if d >= 0 and op in ("sum", "avg", "max", "min"):
            parent = _local_len(cur, mesh, shape, d)
            steps.append(("reduce_scatter", a, d, op, chunk_sizes(parent, n), coord[a]))
            cur[d].append(a)
        else:
            steps.append(("all_reduce", a, op, n))
        partial[a] = None

    # 2. unshard what the target does not keep, innermost first
    for d in range(len(cur)):
        want = list(dst.tensor_map[d])
        keep = 0
        while keep < len(cur[d]) and keep < len(want) and cur[d][keep] == want[keep]:
            keep += 1
        while len(cur[d]) > keep:
            a = cur[d][-1]
            n = mesh.shape[a]
            parent_len = _local_len([x[:-1] if i == d else x for i, x in enumerate(cur)], mesh, shape, d)
            e = can_append(a)
            if e >= 0 and e != d and _even(cur[d], mesh, shape[d]) and _even(cur[e] + [a], mesh, shape[e]):
                steps.append(("all_to_all", a, d, e, n))
                cur[d].pop()
                cur[e].append(a)
            else:
                steps.append(("all_gather", a, d, chunk_sizes(parent_len, n)))
                cur[d].pop()

    # 3. new splits: slice locally, outer first
    for d in range(len(cur)):
        want = dst.tensor_map[d]
        for a in want[len(cur[d]):]:
            n = mesh.shape[a]
            sizes = chunk_sizes(_local_len(cur, mesh, shape, d), n)
            i = coord[a]
            steps.append(("slice", d, sum(sizes[:i]), sizes[i]))
            cur[d].append(a)

    # 4. Replicate -> Partial is local: the value sits on coordinate 0 (sum) or everywhere (avg/max/min)
    for a, op in enumerate(dst.partial):
        if op is not None and partial[a] != op:
            if partial[a] is not None:
                steps.append(("all_reduce", a, partial[a], mesh.shape[a]))
            if op == "sum" and coord[a] != 0:
                steps.append(("zero",))
    return steps


_COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


def _in_format_of(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`out` in the memory format `like` suggests: torch's CPU kernels (batch_norm's backward, convolutions,
    pooling) pick their code path from the input's memory format, and at least one (batch_norm's backward on
    a contiguous input with a channels-last gradient, where a size-1 dim makes the strides ambiguous) gives
    wrong gradients on the mixed path; the collectives return contiguous pieces, so a channels-last tensor
    (a transpose of the channels last) would reach the local op in another format than the plain op sees."""
    fmt = _FORMATS.get(like.ndim)
    if fmt is None or out.ndim != like.ndim or like.is_contiguous() or out.is_contiguous(memory_format=fmt):
        return out
    return out.contiguous(memory_format=fmt) if like.is_contiguous(memory_format=fmt) else out


def redistribute_local(local: torch.Tensor, src: Layout, dst: Layout, shape: tuple) -> torch.Tensor:
    """`local` (this rank's piece of a `shape` tensor laid out `src`) as its piece under `dst`, in the memory
    format the input had (see `_in_format_of`)."""
    if src is dst:
        return local
    source = local
    mesh = dst.mesh
    for step in plan(src, dst, shape):
        kind = step[0]
        if kind in _COLLECTIVES and mesh.shape[step[1]] == 1:
            continue  # a size-1 axis holds everything already
        if kind == "slice":
            local = local.narrow(step[1], step[2], step[3])
        elif kind == "all_gather":
            local = C.all_gather(local, step[2], mesh.get_group(step[1]), step[3])
        elif kind == "all_reduce":
            local = C.all_reduce(local, step[2], mesh.get_group(step[1]), step[3])
        elif kind == "reduce_scatter":
            local = C.reduce_scatter(local, step[2], step[3], mesh.get_group(step[1]), step[4], step[5])
        elif kind == "all_to_all":
            local = C.all_to_all(local, step[2], step[3], mesh.get_group(step[1]), step[4])
        elif kind == "zero":
            local = torch.zeros_like(local)
    return _in_format_of(local, source)


_check.describe_frames(redistribute_local.__code__,
                       lambda f: f"redistribution {f['src']} -> {f['dst']} of global shape {tuple(f['shape'])}")
