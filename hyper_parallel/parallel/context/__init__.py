"""Context parallelism: the sequence split over a mesh axis, exact attention by ring, Ulysses or all-gather."""
from .api import context_parallel

__all__ = ["context_parallel"]
