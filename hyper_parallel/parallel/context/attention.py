"""The attention function context parallelism registers with transformers (`AttentionInterface`).

Why a registered function and not a dispatcher rule for `scaled_dot_product_attention`: the sdpa
and eager paths of transformers build their masks from the *position in the tensor*, which under a
split (and load-balanced) sequence is not the token's global position, and eager never calls sdpa.
The model's config names this function instead; its masks are made here, block by block, from the
original token index of every query and key, and the mask builders of `masking_utils` hand the 2D
padding mask over untouched (the mask function registered under the same name returns it as is). The model's code is not modified: q, k, v arrive as DTensors
split on the sequence over the context axis (heads possibly split over "tp"), and the output leaves
as one, so everything around attention keeps going through the DTensor dispatch.

Attention sinks (`s_aux`: one logit per query head, GPT-OSS) and logit softcapping (`softcap`, Gemma 2) are
done exactly by every method (`ring.py`: the sink in the softmax's denominator after the blocks are merged,
the softcap in the unfused block kernel); ordinary attention keeps its fused path. The sink's gradient is
this rank's queries' share, summed over the axis (`_SumGradOverAxis`) before it reaches the parameter.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ...dtensor import DTensor
from ...redistribute import collectives as C
from .ring import BlockAttention, IndexMask, Ring, RingAttention, Visibility, block_forward
from .zigzag import token_index

METHODS = ("ring", "ulysses", "allgather")
# attention keywords some models pass that change the math the context-parallel kernels do (refused, never dropped);
# `s_aux` is taken where it is one sink logit per query head (`_check_sink`)
MATH_KWARGS = ("sinks", "position_bias", "attn_bias", "alibi", "attention_bias", "sparse_indices")


@dataclass
class ContextSettings:
    """What one `context_parallel` call chose: the mesh axis, its group and this rank's place, the method."""

    mesh: object
    axis: str
    method: str
    axis_index: int = field(init=False)
    parts: int = field(init=False)
    rank: int = field(init=False)
    group: object = field(init=False)
    # attention calls since the sequence was last split: a forward that split it and made none mixed its
    # sequence some other way (a recurrent scan, attention code of its own), which the split makes wrong
    attention_calls: int = field(init=False, default=0)
    split_pending: bool = field(init=False, default=False)
    # the KV cache a split (prompt) forward fills, or None: its `update` stores each layer's keys and values whole
    # and in the plain order, as one device holds them (a sequence-split cache could not serve a decoding step)
    filling: object = field(init=False, default=None)
    # inside a layer that runs whole (scan_layers.py): its attention, if any, is one device's over the whole sequence
    whole_layer: bool = field(init=False, default=False)
    # the sequence length of the last split forward (the KV cache fill checks what it stores against it)
    seq_len: int = field(init=False, default=0)
    # the sequence split in order (rank i holds the i-th n-th), not load-balanced, and the model's attention left to
    # its own code through the dispatcher: for models whose attention the registered function cannot take over
    contiguous: bool = False

    def __post_init__(self):
        self.axis_index = self.mesh.axis_index(self.axis)
        self.parts = self.mesh.size(self.axis)
        self.rank = self.mesh.get_local_rank(self.axis)
        self.group = self.mesh.get_group(self.axis) if self.parts > 1 else None

    def ring(self, seq_len: int, device) -> Ring:
        """The ring's token indices on `device`; on the CPU for meta queries (hp.plan's trace): the skip and
        mask decisions read their values, which a meta tensor does not have."""
        chunk = seq_len // (2 * self.parts)
        device = "cpu" if torch.device(device).type == "meta" else device
        return Ring(self.group, self.rank, self.parts,
                    tuple(token_index(r, self.parts, chunk, device) for r in range(self.parts)))

    def plain_order_index(self, seq_len: int, device) -> Tensor:
        """The index that takes a whole sequence in the zigzag order back to the plain one (`index_select`)."""
        return torch.argsort(torch.cat(self.ring(seq_len, "cpu").index)).to(device)


