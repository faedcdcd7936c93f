"""Indexing: __getitem__ / __setitem__, gather / scatter / index_* ops, data-dependent ops and Python values.

Positions in an index refer to the global tensor, so a dim that an index selects from must be whole
(unless it takes the full range); other dims keep their splits. An index tensor split on its own dims
(token ids split over data-parallel ranks) may keep that split where the indexed tensor is replicated.
"""
from __future__ import annotations

import numbers

import torch

from ..dispatch.call import OpCall, Strategy
from .base import Partial, Rule, Shard, Signature, SignatureRule, REPLICATE
from .shape import ALL_OPS, LINEAR, main_strategy, norm_dim, replicate_all

_MASKS = (torch.bool, torch.uint8)


# ---- parsing an index ------------------------------------------------------------------------
class IndexPlan:
    """An index resolved against a tensor's global shape.

    `items`: per index entry in order, one of ("new",), ("int", dim, i), ("slice", dim, slice),
    ("adv", dims, ndim, input_number or None). `keep`: input dim -> output dim for full-range slices.
    `slice_out`: input dim -> output dim for every slice. `adv_first` / `adv_ndim`: where the advanced
    (tensor) index dims land in the output. `out_ndim`: rank of the result.
    """

    def __init__(self, index, shape: tuple):
        raw = index if type(index) is tuple else (index,)
        # tensors in the index are op inputs (numbered after x); lists become constant tensors
        entries = [_sequence_entry(e) if isinstance(e, (list, tuple)) else e for e in raw]
        is_input = [isinstance(e, torch.Tensor) for e in raw]
        ndim = len(shape)

        def consumed(e):
            if e is None or e is Ellipsis or isinstance(e, bool):
                return 0
            if isinstance(e, torch.Tensor) and e.dtype in _MASKS:
                return e.ndim
            return 1
        n_ell = ndim - sum(consumed(e) for e in entries if e is not Ellipsis)
        items, pos, n_inputs = [], 0, 0
        for k, e in enumerate(entries):
            if e is None or isinstance(e, bool):
                items.append(("new",))
            elif e is Ellipsis:
                for _ in range(n_ell):
                    items.append(("slice", pos, slice(None)))
                    pos += 1
            elif isinstance(e, torch.Tensor):
                number = None
                if is_input[k]:
                    n_inputs += 1
                    number = n_inputs
                else:  # a list's own tensors are inputs too (the dispatcher collects them): count them
                    n_inputs += sum(isinstance(b, torch.Tensor) for b in raw[k])
                if e.dtype in _MASKS:
                    items.append(("adv", tuple(range(pos, pos + e.ndim)), 1, None))  # data-dependent length
                    pos += e.ndim
                else:
                    items.append(("adv", (pos,), e.ndim, number))
                    pos += 1
            elif isinstance(e, slice):
                items.append(("slice", pos, e))
                pos += 1
            elif isinstance(e, numbers.Integral):
                items.append(("int", pos, int(e)))
                pos += 1
            else:
                raise TypeError(f"unsupported index entry {type(e).__name__}")
        for d in range(pos, ndim):
            items.append(("slice", d, slice(None)))
        post = [k for k, it in enumerate(items) if it[0] != "int"]
        advs = [k for k in post if items[k][0] == "adv"]
        adjacent = bool(advs) and post.index(advs[-1]) - post.index(advs[0]) == len(advs) - 1
        self.adv_ndim = max((items[k][2] for k in advs), default=0)
        self.adv_first = None if not advs or adjacent else 0
        out = 0 if self.adv_first is None else self.adv_ndim
        self.keep, self.slice_out = {}, {}
        for k in post:
            it = items[k]
            if it[0] == "adv":
                if self.adv_first is None:
                    self.adv_first = out
                    out += self.adv_ndim
                elif adjacent:
                    continue
            elif it[0] == "new":
                out += 1
            else:
                d, sl = it[1], it[2]
                self.slice_out[d] = out
                if range(shape[d])[sl] == range(shape[d]):
                    self.keep[d] = out
                out += 1
        self.items = items
        self.out_ndim = out
        self.has_adv = bool(advs)


