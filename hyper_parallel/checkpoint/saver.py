"""`save(state, path)`: every rank writes the pieces it owns, rank 0 writes the index, then one rename.

Protocol (all ranks call it with the same state structure and path):
1. resolve Partial DTensors (a collective per tensor, in the same order everywhere), and pick
   the one writer of each piece among the ranks holding it (`plan_writes`, no communication);
2. rank 0 creates `.<name>.tmp-<id>` next to `path` and tells the others its name;
3. each rank streams its pieces into `rank<r>.safetensors` there (CRC32 per piece), fsync;
4. the piece lists are gathered; rank 0 writes `index.json`, fsyncs, and swaps the folder into
   place (an atomic exchange where the OS has one, else two renames that `load` can recover from);
5. everyone learns the outcome, so a failure on any rank raises on all ranks.
A crash before step 4 leaves only a stale temporary folder: the previous checkpoint is untouched.
"""
from __future__ import annotations

import ctypes
import math
import os
import shutil
import uuid
from pathlib import Path

import torch

from ..dtensor.dtensor import DTensor
from . import comm
from .dcp import METADATA_NAME, write_dcp
from .errors import CheckpointError
from .flatten import encode_value, flatten
from .format import (FORMAT_NAME, FORMAT_VERSION, INDEX_NAME, SafetensorsWriter, dtype_name, write_json)
from .pieces import layout_info, local_of, piece_holders


def piece_name(key: str, offsets) -> str:
    return f"{key}@{','.join(map(str, offsets))}"


FORMATS = ("hyper_parallel", "dcp")


def save(state: dict, path: str | os.PathLike, *, overwrite: bool = True, format: str = "hyper_parallel") -> None:
    """Save a (nested) dict of DTensors, tensors and Python values to the folder `path`, atomically.

    Every rank must call it. DTensors may have any layout (Partial is reduced first); each rank
    writes only pieces it holds, and replicated data once (one holder per piece, balancing bytes
    across ranks). Plain tensors are assumed equal on all ranks; Python values come from rank 0. An
    existing checkpoint at `path` is replaced only once the new one is complete.
    `format="dcp"`: a torch.distributed.checkpoint folder, written by DCP's own `FileSystemWriter`,
    which `dcp.load` reads into FSDP2 / torch DTensors (keys: the state flattened as DCP flattens it).
    """
    if format not in FORMATS:
        raise ValueError(f"save: unknown format {format!r}; use one of {FORMATS}")
    path = Path(path).absolute()
    me = comm.rank()
    leaves = flatten(state)
    values: dict = {}
    raw_values: dict = {}
    tensors: list = []
    with torch.no_grad():
        for leaf in leaves:
            if not leaf.is_tensor:
                values[leaf.key] = encode_value(leaf.value, leaf.key)  # checks it is a value we store
                raw_values[leaf.key] = leaf.value
                continue
            t = leaf.value
            dtype_name(t.dtype)
            if isinstance(t, DTensor) and not t.dist_layout.mesh.distributed and (
                    t.dist_layout.sharded_axes or t.dist_layout.has_partial):
                raise CheckpointError(f"{leaf.key!r} is split over {t.dist_layout} but torch.distributed is not "
                                      f"running, so this process holds only one piece: saving it needs "
                                      f"torch.distributed with every rank of its mesh")
            if isinstance(t, DTensor) and t.dist_layout.has_partial:
                t = t.redistribute(t.dist_layout.without_partial())
            tensors.append((leaf, t))

    tmp, err = None, None
    if me == 0:
        try:
            tmp = str(make_tmp(path, overwrite, marker=METADATA_NAME if format == "dcp" else INDEX_NAME))
        except (OSError, CheckpointError) as e:
            err = str(e)
    tmp, err = comm.broadcast_object((tmp, err))
    if err:
        raise CheckpointError(err)
    tmp = Path(tmp)
    if format == "dcp":
        return _save_dcp(tensors, raw_values, tmp, path)

    mine = [(leaf.key, offsets, sizes, local_of(t)) for leaf, t, offsets, sizes in plan_writes(tensors)]
    fname = f"rank{me:05d}.safetensors"
    meta, file_info, errors = [], None, []
    if mine:
        writer = None
        try:
            writer = SafetensorsWriter(tmp / fname, [(piece_name(k, o), loc.dtype, s) for k, o, s, loc in mine],
                                       {"format": "pt", "writer": FORMAT_NAME, "rank": me})
            for key, offsets, sizes, local in mine:
                crc = writer.write(local)
                meta.append({"key": key, "file": fname, "name": piece_name(key, offsets), "offsets": list(offsets),
                             "sizes": list(sizes), "crc32": crc})
            writer.close()
            file_info = (fname, {"bytes": writer.total_bytes, "rank": me})
        except Exception as e:  # report on every rank instead of leaving the others waiting
            if writer is not None:
                writer.abort()
            errors.append(f"rank {me} could not write {tmp / fname}: {e!r}")
    gathered = comm.all_gather_object((meta, file_info, errors))
    _finish(tmp, path, [e for _, _, errs in gathered for e in errs],
            lambda: write_json(tmp / INDEX_NAME, _build_index(tensors, values, gathered)))


def _save_dcp(tensors: list, values: dict, tmp: Path, path: Path) -> None:
    """The DCP flavour of `save`: DCP writes into `tmp` (its `.metadata` last), then the same publishing."""
    errors = []
    try:
        write_dcp(tensors, values, tmp)
    except Exception as e:  # DCP raises on every rank when any rank failed; report it like ours
        errors.append(f"rank {comm.rank()} could not write the DCP checkpoint in {tmp}: {e!r}")
    _finish(tmp, path, [e for errs in comm.all_gather_object(errors) for e in errs], lambda: None)


