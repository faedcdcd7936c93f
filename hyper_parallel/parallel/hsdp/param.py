"""One parameter under hsdp: the sharded DTensor the optimizer updates, and the unsharded tensor compute uses.

Every parameter has two faces:
- `sparam`, an `nn.Parameter` DTensor on the storage mesh, registered in the module outside forward:
  what `model.parameters()`, the optimizer, `state_dict()` and `full_tensor()` see. A sharded
  parameter is `Shard(0)` on the dp shard axis (torch.chunk pieces of this rank's tp-local rows).
- `compute`, an `nn.Parameter` (plain, or a DTensor with the parameter's original tp layout) swapped
  into the module for its forward. It is a view of `buffer`, a flat tensor holding every shard's rows,
  each padded to the same length, so one all-gather fills it and no copy-out is needed.

Per level (`buffer` is the unsharded parameter):
- level1/level2: `buffer` stays allocated; the shard is a *view* of this rank's rows of it, so the
  optimizer updates those rows in place and the next forward all-gathers the other ranks' rows
  (only when the shard changed: its version counter says so). Memory: full params, sharded state.
- level3: the shard owns its memory; `buffer`'s storage is allocated and all-gathered before a
  module's forward and backward and resized to zero after (as FSDP2 does). Autograd saved the very
  tensors that alias `buffer`, so refilling the storage is seen by backward; the version counter is
  preserved across the refill so autograd does not mistake it for an in-place edit.
Parameters below the size threshold (and 0-d or one-row ones) are not sharded: `sparam` is replicated on dp and
shares memory with `compute`; their gradients are all-reduced.

Mixed precision (`param_dtype`) and offload (`host`) keep the shard apart from `buffer` (`separate`): the
shard, what the optimizer updates, stays in the model's dtype (fp32 master) and, offloaded, in host memory;
`buffer` is in `param_dtype` on the compute device. A gather casts (and copies in) the shard first; a
reduced gradient is cast back to the master dtype (and copied out to the host). An unsharded parameter
then has a compute copy of its own, refreshed (cast, copied in) when the optimizer changed the master.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ...dtensor.dtensor import DTensor, make_dtensor
from .topology import Topology


class HsdpParam:
    """The two faces of one parameter and the arithmetic of its padded shards."""

    def __init__(self, fqn: str, param: nn.Parameter, registrations: list, topo: Topology, level: int,
                 threshold_bytes: float, param_dtype: torch.dtype | None = None, offload: str | None = None):
        self.fqn = fqn
        self.registrations = registrations  # every (module, name) the parameter is registered under (tied)
        self.requires_grad = param.requires_grad
        is_dt = type(param) is DTensor
        self.compute_layout = param._layout if is_dt else None
        self.global_shape = tuple(param.shape)
        local = (param._local if is_dt else param).detach()
        self.local_shape = tuple(local.shape)
        self.dtype = local.dtype  # the master's: what the optimizer and its state see
        self.mixed = param_dtype is not None and local.is_floating_point()
        self.compute_dtype = param_dtype if self.mixed else local.dtype  # gathered parameters, compute, gradients
        self.device = local.device  # where compute runs
        self.host = torch.device("cpu") if offload == "cpu" else None  # where the master lives between uses
        self.separate = self.mixed or self.host is not None  # the shard is not a view of `buffer`
        self.level = level
        nbytes = local.numel() * local.element_size()
        # one row cannot be split (its dim is a broadcast dim to the elementwise rules an optimizer step uses)
        self.sharded = (local.ndim > 0 and local.shape[0] > 1 and local.numel() > 0 and nbytes >= threshold_bytes
                        and topo.shard_size > 1)
        S = topo.shard_size if self.sharded else 1
        self.parts = S
        rows = self.local_shape[0] if local.ndim else 1
        self.rows = rows
        self.row = math.prod(self.local_shape[1:]) if local.ndim else 1
        self.step = -(-rows // S)  # torch.chunk piece length (the padded length of every shard)
        r = topo.shard_rank if self.sharded else 0
        self.offset = min(r * self.step, rows)
        self.length = max(0, min(self.step, rows - self.offset))
        self.layout = topo.storage_layout(self.compute_layout, local.ndim, self.sharded)
        if self.sharded:
            self.buffer = local.new_empty(S * self.step * self.row, dtype=self.compute_dtype)
            self.full = self.buffer[: rows * self.row].view(self.local_shape)
            shard_rows = local.reshape(rows, self.row)[self.offset: self.offset + self.length]
            with torch.no_grad():
                self.full.copy_(local)
            if level == 3 or self.separate:
                shard = self._to_host(shard_rows.reshape((self.length,) + self.local_shape[1:]).clone())
            else:
                shard = self._buffer_rows()
            self.gathered = True
        elif self.separate:
            self.buffer = local.to(dtype=self.compute_dtype, copy=True).reshape(-1)
            self.full = self.buffer.view(self.local_shape)
            shard = self._to_host(local)
            self.gathered = True
        else:
            self.buffer = local.reshape(-1) if local.is_contiguous() else local.contiguous().reshape(-1)
            self.full = self.buffer.view(self.local_shape)
            shard = self.full
            self.gathered = True
        self.sparam = _parameter(make_dtensor(shard, self.layout, self.global_shape), self.requires_grad)
        c = make_dtensor(self.full, self.compute_layout, self.global_shape) if is_dt else self.full
        self.compute = _parameter(c, self.requires_grad)
        self.version = self._shard_version()
        self.free()

    # ---- the shard ----------------------------------------------------------------------
    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """The master shard's home: host memory when offloaded (pinned when a GPU copies it), else `t`."""
        if self.host is None or t.device == self.host:
            return t
        return t.to(self.host).pin_memory() if torch.cuda.is_available() else t.to(self.host)

    def _buffer_rows(self) -> torch.Tensor:
        return self.buffer[self.offset * self.row: (self.offset + self.length) * self.row].view(
            (self.length,) + self.local_shape[1:])

    def _shard_version(self):
        return (id(self.sparam._local), self.sparam._local._version)

    def needs_gather(self) -> bool:
        """level3: whenever not gathered; level1/2: when the shard changed since the last gather."""
        if not self.sharded:
            return self.separate and self._shard_version() != self.version
        if self.level == 3:
            return not self.gathered
        return self._shard_version() != self.version

    def _current_shard(self) -> torch.Tensor:
        local = self.sparam._local
        if self.level != 3 and not self.separate and not _aliases(local, self.buffer):
            # the optimizer or a load replaced the local tensor: make the buffer rows the shard again
            with torch.no_grad():
                self._buffer_rows().copy_(local)
            self.sparam._local = self._buffer_rows()
            local = self.sparam._local
        return local

    def gather_input(self) -> torch.Tensor:
        """This rank's shard, flat and padded to `step` rows, in the compute dtype on the compute device (a copy:
        in level1/2 it aliases `buffer`)."""
        flat = self._current_shard().reshape(-1)
        if (self.length == self.step and (self.level == 3 or self.separate) and flat.dtype == self.compute_dtype
                and flat.device == self.device):
            return flat.contiguous()
        out = torch.empty(self.step * self.row, dtype=self.compute_dtype, device=self.device)
        self.write_gather_input(out)
        return out

    def write_gather_input(self, dst: torch.Tensor) -> None:
        """Write `gather_input()` into `dst` (flat, `step * row`): cast and copied in by one copy, padding zeroed."""
        n = self.length * self.row
        dst[:n].copy_(self._current_shard().reshape(-1), non_blocking=True)
        if n < dst.numel():
            dst[n:].zero_()

    def alloc(self) -> None:
        storage = self.buffer.untyped_storage()
        want = self.buffer.numel() * self.buffer.element_size()
        if storage.nbytes() != want:
            storage.resize_(want)

    def refresh(self) -> None:
        """An unsharded parameter's compute copy from its master (cast, copied in): no collective needed."""
        with torch.no_grad(), self.keep_version():
            self.full.copy_(self.sparam._local)
        self.version = self._shard_version()

    def mark_gathered(self) -> None:
        self.gathered = True
        self.version = self._shard_version()

    def free(self) -> None:
        """level3: drop the unsharded storage (autograd's saved aliases keep their metadata, not memory)."""
        if self.sharded and self.level == 3 and self.gathered:
            self.buffer.untyped_storage().resize_(0)
            self.gathered = False

    def keep_version(self):
        """Writes into `buffer` that autograd must not count as in-place edits of saved tensors."""
        if self.sharded or self.separate:
            return torch.autograd._unsafe_preserve_version_counter(self.buffer)
        return contextlib.nullcontext()

    # ---- gradients ----------------------------------------------------------------------
    def take_grad(self) -> torch.Tensor | None:
        """Detach the accumulated unsharded gradient from the compute parameter (local tensor, or None)."""
        g = self.compute.grad
        if g is None:
            return None
        self.compute.grad = None
        return g._local if type(g) is DTensor else g

    def padded_grad(self, g: torch.Tensor | None, dtype) -> torch.Tensor:
        """The gradient flat, padded to `parts * step` rows, in the reduction dtype (zeros if unused)."""
        n = self.parts * self.step * self.row
        if g is None:
            return torch.zeros(n, dtype=dtype, device=self.buffer.device)
        flat = g.reshape(-1)
        if flat.numel() == n:
            return flat.to(dtype).contiguous()
        out = torch.zeros(n, dtype=dtype, device=flat.device)
        out[: flat.numel()].copy_(flat)
        return out

    def write_padded_grad(self, dst: torch.Tensor, g: torch.Tensor | None) -> None:
        """Write `padded_grad(g)` into `dst`, a (parts, step * row) view of a bucket: one (casting) copy."""
        if g is None:
            dst.zero_()
            return
        flat, n = g.reshape(-1), dst.shape[1]
        whole, rest = divmod(flat.numel(), n)
        if whole:
            dst[:whole].copy_(flat[: whole * n].view(whole, n))
        if rest:
            dst[whole, :rest].copy_(flat[whole * n:])
            dst[whole, rest:].zero_()
        dst[whole + (1 if rest else 0):].zero_()

    def set_grad(self, shard_grad: torch.Tensor) -> None:
        """Give the sharded parameter its gradient, accumulating as torch does for `.grad`."""
        local = self.sparam._local
        shard_grad = shard_grad.view(local.shape)
        if shard_grad.dtype != self.dtype or shard_grad.device != local.device:
            shard_grad = shard_grad.to(device=local.device, dtype=self.dtype)
        g = self.sparam.grad
        if g is None:
            self.sparam.grad = make_dtensor(shard_grad, self.layout, self.global_shape)
        else:
            with torch.no_grad():
                g._local.add_(shard_grad)

    # ---- memory for a model wrapped on the meta device ----------------------------------------
    @torch.no_grad()
    def allocate(self, device: torch.device) -> None:
        """Real memory for a parameter that hsdp wrapped on the meta device: the shard (and, level1/2,
        the full buffer), values unset: load them next. Both faces become new Parameter objects."""
        self.device = torch.device(device)
        self.buffer = torch.empty(self.buffer.numel(), dtype=self.compute_dtype, device=device)
        self.full = self.buffer[: self.rows * self.row].view(self.local_shape)
        if self.sharded and (self.level == 3 or self.separate):
            shard = torch.empty((self.length,) + self.local_shape[1:], dtype=self.dtype, device=self.host or device)
        elif self.separate:
            shard = torch.empty(self.local_shape, dtype=self.dtype, device=self.host or device)
        else:
            shard = self._buffer_rows() if self.sharded else self.full
        self.sparam = _parameter(make_dtensor(shard, self.layout, self.global_shape), self.requires_grad)
        c = make_dtensor(self.full, self.compute_layout, self.global_shape) if self.compute_layout else self.full
        self.compute = _parameter(c, self.requires_grad)
        self.install(self.sparam)
        self.gathered = True
        self.version = None  # loaded shards: the first forward gathers
        self.free()

    # ---- dtype / device conversion (Module.to, .float(), .half(), .cpu()) -----------------
    @torch.no_grad()
    def convert(self, fn) -> None:
        """Apply a tensor conversion `fn` (as `Module._apply` gets it) to both faces, keeping the
        Parameter objects (optimizer references, tied registrations, grad hooks) and the sharding."""
        if (self.level == 3 and self.sharded) or self.separate:
            if self.gathered:
                self.free()
            shard = fn(self.sparam._local)
            if shard is self.sparam._local:
                return
            if self.host is not None and shard.device != self.host:
                raise ValueError(f"{self.fqn}: hsdp(offload='cpu') keeps the sharded parameters in host memory; "
                                 f"move the model to its compute device before hsdp, not after")
            if self.host is None:
                self.device = shard.device
            dtype = self.compute_dtype if self.mixed else shard.dtype
            self.buffer = torch.empty(self.buffer.numel(), dtype=dtype, device=self.device)
            self.full = self.buffer[: self.rows * self.row].view(self.local_shape)
        else:
            if self.level != 3 and self.sharded:
                self.gather_input()  # the optimizer or a load may have replaced the shard: rows are current
            buffer = fn(self.buffer)
            if buffer is self.buffer:
                return
            self.buffer = buffer.contiguous()
            self.full = self.buffer[: self.rows * self.row].view(self.local_shape)
            shard = self._buffer_rows() if self.sharded else self.full
        self.dtype = shard.dtype
        self.compute_dtype = self.buffer.dtype
        self.device = self.buffer.device
        self.sparam.data = make_dtensor(shard, self.layout, self.global_shape)
        c = make_dtensor(self.full, self.compute_layout, self.global_shape) if self.compute_layout else self.full
        self.compute.data = c
        if self.sparam.grad is not None:
            g = self.sparam.grad
            self.sparam.grad = make_dtensor(fn(g._local), g._layout, tuple(g.shape))
        self.compute.grad = None  # unreduced micro-batch gradients do not survive a cast
        self.gathered = not (self.level == 3 and self.sharded)
        # other ranks' rows may predate their last optimizer step: the next forward gathers them again
        self.version = None if self.sharded or self.separate else self._shard_version()
        if self.level == 3 and self.sharded:
            self.buffer.untyped_storage().resize_(0)

    # ---- module registration ------------------------------------------------------------
    def install(self, which: nn.Parameter) -> None:
        for module, name in self.registrations:
            module._parameters[name] = which


def _parameter(t: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """An nn.Parameter around exactly `t`: its local tensor (a view of `buffer`) and its layout. Built below
    the dispatcher (torch's own alias), which would otherwise plan a layout for the detach, and gathers a
    shard that is empty on some rank (a parameter with fewer rows than shards)."""
    with torch._C.DisableTorchFunctionSubclass():
        return nn.Parameter(t, requires_grad)


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.data_ptr() == sb.data_ptr() and sa.nbytes() > 0
