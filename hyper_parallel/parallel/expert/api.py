"""expert_parallel(): every MoE experts module keeps a block of whole experts per rank of one mesh axis.

Reading order: `expert_parallel` -> `find_experts` -> `_lay_out_parameters` -> `_dispatching_forward`
-> `BatchShares`. The axis also carries a share of the batch, like a data-parallel axis (API §12): each
rank feeds its own rows, which become its rows of one batch split over the axis, so every activation is
a DTensor sharded on rows, and the op rules give single-device semantics to everything outside the
experts (replicated parameters get their gradients summed over the axis, the loss is the mean over the
whole batch). Inside an experts
module the local rows travel to the experts' owners and back (dispatch.py); the module's own forward
computes the local experts, so whatever the model's experts do (gating, biases, grouped_mm or eager
loops) is kept. Experts are Shard(0) DTensors, which checkpoints save and reshard like any parameter.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch import Tensor, nn

from ...dtensor.autograd import Wrap, local_input
from ...dtensor.dtensor import DTensor, make_dtensor
from ...layout.layout import Layout
from ...layout.mesh import DeviceMesh
from ...layout.placement import REPLICATE, Shard
from .. import feed
from ..dims import EP, TP
from ..surgery import (bind_save_pretrained, lay_out_parameters, local_experts, move, record_applied,
                       replicated_elsewhere, swapped_parameters)
from .dispatch import dispatch_combine

# model inputs that are never batch-major, whatever their length
_NOT_BATCH = frozenset({"cache_position", "logits_to_keep"})
# model inputs whose dim 0 counts the rank's images / videos / audio clips or their patch rows, not its samples
# (Qwen-VL style: the patches of every image concatenated, prod(grid_thw) rows per image; one grid row or size
# per image; Omni / Qwen2-Audio: one feature row per clip). They are this rank's share all the same: the global
# batch's images are the ranks' images in the axis' order, as its samples are.
PER_ITEM = frozenset({"pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
                      "second_per_grid_ts", "image_sizes", "input_features", "feature_attention_mask",
                      "audio_feature_lengths", "pixel_attention_mask", "image_attention_mask"})


def expert_parallel(model: nn.Module, mesh: DeviceMesh, axis: str = "ep") -> nn.Module:
    """Spread the experts of every MoE experts module of `model` over mesh axis `axis`, in place.

    Each rank of the axis keeps a contiguous block of whole experts; each rank feeds its own share of the
    batch (the global batch is the concatenation of the shares, which must have equal shapes; DTensors
    already laid out are taken as they are); routed tokens travel to their experts by all_to_all and come
    back by a second one. Every other parameter is replicated over the axis (data-parallel). Compose with
    `shard` first (tp) and `hsdp` after (dp), or use `hyper_parallel.parallelize`.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"expert_parallel: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    ranks = mesh.size(axis)  # raises, naming the axes, if the mesh lacks `axis`
    experts = find_experts(model)
    refused = unsupported_experts(model, experts)
    if refused:
        raise ValueError(f"expert_parallel: {type(model).__name__} has experts modules expert parallel cannot "
                         f"spread: " + "; ".join(f"{n}: {why}" for n, why in list(refused.items())[:3])
                         + ". Expert parallel moves whole experts of a module whose parameters stack them on dim 0 "
                           "and whose forward takes the router's (hidden, top_k_index, top_k_weights); train this "
                           "model with dp/tp/pp instead (the ep axis as a data axis: parallelize on a 'dp' mesh)")
    if not experts:
        raise ValueError(f"expert_parallel: {type(model).__name__} has no MoE experts module (a module whose "
                         f"parameters stack experts on dim 0 and whose forward takes (hidden, indices, weights))")
    n_experts = {name: _expert_count(m) for name, m in experts.items()}
    uneven = {name: n for name, n in n_experts.items() if n % ranks}
    if uneven:
        raise ValueError(f"expert_parallel: experts do not divide evenly over the {ranks} ranks of axis {axis!r}: "
                         f"{uneven}; use an axis size that divides the number of experts")
    elsewhere = sorted({repr(p.device_mesh) for p in model.parameters() if isinstance(p, DTensor) and p.device_mesh is not mesh})
    if elsewhere:
        raise ValueError(f"expert_parallel: parameters already live on {', '.join(elsewhere)}, not on {mesh}; expert "
                         f"parallel needs every parameter on the one mesh it is given: shard with that same mesh "
                         f"(style plans then lay out on it), or use hyper_parallel.parallelize")
    split_by_tp = sorted(name for name, m in experts.items() if m.__dict__.get("_hp_experts_split") == TP)
    if split_by_tp:
        raise ValueError(f"expert_parallel: the experts of {split_by_tp[:3]} are already split by shard (its plan "
                         f"has an experts style for them); use hyper_parallel.parallelize(model, mesh, ep=True, ...), "
                         f"which leaves the experts to expert parallelism, or a shard plan without the experts")
    _lay_out_parameters(model, experts, mesh, axis)
    for name, module in experts.items():
        _dispatching_forward(module, mesh, axis, name)
    feed.register(model, mesh, equal_shares=(axis,), step=BatchShares(mesh, axis))
    bind_save_pretrained(model)
    counts = sorted(set(n_experts.values()))
    record_applied(model, f"ep: {len(experts)} experts modules of {'/'.join(map(str, counts))} experts over "
                          f"{axis!r} ({'/'.join(str(n // ranks) for n in counts)} per rank), each rank's rows a "
                          f"share of the batch over {axis!r}")
    return model


