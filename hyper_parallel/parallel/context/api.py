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
from .attention import HELD_ORDER, INDEX_MASK, METHODS, ContextSettings, off_axis_map, register_attention
from .multimodal import check_language_model, language_model_of, split_at_language_model
from .own_attention import own_attention_problem, score_bias_problem
from .scan_layers import run_whole, scan_layer_types, scan_layers
from .zigzag import reorder, token_index, zigzag_slice

SEQ_DIM = 1
# inputs laid out in the load-balanced order (the attention's own order); labels stay in the plain
# order, as the base model's outputs are put back into it before the head and the loss
ZIGZAG_INPUTS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")
PLAIN_INPUTS = ("labels",)
# the names of a KV cache among a forward's inputs (transformers 5 calls it `cache`, earlier `past_key_values`)
CACHE_INPUTS = ("cache", "past_key_values")
# a recurrent model's state from the forward before (RWKV's, Mamba's): a forward given one continues a sequence,
# which `runs_whole` does not take for a forward of its own
_STATE_INPUTS = ("state", "cache_params", "mems")


def context_parallel(model: nn.Module, mesh: DeviceMesh | Layout, axis: str = "cp",
                     method: str = "ring") -> nn.Module:
    """Split the sequence of the model's inputs over mesh axis `axis`; every attention layer computes
    exact attention over the whole sequence by `method` ("ring", "ulysses" or "allgather").

    Rank i of n holds sequence chunks i and 2n-1-i (causal work balanced); rotary positions and masks
    use global positions; the base model's output comes back in the plain order (an ordinary Shard of
    the sequence over `axis`), so logits, loss and gradients equal the single-device ones. Apply after
    `shard` (heads split over "tp" inside each context rank) and before `hsdp`.

    A multimodal model whose decoder is a sub-module (Qwen3-VL's `model.language_model`) is fed whole, so
    that its towers, the placeholder scatter and the 3-D rotary positions see the whole sequence as on one
    device; the sequence is split at the language model's entry instead (`multimodal.py`).

    `model.generate` works as on one device: its prompt forward is split and fills the KV cache whole, its
    decoding steps run whole on every rank (`SequenceSplit`; prompts left-padded to a multiple of 2n).
    """
    mesh = mesh.mesh if isinstance(mesh, (Layout, PlacementLayout)) else mesh
    if method not in METHODS:
        raise ValueError(f"context_parallel: method must be one of {METHODS}, got {method!r}")
    settings = ContextSettings(mesh, axis, method)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(model.config, "is_encoder_decoder", False):   # Florence-2, UDOP, T5Gemma2, VisionEncoderDecoder
        raise ValueError(f"context_parallel: {type(model).__name__} is an encoder-decoder model "
                         f"(config.is_encoder_decoder): its decoder inputs are the labels shifted right and its "
                         f"cross-attention reads the encoder's sequence, neither of which the sequence split keeps "
                         f"exact; run this model without context parallelism (dp, tp or hsdp)")
    language = language_model_of(model)
    if language is not None:
        check_language_model(language)  # before anything changes: a refusal leaves the model as it was
    decoder = language if language is not None else model.base_model   # the modules that get the split sequence
    # layers that mix the sequence by a scan (linear attention, state-space, short convolutions) run whole
    scans = scan_layers(decoder, config) if scan_layer_types(config) else []
    # what the registered attention cannot take over: attention code of its own (Bloom, GPT-Neo, ...), a bias in its
    # own 4-D mask, positions from ids, sparse (indexed) attention, chunked attention (a scan layer runs whole,
    # whatever it holds; an axis of size 1 splits nothing)
    problem = (own_attention_problem(decoder, config, scans) or score_bias_problem(scans)
               or _attention_kind_problem(config))
    settings.contiguous = bool(problem)
    if method == "ulysses" and not settings.contiguous:
        _check_heads_divide(config, mesh, settings)
    lay_out_parameters(model, lambda name, p: None, default=replicated_elsewhere(mesh), where="context_parallel")
    if settings.parts == 1:  # one rank holds the whole sequence: the model's own attention is exact
        record_applied(model, f"cp: axis {axis!r} of size 1, the sequence is not split")
        return model
    if not settings.contiguous:
        # only the language model's attention: a vision / audio tower (its own sub-config) keeps its implementation
        # and runs as on one device (a plain string would be set on the text config's sub-configs too, where the
        # text config is the model's own: Git's, Kimi-K2.5's)
        config._attn_implementation = {"": register_attention(settings)}
        run_whole(settings, scans)
    feed.register(model, mesh, same_feed=(axis,), step=SequenceSplit(settings, split_here=language is None))
    model.register_forward_hook(whole_logits_when_generating, with_kwargs=True)
    if language is None:
        _hidden_state_module(model).register_forward_hook(functools.partial(plain_order_outputs, settings))
    else:
        split_at_language_model(language, settings)
    record_applied(model, _applied_note(settings, config, language, scans, problem))
    return model


