"""`load(state, path)`: fill a state in place under its own layouts, reading only the slices needed.

Every rank computes the global region its tensors hold (from their current layouts, which need not
match the saved ones), reads the overlapping parts of the stored pieces with safetensors'
`get_slice` (memory-mapped: only those bytes are read), and checks them. A piece read whole is
checksummed by the reader; pieces that no rank read whole are checksummed by one rank each. Values
are copied into the state only after every rank found everything intact, so a corrupt checkpoint
raises on every rank and leaves the state untouched.
"""
from __future__ import annotations

import math
import os
import warnings
import zlib
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch

from ..dtensor.dtensor import DTensor
from . import comm
from .dcp import check_leaves, dcp_entries, is_dcp_folder, read_dcp
from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from .flatten import decode_value, flatten
from .format import INDEX_NAME, dtype_from_name, dtype_name, member_file, read_index, tensor_bytes
from .pieces import covers_whole, local_of, overlap, region


class LoadResult(NamedTuple):
    missing_keys: list
    unexpected_keys: list


def resolve_path(path: str | os.PathLike) -> Path:
    """`path`, or the previous checkpoint a crash between the two renames of a save left beside it."""
    p = Path(path).absolute()
    if (p / INDEX_NAME).is_file():
        return p
    olds = sorted(p.parent.glob(f".{p.name}.old-*"), key=lambda q: q.stat().st_mtime)
    for old in reversed(olds):
        if (old / INDEX_NAME).is_file():
            warnings.warn(f"{p} is missing (a save was interrupted while replacing it); loading the previous "
                          f"checkpoint from {old}")
            return old
    return p


class SliceReader:
    """Open safetensors files lazily (memory-mapped) and turn read failures into errors naming the file."""

    def __init__(self, folder: Path, stack: ExitStack):
        self.folder = folder
        self.stack = stack
        self.handles: dict = {}

    def handle(self, fname: str):
        h = self.handles.get(fname)
        if h is None:
            from safetensors import safe_open
            path = member_file(self.folder, fname, f"{self.folder}: reading {fname!r}", follow_links=True)
            try:
                h = self.stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as e:
                raise CheckpointCorruptError(f"{self.folder / fname} cannot be opened as safetensors "
                                             f"(corrupt or truncated): {e}") from None
            self.handles[fname] = h
        return h

    def read(self, fname: str, name: str, slices=None) -> torch.Tensor:
        """The stored tensor `name`, or the part `slices` of it."""
        h = self.handle(fname)
        try:
            if slices is None:
                return h.get_tensor(name)
            return h.get_slice(name)[slices]
        except Exception as e:
            raise CheckpointCorruptError(f"{self.folder / fname}: cannot read {name!r}: {e}") from None


def check_crc(piece: dict, data: torch.Tensor, key: str, folder: Path) -> str | None:
    if zlib.crc32(tensor_bytes(data)) != piece["crc32"]:
        return (f"checksum mismatch for {key!r} (piece at offsets {piece['offsets']}) in "
                f"{folder / piece['file']}: the file is corrupt")
    return None


def load(state: dict, path: str | os.PathLike, *, strict: bool = True, verify: bool = True) -> LoadResult:
    """Fill `state` (same structure as saved) in place from the checkpoint folder `path`.

    DTensors keep their current layout, mesh and rank count, whatever the saved ones were; plain
    tensors are filled whole; Python values are replaced in their dict/list. Every rank must call
    it. `strict`: missing or extra keys are an error (else they are skipped and returned). `verify`:
    every stored piece that is read is checked against its CRC32. Errors: CheckpointNotFoundError,
    CheckpointMismatchError (keys, shapes, dtypes), CheckpointCorruptError (truncated, unreadable or
    checksum), each naming the key and file.

    `path` may also be a torch.distributed.checkpoint (DCP) folder, as FSDP2 or torchtitan save one
    (`dcp.save(model.state_dict(), ...)`: load `model.state_dict()` from it): read with DCP's own
    reader into the current layouts, with the same key, shape and dtype checks (DCP stores no
    checksums, so `verify` has nothing to check there).
    """
    folder = resolve_path(path)
    if is_dcp_folder(folder) and not (folder / INDEX_NAME).is_file():
        return _load_dcp(state, folder, strict)
    index = read_index(folder)
    leaves = flatten(state)
    stored_t, stored_v = index["tensors"], index["values"]
    missing, unexpected = _match_keys(leaves, list(stored_t) + list(stored_v), folder, strict)
    _check_leaves(leaves, stored_t, stored_v, folder)
    _check_files(index, folder)

    tensor_leaves = [leaf for leaf in leaves if leaf.is_tensor and leaf.key in stored_t]
    buffers: dict = {}
    errors: list = []
    verified: set = set()
    with ExitStack() as stack:
        reader = SliceReader(folder, stack)
        for leaf in tensor_leaves:
            entry = stored_t[leaf.key]
            reg = region(leaf.value)
            if reg is None:
                continue
            try:
                buffers[leaf.key] = _read_region(reader, leaf.key, entry, reg, verify, verified, errors, folder)
            except CheckpointError as e:
                errors.append(str(e))
            except Exception as e:  # report, never leave the other ranks waiting below
                errors.append(f"{leaf.key!r}: reading from {folder} failed: {e!r}")
        if verify:
            _verify_rest(reader, tensor_leaves, stored_t, verified, errors, folder)
    comm.raise_first(comm.all_gather_object(errors), CheckpointCorruptError)
    values = {leaf.key: decode_value(stored_v[leaf.key]) for leaf in leaves
              if not leaf.is_tensor and leaf.key in stored_v}
    _apply(leaves, buffers, values)
    return LoadResult(missing, unexpected)


