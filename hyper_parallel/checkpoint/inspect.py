"""`hyper-parallel checkpoint inspect PATH`: what a checkpoint holds, without loading it into a model."""
from __future__ import annotations

import argparse
import json
import math
import sys
from contextlib import ExitStack
from pathlib import Path

from .errors import CheckpointError
from .flatten import decode_value
from .dcp import dcp_entries, is_dcp_folder
from .format import INDEX_NAME, dtype_from_name, read_index
from .loader import SliceReader, check_crc, resolve_path


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def describe_layout(info: dict | None) -> str:
    """`mesh(dp=2,tp=2) [dp+tp, None] partial(tp=sum)` as saved; `plain` for a plain tensor."""
    if info is None:
        return "plain"
    mesh = ",".join(f"{a}={n}" for a, n in zip(info["mesh_axes"], info["mesh_shape"]))
    dims = ", ".join("+".join(axes) if axes else "None" for axes in info["tensor_map"])
    extra = "".join(f" partial({a}={op})" for a, op in info.get("partial", {}).items())
    return f"mesh({mesh}) [{dims}]{extra}"


def summarize(path: str) -> dict:
    """The index as rows: key, dtype, shape, layout, bytes, pieces (plus values and totals)."""
    folder = resolve_path(path)
    if is_dcp_folder(folder) and not (folder / INDEX_NAME).is_file():
        return _summarize_dcp(folder)
    index = read_index(folder)
    rows = []
    for key, e in index["tensors"].items():
        size = math.prod(e["shape"]) * dtype_from_name(e["dtype"]).itemsize
        rows.append({"key": key, "dtype": e["dtype"], "shape": list(e["shape"]), "layout": describe_layout(e["layout"]),
                     "bytes": size, "pieces": len(e["pieces"])})
    values = {k: decode_value(v) for k, v in index["values"].items()}
    return {"path": str(folder), "world_size": index["world_size"], "files": index["files"], "tensors": rows,
            "values": values}


def _summarize_dcp(folder: Path) -> dict:
    """The same listing for a torch.distributed.checkpoint folder (its `.metadata`; values are not unpickled)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    rows, values = [], {}
    for key, md in dcp_entries(folder).items():
        if isinstance(md, BytesStorageMetadata):
            values[key] = "<a pickled value>"
            continue
        dtype = str(md.properties.dtype).removeprefix("torch.")
        rows.append({"key": key, "dtype": dtype, "shape": list(md.size), "layout": "dcp chunks",
                     "bytes": math.prod(md.size) * md.properties.dtype.itemsize, "pieces": len(md.chunks)})
    files = {f.name: {"bytes": f.stat().st_size} for f in sorted(folder.glob("*.distcp"))}
    writers = {name.split("_")[2] for name in files if name.startswith("__") and name.count("_") >= 3}
    return {"path": str(folder), "world_size": len(writers) or len(files), "files": files, "tensors": rows,
            "values": values, "format": "dcp"}


def verify(path: str) -> list[str]:
    """Checksum every stored piece; the problems found (empty when intact)."""
    folder = resolve_path(path)
    if is_dcp_folder(folder) and not (folder / INDEX_NAME).is_file():
        return [f"{folder} is a torch.distributed.checkpoint folder: DCP stores no checksums to verify"]
    index = read_index(folder)
    problems = []
    with ExitStack() as stack:
        reader = SliceReader(folder, stack)
        for key, e in index["tensors"].items():
            for p in e["pieces"]:
                try:
                    err = check_crc(p, reader.read(p["file"], p["name"]), key, folder)
                except CheckpointError as ex:
                    err = str(ex)
                if err:
                    problems.append(err)
    return problems


def print_summary(s: dict, out=None) -> None:
    out = out if out is not None else sys.stdout  # looked up per call: the stream may be replaced (pytest, redirects)
    total = sum(r["bytes"] for r in s["tensors"])
    print(f"checkpoint {s['path']}: {len(s['tensors'])} tensors ({_human(total)}), {len(s['values'])} values, "
          f"{len(s['files'])} files, saved by {s['world_size']} rank(s)", file=out)
    if s["tensors"]:
        w = max(len("tensor"), *(len(r["key"]) for r in s["tensors"]))
        shapes = [str(tuple(r["shape"])) for r in s["tensors"]]
        ws = max(len("shape"), *(len(x) for x in shapes))
        wl = max(len("layout (as saved)"), *(len(r["layout"]) for r in s["tensors"]))
        print(f"{'tensor':<{w}}  {'dtype':<9} {'shape':<{ws}}  {'layout (as saved)':<{wl}}  {'pieces':>6}  size",
              file=out)
        for r, shape in zip(s["tensors"], shapes):
            print(f"{r['key']:<{w}}  {r['dtype']:<9} {shape:<{ws}}  {r['layout']:<{wl}}  {r['pieces']:>6}  "
                  f"{_human(r['bytes'])}", file=out)
    if s["values"]:
        print("values:", file=out)
        for k, v in s["values"].items():
            text = repr(v)
            print(f"  {k} = {text if len(text) <= 100 else text[:97] + '...'}", file=out)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `checkpoint inspect PATH [--json FILE] [--verify]` on a CLI's subparsers."""
    p = subparsers.add_parser("checkpoint", help="inspect hyper_parallel checkpoints")
    sub = p.add_subparsers(dest="checkpoint_command", required=True)
    i = sub.add_parser("inspect", help="list tensors, global shapes, dtypes, saved layouts and sizes")
    i.add_argument("path", help="a checkpoint folder written by hyper_parallel.checkpoint.save")
    i.add_argument("--json", metavar="FILE", help="also write the listing as JSON ('-' for stdout only)")
    i.add_argument("--verify", action="store_true", help="checksum every stored piece; exit 1 if any fails")
    p.set_defaults(handler=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        s = summarize(args.path)
    except CheckpointError as e:
        print(f"hyper-parallel checkpoint inspect: {e}", file=sys.stderr)
        return 1
    if args.json == "-":
        print(json.dumps(s, indent=1, default=repr))
    else:
        print_summary(s)
        if args.json:
            Path(args.json).write_text(json.dumps(s, indent=1, default=repr))
    if args.verify:
        problems = verify(args.path)
        for msg in problems:
            print(f"CORRUPT: {msg}", file=sys.stderr)
        if problems:
            return 1
        print("verified: every stored piece matches its checksum", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: `python -m hyper_parallel.checkpoint.inspect inspect PATH`."""
    parser = argparse.ArgumentParser(prog="hyper-parallel")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["checkpoint", *(argv if argv is not None else sys.argv[1:])])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
