"""`set_check`: check mode (API §11). Below, redistribute/check.py compares fingerprints before each
collective; here every op dispatched on DTensors is noted into them, by swapping DTensor's
__torch_function__ for a noting one while check mode is on, so that the normal path pays nothing."""
from __future__ import annotations

from ..dtensor.dtensor import DTensor
from ..redistribute import check as _check
from . import dispatcher

_NORMAL = []  # the __torch_function__ in use when check mode was switched on


def _noting_torch_function(func, types, args=(), kwargs=None):
    if func not in dispatcher._PASSTHROUGH:  # metadata reads (size, dim) are not ops
        _check.note(_entry(func, args, kwargs))
    return _NORMAL[0](func, types, args, kwargs)


def _entry(func, args, kwargs) -> str:
    leaves = []
    dispatcher._collect(list(args) + list((kwargs or {}).values()), leaves)
    ins = ", ".join(f"{t._layout.alias_entries()}{' partial' if t._layout.has_partial else ''} {tuple(t._shape)}"
                    if type(t) is DTensor else f"plain {tuple(t.shape)}" for t in leaves)
    return f"{dispatcher.registry.op_name(func)}({ins}) at {_check.user_site()}"


def set_check(enabled: bool = True) -> None:
    """Check mode: before each collective the ranks compare what they are about to run (op, layouts, global
    shapes, source line, the DTensor ops since the previous collective) and all raise `CheckError`, naming
    each rank's op and line, when they differ. Costly (an object exchange per collective): for debugging.
    Also switched on by the environment variable HYPER_PARALLEL_CHECK=1."""
    on = DTensor.__torch_function__ is _noting_torch_function
    if enabled and not on:
        _NORMAL[:] = [DTensor.__torch_function__]
        DTensor.__torch_function__ = staticmethod(_noting_torch_function)
    elif not enabled and on:
        DTensor.__torch_function__ = staticmethod(_NORMAL[0])
    _check.set_enabled(enabled)


def _describe_dispatch(f) -> str:
    leaves = f.get("leaves") or []
    ins = ", ".join(f"{t._layout} {tuple(t._shape)}" if type(t) is DTensor else f"plain {tuple(t.shape)}"
                    for t in leaves)
    return f"op {f['name']} on [{ins}]"


_check.describe_frames(dispatcher._dispatch.__code__, _describe_dispatch)
_check.describe_frames(dispatcher._missing.__code__, _describe_dispatch)
