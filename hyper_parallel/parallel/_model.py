"""What every parallelism's entry function does to the model it is given, besides laying it out.

- A model whose parameters are torch's own DTensors (loaded with transformers' `tp_plan=`) is refused
  up front: its weights are already split by another library, whose process groups and ops ours do
  not know; `hp.from_pretrained(path, mesh)` loads the same folder straight into our layouts.
- The model's own `save_pretrained(path)` is bound to `hyper_parallel`'s, which gathers the shards
  piece by piece (transformers' would read the wrappers' storage and fail).
"""
from __future__ import annotations

import types

from torch import nn


def refuse_foreign_dtensors(model: nn.Module, where: str) -> None:
    """ValueError (on every rank: parameters are the same everywhere) if torch DTensors are in the model."""
    try:
        from torch.distributed.tensor import DTensor as TorchDTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return
    for name, p in model.named_parameters():
        if isinstance(p, TorchDTensor):
            raise ValueError(f"{where}: parameter {name!r} is a torch.distributed DTensor (the model was loaded "
                             f"with transformers' tp_plan=, or parallelized by torch). Load the folder with "
                             f"hyper_parallel.from_pretrained(path, mesh) instead, which reads each rank's "
                             f"slices straight into hyper_parallel's layouts")


def bind_save_pretrained(model: nn.Module) -> None:
    """`model.save_pretrained(path, ...)` -> `hyper_parallel.save_pretrained(model, path, ...)` (a collective)."""
    if not hasattr(model, "config"):
        return

    def save_pretrained(self, save_directory, *, max_shard_size="50GB", **kwargs):
        from ..checkpoint.pretrained import save_pretrained as save  # the checkpoint package sits above us
        return save(self, save_directory, max_shard_size=max_shard_size, **kwargs)

    model.save_pretrained = types.MethodType(save_pretrained, model)
