"""Complex-number views: `torch.view_as_complex` and `torch.view_as_real` (rotary embeddings written with
complex multiplies: Llama-style `freqs_cis`, ChatGLM, DeepSeek). `torch.polar` / `torch.complex` and the
complex multiply itself are pointwise (ops/elementwise.py).

A float tensor `[..., 2]` and its complex view `[...]` share every dim but the pair dim, so splits of those
dims (and pending sums: both views are linear over the reals) carry over unchanged; the pair dim is never
split (it has two elements and must stay whole to form a number).
"""
from __future__ import annotations

from .base import Partial, Shard, Signature, SignatureRule

_P = Partial("sum")


class ViewAsComplex(SignatureRule):
    """`torch.view_as_complex(x)`: x `[..., 2]` -> `[...]`; any dim but the last may stay split."""

    def out_ndims(self, call) -> list[int]:
        return [call.inputs[0].ndim - 1]

    def signatures(self, call) -> list[Signature]:
        x = call.inputs[0]
        sigs = [Signature([Shard(d)], [Shard(d)]) for d in range(x.ndim - 1) if x.shape[d] > 1]
        return sigs + [Signature([_P], [_P])]


class ViewAsReal(SignatureRule):
    """`torch.view_as_real(z)`: z `[...]` -> `[..., 2]`; every dim may stay split."""

    def out_ndims(self, call) -> list[int]:
        return [call.inputs[0].ndim + 1]

    def signatures(self, call) -> list[Signature]:
        z = call.inputs[0]
        sigs = [Signature([Shard(d)], [Shard(d)]) for d in range(z.ndim) if z.shape[d] > 1]
        return sigs + [Signature([_P], [_P])]


__all__ = ["ViewAsComplex", "ViewAsReal"]
