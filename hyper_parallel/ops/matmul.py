"""Contractions: linear, the matmul family and einsum, described as labelled dims (einsum style).

Every op here computes `out[o] = sum over contracted labels of prod(operand[labels])` (plus, for
addmm/baddbmm/linear, an addend broadcast onto the output). From that description the legal
single-axis signatures follow mechanically:

- an output label may be split: every operand holding it at full size is split on that dim, operands
  holding it at size 1 (broadcast) stay replicated, and so does an operand without it;
- a contracted label may be split in every operand holding it: each rank sums part of the range, so
  the output is Partial(sum) and the addend must be Partial too (Replicate -> Partial keeps it on one
  coordinate, so it is added exactly once);
- the op is linear in each operand: one operand Partial, the others replicated -> Partial output.

Labels that appear twice in one operand (a diagonal) and labels a caller marks `frozen` are never split.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..dispatch.call import OpCall, Strategy
from .base import Partial, Signature, SignatureRule, Shard, REPLICATE
from .deferred import guard_pending_sum

_P = Partial("sum")


@dataclass
class ContractionSpec:
    """One call as labelled dims.

    `operands`: (input index, one label per dim) for each multiplied tensor input; `out`: the output's
    labels; `addends`: input indices added to the output (broadcast, right-aligned); `frozen`: labels
    that must stay whole (e.g. a normalized or softmax dim); `linear`: input indices in which the op is
    linear (None: every operand and addend together, the einsum case); `contract_partial`: whether a
    split contracted label gives Partial(sum) (True for sums of products).
    """

    operands: list
    out: tuple
    addends: list = field(default_factory=list)
    frozen: frozenset = frozenset()
    linear: list | None = None
    contract_partial: bool = True


def contraction_signatures(call: OpCall, spec: ContractionSpec) -> list[Signature]:
    """The single-axis signatures implied by a ContractionSpec (see the module docstring)."""
    if not call.out_shapes or len(call.out_shapes[0]) != len(spec.out):
        return []
    out_shape = call.out_shapes[0]
    n_in = len(call.inputs)
    n_out = len(call.out_shapes)
    blocked = set(spec.frozen)
    for _, labels in spec.operands:
        blocked.update(lab for lab, c in Counter(labels).items() if c > 1)
    full = {}  # label -> its full (non-broadcast) size
    for idx, labels in spec.operands:
        for lab, n in zip(labels, call.inputs[idx].shape):
            if n != 1:
                if full.setdefault(lab, n) != n:
                    blocked.add(lab)  # sizes that neither match nor broadcast (e.g. GQA heads): caller's job
    for p, lab in enumerate(spec.out):
        full.setdefault(lab, out_shape[p])
    sigs = []

    def split(lab):
        ins = [REPLICATE] * n_in
        for idx, labels in spec.operands:
            if lab in labels:
                d = labels.index(lab)
                if call.inputs[idx].shape[d] == full[lab]:
                    ins[idx] = Shard(d)
        return ins

    for p, lab in enumerate(spec.out):
        if lab in blocked or out_shape[p] <= 1:
            continue
        ins = split(lab)
        if all(x is REPLICATE for x in ins):
            continue  # only an addend holds this dim at full size: the product would not be split
        for idx in spec.addends:
            k = p - (len(out_shape) - call.inputs[idx].ndim)
            if k >= 0 and call.inputs[idx].shape[k] == out_shape[p]:
                ins[idx] = Shard(k)
        sigs.append(Signature([Shard(p)] * n_out, ins))
    if spec.contract_partial:
        seen = set()
        for _, labels in spec.operands:
            for lab in labels:
                if lab in spec.out or lab in blocked or lab in seen or full.get(lab, 1) <= 1:
                    continue
                seen.add(lab)
                ins = split(lab)
                for idx in spec.addends:
                    ins[idx] = _P
                sigs.append(Signature([_P] * n_out, ins))
    linear = spec.linear if spec.linear is not None else [idx for idx, _ in spec.operands]
    for i in linear:
        ins = [REPLICATE] * n_in
        ins[i] = _P
        if i not in spec.addends:
            for idx in spec.addends:
                ins[idx] = _P
        sigs.append(Signature([_P] * n_out, ins))
    return sigs


class Contraction(SignatureRule):
    """Base of the rules in this module: subclasses say how a call maps onto labelled dims."""

    def spec(self, call: OpCall) -> ContractionSpec | None:
        raise NotImplementedError

    def signatures(self, call: OpCall) -> list[Signature]:
        spec = self.spec(call)
        return [] if spec is None else contraction_signatures(call, spec)

    def strategy(self, call: OpCall) -> Strategy:
        # a pending sum carried through the product with replicated factors: exact for non-finite ones too
        return guard_pending_sum(call, super().strategy(call))


# ---- label helpers -----------------------------------------------------------------------------
def batch_labels(n: int) -> tuple:
    return tuple(f"b{i}" for i in range(n))


def matmul_labels(a_ndim: int, b_ndim: int) -> tuple[tuple, tuple, tuple]:
    """torch.matmul's dims: 1-D operands lose their dim, batch dims broadcast right-aligned."""
    if a_ndim == 1 and b_ndim == 1:
        return ("k",), ("k",), ()
    a_batch = max(a_ndim - 2, 0)
    b_batch = max(b_ndim - 2, 0)
    batch = batch_labels(max(a_batch, b_batch))
    a = batch[len(batch) - a_batch:] + (("m", "k") if a_ndim >= 2 else ("k",))
    b = batch[len(batch) - b_batch:] + (("k", "n") if b_ndim >= 2 else ("k",))
    out = batch + (("m",) if a_ndim >= 2 else ()) + (("n",) if b_ndim >= 2 else ())
    return a, b, out