def _load_dcp(state: dict, folder: Path, strict: bool) -> LoadResult:
    """`load` from a torch.distributed.checkpoint folder (see dcp.py): same checks, then DCP's reader."""
    leaves = flatten(state)
    entries = dcp_entries(folder)
    missing, unexpected = _match_keys(leaves, list(entries), folder, strict)
    check_leaves(leaves, entries, folder)
    buffers, values, errors = {}, {}, []
    try:
        buffers, values = read_dcp(folder, leaves, entries)
    except CheckpointError as e:
        errors.append(str(e))
    except Exception as e:  # report, never leave the other ranks waiting below
        errors.append(f"reading the DCP checkpoint {folder} failed: {e!r}")
    comm.raise_first(comm.all_gather_object(errors), CheckpointCorruptError)
    _apply(leaves, buffers, values)
    return LoadResult(missing, unexpected)


def _match_keys(leaves: list, stored: list, folder: Path, strict: bool) -> tuple[list, list]:
    """(missing, unexpected) keys; with `strict` either is an error (decided from the index: on every rank)."""
    have = {leaf.key for leaf in leaves}
    stored_set = set(stored)
    missing = [leaf.key for leaf in leaves if leaf.key not in stored_set]
    unexpected = [k for k in stored if k not in have]
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(_key_message(folder, missing, unexpected))
    return missing, unexpected


def _apply(leaves: list, buffers: dict, values: dict) -> None:
    """Copy the checked buffers into the state's tensors and put the values into their containers."""
    with torch.no_grad():
        for leaf in leaves:
            if leaf.is_tensor and leaf.key in buffers:
                _fill(leaf.value, buffers.pop(leaf.key))
    for leaf in leaves:
        if not leaf.is_tensor and leaf.key in values:
            value = values[leaf.key]
            if isinstance(leaf.container, tuple):
                if leaf.container[leaf.slot] != value:
                    raise CheckpointMismatchError(f"{leaf.key!r} sits in a tuple and cannot be replaced in place "
                                                  f"(saved {value!r}, found {leaf.container[leaf.slot]!r})")
                continue
            leaf.container[leaf.slot] = value


