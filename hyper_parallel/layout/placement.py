"""Placements: how one mesh axis holds a tensor (small immutable values, as in torch)."""
from __future__ import annotations

_REDUCE_OPS = ("sum", "avg", "max", "min")


class Placement:
    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


class Shard(Placement):
    """The tensor dim `dim` is split over the mesh axis (torch.chunk semantics)."""

    __slots__ = ("dim",)

    def __init__(self, dim: int):
        object.__setattr__(self, "dim", int(dim))

    def __setattr__(self, *_):
        raise AttributeError("placements are immutable")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __eq__(self, other):
        return type(other) is Shard and other.dim == self.dim

    def __hash__(self):
        return hash(("S", self.dim))

    def __repr__(self):
        return f"Shard(dim={self.dim})"


class Replicate(Placement):
    """Every rank along the mesh axis holds the whole tensor."""

    __slots__ = ()

    def is_replicate(self) -> bool:
        return True

    def __eq__(self, other):
        return type(other) is Replicate

    def __hash__(self):
        return hash("R")

    def __repr__(self):
        return "Replicate()"


class Partial(Placement):
    """Each rank holds a term; the value is their reduction (a pending all-reduce)."""

    __slots__ = ("reduce_op",)

    def __init__(self, reduce_op: str = "sum"):
        if reduce_op not in _REDUCE_OPS:
            raise ValueError(f"Partial reduce_op must be one of {_REDUCE_OPS}, got {reduce_op!r}")
        object.__setattr__(self, "reduce_op", reduce_op)

    def __setattr__(self, *_):
        raise AttributeError("placements are immutable")

    def is_partial(self) -> bool:
        return True

    def __eq__(self, other):
        return type(other) is Partial and other.reduce_op == self.reduce_op

    def __hash__(self):
        return hash(("P", self.reduce_op))

    def __repr__(self):
        return f"Partial({self.reduce_op})"


REPLICATE = Replicate()
