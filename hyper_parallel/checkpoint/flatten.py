"""Walk a nested state (dicts, lists, tuples) into dotted keys, and store Python values as JSON.

Dicts are always walked so that a key mismatch is reported at the leaf ("optim.state.3.exp_avg").
Lists and tuples are walked only when they hold a tensor or a dict somewhere; otherwise (e.g.
`betas`, a param group's `params`) they are one Python value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CheckpointCorruptError


@dataclass
class Leaf:
    key: str
    container: Any  # the dict / list / tuple holding the value, so load can replace it in place
    slot: Any
    value: Any

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.value, torch.Tensor)


def _walkable(v) -> bool:
    if isinstance(v, dict):
        return True
    if isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
        return any(isinstance(x, torch.Tensor) or _walkable(x) for x in v)
    return False


def flatten(state: dict) -> list[Leaf]:
    """Leaves in a deterministic order (dict insertion order), with unique dotted keys."""
    if not isinstance(state, dict):
        raise TypeError(f"a checkpoint state must be a dict (e.g. {{'model': ..., 'optim': ...}}), "
                        f"got {type(state).__name__}")
    out: list[Leaf] = []
    seen: set = set()

    def walk(container, prefix: str) -> None:
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for k, v in items:
            key = f"{prefix}{k}"
            if _walkable(v):
                walk(v, key + ".")
                continue
            if key in seen:
                raise ValueError(f"two entries of the state flatten to the same key {key!r}: rename one")
            seen.add(key)
            out.append(Leaf(key, container, k, v))

    walk(state, "")
    return out


def encode_value(v: Any, key: str) -> Any:
    """A JSON-safe form of a Python value (tuples, non-finite floats, dtypes are tagged)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"__float__": repr(v)}
    if isinstance(v, tuple):
        return {"__tuple__": [encode_value(x, key) for x in v]}
    if isinstance(v, list):
        return [encode_value(x, key) for x in v]
    if isinstance(v, dict):
        return {"__dict__": [[encode_value(k, key), encode_value(x, key)] for k, x in v.items()]}
    if isinstance(v, torch.dtype):
        return {"__dtype__": str(v).removeprefix("torch.")}
    raise TypeError(f"checkpoint key {key!r}: cannot store a {type(v).__name__}; values must be tensors or "
                    f"JSON-like Python values (None, bool, int, float, str, list, tuple, dict, torch.dtype)")


_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def decode_value(v: Any, where: str = "a stored value") -> Any:
    """The Python value `encode_value` stored; anything it could not have written is a CheckpointCorruptError
    naming `where` (a dtype tag must name a torch.dtype: an index is data, never a path to any torch attribute)."""
    if isinstance(v, list):
        return [decode_value(x, where) for x in v]
    if isinstance(v, dict):
        tag = next(iter(v), None) if len(v) == 1 else None
        body = v.get(tag)
        if tag == "__tuple__" and isinstance(body, list):
            return tuple(decode_value(x, where) for x in body)
        if tag == "__float__" and body in ("inf", "-inf", "nan"):
            return float(body)
        if tag == "__dict__" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
            out = {}
            for k, x in body:
                k = decode_value(k, where)
                try:
                    out[k] = decode_value(x, where)
                except TypeError:
                    raise CheckpointCorruptError(f"{where}: a dict key cannot be {k!r:.100}") from None
            return out
        if tag == "__dtype__" and isinstance(body, str) and body in _DTYPES:
            return _DTYPES[body]
        raise CheckpointCorruptError(f"{where}: {v!r:.200} is not a value a checkpoint stores (tagged tuple, "
                                     f"float, dict, or a torch dtype name)")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise CheckpointCorruptError(f"{where}: {v!r:.200} is not a value a checkpoint stores")
