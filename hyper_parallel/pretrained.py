"""Hugging Face folders <-> parallel models in one call: `from_pretrained` and `save_pretrained`.

This module sits above both `parallel` (which lays the model out) and `checkpoint` (which reads and writes
the files); neither of those imports the other. A parallelized model's own `model.save_pretrained(path)`
reaches `save_pretrained` here through `parallel.surgery.set_exporter`.

`from_pretrained(path, mesh)` never builds the full model: the model is made from the config on the
meta device, `parallelize`d there (tp, ep, cp, then hsdp: still meta), given memory for its local
pieces only (hsdp's shards, `materialize` for the rest; computed buffers such as rotary frequencies
are computed), and filled by `load_hf`, which reads each rank's slices of each tensor straight from
the safetensors files (`get_slice`). So a rank's private peak is about its own pieces plus one slice
in flight (with hsdp level1/2, plus the full buffers those levels keep anyway). `save_pretrained` is `export_hf`: a standard
folder that plain transformers loads, split with an index past `max_shard_size`, published atomically.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .checkpoint.errors import CheckpointNotFoundError
from .checkpoint.format import hf_weight_map
from .checkpoint.hf import export_hf, load_hf
from .parallel import surgery
from .parallel.dims import PP, ParallelDims
from .parallel.parallelize import apply_parallelisms, check_request
from .parallel.pipeline import Pipeline
from .parallel.pipeline.api import build_pipeline
from .parallel.shard.init import materialize
from .parallel.surgery import refuse_foreign_dtensors

# Arguments of transformers' save_pretrained that describe what it already is here (every rank calls,
# safetensors always), so code written for it (Trainer, scripts) can pass them unchanged.
_SAVE_KWARGS_ACCEPTED = {"is_main_process", "safe_serialization", "state_dict", "save_function", "variant"}


def save_pretrained(model: nn.Module, path: str | os.PathLike, *, max_shard_size: int | str = "50GB",
                    overwrite: bool = True, **kwargs) -> None:
    """Write `model` (parallelized or not) as a standard Hugging Face folder; every rank calls it.

    config.json (+ generation_config.json) and the weights as safetensors, split into
    `model-0000i-of-0000n.safetensors` files with `model.safetensors.index.json` past `max_shard_size`
    ("5GB" style or bytes), exactly what `AutoModel*.from_pretrained(path)` loads on one device. The
    folder appears atomically: an existing one is replaced only once the new one is complete.
    """
    unknown = sorted(set(kwargs) - _SAVE_KWARGS_ACCEPTED)
    if unknown:
        raise TypeError(f"save_pretrained: unsupported arguments {unknown} for a hyper_parallel model "
                        f"(push_to_hub and friends: upload the folder it wrote instead)")
    if kwargs.get("state_dict") is not None:
        raise ValueError("save_pretrained(state_dict=...): a parallel model is saved from its own parameters; "
                         "load the state dict into the model first")
    if isinstance(model, Pipeline):  # each stage's tensors, sent to rank 0 by their owners
        return export_hf(model.model, path, overwrite=overwrite, max_shard_size=max_shard_size,
                         state_dict=model.state_dict())
    export_hf(model, path, overwrite=overwrite, max_shard_size=max_shard_size)


def _config(path: Path):
    from transformers import AutoConfig
    if not (path / "config.json").is_file():
        raise CheckpointNotFoundError(f"from_pretrained: no config.json in {path} (a local Hugging Face folder "
                                      f"is needed; download it first, e.g. with huggingface_hub.snapshot_download)")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:  # transformers' own, on bad fields
        raise ValueError(f"from_pretrained: transformers cannot read {path / 'config.json'}: {type(e).__name__}: {e}. "
                         f"Check its fields (model_type, architectures: a list of class names, dtype: e.g. "
                         f"'bfloat16')") from e


def _model_class(config, auto_class):
    import transformers
    if auto_class is not None:
        return auto_class
    names = getattr(config, "architectures", None) or ()
    names = [names] if isinstance(names, str) else names   # one name written without its list
    for name in names if isinstance(names, (list, tuple)) else ():
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type):
            return cls
    raise ValueError(f"from_pretrained: the config names no transformers class in `architectures` "
                     f"({getattr(config, 'architectures', None)}); pass auto_class=, e.g. AutoModelForCausalLM")


def _config_dtype(config) -> torch.dtype | None:
    """The config's `dtype` (or older `torch_dtype`) as a floating torch dtype; None when it gives none ("auto").
    Anything else is a ValueError naming the value: a model cannot be built in it."""
    value = getattr(config, "dtype", None)
    if value is None or value == "auto":
        return None
    found = getattr(torch, value, None) if isinstance(value, str) else value
    if isinstance(found, torch.dtype) and found.is_floating_point:
        return found
    raise ValueError(f"from_pretrained: config.json's dtype {value!r} is not a floating torch dtype (e.g. "
                     f"'float32', 'bfloat16', 'float16'); fix config.json, or pass dtype=torch.bfloat16 to override it")


def _checkpoint_dtype(path: Path) -> torch.dtype | None:
    """The dtype of the first floating tensor stored in the folder (transformers' dtype="auto" fallback)."""
    from safetensors import safe_open
    index = path / "model.safetensors.index.json"
    files = [path / next(iter(hf_weight_map(path, index).values()))] if index.is_file() \
        else sorted(path.glob("*.safetensors"))[:1]
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                t = h.get_slice(key)
                dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                         "F64": torch.float64}.get(t.get_dtype())
                if dtype is not None:
                    return dtype
    return None


