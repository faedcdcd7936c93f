"""`context_parallel`: split the sequence of a transformers model over a mesh axis, exact attention."""
from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor, nn

from ...dtensor import DTensor
from ...layout import Layout
from ...layout.layout import PlacementLayout, replicate_layout
from ...layout.mesh import DeviceMesh
from .._applied import record_applied
from ..shard.api import distribute_parameter
from .attention import METHODS, ContextSettings, register_attention
from .zigzag import reorder, zigzag_slice

SEQ_DIM = 1
# inputs laid out in the load-balanced order (the attention's own order); labels stay in the plain
# order, as the base model's outputs are put back into it before the head and the loss
ZIGZAG_INPUTS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")
PLAIN_INPUTS = ("labels",)


def context_parallel(model: nn.Module, mesh: DeviceMesh | Layout, axis: str = "cp",
                     method: str = "ring") -> nn.Module:
    """Split the sequence of the model's inputs over mesh axis `axis`; every attention layer computes
    exact attention over the whole sequence by `method` ("ring", "ulysses" or "allgather").

    Rank i of n holds sequence chunks i and 2n-1-i (causal work balanced); rotary positions and masks
    use global positions; the base model's output comes back in the plain order (an ordinary Shard of
    the sequence over `axis`), so logits, loss and gradients equal the single-device ones. Apply after
    `shard` (heads split over "tp" inside each context rank) and before `hsdp`.
    """
    mesh = mesh.mesh if isinstance(mesh, (Layout, PlacementLayout)) else mesh
    if method not in METHODS:
        raise ValueError(f"context_parallel: method must be one of {METHODS}, got {method!r}")
    settings = ContextSettings(mesh, axis, method)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if method == "ulysses":
        _check_heads_divide(config, mesh, settings)
    _replicate_parameters(model, mesh)
    model.config._attn_implementation = register_attention(settings)
    model.register_forward_pre_hook(functools.partial(_split_inputs, settings, _forward_names(model)),
                                    with_kwargs=True)
    model.base_model.register_forward_hook(functools.partial(_plain_order_outputs, settings))
    record_applied(model, f"cp: sequence split over {axis!r} ({settings.parts} ranks, {method}, "
                          f"rank i holds chunks i and {2 * settings.parts - 1}-i)")
    return model


def _check_heads_divide(config, mesh: DeviceMesh, settings: ContextSettings) -> None:
    """Ulysses swaps the sequence split for a head split: heads per tp rank must divide by the axis size."""
    tp = mesh.size("tp") if "tp" in mesh.mesh_dim_names else 1
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if n % (tp * settings.parts):
            raise ValueError(f"context_parallel(method='ulysses'): {name}={n} does not divide by "
                             f"tp ({tp}) x {settings.axis!r} ({settings.parts}); use method='ring' or 'allgather'")


def _replicate_parameters(model: nn.Module, mesh: DeviceMesh) -> None:
    """Parameters not laid out yet become replicated DTensors on the mesh (tied ones stay tied)."""
    done: dict = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, DTensor):
                continue
            if id(p) not in done:
                done[id(p)] = distribute_parameter(p, replicate_layout(mesh, p.ndim))
            module._parameters[name] = done[id(p)]


