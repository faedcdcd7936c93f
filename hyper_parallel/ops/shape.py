"""Shape ops: views, permutations, expansion, concatenation and splitting.

Also home of the helpers the indexing and reduction families share: `derive` turns "which input dims
keep their splits, and where they land" into input and output layouts, `main_strategy` wraps it for
ops with one main tensor, and `dims_arg` normalises dim arguments.

Data movement never mixes elements, so every pending reduction (Partial of any op) passes through.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Iterable

import torch

from ..dispatch.call import LocalReshape, OpCall, Strategy
from ..layout.chunks import piece
from ..layout.layout import Layout, replicate_layout
from .base import Partial, Rule, Shard, Signature, SignatureRule

ALL_OPS = ("sum", "avg", "max", "min")   # data movement: every pending reduction passes
LINEAR = ("sum", "avg")                  # linear maps: pending sums pass
NONE: tuple = ()                         # pending reductions must be done first


# ---- shared helpers --------------------------------------------------------------------------
def norm_dim(d: int, ndim: int) -> int:
    """A dim argument as a non-negative index (0-d tensors accept 0 and -1)."""
    n = max(ndim, 1)
    if not -n <= d < n:
        raise IndexError(f"dim {d} is out of range for a tensor of rank {ndim}")
    return d % n if ndim else 0


def dims_arg(value, ndim: int) -> tuple:
    """Dims named by an int / sequence / None argument; None and () mean every dim."""
    if value is None or (isinstance(value, (tuple, list)) and len(value) == 0):
        return tuple(range(ndim))
    if isinstance(value, (tuple, list, torch.Size)):
        return tuple(sorted({norm_dim(int(v), ndim) for v in value}))
    return (norm_dim(int(value), ndim),)


def even_limit(layout: Layout, shape: tuple) -> Callable[[int, tuple], int]:
    """Keep only splits that cut `shape` evenly (ops without a meta kernel: the dispatcher assumes even)."""
    mesh = layout.mesh

    def limit(d: int, axes: tuple) -> int:
        n = 0
        count = 1
        for a in axes:
            count *= mesh.shape[a]
            if shape[d] % count:
                break
            n += 1
        return n
    return limit


def nonempty_limit(layout: Layout, shape: tuple) -> Callable[[int, tuple], int]:
    """Keep only splits that leave every rank a non-empty piece (local max/min need an element)."""
    mesh = layout.mesh

    def limit(d: int, axes: tuple) -> int:
        n = 0
        for k in range(1, len(axes) + 1):
            ranges = [range(mesh.shape[a]) for a in axes[:k]]
            if any(piece(shape[d], list(zip([mesh.shape[a] for a in axes[:k]], c)))[1] == 0
                   for c in itertools.product(*ranges)):
                break
            n = k
        return n
    return limit


def derive(layout: Layout, out_ndim: int, keep: dict, reduced: dict | None = None,
           passes: Iterable[str] = ALL_OPS, limit: Callable[[int, tuple], int] | None = None,
           reduced_limit: Callable[[int, tuple], int] | None = None) -> tuple[Layout, Layout]:
    """(target input layout, output layout) for an op on one tensor.

    `keep` maps input dims whose splits survive to their output dim; `reduced` maps input dims whose
    splits turn into a pending reduction of the output (a sum over a split dim) to the reduce op.
    Every other split is gathered first; pending reductions not in `passes` are done first.
    `limit(dim, axes)` may keep only a leading part of a dim's axes (the rest are gathered).
    """
    mesh = layout.mesh
    in_map, out_map = [], [[] for _ in range(out_ndim)]
    in_partial = list(layout.partial)
    out_partial = [None] * mesh.ndim
    passes = tuple(passes)
    for a, op in enumerate(layout.partial):
        if op is not None:
            if op in passes:
                out_partial[a] = op
            else:
                in_partial[a] = None
    for d, axes in enumerate(layout.tensor_map):
        if d in keep:
            n = len(axes) if limit is None else limit(d, axes)
            in_map.append(axes[:n])
            out_map[keep[d]].extend(axes[:n])
        elif reduced and d in reduced:
            n = len(axes) if reduced_limit is None else reduced_limit(d, axes)
            in_map.append(axes[:n])
            for a in axes[:n]:
                out_partial[a] = reduced[d]
        else:
            in_map.append(())
    return layout.with_map(in_map, in_partial), layout.with_map(out_map, out_partial)


def main_strategy(call: OpCall, keep: dict, reduced: dict | None = None, passes: Iterable[str] = ALL_OPS,
                  limit=None, reduced_limit=None, out_ndims: list | None = None, local_fn=None,
                  other: str = "replicate", grad_layouts=None) -> Strategy:
    """Strategy for ops on one main tensor (input 0): the others are replicated, or kept as they are
    (`other="keep"`: tensors that only donate a shape, like expand_as's argument)."""
    x = call.inputs[0]
    if out_ndims is None:
        out_ndims = [len(s) for s in call.out_shapes] if call.out_shapes is not None else [x.ndim]
    if call.out_shapes is None and limit is None:
        limit = even_limit(x.layout, x.shape)
    nd = out_ndims[0] if out_ndims else 0
    keep = {d: e for d, e in keep.items() if e < nd}
    in_lay, out_lay = derive(x.layout, nd, keep, reduced, passes, limit, reduced_limit)
    ins = [in_lay]
    for spec in call.inputs[1:]:
        ins.append(spec.layout if other == "keep" else spec.layout.replicated())
    outs = [out_lay if n == nd else replicate_layout(x.layout.mesh, n) for n in out_ndims]
    if len(outs) == 1 and call.out_shapes is None:
        outs = outs[0]
    return Strategy(ins, outs, local_fn, grad_layouts)


def replicate_all(call: OpCall, out_ndims: list | None = None) -> Strategy:
    """Gather every input: the always-correct fallback (and the only plan for data-dependent outputs)."""
    mesh = call.mesh
    ins = [s.layout.replicated() for s in call.inputs]
    if out_ndims is None:
        out_ndims = [len(s) for s in call.out_shapes] if call.out_shapes is not None else None
    if out_ndims is None:
        return Strategy(ins, replicate_layout(mesh, call.inputs[0].ndim if call.inputs else 0))
    return Strategy(ins, [replicate_layout(mesh, n) for n in out_ndims])


def local_shape(layout: Layout, shape: tuple) -> tuple:
    return layout.local_shape(tuple(shape))


# ---- views -----------------------------------------------------------------------------------
def view_groups(in_shape: tuple, out_shape: tuple) -> list | None:
    """Pairs (input dims, output dims) of non-singleton dims holding the same elements, in order."""
    if math.prod(in_shape) == 0:
        return None
    ii = [d for d, n in enumerate(in_shape) if n != 1]
    oo = [d for d, n in enumerate(out_shape) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(ii) and j < len(oo):
        gi, gj = [ii[i]], [oo[j]]
        pi, pj = in_shape[ii[i]], out_shape[oo[j]]
        i += 1
        j += 1
        while pi != pj:
            if pi < pj:
                pi *= in_shape[ii[i]]
                gi.append(ii[i])
                i += 1
            else:
                pj *= out_shape[oo[j]]
                gj.append(oo[j])
                j += 1
        groups.append((gi, gj))
    return groups


def view_plan(layout: Layout, in_shape: tuple, out_shape: tuple):
    """keep and limit for a view: the outermost dim of a group may stay split when every rank's piece is
    the same run of elements before and after (checked on global shapes, uneven splits included)."""
    groups = view_groups(in_shape, out_shape)
    if groups is None:
        return {}, None
    mesh = layout.mesh
    keep, info = {}, {}
    for gi, gj in groups:
        d, e = gi[0], gj[0]
        keep[d] = e
        info[d] = (math.prod(in_shape[g] for g in gi[1:]), out_shape[e], math.prod(out_shape[g] for g in gj[1:]))

    def limit(d: int, axes: tuple) -> int:
        inner_in, out_len, inner_out = info[d]
        n = 0
        for k in range(1, len(axes) + 1):
            parts = [mesh.shape[a] for a in axes[:k]]
            ok = True
            for c in itertools.product(*[range(p) for p in parts]):
                o1, s1 = piece(in_shape[d], list(zip(parts, c)))
                o2, s2 = piece(out_len, list(zip(parts, c)))
                if (o1 * inner_in, s1 * inner_in) != (o2 * inner_out, s2 * inner_out):
                    ok = False
                    break
            if not ok:
                break
            n = k
        return n
    return keep, limit


class View(Rule):
    """view / reshape / flatten / unflatten / view_as / reshape_as: local reshape to the local output shape."""

    def strategy(self, call: OpCall) -> Strategy:
        x = call.inputs[0]
        first = call.arg(1, "dtype")
        if isinstance(first, torch.dtype):  # Tensor.view(dtype): reinterprets the last dim
            same = first.itemsize == x.dtype.itemsize
            keep = {d: d for d in range(x.ndim) if same or d < x.ndim - 1}
            return main_strategy(call, keep, passes=NONE)  # bits of a pending sum are not its bits
        out_shape = call.out_shapes[0] if call.out_shapes is not None else self._shape_from_tensor_sizes(call)
        if out_shape is None:
            return replicate_all(call)
        keep, limit = view_plan(x.layout, x.shape, out_shape)
        in_lay, out_lay = derive(x.layout, len(out_shape), keep, None, ALL_OPS, limit)
        # reshape even for view: a gathered local piece need not be contiguous, though the global is
        fn = LocalReshape(local_shape(out_lay, out_shape))
        ins = [in_lay] + [s.layout for s in call.inputs[1:]]  # view_as's argument only gives a shape
        return Strategy(ins, [out_lay], fn)

    def _shape_from_tensor_sizes(self, call: OpCall) -> tuple | None:
        """view(b, n, ...) with a size given as a 0-d integer tensor (`seq_len // w` computed on tensors): the
        meta run cannot read it, so read it here (a plain tensor, or a replicated DTensor's local value).
        The decision cache keys tensors by shape, not value, so a size the tensor alone decides (with a
        -1 beside it, or two tensor sizes) could be replayed for another value: refused."""
        sizes = list(call.args[1:])
        if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
            sizes = list(sizes[0])
        tensors = [v for v in sizes if isinstance(v, torch.Tensor)]
        if not tensors or any(v.ndim or v.is_floating_point() or v.is_complex() for v in tensors):
            return None
        local = [getattr(v, "_local", v) for v in tensors]
        if any(getattr(v, "_layout", None) is not None and not v._layout.is_replicate for v in tensors):
            return None
        if len(tensors) > 1 or any(not isinstance(v, torch.Tensor) and v == -1 for v in sizes):
            self.fail(call, "a size given as a tensor beside -1 or another tensor size; give it as an int")
        values = iter(int(v) for v in local)
        ints = [next(values) if isinstance(v, torch.Tensor) else v for v in sizes]
        return tuple(torch.empty(call.inputs[0].shape, device="meta").view(ints).shape)


def _probe(shape: tuple):
    """A meta tensor whose strides name its dims, so a view's output strides say where each dim went."""
    strides = tuple(1009 * (i + 1) for i in range(len(shape)))
    return torch.empty_strided(shape, strides, device="meta"), strides


def probe_keep(call: OpCall) -> dict:
    """Input dim -> output dim for a strided view op (transpose, permute, movedim, squeeze, unsqueeze)."""
    x = call.inputs[0]
    probe, strides = _probe(x.shape)
    out = call.func(probe, *call.args[1:], **call.kwargs)
    keep = {}
    for j, (n, s) in enumerate(zip(out.shape, out.stride())):
        if n > 1 and s in strides:
            d = strides.index(s)
            if x.shape[d] == n:
                keep[d] = j
    return keep


class Permute(Rule):
    """transpose / t / permute / swapaxes / movedim / unsqueeze / select: splits follow their dims (a
    selected dim disappears from the output, so it is gathered first)."""

    def strategy(self, call: OpCall) -> Strategy:
        return main_strategy(call, probe_keep(call))


class Squeeze(Permute):
    """squeeze: the local op must drop only globally size-1 dims (a split dim can be locally size 1)."""

    def strategy(self, call: OpCall) -> Strategy:
        x = call.inputs[0]
        dim = call.arg(1, "dim")
        dims = dims_arg(dim, x.ndim)
        drop = tuple(d for d in dims if x.shape[d] == 1)

        def fn(t, *args, **kwargs):
            return torch.squeeze(t, drop) if drop else t.view(t.shape)
        return main_strategy(call, probe_keep(call), local_fn=fn)


class Expand(Rule):
    """expand / expand_as / broadcast_to: a dim keeps its split when it is not broadcast."""

    def strategy(self, call: OpCall) -> Strategy:
        x = call.inputs[0]
        out_shape = call.out_shapes[0]
        lead = len(out_shape) - x.ndim
        keep = {d: d + lead for d in range(x.ndim) if x.shape[d] == out_shape[d + lead]}
        strat = main_strategy(call, keep, other="keep")
        local_out = local_shape(strat.out_layouts[0], out_shape)
        strat.local_fn = lambda t, *args, **kwargs: t.expand(local_out)
        return strat


class Repeat(Rule):
    """Tensor.repeat: dims repeated once keep their splits (counts are multipliers, so args stay global)."""

    count_name = "repeats"

    def counts(self, call: OpCall) -> tuple:
        reps = call.args[1:]
        if len(reps) == 1 and isinstance(reps[0], (tuple, list, torch.Size)):
            reps = reps[0]
        return tuple(int(r) for r in (reps or call.kwargs.get(self.count_name, ())))

    def strategy(self, call: OpCall) -> Strategy:
        x = call.inputs[0]
        reps = self.counts(call)
        lead = len(reps) - x.ndim
        keep = {d: d + lead for d in range(x.ndim) if reps[d + lead] == 1}
        return main_strategy(call, keep)


class Tile(Repeat):
    """Tensor.tile / torch.tile: Tensor.repeat with fewer counts than dims allowed (the leading dims count 1)."""

    count_name = "dims"

    def counts(self, call: OpCall) -> tuple:
        reps = super().counts(call)
        return (1,) * (call.inputs[0].ndim - len(reps)) + reps


class RepeatInterleave(Rule):
    """repeat_interleave: the repeated dim must be whole; without dim the input is flattened."""

    def strategy(self, call: OpCall) -> Strategy:
        x = call.inputs[0]
        dim = call.arg(2, "dim")
        if dim is None or call.out_shapes is None or len(call.args) < 2 and "repeats" not in call.kwargs:
            return replicate_all(call, [1 if dim is None else x.ndim])
        dim = norm_dim(dim, x.ndim)
        return main_strategy(call, {d: d for d in range(x.ndim) if d != dim})


class Split(Rule):
    """split / chunk / tensor_split / unbind / narrow: the cut dim must be whole, others keep."""

    dim_index = 2
    dim_default = 0
    removes_dim = False

    def strategy(self, call: OpCall) -> Strategy:
        x = call.inputs[0]
        dim = norm_dim(call.arg(self.dim_index, "dim", self.dim_default), x.ndim)
        if self.removes_dim:
            keep = {d: d - (d > dim) for d in range(x.ndim) if d != dim}
        else:
            keep = {d: d for d in range(x.ndim) if d != dim}
        return main_strategy(call, keep)


class Cat(SignatureRule):
    """cat / concat / stack: any dim but the joined one keeps a split that all inputs share."""

    stack = False

    def signatures(self, call: OpCall) -> list:
        n = len(call.inputs)
        nds = {s.ndim for s in call.inputs}
        if len(nds) != 1 or call.out_shapes is None:
            return []
        nd = nds.pop()
        out_nd = nd + 1 if self.stack else nd
        dim = norm_dim(call.arg(1, "dim", 0), out_nd)
        sigs = []
        for e in range(nd):
            o = e + 1 if self.stack and e >= dim else e
            if o != dim or self.stack:
                if call.out_shapes[0][o] > 1:
                    sigs.append(Signature([Shard(o)], [Shard(e)] * n))
        for op in ALL_OPS:
            sigs.append(Signature([Partial(op)], [Partial(op)] * n))
        return sigs


__all__ = ["View", "Permute", "Squeeze", "Expand", "Repeat", "RepeatInterleave", "Split", "Cat", "derive",
           "main_strategy", "replicate_all", "dims_arg", "norm_dim", "ALL_OPS", "LINEAR", "NONE"]
