"""Rules for the ops that are neither matmul-like, shape/indexing/reduction, nor plain pointwise.

Factories that take tensor arguments (`x.new_zeros`, `torch.full(n)` with a 0-d tensor `n`), dtype
queries, values handed back to Python (`bool(t)`, `int(t)`), random ops, the optimizers' `_foreach`
ops, convolutions, padding, interpolation, and ops whose distributed form is not worth more than a
gather (`Replicated`). Each class says which layouts it accepts; anything else is gathered first, so
a result is never silently wrong.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch.call import OpCall, Strategy
from ..layout.layout import Layout, replicate_layout
from .base import Partial, Rule, Shard, Signature, SignatureRule, REPLICATE

_P = Partial("sum")


def _repl(spec) -> Layout:
    return spec.layout.replicated()


def _out_layouts(call: OpCall, base: Layout, ndims=None) -> list[Layout]:
    """Replicated layouts for every tensor output (from the meta shapes, else from the rule's `out_ndims`;
    without either, every output is replicated whatever its rank)."""
    if call.out_shapes is not None:
        return [replicate_layout(base.mesh, len(s)) for s in call.out_shapes]
    if ndims:
        return [replicate_layout(base.mesh, n) for n in ndims]
    return Strategy.REPLICATED


def _local_piece(full: Tensor, layout: Layout) -> Tensor:
    """This rank's shard of a full tensor under `layout` (nested torch.chunk ranges)."""
    if not layout.sharded_axes:
        return full
    shape = tuple(full.shape)
    offsets = layout.local_offset(shape)
    sizes = layout.local_shape(shape)
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


def _full_like(local: Tensor, shape: tuple) -> Tensor:
    """An uninitialised tensor of the global `shape` laid out in memory in the order of `local`'s strides, the
    stand-in for x that a random op on a split x draws in full. Random `*_like` ops, in-place fills and dropout's
    mask (`empty_like(x).bernoulli_`) fill memory in order, so on one device a transposed x (VITS's
    `randn_like(prior_means)` after `.transpose(1, 2)`) gets its values in another arrangement than a contiguous
    one: the stand-in must be ordered as the single-device x is (its shard's order is the global one's)."""
    order = sorted(range(local.ndim), key=lambda d: -local.stride(d))  # outermost first; ties keep dim order
    full = torch.empty([shape[d] for d in order], dtype=local.dtype, device=local.device)
    return full.permute([order.index(d) for d in range(local.ndim)])


class Replicated(Rule):
    """Gather every input (resolving pending sums), run the op on full values, replicate the outputs.

    For ops whose sharded form is data-dependent or not worth a dedicated rule (histogram-free
    sorting helpers, grouped matmul, padding a list of sequences, masked scatter). Correct for any
    layout; the cost is the gather. `out_ndims` (YAML) gives the output ranks of ops without a meta kernel.
    """

    out_ndims = None

    def strategy(self, call: OpCall) -> Strategy:
        base = call.inputs[0].layout
        return Strategy([_repl(s) for s in call.inputs], _out_layouts(call, base, self.out_ndims))


class Query(Rule):
    """Ops that read only metadata (`torch.is_complex`, `x.type()`): inputs stay where they are."""

    def strategy(self, call: OpCall) -> Strategy:
        base = call.inputs[0].layout
        return Strategy([s.layout for s in call.inputs], _out_layouts(call, base))


class ScalarValue(Rule):
    """A value handed to Python (`bool(t)`, `int(t)`, `t.__index__()`): the global value, on every rank."""

    def strategy(self, call: OpCall) -> Strategy:
        return Strategy([_repl(s) for s in call.inputs], [])


class TypeCast(Rule):
    """`x.type()` is a metadata query (a string); `x.type(dtype)` is a cast that keeps the layout."""

    def strategy(self, call: OpCall) -> Strategy:
        dtype = call.arg(1, "dtype")
        if dtype is None:
            return Strategy([s.layout for s in call.inputs], [])
        src = call.inputs[0].layout.without_partial()
        return Strategy([src], [src])


def _sizes_only(args: tuple) -> bool:
    """Are `x.new(*args)`'s arguments sizes (ints, or one torch.Size) rather than data (a list, a tuple)?"""
    return all(type(a) is int for a in args) or (len(args) == 1 and type(args[0]) is torch.Size)