def register_attention(settings: ContextSettings) -> str:
    """Register this model's context-parallel attention with transformers; returns the name to configure."""
    name = f"hyper_parallel_cp_{settings.method}_{id(settings):x}"

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                  sliding_window=None, softcap=None, s_aux=None, **kwargs):
        changing = sorted(k for k in MATH_KWARGS if kwargs.get(k) is not None)
        if changing:
            raise ValueError(f"{_where(module)}: {', '.join(changing)} "
                             f"(attention sinks or a bias added to the scores) is not supported; run this "
                             f"model without context parallelism")
        _check_sink(s_aux, query, _where(module))
        settings.attention_calls += 1
        if settings.whole_layer or not settings.split_pending and not split_over_axis(settings, query):
            # nothing split this forward (a decoding step over a whole cache): attention as on one device
            return whole_attention(settings, module, query, key, value, attention_mask, scaling, is_causal,
                                   sliding_window, softcap, s_aux)
        return context_attention(settings, module, query, key, value, attention_mask, dropout, scaling,
                                 is_causal, sliding_window, softcap, s_aux)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, _mask_for_context)
    return name


# the mask functions of transformers' builders that `Visibility`'s causal / window rules are (the layer says which:
# is_causal, sliding_window); anything else is carried as an `IndexMask`
_STANDARD_MASKS = frozenset(("causal_mask_function", "bidirectional_mask_function",
                             "sliding_window_overlay.<locals>.inner_mask",
                             "sliding_window_bidirectional_overlay.<locals>.inner_mask"))
HELD_ORDER = "_hp_held_order"   # marks the whole padding masks of a split forward (held, zigzag order)
INDEX_MASK = "_hp_index_mask"    # a padding mask's `IndexMask`, where the builders made one


def standard_mask(function) -> bool:
    """Is `function` causal, bidirectional or sliding-window, alone or intersected (`and_masks`)?"""
    if getattr(function, "__qualname__", None) == "and_masks.<locals>.and_mask":
        parts = next((c.cell_contents for c in function.__closure__ or ()
                      if isinstance(c.cell_contents, tuple)), None)
        return parts is not None and all(standard_mask(f) for f in parts)
    return getattr(function, "__qualname__", None) in _STANDARD_MASKS


def _mask_for_context(attention_mask=None, mask_function=None, batch_size: int = 1, kv_length: int = 0,
                      q_offset: int = 0, kv_offset: int = 0, device=None, **_):
    """The mask builders' output for this attention: the 2D padding mask itself (or None), which the attention
    turns into per-block masks from original token indices. Where the builders made more than a causal or
    sliding-window mask (Gemma 3's image blocks, PaliGemma's prefix: `block_sequence_ids`), a view of the padding
    mask (a new object per mask: a forward's full and sliding masks differ) carries the mask function as an
    `IndexMask`. Its tensors index the plain order, so it must be built from the whole inputs (a multimodal base
    model's, before its language model splits them); built from a split forward's inputs it is refused."""
    if mask_function is None or standard_mask(mask_function):
        return attention_mask
    if getattr(attention_mask, HELD_ORDER, False):
        raise ValueError(f"context_parallel: the model builds an attention mask other than causal / sliding-window "
                         f"({getattr(mask_function, '__qualname__', mask_function)}: chunked attention, packed "
                         f"sequences, or token blocks) from inputs already split over the sequence, whose indices "
                         f"would be the held order's; run this model without context parallelism")
    if attention_mask is None:
        attention_mask = torch.ones((batch_size, kv_length + kv_offset), dtype=torch.bool, device=device)
    mask = attention_mask.view(tuple(attention_mask.shape))
    setattr(mask, INDEX_MASK, IndexMask(mask_function, batch_size, q_offset, kv_offset))
    return mask


