"""Neural-network ops: embedding, scaled_dot_product_attention, layer_norm / rms_norm, batch / group norm,
cross_entropy / nll_loss.

They reuse the labelled-dims description of ops/matmul.py (`ContractionSpec`): each rule names the
dims that may be split (batch, heads, hidden) and the ones that must stay whole (a softmax or
normalized dim), and adds what the generic description cannot say:

- embedding with the vocabulary split: each rank looks up only the ids in its slice and zeroes the
  other rows, so the output is Partial(sum) (no communication in the local function);
- attention with fewer key/value heads (GQA): the head split must divide the key/value heads;
- losses: a batch-split mean divides the local sum by the *global* count of non-ignored targets (one
  all_reduce of a count, which carries no gradient), and a class-split ("loss parallel") cross
  entropy reduces max, sum-of-exp and the target logit over the class axes, with its own backward.
"""
from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from ..dispatch.call import OpCall, Strategy
from ..redistribute import collectives as C
from .base import Partial, Signature, SignatureRule, Shard, REPLICATE
from .matmul import ContractionSpec, batch_labels, contraction_signatures

_P = Partial("sum")


def local_index(index: Tensor, offset: int, length: int) -> tuple[Tensor, Tensor]:
    """Global indices -> indices into this rank's slice [offset, offset + length), and which are inside it.

    Outside ids map to 0 (any valid row) so the local lookup runs; callers zero their results.
    """
    local = index - offset
    inside = (local >= 0) & (local < length)
    return torch.where(inside, local, torch.zeros_like(local)), inside


def all_reduce_axes(t: Tensor, op: str, mesh, axes) -> Tensor:
    """Reduce `t` over several mesh axes in turn (each one group)."""
    for a in axes:
        t = C.all_reduce(t, op, mesh.get_group(a), mesh.shape[a])
    return t


def split_axes(layout, dims) -> list[int]:
    """Mesh axes that split any of `dims` under `layout`."""
    return sorted({a for d in dims for a in layout.tensor_map[d]})


# ---- embedding -----------------------------------------------------------------------------------
def _embedding_args(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                    sparse=False):
    return input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse


class Embedding(SignatureRule):
    """F.embedding(ids, weight): ids split -> out split the same way; hidden split (weight dim 1) ->
    out dim -1; vocab split (weight dim 0) -> Partial(sum) through a local lookup that zeroes the ids
    outside this rank's rows; weight Partial -> Partial (a lookup is linear in the table)."""

    def _spec(self, call):
        ids, weight = call.inputs[0], call.inputs[1]
        _, _, _, max_norm, _, by_freq, _ = _embedding_args(*call.args, **call.kwargs)
        if max_norm is not None:
            self.fail(call, "max_norm renormalises weight rows in place, which sharded or per-rank lookups "
                            "cannot reproduce; replicate the weight and ids")
        if weight.ndim != 2:
            return None
        b = batch_labels(ids.ndim)
        # scale_grad_by_freq counts ids: a split of the ids would count only local ones, and the
        # rows zeroed by a vocab split would be counted as row 0
        frozen = frozenset(b + ("v",)) if by_freq else frozenset()
        return ContractionSpec([(0, b), (1, ("v", "h"))], b + ("h",), frozen=frozen, linear=[1])

    def signatures(self, call):
        spec = self._spec(call)
        return [] if spec is None else contraction_signatures(call, spec)

    def strategy(self, call: OpCall) -> Strategy:
        strat = super().strategy(call)
        wl = strat.in_layouts[1]
        if wl.tensor_map[0]:
            vocab = call.inputs[1].shape[0]
            strat.local_fn = _masked_embedding(wl.local_offset(call.inputs[1].shape)[0],
                                               wl.local_shape(call.inputs[1].shape)[0], vocab)
        return strat


