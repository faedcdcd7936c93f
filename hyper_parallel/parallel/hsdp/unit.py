"""Module units and their hooks: when parameters are gathered, swapped in, freed, and reduced.

A *unit* is a module whose parameters are gathered together (FSDP2's `fully_shard` module): each
module named in the model's `_no_split_modules` (Hugging Face decoder layers), otherwise each module
that owns parameters directly, plus the root for whatever is left (embeddings, final norm, head, and
any parameter shared between units, such as tied embeddings).

Per unit and step:
1. pre-forward: gather (level3 always; level1/2 when the optimizer changed the shard), swap the
   compute parameters into the module, and with `comm_async` start the next unit's gather;
2. post-forward: swap the sharded parameters back (so `model.parameters()` is always the sharded
   view), free (level3, not the root) and hook the outputs so their gradient triggers the re-gather;
3. backward: the outputs' hook gathers again (and prefetches the unit before it) and swaps the compute
   parameters in until the unit's gradients are all there, as FSDP2's pre-backward unshard does: activation
   checkpointing recomputes the forward inside backward (transformers checkpoints `forward`, so the hooks
   do not run again; `torch.utils.checkpoint` around a module call runs them again, and then they leave
   the parameters swapped in); each compute parameter's post-accumulate-grad hook counts down, and when
   the unit's gradients are all there they are reduced (or, during accumulation without sync, left to
   accumulate), the sharded parameters are swapped back and level3 frees;
4. end of backward (an autograd engine callback queued by the first hook of the pass): reduce
   units that did not complete. Which of their parameters got a gradient on some rank is agreed first
   (one small all-reduce of flags over the data-parallel ranks); those are reduced (zeros where a rank
   did not use them), and a parameter no rank used keeps `grad is None`, as on one device. Then async
   reductions are finished and what is still gathered is freed.
Every rank must run the same units in the same order, as with FSDP2. Every collective goes through
redistribute/collectives.py (counted by `comm_counter`, compared in check mode, `CollectiveError` on a
failure).
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_flatten

from ...redistribute import collectives
from .policy import cast_floating
from .reduce import Reducer, make_buckets


class Unit:
    """One module's parameters gathered and reduced together."""

    def __init__(self, module: torch.nn.Module, params: list, state: "HsdpState", is_root: bool):
        self.module = module
        self.params = params
        self.state = state
        self.is_root = is_root
        self.grad_params = [p for p in params if p.requires_grad]
        self.has_frozen = any(not p.requires_grad for p in params)
        self.reduce_buckets = make_buckets(params, state.level, state.fusion, state.bucket_bytes)
        self.gather_buckets = _gather_buckets([p for p in params if p.sharded], state.fusion, state.bucket_bytes)
        self.seen = 0
        self.reduced = False
        self.inflight = None  # (works, finishes, buffers, versions) of an issued gather
        self.in_backward = False  # between its pre-backward hook and its gradients: compute params installed
        self.hook_grads()
        self.refreshed = [p for p in params if not p.sharded and p.separate]  # compute copies without a gather
        self.handles = [module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True),
                        module.register_forward_hook(self._post_forward)]

    def hook_grads(self) -> None:
        """Count the gradients arriving at the compute parameters (again after they were replaced)."""
        for p in self.grad_params:
            p.compute.register_post_accumulate_grad_hook(self._on_grad)

    # ---- gathering ----------------------------------------------------------------------
    def start_gather(self) -> None:
        """Issue the all-gathers this unit needs (asynchronously when comm_async)."""
        if self.inflight is not None:
            return
        for p in self.refreshed:
            if p.needs_gather():
                p.refresh()
        todo = [b for b in self.gather_buckets if any(p.needs_gather() for p in b)]
        if not todo:
            return
        group = self.state.topo.gather_group
        async_op = self.state.comm_async
        buffers = tuple(p.buffer for b in todo for p in b)
        versions = tuple(t._version for t in buffers)
        works, finishes = [], []
        for bucket in todo:
            work, finish = _gather(bucket, group, async_op)
            works.append(work)
            finishes.append(finish)
        self.inflight = (works, finishes, buffers, versions)

    def gather(self) -> None:
        self.start_gather()
        if self.inflight is None:
            return
        works, finishes, buffers, versions = self.inflight
        self.inflight = None
        for w in works:
            collectives.wait(w, "all_gather", "hsdp parameter gather", self.state.topo.gather_group)
        # Refilling a buffer is not an in-place edit of what autograd saved from it. c10d bumps the
        # version of an async output when any wait runs, so restore the versions seen at issue time.
        torch._C._autograd._unsafe_set_version_counter(buffers, versions)
        for f in finishes:
            f()

    def free(self) -> None:
        if self.inflight is not None:
            self.gather()
        for p in self.params:
            p.free()

    def install_compute(self) -> None:
        """Register the unsharded compute parameters in the modules (for a forward, or a backward)."""
        for p in self.params:
            p.install(p.compute)

    def install_sharded(self) -> None:
        """Register the sharded parameters again: what `model.parameters()` shows outside forward/backward."""
        self.in_backward = False
        for p in self.params:
            p.install(p.sparam)

    # ---- hooks --------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        state = self.state
        if torch._C._current_autograd_node() is not None:  # activation checkpointing recomputes it in backward
            self.gather()
            self.install_compute()
            return state.cast_inputs(args, kwargs)
        if self.is_root:
            state.begin_forward()
        state.order.append(self)
        self.gather()
        self.install_compute()
        if state.comm_async:
            nxt = state.next_in_forward(self)
            if nxt is not None:
                nxt.start_gather()
        return state.cast_inputs(args, kwargs)

    def _post_forward(self, module, args, output):
        state = self.state
        if self.in_backward:
            return output  # a recomputation inside this unit's backward: its parameters stay swapped in
        self.install_sharded()
        grad = torch.is_grad_enabled()
        if state.level == 3 and (not self.is_root or not grad):
            self.free()
        if self.is_root and state.output_dtype is not None:
            output = cast_floating(output, state.output_dtype)
        if grad:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad):
        state = self.state
        state.backward_started()
        # From here until its gradients are in, the unit's compute parameters are swapped in (as FSDP2's
        # pre-backward unshard does): activation checkpointing recomputes the forward during backward, and
        # must see the very parameters the first forward used, not the sharded ones.
        if state.level == 3:
            with torch.no_grad():
                self.gather()
        self.install_compute()
        self.in_backward = True
        if state.level == 3:
            if state.comm_async:
                prev = state.prev_in_forward(self)
                if prev is not None:
                    prev.start_gather()
        return grad

    def _on_grad(self, param) -> None:
        self.seen += 1
        if self.seen == len(self.grad_params):
            self.finish_backward()

    def finish_backward(self, used: set | None = None) -> None:
        """All gradients of this unit are in: reduce them (when syncing) and free the parameters.

        `used`: at the end of backward, the parameters some rank computed a gradient for; the others are
        left without one (`grad is None`), and a bucket holding none of them is not reduced at all."""
        state = self.state
        self.install_sharded()
        if state.level == 3 and not self.has_frozen:
            self.free()  # every use of the parameters in backward is done once all their gradients are
        if state.sync and not self.reduced and self.grad_params:
            self.reduced = True
            with torch.no_grad():
                for bucket in self.reduce_buckets:
                    if used is None or any(p in used for p in bucket.params):
                        state.reducer.reduce(bucket, used)


