"""Linear solves: `torch.linalg.solve_triangular` (the chunked delta rule of linear-attention layers:
Qwen3-Next, Qwen3.5, OLMo-hybrid, gated DeltaNet).

`solve_triangular(A, B, upper=, left=True)` solves A X = B for every batch entry: X has B's shape. Each
column of X depends on the same column of B and on all of A, so
- batch dims may be split (A and B split alike; a batch dim A broadcasts stays replicated in A);
- with `left=True` B's columns (last dim) may be split, A replicated; with `left=False` (X A = B) B's rows;
- X is linear in B: a pending sum in B (A replicated) stays pending in X.
A's own matrix dims are never split (every unknown needs the whole triangle).
"""
from __future__ import annotations

from .base import Partial, REPLICATE, Shard, Signature, SignatureRule

_P = Partial("sum")


class SolveTriangular(SignatureRule):

    def signatures(self, call) -> list[Signature]:
        if len(call.inputs) != 2:
            return []
        a, b = call.inputs
        left = call.arg(3, "left", True)
        out_nd = b.ndim if not call.out_shapes else len(call.out_shapes[0])
        sigs = []
        for d in range(out_nd - 2):  # batch dims, aligned from the right
            ka, kb = d - (out_nd - a.ndim), d - (out_nd - b.ndim)
            if kb < 0 or b.shape[kb] <= 1:
                continue
            a_place = Shard(ka) if ka >= 0 and a.shape[ka] == b.shape[kb] else REPLICATE
            sigs.append(Signature([Shard(d)], [a_place, Shard(kb)]))
        free = b.ndim - 1 if left else b.ndim - 2
        if b.shape[free] > 1:
            sigs.append(Signature([Shard(out_nd - (b.ndim - free))], [REPLICATE, Shard(free)]))
        sigs.append(Signature([_P], [REPLICATE, _P]))
        return sigs


__all__ = ["SolveTriangular"]