def _finish(tmp: Path, path: Path, problems: list, finish) -> None:
    """Rank 0 publishes `tmp` at `path` unless a rank reported a problem; every rank learns the outcome."""
    outcome = None
    if comm.rank() == 0:
        outcome = publish(tmp, path, problems, finish) or None
    outcome = comm.broadcast_object(outcome)
    if outcome:
        raise CheckpointError(f"saving {path} failed; the previous checkpoint (if any) is untouched:\n  "
                              + "\n  ".join(outcome))


def plan_writes(tensors: list) -> list:
    """This rank's share of the pieces: [(leaf, tensor, offsets, sizes)].

    Each piece is written once, by one of the ranks holding a copy: the least loaded so far (bytes),
    lowest rank on ties. Every rank computes the same assignment from the layouts and shapes alone
    (no communication), and replicated data spreads over the ranks instead of piling on rank 0.
    """
    me, world = comm.rank(), comm.world()
    load = [0] * world
    out = []
    for leaf, t in tensors:
        shape = tuple(t.shape)
        if isinstance(t, DTensor):
            holders = piece_holders(t.dist_layout, shape)
        elif len(shape) and 0 in shape:
            holders = []
        else:
            holders = [((0,) * len(shape), shape, list(range(world)))]
        size = t.element_size()
        for offsets, sizes, ranks in holders:
            ranks = [r for r in ranks if r < world] or [0]
            writer = min(ranks, key=lambda r: (load[r], r))
            load[writer] += size * math.prod(sizes)
            if writer == me:
                out.append((leaf, t, offsets, sizes))
    return out


def _build_index(tensors: list, values: dict, gathered: list) -> dict:
    entries = {}
    for leaf, t in tensors:
        entries[leaf.key] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "layout": layout_info(leaf.value),
                             "pieces": []}
    files = {}
    for meta, file_info, _ in gathered:
        if file_info:
            files[file_info[0]] = file_info[1]
        for m in meta:
            entry = entries.get(m.pop("key"))
            if entry is None:
                raise CheckpointError(f"a rank wrote piece {m['name']} of a key rank 0 does not have: every rank "
                                      f"must pass the same state structure")
            entry["pieces"].append(m)
    for key, entry in entries.items():
        total = 1
        for n in entry["shape"]:
            total *= n
        stored = 0
        for p in entry["pieces"]:
            n = 1
            for s in p["sizes"]:
                n *= s
            stored += n
        if stored != total:
            raise CheckpointError(f"{key}: the ranks' pieces hold {stored} of its {total} elements; the layouts "
                                  f"of this tensor differ between ranks")
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "world_size": comm.world(), "files": files,
            "tensors": entries, "values": values}


def make_tmp(path: Path, overwrite: bool, marker: str | None = INDEX_NAME) -> Path:
    """A fresh temporary folder beside `path`; refuses to later replace a folder that is not ours (one without
    `marker`). `marker=None`: the files will be merged into `path` (see `merge_into`), nothing is replaced whole."""
    if path.exists() and marker is None:
        if not path.is_dir():
            raise CheckpointError(f"{path} exists and is not a folder")
    elif path.exists():
        if not overwrite:
            raise CheckpointError(f"{path} exists and overwrite=False")
        if path.is_file() or (any(path.iterdir()) and not (path / marker).is_file()):
            raise CheckpointError(f"refusing to replace {path}: it is not a folder this function wrote "
                                  f"(no {marker} in it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def publish(tmp: Path, path: Path, problems: list, finish, put=None) -> list:
    """Rank 0, after every rank wrote into `tmp`: `finish()` (the last file), then swap `tmp` into place
    (or `put(tmp, path)`). On any problem `tmp` is removed and the previous checkpoint stays. Returns the
    problems."""
    try:
        if not problems:
            finish()
            fsync_dir(tmp)
            (put or commit)(tmp, path)
            remove_stale(path)
    except Exception as e:
        problems.append(f"rank 0 could not finish {path}: {e!r}")
    if problems:
        shutil.rmtree(tmp, ignore_errors=True)
    return problems


def commit(tmp: Path, path: Path) -> None:
    """Put the finished folder at `path`; the old one stays readable until the new one is in place."""
    if not path.exists():
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp)  # now holds the previous checkpoint
    else:
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(path, old)  # a crash right here leaves `old`, which load() falls back to
        os.rename(tmp, path)
        shutil.rmtree(old)
    fsync_dir(path.parent)


def merge_into(tmp: Path, path: Path, stale: list[str]) -> None:
    """Move the files of the finished folder `tmp` into the folder `path`, keeping `path`'s other files (as
    transformers' save_pretrained writes into a folder): first the files matching a `stale` pattern go
    (a previous save's weight shards), then each new file is renamed in. Each file appears whole, but
    the set of files is not replaced atomically."""
    path.mkdir(parents=True, exist_ok=True)
    for pattern in stale:
        for old in path.glob(pattern):
            if old.is_file():
                old.unlink()
    for f in sorted(tmp.iterdir()):
        os.replace(f, path / f.name)
    tmp.rmdir()
    fsync_dir(path)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def remove_stale(path: Path) -> None:
    """Temporary folders left by crashed saves of this checkpoint (safe once a new one is in place)."""
    for pattern in (f".{path.name}.tmp-*", f".{path.name}.old-*"):
        for p in path.parent.glob(pattern):
            shutil.rmtree(p, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
