"""On-disk format: a streaming safetensors writer, dtype names, and the JSON index.

The safetensors layout is: 8-byte little-endian header length, a JSON header (name -> dtype, shape,
data_offsets), then the raw bytes. Writing it ourselves lets a rank stream pieces straight from its
shards (no second copy of the state) and checksum exactly the bytes that land in the file.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import torch

from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

INDEX_NAME = "index.json"
FORMAT_NAME = "hyper_parallel.checkpoint"
FORMAT_VERSION = 1

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_TORCH_DTYPES = {str(dt).removeprefix("torch."): dt for dt in _ST_DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    """The index spelling of a dtype ("float32", "bfloat16", ...)."""
    if dtype not in _ST_DTYPES:
        raise TypeError(f"dtype {dtype} cannot be stored in safetensors")
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _TORCH_DTYPES:
        raise CheckpointCorruptError(f"unknown dtype {name!r} in the checkpoint index")
    return _TORCH_DTYPES[name]


def tensor_bytes(t: torch.Tensor):
    """A zero-copy byte view of a tensor (a contiguous copy first if it is not contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy()


def crc32(t: torch.Tensor) -> int:
    return zlib.crc32(tensor_bytes(t))


class SafetensorsWriter:
    """Write named tensors one by one into a safetensors file whose header is fixed up front.

    `entries` is [(name, dtype, shape)] in file order; `write(t)` must then be called once per entry,
    in order. Each write returns the CRC32 of the bytes written.
    """

    def __init__(self, path: str | os.PathLike, entries: list, metadata: dict | None = None):
        header: dict = {}
        offset = 0
        self._sizes = []
        for name, dtype, shape in entries:
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._sizes.append((name, dtype, tuple(shape), n))
            offset += n
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = str(path)
        self.total_bytes = 8 + len(raw) + offset
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0

    def write(self, t: torch.Tensor) -> int:
        name, dtype, shape, n = self._sizes[self._next]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
        data = tensor_bytes(t)
        self._f.write(data)
        self._next += 1
        return zlib.crc32(data)

    def close(self) -> None:
        if self._next != len(self._sizes):
            raise ValueError(f"{self.path}: {len(self._sizes) - self._next} tensors were never written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()


def write_json(path: Path, obj) -> None:
    """Write JSON durably (fsync) so the index is on disk before the folder is renamed into place."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_index(path: str | os.PathLike) -> dict:
    """The JSON index of a checkpoint folder, checked for the format it was written in."""
    folder = Path(path)
    index_path = folder / INDEX_NAME
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint at {folder}: the folder does not exist")
    if not index_path.is_file():
        raise CheckpointNotFoundError(f"no {INDEX_NAME} in {folder}: not a hyper_parallel checkpoint "
                                      f"(or its save never completed)")
    try:
        index = json.loads(index_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{index_path} is not valid JSON (corrupt or truncated): {e}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"{index_path} is not a {FORMAT_NAME} index")
    version = index.get("version", 0)
    if not _is_int(version):
        raise CheckpointCorruptError(f"{index_path}: 'version' must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{index_path} has format version {index['version']}; this hyper_parallel reads "
                              f"up to {FORMAT_VERSION}")
    check_index(index, folder, index_path)
    return index


# ---- an index is data: check its whole structure before anything is opened -----------------
def member_file(folder: Path, name, where: str, follow_links: bool = False) -> Path:
    """`folder / name` for a file name read from an index, refused unless it stays inside `folder`.

    A name must be a relative path without '..' (an absolute path or '..' could make a loader open any
    file). `follow_links=False` also refuses a symbolic link that leads out of the folder (our own
    checkpoints never contain links); Hugging Face cache snapshots are links into ../../blobs, so
    their loader checks the name only."""
    if not isinstance(name, str) or not name:
        raise CheckpointCorruptError(f"{where}: a file name must be a non-empty string, got {name!r}")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or "\\" in name:
        raise CheckpointCorruptError(f"{where}: file {name!r} is outside the checkpoint folder {folder}; an index "
                                     f"may only name files inside its own folder (no absolute paths, no '..')")
    path = folder / rel
    if not follow_links and not path.resolve().is_relative_to(folder.resolve()):
        raise CheckpointCorruptError(f"{where}: file {name!r} is a link to {path.resolve()}, outside the checkpoint "
                                     f"folder {folder}; an index may only name files inside its own folder")
    return path


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(v, n: int | None = None) -> bool:
    return isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v) and (n is None or len(v) == n)


def _need(ok: bool, where: str, what: str, value) -> None:
    if not ok:
        raise CheckpointCorruptError(f"{where}: {what}, got {value!r:.200}")


def check_index(index: dict, folder: Path, index_path: Path) -> None:
    """Raise CheckpointCorruptError naming the entry unless `index` has exactly the structure `save` writes:
    files inside `folder`, torch dtypes, integer shapes and offsets, pieces that lie inside their tensor."""
    for key, kind in (("world_size", int), ("files", dict), ("tensors", dict), ("values", dict)):
        value = index.get(key)
        _need(isinstance(value, kind) and not isinstance(value, bool), f"{index_path}: {key!r}",
              f"must be {'an integer' if kind is int else 'a mapping'}", value)
    for fname, info in index["files"].items():
        where = f"{index_path}: files[{fname!r}]"
        member_file(folder, fname, where)
        _need(isinstance(info, dict) and _is_int(info.get("bytes")) and info["bytes"] >= 0, where,
              "must be a mapping with an integer 'bytes'", info)
    for key, entry in index["tensors"].items():
        where = f"{index_path}: tensors[{key!r}]"
        _need(isinstance(entry, dict), where, "must be a mapping", entry)
        _need(isinstance(entry.get("dtype"), str) and entry["dtype"] in _TORCH_DTYPES, f"{where}['dtype']",
              f"must name a torch dtype safetensors stores ({', '.join(sorted(_TORCH_DTYPES))})", entry.get("dtype"))
        shape = entry.get("shape")
        _need(_int_list(shape), f"{where}['shape']", "must be a list of non-negative integers", shape)
        _need(entry.get("layout") is None or isinstance(entry["layout"], dict), f"{where}['layout']",
              "must be a mapping or null", entry.get("layout"))
        pieces = entry.get("pieces")
        _need(isinstance(pieces, list), f"{where}['pieces']", "must be a list", pieces)
        for i, piece in enumerate(pieces):
            pw = f"{where}['pieces'][{i}]"
            _need(isinstance(piece, dict), pw, "must be a mapping", piece)
            _need(isinstance(piece.get("file"), str) and piece["file"] in index["files"], f"{pw}['file']",
                  "must be one of the index's 'files'", piece.get("file"))
            _need(isinstance(piece.get("name"), str), f"{pw}['name']", "must be a string", piece.get("name"))
            _need(_is_int(piece.get("crc32")), f"{pw}['crc32']", "must be an integer", piece.get("crc32"))
            offsets, sizes = piece.get("offsets"), piece.get("sizes")
            _need(_int_list(offsets, len(shape)) and _int_list(sizes, len(shape))
                  and all(o + n <= d for o, n, d in zip(offsets, sizes, shape)), pw,
                  f"'offsets' and 'sizes' must be {len(shape)} non-negative integers inside the shape {shape}",
                  {"offsets": offsets, "sizes": sizes})
    from .flatten import decode_value  # checks every stored Python value (dtypes must be torch dtypes)
    for key, value in index["values"].items():
        decode_value(value, f"{index_path}: values[{key!r}]")


def hf_weight_map(folder: Path, index_file: Path) -> dict:
    """tensor name -> file of a Hugging Face `*.safetensors.index.json`, each file checked to lie in `folder`."""
    try:
        index = json.loads(index_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{index_file} is not valid JSON (corrupt or truncated): {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    _need(isinstance(weight_map, dict), f"{index_file}: 'weight_map'", "must be a mapping from tensor names to "
          "safetensors file names", weight_map)
    for name, fname in weight_map.items():
        member_file(folder, fname, f"{index_file}: weight_map[{name!r}]", follow_links=True)
    return dict(weight_map)