def _key_message(folder: Path, missing: list, unexpected: list) -> str:
    parts = [f"checkpoint {folder} does not match the state:"]
    for what, keys in (("missing from the checkpoint", missing), ("in the checkpoint but not in the state",
                                                                   unexpected)):
        if keys:
            shown = ", ".join(repr(k) for k in keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
            parts.append(f"{len(keys)} key(s) {what}: {shown}")
    if any(".state." in k for k in unexpected) and not any(".state." in k for k in missing):
        parts.append("(a fresh optimizer has no state yet: call hyper_parallel.checkpoint.init_optimizer_state(opt) "
                     "before opt.state_dict())")
    parts.append("pass strict=False to load the keys both have")
    return "\n  ".join(parts)


def _check_leaves(leaves, stored_t: dict, stored_v: dict, folder: Path) -> None:
    problems = []
    for leaf in leaves:
        if leaf.is_tensor and leaf.key in stored_v:
            problems.append(f"{leaf.key!r}: the checkpoint holds a Python value, the state a tensor")
        elif not leaf.is_tensor and leaf.key in stored_t:
            problems.append(f"{leaf.key!r}: the checkpoint holds a tensor, the state a {type(leaf.value).__name__}")
        elif leaf.is_tensor and leaf.key in stored_t:
            entry = stored_t[leaf.key]
            shape = tuple(leaf.value.shape)
            if tuple(entry["shape"]) != shape:
                problems.append(f"{leaf.key!r}: shape mismatch, checkpoint {tuple(entry['shape'])} vs state {shape}")
            dtype_from_name(entry["dtype"])
            if entry["dtype"] != dtype_name(leaf.value.dtype):
                problems.append(f"{leaf.key!r}: dtype mismatch, checkpoint {entry['dtype']} vs state "
                                f"{dtype_name(leaf.value.dtype)}")
    if problems:
        raise CheckpointMismatchError(f"checkpoint {folder} does not match the state:\n  " + "\n  ".join(problems))


def _check_files(index: dict, folder: Path) -> None:
    """Every rank checks every file, so all ranks agree and raise together."""
    problems = []
    for fname, info in index["files"].items():
        f = folder / fname
        if not f.is_file():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != info["bytes"]:
            size = f.stat().st_size
            what = "truncated" if size < info["bytes"] else "has extra bytes"
            problems.append(f"{f} is {what}: {size} bytes, the index records {info['bytes']}")
    if problems:
        raise CheckpointCorruptError("\n  ".join(problems))


def _read_region(reader: SliceReader, key: str, entry: dict, reg, verify: bool, verified: set, errors: list,
                 folder: Path) -> torch.Tensor:
    r_off, r_size = reg
    dtype = dtype_from_name(entry["dtype"])
    buf = torch.empty(r_size, dtype=dtype)
    covered = 0
    for i, piece in enumerate(entry["pieces"]):
        ov = overlap(piece["offsets"], piece["sizes"], r_off, r_size)
        if ov is None:
            continue
        p_sl, r_sl = ov
        if covers_whole(p_sl, piece["sizes"]):
            data = reader.read(piece["file"], piece["name"])
            if tuple(data.shape) != tuple(piece["sizes"]) or data.dtype != dtype:
                raise CheckpointCorruptError(f"{key!r}: {folder / piece['file']} stores {piece['name']!r} as "
                                             f"{data.dtype} {tuple(data.shape)}, the index says {dtype} "
                                             f"{tuple(piece['sizes'])}")
            if verify:
                err = check_crc(piece, data, key, folder)
                if err:
                    errors.append(err)
                verified.add((key, i))
        else:
            data = reader.read(piece["file"], piece["name"], p_sl)
        if list(piece["offsets"]) == list(r_off) and list(piece["sizes"]) == list(r_size):
            buf = data  # the region is exactly this piece: keep the read tensor, skip a copy
        elif buf.ndim:
            buf[r_sl] = data
        else:
            buf.copy_(data)
        covered += math.prod(s.stop - s.start for s in r_sl)
    if covered != math.prod(r_size):
        raise CheckpointCorruptError(f"{key!r}: the pieces listed in {folder / INDEX_NAME} cover {covered} of the "
                                     f"{math.prod(r_size)} elements this rank needs")
    return buf


def _verify_rest(reader: SliceReader, tensor_leaves: list, stored_t: dict, verified: set, errors: list,
                 folder: Path) -> None:
    """Checksum every piece no rank read whole, each by one rank (round robin over the pieces)."""
    done = set()
    for part in comm.all_gather_object(sorted(verified)):
        done.update(tuple(x) for x in part)
    me, world = comm.rank(), comm.world()
    g = 0
    for leaf in tensor_leaves:
        for i, piece in enumerate(stored_t[leaf.key]["pieces"]):
            if (leaf.key, i) not in done and g % world == me:
                try:
                    err = check_crc(piece, reader.read(piece["file"], piece["name"]), leaf.key, folder)
                except CheckpointError as e:
                    err = str(e)
                if err:
                    errors.append(err)
            if (leaf.key, i) not in done:
                g += 1


def _fill(target: torch.Tensor, buf: torch.Tensor) -> None:
    local = local_of(target)
    if isinstance(target, DTensor):
        layout = target.dist_layout
        coord = layout.mesh.coordinate
        if any(op == "sum" and coord[a] != 0 for a, op in enumerate(layout.partial)):
            buf = torch.zeros_like(buf)  # Partial(sum): the value sits on coordinate 0, zeros elsewhere
    if local.is_meta:
        raise CheckpointError("cannot load into a tensor on the meta device: materialise it first "
                              "(hyper_parallel.init_parameters)")
    local.copy_(buf)