def parse_einsum(equation: str, ndims: list[int]) -> tuple[list[tuple], tuple] | None:
    """Labels per operand and of the output for an einsum equation; None if it cannot be parsed."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        return None
    pieces = []
    n_ell = 0
    for term, nd in zip(terms, ndims):
        if term.count("...") > 1:
            return None
        if "..." in term:
            pre, post = term.split("...")
            k = nd - len(pre) - len(post)
            if k < 0:
                return None
            n_ell = max(n_ell, k)
            pieces.append((pre, k, post))
        else:
            if len(term) != nd:
                return None
            pieces.append((term, 0, ""))
    if not all(c.isalpha() for pre, _, post in pieces for c in pre + post):
        return None

    def ell(k):  # ellipsis dims broadcast right-aligned, like batch dims
        return tuple(f"...{i}" for i in range(n_ell - k, n_ell))

    operands = [tuple(pre) + ell(k) + tuple(post) for pre, k, post in pieces]
    if arrow:
        if rhs.count("...") > 1:
            return None
        if "..." in rhs:
            pre, post = rhs.split("...")
            out = tuple(pre) + ell(n_ell) + tuple(post)
        else:
            out = tuple(rhs)
    else:  # implicit output: the ellipsis dims, then the letters used once, in ASCII order (as torch)
        counts = Counter(c for pre, _, post in pieces for c in pre + post)
        out = ell(n_ell) + tuple(sorted(c for c, n in counts.items() if n == 1))
    return operands, out


# ---- rules ---------------------------------------------------------------------------------------
class Linear(Contraction):
    """F.linear(x, w, b): column split (w dim 0), row split (x dim -1 with w dim 1 -> Partial, the
    bias then Partial so it is added once), and any leading dim of x."""

    def spec(self, call):
        x, w = call.inputs[0], call.inputs[1]
        xl = batch_labels(x.ndim - 1) + ("k",)
        wl = ("n", "k") if w.ndim == 2 else ("k",)
        out = xl[:-1] + (("n",) if w.ndim == 2 else ())
        addends = [2] if len(call.inputs) > 2 else []
        return ContractionSpec([(0, xl), (1, wl)], out, addends)


class Matmul(Contraction):
    """torch.matmul and its operators, with broadcast batch dims. `swap`: the call's first tensor is
    the right operand (Tensor.__rmatmul__)."""

    swap = False

    def spec(self, call):
        if len(call.inputs) != 2:
            return None
        ia, ib = (1, 0) if self.swap else (0, 1)
        a, b, out = matmul_labels(call.inputs[ia].ndim, call.inputs[ib].ndim)
        return ContractionSpec([(ia, a), (ib, b)], out)


class Contract(Contraction):
    """A fixed-pattern contraction from YAML: `equation` (einsum form over the multiplied inputs) and
    optionally `addend` (the index of the tensor input that is added, e.g. 0 for addmm's `input`)."""

    equation = None
    addend = None

    def spec(self, call):
        idx = [i for i in range(len(call.inputs)) if i != self.addend]
        parsed = parse_einsum(self.equation, [call.inputs[i].ndim for i in idx])
        if parsed is None:
            return None
        labels, out = parsed
        addends = [self.addend] if self.addend is not None and self.addend < len(call.inputs) else []
        return ContractionSpec(list(zip(idx, labels)), out, addends)


class Einsum(Contraction):
    """torch.einsum(equation, *operands) (the sublist form reaches us already turned into an equation)."""

    def spec(self, call):
        eq = call.args[0] if call.args and isinstance(call.args[0], str) else None
        if eq is None:
            return None
        parsed = parse_einsum(eq, [s.ndim for s in call.inputs])
        if parsed is None:
            return None
        labels, out = parsed
        return ContractionSpec(list(enumerate(labels)), out)


__all__ = ["ContractionSpec", "contraction_signatures", "Contraction", "Linear", "Matmul", "Contract", "Einsum",
           "parse_einsum", "matmul_labels", "batch_labels"]
