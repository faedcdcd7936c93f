"""Collectives on local tensors over one mesh axis, built on torch.distributed, with accounting.

Every collective goes through `_issue`: in check mode (`set_check`, HYPER_PARALLEL_CHECK=1) the ranks of
the group first compare fingerprints of what they are about to run (see check.py), and a collective that
fails (a timeout: HYPER_PARALLEL_COMM_TIMEOUT) is re-raised naming the op, the layouts and the mesh axis.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist

from ..layout import mesh as _mesh
from . import check as _check

_COUNTERS: list = []
_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class CommCounts:
    """Collectives seen inside `comm_counter()`: calls and bytes this rank passed in, per kind, and the same
    per mesh axis (`by_axis[axis][kind] = [count, bytes]`; the axis is the name of the mesh axis whose
    process group ran it, "world" for the default group: what a cost model needs to price each link)."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()
        self.by_axis: dict = {}

    def add(self, kind: str, axis: str, nbytes: int) -> None:
        self.counts[kind] += 1
        self.bytes[kind] += nbytes
        entry = self.by_axis.setdefault(axis, {}).setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += nbytes

    def __repr__(self):
        return f"CommCounts(counts={dict(self.counts)}, bytes={dict(self.bytes)})"


@contextlib.contextmanager
def comm_counter():
    counts = CommCounts()
    _COUNTERS.append(counts)
    try:
        yield counts
    finally:
        _COUNTERS.remove(counts)


def _record(kind: str, tensor: torch.Tensor, group) -> None:
    if _COUNTERS:
        _count(kind, tensor.numel() * tensor.element_size(), group)


def _count(kind: str, nbytes: int, group) -> None:
    """Only while a counter is active (callers test `_COUNTERS`): the axis lookup stays off the hot path."""
    axis = _mesh.axis_name_of(group)
    for c in _COUNTERS:
        c.add(kind, axis, nbytes)


def _unchecked(fn):
    """Mark a point-to-point function: check mode does not compare fingerprints before it (only the two
    peers take part, and they run different things by design)."""
    def run(*args, **kwargs):
        return fn(*args, **kwargs)
    run.unchecked = True
    return run


def _issue(kind: str, detail, over, collective, *args, check_over=None, **kwargs):
    """Run one torch.distributed collective: fingerprints compared first in check mode; a failure (timeout,
    a peer gone) re-raised with what this rank was running.

    `check_over`: the group check mode compares over, when not `over` itself: a parallelism that runs its
    collectives on several groups of the same ranks (hsdp gathers on one, reduces on another, so that an
    asynchronous reduction never interleaves with a gather) compares them all over one, so that ranks that
    diverge from one kind to the other meet in the same comparison instead of waiting on different groups."""
    if _check.CHECK[0] and not getattr(collective, "unchecked", False):
        _check.compare(kind, detail, over if check_over is None else check_over)
    try:
        return collective(*args, **kwargs)
    except RuntimeError as e:  # DistBackendError and gloo's timeouts are RuntimeErrors
        raise _check.CollectiveError(_check.failure_message(kind, detail, over, e)) from e


def gather_objects(mesh, obj) -> list:
    """Every rank's `obj` on every rank of `mesh`, as [(coordinate, obj)] in coordinate order: one object
    all-gather per mesh axis, so a mesh over part of the world needs no group of its own."""
    items = [(mesh.coordinate, obj)]
    for axis, size in enumerate(mesh.shape):
        if size > 1:
            parts = all_gather_object(items, mesh.get_group(axis))
            items = [item for part in parts for item in part]
    return sorted(items, key=lambda item: item[0])


def gather_over_mesh(mesh, t: torch.Tensor, kind: str = "all_gather") -> torch.Tensor:
    """Every rank's `t` stacked in the mesh's row-major coordinate order, on every rank of `mesh`.

    One all_gather on the default group when the mesh is the whole world in rank order, else one per mesh
    axis (innermost first), so a mesh over part of the world needs no group of its own. `kind`: what
    `comm_counter` counts it as (the feed check's exchange is "feed_check", not model traffic)."""
    items = t.unsqueeze(0)
    if dist.get_world_size() == len(mesh.ranks) and list(mesh.ranks) == list(range(len(mesh.ranks))):
        return all_gather(items, 0, None, [1] * len(mesh.ranks), kind)
    for axis in reversed(range(mesh.ndim)):
        size = mesh.shape[axis]
        if size > 1:
            items = all_gather(items, 0, mesh.get_group(axis), [items.shape[0]] * size, kind)
    return items


def all_reduce(t: torch.Tensor, op: str, group, parts: int) -> torch.Tensor:
    out = t.contiguous().clone()
    _record("all_reduce", out, group)
    _issue("all_reduce", op, group, dist.all_reduce, out, _OPS[op], group=group)
    if op == "avg":
        out /= parts
    return out


