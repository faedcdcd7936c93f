"""What hsdp computes in and where it keeps its shards: `MixedPrecision` (FSDP2's MixedPrecisionPolicy) and offload."""
from __future__ import annotations

from dataclasses import dataclass

import torch

OFFLOADS = (None, "cpu")


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in `param_dtype` from master parameters kept in their own dtype (fp32), as FSDP2 does.

    - `param_dtype`: the gathered (unsharded) parameters, hence the forward and backward compute, are in
      this dtype; the sharded parameters the optimizer updates, and so its state, keep the model's dtype.
    - `reduce_dtype`: gradients are reduced across data-parallel ranks in this dtype (default:
      `param_dtype`), then given to the sharded parameters in their own dtype.
    - `output_dtype`: floating-point outputs of the root module are cast to it (default: left as computed).
    - `cast_forward_inputs`: floating-point tensors passed to each hsdp unit (decoder layer, root) are
      cast to `param_dtype`, as FSDP2 casts each `fully_shard` module's inputs. Buffers are not cast.
    Only floating-point parameters are cast. `None` everywhere is plain hsdp.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"MixedPrecision: {name} must be a floating-point torch.dtype or None, got {value!r}")


def cast_floating(value, dtype: torch.dtype):
    """Every floating-point tensor in a (nested) forward argument or output cast to `dtype`."""
    from torch.utils._pytree import tree_map_only

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
    return tree_map_only(torch.Tensor, cast, value)


def resolve(mixed_precision, reduce_dtype, offload) -> tuple:
    """(param_dtype, reduce_dtype, MixedPrecision or None, offload) from hsdp's arguments, or a clear error."""
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(f"hsdp: mixed_precision must be a hyper_parallel.MixedPrecision, got {mixed_precision!r}")
    if offload not in OFFLOADS:
        raise ValueError(f"hsdp: offload={offload!r}; use None or 'cpu' (sharded parameters, gradients and optimizer "
                         f"state in host memory between uses)")
    if reduce_dtype is not None and not isinstance(reduce_dtype, torch.dtype):
        raise TypeError(f"hsdp: reduce_dtype must be a torch.dtype or None, got {reduce_dtype!r}")
    mp = mixed_precision
    if mp is not None and mp.reduce_dtype is not None and reduce_dtype is not None and mp.reduce_dtype != reduce_dtype:
        raise ValueError(f"hsdp: reduce_dtype={reduce_dtype} and mixed_precision.reduce_dtype={mp.reduce_dtype} "
                         f"disagree; give it once")
    param_dtype = mp.param_dtype if mp is not None else None
    reduce = reduce_dtype or (mp.reduce_dtype if mp is not None else None) or param_dtype
    return param_dtype, reduce, mp, offload