def context_attention(settings, module, query, key, value, attention_mask, dropout, scaling, is_causal,
                      sliding_window, softcap, s_aux=None):
    """(b, L, heads, dv) DTensor output of exact attention over the whole (split) sequence, and None."""
    where = _where(module)
    if dropout and module.training:
        raise ValueError(f"{where}: attention dropout ({dropout}) is not supported; set the config's "
                         "attention_dropout to 0")
    query, key, value = _common_layout(settings, query, key, value, where)
    if isinstance(attention_mask, Tensor) and attention_mask.ndim != 2:
        raise ValueError(f"{where}: only 2D padding masks are supported, got a {attention_mask.ndim}D mask")
    seq_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    vis = Visibility(bool(causal), sliding_window, _padding_keys(attention_mask), getattr(attention_mask, INDEX_MASK, None))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = query.to_local(), key.to_local(), value.to_local()
    ring = settings.ring(seq_len, q.device)
    sink = _local_sink(s_aux, query)
    if sink is not None:  # each rank's gradient is its queries' share (its heads' under ulysses)
        sink = _SumGradOverAxis.apply(sink, settings)
    if settings.method == "ring":
        out = RingAttention.apply(q, k, v, sink, ring, vis, scale, softcap)
    elif settings.method == "ulysses":
        out = _ulysses(settings, ring, vis, q, k, v, scale, where, sink, softcap)
    else:
        out = _allgather(settings, ring, vis, q, k, v, scale, sink, softcap)
    return _output(out, query, value), None


def _where(module) -> str:
    return f"context_parallel attention in {type(module).__name__}"


def _output(out: Tensor, query, value):
    """This rank's attention output (b, heads, L, dv) as the (b, L, heads, dv) DTensor laid out as q is."""
    if not isinstance(query, DTensor):
        return out.transpose(1, 2).contiguous()
    shape = tuple(query.shape[:3]) + (value.shape[-1],)
    out = DTensor.from_local(out, query.dist_layout, shape=shape)
    return out.transpose(1, 2).contiguous()


def _check_sink(s_aux, query, where: str) -> None:
    """`s_aux` is taken as transformers' attention sinks: one logit per query head (GPT-OSS's `sinks`
    parameter), which is all transformers 5 passes; anything else (a bias added to the scores, per query or
    key) is refused, on every rank alike (shapes only)."""
    if s_aux is None:
        return
    if not isinstance(s_aux, Tensor) or tuple(s_aux.shape) != (query.shape[1],):
        shape = tuple(s_aux.shape) if isinstance(s_aux, Tensor) else type(s_aux).__name__
        raise ValueError(f"{where}: s_aux of shape {shape} is not one sink logit per query head "
                         f"({query.shape[1]},) (a bias added to the scores) and is not supported; run this "
                         f"model without context parallelism")


def _local_sink(s_aux, query) -> Tensor | None:
    """The sink logits of this rank's query heads (query's local heads), a local tensor whose gradient reaches
    the `s_aux` parameter (through its DTensor's redistribution: heads split as the query's are)."""
    if s_aux is None or not isinstance(query, DTensor):
        return s_aux.full_tensor() if isinstance(s_aux, DTensor) else s_aux
    layout = query.dist_layout
    target = layout.with_map((layout.tensor_map[1],), (None,) * layout.mesh.ndim)
    if not isinstance(s_aux, DTensor):
        s_aux = DTensor.from_local(s_aux, layout.replicated(1))
    return (s_aux if s_aux.dist_layout is target else s_aux.redistribute(target)).to_local()


def _padding_keys(attention_mask, keys: int | None = None) -> Tensor | None:
    """(b, keys) bool: which keys the 2D padding mask lets be seen (its last `keys` columns where given: the keys
    a sliding-window cache layer kept), or None where it hides none. A mask on the meta device (hp.plan's trace)
    has no values to read: planned as no padding, as the plan feeds unpadded rows."""
    if attention_mask is None:
        return None
    full = attention_mask.full_tensor() if isinstance(attention_mask, DTensor) else attention_mask
    full = full if keys is None else full[:, -keys:]
    return None if full.is_meta or bool(full.all()) else full.to(torch.bool)


def off_axis_map(settings, layout) -> list:
    """`layout`'s tensor map with the axis taken off every dim (what a DTensor whole over the axis keeps)."""
    return [tuple(a for a in axes if a != settings.axis_index) for axes in layout.tensor_map]


def split_over_axis(settings, t) -> bool:
    """Is `t` (b, heads, L, d) a DTensor split on its sequence dim over the axis?"""
    return isinstance(t, DTensor) and t.dist_layout.tensor_map[2] == (settings.axis_index,)


