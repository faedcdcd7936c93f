"""Gradient reduction: unsharded local gradients -> the sharded parameters' `.grad`.

The loss each rank computes is the mean over its own micro-batch; the global loss is the mean of those
over the dp ranks (equal micro-batches), so gradients are summed over dp and divided by the dp size,
then multiplied by `grad_scale`.

- sharded parameters at level2/3: reduce-scatter inside the shard group (each rank keeps its rows),
  then all-reduce that piece across the replica groups (hybrid);
- level1 and unsharded (small) parameters: all-reduce the whole gradient (shard group, then replica
  groups); a level1 parameter's `.grad` is a view of its rows of the full reduced gradient, which it
  keeps alive (level1 does not shard gradients).

Buckets: without `comm_fusion` each parameter is one collective straight from its padded gradient;
with it, consecutive parameters of one module unit (up to `bucket_size` KB, -1 = no limit) are packed
into one buffer laid out as [shard rank, rows of every parameter] so one reduce-scatter serves them all.
With `comm_async` the collectives run in the background (one in flight) and are finished at
the end of backward; gradients of a finished bucket are released at once.
"""
from __future__ import annotations

from collections import deque

import torch

from ...redistribute import collectives
from .topology import Topology

_MAX_IN_FLIGHT = 1


class Bucket:
    """Parameters reduced by one collective: `scatter` (reduce-scatter) or `all_reduce`."""

    def __init__(self, kind: str, params: list):
        self.kind = kind
        self.params = params
        if kind == "scatter":
            self.sizes = [p.step * p.row for p in params]  # per-rank padded piece of each parameter
        else:
            self.sizes = [p.rows * p.row for p in params]


def make_buckets(params: list, level: int, fusion: bool, bucket_bytes: float) -> list:
    """Group the gradient-requiring parameters of one unit into buckets (same kind and dtype)."""
    buckets: list = []
    current: list = []
    size = 0.0
    key = None
    for p in params:
        if not p.requires_grad:
            continue
        kind = "scatter" if p.sharded and level >= 2 else "all_reduce"
        nbytes = p.buffer.numel() * p.buffer.element_size()
        k = (kind, p.dtype)
        if current and (not fusion or k != key or (bucket_bytes > 0 and size + nbytes > bucket_bytes)):
            buckets.append(Bucket(key[0], current))
            current, size = [], 0.0
        current.append(p)
        size += nbytes
        key = k
    if current:
        buckets.append(Bucket(key[0], current))
    return buckets


class Reducer:
    """Launches bucket reductions in program order and finishes them (now, or later when async)."""

    def __init__(self, topo: Topology, reduce_dtype, grad_scale: float, comm_async: bool):
        self.topo = topo
        self.reduce_dtype = reduce_dtype
        self.factor = grad_scale / topo.dp_size
        self.comm_async = comm_async
        self.pending: deque = deque()

    def reduce(self, bucket: Bucket, used: set | None = None) -> None:
        """Reduce `bucket`'s gradients; with `used`, only those parameters get one (the rest stay None)."""
        dtype = self.reduce_dtype or bucket.params[0].dtype
        keep = (lambda p: True) if used is None else used.__contains__
        if bucket.kind == "scatter":
            job = self._scatter(bucket, dtype, keep)
        else:
            job = self._all_reduce(bucket, dtype, keep)
        if self.comm_async:
            self.pending.append(job)
            while len(self.pending) > _MAX_IN_FLIGHT:
                self._finish(self.pending.popleft())
        else:
            self._finish(job)

    def flush(self) -> None:
        while self.pending:
            self._finish(self.pending.popleft())

    # ---- the two collectives ------------------------------------------------------------
    # each unsharded gradient is taken from its parameter only when it is packed, and dropped right after
    def _scatter(self, bucket: Bucket, dtype, keep):
        params = bucket.params
        S = params[0].parts
        if len(params) == 1:
            inp = params[0].padded_grad(params[0].take_grad(), dtype)
        else:
            total = sum(bucket.sizes)
            inp = torch.empty(S, total, dtype=dtype, device=params[0].buffer.device)
            o = 0
            for p, n in zip(params, bucket.sizes):
                inp[:, o:o + n].copy_(p.padded_grad(p.take_grad(), dtype).view(S, n))
                o += n
            inp = inp.view(-1)
        out = inp.new_empty(inp.numel() // S)
        group = self.topo.reduce_shard_group
        work = collectives.reduce_scatter_into(out, inp, group, self.comm_async)

        def finish():
            if self.comm_async:
                collectives.wait(work, "reduce_scatter", "hsdp gradient reduction", group)
            self._across_replicas(out)
            o = 0
            for p, n in zip(params, bucket.sizes):
                if keep(p):
                    p.set_grad(out[o:o + p.length * p.row])
                o += n
        return finish

    def _all_reduce(self, bucket: Bucket, dtype, keep):
        params = bucket.params
        if len(params) == 1:
            buf = params[0].padded_grad(params[0].take_grad(), dtype)[: bucket.sizes[0]]
        else:
            buf = torch.empty(sum(bucket.sizes), dtype=dtype, device=params[0].buffer.device)
            o = 0
            for p, n in zip(params, bucket.sizes):
                buf[o:o + n].copy_(p.padded_grad(p.take_grad(), dtype)[:n])
                o += n
        group = self.topo.reduce_shard_group
        work = collectives.all_reduce_(buf, group, self.comm_async) if group is not None else None

        def finish():
            if self.comm_async:
                collectives.wait(work, "all_reduce", "hsdp gradient reduction", group)
            self._across_replicas(buf)
            o = 0
            for p, n in zip(params, bucket.sizes):
                g = buf[o:o + n]
                if p.sharded:  # level1: keep the full reduced gradient, hand the shard its rows
                    g = g[p.offset * p.row: (p.offset + p.length) * p.row]
                if keep(p):
                    p.set_grad(g)
                o += n
        return finish

    def _across_replicas(self, t: torch.Tensor) -> None:
        if self.topo.reduce_replicate_group is not None:
            collectives.all_reduce_(t, self.topo.reduce_replicate_group)
        if self.factor != 1.0:
            t.mul_(self.factor)

    @staticmethod
    def _finish(job) -> None:
        job()


__all__ = ["Bucket", "Reducer", "make_buckets"]