def batch_shares_only(model: nn.Module, mesh: DeviceMesh, axis: str = "ep") -> nn.Module:
    """The "ep" axis of a model without experts (`parallelize` on a dense model): a data axis only. Each rank's
    rows become its share of one batch split over `axis`; parameters are replicated over it, their gradients
    summed over it by the op rules."""
    lay_out_parameters(model, lambda name, p: None, default=replicated_elsewhere(mesh), where="parallelize")
    feed.register(model, mesh, equal_shares=(axis,), step=BatchShares(mesh, axis))
    bind_save_pretrained(model)
    record_applied(model, f"ep: {type(model).__name__} has no MoE experts: each rank's rows a share of the batch "
                          f"over {axis!r} (data parallel)")
    return model


# ---- finding the experts ---------------------------------------------------------------------------
def find_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The MoE experts modules of `model`, by structure: every direct parameter stacks the experts on dim 0
    (one 3-D weight at least, all with the same leading size > 1), and forward takes the router's result,
    (hidden_states, top_k_index, top_k_weights), as transformers' experts modules do."""
    found = {}
    for name, module in model.named_modules():
        params = [p for p in module._parameters.values() if p is not None]
        if not params or not any(p.ndim == 3 for p in params):
            continue
        leading = params[0].shape[0]
        if leading < 2 or any(p.ndim < 2 or p.shape[0] != leading for p in params):
            continue
        if _takes_routing(type(module).forward):
            found[name] = module
    return found


def unsupported_experts(model: nn.Module, found: dict | None = None) -> dict[str, str]:
    """MoE experts modules `find_experts` does not take, with why: modules named experts (a parent's
    `experts` attribute, or a class named ...Experts / ...NaiveMoe) outside the ones found."""
    found = find_experts(model) if found is None else found
    taken = {id(m) for m in found.values()}
    out = {}
    for name, module in model.named_modules():
        cls = type(module).__name__
        named = name.rsplit(".", 1)[-1] == "experts" or cls.endswith(("Experts", "NaiveMoe")) or "ParallelExperts" in cls
        if not named or "Shared" in cls or id(module) in taken or any(name.startswith(f + ".") for f in found):
            continue
        if not any(True for _ in module.parameters()) or any(name.startswith(n + ".") for n in out):
            continue
        out[name] = _why_unsupported(module)
    return out