def _sequence_entry(e):
    """A list or tuple in an index, as the tensor torch makes of it, for the plan's dtype and rank. Its elements may
    be 0-d tensors (`rows, cols = zip(*ind)` iterates a DTensor into 0-d DTensors): here, under the dispatcher, those
    are wrappers without data, so it is a meta tensor of the shape and dtype torch.as_tensor gives; the local op
    converts the elements' own (replicated) values."""
    tensors = [b for b in e if isinstance(b, torch.Tensor)]
    if tensors and len(tensors) == len(e) and not any(b.ndim for b in tensors):
        dtype = tensors[0].dtype
        for b in tensors[1:]:
            dtype = torch.promote_types(dtype, b.dtype)
        return torch.empty(len(e), dtype=dtype, device="meta")
    try:
        return torch.as_tensor(e)
    except RuntimeError as err:  # DTensors mixed with numbers, or not 0-d, or nested: decided from shapes alone
        raise TypeError("an index list holding DTensors that are not all 0-d (or mixed with numbers, or nested) "
                        "is not supported; make it one tensor (torch.stack) first") from err


def _plan(call: OpCall) -> IndexPlan:
    return IndexPlan(call.args[1], call.inputs[0].shape)


class GetItem(Rule):
    """x[index]: selected dims whole, full-range slices and untouched dims keep their splits."""

    def strategy(self, call: OpCall) -> Strategy:
        plan = _plan(call)
        if call.out_shapes is not None and len(call.out_shapes[0]) != plan.out_ndim:
            raise RuntimeError(f"{call.name}: index parsed to rank {plan.out_ndim}, torch says "
                               f"{len(call.out_shapes[0])}")
        strat = main_strategy(call, plan.keep, out_ndims=[plan.out_ndim])
        advs = [it for it in plan.items if it[0] == "adv"]
        if len(advs) == 1 and advs[0][3] is not None and call.out_shapes is not None:
            self._index_splits(call, strat, advs[0], plan)
        return strat

    @staticmethod
    def _index_splits(call, strat, adv, plan):
        """A lone integer index tensor keeps its splits on axes the indexed tensor does not use."""
        number = adv[3]
        spec = call.inputs[number]
        x_in = strat.in_layouts[0]
        out = strat.out_layouts[0] if isinstance(strat.out_layouts, list) else strat.out_layouts
        free = [a for a in spec.layout.sharded_axes if x_in.axis_dim[a] < 0 and x_in.partial[a] is None]
        if not free:
            return
        idx_map = [tuple(a for a in axes if a in free) for axes in spec.layout.tensor_map]
        out_map = [list(axes) for axes in out.tensor_map]
        for k, axes in enumerate(idx_map):
            out_map[plan.adv_first + k].extend(axes)
        strat.in_layouts[number] = spec.layout.with_map(idx_map, (None,) * spec.layout.mesh.ndim)
        strat.out_layouts = [out.with_map(out_map, out.partial)]


class SetItem(Rule):
    """x[index] = value, in place: x keeps its layout; the value is laid out like x's selected piece.

    A split dim indexed by an int or a slice (any step, negative bounds) is translated to this rank's
    piece (ranks outside the range write nothing); a pending sum in x receives the value on one rank only.
    """

    def strategy(self, call: OpCall) -> Strategy:
        masked = _masked_write(call)
        if masked is not None:
            return masked
        x = call.inputs[0]
        lay = x.layout
        mesh = lay.mesh
        plan = _plan(call)
        indexed = _tensor_indexed_write(call, plan)
        if indexed is not None:
            return indexed
        value = call.args[2] if len(call.args) > 2 else None
        v_spec = call.inputs[-1] if isinstance(value, torch.Tensor) else None
        r_nd = plan.out_ndim
        v_nd = v_spec.ndim if v_spec is not None else 0
        v_map = [[] for _ in range(v_nd)]
        v_partial = [None] * mesh.ndim
        translate = {}  # dim -> (offset, length) of this rank's piece
        for a in range(mesh.ndim):
            d = lay.axis_dim[a]
            if lay.partial[a] is not None:
                v_partial[a] = lay.partial[a]
            if d < 0:
                continue
            item = next(it for it in plan.items if it[0] != "new" and (it[1] == d if it[0] != "adv" else d in it[1]))
            if d in plan.keep:
                vd = plan.keep[d] - (r_nd - v_nd)
                if v_spec is not None and vd >= 0 and v_spec.shape[vd] == x.shape[d]:
                    v_map[vd].append(a)
            elif item[0] in ("int", "slice"):
                off = lay.local_offset(x.shape)[d]
                translate[d] = (off, lay.local_shape(x.shape)[d])
            else:
                self.fail(call, f"dim {d} is split over mesh axis {mesh.mesh_dim_names[a]!r} and indexed by "
                                f"a tensor; gather it first")
        ins = [lay] + [s.layout.replicated() for s in call.inputs[1:len(call.inputs) - (v_spec is not None)]]
        if v_spec is not None:
            order = {a: i for axes in lay.tensor_map for i, a in enumerate(axes)}
            v_map = [sorted(axes, key=lambda a: order.get(a, 0)) for axes in v_map]
            ins.append(v_spec.layout.with_map(v_map, v_partial))
        if plan.has_adv and translate:
            kept = {it[1] for it in plan.items if it[0] == "int" and it[1] in translate}
            if _adv_adjacent(plan.items, kept) != _adv_adjacent(plan.items, set()):
                self.fail(call, f"dims {sorted(kept)} are split and indexed by ints between tensor indices")
        root = all(mesh.coordinate[a] == 0 for a, p in enumerate(lay.partial) if p == "sum")
        zero_scalar = v_spec is None and not root
        if not translate and not zero_scalar:
            return Strategy(ins, [lay])
        return Strategy(ins, [lay], _local_setitem(plan, translate, x.shape, r_nd, v_nd, zero_scalar))


