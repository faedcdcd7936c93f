"""Hugging Face checkpoint folders <-> sharded models.

`export_hf` writes what `from_pretrained` reads: `config.json` (+ `generation_config.json`) and
`model.safetensors` under the model's own state_dict names (a tied weight once, under its first
name, as `save_pretrained` does); past `max_shard_size` the weights are split into
`model-0000i-of-0000n.safetensors` files with a `model.safetensors.index.json`, as transformers does.
Rank 0 writes; every tensor is assembled there piece by piece from the ranks that own it
(point-to-point), so no rank ever holds more than one full tensor.
`load_hf` fills a sharded model from such a folder, each rank reading only its slices.
"""
from __future__ import annotations

import copy
import os
import shutil
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..dtensor.dtensor import DTensor
from ..redistribute import collectives
from . import comm
from .errors import CheckpointError, CheckpointMismatchError, CheckpointNotFoundError
from .format import SafetensorsWriter, hf_weight_map, write_json
from .loader import SliceReader
from .pieces import local_of, overlap, region, writer_pieces
from .saver import make_tmp, merge_into, publish

WEIGHTS_NAME = "model.safetensors"
INDEX_JSON = "model.safetensors.index.json"


def _model_tensors(model: nn.Module) -> list:
    """[(names, tensor)]: persistent parameters and buffers, tied ones grouped under all their names (a
    pipeline stage's copy of a weight tied across stages under the names of the whole model's weight)."""
    groups: dict = {}
    tied = model.__dict__.get("_hp_tied_names", ())   # parallel/pipeline/tie.py ALIASES
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), (t, []))[1].append(name)
    return [(names + [n for n in tied if n not in names] if set(names) & set(tied) else names, t)
            for t, names in groups.values()]


@torch.no_grad()
def gather_to_rank0(t: torch.Tensor) -> torch.Tensor | None:
    """The full value of `t` on rank 0 (None elsewhere), sent there piece by piece by the owners."""
    me = comm.rank()
    if not isinstance(t, DTensor):
        return t.detach().cpu() if me == 0 else None
    if t.dist_layout.has_partial:
        t = t.redistribute(t.dist_layout.without_partial())
    layout, shape = t.dist_layout, tuple(t.shape)
    pieces = writer_pieces(layout, shape)
    if not comm.distributed() and any(r != 0 for r, _, _ in pieces):
        raise CheckpointError(f"a {shape} tensor laid out as {layout} spans several ranks: export needs "
                              f"torch.distributed")
    local = local_of(t)
    full = torch.empty(shape, dtype=t.dtype) if me == 0 else None
    for r, offsets, sizes in pieces:
        where = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
        if r == me == 0:
            full[where] = local.cpu()
        elif me == 0:  # rank 0 may hold only a metadata placeholder of `t` (another pipeline stage's)
            buf = torch.empty(sizes, dtype=t.dtype, device=_receive_device(local))
            collectives.recv(buf, r)
            full[where] = buf.cpu()
        elif r == me:
            collectives.send(local.contiguous(), 0)
    return full


