"""The load-balanced ("zigzag") sequence order of context parallelism.

The sequence is cut into 2n chunks; rank i of n holds chunks i and 2n-1-i, so that under a causal mask
every rank has the same amount of attention work. Inside the model the sequence-split activations are
DTensors whose global order is this zigzag order; positions and masks are computed from the original
(global) token index, and the base model's output is put back into the plain order (rank i holding
chunks 2i and 2i+1, i.e. an ordinary Shard of the sequence) before the head and the loss.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...redistribute import collectives as C


def zigzag_chunks(rank: int, parts: int) -> tuple[int, int]:
    """The two sequence chunks (of 2 * parts) that `rank` holds."""
    return rank, 2 * parts - 1 - rank


def token_index(rank: int, parts: int, chunk: int, device=None) -> Tensor:
    """Original (global) token index of each of `rank`'s local tokens, in local order."""
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in zigzag_chunks(rank, parts)])


def zigzag_slice(t: Tensor, dim: int, rank: int, parts: int) -> Tensor:
    """This rank's zigzag piece of a whole tensor (no communication)."""
    chunk = t.shape[dim] // (2 * parts)
    return torch.cat([t.narrow(dim, c * chunk, chunk) for c in zigzag_chunks(rank, parts)], dim)


def _plain_owner(chunk: int, parts: int) -> tuple[int, int]:
    return chunk // 2, chunk % 2


def _zigzag_owner(chunk: int, parts: int) -> tuple[int, int]:
    return (chunk, 0) if chunk < parts else (2 * parts - 1 - chunk, 1)


def _move_chunks(local: Tensor, dim: int, group, rank: int, parts: int, src, dst) -> Tensor:
    """Exchange chunks so that each lands where `dst` says, from where `src` says (one batch of P2P)."""
    halves = list(local.chunk(2, dim))
    out = [torch.empty_like(halves[0]), torch.empty_like(halves[1])]
    sends, recvs = [], []
    for chunk in range(2 * parts):  # same order on every rank: P2P messages between a pair match in order
        (s_rank, s_slot), (d_rank, d_slot) = src(chunk, parts), dst(chunk, parts)
        if s_rank == rank and d_rank == rank:
            out[d_slot] = halves[s_slot]
        elif s_rank == rank:
            sends.append((halves[s_slot].contiguous(), d_rank))
        elif d_rank == rank:
            recvs.append((out[d_slot], s_rank))
    for work in C.exchange(sends, recvs, group):
        work.wait()
    return torch.cat(out, dim)


class _Reorder(torch.autograd.Function):
    """Plain sequence split <-> zigzag split of a local shard; the gradient takes the reverse trip."""

    @staticmethod
    def forward(ctx, local, dim, group, rank, parts, to_zigzag):
        ctx.args = (dim, group, rank, parts, not to_zigzag)
        return reorder(local, dim, group, rank, parts, to_zigzag, differentiable=False)

    @staticmethod
    def backward(ctx, grad):
        return reorder(grad, *ctx.args, differentiable=False), None, None, None, None, None


def reorder(local: Tensor, dim: int, group, rank: int, parts: int, to_zigzag: bool,
            differentiable: bool = True) -> Tensor:
    """Move a sequence shard between the plain order and the zigzag order (`to_zigzag` says which way)."""
    if differentiable and torch.is_grad_enabled() and local.requires_grad:
        return _Reorder.apply(local, dim, group, rank, parts, to_zigzag)
    src, dst = (_plain_owner, _zigzag_owner) if to_zigzag else (_zigzag_owner, _plain_owner)
    return _move_chunks(local, dim, group, rank, parts, src, dst)