class NewFactory(Rule):
    """`x.new_zeros(size)`, `x.new_full(size, v)`, `x.new_empty(size)`, `x.new_tensor(data)`: `x` gives only
    dtype and device.

    `x` stays where it is (no communication); tensors among the other arguments (0-d sizes, fill
    values, data) are needed by value and are replicated. A new tensor of x's rank keeps x's split on
    every dim whose size it keeps (each rank makes only its piece: the values are one constant, or
    uninitialised, so any layout holds them exactly) — DeepSeek's MLA builds its keys with
    `kv.new_empty(...)` and copies the sequence-split parts in, which must stay split under context
    parallelism. Any other new tensor (another rank, `new_tensor`'s data) is replicated.
    """

    def strategy(self, call: OpCall) -> Strategy:
        first = call.inputs[0]
        ins = [first.layout] + [_repl(s) for s in call.inputs[1:]]
        split = self._split_like_source(call)
        if split is None:
            return Strategy(ins, _out_layouts(call, first.layout))
        local = split.local_shape(call.out_shapes[0])
        func = call.func

        def local_fn(x, *args, **kwargs):
            if "size" in kwargs:
                kwargs = dict(kwargs, size=local)
            elif args and isinstance(args[0], (tuple, list)):
                args = (torch.Size(local),) + args[1:]   # x.new(sequence) reads a torch.Size as sizes, others as data
            else:  # x.new_zeros(2, 8, 4), x.new(2, 8, 4): every positional argument is a size
                args = tuple(local)
            return func(x, *args, **kwargs)
        return Strategy(ins, [split], local_fn)

    @staticmethod
    def _split_like_source(call: OpCall) -> Layout | None:
        """x's layout on the dims the new tensor keeps the size of (the others whole), or None."""
        first, shapes = call.inputs[0], call.out_shapes
        if (call.name.endswith("new_tensor") or (call.name.endswith(".new") and not _sizes_only(call.args[1:]))
                or len(call.inputs) != 1 or shapes is None or len(shapes) != 1
                or len(shapes[0]) != len(first.shape) or not first.layout.sharded_axes):
            return None
        kept = [axes if n == m else () for axes, n, m in zip(first.layout.tensor_map, shapes[0], first.shape)]
        if not any(kept):
            return None
        return first.layout.with_map(kept, (None,) * first.layout.mesh.ndim)


class Factory(Rule):
    """`torch.full(n, v)`, `torch.arange(n)`, `torch.zeros(n, m)` given 0-d tensors: their values, replicated.

    A size given as a tensor has no meta kernel, so the output rank comes from the size argument
    (`out_ndims` in YAML for factories whose rank is fixed, like arange).
    """

    out_ndims = None

    def strategy(self, call: OpCall) -> Strategy:
        base = call.inputs[0].layout
        ndims = self.out_ndims
        if ndims is None and call.out_shapes is None:
            size = call.arg(0, "size", ())
            if isinstance(size, (list, tuple)):
                ndims = [len(size)]
            else:  # torch.zeros(n, m): every leading positional argument is a size
                ndims = [sum(1 for a in call.args if not isinstance(a, (list, tuple, str)) and a is not None
                             and not isinstance(a, (float, torch.dtype, torch.device)))]
        return Strategy([_repl(s) for s in call.inputs], _out_layouts(call, base, ndims))


class Like(Rule):
    """`torch.full_like(x, v)`, `torch.empty_like(x)`: the new tensor has x's layout (without pending sums).

    Random `*_like` ops (`rand_like`, `randn_like`, `randint_like`) on a split `x` draw the full tensor on
    every rank and keep this rank's piece, so the values equal the single-device ones for the same seed.
    """

    random = False

    def strategy(self, call: OpCall) -> Strategy:
        src = call.inputs[0].layout
        out = src.without_partial()
        ins = [src] + [_repl(s) for s in call.inputs[1:]]
        local_fn = None
        if self.random and out.sharded_axes:
            func, shape = call.func, call.inputs[0].shape

            def local_fn(x, *args, **kwargs):
                full = func(_full_like(x, shape), *args, **kwargs)
                return _local_piece(full, out).clone(memory_format=torch.preserve_format)
        return Strategy(ins, [out], local_fn)


class RandomFill(Rule):
    """In-place random fills (`uniform_`, `normal_`, `bernoulli_`, ...): the layout is kept.

    A split tensor is filled by drawing the full tensor and copying this rank's piece, which matches the
    single-device values when every rank has the same generator state (as they do after the same seed).
    """

    def strategy(self, call: OpCall) -> Strategy:
        target = call.inputs[0]
        if target.layout.has_partial:
            self.fail(call, "a random fill of a tensor with a pending sum")
        ins = [target.layout] + [_repl(s) for s in call.inputs[1:]]
        local_fn = None
        if target.layout.sharded_axes:
            func, shape, layout = call.func, target.shape, target.layout

            def local_fn(x, *args, **kwargs):
                full = _full_like(x, shape)
                func(full, *args, **kwargs)
                return x.copy_(_local_piece(full, layout))
        return Strategy(ins, [target.layout], local_fn)


