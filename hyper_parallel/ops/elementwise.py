"""Pointwise ops: every output element depends on the same element of each (broadcast) input."""
from __future__ import annotations

import numbers

import torch

from ..dispatch.dispatcher import is_inplace_op
from .base import Partial, Replicate, Shard, Signature, SignatureRule, REPLICATE
from .deferred import guard_pending_sum

_P = Partial("sum")


class Elementwise(SignatureRule):
    """Split any output dim that every non-broadcast input shares.

    `linear` says which pending sums survive the op: "unary" (neg, casts, clone: P -> P),
    "add" (add/sub: all tensor operands P, no scalar operand), "mul" (mul/div: one operand P, the
    others replicated; for div only the numerator).
    """

    linear = None

    def output_shapes(self, inputs):
        # pointwise: the broadcast of the tensor inputs (meta kernels of pointwise ops are slow Python refs)
        if not inputs:
            return None
        if self.name.endswith((".to", ".type_as")) or is_inplace_op(self.name):
            return [tuple(inputs[0].shape)]  # casts and in-place ops keep the first tensor's shape
        return [tuple(torch.broadcast_shapes(*[s.shape for s in inputs]))]

    def signatures(self, call):
        out_shapes = call.out_shapes
        if not out_shapes:
            return []
        out = out_shapes[0]
        n_out = len(out_shapes)
        nd = len(out)
        sigs = []
        for d in range(nd):
            if out[d] <= 1:
                continue
            ins = []
            for spec in call.inputs:
                k = d - (nd - spec.ndim)
                ins.append(Shard(k) if k >= 0 and spec.shape[k] == out[d] else REPLICATE)
            sigs.append(Signature([Shard(d)] * n_out, ins))
        n = len(call.inputs)
        if self.linear == "unary" and n == 1:
            sigs.append(Signature([_P] * n_out, [_P]))
        elif self.linear == "add" and not _has_number(call) and n >= 1:
            sigs.append(Signature([_P] * n_out, [_P] * n))
        elif self.linear == "mul" and n >= 1:
            if call.kwargs.get("rounding_mode") is not None:
                return sigs  # floor/trunc of each term's quotient is not the quotient of the sum
            first = 1 if _divides(call) else n
            for i in range(first):
                sigs.append(Signature([_P] * n_out, [_P if j == i else REPLICATE for j in range(n)]))
        return sigs


    def strategy(self, call):
        strat = super().strategy(call)
        if self.linear != "mul":
            return strat
        # a pending sum carried through a product: exact for non-finite factors (and zero divisors) too
        return guard_pending_sum(call, strat, divisor_from=1 if _divides(call) else None)


def _divides(call) -> bool:
    return call.name.endswith(("div", "div_", "__truediv__", "__itruediv__"))


class Where(Elementwise):
    """`torch.where(cond, x, y)` is pointwise; `torch.where(cond)` alone is `torch.nonzero(cond, as_tuple=True)`:
    one index tensor per dim whose length depends on the data, so the condition is gathered and the indices are
    replicated (the indexing module's `Replicated` rule, as for `nonzero`)."""

    def output_shapes(self, inputs):
        # one tensor input may be where(cond) (data-dependent) or where(cond, scalar, scalar): the meta run tells
        return None if len(inputs) == 1 else super().output_shapes(inputs)

    def strategy(self, call):
        if len(call.args) + len(call.kwargs) == 1:
            from .indexing import Replicated
            return Replicated(call.name).strategy(call)
        return super().strategy(call)


_METHOD_DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64,
                  "long": torch.int64, "int": torch.int32, "short": torch.int16, "char": torch.int8,
                  "byte": torch.uint8, "bool": torch.bool}


class Cast(Elementwise):
    """Dtype casts (`.to`, `.float()`, `.long()`, `type_as`, ...): pointwise, so splits pass through. A
    pending reduction passes only where casting each rank's term gives the cast of the reduced value:

    - sum / avg: the cast is linear only into a dtype that holds every term and their sum at least as
      exactly as the source (same dtype, or a float at least as wide in mantissa and range). Into int
      (truncation), bool (any nonzero term), a narrower float (rounding per term) the sum is reduced first.
    - max / min: a monotone cast commutes with them: into any float dtype from float, int or bool (rounding
      is monotone), or into an integer dtype wide enough for the source integers. Not into bool
      (-1 and 1 both become True) nor float -> int (out-of-range values are undefined).
    """

    def target_dtype(self, call):
        x = call.inputs[0]
        method = self.name.rsplit(".", 1)[-1]
        if method in _METHOD_DTYPES:
            return _METHOD_DTYPES[method]
        if len(call.inputs) > 1:  # to(other) / type_as(other)
            return call.inputs[1].dtype
        for value in list(call.args[1:]) + list(call.kwargs.values()):
            if isinstance(value, torch.dtype):
                return value
        return x.dtype  # to(device), to(memory_format=...), copy=True

    def signatures(self, call):
        sigs = [s for s in super().signatures(call) if not any(isinstance(p, Partial) for p in s.ins)]
        src, dst = call.inputs[0].dtype, self.target_dtype(call)
        for op in ("sum", "avg", "max", "min"):
            if cast_commutes(op, src, dst):
                p = Partial(op)
                sigs.append(Signature([p], [p] + [None] * (len(call.inputs) - 1)))
        return sigs


def _int_range(dtype) -> tuple:
    if dtype == torch.bool:
        return (0, 1)
    info = torch.iinfo(dtype)
    return (info.min, info.max)


def cast_commutes(op: str, src: torch.dtype, dst: torch.dtype) -> bool:
    """Does casting each rank's term and then reducing with `op` give the cast of the reduced value?"""
    if src == dst:
        return True
    if src.is_complex or dst.is_complex:
        return False
    if op in ("sum", "avg"):
        if not (src.is_floating_point and dst.is_floating_point):
            return False
        s, d = torch.finfo(src), torch.finfo(dst)
        return d.eps <= s.eps and d.max >= s.max
    if dst.is_floating_point:
        return True
    if dst == torch.bool or src.is_floating_point:
        return False
    (slo, shi), (dlo, dhi) = _int_range(src), _int_range(dst)
    return dlo <= slo and dhi >= shi


def _has_number(call) -> bool:
    values = list(call.args[1:]) + [v for k, v in call.kwargs.items() if k not in ("alpha", "out")]
    return any(isinstance(v, numbers.Number) and not isinstance(v, bool) for v in values)


__all__ = ["Elementwise", "Cast", "Where", "cast_commutes", "Replicate"]
