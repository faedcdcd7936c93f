"""torch.chunk arithmetic for nested splits: each mesh axis splits the piece left by the axes before it."""
from __future__ import annotations


def chunk_sizes(length: int, parts: int) -> list[int]:
    """Sizes torch.chunk gives (padded with empty chunks up to `parts`)."""
    step = -(-length // parts) if length else 0
    return [max(0, min(step, length - i * step)) for i in range(parts)]


def piece(length: int, splits) -> tuple[int, int]:
    """(offset, size) of the piece selected by `splits`, a sequence of (parts, index), outer first."""
    offset, size = 0, length
    for parts, index in splits:
        step = -(-size // parts) if size else 0
        start = min(index * step, size)
        offset += start
        size = max(0, min(step, size - start))
    return offset, size
