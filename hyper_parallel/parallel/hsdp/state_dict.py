"""Full, plain state dicts for an hsdp model: gathered to rank 0 for saving, scattered back for loading."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...dtensor.dtensor import DTensor, distribute_tensor
from ...redistribute import collectives


def full_state_dict(model: nn.Module, rank0_only: bool = True) -> dict:
    """Every entry of `model.state_dict()` as a plain full tensor (all ranks take part in the gathers)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = {}
    with torch.no_grad():
        for name, value in model.state_dict().items():
            full = value.full_tensor() if type(value) is DTensor else value
            if rank == 0 or not rank0_only:
                out[name] = full.detach().clone()
    return out


def load_full_state_dict(model: nn.Module, state_dict: dict | None, from_rank0: bool = True) -> None:
    """Copy full tensors into the shards; with `from_rank0` only rank 0 needs `state_dict` (others: None)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    broadcast = from_rank0 and dist.is_initialized() and dist.get_world_size() > 1
    own = model.state_dict()
    if rank == 0 or not broadcast:
        missing = sorted(set(own) - set(state_dict or {}))
        if missing:
            raise KeyError(f"load_full_state_dict: missing entries {missing[:5]}{'...' if len(missing) > 5 else ''}")
    with torch.no_grad():
        for name, target in own.items():
            local_target = target._local if type(target) is DTensor else target
            if broadcast:
                full = state_dict[name].to(local_target.dtype).contiguous().clone() if rank == 0 else \
                    torch.empty(tuple(target.shape), dtype=local_target.dtype, device=local_target.device)
                collectives.broadcast(full, 0)
            else:
                full = state_dict[name]
            if type(target) is DTensor:
                piece = distribute_tensor(full, target.dist_layout, src_data_rank=None).to_local()
                target._local.copy_(piece)
            else:
                target.copy_(full)
