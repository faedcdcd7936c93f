"""Hugging Face `Trainer` on a model parallelized by hyper_parallel, under `torchrun`.

    from hyper_parallel.integrations.transformers import HyperParallelTrainer

    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = hp.from_pretrained(path, mesh, hsdp={"optimizer_level": "level3"})
    args = TrainingArguments(per_device_train_batch_size=4, ...)   # per *data-parallel* rank
    HyperParallelTrainer(model=model, args=args, train_dataset=ds).train()

What plain `Trainer` gets wrong with a parallel model, and what this subclass does instead:
- accelerate wraps the model in DistributedDataParallel over every process; hyper_parallel's hsdp
  already reduces gradients over "dp" (and "tp" ranks must not be averaged at all): the model is
  handed to accelerate as already prepared.
- accelerate gives every process a different batch; here every rank draws the *global* batch exactly
  as a one-device Trainer with batch size `per_device_train_batch_size * dp` would (same sampler, seed
  and order) and keeps its data-parallel share, so ranks of one "tp" group see the same rows.
- the loss is each rank's mean over its share (hsdp averages the gradients over "dp"), returned as a
  plain tensor so that Trainer's logging (an all-gather mean over processes) reports the global loss.
- the fused AdamW kernel (Trainer's default optimizer) becomes the multi-tensor AdamW (same update).
- `save_model` is a collective (`hp.save_pretrained` on every rank), not rank 0 only.
Needs `accelerate` (pip install hyper_parallel[trainer]). Checkpoints of the optimizer inside
`Trainer` (save_strategy="steps"/"epoch") are not supported yet: use save_strategy="no" and
`hyper_parallel.checkpoint.save` / `trainer.save_model()`.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

try:
    from transformers import Trainer
except ImportError as e:  # pragma: no cover
    raise ImportError("hyper_parallel.integrations.transformers needs transformers and accelerate: "
                      "pip install 'hyper_parallel[trainer]'") from e

from ..dtensor.dtensor import DTensor

logger = logging.getLogger("hyper_parallel")


def data_parallel_coordinates(model: nn.Module) -> tuple[int, int]:
    """(dp size, this rank's dp index) of a parallelized model: from its hsdp topology, else (1, 0)."""
    state = getattr(model, "_hsdp_state", None)
    if state is None:
        return 1, 0
    topo = state.topo
    outer = topo.storage_mesh.coordinate[topo.replicate_axis] if topo.replicate_axis is not None else 0
    return topo.dp_size, outer * topo.shard_size + topo.shard_rank


def _share(value, dp: int, index: int, batch: int):
    if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == batch:
        return value.chunk(dp)[index] if batch % dp == 0 else value
    return value


class HyperParallelTrainer(Trainer):
    """`Trainer` for a model parallelized by hyper_parallel (see the module docstring)."""

    def __init__(self, model: nn.Module = None, args=None, *rest, **kwargs):
        if model is None:
            raise ValueError("HyperParallelTrainer needs the parallelized model (model_init is not supported)")
        model._is_accelerate_prepared = True  # our parallelisms replace DDP: accelerate must not wrap it
        if args is not None and str(getattr(args.optim, "value", args.optim)) == "adamw_torch_fused":
            from transformers.training_args import OptimizerNames
            logger.info("HyperParallelTrainer: optim adamw_torch_fused -> adamw_torch (the fused kernel has no "
                        "distributed rule; the multi-tensor path computes the same update)")
            args.optim = OptimizerNames.ADAMW_TORCH
        super().__init__(model, args, *rest, **kwargs)
        self.model_accepts_loss_kwargs = False  # each rank's loss is the mean over its share
        self.dp_size, self.dp_rank = data_parallel_coordinates(model)

    # ---- data: the global batch on every rank, then this rank's share ----------------------------
    def _get_dataloader(self, dataset, description, batch_size, sampler_fn=None, is_training=False,
                        dataloader_key=None):
        accelerator = self.accelerator
        state = accelerator.state
        saved = (state.num_processes, state.process_index)
        batch_size = batch_size * (self.dp_size if is_training else 1)
        try:  # draw batches as one process would: no per-process split of the sampler
            state.num_processes, state.process_index = 1, 0
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, dataloader_key)
        finally:
            state.num_processes, state.process_index = saved

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.dp_size > 1:
            sizes = [v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.ndim]
            batch = max(sizes, default=0)
            if batch % self.dp_size:
                raise ValueError(f"HyperParallelTrainer: a global batch of {batch} rows does not split over "
                                 f"{self.dp_size} data-parallel ranks; use dataloader_drop_last=True or a dataset "
                                 f"size divisible by per_device_train_batch_size * {self.dp_size}")
            inputs = {k: _share(v, self.dp_size, self.dp_rank, batch) for k, v in inputs.items()}
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs)
        loss = result[0] if return_outputs else result
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()  # a plain scalar: Trainer gathers and logs it
        return (loss, result[1]) if return_outputs else loss

    # ---- saving: a collective on every rank ---------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        from ..pretrained import save_pretrained
        save_pretrained(self.model, output_dir or self.args.output_dir)

    def _save_checkpoint(self, model, trial):
        raise NotImplementedError("HyperParallelTrainer does not write Trainer checkpoints (optimizer state of a "
                                  "parallel model) yet: use save_strategy='no', hyper_parallel.checkpoint.save "
                                  "for resumable state and trainer.save_model() for a Hugging Face folder")


__all__ = ["HyperParallelTrainer", "data_parallel_coordinates"]
