"""`torch.distributed.checkpoint` (DCP) folders: read one into any layout of ours, write one DCP loads.

A DCP folder (as FSDP2 and torchtitan write it) is a pickled `.metadata` (per key: global size, dtype
and the chunks stored, with where each chunk lies in the `*.distcp` files) beside the data files.
Both directions run on DCP's own machinery, its `FileSystemReader` / `FileSystemWriter` and default
planners; what is ours is how a rank's piece of one of our DTensors is presented to them:
`_Piece` follows DCP's `_Checkpointable` protocol (the one torch's DTensor implements): the chunk of
the global tensor the rank holds, as (offsets, local tensor).

Keys: a state is flattened as DCP flattens it (nested dicts joined by "."), so
`save({"model": model.state_dict()}, path, format="dcp")` is what `dcp.load({"model":
fsdp_model.state_dict()}, checkpoint_id=path)` reads, and a `dcp.save(model.state_dict(), ...)`
(FSDP2, torchtitan's model-only checkpoints) is read by `load(model.state_dict(), path)`.

Data is not code: `.metadata` is unpickled with only DCP's metadata classes allowed, and stored Python
values with `torch.load(weights_only=True)` (DCP's own loader would unpickle anything).
"""
from __future__ import annotations

import io
import math
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from . import comm
from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from .pieces import local_of, overlap, region

METADATA_NAME = ".metadata"


def is_dcp_folder(folder: Path) -> bool:
    return (folder / METADATA_NAME).is_file()


class _Piece:
    """This rank's chunk of a global tensor, as DCP's planners see a DTensor (its `_Checkpointable` protocol)."""

    def __init__(self, local: torch.Tensor, offsets, shape):
        self.local = local
        self.offsets = torch.Size(offsets)
        self.shape = torch.Size(shape)

    def size(self) -> torch.Size:  # the global size: what DCP checks against the stored one
        return self.shape

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.shape)

    def __create_chunk_list__(self) -> list:
        return [self._chunk()]

    def __create_write_items__(self, fqn: str, obj) -> list:
        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._chunk(), size=self.shape,
                                                      properties=TensorProperties.create_from_tensor(self.local)))]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self.local


def _lookup(state: dict, index: MetadataIndex, default):
    obj = state[index.fqn]
    return obj.local if isinstance(obj, _Piece) else default(index)


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner (dedup of replicated chunks, metadata); our keys are already flat."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)

    def lookup_object(self, index: MetadataIndex):
        return _lookup(self.state_dict, index, super().lookup_object)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner (resharding reads), filling our region buffers; values read as data only."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        # DCP's set-up materialises meta tensors and drops objects it does not know (our pieces): run it on
        # nothing, then hand it the state (the pieces are allocated already; values are placeholders)
        super().set_up_planner({}, metadata, is_coordinator)
        self.original_state_dict = self.state_dict = state_dict

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index, super().lookup_tensor)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            self.state_dict[key] = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointCorruptError(f"{key!r}: the stored value is not plain data (torch.load with "
                                         f"weights_only=True refused it): {e}") from None


