"""`hsdp(model, ...)`: hybrid sharded data parallelism (ZeRO levels 1-3), FSDP2-style, composable with `shard`.

Usage (every rank feeds its own micro-batch as plain tensors, like DDP/FSDP):

    model = hsdp(model, optimizer_level="level3")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # sharded DTensor parameters
    loss = model(**my_micro_batch).loss                      # mean over this rank's micro-batch
    loss.backward()                                          # grads = mean over all dp ranks
    opt.step(); opt.zero_grad()

Design (see param.py for a parameter's two faces, unit.py for the hooks, reduce.py for gradients):
the optimizer always sees DTensor parameters sharded on the dp axis, so its state is sharded at every
level; compute runs on unsharded tensors (plain tensors, or DTensors with the `shard` layout) that hooks
swap into each module for its forward and backward. Levels differ in what stays unsharded:
level1 keeps full parameters and full (all-reduced) gradients, level2 full parameters and sharded
(reduce-scattered) gradients, level3 nothing (parameters gathered per module and freed after).
After `optimizer.step()` the next forward all-gathers the updated shards into the full copy (level1/2).

Gradients: each rank's loss is the mean over its own micro-batch, and `.grad` is the mean over the dp
ranks (times `grad_scale`), i.e. the gradient of the mean loss over the global batch when micro-batches
are equal. Full checkpoints: `model.full_state_dict()` / `model.load_full_state_dict(sd)` (rank 0).

A parameter that took no part in the loss on any rank keeps `grad is None`, as on one device (so AdamW's
weight decay leaves it alone). Limits: every rank must run the same modules (as with FSDP2);
`.to()`, `.half()`, `.float()`, `.cpu()` on the wrapped model are converted by `_apply` on the root,
keeping the parameters' identity and sharding.
"""
from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from ...dtensor.dtensor import DTensor
from ..surgery import bind_save_pretrained, record_applied, refuse_foreign_dtensors, registrations
from . import topology
from .param import HsdpParam
from .unit import HsdpState, Unit

_LEVELS = {"level1": 1, "level2": 2, "level3": 3}


class HSDPModule:
    """Methods mixed into the wrapped model's class (as FSDP2 does)."""

    _hsdp_state: HsdpState

    def set_requires_grad_sync(self, requires_grad_sync: bool) -> None:
        """False: the next backward passes only accumulate local, unreduced gradients (micro-batches);
        the first backward with True reduces the sum. Needs `enable_grad_accumulation=True`."""
        state = self._hsdp_state
        if not requires_grad_sync and not state.grad_accumulation:
            raise ValueError("set_requires_grad_sync(False) needs hsdp(..., enable_grad_accumulation=True): "
                             "skipping the gradient sync keeps unsharded gradients between micro-batches")
        state.sync = bool(requires_grad_sync)

    def zero_grads(self) -> None:
        """Drop every gradient: the sharded `.grad`s and any unreduced micro-batch accumulation."""
        for p in self._hsdp_state.params:
            p.sparam.grad = None
            p.compute.grad = None

    def full_state_dict(self, rank0_only: bool = True) -> dict:
        """Plain full tensors by name (a collective: call on every rank); `{}` off rank 0 if `rank0_only`."""
        from .state_dict import full_state_dict
        return full_state_dict(self, rank0_only)

    def load_full_state_dict(self, state_dict: dict | None, from_rank0: bool = True) -> None:
        """Load plain full tensors (held by rank 0 only when `from_rank0`) into the shards."""
        from .state_dict import load_full_state_dict
        load_full_state_dict(self, state_dict, from_rank0)

    def _apply(self, fn, recurse=True):
        """`.to(dtype/device)`, `.float()`, `.half()`, `.cpu()`: convert hsdp's shards, full buffers and
        compute parameters together (the parameters stay the same objects), then the module's buffers.
        Call it on the root (the hsdp-wrapped) module."""
        for unit in self._hsdp_state.units:
            if unit.inflight is not None:
                unit.gather()  # no collective left in flight
        for p in self._hsdp_state.params:
            p.convert(fn)
        return super()._apply(fn, recurse)  # buffers; the parameters are already converted (fn is a no-op)

    def materialize_hsdp(self, device: torch.device | str = "cpu") -> None:
        """Memory for a model wrapped on the meta device: each rank's shards only (level3), values unset;
        fill them with `hyper_parallel.checkpoint.load_hf` (what `from_pretrained` does)."""
        for p in self._hsdp_state.params:
            p.allocate(torch.device(device))
        for unit in self._hsdp_state.units:
            unit.hook_grads()

    def hsdp_held_tensors(self) -> list:
        """Every tensor hsdp holds for parameters and gradients (for memory accounting)."""
        out = []
        for p in self._hsdp_state.params:
            out += [p.sparam._local, p.buffer]
            if p.sparam.grad is not None:
                out.append(p.sparam.grad._local)
            if p.compute.grad is not None:
                g = p.compute.grad
                out.append(g._local if type(g) is DTensor else g)
        return out