def _gather_buckets(params: list, fusion: bool, bucket_bytes: float) -> list:
    buckets: list = []
    for p in params:
        nbytes = p.buffer.numel() * p.buffer.element_size()
        last = buckets[-1] if buckets else None
        if (fusion and last and last[0].compute_dtype == p.compute_dtype
                and (bucket_bytes <= 0 or sum(q.buffer.numel() * q.buffer.element_size() for q in last) + nbytes
                     <= bucket_bytes)):
            last.append(p)
        else:
            buckets.append([p])
    return buckets


def _gather(bucket: list, group, async_op: bool):
    """All-gather the shards of `bucket` into their buffers: (work or None, finish callback)."""
    for p in bucket:
        p.alloc()
    S = bucket[0].parts
    if len(bucket) == 1:
        p = bucket[0]
        inp = p.gather_input()
        with p.keep_version():
            work = collectives.all_gather_into(p.buffer, inp, group, async_op)

        def finish():
            p.mark_gathered()
        return work, finish
    sizes = [p.step * p.row for p in bucket]
    inp = torch.empty(sum(sizes), dtype=bucket[0].compute_dtype, device=bucket[0].device)
    o = 0
    for p, n in zip(bucket, sizes):
        p.write_gather_input(inp[o:o + n])  # cast and copied straight into the bucket
        o += n
    out = inp.new_empty(S * inp.numel())
    work = collectives.all_gather_into(out, inp, group, async_op)

    def finish():
        rows = out.view(S, -1)
        o = 0
        for p, n in zip(bucket, sizes):
            with p.keep_version(), torch.no_grad():
                p.buffer.view(S, n).copy_(rows[:, o:o + n])
            p.mark_gathered()
            o += n
    return work, finish


