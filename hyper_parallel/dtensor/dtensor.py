"""DTensor: a wrapper tensor with the global shape as real metadata, holding this rank's shard."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ..layout.layout import Layout, PlacementLayout, replicate_layout
from ..layout.mesh import DeviceMesh
from ..redistribute.planner import redistribute_local
from . import autograd as _bridge
from .autograd import Unwrap, Wrap, local_input

_make_wrapper = torch.Tensor._make_wrapper_subclass
_engine_dispatch = None  # set by hyper_parallel.dispatch: the aten ops the autograd engine runs on DTensors
_Size = torch.Size


class DTensor(torch.Tensor):
    """A global tensor laid out over a device mesh; every op sees single-device values and shapes."""

    # Slots, not instance-dict entries: a wrapper is made for every op's output, and a dict per wrapper
    # costs an allocation, a GC-tracked object and a hash lookup on every read. Other attributes (`_is_param`,
    # `_view_of`, users' own) still go to the lazily made __dict__.
    __slots__ = ("_local", "_layout", "_shape")

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: Layout, shape=None, requires_grad: bool = False):
        shape = tuple(local.shape) if shape is None else tuple(shape)
        return make_dtensor(local, layout, shape, requires_grad)

    # Set by hyper_parallel.dispatch (one dispatch path for every op): a staticmethod, as torch's own
    # _disabled_torch_function_impl is a plain builtin; a classmethod would make a bound method per lookup,
    # and torch looks it up several times per op.
    __torch_function__ = None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _engine_dispatch(func, args, kwargs or {})

    _python_torch_dispatch = __torch_dispatch__  # the reference, when the C twin is installed (autograd.use_c_nodes)

    # ---- construction --------------------------------------------------------------------
    @staticmethod
    def from_local(local: torch.Tensor, layout, placements=None, *, shape=None, run_check: bool = False) -> "DTensor":
        """Wrap this rank's shard; the global shape is the shard's times the split counts unless `shape` is given."""
        if isinstance(local, DTensor):
            raise TypeError("DTensor.from_local takes a plain torch.Tensor, got a DTensor: use .redistribute()")
        layout = resolve_layout(layout, placements, local.ndim)
        given = shape is not None
        if not given:
            shape = tuple(n * layout.shard_count(d) for d, n in enumerate(local.shape))
        shape = tuple(shape)
        if run_check and layout.mesh.distributed:
            _check_from_local(local, layout, shape, given)  # raises on every rank or none
        elif given:
            expect = layout.local_shape(shape)
            if expect != tuple(local.shape):
                raise ValueError(f"local shard of shape {tuple(local.shape)} does not match global shape {shape} "
                                 f"under {layout} (expected {expect} on this rank; run_check=True checks "
                                 f"every rank and raises on all of them)")
        if torch.is_grad_enabled() and local.requires_grad:
            return Wrap.apply(local, layout, shape)
        return make_dtensor(local, layout, shape)

    def to_local(self) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            if torch.is_grad_enabled() and self.requires_grad:
                return Unwrap.apply(self, self._layout, self._layout.without_partial(), self.grad_fn is None)
        local = self._local
        return local.detach() if local.requires_grad else local  # no history outside grad mode

    def redistribute(self, layout, placements=None) -> "DTensor":
        target = resolve_layout(layout, placements, self.ndim)
        if target.mesh is not self._layout.mesh:
            raise ValueError(f"redistribute keeps the mesh: {self._layout.mesh} vs {target.mesh}")
        with torch._C.DisableTorchFunctionSubclass():
            if torch.is_grad_enabled() and self.requires_grad:
                return Wrap.apply(local_input(self, target, target.without_partial()), target, self._shape)
        return make_dtensor(redistribute_local(self._local, self._layout, target, self._shape), target, self._shape)

    def full_tensor(self) -> torch.Tensor:
        return self.redistribute(self._layout.replicated()).to_local()

    def is_contiguous(self, memory_format: torch.memory_format = torch.contiguous_format) -> bool:
        """Whether the local shard is contiguous: for a replicated tensor exactly one device's answer (the local
        went through the same views), for a split one its shard's (a transposed split tensor is not contiguous).

        The wrapper itself is always laid out contiguously (`stride()` answers so, see ops/strided.py), so asking
        it would say True after a transpose, and the `.view` that code guarded by this test then fails. The
        answer may differ between the ranks of a split tensor (an empty or one-row shard is contiguous whatever
        the view), which is harmless: what code does with it, `.contiguous()`, is local."""
        return self._local.is_contiguous(memory_format=memory_format)

    # ---- autograd ------------------------------------------------------------------------
    def register_hook(self, hook):
        return _bridge.register_hook(self, hook)

    def retain_grad(self) -> None:
        return _bridge.retain_grad(self)

    # ---- metadata ------------------------------------------------------------------------
    # Models read these on every layer; as Python attributes they skip __torch_function__ (about 1 us each).
    # The wrapper's metadata is the global one and its local tensor always shares dtype and device.
    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._local.dtype

    @property
    def device(self) -> torch.device:
        return self._local.device

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def dim(self) -> int:
        return len(self._shape)

    def size(self, dim: int | None = None):
        if dim is None:
            return self._shape
        try:
            return self._shape[dim]
        except (IndexError, TypeError):
            raise IndexError(f"Dimension out of range (expected to be in range of [{-len(self._shape)}, "
                             f"{len(self._shape) - 1}], but got {dim})") from None

    def numel(self) -> int:
        n = 1
        for d in self._shape:
            n *= d
        return n

    nelement = numel

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    @property
    def dist_layout(self) -> Layout:
        return self._layout

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._layout.mesh

    @property
    def placements(self) -> tuple:
        return self._layout.placements

    @property
    def local_shape(self) -> torch.Size:
        return self._local.shape

    def __repr__(self):
        return (f"DTensor(shape={tuple(self._shape)}, dtype={self._local.dtype}, layout={self._layout}, "
                f"local={self._local!r})")

    def __format__(self, format_spec: str) -> str:
        """`f"{t}"` and `format(t, spec)` as for a plain tensor: a 0-d DTensor formats as its value, so
        `f"expert_{idx}"` names the same module as on one device; any other DTensor (and a meta one) formats as
        `object.__format__` does (its repr without a spec, TypeError with one), exactly as torch.Tensor.__format__.
        `str(t)` and `repr(t)` stay the DTensor's repr, which shows the layout (a plain tensor's str is its repr too).

        Reading the value must never make ranks wait on each other: formatting is what rank-0-only logging does
        (`if rank == 0: print(f"{loss}")`). A replicated 0-d DTensor's value is this rank's local: no communication.
        A 0-d DTensor with a pending reduction (Partial) has no value on any rank until every rank reduces it, so it
        is never reduced here (that would hang one-rank logging) and its local part is never printed as if it were
        the value. Without a spec it formats as its repr, which names the pending reduction: model code formats
        values eagerly into messages of checks that pass (transformers' `torch_check(cond, f"... {n_tokens}")`), and
        that must keep working on every rank. With a spec (`f"{loss:.4f}"`) it raises ValueError on the rank that
        formats (nothing waits): reduce on every rank first (`t.full_tensor()`) and format that.
        """
        if not self._shape and not self._local.is_meta:
            if not self._layout.has_partial:
                return self._local.detach().item().__format__(format_spec)
            if format_spec:
                raise ValueError(f"format(t, {format_spec!r}) of a 0-d DTensor with a pending reduction "
                                 f"({self._layout}): its value exists only after a reduction across ranks, which "
                                 f"formatting (often done on one rank) must not start. Call t.full_tensor() on every "
                                 f"rank and format that.")
        return object.__format__(self, format_spec)

    def __deepcopy__(self, memo):
        with torch._C.DisableTorchFunctionSubclass():
            out = make_dtensor(copy.deepcopy(self._local, memo), self._layout, self._shape, self.requires_grad)
            if getattr(self, "_is_param", False):
                out._is_param = True
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):
        raise TypeError("a DTensor holds process groups and cannot be pickled: save .to_local() with its layout, "
                        "or use hyper_parallel checkpointing")


def make_dtensor(local: torch.Tensor, layout: Layout, shape: tuple, requires_grad: bool = False) -> DTensor:
    if type(shape) is not _Size:
        shape = _Size(shape)
    out = _make_wrapper(DTensor, shape, dtype=local.dtype, device=local.device, requires_grad=requires_grad)
    out._local = local
    out._layout = layout
    out._shape = shape  # a torch.Size, as `.shape` answers
    return out


def resolve_layout(layout, placements, ndim: int) -> Layout:
    """Accept `layout`, `layout` built from placements, or `(mesh, placements)`; check it fits `ndim` dims."""
    if isinstance(layout, DeviceMesh):
        if placements is None:
            raise ValueError("pass placements with a DeviceMesh, e.g. (mesh, [Shard(0), Replicate()])")
        return Layout.from_placements(layout, placements, ndim)
    if isinstance(layout, (Layout, PlacementLayout)):
        if placements is not None:
            raise ValueError("pass either a Layout or (mesh, placements), not both")
        return layout.for_ndim(ndim)
    raise TypeError(f"expected a Layout or a DeviceMesh, got {type(layout).__name__}")


def _check_from_local(local: torch.Tensor, layout: Layout, shape: tuple, given: bool) -> None:
    """from_local(run_check=True): the ranks exchange their local shapes, dtypes and the global shape each
    one infers, then compare replicated values; every check ends in a verdict all ranks share, so a
    mismatch raises the same ValueError on every rank (an error on some ranks only would hang the others)."""
    from ..redistribute.collectives import broadcast, gather_objects
    mesh = layout.mesh
    seen = gather_objects(mesh, (tuple(local.shape), str(local.dtype), shape))
    bad = [(c, s, d, g) for c, (s, d, g) in seen if g != shape or d != str(local.dtype)
           or tuple(s) != layout.local_shape(g, c)]
    if bad or any(g != seen[0][1][2] for _, (_, _, g) in seen):
        ranks = ", ".join(f"rank at {c}: local {s} {d} -> global {g}" for c, (s, d, g) in seen)
        how = "" if given else " (no shape= given: each rank inferred the global shape from its own shard)"
        raise ValueError(f"from_local(run_check=True) under {layout}: the ranks' local shapes and dtypes do not "
                         f"make one global tensor{how}: {ranks}. Pass shape= (the global shape) and shards that "
                         f"match it (layout.local_shape(shape) on each rank).")
    differ = []
    for a in range(mesh.ndim):
        if layout.placements[a].is_replicate() and mesh.shape[a] > 1:
            group = mesh.get_group(a)
            ref = local.detach().clone()
            ref = broadcast(ref, dist.get_global_rank(group, 0), group=group)
            if not torch.equal(ref, local.detach()):
                differ.append(mesh.mesh_dim_names[a])
    verdicts = gather_objects(mesh, differ)
    wrong = sorted({(c, a) for c, axes in verdicts for a in axes})
    if wrong:
        where = ", ".join(f"rank at {c} on axis {a!r}" for c, a in wrong)
        raise ValueError(f"from_local(run_check=True) under {layout}: ranks along a replicated axis hold "
                         f"different values ({where} differ from the axis' first rank). Replicated shards must "
                         f"be equal: broadcast them or declare the axis Partial or Shard.")


def distribute_tensor(tensor: torch.Tensor, layout, placements=None, *, src_data_rank: int | None = 0) -> DTensor:
    """Shard a full tensor. With `src_data_rank`, that rank's copy is broadcast first (as torch does)."""
    if isinstance(tensor, DTensor):  # the same on every rank: raised everywhere or nowhere
        raise TypeError(f"distribute_tensor takes a plain tensor holding the full value, got a DTensor laid out as "
                        f"{tensor.dist_layout}: use its .redistribute(layout) to change its layout (or "
                        f".full_tensor() to get the plain value)")
    target = resolve_layout(layout, placements, tensor.ndim)
    shape = tuple(tensor.shape)
    full = tensor.detach()
    mesh = target.mesh
    if src_data_rank is not None and mesh.distributed and len(mesh.ranks) == dist.get_world_size() and mesh.size() > 1:
        from ..redistribute.collectives import broadcast
        full = broadcast(full.clone(), src_data_rank)
    local = redistribute_local(full, replicate_layout(mesh, tensor.ndim), target.without_partial(), shape)
    if target.has_partial:
        local = redistribute_local(local, target.without_partial(), target, shape)
    local = local.clone(memory_format=torch.contiguous_format)  # own memory: the full tensor can be freed
    return make_dtensor(local, target, shape, tensor.requires_grad)