class Dropout(Rule):
    """`F.dropout` and the channel-wise variants.

    Identity when not training or `p == 0` (any layout, pending sums included). When it drops, a split
    input is multiplied by this rank's piece of the full mask (`dropout(ones(full_shape))`), which is
    exactly what the single-device op computes for the same generator state.
    """

    float_args_matter = True   # p == 0 is the identity; any other p draws a mask

    def _p_training(self, call: OpCall):
        p = call.arg(1, "p", 0.5)
        training = call.arg(2, "training", call.kwargs.get("train", True))  # torch.dropout names it `train`
        return p, training

    def strategy(self, call: OpCall) -> Strategy:
        x = call.inputs[0]
        p, training = self._p_training(call)
        if not training or p == 0:
            return Strategy([x.layout], [x.layout])
        layout = x.layout.without_partial()
        if not layout.sharded_axes:
            return Strategy([layout], [layout])
        func, shape = call.func, x.shape

        def local_fn(inp, *args, **kwargs):
            kwargs = {k: v for k, v in kwargs.items() if k != "inplace"}
            args = args[:2] if len(args) > 2 else args
            mask = func(_full_like(inp, shape).fill_(1), *args, **kwargs)
            return inp * _local_piece(mask, layout)
        return Strategy([layout], [layout], local_fn)


def _whole_batch_stride(x: Tensor) -> Tensor:
    """x, with its batch dim's stride the one the whole batch has when this rank holds a batch of one.

    A size-1 dim's stride addresses nothing, so torch leaves whatever a view computes there (a reshape of a
    permuted (1, hw, c) piece gets stride c, the whole batch's piece h*w*c). Convolution kernels pick their
    memory format from all strides (`suggest_memory_format`): with the odd one a channels-last piece runs, and
    its output stays, contiguous where the single-device op runs channels-last, and a later random op then
    draws in another memory order (dropout's mask: other values than one device's, DPT's auxiliary head).
    Re-striding that dim is a view of the same memory."""
    if x.ndim < 4 or x.shape[0] != 1:
        return x
    extent = max(x.stride(d) * x.shape[d] for d in range(1, x.ndim))
    return x if x.stride(0) == extent else x.as_strided(x.shape, (extent,) + x.stride()[1:])


class _BatchSplitConv(SignatureRule):
    """A convolution whose batch-split input keeps the single-device memory format (`_whole_batch_stride`)."""

    def strategy(self, call: OpCall) -> Strategy:
        strategy = super().strategy(call)
        layout = strategy.in_layouts[0]
        if strategy.local_fn is None and layout.shard_count(0) > 1 and call.inputs[0].ndim >= 4:
            func = call.func

            def local_fn(x, *args, **kwargs):
                return func(_whole_batch_stride(x), *args, **kwargs)
            strategy.local_fn = local_fn
        return strategy


class Conv(_BatchSplitConv):
    """conv1d/2d/3d(input, weight, bias, ...): batch split (weight replicated) or output channels split
    (weight and bias split on dim 0, input replicated; only with groups == 1)."""

    def signatures(self, call: OpCall) -> list[Signature]:
        n = len(call.inputs)
        sigs = []
        if call.inputs[0].shape[0] > 1:
            sigs.append(Signature([Shard(0)], [Shard(0)] + [REPLICATE] * (n - 1)))
        groups = call.arg(6, "groups", 1)
        if groups == 1 and n >= 2:
            sigs.append(Signature([Shard(1)], [REPLICATE] + [Shard(0)] * (n - 1)))
        return sigs


class ConvTranspose(_BatchSplitConv):
    """conv_transpose1d/2d/3d(input, weight, bias, ...): batch split, weight and bias replicated (the
    weight's dims are (in, out / groups, ...): an output-channel split would need the groups)."""

    def signatures(self, call: OpCall) -> list[Signature]:
        n = len(call.inputs)
        return [Signature([Shard(0)], [Shard(0)] + [REPLICATE] * (n - 1))] if call.inputs[0].shape[0] > 1 else []


class FirstOperand(SignatureRule):
    """`torch.isin(x, set)`, `torch.bucketize(x, boundaries)`: pointwise in `x` only; the other operand is a
    lookup table every rank needs whole."""

    def signatures(self, call: OpCall) -> list[Signature]:
        n = len(call.inputs)
        return [Signature([Shard(d)], [Shard(d)] + [REPLICATE] * (n - 1))
                for d in range(call.inputs[0].ndim) if call.inputs[0].shape[d] > 1]


