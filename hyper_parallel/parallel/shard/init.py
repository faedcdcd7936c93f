"""Deferred initialisation: a model built on the meta device, sharded, then given memory shard by shard.

`init_parameters` allocates each parameter's local piece only and fills it locally (no full tensor
ever exists); `load_sharded` then reads each rank's slices from safetensors files with
`safe_open(...).get_slice`, so a rank's peak memory stays near its shard plus one slice.
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import torch
from torch import Tensor, nn

from ...dtensor.dtensor import DTensor, make_dtensor

_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.RMSNorm)


def _device(t: Tensor) -> torch.device:
    if isinstance(t, DTensor):
        kind = t.device_mesh.device_type
        if kind == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(kind)
    return torch.device("cpu")


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, _NORM_TYPES) or "LayerNorm" in name or "RMSNorm" in name


def _std(model: nn.Module) -> float:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    for c in (config, text):
        value = getattr(c, "initializer_range", None)
        if value:
            return float(value)
    return 0.02


def _tensors(model: nn.Module, kind: str):
    """(module, attr, full name, tensor) for every parameter or buffer, tied ones once per owner."""
    for mname, module in model.named_modules(remove_duplicate=False):
        store = module._parameters if kind == "param" else module._buffers
        for attr, t in store.items():
            if t is not None:
                yield module, attr, (f"{mname}.{attr}" if mname else attr), t


def _with_local(old: Tensor, local: Tensor) -> Tensor:
    """`old` (a parameter or buffer, DTensor or plain) rebuilt around new local data."""
    if isinstance(old, DTensor):
        new = make_dtensor(local, old.dist_layout, tuple(old.shape))
    else:
        new = local
    if isinstance(old, nn.Parameter) or getattr(old, "_is_param", False):
        return nn.Parameter(new, requires_grad=old.requires_grad)
    return new


def _local_shape(t: Tensor) -> tuple:
    return tuple(t._local.shape) if isinstance(t, DTensor) else tuple(t.shape)


def _is_meta(t: Tensor) -> bool:
    return (t._local if isinstance(t, DTensor) else t).is_meta


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int = 0) -> nn.Module:
    """Materialise meta parameters and buffers as their local shards only; returns the model.

    Values follow the usual transformers convention (normal(0, initializer_range) for weights,
    ones for norm weights, zeros for biases); each piece is drawn from a generator seeded by the
    parameter's name and the piece's offset, so replicas agree without communication. Buffers
    (rotary frequencies) are recomputed by the model's own `_init_weights` where it has one.
    """
    return _allocate(model, seed, fill=True)


@torch.no_grad()
def materialize(model: nn.Module) -> nn.Module:
    """`init_parameters` without the values: memory for each local piece only, to be loaded next
    (`load_hf`, `load_sharded`); tied parameters stay tied, computed buffers are computed. Returns the model."""
    return _allocate(model, 0, fill=False)


def _allocate(model: nn.Module, seed: int, fill: bool) -> nn.Module:
    std = _std(model)
    done: dict = {}
    modules_with_buffers = []
    for module, attr, name, t in list(_tensors(model, "param")):
        if id(t) in done:
            module._parameters[attr] = done[id(t)]
            continue
        if not _is_meta(t):
            done[id(t)] = t
            continue
        local = torch.empty(_local_shape(t), dtype=t.dtype, device=_device(t))
        if fill:
            offset = t.dist_layout.local_offset(tuple(t.shape)) if isinstance(t, DTensor) else (0,) * t.ndim
            _fill(local, module, attr, name, offset, std, seed)
        new = _with_local(t, local)
        done[id(t)] = new
        module._parameters[attr] = new
    for module, attr, name, t in list(_tensors(model, "buffer")):
        if _is_meta(t):
            module._buffers[attr] = _with_local(t, torch.zeros(_local_shape(t), dtype=t.dtype, device=_device(t)))
            if module not in modules_with_buffers:
                modules_with_buffers.append(module)
    _init_buffers(model, modules_with_buffers)
    return model


def _init_buffers(model: nn.Module, modules: list) -> None:
    """Computed buffers (rotary frequencies) by the model's own `_init_weights`, module by module."""
    init_fn = getattr(model, "_init_weights", None)
    for module in modules:
        if init_fn is not None and not any(True for _ in module.parameters(recurse=False)):
            init_fn(module)