def all_gather(t: torch.Tensor, dim: int, group, sizes: list[int], kind: str = "all_gather") -> torch.Tensor:
    """Concatenate every rank's piece along `dim`; `sizes` are the pieces' lengths (uneven allowed)."""
    parts = len(sizes)
    top = max(sizes)
    src = t.movedim(dim, 0) if dim else t
    if src.shape[0] != top:
        pad = src.new_zeros((top - src.shape[0],) + tuple(src.shape[1:]))
        src = torch.cat([src, pad])
    src = src.contiguous()
    out = src.new_empty((parts * top,) + tuple(src.shape[1:]))
    _record(kind, src, group)
    _issue(kind, dim, group, dist.all_gather_single, out, src, group=group)
    if any(s != top for s in sizes):
        out = torch.cat([c[:s] for c, s in zip(out.chunk(parts), sizes)])
    return out.movedim(0, dim).contiguous() if dim else out  # model code may .view() the result


def reduce_scatter(t: torch.Tensor, dim: int, op: str, group, sizes: list[int], index: int) -> torch.Tensor:
    """Reduce over the axis and keep piece `index` of `dim` (uneven pieces fall back to all_reduce)."""
    parts = len(sizes)
    if any(s != sizes[0] for s in sizes):
        full = all_reduce(t, op, group, parts)
        return full.narrow(dim, sum(sizes[:index]), sizes[index])
    src = (t.movedim(dim, 0) if dim else t).contiguous()
    out = src.new_empty((sizes[0],) + tuple(src.shape[1:]))
    _record("reduce_scatter", src, group)
    _issue("reduce_scatter", (dim, op), group, dist.reduce_scatter_single, out, src, _OPS[op], group=group)
    if op == "avg":
        out /= parts
    return out.movedim(0, dim) if dim else out


def all_to_all(t: torch.Tensor, gather_dim: int, scatter_dim: int, group, parts: int) -> torch.Tensor:
    """Even split of `scatter_dim` sent out, pieces of `gather_dim` received: S(gather) -> S(scatter)."""
    chunks = [c.contiguous() for c in t.chunk(parts, scatter_dim)]
    src = torch.stack(chunks)
    out = torch.empty_like(src)
    _record("all_to_all", src, group)
    _issue("all_to_all", (gather_dim, scatter_dim), group, dist.all_to_all_single, out, src, group=group)
    return torch.cat(out.unbind(0), dim=gather_dim)


def broadcast(t: torch.Tensor, src_rank: int, group=None) -> torch.Tensor:
    """`t` from global rank `src_rank` to every rank of `group` (in place when `t` is contiguous)."""
    t = t.contiguous()
    _record("broadcast", t, group)
    _issue("broadcast", src_rank, group, dist.broadcast, t, src_rank, group=group)
    return t


# ---- in place, on flat buffers, optionally asynchronous: hsdp's gathers and gradient reductions ----------
def all_gather_into(out: torch.Tensor, t: torch.Tensor, group, async_op: bool = False, check_group=None):
    """Every rank's flat `t` concatenated into `out` (rank order); returns the work when `async_op`."""
    _record("all_gather", t, group)
    return _issue("all_gather", f"flat {t.numel()} {t.dtype}", group, dist.all_gather_single, out, t,
                  check_over=check_group, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, t: torch.Tensor, group, async_op: bool = False, check_group=None):
    """The sum over the ranks of flat `t`, this rank's equal piece into `out`; the work when `async_op`."""
    _record("reduce_scatter", t, group)
    return _issue("reduce_scatter", f"flat {t.numel()} {t.dtype} sum", group, dist.reduce_scatter_single, out, t,
                  _OPS["sum"], check_over=check_group, group=group, async_op=async_op)


def all_reduce_(t: torch.Tensor, group, async_op: bool = False, op: str = "sum", check_group=None):
    """`t` summed (or `op`) over the ranks of `group`, in place; the work when `async_op`."""
    _record("all_reduce", t, group)
    return _issue("all_reduce", f"in place {t.numel()} {t.dtype} {op}", group, dist.all_reduce, t, _OPS[op],
                  check_over=check_group, group=group, async_op=async_op)


def wait(work, kind: str, what: str, group) -> None:
    """Wait for an asynchronous collective (None: nothing in flight); a failure becomes CollectiveError."""
    if work is None:
        return
    try:
        work.wait()
    except RuntimeError as e:
        raise _check.CollectiveError(_check.failure_message(kind, what, group, e)) from e