def _masked_write(call: OpCall) -> Strategy | None:
    """`x[mask] = rows` (`x[mask, :]`) with x split on the masked dims: each rank writes its own masked
    positions, taking from the replicated rows the ones whose global order (a cumsum of the full mask)
    falls in its piece. No communication beyond replicating mask and rows."""
    index = call.args[1] if len(call.args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    mask = parts[0]
    if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool) or \
            any(p is not Ellipsis and p != slice(None) for p in parts[1:]):
        return None
    x = call.inputs[0]
    lay = x.layout
    k = mask.ndim
    if lay.has_partial or not any(lay.tensor_map[:k]) or any(lay.tensor_map[k:]):
        return None
    offsets, sizes = lay.local_offset(x.shape)[:k], lay.local_shape(x.shape)[:k]
    piece = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
    row_nd = 1 + x.ndim - k

    def write(x_local, index, value):
        full = index[0] if isinstance(index, tuple) else index
        if isinstance(value, torch.Tensor) and value.ndim == row_nd and value.shape[0] not in (1, int(full.sum())):
            # decided from the replicated mask and rows, so every rank raises (torch's own error is per rank)
            raise RuntimeError(f"x[mask] = rows: the mask selects {int(full.sum())} rows but {value.shape[0]} "
                               f"were given")
        order = (full.flatten().cumsum(0) - 1).reshape(full.shape)
        mine = full[piece]
        many = isinstance(value, torch.Tensor) and value.ndim == row_nd and value.shape[0] != 1  # 1 row broadcasts
        rows = value[order[piece][mine]] if many else value
        x_local[mine] = rows

    ins = [lay] + [s.layout.replicated() for s in call.inputs[1:]]
    return Strategy(ins, [lay], write)