# ---- .metadata: unpickled with DCP's metadata classes only -------------------------------------------
_ALLOWED = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == _METADATA_MODULE and isinstance(getattr(dcp.metadata, name, None), type):
            return getattr(dcp.metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a class DCP metadata holds")


class SafeFileSystemReader(FileSystemReader):
    """DCP's `FileSystemReader`, reading `.metadata` without running code a checkpoint could smuggle in."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / METADATA_NAME
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            raise CheckpointCorruptError(f"{path} is not a torch.distributed.checkpoint metadata file (or it is "
                                         f"corrupt): {e}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointCorruptError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---- load -----------------------------------------------------------------------------------------------
def check_leaves(leaves: list, entries: dict, folder: Path) -> None:
    """Raise CheckpointMismatchError naming each leaf whose kind, shape or dtype differs from the stored entry;
    decided from the metadata alone, so every rank raises together."""
    problems = []
    for leaf in leaves:
        md = entries.get(leaf.key)
        if md is None:
            continue
        if isinstance(md, BytesStorageMetadata):
            if leaf.is_tensor:
                problems.append(f"{leaf.key!r}: the checkpoint holds a Python value, the state a tensor")
            continue
        if not leaf.is_tensor:
            problems.append(f"{leaf.key!r}: the checkpoint holds a tensor, the state a {type(leaf.value).__name__}")
            continue
        shape, dtype = tuple(leaf.value.shape), leaf.value.dtype
        if tuple(md.size) != shape:
            problems.append(f"{leaf.key!r}: shape mismatch, checkpoint {tuple(md.size)} vs state {shape}")
        if md.properties.dtype != dtype:
            problems.append(f"{leaf.key!r}: dtype mismatch, checkpoint {md.properties.dtype} vs state {dtype}")
    if problems:
        raise CheckpointMismatchError(f"checkpoint {folder} does not match the state:\n  " + "\n  ".join(problems))


def read_dcp(folder: Path, leaves: list, entries: dict) -> tuple[dict, dict]:
    """(buffers {key: this rank's region of the tensor}, values {key: Python value}) for the leaves stored in
    the DCP checkpoint (`entries`, from `dcp_entries`), read with DCP's reader and load planner. No
    collective: the caller exchanges failures so that every rank raises."""
    state: dict = {}
    regions: dict = {}
    for leaf in leaves:
        md = entries.get(leaf.key)
        if md is None:
            continue
        if isinstance(md, BytesStorageMetadata):
            state[leaf.key] = None  # filled by the planner's load_bytes
            continue
        reg = region(leaf.value)
        if reg is None:
            continue
        offsets, sizes = reg
        covered = sum(_overlap_size(c, offsets, sizes) for c in md.chunks)
        if covered != math.prod(sizes):
            raise CheckpointCorruptError(f"{leaf.key!r}: the chunks listed in {folder / METADATA_NAME} cover "
                                         f"{covered} of the {math.prod(sizes)} elements this rank needs")
        regions[leaf.key] = _Piece(torch.empty(sizes, dtype=leaf.value.dtype), offsets, leaf.value.shape)
    state.update(regions)
    _run(dcp.load, state, storage_reader=SafeFileSystemReader(str(folder)), planner=_LoadPlanner(), no_dist=True)
    buffers = {k: piece.local for k, piece in regions.items()}
    values = {k: v for k, v in state.items() if k not in regions}
    return buffers, values


def _overlap_size(chunk: ChunkStorageMetadata, offsets, sizes) -> int:
    ov = overlap(chunk.offsets, chunk.sizes, offsets, sizes)
    return 0 if ov is None else math.prod(s.stop - s.start for s in ov[1])


def dcp_entries(folder: Path) -> dict:
    """key -> TensorStorageMetadata | BytesStorageMetadata of a DCP folder (every rank reads the same)."""
    metadata = SafeFileSystemReader(str(folder)).read_metadata()
    entries = metadata.state_dict_metadata
    for key, md in entries.items():
        if not isinstance(md, (TensorStorageMetadata, BytesStorageMetadata)):
            raise CheckpointCorruptError(f"{folder / METADATA_NAME}: {key!r} is described by a "
                                         f"{type(md).__name__}, not tensor or bytes metadata")
    return entries


# ---- save -----------------------------------------------------------------------------------------------
def write_dcp(tensors: list, values: dict, folder: Path) -> None:
    """Write `tensors` ([(leaf, tensor without Partial)]) and `values` into `folder` as DCP does, every rank
    presenting its own chunk of each tensor (DCP keeps one copy of replicated chunks). A collective."""
    state: dict = {}
    for leaf, t in tensors:
        reg = region(t)
        if reg is not None:
            state[leaf.key] = _Piece(local_of(t), reg[0], t.shape)
    state.update(values)
    writer = dcp.FileSystemWriter(str(folder), single_file_per_rank=True, sync_files=True)
    _run(dcp.save, state, storage_writer=writer, planner=_SavePlanner(), no_dist=not comm.distributed())


def _run(fn, *args, **kwargs):
    """A DCP call, its failures raised as our errors: DCP wraps them in a CheckpointException, which is a
    BaseException (an `except Exception` would let it through and leave the other ranks waiting)."""
    try:
        with warnings.catch_warnings():  # DCP warns on every call without collectives; ours never use them
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            return fn(*args, **kwargs)
    except CheckpointException as e:
        causes = [exc for exc, _ in e.failures.values()]
        ours = [c for c in causes if isinstance(c, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise CheckpointError("; ".join(f"rank {r}: {exc!r}" for r, (exc, _) in e.failures.items())) from None
