"""Check mode and collective failures: an SPMD program whose ranks diverge fails loudly, on every rank.

With check mode on, every rank keeps a running digest of the DTensor ops it has dispatched since its
last collective (op, input layouts, global shapes, the user's source line; `note`, fed by the
dispatcher). Before each collective the ranks of its group exchange a fingerprint (the collective, the op
or redistribution that issues it, the source line, the digest) and, when they differ, every rank raises
`CheckError` naming each rank's op and line. Off, the only cost is one list read per collective.

The digest is reset at every checked collective, so check mode fits SPMD code, where all ranks run the
same collectives in the same order (pipeline stages that run different ops on different ranks do not).
"""
from __future__ import annotations

import os
import sys
import zlib
from collections import deque
from pathlib import Path

import torch.distributed as dist

CHECK = [os.environ.get("HYPER_PARALLEL_CHECK", "") not in ("", "0")]
_DIGEST = [0]
_TRAIL: deque = deque(maxlen=6)   # the last ops noted, for the error message
_DESCRIBERS: dict = {}            # code object of a frame that issues collectives -> fn(frame locals) -> str
_PACKAGE = str(Path(__file__).resolve().parent.parent)
_SKIP = (_PACKAGE, str(Path(dist.__file__).resolve().parent.parent), "<")


class CheckError(RuntimeError):
    """Check mode: the ranks of a group were about to run different collectives or different ops."""


class CollectiveError(RuntimeError):
    """A collective failed (timed out, a peer died): says which op, layouts and mesh axis it served."""


def set_enabled(enabled: bool) -> None:
    CHECK[0] = bool(enabled)
    _DIGEST[0] = 0
    _TRAIL.clear()


def describe_frames(code, describe) -> None:
    """Name what a frame running `code` is doing (e.g. the dispatcher's op and layouts), read from its
    locals only when a check or a failure needs it: nothing is recorded on the way in."""
    _DESCRIBERS[code] = describe


def user_site(frame=None) -> str:
    """file:line of the innermost frame outside hyper_parallel and torch: the user's code."""
    f = frame or sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_SKIP) and "contextlib" not in name:
            return f"{name}:{f.f_lineno}"
        f = f.f_back
    return "?"


def note(entry: str) -> None:
    """An op ran on DTensors (check mode): fold it into this rank's digest."""
    _DIGEST[0] = zlib.crc32(entry.encode(), _DIGEST[0])
    _TRAIL.append(entry)


def _running() -> str:
    """What the frames below this collective are doing: the innermost described frames, outermost first."""
    found = []
    f = sys._getframe(2)
    while f is not None:
        describe = _DESCRIBERS.get(f.f_code)
        if describe is not None:
            try:
                found.append(describe(f.f_locals))
            except Exception:  # a description must never hide the real error
                pass
        f = f.f_back
    return "; ".join(reversed(found)) or "a collective outside any op"


def axis_name(group) -> str:
    """The mesh axis a process group serves, for messages."""
    from ..layout.mesh import _MESHES
    for mesh in _MESHES.values():
        for axis, g in enumerate(mesh.groups):
            if g is group and group is not None:
                return f"mesh axis {mesh.mesh_dim_names[axis]!r} of {mesh}"
    return "the default process group" if group is None else "a process group of no hyper_parallel mesh"


def compare(kind: str, detail, group) -> None:
    """Exchange fingerprints over `group`; raise CheckError on every rank if they differ."""
    mine = (f"{kind}({detail}) for {_running()}", user_site(sys._getframe(2)), _DIGEST[0], list(_TRAIL))
    size = dist.get_world_size(group)
    everyone = [None] * size
    try:
        dist.all_gather_object(everyone, mine, group=group)
    except RuntimeError as e:
        raise CollectiveError(failure_message("check-mode fingerprint exchange before " + kind, detail, group, e)) from e
    _DIGEST[0] = 0
    _TRAIL.clear()
    if all(fp[:3] == everyone[0][:3] for fp in everyone):
        return
    lines = []
    for i, (what, site, digest, trail) in enumerate(everyone):
        rank = dist.get_global_rank(group, i) if group is not None else i
        ops = "\n      ".join(trail) or "(no op since the previous collective)"
        lines.append(f"  rank {rank}: {what} at {site}\n    ops since the previous collective:\n      {ops}")
    raise CheckError(f"check mode: the ranks of {axis_name(group)} are about to run different things:\n"
                     + "\n".join(lines) + "\nEvery rank must run the same DTensor ops in the same order (SPMD): "
                     "look for rank-dependent branches around these lines.")


def failure_message(kind: str, detail, group, error: BaseException) -> str:
    return (f"collective {kind}({detail}) over {axis_name(group)} failed for {_running()} "
            f"(called at {user_site(sys._getframe(2))}): {error}. A timeout (HYPER_PARALLEL_COMM_TIMEOUT) usually "
            f"means the ranks diverged; rerun with HYPER_PARALLEL_CHECK=1 to find where.")
