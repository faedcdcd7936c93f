"""`context_parallel`: split the sequence of a transformers model over a mesh axis, exact attention."""
from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from ...dtensor import DTensor
from ...layout import Layout
from ...layout.layout import PlacementLayout, replicate_layout
from ...layout.mesh import DeviceMesh
from .. import feed
from ..dims import TP, ParallelDims
from ..surgery import lay_out_parameters, record_applied, replicated_elsewhere
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
    lay_out_parameters(model, lambda name, p: None, default=replicated_elsewhere(mesh), where="context_parallel")
    if settings.parts == 1:  # one rank holds the whole sequence: the model's own attention is exact
        record_applied(model, f"cp: axis {axis!r} of size 1, the sequence is not split")
        return model
    # only the language model's attention: a vision / audio tower (its own sub-config) keeps its implementation
    # and runs as on one device
    config._attn_implementation = register_attention(settings)
    feed.register(model, mesh, same_feed=(axis,), step=SequenceSplit(settings))
    model.base_model.register_forward_hook(functools.partial(_plain_order_outputs, settings))
    record_applied(model, f"cp: sequence split over {axis!r} ({settings.parts} ranks, {method}, "
                          f"rank i holds chunks i and {2 * settings.parts - 1}-i)")
    return model


def _check_heads_divide(config, mesh: DeviceMesh, settings: ContextSettings) -> None:
    """Ulysses swaps the sequence split for a head split: heads per tp rank must divide by the axis size."""
    tp = ParallelDims.of(mesh, "context_parallel", allow_other_axes=True).size(TP)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if n % (tp * settings.parts):
            raise ValueError(f"context_parallel(method='ulysses'): {name}={n} does not divide by "
                             f"tp ({tp}) x {settings.axis!r} ({settings.parts}); use method='ring' or 'allgather'")


class SequenceSplit:
    """The input step of context parallelism: the ranks of the axis feed the same whole sequences, split
    here over the axis in the zigzag order (global positions, a padding mask whole on every rank)."""

    name = "cp"
    may_refuse = True  # sequence lengths change from step to step
    for_generate = False

    def __init__(self, settings: ContextSettings):
        self.settings = settings

    def refuse(self, inputs: dict) -> str | None:
        """Why these inputs cannot be split over the axis (decided from shapes, before anything runs)."""
        if inputs.get("past_key_values") is not None or inputs.get("cache") is not None:
            return ("context_parallel: a KV cache (generation) is not supported; call the model without "
                    "past_key_values/cache")
        ref = inputs.get("input_ids") if inputs.get("input_ids") is not None else inputs.get("inputs_embeds")
        if ref is None:
            return None
        if ref.ndim < 2:
            return f"context_parallel: input_ids/inputs_embeds need a batch and a sequence dim, got shape {tuple(ref.shape)}"
        batch, seq_len, parts = ref.shape[0], ref.shape[SEQ_DIM], self.settings.parts
        if seq_len % (2 * parts):
            return (f"context_parallel: the sequence length {seq_len} must be a multiple of 2 x "
                    f"{self.settings.axis!r} size = {2 * parts} (each rank holds two chunks); pad the batch, "
                    f"e.g. tokenizer(..., padding=True, pad_to_multiple_of={2 * parts}), with "
                    "attention_mask 0 and labels -100 on the padding")
        problem = feed.token_inputs_problem("context_parallel", inputs, batch, seq_len)
        if problem:
            return problem
        positions = inputs.get("position_ids")
        if positions is not None and inputs.get("attention_mask") is None and not isinstance(positions, DTensor):
            plain = torch.arange(seq_len, device=positions.device).expand(positions.shape)
            if not torch.equal(positions, plain):
                return ("context_parallel: packed sequences (position_ids that restart) are not supported; pass "
                        "one sequence per row with an attention_mask")
        return None

    def restore_order(self, hidden):
        """The base model's output back in the plain sequence order (an ordinary Shard of the sequence), as
        the model's own forward hook does; a pipeline's last stage calls it before the head."""
        return _plain_order(self.settings, hidden)

    def apply(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook body: the inputs' sequence dim split over the axis (zigzag order, global positions)."""
        settings = self.settings
        kwargs = feed.named_inputs(module, args, kwargs)
        kwargs["use_cache"] = False  # a cache would gather the split keys and values
        ref = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        if ref is None:
            return (), kwargs
        seq_len = ref.shape[SEQ_DIM]
        plain_positions = torch.arange(seq_len, device=ref.device).unsqueeze(0)
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = plain_positions
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