def _tensor_indexed_write(call: OpCall, plan: IndexPlan) -> Strategy | None:
    """`x[i, j, ...] = value` with x split only on dims indexed by integer tensors (the rest slices, e.g. a
    detection head writing per-sample query positions into a batch-split tensor): each rank writes the
    positions that fall in its piece, the value's matching entries taken from the replicated value (into a
    pending sum on one rank of its axes, zeros on the others). The
    indices and the value are replicated, so what each rank writes and any out-of-range index (raised on
    every rank) are decided from the same global data. None where another path applies."""
    x = call.inputs[0]
    lay = x.layout
    items = plan.items
    if any(p not in (None, "sum") for p in lay.partial) or any(it[0] not in ("adv", "slice") for it in items):
        return None
    # a pending sum receives the value on one rank of its axes (the others write zeros)
    root = all(lay.mesh.coordinate[a] == 0 for a, p in enumerate(lay.partial) if p == "sum")
    adv_dims = [it[1][0] for it in items if it[0] == "adv"]
    split = {d for d in range(x.ndim) if lay.tensor_map[d]}
    if not split or not split <= set(adv_dims) or any(len(it[1]) != 1 for it in items if it[0] == "adv"):
        return None
    raw = call.args[1] if type(call.args[1]) is tuple else (call.args[1],)
    if any(isinstance(e, torch.Tensor) and e.dtype in _MASKS for e in raw):
        return None
    shape = tuple(x.shape)
    pieces = dict(zip(range(x.ndim), zip(lay.local_offset(shape), lay.local_shape(shape))))
    lengths = [len(range(shape[it[1]])[it[2]]) for it in items if it[0] == "slice"]
    first = plan.adv_first

    def write(x_local, index, value):
        entries = index if type(index) is tuple else (index,)
        tensors = iter([torch.as_tensor(e, device=x_local.device) for e in entries
                        if isinstance(e, (torch.Tensor, list, tuple))])
        advs = [next(tensors) for _ in adv_dims]
        batch = torch.broadcast_shapes(*(t.shape for t in advs))
        mine = torch.ones(batch, dtype=torch.bool, device=x_local.device)
        local = []
        for d, t in zip(adv_dims, advs):
            t = t.expand(batch)
            if bool(((t < -shape[d]) | (t >= shape[d])).any()):   # replicated: every rank raises alike
                raise IndexError(f"x[...] = value: an index on dim {d} is out of bounds for size {shape[d]}")
            t = t % shape[d]
            if d in split:
                off, n = pieces[d]
                mine &= (t >= off) & (t < off + n)
                t = t - off
            local.append(t)
        local = iter([t[mine] for t in local])
        local_index = tuple(next(local) if it[0] == "adv" else it[2] for it in items)
        if isinstance(value, torch.Tensor):
            whole = lengths[:first] + list(batch) + lengths[first:]
            v = torch.broadcast_to(value, whole)
            v = v.flatten(first, first + len(batch) - 1) if batch else v.unsqueeze(first)
            value = v[(slice(None),) * first + (mine.flatten(),)]
            if not root:   # exact zeros (value * 0 would be nan at an inf), in the same autograd graph on every rank
                value = torch.where(torch.zeros((), dtype=torch.bool, device=value.device), value, 0.0)
        elif not root:
            value = type(value)(0) if isinstance(value, numbers.Number) else value
        x_local[local_index] = value

    ins = [lay] + [s.layout.replicated() for s in call.inputs[1:]]
    return Strategy(ins, [lay], write)