def whole_attention(settings, module, query, key, value, attention_mask, scaling, is_causal, sliding_window,
                    softcap, s_aux=None):
    """Attention of a query whose sequence is not split over the axis (a decoding step of `generate`: one new
    token over a cache that holds every key whole, the same on every rank) computed as one device does, on
    each rank's heads, without communication. The keys are the cache's (the last ones where a sliding-window
    layer keeps only those), so the queries are the last of them: causal and window masks by that position,
    the padding mask's last columns for the keys."""
    where = _where(module)
    if isinstance(query, DTensor):
        query, key, value = _common_layout(settings, query, key, value, where, split=False)
    q, k, v = (t.to_local() if isinstance(t, DTensor) else t for t in (query, key, value))
    lq, lk = q.shape[2], k.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    index_mask = getattr(attention_mask, INDEX_MASK, None)
    vis = Visibility(bool(causal), sliding_window, _padding_keys(attention_mask, lk), index_mask)
    device = "cpu" if q.is_meta else q.device   # indices on the CPU for meta queries, as `ring` makes them
    # the queries are the last keys' positions; an index mask's builder adds its own offsets to 0-based indices
    q_index = torch.arange(lq, device=device) if index_mask is not None else torch.arange(lk - lq, lk, device=device)
    k_index = torch.arange(lk, device=device)
    mask = vis.mask(q_index, k_index, slice(None))
    if mask is not None and bool(mask.all()):   # every key visible (one query, no padding): sdpa unmasked
        vis = Visibility(False)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = _local_attention(q, k, v, vis, q_index, k_index, scale, _local_sink(s_aux, query), softcap)
    return _output(out, query, value), None


def _common_layout(settings, query, key, value, where, split: bool = True):
    """q, k, v in one layout: the sequence (dim 2) split over the axis (as q's is where not `split`), heads split
    as q's are where the key/value heads divide (else whole), batch as it comes, head_dim whole, no pending
    reduction."""
    if split:
        query, key, value = (_split_again(settings, t, name, where)
                             for name, t in (("query", query), ("key", key), ("value", value)))
    layout = query.dist_layout
    tensor_map = list(layout.tensor_map)
    tensor_map[3] = ()
    if key.shape[1] % layout.shard_count(1):
        tensor_map[1] = ()
    target = layout.with_map(tensor_map, (None,) * layout.mesh.ndim)
    return tuple(t if t.dist_layout is target else t.redistribute(target) for t in (query, key, value))


def _split_again(settings, t, name: str, where: str):
    """`t` (b, heads, L, d) split on its sequence over the axis. A DTensor of the split forward whose sequence the
    dispatcher gathered (GPT-2's and OPT's projections flatten (batch, seq) to one dim, which no split of one
    dim holds) is whole over the axis in the held order: split again by its layout, a local slice (rank i's
    piece of the held order is its zigzag chunks). A plain tensor, or one of another sequence length, is not
    of the split sequence: refused."""
    if split_over_axis(settings, t):
        return t
    if isinstance(t, DTensor) and t.ndim == 4 and t.shape[2] == settings.seq_len:
        tensor_map = off_axis_map(settings, t.dist_layout)
        tensor_map[2] = (settings.axis_index,)
        return t.redistribute(t.dist_layout.with_map(tuple(tensor_map), t.dist_layout.partial))
    layout = t.dist_layout.alias_entries() if isinstance(t, DTensor) else "a plain tensor"
    raise ValueError(f"{where}: {name} must be split on its sequence dim (2) over {settings.axis!r}, "
                     f"got {layout}; call the model through context_parallel's pre-hook (whole inputs, "
                     "or DTensors split on the sequence over the axis)")


def _all_index(ring: Ring) -> Tensor:
    return torch.cat(ring.index)