def _why_unsupported(module: nn.Module) -> str:
    cls = type(module).__name__
    children = [m for m in module.children() if any(True for _ in m.parameters())]
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) or (children and not module._parameters):
        return (f"{cls} holds {len(children)} expert modules (not stacked weights) and its forward "
                f"{_signature(module)} routes by its own rule")
    params = {n: tuple(p.shape) for n, p in module._parameters.items() if p is not None}
    leading = {shape[0] for shape in params.values()}
    if len(leading) > 1:
        return (f"{cls}'s stacked weights count different numbers of experts ({params}): extra experts without "
                f"weights (zero/identity experts) are computed where the token lives")
    return (f"{cls}.forward{_signature(module)} does not take the router's (hidden, top_k_index, top_k_weights): "
            f"it computes experts on tokens it sorts or scales itself")


def _signature(module: nn.Module) -> str:
    try:
        return str(inspect.signature(type(module).forward)).replace("self, ", "")
    except (TypeError, ValueError):
        return "(...)"


def _takes_routing(forward) -> bool:
    try:
        sig = inspect.signature(forward)
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len([p for p in sig.parameters.values() if p.kind in kinds]) >= 4  # self, hidden, index, weights


def _expert_count(module: nn.Module) -> int:
    return next(p for p in module._parameters.values() if p is not None).shape[0]


# ---- parameters ------------------------------------------------------------------------------------
def _rows(mesh: DeviceMesh, axis: str, ndim: int) -> Layout:
    """Dim 0 split over `axis`, replicated over every other axis."""
    index = mesh.axis_index(axis)
    placements = [Shard(0) if a == index else REPLICATE for a in range(mesh.ndim)]
    return Layout.from_placements(mesh, placements, ndim)


def _lay_out_parameters(model: nn.Module, experts: dict, mesh: DeviceMesh, axis: str) -> None:
    """Experts' parameters: Shard(0) over `axis` (whole experts per rank, replicated elsewhere). Other
    parameters: replicated DTensors unless `shard` laid them out already, so their gradients are summed
    over the axis by the op rules."""
    expert_ids = {id(p) for m in experts.values() for p in m._parameters.values() if p is not None}
    lay_out_parameters(model, lambda name, p: _rows(mesh, axis, p.ndim) if id(p) in expert_ids else None,
                       default=replicated_elsewhere(mesh), where="expert_parallel")