def hsdp(model: nn.Module, shard_size: int = -1, threshold: float = 64, optimizer_level: str = "level1",
         enable_grad_accumulation: bool = False, grad_scale: float = 1.0, reduce_dtype: torch.dtype | None = None,
         comm_async: bool = False, comm_fusion: bool = False, bucket_size: float = -1, mesh=None) -> nn.Module:
    """Shard `model` for data parallelism in place and return it.

    shard_size: ranks one parameter is sharded over (-1: all dp ranks); the dp ranks beyond it hold
    replicas (hybrid). threshold: parameters smaller than this many KB stay unsharded. optimizer_level:
    "level1" (optimizer state), "level2" (+ gradients), "level3" (+ parameters). reduce_dtype: dtype
    of gradient collectives. grad_scale: gradients are the dp mean times this. comm_async: prefetch the
    next module's gather and reduce in the background. comm_fusion/bucket_size (KB, -1 = per module):
    pack several parameters into one collective. mesh: the data-parallel mesh (or a mesh with a "dp"
    axis); by default all ranks that the parameters' own layouts do not use.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"hsdp takes an nn.Module, got {type(model).__name__}")
    refuse_foreign_dtensors(model, "hsdp")
    for m in model.modules():
        if isinstance(m, HSDPModule) or hasattr(m, "_hsdp_state"):
            raise ValueError(f"hsdp: {'the model' if m is model else type(m).__name__} is already wrapped by hsdp; "
                             f"call hsdp once, on the whole model")
    _check_arguments(shard_size, threshold, optimizer_level, grad_scale, reduce_dtype, bucket_size)
    level = _LEVELS[optimizer_level]
    registered = registrations(model)
    params = [p for p, _ in registered.values()]
    topo = topology.resolve(params, mesh, shard_size)
    bucket_bytes = -1.0 if bucket_size is None or bucket_size < 0 else float(bucket_size) * 1024
    state = HsdpState(topo, level, bool(comm_fusion), bucket_bytes, bool(comm_async), reduce_dtype,
                      float(grad_scale), bool(enable_grad_accumulation))

    owner = _owners(model, registered)
    by_unit: dict = {}
    with torch.no_grad():
        for pid, (param, regs) in registered.items():
            fqn = regs[0][2]
            hp = HsdpParam(fqn, param, [(m, n) for m, n, _ in regs], topo, level, float(threshold) * 1024)
            hp.install(hp.sparam)
            state.params.append(hp)
            by_unit.setdefault(owner[pid], []).append(hp)
    for module in [model] + [m for m in by_unit if m is not model]:
        unit = Unit(module, by_unit.get(module, []), state, module is model)
        state.units.append(unit)
    model._hsdp_state = state
    cls = type(model)
    model.__class__ = type(f"HSDP{cls.__name__}", (HSDPModule, cls), {})
    _report(model, state, optimizer_level, threshold)
    bind_save_pretrained(model)
    return model


def _report(model: nn.Module, state: HsdpState, optimizer_level: str, threshold: float) -> None:
    """Record what was sharded (for `summary` and the INFO log); warn when the threshold sharded nothing."""
    sharded = [p for p in state.params if p.sharded]
    size = state.topo.shard_size
    record_applied(model, f"dp: hsdp {optimizer_level}, {len(sharded)} of {len(state.params)} parameters sharded "
                          f"{size}-way (threshold {threshold} KB)")
    if size > 1 and state.params and not sharded:
        warnings.warn(f"hsdp: threshold={threshold} KB left every parameter of {type(model).__name__} unsharded "
                      f"(the largest holds {max(p.buffer.numel() * p.buffer.element_size() for p in state.params) / 1024:.1f} KB): "
                      f"optimizer state, gradients and parameters are replicated; lower the threshold "
                      f"(threshold=0 shards every parameter)", stacklevel=3)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_arguments(shard_size, threshold, optimizer_level, grad_scale, reduce_dtype, bucket_size) -> None:
    """Refuse invalid arguments before anything is sharded. Decided from the arguments alone, so every rank
    (called with the same arguments) raises the same error and none is left waiting in a collective."""
    if optimizer_level not in _LEVELS:
        raise ValueError(f"hsdp: unknown optimizer_level {optimizer_level!r}; use one of {sorted(_LEVELS)}")
    if not _is_number(threshold) or threshold < 0:
        raise ValueError(f"hsdp: threshold={threshold!r} must be a size in KB >= 0 (parameters smaller than it "
                         f"stay unsharded; 0 shards every parameter)")
    if not (isinstance(shard_size, int) and not isinstance(shard_size, bool) and (shard_size == -1 or shard_size >= 1)):
        raise ValueError(f"hsdp: shard_size={shard_size!r} must be -1 (all data-parallel ranks) or a positive "
                         f"divisor of the data-parallel size")
    if bucket_size is not None and (not _is_number(bucket_size) or (bucket_size < 0 and bucket_size != -1)):
        raise ValueError(f"hsdp: bucket_size={bucket_size!r} must be a size in KB >= 0, or -1 (one bucket per module)")
    if not _is_number(grad_scale):
        raise ValueError(f"hsdp: grad_scale={grad_scale!r} must be a finite number")
    if reduce_dtype is not None and not isinstance(reduce_dtype, torch.dtype):
        raise TypeError(f"hsdp: reduce_dtype must be a torch.dtype or None, got {reduce_dtype!r}")


def _unit_modules(model: nn.Module) -> set:
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = {m for m in model.modules() if m is not model and type(m).__name__ in names}
        if found:
            return found
    return {m for m in model.modules() if m is not model and next(m.parameters(recurse=False), None) is not None}


def _owners(model: nn.Module, registrations: dict) -> dict:
    """id(param) -> the unit module gathering it: the innermost unit holding every registration, else root."""
    units = _unit_modules(model)
    enclosing: dict = {}

    def walk(module, current):
        current = module if module in units else current
        if id(module) in enclosing:
            return
        enclosing[id(module)] = current
        for child in module.children():
            walk(child, current)

    walk(model, model)
    owner = {}
    for pid, (_, regs) in registrations.items():
        found = {id(enclosing[id(m)]) for m, _, _ in regs}
        owner[pid] = enclosing[id(regs[0][0])] if len(found) == 1 else model
    return owner


__all__ = ["hsdp", "HSDPModule"]