def _local_attention(q, k, v, vis: Visibility, q_index, k_index, scale, sink=None, softcap=None):
    """Plain differentiable attention of q over k/v with the global-position mask (torch's sdpa when it can;
    the block kernel where sinks or a softcap change the scores)."""
    mask = vis.mask(q_index, k_index, slice(None))
    if sink is not None or softcap is not None:
        return BlockAttention.apply(q, k, v, sink, None if mask is None else mask.to(q.device), scale, softcap)
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    if bool(mask.any(-1).all()):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None].to(q.device), scale=scale,
                                              enable_gqa=gqa)
    return block_forward(q, k, v, mask, scale)[0]  # rows that see no key at all come out 0


def _allgather(settings, ring, vis, q, k, v, scale, sink=None, softcap=None):
    k_full, v_full = _GatherSequence.apply(k, settings), _GatherSequence.apply(v, settings)
    return _local_attention(q, k_full, v_full, vis, ring.index[ring.rank], _all_index(ring), scale, sink, softcap)


def _ulysses(settings, ring, vis, q, k, v, scale, where, sink=None, softcap=None):
    parts = settings.parts
    for name, t in (("query", q), ("key/value", k)):
        if t.shape[1] % parts:
            raise ValueError(f"{where}: ulysses needs the {name} heads on each rank ({t.shape[1]}) to divide "
                             f"by the {settings.axis!r} size {parts}; use method='ring' or 'allgather'")
    q, k, v = (_AllToAll.apply(t, settings, 2, 1) for t in (q, k, v))  # sequence split -> head split
    index = _all_index(ring)
    if sink is not None or softcap is not None:  # the block kernel, on this rank's heads
        heads = q.shape[1]
        sink = None if sink is None else sink[settings.rank * heads:(settings.rank + 1) * heads]
        out = _local_attention(q, k, v, vis, index, index, scale, sink, softcap)
    elif vis.key_ok is None and vis.index_mask is None:  # back to the plain order: a causal mask is sdpa's is_causal
        order = torch.argsort(index)
        q, k, v = (t.index_select(2, order.to(q.device)) for t in (q, k, v))   # indices stay on the CPU for meta
        vis_plain = Visibility(vis.causal, vis.window)
        out = _local_attention(q, k, v, vis_plain, index[order], index[order], scale) if vis.window is not None \
            else F.scaled_dot_product_attention(q, k, v, is_causal=vis.causal, scale=scale,
                                                enable_gqa=q.shape[1] != k.shape[1])
        out = out.index_select(2, torch.argsort(order).to(out.device))
    else:
        out = _local_attention(q, k, v, vis, index, index, scale)
    return _AllToAll.apply(out, settings, 1, 2)


class _SumGradOverAxis(torch.autograd.Function):
    """Identity whose gradient is summed over the axis: a replicated value (the sink logits) that each rank
    used on its own queries, so that its gradient is the whole sequence's on every rank."""

    @staticmethod
    def forward(ctx, t, settings):
        ctx.settings = settings
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        s = ctx.settings
        return C.all_reduce(grad, "sum", s.group, s.parts), None


class _GatherSequence(torch.autograd.Function):
    """All-gather of the sequence dim (2); the gradient is reduce-scattered back (each rank's queries
    contribute to every key)."""

    @staticmethod
    def forward(ctx, t, settings):
        ctx.settings = settings
        return C.all_gather(t, 2, settings.group, [t.shape[2]] * settings.parts)

    @staticmethod
    def backward(ctx, grad):
        s = ctx.settings
        piece = grad.shape[2] // s.parts
        return C.reduce_scatter(grad, 2, "sum", s.group, [piece] * s.parts, s.rank).contiguous(), None


class _AllToAll(torch.autograd.Function):
    """all_to_all gathering `gather_dim` and scattering `scatter_dim`: (b, h, L/n, d) -> (b, h/n, L, d) with
    (2, 1), back with (1, 2); the gradient takes the inverse exchange."""

    @staticmethod
    def forward(ctx, t, settings, gather_dim, scatter_dim):
        ctx.args = (settings, scatter_dim, gather_dim)
        return C.all_to_all(t, gather_dim, scatter_dim, settings.group, settings.parts)

    @staticmethod
    def backward(ctx, grad):
        settings, gather_dim, scatter_dim = ctx.args
        return C.all_to_all(grad, gather_dim, scatter_dim, settings.group, settings.parts), None, None, None