def _slice_piece(positions: range, offset: int, length: int) -> tuple[int, int, slice]:
    """The part of a slice's global `positions` that falls in the piece [offset, offset + length):
    (index of its first position among `positions`, how many, the local slice that writes them).
    Any step and any empty overlap give in-range numbers, so every rank computes without raising."""
    step = positions.step
    if not len(positions):
        return 0, 0, slice(0, 0)
    start = positions.start
    first = max(0, -(-(offset - start) // step))               # first k with start + k*step >= offset
    stop = min(len(positions), -(-(offset + length - start) // step))  # first k past the piece
    if stop <= first:
        return 0, 0, slice(0, 0)
    lo = start + first * step - offset
    return first, stop - first, slice(lo, lo + (stop - first - 1) * step + 1, step)


def _adv_adjacent(items: list, int_dims: set) -> bool:
    """Are the tensor indices adjacent once the ints on `int_dims` become one-wide slices? (torch then puts
    the indexed dims where the tensors are; otherwise first.) Other ints drop their dim before indexing."""
    post = [k for k, it in enumerate(items) if it[0] != "int" or it[1] in int_dims]
    advs = [k for k in post if items[k][0] == "adv"]
    return bool(advs) and post.index(advs[-1]) - post.index(advs[0]) == len(advs) - 1


def _local_setitem(plan: IndexPlan, translate: dict, shape: tuple, r_nd: int, v_nd: int, zero_scalar: bool):
    """The local write for this rank: global positions on split dims become local ones.

    An int on a split dim becomes a one-wide slice (empty on ranks that do not hold the position) and the value
    gets that dim (`steps`): `p` follows the value's dims, with the tensor indices' dims first or in place."""
    index, steps = [], []
    in_place = _adv_adjacent(plan.items, {it[1] for it in plan.items if it[0] == "int" and it[1] in translate})
    p = plan.adv_ndim if plan.has_adv and not in_place else 0
    adv_seen = False
    for it in plan.items:
        kind = it[0]
        if kind == "new":
            index.append(None)
            p += 1
        elif kind == "adv":
            index.append(("tensor",))
            if in_place and not adv_seen:
                p += plan.adv_ndim
            adv_seen = True
        elif kind == "slice":
            d, sl = it[1], it[2]
            if d in translate:
                first, count, local = _slice_piece(range(shape[d])[sl], *translate[d])
                index.append(local)
                steps.append(("narrow", p, first, count))
            else:
                index.append(sl)
            p += 1
        else:
            d, i = it[1], it[2] % shape[it[1]]
            if d in translate:
                off, n = translate[d]
                mine = off <= i < off + n
                index.append(slice(i - off, i - off + 1) if mine else slice(0, 0))
                steps.append(("unsqueeze", p))
                p += 1
            else:
                index.append(it[2])

    def fn(x, idx, value):
        tensors = iter([e for e in (idx if type(idx) is tuple else (idx,)) if isinstance(e, (torch.Tensor, list, tuple))])
        local_idx = tuple(next(tensors) if e == ("tensor",) else e for e in index)
        if isinstance(value, torch.Tensor):
            v = value.reshape((1,) * (r_nd - v_nd) + tuple(value.shape)) if r_nd > v_nd else value
            for step in steps:
                if step[0] == "unsqueeze":
                    v = v.unsqueeze(step[1])
                elif v.shape[step[1]] != 1:
                    v = v.narrow(step[1], step[2], step[3])
            value = v
        elif zero_scalar:
            value = type(value)(0) if isinstance(value, numbers.Number) else value
        x[local_idx] = value
    return fn


# ---- gather / scatter families -----------------------------------------------------------------
class IndexSelect(SignatureRule):
    """index_select(x, dim, index): other dims keep splits; a split index splits the output's dim."""

    def signatures(self, call: OpCall) -> list:
        x = call.inputs[0]
        dim = norm_dim(call.arg(1, "dim"), x.ndim)
        sigs = [Signature([Shard(e)], [Shard(e), REPLICATE]) for e in range(x.ndim) if e != dim]
        sigs.append(Signature([Shard(dim)], [REPLICATE, Shard(0)]))
        sigs += [Signature([Partial(op)], [Partial(op), REPLICATE]) for op in ALL_OPS]
        return sigs


class Gather(SignatureRule):
    """gather / take_along_dim: output dims follow the index; dims other than `dim` may split both alike."""

    dim_index = 1

    def strategy(self, call: OpCall) -> Strategy:
        strat = super().strategy(call)
        if call.arg(self.dim_index, "dim") is None:  # take_along_dim flattens with .view: gathered pieces
            func = call.func                           # need not be contiguous

            def flat(x, idx, *args, **kwargs):
                return func(x.contiguous(), idx.contiguous(), *args, **kwargs)
            strat.local_fn = flat
        return strat

    def signatures(self, call: OpCall) -> list:
        x, idx = call.inputs[0], call.inputs[1]
        dim = call.arg(self.dim_index, "dim")
        if dim is None or call.out_shapes is None or x.ndim != idx.ndim:
            return []
        out = call.out_shapes[0]
        dim = norm_dim(dim, x.ndim)
        sigs = []
        for e in range(x.ndim):  # positions along dims other than `dim` pair x with the index one to one
            if idx.shape[e] == out[e] and out[e] > 1:
                if e == dim:
                    sigs.append(Signature([Shard(e)], [REPLICATE, Shard(e)]))
                elif x.shape[e] == out[e]:
                    sigs.append(Signature([Shard(e)], [Shard(e), Shard(e)]))
        sigs += [Signature([Partial(op)], [Partial(op), REPLICATE]) for op in ALL_OPS]
        return sigs


class Scatter(SignatureRule):
    """scatter / scatter_add / index_add / index_copy (and in-place forms): x, index and source split alike
    on dims other than `dim`; pending reductions pass when x and source carry them (sums only for adds).

    `index_split`: the index shares x's dims (scatter) rather than being a 1-D list (index_*).
    """

    accumulate = False
    index_split = True

    def strategy(self, call: OpCall) -> Strategy:
        rows = self._rows_strategy(call)
        return rows if rows is not None else super().strategy(call)

    def _rows_strategy(self, call: OpCall) -> Strategy | None:
        """index_add / index_copy (a 1-D index) into x split on the indexed dim only, nothing pending: each rank
        writes the source rows whose index falls in its own rows (`_RowsOfThisRank`), x keeps its layout (what
        an in-place `index_add_` into a batch-split tensor needs: Switch Transformers' experts). The index and
        the source are read whole; the source's gradient is this rank's rows, a pending sum (the duality)."""
        if self.index_split or len(call.inputs) != 3:
            return None
        x, idx, src = call.inputs
        if not x.ndim or idx.ndim != 1:
            return None
        dim = norm_dim(call.arg(1, "dim"), x.ndim)
        lay = x.layout
        if (not lay.tensor_map[dim] or lay.has_partial or idx.layout.has_partial or src.layout.has_partial
                or any(lay.tensor_map[d] for d in range(x.ndim) if d != dim)):
            return None
        return Strategy([lay, idx.layout.replicated(), src.layout.replicated()], [lay],
                        local_fn=_RowsOfThisRank(call.func, lay, tuple(x.shape), dim))

    def signatures(self, call: OpCall) -> list:
        x = call.inputs[0]
        dim = norm_dim(call.arg(1, "dim"), x.ndim)
        n = len(call.inputs)
        reduce_arg = call.kwargs.get("reduce") is not None or len(call.args) > 4 and isinstance(call.args[4], str)
        idx = call.inputs[1]
        src = call.inputs[2] if n == 3 else None
        follow = ([idx] if self.index_split else []) + ([src] if src is not None else [])
        sigs = []
        for e in range(x.ndim):
            if e != dim and x.shape[e] > 1 and all(s.ndim == x.ndim and s.shape[e] == x.shape[e] for s in follow):
                ins = [Shard(e), Shard(e) if self.index_split else REPLICATE] + ([Shard(e)] if src is not None else [])
                sigs.append(Signature([Shard(e)], ins))
        if reduce_arg:
            return sigs
        if n == 3:  # a tensor source: pending reductions pass when x and source both hold terms
            for op in (LINEAR if self.accumulate else ALL_OPS):
                sigs.append(Signature([Partial(op)], [Partial(op), REPLICATE, Partial(op)]))
        return sigs



class _RowsOfThisRank:
    """`func(x_local, dim, index, source, ...)` restricted to the rows of `dim` this rank holds: the index entries in
    [offset, offset + rows) shifted to local rows, with their source slices (torch refuses out-of-range indices on
    one device; here every rank sees the whole index, so each entry lands on exactly one rank)."""

    def __init__(self, func, layout, shape: tuple, dim: int):
        self.func, self.dim, self.total = func, dim, shape[dim]
        self.offset = layout.local_offset(shape)[dim]
        self.rows = layout.local_shape(shape)[dim]

    def __call__(self, x, dim, index, source, *rest, **kwargs):
        # an index torch would refuse on one device must not vanish between the ranks' ranges: every rank holds
        # the whole index, so every rank raises here or none does
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.total):
            raise IndexError(f"{getattr(self.func, '__name__', self.func)}: index out of range for dim {self.dim} of "
                             f"size {self.total} (values {int(index.min())}..{int(index.max())})")
        mine = (index >= self.offset) & (index < self.offset + self.rows)
        picked = mine.nonzero().squeeze(1)
        src_dim = self.dim if source.ndim else 0
        local_source = source.index_select(src_dim, picked) if source.ndim else source
        return self.func(x, dim, index[picked] - self.offset, local_source, *rest, **kwargs)

# ---- data-dependent results and Python values ------------------------------------------------
def _dummy_out_ndims(call: OpCall) -> list:
    """Ranks of the op's tensor outputs, found by running it on tiny tensors (they do not depend on data)."""
    from ..dispatch.dispatcher import _collect, _swap_args
    dummies = [torch.zeros((1,) * s.ndim, dtype=s.dtype) for s in call.inputs]
    args, kwargs = _swap_args(call.args, call.kwargs, dummies)
    with torch.no_grad():
        out = call.func(*args, **kwargs)
    found = []
    _collect([tuple(out) if isinstance(out, tuple) else out], found)
    return [t.ndim for t in found]


class Replicated(Rule):
    """Ops whose results depend on the data (nonzero, unique, masked_select) or leave torch (item,
    tolist, bool, int, float, index): every input is gathered, results are replicated."""

    def strategy(self, call: OpCall) -> Strategy:
        ndims = [len(s) for s in call.out_shapes] if call.out_shapes is not None else _dummy_out_ndims(call)
        return replicate_all(call, ndims)


__all__ = ["GetItem", "SetItem", "IndexSelect", "Gather", "Scatter", "Replicated", "IndexPlan"]
