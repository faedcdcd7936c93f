"""Distributed checkpoints: save and resume under any layout, mesh or rank count, atomically and verified.

    from hyper_parallel.checkpoint import save, load, init_optimizer_state, apply_optimizer_state

    save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, "ckpt/step100")

    # resume, possibly on other ranks / layouts: build model and optimizer as usual, then
    init_optimizer_state(opt)            # a fresh optimizer has no state to fill yet
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}
    load(state, "ckpt/step100")          # fills the tensors in place (params, exp_avg, ...)
    apply_optimizer_state(opt, state["optim"])  # the loaded param_groups (lr, betas, ...)

`load` fills exp_avg & co. in place (opt.state_dict() hands out the optimizer's own tensors), so
only the param-group values remain to apply; `opt.load_state_dict(state["optim"])` does that too,
but it re-creates every state tensor through `.to(dtype=, device=)`.
    step = state["step"]

On disk: one `rank<r>.safetensors` per rank that owns data plus `index.json` (global shape, dtype,
saved layout, and per stored piece: file, offsets, sizes, CRC32). `export_hf` / `load_hf` write and
read Hugging Face folders; `hyper-parallel checkpoint inspect PATH` lists a checkpoint.
"""
from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointNotFoundError
from .format import read_index
from .hf import export_hf, load_hf
from .loader import LoadResult, load
from .optim import apply_optimizer_state, init_optimizer_state
from .saver import save

__all__ = ["save", "load", "export_hf", "load_hf", "init_optimizer_state", "apply_optimizer_state", "read_index", "LoadResult",
           "CheckpointError", "CheckpointNotFoundError", "CheckpointMismatchError", "CheckpointCorruptError"]
