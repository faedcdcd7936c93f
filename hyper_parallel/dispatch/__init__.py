"""Op dispatch: one path from a torch call on DTensors to local ops plus redistribution."""
import os

import torch
from torch.optim import optimizer as _optimizer

from ..dtensor import autograd as _bridge
from ..dtensor import dtensor as _dtensor_module
from ..dtensor.autograd import local_input, wrap_local
from ..dtensor.dtensor import DTensor
from ..layout.layout import Layout, replicate_layout
from . import dispatcher
from .engine_ops import engine_dispatch
from .dispatcher import STATS, clear_caches, count_calls, torch_function
from .registry import _RECORDERS, MissingOpError, load_builtin_rules, record_missing_ops, register_ops


def _check_env() -> bool:
    return os.environ.get("HYPER_PARALLEL_CHECK", "") not in ("", "0")


def _accelerated():
    """The C version of the replicated no-grad path, if it was built and not switched off."""
    if os.environ.get("HYPER_PARALLEL_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from . import _fastpath
    except ImportError:
        return None
    _fastpath.configure(DTensor, torch.Tensor, Layout, dispatcher._FAST, dispatcher.torch_function_after_c,
                        torch.is_grad_enabled, torch.Tensor._make_wrapper_subclass, torch.strided, dispatcher._wrap_replicated,
                        replicate_layout)
    _fastpath.configure_nodes(_bridge._wrap_c_apply, _bridge._unwrap_c_apply, torch._C._are_functorch_transforms_active,
                              wrap_local, local_input, _bridge.local_grad, _bridge.Unwrap.__dict__["forward"].__func__,
                              _bridge.Unwrap.__dict__["backward"].__func__, torch.Size)
    _fastpath.configure_engine(engine_dispatch, torch.ops.aten.detach.default, torch.ops.aten.alias.default)
    _bridge.use_c_nodes(_fastpath)
    _fastpath.configure_grad(dispatcher._PASSTHROUGH, torch._C._disabled_torch_function_impl, _fastpath.local_input,
                             _fastpath.wrap_local,
                             dispatcher._note_view, dispatcher.torch_function_after_c_grad,
                             _fastpath._under_disabled_torch_function, dispatcher._NOT_HANDLED, dispatcher._NO_KWARGS)
    _fastpath.configure_decision(dispatcher._RULE_OF, dispatcher._CACHE, _RECORDERS, dispatcher._wrap_outs)
    return _fastpath


_dtensor_module._engine_dispatch = engine_dispatch
_fastpath = _accelerated()
DTensor.__torch_function__ = staticmethod(_fastpath.torch_function if _fastpath else torch_function)

# Optimizers take their foreach path (one call per op over all parameters instead of a Python loop over them) only
# for the types in this list; torch's DTensor registers itself the same way. On CPU torch picks the per-tensor loop
# for every type, so this changes what runs only where foreach kernels exist (CUDA), as it does for plain tensors.
if DTensor not in _optimizer._foreach_supported_types:
    _optimizer._foreach_supported_types.append(DTensor)

from .check import set_check  # noqa: E402  (wraps the __torch_function__ just installed)
from ..redistribute.check import CheckError, CollectiveError  # noqa: E402
if _check_env():
    set_check(True)

__all__ = ["MissingOpError", "record_missing_ops", "register_ops", "load_builtin_rules", "STATS", "clear_caches",
           "count_calls", "set_check", "CheckError", "CollectiveError"]
