"""Rule classes: a rule turns an op call's input layouts into target input layouts and output layouts.

Most families only list legal *single-mesh-axis signatures* (`SignatureRule`); the shared planner
expands them to every mesh axis and picks, per axis, the signature whose input moves cost least.
"""
from __future__ import annotations

from ..dispatch.call import OpCall, Strategy
from ..layout.placement import Partial, Replicate, Shard, REPLICATE
from ..redistribute.cost import axis_cost


class Rule:
    """Base of all rules. Options from the YAML entry arrive as keyword arguments."""

    float_args_matter = False   # do float arguments change the decision (e.g. interpolate's scale)?
    replicated_local = True     # all inputs replicated -> run locally, outputs replicated
    # Element i of every list argument is laid out like element i of the first list and the op is elementwise on
    # the shards (the optimizers' _foreach_* / _fused_* kernels): when the arguments already are so, the
    # dispatcher runs the call on the lists of local shards without a decision (dispatcher._listwise_local).
    listwise = False
    # Tensor inputs (by position among the call's tensors) that only lend their shape or dtype: `view_as`,
    # `expand_as`, `type_as`, `to(other)`. The dispatcher leaves them where they are (no communication) and
    # keeps their splits out of the gradient duality: a donor split over an axis does not split the
    # computation, so it must not turn a replicated input's gradient into a pending sum. YAML: shape_only: [1].
    shape_only: tuple = ()

    def __init__(self, name: str, **options):
        self.name = name
        self.options = options
        for k, v in options.items():
            setattr(self, k, v)

    def output_shapes(self, inputs: list) -> list | None:
        """Global output shapes if the family knows them cheaply; None runs the op on meta tensors."""
        return None

    def strategy(self, call: OpCall) -> Strategy:
        raise NotImplementedError

    def fail(self, call: OpCall, why: str):
        raise RuntimeError(f"{call.name} cannot run on inputs laid out as [{call.layouts()}]: {why}. "
                           f"Redistribute the inputs (e.g. .redistribute(layout) or .full_tensor()) first.")


class Signature:
    """Placements on one mesh axis: one per tensor output and one per tensor input."""

    __slots__ = ("outs", "ins")

    def __init__(self, outs, ins):
        self.outs = tuple(outs)
        self.ins = tuple(ins)

    def __repr__(self):
        return f"Signature(outs={self.outs}, ins={self.ins})"


def replicated_signature(n_out: int, n_in: int) -> Signature:
    return Signature((REPLICATE,) * n_out, (REPLICATE,) * n_in)


class SignatureRule(Rule):
    """A rule given as legal single-axis signatures; all-Replicate is always added as the fallback."""

    def signatures(self, call: OpCall) -> list[Signature]:
        raise NotImplementedError

    def n_outputs(self, call: OpCall) -> int:
        return len(call.out_shapes) if call.out_shapes is not None else 1

    def out_ndims(self, call: OpCall) -> list[int]:
        if call.out_shapes is not None:
            return [len(s) for s in call.out_shapes]
        return [call.inputs[0].ndim] * self.n_outputs(call)

    def strategy(self, call: OpCall) -> Strategy:
        n_in = len(call.inputs)
        n_out = self.n_outputs(call)
        sigs = [s for s in self.signatures(call) if len(s.ins) == n_in]
        sigs.append(replicated_signature(n_out, n_in))
        mesh = call.mesh
        chosen = []
        for axis in range(mesh.ndim):
            parts = mesh.shape[axis]
            current = [spec.layout.placements[axis] for spec in call.inputs]
            if parts == 1:  # nothing is split over a size-1 axis: inputs stay as they are
                chosen.append(Signature([REPLICATE] * n_out, current))
                continue
            candidates = sigs
            if call.inplace:
                candidates = [s for s in sigs if s.ins[0] == current[0] and s.outs[0] == current[0]]
                if not candidates:
                    self.fail(call, f"no way to keep {current[0]} on mesh axis "
                                    f"{mesh.mesh_dim_names[axis]!r} for the in-place result")
            best, best_cost = None, None
            for sig in candidates:
                cost = 0.0
                for spec, cur, want in zip(call.inputs, current, sig.ins):
                    if want is not None:
                        cost += axis_cost(cur, want, spec.local_bytes, parts)
                if best is None or cost < best_cost:
                    best, best_cost = sig, cost
            chosen.append(Signature(best.outs, [w if w is not None else REPLICATE for w in best.ins]))
        return assemble(call, chosen, self.out_ndims(call))


def assemble(call: OpCall, chosen: list[Signature], out_ndims: list[int]) -> Strategy:
    """Turn one chosen signature per mesh axis into input and output layouts (keeping split order).

    Dims split over several axes get one nesting order shared by every input and output: dims that
    the signatures split together (a contracted dim, a batch dim) must nest their pieces identically.
    The order is the one an input already has (multi-axis splits first), new axes innermost.
    """
    wanted = []  # per input, per dim: the axes that split it
    for i, spec in enumerate(call.inputs):
        dims = [set() for _ in range(spec.ndim)]
        for axis, sig in enumerate(chosen):
            p = sig.ins[i]
            if isinstance(p, Shard):
                dims[p.dim % spec.ndim].add(axis)
        wanted.append(dims)
    order = {}
    for multi in (True, False):
        for spec, dims in zip(call.inputs, wanted):
            for d, axes in enumerate(spec.layout.tensor_map):
                kept = [a for a in axes if a in dims[d]]
                if (len(kept) > 1) == multi:
                    for pos, a in enumerate(kept):
                        order.setdefault(a, pos)
    n_axes = len(chosen)

    def key(a):
        return (order.get(a, n_axes), a)

    in_layouts = []
    for i, spec in enumerate(call.inputs):
        partial = []
        for axis, sig in enumerate(chosen):
            p = sig.ins[i]
            partial.append(p.reduce_op if isinstance(p, Partial) else None)
        tensor_map = [tuple(sorted(axes, key=key)) for axes in wanted[i]]
        in_layouts.append(spec.layout.with_map(tensor_map, partial))
    outs = []
    base = call.inputs[0].layout if call.inputs else None
    for j, ndim in enumerate(out_ndims):
        dims = [[] for _ in range(ndim)]
        partial = []
        for axis, sig in enumerate(chosen):
            p = sig.outs[j] if j < len(sig.outs) else sig.outs[-1]
            partial.append(p.reduce_op if isinstance(p, Partial) else None)
            if isinstance(p, Shard):
                dims[p.dim % ndim].append(axis)
        tensor_map = [tuple(sorted(axes, key=key)) for axes in dims]
        outs.append(base.with_map(tensor_map, partial))
    return Strategy(in_layouts, outs)


__all__ = ["Rule", "SignatureRule", "Signature", "Shard", "Replicate", "Partial", "REPLICATE", "assemble",
           "replicated_signature"]
