"""Ring attention on local tensors: Q stays, K/V blocks go around the ring of the context-parallel axis.

Each block's scores are computed, folded into the running output by an online softmax (log-sum-exp
merge) and dropped, so no rank ever holds full-length scores; the next block travels while this one
is computed. The backward runs the ring again, recomputing each block's probabilities from the saved
log-sum-exp (as flash attention does), with the K/V gradients travelling along with their block back
to the rank that owns it.

Shapes: q (b, hq, lq, d), k and v (b, hkv, lk, d) with hq a multiple of hkv (GQA: the K/V heads are
not repeated, query heads are grouped per K/V head). Masks are computed per block from the original
token index of every query and key (`Visibility`), so causal, sliding-window and padding masks use
global positions whatever order the tokens are held in; so do the index-based mask functions of transformers'
mask builders where a model makes more than those (`IndexMask`: image blocks seen bidirectionally).

Two changes to the scores that one device's eager attention makes are done exactly here: logit
softcapping (`softcap * tanh(scores / softcap)` before the mask, Gemma 2), which torch's fused kernel
cannot do, so such blocks take the unfused kernel; and attention sinks (`sink`, one logit per query
head concatenated to every row of scores and dropped after the softmax, GPT-OSS), which change only the
softmax's denominator: after the blocks are merged, `out * sigmoid(lse - sink)` and
`lse = logaddexp(lse, sink)` (`with_sink`), the sink being a key whose value is 0. The backward of the
blocks then runs unchanged from that final out and lse (the sink's probability is part of the
denominator, its value adds nothing), and the sink's own gradient is `-exp(sink - lse) * rowsum(d_out * out)`
(`sink_grad`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ...redistribute import collectives as C

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class IndexMask:
    """A mask function of transformers' mask builders, `function(batch, head, q_index, kv_index) -> bool`
    (index-based, as their non-vmap sdpa path calls it), with the batch and offsets it was built for. It says
    which keys a query sees where the builders make more than causal / sliding-window masks: image or prefix
    blocks seen bidirectionally (Gemma 3's and PaliGemma's `block_sequence_ids`), chunks, any `or_mask_function`.
    Evaluated per block on original token indices, it is the model's own mask whatever order tokens are held in."""

    function: Callable
    batch: int
    q_offset: int = 0
    kv_offset: int = 0

    def __call__(self, q_index: Tensor, k_index: Tensor) -> Tensor:
        """(batch, lq, lk) bool: which keys (original indices `k_index`) each query (`q_index`) sees."""
        device = q_index.device
        batch = torch.arange(self.batch, device=device)[:, None, None, None]
        head = torch.zeros(1, dtype=torch.long, device=device)[None, :, None, None]
        allowed = self.function(batch, head, (q_index + self.q_offset)[None, None, :, None],
                                (k_index + self.kv_offset)[None, None, None, :])
        return allowed.to(device).expand(self.batch, 1, q_index.numel(), k_index.numel())[:, 0]


