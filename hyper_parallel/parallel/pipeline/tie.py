"""Input embeddings tied to the output head (`tie_word_embeddings=True`) when they sit on different stages.

Qwen3 up to 4B, Gemma, Llama 3.2 1B/3B and many image-text models share one weight between the embedding
table (first stage) and the head (last stage). Cut apart, each of the two pp ranks holds its own copy, and
the copies stay one weight the way Megatron keeps them ("embedding group"):

- the same values at the start: the first stage's copy is broadcast to the last stage's after a random
  initialisation, and `from_pretrained` reads both from the one tensor the folder holds (`ALIASES`);
- the same gradient: after each `Pipeline.step` each copy's gradient of that step is summed over the two
  ranks (one all-reduce, through the collectives module), so the optimizer, which sees each copy on its rank
  with the same state, takes the same step on both; gradients accumulated by earlier steps are kept aside
  while the step runs, so accumulation over several steps is not counted twice;
- the same layout: decided from every rank's description before any step, so that a tp / hsdp plan that
  lays the two copies out differently is refused on every rank rather than summing mismatched pieces.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...dtensor import DTensor
from ...layout.mesh import DeviceMesh
from ...redistribute import collectives
from ..surgery import embeddings

# the model attribute naming every state_dict name of a weight tied across stages (checkpoint/hf.py reads it)
ALIASES = "_hp_tied_names"


def tied_names(model: nn.Module, last: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """Every state_dict name of the weight the input embeddings share with the output head (embedding's
    first), or None when they share none. A model without a head at its root (BLIP's is inside its text
    decoder, `get_output_embeddings()` None) ties the same way where the embeddings' weight is shared only with
    modules of the last stage (`last`: their paths, `cut.Structure.last`)."""
    embed, head = embeddings(model, "input"), embeddings(model, "output")
    weight = getattr(embed, "weight", None)
    if weight is None:
        return None
    names = tuple(name for name, p in model.named_parameters(remove_duplicate=False) if p is weight)
    if weight is getattr(head, "weight", None):
        return names
    prefixes = tuple(f"{path}." for path in last)
    elsewhere = [n for n in names if not n.startswith(prefixes)] if prefixes else []
    if head is None and len(names) > 1 and len(elsewhere) == 1:
        return tuple(elsewhere) + tuple(n for n in names if n not in elsewhere)
    return None


@dataclass
class Tie:
    """The two copies of a tied weight: its names, and the group of the two pp ranks that hold them."""

    names: tuple
    group: Any          # this rank's group over (first stage's rank, last stage's rank); None: not a holder
    source: int         # the global rank of the first stage's copy in this rank's group

    def param(self, model: nn.Module) -> nn.Parameter | None:
        """This rank's copy (the parameter the optimizer sees, after hsdp), or None."""
        params = dict(model.named_parameters())
        return next((params[n] for n in self.names if n in params), None)

    @torch.no_grad()
    def broadcast_values(self, model: nn.Module) -> None:
        """The last stage's copy takes the first stage's values (after a random initialisation)."""
        p = self.param(model)
        if self.group is not None and p is not None:
            collectives.broadcast(p.data, self.source, self.group)

    def check_layouts(self, model: nn.Module, mesh: DeviceMesh) -> None:
        """Both copies laid out alike, decided on every rank from every rank's description."""
        p = self.param(model) if self.group is not None else None
        mine = None if p is None else (str(p.dist_layout.alias_entries()) if isinstance(p, DTensor) else "whole",
                                       tuple(p.shape), str(p.dtype))
        seen = {desc for _, desc in collectives.gather_objects(mesh, mine) if desc is not None}
        if len(seen) > 1:
            raise ValueError(f"pipeline: the weight {self.names[0]} tied to {', '.join(self.names[1:])} is laid out "
                             f"differently on the first and the last stage ({sorted(seen)}); give both the same "
                             f"layout in the tp plan, or untie them (tie_word_embeddings=False)")

    def hold_gradient(self, model: nn.Module):
        """The copy's gradient from earlier steps, kept aside while a step runs (None: nothing held)."""
        p = self.param(model) if self.group is not None else None
        if p is None or not p.requires_grad:
            return None
        held, p.grad = p.grad, None
        return held

    @torch.no_grad()
    def sum_gradients(self, model: nn.Module, held) -> None:
        """This step's gradient summed over the two copies, added to what earlier steps accumulated."""
        p = self.param(model) if self.group is not None else None
        if p is None or not p.requires_grad:
            return
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
        collectives.all_reduce_(grad._local if isinstance(grad, DTensor) else grad, self.group)
        if held is not None:
            (held._local if isinstance(held, DTensor) else held).add_(grad._local if isinstance(grad, DTensor)
                                                                      else grad)
            p.grad = held


def tie_across_stages(model: nn.Module, mesh: DeviceMesh, axis: str, names: tuple | None, first: int,
                      last: int) -> Tie | None:
    """The Tie of a weight whose copies sit on pp coordinates `first` and `last` (None when one rank holds
    both, which keeps the weight one object). Every rank calls it: it creates the pair's process groups."""
    if names is None or first == last:
        return None
    grid = mesh.mesh.movedim(mesh.axis_index(axis), 0)
    pairs = torch.stack([grid[first].reshape(-1), grid[last].reshape(-1)], dim=1)   # (others, 2)
    pair_mesh = DeviceMesh(mesh.device_type, pairs, ("tie_others", "tie"))
    coordinate = pair_mesh.coordinate if pair_mesh.distributed else (0, 0)
    model.__dict__[ALIASES] = names
    if coordinate is None:   # a middle stage's rank: holds neither copy
        return Tie(names, None, -1)
    return Tie(names, pair_mesh.get_group("tie"), int(pairs[coordinate[0], 0]))


__all__ = ["ALIASES", "Tie", "tie_across_stages", "tied_names"]