# ---- the experts' forward -----------------------------------------------------------------------------
def _dispatching_forward(module: nn.Module, mesh: DeviceMesh, axis: str, where: str) -> None:
    """Replace the module's forward by: local rows -> dispatch_combine (the module's own forward computing
    this rank's experts on what it received) -> rows of the output, as a DTensor split like the input."""
    original = module.forward
    module.__dict__["_hp_experts_split"] = EP
    sig = inspect.signature(original)
    n_total = _expert_count(module)
    n_local = n_total // mesh.size(axis)

    # parameters of the module's own submodules (MuseSpark's post-expert norm): shared by every expert,
    # replicated over the axis; inside, they meet the received rows as local tensors
    inner = [sub for name, sub in module.named_modules() if sub is not module
             and any(p is not None for p in sub._parameters.values())]

    def compute(received: Tensor, local_ids: Tensor) -> Tensor:
        params = {pn: p for pn, p in module._parameters.items() if p is not None}
        locals_ = {pn: _local_of(p) for pn, p in params.items()}
        ones = torch.ones(local_ids.shape + (1,), dtype=received.dtype, device=received.device)
        with contextlib.ExitStack() as stack:
            stack.enter_context(local_experts(module, locals_, n_total, n_local))
            for sub in inner:
                shared = {pn: _local_shared(p, axis) for pn, p in sub._parameters.items() if p is not None}
                locals_.update({f"{id(sub)}.{pn}": t for pn, t in shared.items()})
                stack.enter_context(swapped_parameters(sub, shared))
            out = original(received, local_ids.unsqueeze(-1), ones)
        if out.shape[0] == 0 and torch.is_grad_enabled() and received.requires_grad:
            # nothing reached this rank's experts: still join both all_to_alls' backward, with zero gradients
            out = out + sum(t.sum() * 0 for t in (received, *locals_.values()) if t.requires_grad)
        return out

    def forward(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        hidden_name, index_name, weights_name = list(bound.arguments)[:3]
        hidden = move(bound.arguments[hidden_name], lambda nd: _rows(mesh, axis, nd), f"hidden states of {where}")
        index = move(bound.arguments[index_name], lambda nd: _rows(mesh, axis, nd), f"expert indices of {where}")
        weights = move(bound.arguments[weights_name], lambda nd: _rows(mesh, axis, nd), f"routing weights of {where}")
        group = mesh.get_group(axis)  # here, not before: on a virtual mesh (no torch.distributed) this raises
        out = dispatch_combine(_local_rows(hidden), index._local, _local_rows(weights), n_local, group, compute)
        layout = hidden.dist_layout
        if torch.is_grad_enabled() and out.requires_grad:
            return Wrap.apply(out, layout, tuple(hidden.shape))
        return make_dtensor(out, layout, tuple(hidden.shape))

    module.forward = forward


def _local_rows(dt: DTensor) -> Tensor:
    """This rank's rows, autograd-connected: their gradient is this rank's rows of the gradient."""
    if torch.is_grad_enabled() and dt.requires_grad:
        return local_input(dt, dt.dist_layout, dt.dist_layout)
    return dt._local


def _local_shared(p: Tensor, axis: str) -> Tensor:
    """A parameter replicated over `axis` used on this rank's rows only: its local value, whose gradient is
    this rank's part of the sum over the axis (a pending sum, reduced into the parameter's layout)."""
    if not isinstance(p, DTensor):
        return p
    if torch.is_grad_enabled() and p.requires_grad:
        return local_input(p, p.dist_layout, p.dist_layout.with_partial(axis))
    return p._local


def _local_of(p: Tensor) -> Tensor:
    """A parameter's local block of experts, whose gradient lands in the parameter's own layout."""
    if not isinstance(p, DTensor):
        return p
    if torch.is_grad_enabled() and p.requires_grad:
        return local_input(p, p.dist_layout, p.dist_layout)
    return p._local


# ---- each rank's rows, a share of the batch over the axis ------------------------------------------------
class BatchShares:
    """The input step of expert parallelism: each rank's plain batch-major inputs become its rows of one
    DTensor batch split over `axis` (the global batch: the shares concatenated in the axis' order). So do its
    per-item inputs (`PER_ITEM`: its images' patch rows and grids, its audio clips' features), whose dim 0 is
    not the batch: leaving them plain beside a batch-split `image_grid_thw` fed the vision tower this rank's
    patches against every rank's grids. The feed check makes the ranks' shapes equal (one Shard(0) DTensor per
    input), so ranks with different numbers of images or patch rows get the same FeedError everywhere."""

    name = "ep"
    may_refuse = True  # the shares' shapes change from step to step: compared on every forward
    for_generate = True  # generate's loop then runs on the same batch-split DTensors

    def __init__(self, mesh: DeviceMesh, axis: str):
        self.mesh, self.axis, self.ranks = mesh, axis, mesh.size(axis)

    def refuse(self, inputs: dict) -> str | None:
        """Any rows are a share (the feed check compares the shares' shapes across the axis); labels must be one
        per token: a rank whose loss failed on its own would leave the others inside the experts' all_to_all."""
        ref = inputs.get("input_ids") if inputs.get("input_ids") is not None else inputs.get("inputs_embeds")
        if not isinstance(ref, Tensor) or isinstance(ref, DTensor) or ref.ndim < 2:
            return None
        return feed.token_inputs_problem("expert_parallel", inputs, ref.shape[0], ref.shape[1], ("labels",))

    def apply(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
        if not tensors or tensors[0].ndim == 0:
            return args, kwargs
        batch = tensors[0].shape[0]   # input_ids or inputs_embeds: its dim 0 is the batch
        args = tuple(self._share(str(i), a, batch) for i, a in enumerate(args))
        kwargs = {k: self._share(k, v, batch) for k, v in kwargs.items()}
        return args, kwargs

    def _share(self, name: str, x, batch: int):
        if not isinstance(x, Tensor) or isinstance(x, DTensor) or name in _NOT_BATCH:
            return x
        if x.ndim == 0 or (x.shape[0] != batch and name not in PER_ITEM):
            return x
        layout = _rows(self.mesh, self.axis, x.ndim)
        return DTensor.from_local(x, layout, shape=(x.shape[0] * self.ranks,) + tuple(x.shape[1:]))
