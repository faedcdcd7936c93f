"""The distributed tensor and its autograd bridge."""
from .dtensor import DTensor, distribute_tensor, make_dtensor

__all__ = ["DTensor", "distribute_tensor", "make_dtensor"]