def _receive_device(local: torch.Tensor) -> torch.device:
    """Where a piece sent by its owner can be received: the local's device, or the backend's for a placeholder."""
    if local.device.type != "meta":
        return local.device
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a transformers-style size string ("5GB", "500MB", "2GiB")."""
    if isinstance(size, int):
        return size
    from transformers.utils.hub import convert_file_size_to_int
    return convert_file_size_to_int(size)


def plan_files(tensors: list, max_bytes: int) -> list:
    """Split the tensors, in order, into files of at most `max_bytes` (a larger tensor gets a file of its own):
    [(file name, [(names, tensor)])]. One file is `model.safetensors`; several follow transformers' naming."""
    groups: list = []
    size = 0
    for names, t in tensors:
        nbytes = t.numel() * t.element_size()
        if not groups or (size + nbytes > max_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append((names, t))
        size += nbytes
    if len(groups) <= 1:
        return [(WEIGHTS_NAME, groups[0] if groups else [])]
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def _architecture(model: nn.Module) -> str:
    """The transformers class a wrapped model was made from (hsdp mixes a class into the model's own)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    return type(model).__name__


def export_hf(model: nn.Module, path: str | os.PathLike, *, overwrite: bool = True,
              max_shard_size: int | str = "50GB", state_dict: dict | None = None, merge: bool = False) -> None:
    """Write a full Hugging Face checkpoint folder from a (possibly sharded) model; every rank calls it.

    The folder appears atomically (temporary folder, then rename); `from_pretrained(path)` loads it.
    `merge=True` writes into `path` instead, keeping the files that are not the model's (Trainer's
    output_dir with its checkpoint-N folders): a previous save's weights are replaced, each file
    appears whole, but not the set of them at once.
    Weights past `max_shard_size` (bytes, or "5GB" style) are split over several files with an index.
    `state_dict`: the whole model's tensors by name, the same keys in the same order on every rank, when
    `model` holds only part of them (a pipeline stage: its `Pipeline.state_dict()`); `model` then gives the
    config and the class.
    """
    path = Path(path).absolute()
    me = comm.rank()
    tensors = _model_tensors(model) if state_dict is None else [([k], t) for k, t in state_dict.items()]
    files = plan_files(tensors, parse_size(max_shard_size))
    tmp, problems = None, []
    if me == 0:
        try:
            tmp = make_tmp(path, overwrite, marker=None if merge else "config.json")
            config = getattr(model, "config", None)
            if config is None or not hasattr(config, "save_pretrained"):
                raise CheckpointError("export_hf needs a transformers model (with .config)")
            config = copy.copy(config)
            config.architectures = [_architecture(model)]
            config.save_pretrained(tmp)
            gen = getattr(model, "generation_config", None)
            if gen is not None and getattr(model, "can_generate", lambda: False)():
                gen.save_pretrained(tmp)
        except Exception as e:
            problems.append(f"rank 0 could not prepare {path}: {e!r}")
    problems = comm.broadcast_object(problems)
    if problems:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError("\n  ".join(problems))

    writer = None
    for fname, group in files:
        if me == 0 and not problems:
            try:
                writer = SafetensorsWriter(tmp / fname, [(names[0], t.dtype, tuple(t.shape)) for names, t in group],
                                           {"format": "pt"})
            except Exception as e:
                problems.append(f"rank 0 could not create {tmp / fname}: {e!r}")
        for names, t in group:
            full = gather_to_rank0(t)  # every rank takes part, even after a local failure, so no one hangs
            if writer is not None and not problems:
                try:
                    writer.write(full)
                except Exception as e:
                    problems.append(f"rank 0 could not write {names[0]!r}: {e!r}")
            del full
        if writer is not None and fname != files[-1][0] and not problems:
            try:
                writer.close()
            except Exception as e:
                problems.append(f"rank 0 could not finish {tmp / fname}: {e!r}")
    if me == 0:
        def finish():
            writer.close()
            if len(files) > 1:
                index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for _, t in tensors)},
                         "weight_map": {names[0]: fname for fname, group in files for names, _ in group}}
                write_json(tmp / INDEX_JSON, index)
        put = (lambda a, b: merge_into(a, b, ["model.safetensors", "model-*-of-*.safetensors", INDEX_JSON])) \
            if merge else None
        problems = publish(tmp, path, problems, finish, put)
        if problems and writer is not None:
            writer.abort()
    problems = comm.broadcast_object(problems)
    if problems:
        raise CheckpointError(f"export to {path} failed:\n  " + "\n  ".join(problems))


def _hf_files(folder: Path) -> dict:
    """tensor name -> safetensors file name, from the shard index json or the files' headers."""
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"no Hugging Face checkpoint at {folder}")
    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        return hf_weight_map(folder, index[0])
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFoundError(f"no *.safetensors in {folder}")
    from safetensors import safe_open
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    out[k] = f.name
        except Exception as e:
            raise CheckpointError(f"{f} cannot be opened as safetensors (corrupt or truncated): {e}") from None
    return out


@torch.no_grad()
def load_hf(model: nn.Module, path: str | os.PathLike, *, strict: bool = True,
            held_elsewhere: frozenset | set = frozenset()) -> nn.Module:
    """Fill a (possibly sharded) model from a Hugging Face folder; each rank reads only its slices.

    Tensors are cast to the model's dtypes (as from_pretrained does with torch_dtype). `strict`:
    a model tensor missing from the folder, or a folder tensor the model lacks, is an error;
    `held_elsewhere` names the folder's tensors that other ranks hold (a pipeline's other stages).
    Needs no communication, so ranks may call it independently.
    """
    folder = Path(path).absolute()
    where = _hf_files(folder)
    tensors = _model_tensors(model)
    known = {n for names, _ in tensors for n in names} | set(held_elsewhere)
    missing = [names[0] for names, _ in tensors if not any(n in where for n in names)]
    unexpected = [k for k in where if k not in known]
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(f"{folder} does not match the model: missing {missing[:8]}, "
                                      f"unexpected {unexpected[:8]}")
    with ExitStack() as stack:
        reader = SliceReader(folder, stack)
        todo, problems = [], []
        for names, t in tensors:  # check every shape before touching the model
            name = next((n for n in names if n in where), None)
            if name is None:
                continue
            stored = tuple(reader.handle(where[name]).get_slice(name).get_shape())
            if stored != tuple(t.shape):
                problems.append(f"{name!r}: shape {stored} in {folder / where[name]}, {tuple(t.shape)} in the model")
            todo.append((name, t, stored))
        if problems:
            raise CheckpointMismatchError(f"{folder} does not match the model:\n  " + "\n  ".join(problems))
        for name, t, stored in todo:
            reg = region(t)
            if reg is None:
                continue
            if not stored:
                data = reader.read(where[name], name)
            else:
                ov = overlap((0,) * len(stored), stored, *reg)
                if ov is None:
                    continue  # this rank holds an empty piece
                data = reader.read(where[name], name, ov[0])
            local = local_of(t)
            local.copy_(data.to(dtype=local.dtype))
    return model