def _masked_embedding(offset: int, length: int, vocab: int):
    """The lookup of a vocabulary slice: rows outside [offset, offset + length) come out zero."""

    def embedding(*args, **kwargs):
        ids, weight, padding_idx, _, norm_type, by_freq, sparse = _embedding_args(*args, **kwargs)
        local, inside = local_index(ids, offset, length)
        if length == 0:  # this rank holds no rows: a zero term that still reaches the weight's graph
            return weight.new_zeros(tuple(ids.shape) + (weight.shape[1],)) + weight.sum() * 0
        pad = None
        if padding_idx is not None:
            p = padding_idx + vocab if padding_idx < 0 else padding_idx
            pad = p - offset if offset <= p < offset + length else None
        out = F.embedding(local, weight, pad, None, norm_type, by_freq, sparse)
        return out.masked_fill(~inside.unsqueeze(-1), 0)

    return embedding


# ---- attention -----------------------------------------------------------------------------------
def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, is_causal, enable_gqa


class Attention(SignatureRule):
    """F.scaled_dot_product_attention: batch and head dims split with q, k, v (and the mask where it is
    not broadcast); q's sequence dim split with whole k, v (not with is_causal, whose mask is anchored
    at the global row); v's feature dim split; v Partial -> Partial (the output is linear in v). The
    softmax dim (keys) and the q/k feature dim stay whole. With GQA the head split must divide the
    key/value heads on every axis that splits them."""

    _strict = threading.local()

    def signatures(self, call):
        q, k, v = call.inputs[0], call.inputs[1], call.inputs[2]
        _, _, _, mask, is_causal, gqa = _sdpa_args(*call.args, **call.kwargs)
        n = max(q.ndim, k.ndim, v.ndim) - 2
        b = batch_labels(n)
        ops = [(0, b[n - (q.ndim - 2):] + ("L", "E")), (1, b[n - (k.ndim - 2):] + ("S", "E")),
               (2, b[n - (v.ndim - 2):] + ("S", "Ev"))]
        if isinstance(mask, Tensor):
            full = b + ("L", "S")
            ops.append((3, full[len(full) - call.inputs[3].ndim:]))
        frozen = {"S", "E"} | ({"L"} if is_causal else set())
        sigs = contraction_signatures(call, ContractionSpec(ops, b + ("L", "Ev"), frozen=frozenset(frozen),
                                                            linear=[2], contract_partial=False))
        if gqa and q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] != k.shape[-3] and k.shape[-3] == v.shape[-3]:
            sigs += self._gqa_heads(call, ops, q.shape[-3], k.shape[-3])
        return sigs

    def _gqa_heads(self, call, ops, hq, hkv):
        """Split q heads and kv heads together: each rank keeps whole groups of q heads per kv head."""
        parts = call.mesh.size() if getattr(self._strict, "on", False) else max(call.mesh.shape)
        if hkv % parts or hq % hkv:
            return []
        ins = [REPLICATE] * len(call.inputs)
        for idx, labels in ops:
            d = len(labels) - 3
            spec = call.inputs[idx]
            if d >= 0 and (idx < 3 or spec.shape[d] == hq):
                ins[idx] = Shard(d)
        return [Signature([Shard(-3)], ins)]

    def strategy(self, call: OpCall) -> Strategy:
        strat = super().strategy(call)
        q, k = call.inputs[0], call.inputs[1]
        gqa = k.ndim >= 3 and q.ndim >= 3 and q.shape[-3] != k.shape[-3]
        if gqa and k.shape[-3] % strat.in_layouts[1].shard_count(k.ndim - 3):
            self._strict.on = True  # nested head splits: ask for a split that divides kv heads on the whole mesh
            try:
                strat = super().strategy(call)
            finally:
                self._strict.on = False
        return strat


# ---- normalization -------------------------------------------------------------------------------
class Norm(SignatureRule):
    """F.layer_norm / F.rms_norm: the normalized (trailing) dims stay whole, with weight and bias
    replicated; every leading dim may be split."""

    def signatures(self, call):
        x = call.inputs[0]
        shape = call.arg(1, "normalized_shape")
        k = 1 if isinstance(shape, int) else len(shape)
        lead = batch_labels(x.ndim - k)
        norm = tuple(f"n{i}" for i in range(k))
        ops = [(0, lead + norm)] + [(i, norm[len(norm) - s.ndim:]) for i, s in enumerate(call.inputs) if i > 0]
        return contraction_signatures(call, ContractionSpec(ops, lead + norm, frozen=frozenset(norm), linear=[],
                                                            contract_partial=False))