def _forward_names(model: nn.Module) -> list[str]:
    return [n for n, p in inspect.signature(model.forward).parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _split_inputs(settings: ContextSettings, names: list[str], module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: the inputs' sequence dim split over the axis (zigzag order, global positions)."""
    kwargs = {**dict(zip(names, args)), **kwargs}
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        raise ValueError("context_parallel: a KV cache (generation) is not supported; call the model "
                         "without past_key_values/cache")
    kwargs["use_cache"] = False  # a cache would gather the split keys and values
    ref = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    if ref is None:
        return (), kwargs
    seq_len, parts = ref.shape[SEQ_DIM], settings.parts
    if seq_len % (2 * parts):
        raise ValueError(f"context_parallel: the sequence length {seq_len} must be a multiple of 2 x "
                         f"{settings.axis!r} size = {2 * parts} (each rank holds two chunks); pad the batch, "
                         f"e.g. tokenizer(..., padding=True, pad_to_multiple_of={2 * parts}), with "
                         "attention_mask 0 and labels -100 on the padding")
    plain_positions = torch.arange(seq_len, device=ref.device).unsqueeze(0)
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = plain_positions
    elif kwargs.get("attention_mask") is None and not isinstance(kwargs["position_ids"], DTensor) \
            and not torch.equal(kwargs["position_ids"].expand(ref.shape[0], -1), plain_positions.expand(ref.shape[0], -1)):
        raise ValueError("context_parallel: packed sequences (position_ids that restart) are not supported; "
                         "pass one sequence per row with an attention_mask")
    # always a mask: without one, transformers would read the zigzag position ids as packed sequences
    mask = kwargs.get("attention_mask")
    kwargs["attention_mask"] = _padding_mask(settings, torch.ones_like(plain_positions.expand(ref.shape[0], -1))
                                             if mask is None else mask)
    for name in ZIGZAG_INPUTS[2:] + ZIGZAG_INPUTS[:1]:
        if kwargs.get(name) is not None:
            kwargs[name] = _split(settings, kwargs[name], zigzag=True)
    for name in PLAIN_INPUTS:
        if kwargs.get(name) is not None:
            kwargs[name] = _split(settings, kwargs[name], zigzag=False)
    return (), kwargs


def _padding_mask(settings: ContextSettings, mask: Tensor):
    """The 2D padding mask, whole on every rank in the zigzag order (b x L, small)."""
    if isinstance(mask, DTensor):
        mask = _split(settings, mask, zigzag=True).full_tensor()
    else:
        mask = torch.cat([zigzag_slice(mask, SEQ_DIM, r, settings.parts) for r in range(settings.parts)], SEQ_DIM)
    if mask.ndim != 2:
        raise ValueError(f"context_parallel: attention_mask must be a 2D padding mask, got {mask.ndim}D")
    return DTensor.from_local(mask.to(torch.bool), replicate_layout(settings.mesh, 2))


def _split(settings: ContextSettings, t: Tensor, zigzag: bool) -> DTensor:
    """Split the sequence dim over the axis: a whole tensor by slicing, a DTensor from its layout."""
    axis, rank, parts = settings.axis_index, settings.rank, settings.parts
    if not isinstance(t, DTensor):
        layout = replicate_layout(settings.mesh, t.ndim)
        local = zigzag_slice(t, SEQ_DIM, rank, parts) if zigzag else t.chunk(parts, SEQ_DIM)[rank]
    else:
        layout = t.dist_layout.without_partial()
        seq_axes = layout.tensor_map[SEQ_DIM]
        if seq_axes == (axis,):  # already split over the axis in the plain order
            local = t.to_local()
            return t if not zigzag else DTensor.from_local(
                reorder(local, SEQ_DIM, settings.group, rank, parts, to_zigzag=True), layout, shape=t.shape)
        if seq_axes:
            raise ValueError(f"context_parallel: input of layout {layout.alias_entries()} splits the sequence "
                             f"over other axes than {settings.axis!r}")
        local = t.redistribute(layout).to_local()
        local = zigzag_slice(local, SEQ_DIM, rank, parts) if zigzag else local.chunk(parts, SEQ_DIM)[rank]
    tensor_map = list(layout.tensor_map)
    tensor_map[SEQ_DIM] = (axis,)
    return DTensor.from_local(local, layout.with_map(tensor_map, layout.partial), shape=t.shape)


def _plain_order(settings: ContextSettings, t):
    if not isinstance(t, DTensor) or t.ndim < 2 or t.dist_layout.tensor_map[SEQ_DIM] != (settings.axis_index,):
        return t
    local = reorder(t.to_local(), SEQ_DIM, settings.group, settings.rank, settings.parts, to_zigzag=False)
    return DTensor.from_local(local, t.dist_layout, shape=t.shape)


def _plain_order_outputs(settings: ContextSettings, module: nn.Module, args, output):
    """Forward hook of the base model: its hidden states back in the plain sequence order."""
    for key in ("last_hidden_state", "hidden_states"):
        value = output.get(key) if hasattr(output, "get") else None
        if isinstance(value, tuple):
            output[key] = tuple(_plain_order(settings, v) for v in value)
        elif value is not None:
            output[key] = _plain_order(settings, value)
    return output