class Pad(SignatureRule):
    """F.pad: dims that are not padded may stay split; a constant zero pad keeps pending sums."""

    float_args_matter = True   # the pad value: only zero keeps pending sums

    def signatures(self, call: OpCall) -> list[Signature]:
        x = call.inputs[0]
        pad = list(call.arg(1, "pad", ()))
        padded = {x.ndim - 1 - i // 2 for i, v in enumerate(pad) if v != 0}
        sigs = [Signature([Shard(d)], [Shard(d)]) for d in range(x.ndim) if d not in padded and x.shape[d] > 1]
        mode = call.arg(2, "mode", "constant")
        value = call.arg(3, "value", None)
        if mode == "constant" and not value:
            sigs.append(Signature([_P], [_P]))
        return sigs


class Interpolate(SignatureRule):
    """F.interpolate resamples the spatial dims only: batch and channel dims may stay split."""

    float_args_matter = True

    def signatures(self, call: OpCall) -> list[Signature]:
        x = call.inputs[0]
        return [Signature([Shard(d)], [Shard(d)]) for d in (0, 1) if d < x.ndim and x.shape[d] > 1]


class LeadingDims(SignatureRule):
    """Ops that depend on positions in the last `trailing` dims (triu/tril, flip of those dims...): only the
    leading dims may stay split."""

    trailing = 2

    def signatures(self, call: OpCall) -> list[Signature]:
        x = call.inputs[0]
        n_out = self.n_outputs(call)
        return [Signature([Shard(d)] * n_out, [Shard(d)] + [REPLICATE] * (len(call.inputs) - 1))
                for d in range(max(0, x.ndim - self.trailing)) if x.shape[d] > 1]


class TransposeProperty(Rule):
    """`x.T` / `x.mT` (and the conjugating `H` / `mH`): the splits and pending sums move with the dims."""

    dims = "reverse"

    def strategy(self, call: OpCall) -> Strategy:
        lay = call.inputs[0].layout
        tmap = list(lay.tensor_map)
        if self.dims == "reverse":
            tmap = tmap[::-1]
        elif len(tmap) >= 2:
            tmap[-2], tmap[-1] = tmap[-1], tmap[-2]
        return Strategy([lay], [lay.with_map(tmap, lay.partial)])


class Histc(SignatureRule):
    """torch.histc with an explicit range: the counts of the shards add up (Partial sum); with the
    automatic range (min == max) the range depends on every value, so the input is gathered."""

    float_args_matter = True

    def signatures(self, call: OpCall) -> list[Signature]:
        lo, hi = call.arg(2, "min", 0), call.arg(3, "max", 0)
        if lo == hi:
            return []
        x = call.inputs[0]
        return [Signature([_P], [Shard(d)]) for d in range(x.ndim) if x.shape[d] > 1]


class Foreach(Rule):
    """`torch._foreach_*` and the fused optimizer kernels `torch._fused_adam(w)_/_sgd_/_adagrad_` (optimizers'
    multi-tensor paths): element i of every list is laid out like element i of the first list (a parameter and
    its gradient and states), and stays so; the update is elementwise on the shards.

    The first list is never moved (the in-place forms update it); the other lists are moved to it
    (a no-op in an optimizer, where gradients and states share the parameter's layout). Tensors outside
    lists (a 0-d step size) and 0-d tensors inside them (the fused kernels' step counts) are replicated.
    When every list already lies so, the dispatcher skips the decision (`listwise`).
    """

    listwise = True

    # which ops keep pending sums: the ones that scale (mul/div by a scalar) or copy
    linear = ("_foreach_mul", "_foreach_div", "_foreach_neg", "_foreach_zero", "_foreach_copy")

    def strategy(self, call: OpCall) -> Strategy:
        groups = []  # per argument: number of tensors it contributed, and whether it was a list
        for a in list(call.args) + list(call.kwargs.values()):
            if isinstance(a, Tensor):
                groups.append((1, False))
            elif isinstance(a, (list, tuple)):
                n = sum(isinstance(b, Tensor) for b in a)
                if n:
                    groups.append((n, True))
        if not groups or not groups[0][1]:
            base = call.inputs[0].layout
            return Strategy([_repl(s) for s in call.inputs], _out_layouts(call, base))
        n = groups[0][0]
        firsts = [call.inputs[i].layout for i in range(n)]
        short = call.name.rsplit(".", 1)[-1].rstrip("_")
        keeps_partial = short in self.linear
        if not keeps_partial and any(lay.has_partial for lay in firsts):
            self.fail(call, "a pending sum in the tensors a non-linear _foreach op updates")
        ins = list(firsts)
        pos = n
        for count, is_list in groups[1:]:
            for j in range(count):
                spec = call.inputs[pos + j]
                same = is_list and count == n and spec.ndim == call.inputs[j].ndim
                ins.append(firsts[j] if same else _repl(spec))
            pos += count
        outs = [] if call.out_shapes is None else [firsts[i % n] for i in range(len(call.out_shapes))]
        return Strategy(ins, outs)


__all__ = ["Replicated", "Query", "ScalarValue", "TypeCast", "NewFactory", "Factory", "Like", "RandomFill",
           "Dropout", "Conv", "Pad", "Interpolate", "LeadingDims", "TransposeProperty", "Histc", "Foreach"]