class ChannelNorm(SignatureRule):
    """F.batch_norm / F.group_norm (input (N, C, ...), per-channel weights): statistics over dims that the
    rule keeps whole. group_norm normalises each sample on its own: the batch dim may be split. batch_norm in eval mode uses its running statistics, pointwise per channel: any dim but
    the channels may be split; in training its statistics span the batch and every spatial dim (and update
    the running buffers), so its input is gathered (all-Replicate) for the exact single-device result."""

    def signatures(self, call: OpCall) -> list[Signature]:
        x = call.inputs[0]
        n = len(call.inputs)
        if call.name.endswith("batch_norm"):
            if call.arg(5, "training", False):
                return []
            dims = [d for d in range(x.ndim) if d != 1]
        else:
            dims = [0]
        return [Signature([Shard(d)], [Shard(d)] + [REPLICATE] * (n - 1)) for d in dims if x.shape[d] > 1]


class Prelu(SignatureRule):
    """F.prelu(input, weight): pointwise, with one slope per channel (dim 1) or one for all: any dim but a
    per-channel weight's may be split, the weight replicated."""

    def signatures(self, call: OpCall) -> list[Signature]:
        x = call.inputs[0]
        per_channel = len(call.inputs) > 1 and math.prod(call.inputs[1].shape) > 1
        return [Signature([Shard(d)], [Shard(d)] + [REPLICATE] * (len(call.inputs) - 1))
                for d in range(x.ndim) if x.shape[d] > 1 and not (per_channel and d == 1)]


# ---- losses --------------------------------------------------------------------------------------
class PointwiseLoss(SignatureRule):
    """F.mse_loss / l1_loss / smooth_l1_loss / huber_loss / binary_cross_entropy(_with_logits) / kl_div: a
    loss per element, then the reduction. 'none' is elementwise (input and target split alike); 'sum' leaves
    each rank's sum pending (Partial); 'mean' divides by the global count, so a split input is gathered
    (all-Replicate) for the exact mean. Inputs of other shapes (a broadcast weight) are gathered too."""

    def signatures(self, call: OpCall) -> list[Signature]:
        x = call.inputs[0]
        if any(tuple(s.shape) != tuple(x.shape) for s in call.inputs[1:]):
            return []
        if self.reduction_index >= 4 and (call.arg(self.reduction_index - 2, "size_average", None) is not None or
                                          call.arg(self.reduction_index - 1, "reduce", None) is not None):
            return []  # the legacy reduction flags: gathered rather than read again here
        reduction = call.arg(self.reduction_index, "reduction", "mean")
        n = len(call.inputs)
        if reduction == "none":
            return [Signature([Shard(d)], [Shard(d)] * n) for d in range(x.ndim) if x.shape[d] > 1]
        if reduction == "sum":
            return [Signature([_P], [Shard(d)] * n) for d in range(x.ndim) if x.shape[d] > 1]
        return []

    reduction_index = 4  # (input, target, size_average, reduce, reduction) for most; YAML overrides



class _LossArgs:
    """The arguments of F.cross_entropy / F.nll_loss that matter here, from a call or local args."""

    __slots__ = ("input", "target", "weight", "ignore_index", "reduction", "label_smoothing")

    def __init__(self, name: str, args, kwargs):
        names = ["input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction"]
        if name.endswith("cross_entropy"):
            names.append("label_smoothing")
        values = dict(zip(names, args))
        values.update(kwargs)
        self.input = values["input"]
        self.target = values["target"]
        self.weight = values.get("weight")
        self.ignore_index = values.get("ignore_index", -100)
        self.label_smoothing = values.get("label_smoothing", 0.0)
        if values.get("size_average") is not None or values.get("reduce") is not None:
            from torch.nn import _reduction
            self.reduction = _reduction.legacy_get_string(values.get("size_average"), values.get("reduce"))
        else:
            self.reduction = values.get("reduction", "mean")


