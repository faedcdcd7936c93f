"""The token exchange of expert parallelism, on local tensors: route, all_to_all, compute, all_to_all back.

Every rank of the axis holds `n_local` whole experts (rank r owns global ids [r*n_local, (r+1)*n_local)).
Routes (token, k) are sorted by expert id, which also groups them by owner rank; per-expert counts are
exchanged first, so the token all_to_all has exact uneven splits: no capacity factor, nothing dropped,
any skew. The owners compute their experts on what they received, grouped by expert, and a second
all_to_all brings every route's result back; the combination with the router's weights then happens
where the token lives, as the model does it (sum over k of weight * expert output).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ...redistribute.collectives import all_to_all_uneven, all_to_all_uneven_autograd

# compute(received rows [R, H], local expert id per row [R]) -> expert outputs [R, H], unweighted
ExpertsCompute = Callable[[Tensor, Tensor], Tensor]


def dispatch_combine(hidden: Tensor, index: Tensor, weights: Tensor, n_local: int, group,
                     compute: ExpertsCompute) -> Tensor:
    """sum_k weights[t, k] * expert_{index[t, k]}(hidden[t]) for this rank's tokens, the experts living on
    the ranks of `group`. hidden [T, H], index [T, K] (global expert ids), weights [T, K]."""
    ranks = dist.get_world_size(group) if group is not None else 1
    tokens, top_k = index.shape
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)                  # routes grouped by expert, hence by owner
    if flat.is_meta:  # hp.plan's trace: no routing without values; every rank sends and receives an even share
        sent_per_expert = torch.empty((ranks, n_local), dtype=torch.long, device="meta")
    else:
        sent_per_expert = torch.bincount(flat, minlength=ranks * n_local).view(ranks, n_local)
    if group is not None:
        received_per_expert = all_to_all_uneven(sent_per_expert, [1] * ranks, [1] * ranks, group)
    else:
        received_per_expert = sent_per_expert
    if flat.is_meta:
        send_splits = recv_splits = [len(r) for r in torch.arange(flat.numel()).chunk(ranks)]
        send_splits += [0] * (ranks - len(send_splits))
    else:
        send_splits = sent_per_expert.sum(1).tolist()
        recv_splits = received_per_expert.sum(1).tolist()

    routed = hidden[order // top_k]
    received = _exchange(routed, recv_splits, send_splits, group)
    if flat.is_meta:
        local_ids = torch.empty((sum(recv_splits),), dtype=torch.long, device="meta")
    else:
        local_ids = torch.arange(n_local, device=index.device).repeat(ranks)
        local_ids = torch.repeat_interleave(local_ids, received_per_expert.reshape(-1))
    results = compute(received, local_ids)
    returned = _exchange(results, send_splits, recv_splits, group)

    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.numel(), device=order.device)
    per_route = returned[unsort].view(tokens, top_k, returned.shape[-1])
    return (per_route * weights.unsqueeze(-1).to(per_route.dtype)).sum(1).to(hidden.dtype)


def _exchange(rows: Tensor, output_splits: list, input_splits: list, group) -> Tensor:
    if group is None:
        return rows
    return all_to_all_uneven_autograd(rows, output_splits, input_splits, group)
