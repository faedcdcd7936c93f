"""Pointwise ops: every output element depends on the same element of each (broadcast) input."""
from __future__ import annotations

import numbers

import torch

from .base import Partial, Replicate, Shard, Signature, SignatureRule, REPLICATE

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
        if self.name.endswith((".to", ".type_as", "_")) or self.name.startswith("torch.Tensor.__i"):
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
            first = 1 if call.name.endswith(("div", "div_", "__truediv__", "__itruediv__")) else n
            for i in range(first):
                sigs.append(Signature([_P] * n_out, [_P if j == i else REPLICATE for j in range(n)]))
        return sigs


def _has_number(call) -> bool:
    values = list(call.args[1:]) + [v for k, v in call.kwargs.items() if k not in ("alpha", "out")]
    return any(isinstance(v, numbers.Number) and not isinstance(v, bool) for v in values)


__all__ = ["Elementwise", "Replicate"]