def send(t: torch.Tensor, dst: int, group=None) -> None:
    """Point-to-point to global rank `dst` (the receiver posts `recv`): not checked, ranks differ by design."""
    _record("send", t, group)
    _issue("send", dst, group, _unchecked(dist.send), t, dst, group=group)


def recv(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Receive into `t` from global rank `src`."""
    _issue("recv", src, group, _unchecked(dist.recv), t, src, group=group)
    return t


def record_p2p(ops: list) -> list:
    """Count the sends of a list of `dist.P2POp`s that someone else (torch's pipeline schedules) posts."""
    for op in ops:
        if op.op in (dist.isend, dist.send):
            record_send(op.tensor, op.group)
    return ops


def record_send(tensor: torch.Tensor, group) -> None:
    """Count one point-to-point send of `tensor` over `group` (as `record_p2p` counts torch's; hp.plan books
    the sends of the schedule it replays on meta tensors with it)."""
    _record("send", tensor, group)


# ---- objects (metadata exchanges: checkpoints, checks) -----------------------------------------------------
def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable `obj` on every rank of `group`, in group rank order."""
    out = [None] * dist.get_world_size(group)
    _issue("all_gather_object", type(obj).__name__, group, dist.all_gather_object, out, obj, group=group)
    return out


def broadcast_object(obj, src: int = 0, group=None):
    """`obj` from global rank `src` to every rank of `group`."""
    box = [obj]
    _issue("broadcast_object", src, group, dist.broadcast_object_list, box, src=src, group=group)
    return box[0]


def barrier(group=None) -> None:
    _issue("barrier", "", group, dist.barrier, group=group)


def all_to_all_uneven(t: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows of `t` cut into `input_splits` pieces, piece i to rank i; the pieces received are `output_splits` long.

    The expert-parallel token exchange (any split sizes, empty pieces included). Bytes counted are the
    rows that leave this rank (its own piece stays local)."""
    src = t.contiguous()
    out = src.new_empty((sum(output_splits),) + tuple(src.shape[1:]))
    if _COUNTERS:
        row_bytes = src[:1].numel() * src.element_size()
        leaving = sum(input_splits) - input_splits[dist.get_rank(group)]
        _count("all_to_all", leaving * row_bytes, group)
    detail = f"uneven rows of {tuple(src.shape[1:])} {src.dtype}"  # the splits differ by rank: not compared
    _issue("all_to_all", detail, group, dist.all_to_all_single, out, src, output_split_sizes=list(output_splits),
           input_split_sizes=list(input_splits), group=group)
    return out


class _AllToAllUneven(torch.autograd.Function):
    """Backward of an uneven all_to_all is the reverse all_to_all, with the splits swapped."""

    @staticmethod
    def forward(ctx, t, output_splits, input_splits, group):
        ctx.splits = (output_splits, input_splits, group)
        return all_to_all_uneven(t, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits, group = ctx.splits
        return all_to_all_uneven(grad, input_splits, output_splits, group), None, None, None


def all_to_all_uneven_autograd(t: torch.Tensor, output_splits: list[int], input_splits: list[int],
                               group) -> torch.Tensor:
    """`all_to_all_uneven` that autograd differentiates (rows' gradients travel back to their senders)."""
    return _AllToAllUneven.apply(t, list(output_splits), list(input_splits), group)


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group) -> list:
    """Point-to-point: post every send and receive at once (`batch_isend_irecv`), peers given as ranks of
    `group`; returns the requests, to `wait()` on once the overlapping compute is done."""
    ops = []
    for t, peer in sends:
        _record("send", t, group)
        ops.append(dist.P2POp(dist.isend, t, group=group, group_peer=peer))
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for t, peer in recvs]
    # every rank of the group comes here (some with nothing to move), so check mode compares them all
    return _issue("exchange", "point-to-point", group, _batch_p2p, ops)


def _batch_p2p(ops: list) -> list:
    if ops and ops[0].tensor.is_meta:
        # hp.plan's trace (meta tensors, fake group): no backend coalesces on meta, and nothing moves anyway
        return [dist.isend(op.tensor, group=op.group, group_dst=op.group_peer) if op.op is dist.isend
                else dist.irecv(op.tensor, group=op.group, group_src=op.group_peer) for op in ops]
    return dist.batch_isend_irecv(ops) if ops else []


def ring_step(t: torch.Tensor, group, index: int, parts: int) -> tuple[torch.Tensor, list]:
    """Start sending `t` to the next rank of the ring and receiving the previous rank's into a new buffer.

    Returns (buffer, requests): the buffer holds the previous rank's tensor once the requests are waited on."""
    t = t.contiguous()
    buffer = torch.empty_like(t)
    return buffer, exchange([(t, (index + 1) % parts)], [(buffer, (index - 1) % parts)], group)