@dataclass(frozen=True)
class Visibility:
    """Which keys a query sees: `causal` (key index <= query index), `window` (query - key < window),
    and `key_ok` (b, total keys in held order) for padding; indices are original token indices. `index_mask`,
    where the model's mask builders made one, replaces the causal and window rules (padding still applies)."""

    causal: bool
    window: int | None = None
    key_ok: Tensor | None = None
    index_mask: IndexMask | None = None

    def mask(self, q_index: Tensor, k_index: Tensor, k_slice: slice) -> Tensor | None:
        """(b or 1, lq, lk) bool mask of the block, None when every key is visible."""
        allowed = None
        if self.index_mask is not None:
            allowed = self.index_mask(q_index, k_index)
        else:
            if self.causal:
                allowed = k_index[None, :] <= q_index[:, None]
            if self.window is not None:
                near = q_index[:, None] - k_index[None, :] < self.window
                allowed = near if allowed is None else allowed & near
            allowed = None if allowed is None else allowed[None]
        if self.key_ok is not None:
            keys = self.key_ok[:, k_slice][:, None, :]
            allowed = keys if allowed is None else allowed & keys
        return allowed

    def skips(self, q_index: Tensor, k_index: Tensor) -> bool:
        """True when no query of the block can see any key of it (a causal block above the diagonal); a block
        under an `index_mask` is judged from its mask (`_pieces`), which is made once."""
        return self.index_mask is None and self.causal and bool(k_index.min() > q_index.max())


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, scale: float, softcap: float | None = None) -> Tensor:
    """(b, hkv, g, lq, lk) scaled (and softcapped) scores with masked entries at -inf."""
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    s = torch.matmul(q.reshape(b, hkv, (hq // hkv) * lq, d), k.transpose(-1, -2)) * scale
    s = s.view(b, hkv, hq // hkv, lq, k.shape[2])
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None].to(s.device), _NEG_INF)
    return s


def _finite(lse: Tensor) -> Tensor:
    """Log-sum-exp with fully masked rows (-inf) set to 0, so exp(scores - lse) is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _fused(q: Tensor, v: Tensor, mask: Tensor | None, softcap: float | None) -> bool:
    """torch's CPU flash kernel (no materialised scores, returns the log-sum-exp) serves unmasked blocks whose
    values have the queries' head size (MLA's do not: DeepSeek's values are narrower than its keys) and whose
    scores are not softcapped (the kernel has no tanh); on meta (hp.plan's trace) too, so the plan saves what a
    CPU run saves."""
    return mask is None and softcap is None and q.shape[-1] == v.shape[-1] and q.device.type in ("cpu", "meta")


def _repeat_kv(t: Tensor, groups: int) -> Tensor:
    b, h, n, d = t.shape
    return t if groups == 1 else t[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def _sum_groups(t: Tensor, heads: int) -> Tensor:
    b, hq, n, d = t.shape
    return t if hq == heads else t.view(b, heads, hq // heads, n, d).sum(2)


def block_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                  causal: bool = False, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """Attention of q over one K/V block: (out (b, hq, lq, dv), lse (b, hq, lq)). `causal` (unmasked
    blocks only): a square block on the diagonal, query i sees keys 0..i. `softcap`: the scores are
    `softcap * tanh(scores / softcap)`."""
    b, hq, lq, _ = q.shape
    hkv = k.shape[1]
    if _fused(q, v, mask, softcap):
        groups = hq // hkv
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), _repeat_kv(k, groups).contiguous(), _repeat_kv(v, groups).contiguous(), 0.0, causal,
            scale=scale)
        return out, lse
    if causal:
        mask = torch.ones(lq, k.shape[2], dtype=torch.bool, device=q.device).tril()[None]
    s = _scores(q, k, mask, scale, softcap)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    out = torch.matmul(p.reshape(b, hkv, -1, k.shape[2]), v).view(b, hq, lq, v.shape[-1])
    return out, lse.reshape(b, hq, lq)


def merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online softmax: fold a block's (out, lse) into the running ones; rows masked everywhere stay 0."""
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    out = out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None]
    return out, new


def with_sink(out: Tensor, lse: Tensor, sink: Tensor | None) -> tuple[Tensor, Tensor]:
    """The merged (out, lse) of every block with the sink logits (hq,) in the softmax's denominator: the sink
    is one more key per row, of score `sink[head]` and value 0 (as one device concatenates it to the scores and
    drops its column after the softmax). A row that sees no key stays 0."""
    if sink is None:
        return out, lse
    sink = sink.to(lse.dtype)[None, :, None]
    out = out * torch.sigmoid(lse - sink).to(out.dtype)[..., None]
    return out, torch.logaddexp(lse, sink)


def sink_grad(d_out: Tensor, out: Tensor, lse: Tensor, sink: Tensor | None) -> Tensor | None:
    """The gradient of the sink logits (hq,) from the final out and lse (`with_sink`'s): the sink column's
    probability times (its value's 0 - rowsum(d_out * out)), summed over batch and queries."""
    if sink is None:
        return None
    delta = (d_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return -(torch.exp(sink.to(lse.dtype)[None, :, None] - lse) * delta).sum((0, 2)).to(sink.dtype)


def block_backward(q, k, v, mask, scale, d_out, out, lse, causal: bool = False, softcap: float | None = None):
    """Gradients of one block from the final out and lse (recomputed probabilities): (dq, dk, dv)."""
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    if _fused(q, v, mask, softcap):
        lse = lse.transpose(1, 2).contiguous().transpose(1, 2)  # the kernel's own (b, lq, h) storage
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out.contiguous(), q.contiguous(), _repeat_kv(k, g).contiguous(), _repeat_kv(v, g).contiguous(),
            out.contiguous(), lse, 0.0, causal, scale=scale)
        return dq, _sum_groups(dk, hkv), _sum_groups(dv, hkv)
    if causal:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()[None]
    delta = (d_out * out).sum(-1)
    s = _scores(q, k, mask, scale, softcap)
    p = torch.exp(s - _finite(lse).view(b, hkv, g, lq)[..., None])
    p = p.reshape(b, hkv, g * lq, lk)
    d_out_g = d_out.reshape(b, hkv, g * lq, -1)
    dv = torch.matmul(p.transpose(-1, -2), d_out_g)
    dp = torch.matmul(d_out_g, v.transpose(-1, -2))
    ds = p * (dp - delta.reshape(b, hkv, g * lq, 1)) * scale
    if softcap is not None:  # d(c tanh(x / c))/dx = 1 - tanh^2; 0 at masked entries (-inf), whose p is 0
        ds = ds * (1 - (s / softcap).square()).clamp_min(0).reshape(b, hkv, g * lq, lk)
    dq = torch.matmul(ds, k).view(b, hq, lq, -1)
    dk = torch.matmul(ds.transpose(-1, -2), q.reshape(b, hkv, g * lq, -1))
    return dq, dk, dv


@dataclass(frozen=True)
class Ring:
    """The ring: process group, this rank's place in it, and each rank's original token indices."""

    group: object
    rank: int
    parts: int
    index: tuple  # per ring rank, the original token index of its local tokens (held order)

    def source(self, step: int) -> int:
        """The rank whose K/V block this rank holds at `step`."""
        return (self.rank - step) % self.parts


def _pieces(ring: Ring, vis: Visibility, src: int):
    """(query rows, key columns, mask, causal) of each (query chunk, key chunk) pair that is not hidden.

    Each rank holds two contiguous chunks: under a causal mask a pair is wholly visible (key chunk
    before the query chunk: no mask), on the diagonal (a square causal block) or hidden (skipped).
    Padding or a window adds a mask built from the original token indices."""
    q_index, k_index = ring.index[ring.rank], ring.index[src]
    half, lk = q_index.numel() // 2, k_index.numel()
    plain = vis.window is None and vis.key_ok is None and vis.index_mask is None
    pieces = []
    for rows in (slice(0, half), slice(half, 2 * half)):
        for cols in (slice(0, lk // 2), slice(lk // 2, lk)):
            qi, ki = q_index[rows], k_index[cols]
            if vis.skips(qi, ki):
                continue
            diagonal = vis.causal and not bool(ki.max() <= qi.min())
            if plain:
                pieces.append((rows, cols, None, diagonal))
            else:
                k_slice = slice(src * lk + cols.start, src * lk + cols.stop)
                mask = vis.mask(qi, ki, k_slice)
                if vis.index_mask is not None and not bool(mask.any()):
                    continue   # hidden by the model's own mask (or padded): adds nothing to the merge
                pieces.append((rows, cols, mask, False))
    return pieces


class RingAttention(torch.autograd.Function):
    """Exact attention of the local queries over every rank's keys, by a ring of P2P K/V blocks."""

    @staticmethod
    def forward(ctx, q, k, v, sink, ring: Ring, vis: Visibility, scale: float, softcap: float | None = None):
        out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
        lse = q.new_full(q.shape[:-1], _NEG_INF, dtype=torch.float32)  # fp32 for bf16/fp16 q too, as flash kernels keep it
        kv = torch.cat([k, v], -1)
        dk = k.shape[-1]
        for step in range(ring.parts):
            if step < ring.parts - 1:
                incoming, works = C.ring_step(kv, ring.group, ring.rank, ring.parts)
            for rows, cols, mask, causal in _pieces(ring, vis, ring.source(step)):
                o, l = block_forward(q[:, :, rows], kv[:, :, cols, :dk], kv[:, :, cols, dk:], mask, scale, causal,
                                     softcap)
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, l)
            if step < ring.parts - 1:
                for w in works:
                    w.wait()
                kv = incoming
        out, lse = with_sink(out, lse, sink)
        ctx.save_for_backward(q, k, v, sink, out, lse)
        ctx.ring, ctx.vis, ctx.scale, ctx.softcap = ring, vis, scale, softcap
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, sink, out, lse = ctx.saved_tensors
        ring, vis, scale, softcap = ctx.ring, ctx.vis, ctx.scale, ctx.softcap
        d_out = d_out.contiguous()
        dq = torch.zeros_like(q)
        kv = torch.cat([k, v], -1)
        d_kv = torch.zeros_like(kv)
        dk_ = k.shape[-1]
        for step in range(ring.parts):
            last = step == ring.parts - 1
            if not last:
                incoming, works = C.ring_step(kv, ring.group, ring.rank, ring.parts)
            for rows, cols, mask, causal in _pieces(ring, vis, ring.source(step)):
                gq, gk, gv = block_backward(q[:, :, rows], kv[:, :, cols, :dk_], kv[:, :, cols, dk_:], mask, scale,
                                            d_out[:, :, rows], out[:, :, rows], lse[:, :, rows], causal, softcap)
                dq[:, :, rows] += gq
                d_kv[:, :, cols, :dk_] += gk
                d_kv[:, :, cols, dk_:] += gv
            # the block's gradient follows it; after the last step it goes home to its owner
            if ring.parts > 1:
                d_kv_in, d_works = C.ring_step(d_kv, ring.group, ring.rank, ring.parts)
                for w in (works if not last else []) + d_works:
                    w.wait()
                d_kv = d_kv_in
                if not last:
                    kv = incoming
        return dq, d_kv[..., :dk_], d_kv[..., dk_:], sink_grad(d_out, out, lse, sink), None, None, None, None


class BlockAttention(torch.autograd.Function):
    """Attention of q over one whole K/V block with the scores' changes (a `softcap`, `sink` logits), on this
    rank alone (ulysses, allgather and the unsplit decoding steps); as ring's blocks, the backward recomputes
    the probabilities from the saved log-sum-exp. `mask` (b or 1, lq, lk) or None: every key visible; rows
    that see no key come out 0."""

    @staticmethod
    def forward(ctx, q, k, v, sink, mask, scale: float, softcap: float | None):
        out, lse = with_sink(*block_forward(q, k, v, mask, scale, softcap=softcap), sink)
        ctx.save_for_backward(q, k, v, sink, mask, out, lse)
        ctx.scale, ctx.softcap = scale, softcap
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, sink, mask, out, lse = ctx.saved_tensors
        d_out = d_out.contiguous()
        dq, dk, dv = block_backward(q, k, v, mask, ctx.scale, d_out, out, lse, softcap=ctx.softcap)
        return dq, dk, dv, sink_grad(d_out, out, lse, sink), None, None, None