class Loss(SignatureRule):
    """F.cross_entropy / F.nll_loss. Batch dims split with the target: 'none' -> split output, 'sum' ->
    Partial, 'mean' -> Partial of local sum / global weight of non-ignored targets. Class dim split
    (class-index targets): nll_loss -> Partial (a masked gather); cross_entropy -> replicated per-sample
    losses from a vocab-parallel log-softmax ("loss parallel"). nll_loss is linear in its input:
    Partial -> Partial."""

    def _labels(self, call):
        x, t = call.inputs[0], call.inputs[1]
        c = 1 if x.ndim >= 2 else 0
        b = batch_labels(x.ndim)
        xl = b[:c] + ("C",) + b[c + 1:]
        index_target = not t.dtype.is_floating_point
        tl = (b[:c] + b[c + 1:]) if index_target else xl
        return c, xl, tl, index_target

    def signatures(self, call):
        a = _LossArgs(call.name, call.args, call.kwargs)
        if len(call.inputs) > 3 or not isinstance(a.input, Tensor) or not isinstance(a.target, Tensor):
            return []
        c, xl, tl, index_target = self._labels(call)
        out = tl if a.reduction == "none" else ()
        ops = [(0, xl), (1, tl)] + [(i, ("C",)) for i in range(2, len(call.inputs))]
        nll = call.name.endswith("nll_loss")
        sigs = contraction_signatures(call, ContractionSpec(ops, out, frozen=frozenset({"C"}),
                                                            linear=[0] if nll else []))
        n_classes = call.inputs[0].shape[c]
        if index_target and n_classes >= call.mesh.size():  # class split: every rank keeps some classes
            ins = [Shard(c)] + [REPLICATE] * (len(call.inputs) - 1)
            sigs.append(Signature([_P if nll else REPLICATE], ins))
        return sigs

    def strategy(self, call: OpCall) -> Strategy:
        strat = super().strategy(call)
        a = _LossArgs(call.name, call.args, call.kwargs)
        c, _, tl, index_target = self._labels(call)
        xin = strat.in_layouts[0]
        class_axes = list(xin.tensor_map[c])
        batch_axes = split_axes(strat.in_layouts[1], range(len(tl)))
        if not class_axes and not (a.reduction == "mean" and batch_axes):
            return strat  # the op itself is right on the local pieces
        shape = call.inputs[0].shape
        offset, length = xin.local_offset(shape)[c], xin.local_shape(shape)[c]
        count = None if index_target else (torch.Size(shape).numel() // max(shape[c], 1))
        strat.local_fn = _local_loss(call.name, c, class_axes, batch_axes, offset, length, shape[c], count,
                                     call.mesh)
        split = set(class_axes) | set(batch_axes)
        grads = [xin.without_partial(), strat.in_layouts[1]]
        for lay in strat.in_layouts[2:]:  # class weights: replicated, so their local gradients are terms
            grads.append(lay.with_map(lay.tensor_map, ["sum" if ax in split else None
                                                       for ax in range(call.mesh.ndim)]))
        strat.grad_layouts = grads
        return strat


class _MeanOver(torch.autograd.Function):
    """total / count of the non-ignored targets, as torch's mean-reduced nll_loss: nan when every target is
    ignored (0/0) with a zero gradient there (the chain rule would give 0 * inf = nan on every logit)."""

    @staticmethod
    def forward(ctx, total, denom):
        ctx.save_for_backward(denom)
        return total / denom

    @staticmethod
    def backward(ctx, grad):
        (denom,) = ctx.saved_tensors
        return torch.where(denom == 0, torch.zeros_like(grad), grad / denom), None


def _local_loss(name, c, class_axes, batch_axes, offset, length, n_classes, count, mesh):
    """The local function of a loss whose class dim is split and/or whose mean spans ranks."""
    nll = name.endswith("nll_loss")

    def loss(*args, **kwargs):
        a = _LossArgs(name, args, kwargs)
        x, t, w = a.input, a.target, a.weight
        if class_axes:
            per = (_class_split_nll(x, t, w, a.ignore_index, c, offset, length) if nll else
                   _VocabParallelCE.apply(x, t, w, a.ignore_index, a.label_smoothing, c, offset, n_classes,
                                          mesh, class_axes))
        else:
            fn = F.nll_loss if nll else F.cross_entropy
            extra = {} if nll else {"label_smoothing": a.label_smoothing}
            per = fn(x, t, w, ignore_index=a.ignore_index, reduction="none", **extra)
        if a.reduction == "none":
            return per
        total = per.sum()
        if a.reduction == "sum":
            return total
        if count is not None:  # probability targets: the mean is over samples
            return total / count
        keep = t != a.ignore_index  # torch itself refuses class weights that require grad
        denom = (w[torch.where(keep, t, 0)] * keep).sum() if w is not None else keep.sum()
        denom = all_reduce_axes(denom.to(x.dtype).reshape(1), "sum", mesh, batch_axes).reshape(())
        return _MeanOver.apply(total, denom)

    return loss


def _class_split_nll(x, t, w, ignore_index, c, offset, length):
    """Per-sample -w[t] * x[t] where this rank holds classes [offset, offset + length); 0 elsewhere."""
    local, inside = local_index(t, offset, length)
    picked = x.movedim(c, -1).gather(-1, local.unsqueeze(-1)).squeeze(-1) if length else x.new_zeros(t.shape)
    keep = inside & (t != ignore_index)
    scale = w[torch.where(t != ignore_index, t, 0)] if w is not None else 1.0
    return torch.where(keep, -picked * scale, torch.zeros_like(picked))


class _VocabParallelCE(torch.autograd.Function):
    """Per-sample cross entropy with the class dim split over `axes`: max, sum of exp and the target
    logit are reduced across ranks; the backward is local (softmax - smoothed one-hot, per rank)."""

    @staticmethod
    def forward(ctx, x, t, w, ignore_index, smoothing, c, offset, n_classes, mesh, axes):
        if w is not None and w.requires_grad:
            raise RuntimeError("cross_entropy with the class dim split: class weights that require grad are "
                               "not supported; detach them")
        x = x.movedim(c, -1)
        m = x.detach().amax(-1) if x.shape[-1] else x.new_full(x.shape[:-1], float("-inf"))
        m = all_reduce_axes(m, "max", mesh, axes)
        s = all_reduce_axes((x - m.unsqueeze(-1)).exp().sum(-1), "sum", mesh, axes)
        lse = m + s.log()
        local, inside = local_index(t, offset, x.shape[-1])
        xt = torch.where(inside, x.gather(-1, local.unsqueeze(-1)).squeeze(-1), torch.zeros_like(lse)) \
            if x.shape[-1] else torch.zeros_like(lse)
        xt = all_reduce_axes(xt, "sum", mesh, axes)
        keep = t != ignore_index
        wt = w[torch.where(keep, t, 0)] if w is not None else torch.ones_like(lse)
        wt = torch.where(keep, wt, torch.zeros_like(wt))
        loss = (1 - smoothing) * wt * (lse - xt)
        wl = w[offset:offset + x.shape[-1]] if w is not None else None
        w_sum = w.sum() if w is not None else n_classes
        if smoothing:
            terms = lse.unsqueeze(-1) - x
            sm = (terms * wl).sum(-1) if wl is not None else terms.sum(-1)
            sm = all_reduce_axes(sm, "sum", mesh, axes)
            loss = loss + (smoothing / n_classes) * torch.where(keep, sm, torch.zeros_like(sm))
        ctx.save_for_backward(x, lse, local, inside, wt, keep)
        ctx.extra = (wl, w_sum, smoothing, n_classes, c)
        return loss

    @staticmethod
    def backward(ctx, g):
        x, lse, local, inside, wt, keep = ctx.saved_tensors
        wl, w_sum, smoothing, n_classes, c = ctx.extra
        p = (x - lse.unsqueeze(-1)).exp()
        onehot = torch.zeros_like(x).scatter(-1, local.unsqueeze(-1), inside.unsqueeze(-1).to(x.dtype)) \
            if x.shape[-1] else torch.zeros_like(x)
        grad = (1 - smoothing) * wt.unsqueeze(-1) * (p - onehot)
        if smoothing:
            grad = grad + (smoothing / n_classes) * (w_sum * p - (wl if wl is not None else 1.0))
        grad = grad * (g * keep).unsqueeze(-1)
        return grad.movedim(-1, c), None, None, None, None, None, None, None, None, None


__all__ = ["Embedding", "Attention", "Norm", "Loss", "local_index", "all_reduce_axes"]
