"""Context parallelism of a multimodal model: the language sequence split at its language model's entry.

In Qwen3-VL, Qwen3-VL-MoE and the Qwen3-Omni thinker the base model runs the vision / audio towers, scatters
their features into the placeholder tokens of the whole sequence, computes the 3-D rotary (mrope) positions
from the whole input_ids and grids (`get_rope_index`), and hands its language model the embeddings, the
positions (rows, batch, seq), the padding mask and the deepstack features: rows to add, in the first decoder
layers, at the visual positions (`visual_pos_masks`; the rows are in the row-major order of its True
entries). Splitting input_ids at the top would break every one of those, so the top-level inputs stay
whole (every rank of the axis runs the towers as one device does) and the language model's pre-hook
splits its own inputs the way the text path splits a text model's: embeddings and positions in the zigzag
order, global positions, a whole padding mask; the visual mask sliced the same way, the deepstack rows
reduced to those whose positions this rank holds. The language model's output goes back to the plain order,
where the head and the loss (labels split in the plain order at the top) take it.

Where the language model's attention is of a kind the registered attention cannot take over (`api`'s
`settings.contiguous`), its inputs are split in order instead and everything else it is handed stays whole:
the model's own code runs on the split DTensors through the dispatcher.
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor, nn

from ...dtensor import DTensor
from .. import feed
from . import api as sequence  # the text path's splitting (imported by api itself: read at call time)
from .attention import ContextSettings
from .zigzag import zigzag_slice

DEEPSTACK = "deepstack_visual_embeds"
# the language model's inputs split by name (the rest: any tensor shaped (batch, seq, ...) is split as a per-token one)
_NAMED = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "visual_pos_masks", DEEPSTACK)


def language_model_of(model: nn.Module) -> nn.Module | None:
    """The decoder sub-module of a multimodal model (the module below the base model that owns the text
    config and a layer list, e.g. `model.model.language_model`), or None where the base model is the decoder."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    base = model.base_model
    if text is config or getattr(base, "config", None) is text:
        return None
    for module in base.modules():
        if module is not base and getattr(module, "config", None) is text \
                and isinstance(getattr(module, "layers", None), nn.ModuleList):
            return module
    return None


def check_language_model(language: nn.Module) -> None:
    """Refuse, at `context_parallel` time, a language model that takes deepstack features without the
    method that adds them (the split rows are added there on each rank's own piece)."""
    takes = DEEPSTACK in inspect.signature(type(language).forward).parameters
    if takes and not callable(getattr(language, "_deepstack_process", None)):
        raise NotImplementedError(
            f"context_parallel: {type(language).__name__} takes {DEEPSTACK} but has no _deepstack_process "
            "(this transformers version adds them elsewhere); run it without context parallelism")


def split_at_language_model(language: nn.Module, settings: ContextSettings) -> None:
    """Hook the language model: its inputs split on entry, its output back in the plain order on exit, and
    the deepstack features added on each rank's own piece of the sequence."""
    language.register_forward_pre_hook(functools.partial(_split_inputs, settings), with_kwargs=True)
    language.register_forward_hook(functools.partial(sequence.plain_order_outputs, settings))
    # split in order (attention by the model's own code): its deepstack addition runs through the dispatcher too
    if not settings.contiguous and callable(getattr(language, "_deepstack_process", None)):
        language._deepstack_process = functools.partial(_local_deepstack, language._deepstack_process)


def _split_inputs(settings: ContextSettings, module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of the language model (its inputs come from the base model, the same on every rank)."""
    kwargs = feed.named_inputs(module, args, kwargs)
    ref = kwargs.get("inputs_embeds") if kwargs.get("inputs_embeds") is not None else kwargs.get("input_ids")
    if ref is None or sequence.runs_whole(settings, kwargs):  # as on one device (a decoding step of generate)
        return (), kwargs
    batch, seq_len = ref.shape[:2]
    zigzag = not settings.contiguous
    for name, value in kwargs.items():  # e.g. Gemma4's per_layer_inputs (batch, seq, layers, dim)
        if name not in _NAMED and isinstance(value, Tensor) and value.ndim >= 2 \
                and tuple(value.shape[:2]) == (batch, seq_len):
            kwargs[name] = sequence.split(settings, value, zigzag=zigzag)
    if settings.contiguous:   # positions, masks and visual masks stay whole, in the plain order, as the code reads them
        sequence.split_sequence(settings, kwargs, ref)
        return (), kwargs
    visual = kwargs.get("visual_pos_masks")
    if visual is not None and kwargs.get(DEEPSTACK) is not None:
        kwargs[DEEPSTACK] = [_rows_of_rank(settings, rows, visual) for rows in kwargs[DEEPSTACK]]
    if visual is not None:
        kwargs["visual_pos_masks"] = sequence.split(settings, visual, zigzag=True)
    sequence.split_sequence(settings, kwargs, ref)
    return (), kwargs


def _rows_of_rank(settings: ContextSettings, rows: Tensor, visual: Tensor) -> Tensor:
    """This rank's deepstack rows, in the row-major order of its piece of the visual mask (whose True entries
    index the rows, in the row-major order of the whole mask)."""
    visual = visual.full_tensor() if isinstance(visual, DTensor) else visual
    visual = visual.to(torch.bool)
    order = (visual.flatten().cumsum(0) - 1).reshape(visual.shape)
    mine = zigzag_slice(order, sequence.SEQ_DIM, settings.rank, settings.parts)[
        zigzag_slice(visual, sequence.SEQ_DIM, settings.rank, settings.parts)]
    rows = sequence.replicated_if_grad(settings, rows)
    if not isinstance(rows, DTensor):
        return rows.index_select(0, mine.to(rows.device))
    return _RowsOfRank.apply(rows, mine.to(rows.device), settings)


class _RowsOfRank(torch.autograd.Function):
    """Some rows of a whole (replicated) DTensor, as this rank's plain tensor; each rank takes other rows, so
    the gradient is a pending sum over the axis (each row's gradient lives on the rank that took it)."""

    @staticmethod
    def forward(ctx, rows: DTensor, mine: Tensor, settings: ContextSettings):
        whole = rows.redistribute(rows.dist_layout.replicated()) if not rows.dist_layout.is_replicate else rows
        ctx.mine, ctx.layout, ctx.shape = mine, whole.dist_layout, whole.shape
        ctx.axis = settings.axis
        return whole.to_local().index_select(0, mine)

    @staticmethod
    def backward(ctx, grad):
        local = grad.new_zeros(ctx.shape).index_add_(0, ctx.mine, grad)
        return DTensor.from_local(local, ctx.layout.with_partial(ctx.axis), shape=ctx.shape), None, None


def _local_deepstack(process, hidden, visual_pos_masks, visual_embeds):
    """The model's own deepstack addition, run on this rank's piece of the sequence: the mask was split and
    the rows reduced to that piece at the language model's entry."""
    if not isinstance(hidden, DTensor):
        return process(hidden, visual_pos_masks, visual_embeds)
    layout = hidden.dist_layout
    only_sequence = layout.with_map([() if d != sequence.SEQ_DIM else axes for d, axes in
                                     enumerate(layout.tensor_map)], (None,) * layout.mesh.ndim)
    if layout is not only_sequence:  # a pending sum or a split hidden dim: the rows are added once, whole
        hidden = hidden.redistribute(only_sequence)
    mask = visual_pos_masks.to_local() if isinstance(visual_pos_masks, DTensor) else visual_pos_masks
    out = process(hidden.to_local(), mask, visual_embeds)
    return DTensor.from_local(out, only_sequence, shape=hidden.shape)
