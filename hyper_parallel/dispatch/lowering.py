"""The dispatch path while a module's forward is traced into a graph of local ops (`hyper_parallel.compile`).

A tracer (`make_fx`) records the torch ops run on local tensors; the dispatcher itself runs in Python, deciding
layouts, moving and wrapping as it does eagerly. Three things change for the trace, all by swapping what is
called (the eager path tests no flag for any of them):
- the Python path replaces the C twin (`DTensor.__torch_function__`, the bridge's C nodes), whose calls
  into torch a Python-level tracer cannot follow step by step;
- the autograd bridge is the traceable one (`dtensor/traceable.py`): gradient moves become custom ops in the
  graph instead of Python autograd nodes the tracer would drop;
- a decision made for the first time (`_decide`: ops on meta tensors for global shapes, the rule's strategy)
  runs untraced, so none of its work lands in the graph.
"""
from __future__ import annotations

import contextlib

from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from ..dtensor import autograd as _bridge
from ..dtensor.dtensor import DTensor
from ..dtensor.traceable import tracing_bridge
from . import dispatcher

_DEPTH = [0]


def _untraced_decide(*args, **kwargs):
    with disable_proxy_modes_tracing():
        return _EAGER_DECIDE(*args, **kwargs)


_EAGER_DECIDE = dispatcher._decide


def is_lowering() -> bool:
    return _DEPTH[0] > 0


@contextlib.contextmanager
def lowering():
    """Dispatch through the Python path with the traceable bridge (see the module docstring); re-entrant."""
    if _DEPTH[0]:
        _DEPTH[0] += 1
        try:
            yield
        finally:
            _DEPTH[0] -= 1
        return
    import hyper_parallel.dispatch as package
    fastpath = package._fastpath  # the C twin in use, or None
    torch_function = DTensor.__dict__["__torch_function__"]
    _DEPTH[0] = 1
    DTensor.__torch_function__ = staticmethod(dispatcher.torch_function)
    if fastpath is not None:
        _bridge.use_c_nodes(None)
    dispatcher._decide = _untraced_decide
    try:
        with tracing_bridge():
            yield
    finally:
        dispatcher._decide = _EAGER_DECIDE
        if fastpath is not None:
            _bridge.use_c_nodes(fastpath)
        DTensor.__torch_function__ = torch_function
        _DEPTH[0] = 0