def _hidden_state_module(model: nn.Module) -> nn.Module:
    """The module whose output is the hidden states the head reads: the decoder `get_decoder()` names where it sits
    inside the base model (OPT's head calls `model.decoder` itself, past the base model's forward), else the base
    model."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        decoder = None
    if isinstance(decoder, nn.Module) and any(decoder is m for m in model.base_model.modules()):
        return decoder
    return model.base_model


def _attention_kind_problem(config) -> str | None:
    """Why the registered attention cannot compute this config's attention layers, or None: sparse attention
    (DeepSeek-V3.2's indexer picks the keys each query sees), chunked attention (Llama 4)."""
    sparse = sorted({t for t in getattr(config, "layer_types", None) or () if t in _SPARSE_ATTENTION})
    if sparse:
        return f"the config's layer_types include {sparse} (sparse attention: an indexer selects the keys of each query)"
    if getattr(config, "attention_chunk_size", None):
        return f"attention_chunk_size={config.attention_chunk_size} (chunked attention)"
    return None


def _applied_note(settings: ContextSettings, config, language, scans: list, problem: str | None) -> str:
    """The summary line of what `context_parallel` did."""
    axis, parts = settings.axis, settings.parts
    where = "" if language is None else (f" at the entry of {type(language).__name__} (the towers and 3-D "
                                         "positions whole, as on one device)")
    if settings.contiguous:
        return (f"cp: sequence split over {axis!r}{where} in order ({parts} ranks, rank i holds the i-th of {parts} "
                f"chunks); attention by the model's own code through the dispatcher, which gathers the keys and "
                f"values each query block needs (method {settings.method!r} not used: {problem})")
    whole = f"; {len(scans)} scan layers ({', '.join(scan_layer_types(config))}) run whole" if scans else ""
    return (f"cp: sequence split over {axis!r}{where} ({parts} ranks, {settings.method}, "
            f"rank i holds chunks i and {2 * parts - 1}-i{whole})")


# layer kinds whose attention selects or compresses keys (DeepSeek-V3.2 / V4, GLM-5 DSA): refused at the call
_SPARSE_ATTENTION = ("indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention")


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
    here over the axis in the zigzag order (global positions, a padding mask whole on every rank).

    `model.generate`: its prompt forward (an empty KV cache) is split like any forward, and fills the cache
    whole and in the plain order (`fill_whole`); its decoding steps (a cache that holds keys) are not
    split: every rank runs them as one device does, on the same whole tokens."""

    name = "cp"
    may_refuse = True  # sequence lengths change from step to step
    # generate's loop runs on whole plain tokens, the same on every rank: only its forwards are split
    for_generate = False

    def __init__(self, settings: ContextSettings, split_here: bool = True):
        self.settings = settings
        # False for a multimodal model: only the labels are split here, the rest at its language model's entry
        self.split_here = split_here

    def refuse(self, inputs: dict) -> str | None:
        """Why these inputs cannot be split over the axis (decided from shapes, before anything runs)."""
        cache = cache_of(inputs)
        if cache is not None:
            problem = cache_problem(cache, self.settings.contiguous)
            if problem or holds_tokens(cache):
                return problem  # a decoding step (the cache holds keys already) is not split
        if runs_whole(self.settings, inputs):
            return None
        ref = inputs.get("input_ids") if inputs.get("input_ids") is not None else inputs.get("inputs_embeds")
        if ref is None:
            return None
        if ref.ndim < 2:
            return f"context_parallel: input_ids/inputs_embeds need a batch and a sequence dim, got shape {tuple(ref.shape)}"
        batch, seq_len = ref.shape[0], ref.shape[SEQ_DIM]
        multiple = _multiple(self.settings)
        if seq_len % multiple:
            pad = (f"left-pad the prompts, tokenizer(..., padding=True, padding_side='left', pad_to_multiple_of="
                   f"{multiple}), with attention_mask 0 on the padding" if cache is not None else
                   f"pad the batch, e.g. tokenizer(..., padding=True, pad_to_multiple_of={multiple}), with "
                   "attention_mask 0 and labels -100 on the padding")
            two = not self.settings.contiguous
            return (f"context_parallel: the sequence length {seq_len} must be a multiple of {'2 x ' if two else ''}"
                    f"{self.settings.axis!r} size = {multiple} (each rank holds {'two chunks' if two else 'one chunk'}); "
                    f"{pad}")
        positions = inputs.get("position_ids")
        # a multimodal model's 3-D rotary positions (rows, batch, seq)
        rows = not self.split_here and isinstance(positions, Tensor) and positions.ndim == 3
        names = ("attention_mask", "labels") + (() if rows else ("position_ids",))
        problem = feed.token_inputs_problem("context_parallel", inputs, batch, seq_len, names)
        if problem or rows:
            return problem or _rotary_rows_problem(positions, batch, seq_len)
        if positions is not None and inputs.get("attention_mask") is None and not isinstance(positions, DTensor):
            # one sequence per row, counted from any start (PaliGemma's positions are 1-indexed)
            plain = torch.arange(seq_len, device=positions.device).expand(positions.shape)
            if not torch.equal(positions - positions[..., :1], plain):
                return ("context_parallel: packed sequences (position_ids that restart) are not supported; pass "
                        "one sequence per row with an attention_mask")
        return None

    def restore_order(self, hidden):
        """The base model's output back in the plain sequence order (an ordinary Shard of the sequence), as
        the model's own forward hook does; a pipeline's last stage calls it before the head."""
        return plain_order(self.settings, hidden)

    def apply(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook body: the inputs' sequence dim split over the axis (zigzag order, global positions)."""
        settings = self.settings
        kwargs = feed.named_inputs(module, args, kwargs)
        if runs_whole(settings, kwargs):  # as on one device (a multimodal model's language model decides alike)
            settings.split_pending = False
            return (), kwargs
        if cache_of(kwargs) is None:
            kwargs["use_cache"] = False  # no cache made inside: it would take the split keys and values
        ref = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        if ref is None:
            return (), kwargs
        if self.split_here:
            split_sequence(settings, kwargs, ref)
        for name in PLAIN_INPUTS:
            if kwargs.get(name) is not None:
                kwargs[name] = split(settings, kwargs[name], zigzag=False)
        return (), kwargs


def cache_of(inputs: dict):
    """The KV cache among a forward's inputs, or None."""
    return next((inputs[n] for n in CACHE_INPUTS if inputs.get(n) is not None), None)


def decoding(inputs: dict) -> bool:
    """Is this forward a decoding step: a KV cache that holds keys already (whole, from the prompt forward)?"""
    cache = cache_of(inputs)
    return cache is not None and holds_tokens(cache)


def runs_whole(settings: ContextSettings, inputs: dict) -> bool:
    """Is this forward run whole on every rank, as one device runs it: a decoding step (`decoding`), or a forward
    without gradients and without a KV cache whose sequence does not divide over the axis (generate's steps of
    a model that keeps no cache, MPT and Evolla by their configs: the whole sequence, one token longer, at
    every step). Decided from shapes and the grad mode, the same on every rank; a training forward
    of such a length is refused instead (pad it)."""
    if decoding(inputs):
        return True
    if torch.is_grad_enabled() or any(inputs.get(n) is not None for n in CACHE_INPUTS + _STATE_INPUTS):
        return False
    ref = inputs.get("input_ids") if inputs.get("input_ids") is not None else inputs.get("inputs_embeds")
    return isinstance(ref, Tensor) and ref.ndim >= 2 and ref.shape[SEQ_DIM] % _multiple(settings) != 0


def _multiple(settings: ContextSettings) -> int:
    """What the sequence length must be a multiple of: the axis size (split in order), twice it (zigzag)."""
    return settings.parts if settings.contiguous else 2 * settings.parts


def holds_tokens(cache) -> bool:
    """Has the KV cache seen tokens already? (A cache of scan layers only, Mamba's, has no sequence length to
    ask: its layers say whether they hold a state, a convolution's or a recurrence's.)"""
    from transformers.cache_utils import CacheLayerMixin
    layers = getattr(cache, "layers", ())
    if layers and not any(isinstance(layer, CacheLayerMixin) for layer in layers):
        return any(any(getattr(layer, flag, {}).values()) for layer in layers
                   for flag in ("is_conv_states_initialized", "is_recurrent_states_initialized"))
    return bool(cache.get_seq_length())


def whole_logits_when_generating(module: nn.Module, args, kwargs: dict, output):
    """Forward hook of the model: a forward of generate's (with a KV cache; or, for a model that keeps none,
    given `logits_to_keep` without gradients, as generate's loop calls it) returns its logits whole, as a plain
    tensor, so that generate's loop runs on plain tokens as on one device; the feed check then compares them
    across the ranks at every step (ranks that sampled different tokens raise FeedError on every rank, where
    a DTensor's values would go unchecked)."""
    logits = output.get("logits") if hasattr(output, "get") else None   # a pipeline stage's output: a tuple
    if isinstance(logits, DTensor) and (cache_of(output) is not None or (kwargs.get("logits_to_keep") is not None
                                                                         and not torch.is_grad_enabled())):
        output["logits"] = logits.full_tensor()
    return output


# scan layers' states (their layers run whole, scan_layers.py); DummyLayer: a layer that caches nothing (an MLP-only
# layer of Nemotron-H, a layer that reads another's keys)
_SCAN_CACHE_LAYERS = ("LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer",
                      "LinearAttentionAndSlidingWindowAttentionLayer", "DummyLayer")


def cache_problem(cache, contiguous: bool = False) -> str | None:
    """Why context parallelism cannot fill or decode over this KV cache, or None: it fills transformers'
    DynamicCache (generate's default) through its layers' own `update`, which a full or sliding-window layer
    makes as on one device (and a linear-attention layer's states, its layer run whole); a static or quantized
    cache, or layers of another kind, are refused. With the sequence split in order (`contiguous`), what a
    layer kind stores beyond the keys and values it `update`s (an indexer's keys) is a DTensor in the plain
    order, which the decoding steps read through the dispatcher: any DynamicCache's layers then do."""
    from transformers import cache_utils as cu
    DynamicCache = cu.DynamicCache
    if contiguous and isinstance(cache, DynamicCache) and type(cache).update is DynamicCache.update:
        return None
    kinds = (cu.DynamicLayer, cu.DynamicSlidingWindowLayer) + tuple(getattr(cu, n) for n in _SCAN_CACHE_LAYERS
                                                                     if hasattr(cu, n))
    layers = {type(layer).__name__ for layer in getattr(cache, "layers", ()) if type(layer) not in kinds}
    if isinstance(cache, DynamicCache) and type(cache).update is DynamicCache.update and not layers \
            and getattr(cache, "layer_class_to_replicate", None) in (None,) + kinds:
        return None
    what = type(cache).__name__ + (f" with {sorted(layers)} layers" if layers and isinstance(cache, DynamicCache) else "")
    return (f"context_parallel: a KV cache of type {what} is not supported: the prompt forward fills "
            "transformers' DynamicCache (generate's default, cache_implementation='dynamic') with full, "
            "sliding-window or linear-attention layers only; generate with that cache, or with the model before "
            "context_parallel")


def _rotary_rows_problem(positions: Tensor, batch: int, seq_len: int) -> str | None:
    """Why 3-D rotary position ids (rows, batch, seq), e.g. Qwen3-VL's mrope ones, do not fit the batch."""
    if tuple(positions.shape[1:]) not in ((batch, seq_len), (1, seq_len)):
        return (f"context_parallel: position_ids of shape {tuple(positions.shape)} do not match the inputs' "
                f"(batch, sequence) = {(batch, seq_len)}; give (rows, {batch}, {seq_len})")
    return None


def split_sequence(settings: ContextSettings, kwargs: dict, ref: Tensor) -> None:
    """Split the decoder's inputs in `kwargs` in place: token ids and embeddings on the sequence dim, position
    ids (2-D, or 3-D rotary rows) on their last dim, all in the zigzag order and keeping global positions; and
    always a padding mask, whole on every rank (without one, transformers would read the zigzag position ids
    as packed sequences)."""
    settings.split_pending, settings.attention_calls = True, 0
    settings.filling = fill_whole(settings, cache_of(kwargs))
    if settings.contiguous:   # the plain order: the model's own positions and masks stay right as they are
        for name in ("inputs_embeds", "input_ids"):
            if kwargs.get(name) is not None:
                kwargs[name] = split(settings, kwargs[name], zigzag=False)
        return
    seq_len = settings.seq_len = ref.shape[SEQ_DIM]
    plain_positions = torch.arange(seq_len, device=ref.device).unsqueeze(0)
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = plain_positions
    ones = torch.ones_like(plain_positions.expand(ref.shape[0], -1))
    mask = kwargs.get("attention_mask")
    if isinstance(mask, dict):  # built by a multimodal base model, one per layer type (Gemma3): 2D padding masks
        kwargs["attention_mask"] = {k: _padding_mask(settings, ones if m is None else m) for k, m in mask.items()}
    else:
        kwargs["attention_mask"] = _padding_mask(settings, ones if mask is None else mask)
    for name in ZIGZAG_INPUTS[2:] + ZIGZAG_INPUTS[:1]:
        value = kwargs.get(name)
        if value is not None:
            dim = value.ndim - 1 if name == "position_ids" else SEQ_DIM
            kwargs[name] = split(settings, value, zigzag=True, dim=dim)


def fill_whole(settings: ContextSettings, cache):
    """A prompt forward's (empty) KV cache, its `update` made to store whole keys for this forward; or None."""
    if cache is not None and "update" not in cache.__dict__:
        cache.update = functools.partial(_update_whole, settings, cache)
    return cache


def _update_whole(settings: ContextSettings, cache, keys, values, layer_idx: int, *args, **kwargs):
    """The KV cache's `update` in a split forward: each layer's keys and values (split on the sequence over the
    axis, in the zigzag order) are stored whole and in the plain order (one all-gather of both) by the cache's
    own `update`, so that the cache is one device's (a sliding-window layer keeps its last keys) and the
    decoding steps run whole; the layer gets back its own split keys and values, which is what an empty
    layer's update returns. Hooked here and not at the attention: a layer may reshape what it caches before it
    attends (JetMoE repeats the key/value heads, DiffLlama regroups the values). Outside the prompt forward the
    cache's own `update`."""
    update = type(cache).update
    if settings.filling is not cache or settings.whole_layer:   # a scan layer's keys come whole, plain order
        return update(cache, keys, values, layer_idx, *args, **kwargs)
    if settings.contiguous:   # in the plain order already: whole over the axis, however the dispatcher laid them out
        update(cache, _whole_over_axis(settings, keys), _whole_over_axis(settings, values), layer_idx, *args, **kwargs)
        return keys, values
    # split on the sequence over the axis, or whole over it (GPT-2's and OPT's projections flatten (batch, seq),
    # which the dispatcher gathers): a DTensor's global sequence is the held (zigzag) order either way
    if not all(isinstance(t, DTensor) and t.ndim == 4 and t.shape[2] == settings.seq_len for t in (keys, values)):
        raise ValueError(f"context_parallel: the keys/values layer {layer_idx} caches are not (batch, heads, "
                         f"{settings.seq_len}, head_dim) DTensors of the split sequence (got {_described(keys)} and "
                         f"{_described(values)}), so the KV cache cannot be filled as one device's; generate with "
                         "the model before context_parallel")
    kv = whole_in_plain_order(settings, torch.cat([keys, values], -1), 2)
    split = keys.shape[-1]
    update(cache, kv[..., :split], kv[..., split:], layer_idx, *args, **kwargs)
    return keys, values


def _described(t) -> str:
    """A tensor's kind and shape, for an error."""
    return f"{type(t).__name__} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _whole_over_axis(settings: ContextSettings, t):
    """`t` replicated over the axis (its other splits kept), or `t` itself when it is not split over it."""
    if not isinstance(t, DTensor):
        return t
    layout = t.dist_layout
    tensor_map = tuple(off_axis_map(settings, layout))
    return t if tensor_map == tuple(layout.tensor_map) else t.redistribute(layout.with_map(tensor_map, layout.partial))


def whole_in_plain_order(settings: ContextSettings, t: DTensor, dim: int) -> DTensor:
    """A DTensor whose `dim` is the held (zigzag) order of the sequence, whole (replicated over the axis) and in
    the plain order: one all-gather where it is split over the axis, then a local permutation; its other
    splits as they are."""
    whole = _whole_over_axis(settings, t)  # the zigzag order
    return whole.index_select(dim, settings.plain_order_index(t.shape[dim], t.to_local().device))


def _padding_mask(settings: ContextSettings, mask: Tensor):
    """The 2D padding mask, whole on every rank in the zigzag order (b x L, small), marked as held in that order
    (`HELD_ORDER`: masks built from it index the held order) and keeping the `IndexMask` a multimodal base model's
    mask builders gave the plain one (image blocks)."""
    index_mask = getattr(mask, INDEX_MASK, None)
    if isinstance(mask, DTensor):
        mask = split(settings, mask, zigzag=True).full_tensor()
    else:
        mask = torch.cat([zigzag_slice(mask, SEQ_DIM, r, settings.parts) for r in range(settings.parts)], SEQ_DIM)
    if mask.ndim != 2:
        raise ValueError(f"context_parallel: attention_mask must be a 2D padding mask, got {mask.ndim}D")
    held = DTensor.from_local(mask.to(torch.bool), replicate_layout(settings.mesh, 2))
    setattr(held, HELD_ORDER, True)
    if index_mask is not None:
        setattr(held, INDEX_MASK, index_mask)
    return held


def split(settings: ContextSettings, t: Tensor, zigzag: bool, dim: int = SEQ_DIM) -> DTensor:
    """Split dim `dim` (the sequence) over the axis: a whole tensor by slicing; a DTensor from its layout, and
    a tensor that takes a gradient (a multimodal model's embeddings, computed on every rank), by
    differentiable DTensor ops, so that its gradient comes back whole."""
    axis, rank, parts = settings.axis_index, settings.rank, settings.parts
    t = replicated_if_grad(settings, t)
    if not isinstance(t, DTensor):
        layout = replicate_layout(settings.mesh, t.ndim)
        local = zigzag_slice(t, dim, rank, parts) if zigzag else t.chunk(parts, dim)[rank]
        return DTensor.from_local(local, _split_layout(settings, layout, dim), shape=t.shape)
    layout = t.dist_layout.without_partial()
    seq_axes = layout.tensor_map[dim]
    if seq_axes == (axis,):  # already split over the axis in the plain order
        local = t.to_local()
        return t if not zigzag else DTensor.from_local(
            reorder(local, dim, settings.group, rank, parts, to_zigzag=True), layout, shape=t.shape)
    if seq_axes:
        raise ValueError(f"context_parallel: input of layout {layout.alias_entries()} splits the sequence "
                         f"over other axes than {settings.axis!r}")
    # whole over the axis first where another dim is split over it (generate's tokens, grown from logits the
    # dispatcher left split on the batch): a dim split over the axis cannot be split over it again
    layout = layout.with_map(tuple(off_axis_map(settings, layout)), layout.partial)
    whole = t if t.dist_layout is layout else t.redistribute(layout)
    if zigzag:  # the zigzag order, whose plain split gives rank i chunks i and 2n-1-i
        chunk = t.shape[dim] // (2 * parts)
        order = torch.cat([token_index(r, parts, chunk, t.device) for r in range(parts)])
        whole = whole.index_select(dim, order)
    return whole.redistribute(_split_layout(settings, layout, dim))


def replicated_if_grad(settings: ContextSettings, t: Tensor) -> Tensor:
    """A plain tensor that takes a gradient, as the replicated DTensor it is (the same value on every rank,
    e.g. a tower's output under tp), so that each rank's part of its gradient is summed back whole."""
    if isinstance(t, DTensor) or not (t.requires_grad and torch.is_grad_enabled()):
        return t
    return DTensor.from_local(t, replicate_layout(settings.mesh, t.ndim))


def _split_layout(settings: ContextSettings, layout, dim: int):
    tensor_map = list(layout.tensor_map)
    tensor_map[dim] = (settings.axis_index,)
    return layout.with_map(tensor_map, layout.partial)


def plain_order(settings: ContextSettings, t):
    """A sequence-split DTensor from the zigzag order back to the plain one (anything else as it is)."""
    if (settings.contiguous or not isinstance(t, DTensor) or t.ndim < 2
            or t.dist_layout.tensor_map[SEQ_DIM] != (settings.axis_index,)):
        return t
    local = reorder(t.to_local(), SEQ_DIM, settings.group, settings.rank, settings.parts, to_zigzag=False)
    return DTensor.from_local(local, t.dist_layout, shape=t.shape)


def plain_order_outputs(settings: ContextSettings, module: nn.Module, args, output):
    """Forward hook of the base model (of a multimodal model's language model): its hidden states back in the
    plain sequence order. A forward that split the sequence but ran none of its attention through context
    parallel's mixed the sequence another way (a recurrent scan, attention code of its own): refused, on
    every rank alike, rather than returned wrong."""
    if settings.split_pending:
        settings.split_pending = False
        if settings.filling is not None:  # the cache's own `update` again
            settings.filling.__dict__.pop("update", None)
            settings.filling = None
        if not settings.attention_calls and not settings.contiguous:
            raise ValueError(f"context_parallel: {type(module).__name__} split its sequence over "
                             f"{settings.axis!r} but none of its layers attended through transformers' attention "
                             f"interface (a recurrent scan, or attention code of its own), so the split would "
                             f"give wrong values; run this model without context parallelism")
    for key in ("last_hidden_state", "hidden_states"):
        value = output.get(key) if hasattr(output, "get") else None
        if isinstance(value, tuple):
            output[key] = tuple(plain_order(settings, v) for v in value)
        elif value is not None:
            output[key] = plain_order(settings, value)
    return output
