"""`custom_shard(func, mesh, out_placements, in_placements=None)`: run a plain-tensor function on shards.

The escape hatch for code that has no op rule or that is already written for one shard (a fused
kernel, a hand-written collective): like torch's `local_map`, the wrapped function receives each
DTensor argument's local shard (redistributed first to `in_placements` where given) and its tensor
outputs are wrapped as DTensors with `out_placements`. Autograd flows through: an input's gradient
arrives as its local gradient, laid out as the input (or as `in_grad_placements` says: a replicated
input used by a sharded computation has a partial-sum gradient, `(Partial(),)`).

    def local_norm(x):                        # x: this rank's rows
        return x / x.norm(dim=-1, keepdim=True)
    norm = hp.custom_shard(local_norm, mesh, out_placements=(Shard(0),), in_placements=((Shard(0),),))
    y = norm(x)                               # a DTensor split on dim 0, as x
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..dtensor.autograd import local_input
from ..dtensor.dtensor import DTensor, resolve_layout
from ..layout.mesh import DeviceMesh
from ..layout.placement import Placement


def _is_placements(x) -> bool:
    return isinstance(x, (tuple, list)) and all(isinstance(p, Placement) for p in x)


def custom_shard(func: Callable, mesh: DeviceMesh, out_placements, in_placements=None, *,
                 in_grad_placements=None) -> Callable:
    """`func` on local shards: a function taking and returning DTensors (see the module docstring).

    out_placements: one placements tuple (one Placement per mesh axis) for a single tensor output, or a
    sequence of them, one per tensor output in order (None for a non-tensor output).
    in_placements: None (take each DTensor argument's shard as it is) or one entry per positional
    argument: a placements tuple to redistribute that argument to first, or None.
    in_grad_placements: like in_placements, the layout of each argument's local gradient (default: the
    argument's own placements).
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"custom_shard: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    outs = [out_placements] if _is_placements(out_placements) else list(out_placements)

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        for name, spec in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
            if spec is not None and len(spec) != len(args):
                raise ValueError(f"custom_shard({func.__name__}): {name} has {len(spec)} entries for "
                                 f"{len(args)} positional arguments; give one per argument (None for no change)")
        local_args = [_local(a, mesh, in_placements[i] if in_placements else None,
                             in_grad_placements[i] if in_grad_placements else None, func, i)
                      for i, a in enumerate(args)]
        local_kwargs = {k: _local(v, mesh, None, None, func, k) for k, v in kwargs.items()}
        result = func(*local_args, **local_kwargs)
        flat, spec = tree_flatten(result)
        tensors = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        if len(tensors) != len([o for o in outs if o is not None]):
            raise ValueError(f"custom_shard({func.__name__}): {len(tensors)} tensor outputs but "
                             f"{len(outs)} out_placements; give one placements tuple per tensor output")
        placements = iter(o for o in outs if o is not None)
        for i in tensors:
            flat[i] = DTensor.from_local(flat[i], mesh, tuple(next(placements)))
        return tree_unflatten(flat, spec)

    return wrapped


def _local(x, mesh: DeviceMesh, placements: Sequence | None, grad_placements: Sequence | None, func, where):
    if not isinstance(x, DTensor):
        if placements is not None and isinstance(x, torch.Tensor):
            raise TypeError(f"custom_shard({func.__name__}): argument {where} is a plain tensor but has "
                            f"in_placements {placements}; pass a DTensor (distribute_tensor) or None")
        return x
    if x.device_mesh is not mesh:
        raise ValueError(f"custom_shard({func.__name__}): argument {where} lives on {x.device_mesh}, not on {mesh}")
    if placements is not None:
        x = x.redistribute(mesh, tuple(placements))
    if grad_placements is None or not (torch.is_grad_enabled() and x.requires_grad):
        return x.to_local()
    return local_input(x, x.dist_layout, resolve_layout(mesh, tuple(grad_placements), x.ndim))


__all__ = ["custom_shard"]