_STATES: "weakref.WeakSet[HsdpState]" = weakref.WeakSet()
_STEP_HOOK = None


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    """Mark the shards an optimizer step updated as changed. Level1/2 gather a shard (and a compute copy is
    refreshed) only when it changed, which its version counter tells, but torch's fused optimizer kernels
    (`fused=True`) write the parameters without bumping it."""
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for state in list(_STATES):
        for p in state.params:
            if id(p.sparam) in ids:
                p.version = None


class HsdpState:
    """What the units of one model share: settings, the reducer, the forward order, sync flag."""

    def __init__(self, topo, level: int, fusion: bool, bucket_bytes: float, comm_async: bool,
                 reduce_dtype, grad_scale: float, grad_accumulation: bool, mixed_precision=None):
        global _STEP_HOOK
        if _STEP_HOOK is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook
            _STEP_HOOK = register_optimizer_step_post_hook(_after_optimizer_step)
        _STATES.add(self)
        self.topo = topo
        mp = mixed_precision
        self.input_dtype = mp.param_dtype if mp is not None and mp.cast_forward_inputs else None
        self.output_dtype = mp.output_dtype if mp is not None else None
        self.level = level
        self.fusion = fusion
        self.bucket_bytes = bucket_bytes
        self.comm_async = comm_async
        self.grad_accumulation = grad_accumulation
        self.reducer = Reducer(topo, reduce_dtype, grad_scale, comm_async)
        self.sync = True
        self.units: list = []
        self.params: list = []
        self.order: list = []
        self.last_order: list = []
        self._callback_queued = False

    def cast_inputs(self, args, kwargs):
        """The unit's forward arguments with floating-point tensors in the compute dtype (FSDP2's
        cast_forward_inputs), or None (unchanged) without mixed precision."""
        if self.input_dtype is None:
            return None
        return cast_floating(args, self.input_dtype), cast_floating(kwargs, self.input_dtype)

    # ---- forward order (prefetch targets) -------------------------------------------------
    def begin_forward(self) -> None:
        if self._callback_queued:  # the last backward stopped before its end (an exception): start afresh
            self._callback_queued = False
            for u in self.units:
                u.seen, u.reduced = 0, False
                u.install_sharded()
        if self.order:
            self.last_order = self.order
        self.order = []
        if self.level == 3:
            for u in self.units:  # nothing stays gathered across steps (a forward without backward)
                u.free()
        if self.level != 3 and self.comm_async:
            for u in self.units:  # level1/2: refresh every changed shard in the background at once
                u.start_gather()

    def next_in_forward(self, unit):
        order = self.last_order
        for i, u in enumerate(order[:-1]):
            if u is unit and order[i + 1].params and not order[i + 1].is_root:
                return order[i + 1]
        return None

    def prev_in_forward(self, unit):
        order = self.order
        for i in range(len(order) - 1, 0, -1):
            if order[i] is unit:
                return order[i - 1]
        return None

    # ---- backward ------------------------------------------------------------------------
    def used_anywhere(self, params: list) -> set:
        """The parameters of `params` that got a gradient on at least one data-parallel rank: flags
        max-reduced over the shard and replica groups (one small all-reduce each)."""
        device = self.params[0].buffer.device if self.params else None
        if device is not None and device.type == "meta":   # hp.plan's trace: the flags are read, so not meta
            device = torch.device("cpu")
        flags = torch.tensor([p.compute.grad is not None for p in params], dtype=torch.int32, device=device)
        for group, check in ((self.topo.reduce_shard_group, self.topo.check_group),
                             (self.topo.reduce_replicate_group, None)):
            if group is not None:
                collectives.all_reduce_(flags, group, op="max", check_group=check)
        return {p for p, flag in zip(params, flags.tolist()) if flag}

    def backward_started(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        """Reduce what did not complete, in a fixed order (the same on every rank), and clean up."""
        self._callback_queued = False
        ordered = []
        for u in list(reversed(self.order)) + self.units:
            if u not in ordered:
                ordered.append(u)
        incomplete = [u for u in ordered if self.sync and u.grad_params and not u.reduced]
        if incomplete:
            used = self.used_anywhere([p for u in incomplete for p in u.grad_params])
            for u in incomplete:
                u.finish_backward(used)
        self.reducer.flush()
        for u in self.units:
            u.seen = 0
            u.reduced = False
            u.install_sharded()
            if self.level == 3:
                u.free()