def _fill(local: Tensor, module: nn.Module, attr: str, name: str, offset: tuple, std: float, seed: int) -> None:
    if attr == "bias" or "bias" in attr.split("_"):
        local.zero_()
    elif _is_norm(module):
        local.fill_(1.0)
    else:
        key = f"{seed}:{name}:{','.join(map(str, offset))}"
        gen = torch.Generator(device=local.device).manual_seed(zlib.crc32(key.encode()))
        local.normal_(0.0, std, generator=gen)
        pad = getattr(module, "padding_idx", None)
        if isinstance(module, nn.Embedding) and pad is not None:
            row = pad - offset[0]
            if 0 <= row < local.shape[0]:
                local[row].zero_()


# ---- loading -----------------------------------------------------------------------------------
def _index(path: Path) -> dict:
    """checkpoint key -> file, from a safetensors file, a folder of them, or a folder with an index json."""
    from safetensors import safe_open
    if path.is_file():
        files = [path]
    else:
        index = sorted(path.glob("*.safetensors.index.json"))
        if index:
            weight_map = json.loads(index[0].read_text())["weight_map"]
            return {k: path / f for k, f in weight_map.items()}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"load_sharded: no *.safetensors under {path}")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = f
    return out


@torch.no_grad()
def load_sharded(model: nn.Module, path: str | os.PathLike, strict: bool = True) -> nn.Module:
    """Fill the model's parameters and persistent buffers from safetensors, reading each rank's slices only.

    Works on a sharded model whose tensors are on the meta device (they are allocated here) or already
    allocated (copied into). Keys are the model's own names (`model.state_dict()` names); a tied
    parameter is read once under any of its names. With `strict`, a tensor missing from the
    checkpoint, or a shape mismatch, is an error.
    """
    from safetensors import safe_open
    where = _index(Path(path))
    handles: dict = {}
    missing = []
    done: dict = {}

    def read(key: str, t: Tensor) -> Tensor:
        f = where[key]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        sl = handles[f].get_slice(key)
        shape = tuple(sl.get_shape())
        if shape != tuple(t.shape):
            raise ValueError(f"load_sharded: {key} has shape {shape} in {f.name} but {tuple(t.shape)} in the model")
        if isinstance(t, DTensor):
            lay = t.dist_layout
            offs, sizes = lay.local_offset(shape), lay.local_shape(shape)
            piece = sl[tuple(slice(o, o + n) for o, n in zip(offs, sizes))] if shape else sl[:]
        else:
            piece = sl[:] if shape else handles[f].get_tensor(key)
        return piece.to(dtype=t.dtype, device=_device(t))

    entries = [("param",) + e for e in _tensors(model, "param")]
    entries += [("buffer",) + e for e in _tensors(model, "buffer")
                if e[1] not in e[0]._non_persistent_buffers_set]
    names_of: dict = {}
    for kind, module, attr, name, t in entries:
        names_of.setdefault(id(t), []).append(name)
    for kind, module, attr, name, t in entries:
        store = module._parameters if kind == "param" else module._buffers
        if id(t) in done:
            if done[id(t)] is not None:
                store[attr] = done[id(t)]
            continue
        key = next((n for n in names_of[id(t)] if n in where), None)
        if key is None:
            missing.append(name)
            done[id(t)] = None
            continue
        local = read(key, t)
        if _is_meta(t):
            new = _with_local(t, local)
        else:
            (t._local if isinstance(t, DTensor) else t).copy_(local)
            new = t
        done[id(t)] = new
        store[attr] = new
    if strict and missing:
        raise KeyError(f"load_sharded: {len(missing)} tensors of the model are not in {path}: "
                       f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}")
    return model