def _build_on_meta(cls, config, dtype: torch.dtype) -> nn.Module:
    """The model with every parameter and buffer on the meta device (no memory, no random init)."""
    with torch.device("meta"):
        if hasattr(cls, "_from_config"):
            return cls._from_config(config, dtype=dtype)
        return cls.from_config(config, dtype=dtype)  # an Auto class


PIPELINE_ARGUMENTS = ("schedule", "n_microbatches", "stages_per_rank", "split_points", "loss")


def from_pretrained(path: str | os.PathLike, mesh=None, *, auto_class=None, dtype: torch.dtype | None = None,
                    **parallelize_kwargs) -> nn.Module | Pipeline:
    """A parallel model from a Hugging Face folder, each rank reading only its slices; every rank calls it.

    Built from the config on the meta device (`auto_class` defaults to the class the config's
    `architectures` names; pass e.g. `AutoModelForCausalLM` otherwise), laid out on `mesh` as
    `parallelize` does with `parallelize_kwargs` (tp=, ep=, cp=, hsdp=), then each rank allocates its local
    pieces and reads them from the folder's safetensors (one file or an indexed set). `dtype` defaults to
    the config's (as transformers' dtype="auto"). Tied weights stay tied. Equals transformers' own
    `from_pretrained` on one device, parallelized. On a mesh with a "pp" axis the result is the
    `Pipeline` (`pipeline`'s schedule=, n_microbatches=, stages_per_rank=, split_points=, loss= are taken too),
    and each rank reads only its stages' slices.
    """
    folder = Path(path).absolute()
    dims = ParallelDims.of(mesh, "from_pretrained") if mesh is not None else None
    pipelined = dims is not None and dims.has(PP)
    pipeline_kwargs = {k: parallelize_kwargs.pop(k) for k in PIPELINE_ARGUMENTS if k in parallelize_kwargs}
    if dims is None and (parallelize_kwargs or pipeline_kwargs):
        raise ValueError(f"from_pretrained: {sorted(parallelize_kwargs) + sorted(pipeline_kwargs)} need a mesh")
    if pipeline_kwargs and not pipelined:
        raise ValueError(f"from_pretrained: {sorted(pipeline_kwargs)} are pipeline arguments; the mesh has no 'pp' "
                         f"axis ({dims.names})")
    if dims is not None and not pipelined:
        check_request(dims, where="from_pretrained", **parallelize_kwargs)
    config = _config(folder)
    cls = _model_class(config, auto_class)
    if dtype is None:
        dtype = _config_dtype(config) or _checkpoint_dtype(folder) or torch.float32
    elif not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"from_pretrained: dtype={dtype!r} is not a floating torch dtype; pass e.g. "
                         f"dtype=torch.bfloat16 (or None: the config's)")
    model = _build_on_meta(cls, config, dtype)
    model.eval()  # as transformers' from_pretrained
    if pipelined:
        pipe = build_pipeline(model, mesh, PP, initialize=False, **pipeline_kwargs, **parallelize_kwargs)
        other_stages = set(pipe.state_dict()) - set(pipe.model.state_dict())
        _fill(pipe.model, pipe.stages, folder, mesh, other_stages)
        return pipe
    if dims is not None:
        refuse_foreign_dtensors(model, "from_pretrained")
        apply_parallelisms(model, dims, **{k: v for k, v in parallelize_kwargs.items() if k != "ep"})
    _fill(model, [model], folder, mesh)
    return model


def _fill(model: nn.Module, roots: list, folder: Path, mesh, held_elsewhere: set = frozenset()) -> None:
    """Memory for each rank's local pieces of a model laid out on the meta device (hsdp's shards through
    each hsdp root), then the values read from the folder (`held_elsewhere`: other stages' tensors)."""
    for root in roots:
        if hasattr(root, "materialize_hsdp"):
            root.materialize_hsdp(_mesh_device(mesh))
    materialize(model)
    load_hf(model, folder, strict=True, held_elsewhere=held_elsewhere)


def _mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


surgery.set_exporter(save_pretrained)

__all__ = ["from_pretrained", "save_pretrained"]
