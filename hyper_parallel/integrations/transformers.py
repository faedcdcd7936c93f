"""Hugging Face `Trainer` on a model parallelized by hyper_parallel, under `torchrun`.

    from hyper_parallel.integrations.transformers import HyperParallelTrainer

    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = hp.from_pretrained(path, mesh, hsdp={"optimizer_level": "level3"})
    args = TrainingArguments(per_device_train_batch_size=4, ...)   # per *data-parallel* rank
    trainer = HyperParallelTrainer(model=model, args=args, train_dataset=ds, eval_dataset=ev)
    trainer.train()                                    # or .train(resume_from_checkpoint=True)

What plain `Trainer` gets wrong with a parallel model, and what this subclass does instead:
- accelerate wraps the model in DistributedDataParallel over every process; hyper_parallel's hsdp
  already reduces gradients over "dp" (and "tp" ranks must not be averaged at all): the model is
  handed to accelerate as already prepared, and only what accelerate adds besides DDP is applied
  (autocast for `bf16=True` / `fp16=True`, which TRL's SFTConfig sets by default).
- accelerate gives every process a different batch; here every rank draws the *global* batch exactly
  as a one-device Trainer with batch size `per_device_train_batch_size * dp` would (same sampler, seed
  and order) and keeps its data-parallel share, so ranks of one "tp" group see the same rows.
  Evaluation batches are not split: every rank evaluates the whole batch (`per_device_eval_batch_size`
  rows), so `eval_loss` is the one-device value.
- the loss is each rank's mean over its share (hsdp averages the gradients over "dp"), returned as a
  plain tensor so that Trainer's logging (an all-gather mean over processes) reports the global loss.
- `save_model` is a collective (every rank calls it; the Hugging Face folder is written into
  `output_dir` beside the checkpoints, as Trainer does), not rank 0 only.
- checkpoints (`save_strategy="steps"`, every `save_steps`, Trainer's default): `checkpoint-N/` holds
  `hyper_parallel/` (the model's parameters and buffers and the optimizer state, sharded: each rank
  writes its own pieces with `hyper_parallel.checkpoint.save`), `scheduler.pt`, one `rng_state_<r>.pth`
  per rank, `trainer_state.json` (step, hence the data position) and config / tokenizer / arguments.
  `train(resume_from_checkpoint=...)` loads them into the model and optimizer *as they are now laid
  out*, so a run can resume on another mesh, layout or number of ranks (keep the global batch:
  `per_device_train_batch_size * dp`); on the same ranks the resumed run equals the uninterrupted one.
  `load_best_model_at_end` reads the best checkpoint's `hyper_parallel/` the same way.
Needs `accelerate` (pip install hyper_parallel[trainer]). TRL's `SFTTrainer` is a `Trainer`: see
`sft_trainer_class`.
"""
from __future__ import annotations

import logging
import os
import warnings

import torch
from torch import nn

try:
    from transformers import Trainer
    from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:  # pragma: no cover
    raise ImportError("hyper_parallel.integrations.transformers needs transformers and accelerate: "
                      "pip install 'hyper_parallel[trainer]'") from e

from ..checkpoint import (CheckpointMismatchError, CheckpointNotFoundError, apply_optimizer_state, export_hf,
                          init_optimizer_state)
from ..checkpoint import load as load_checkpoint
from ..checkpoint import save as save_checkpoint
from ..dtensor.dtensor import DTensor
from ..parallel import feed
from ..parallel.dims import ParallelDims

logger = logging.getLogger("hyper_parallel")

STATE_DIR = "hyper_parallel"  # inside checkpoint-N/: the sharded model and optimizer state


def data_parallel_coordinates(model: nn.Module) -> tuple[int, int]:
    """(number of data shares, this rank's share) of a parallelized model (API §12): over the data axes "dp"
    and "ep" of the mesh its parallelisms share, else from its hsdp topology, else (1, 0)."""
    model_feed = feed.feed_of(model)
    if model_feed is not None:
        dims = ParallelDims.of(model_feed.mesh, "HyperParallelTrainer", allow_other_axes=True)
        return dims.data_world, dims.data_rank
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


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's `AcceleratedOptimizer` (whose step is gated on sync)."""
    return getattr(optimizer, "optimizer", optimizer)


class HyperParallelTrainerMixin:
    """What a `Trainer` subclass needs for a model parallelized by hyper_parallel (see the module docstring).

    Mixed in before the Trainer class: `HyperParallelTrainer` is `(HyperParallelTrainerMixin, Trainer)`;
    `sft_trainer_class()` builds the same on TRL's `SFTTrainer`."""

    def __init__(self, model: nn.Module = None, args=None, *rest, **kwargs):
        if model is None:
            raise ValueError(f"{type(self).__name__} needs the parallelized model (model_init is not supported)")
        model._is_accelerate_prepared = True  # our parallelisms replace DDP: accelerate must not wrap it
        super().__init__(model, args, *rest, **kwargs)
        # what accelerate adds to a model besides DDP: autocast for bf16=/fp16= (TRL's SFTConfig has bf16=True)
        model._is_accelerate_prepared = False
        prepared = self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        if prepared is not model:  # torch_compile=True: Trainer runs the compiled module
            self.model_wrapped = prepared
        self.model_accepts_loss_kwargs = False  # each rank's loss is the mean over its share
        self.dp_size, self.dp_rank = data_parallel_coordinates(model)
        self._in_checkpoint = False

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

    # ---- saving: collectives on every rank ------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model as a Hugging Face folder, written into `output_dir` (which may hold other files, e.g.
        checkpoint-N folders) as Trainer does; every rank calls it. Inside a Trainer checkpoint the weights
        are already in its sharded `hyper_parallel/` state, so only config, tokenizer and arguments go there."""
        output_dir = output_dir or self.args.output_dir
        if self._in_checkpoint:
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                self.model.config.save_pretrained(output_dir)
        else:
            export_hf(self.model, output_dir, merge=True)
        if self.args.should_save:
            tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_checkpoint(self, model, trial):
        """Trainer's checkpoint, with the model and optimizer state written sharded by every rank first."""
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        state = {"model": self.model.state_dict()}
        if not self.args.save_only_model:
            state["optimizer"] = _unwrapped(self.optimizer).state_dict()
        save_checkpoint(state, os.path.join(folder, STATE_DIR))
        self._in_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._in_checkpoint = False

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # the optimizer state is in STATE_DIR; the scheduler's is a small Python object
        if self.args.should_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "please also save the optimizer state"
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # ---- resuming: fill the model and optimizer under their current layouts -----------------------------
    def _load_state(self, checkpoint: str, state: dict) -> None:
        """Fill `state` from `checkpoint`'s sharded state; every key of `state` must be there."""
        path = os.path.join(checkpoint, STATE_DIR)
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(
                f"{checkpoint} has no {STATE_DIR}/ folder: it was not written by HyperParallelTrainer (a plain "
                f"Trainer checkpoint holds one process's full tensors). Load its weights with "
                f"hp.from_pretrained({checkpoint!r}, mesh, ...) and train from there without resume_from_checkpoint")
        missing = load_checkpoint(state, path, strict=False).missing_keys
        if missing:
            raise CheckpointMismatchError(f"{path} lacks {len(missing)} entries of this run: {missing[:8]} (was it "
                                          f"saved with save_only_model=True, or from another model?)")

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        self._load_state(resume_from_checkpoint, {"model": (model or self.model).state_dict()})

    def _load_best_model(self) -> None:
        logger.info(f"Loading best model from {self.state.best_model_checkpoint} (score: {self.state.best_metric}).")
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        optimizer = _unwrapped(self.optimizer)
        init_optimizer_state(optimizer)  # state tensors laid out like the parameters, to be filled in place
        state = {"optimizer": optimizer.state_dict()}
        self._load_state(checkpoint, state)
        apply_optimizer_state(optimizer, state["optimizer"])
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if not os.path.isfile(scheduler):
            raise CheckpointNotFoundError(f"{checkpoint} has no {SCHEDULER_NAME}: the checkpoint is incomplete")
        self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self.args.world_size > 1:
            own = os.path.join(checkpoint, f"rng_state_{self.args.process_index}.pth")
            if not os.path.isfile(own):
                warnings.warn(f"{checkpoint} has no random-number state for rank {self.args.process_index} (it was "
                              f"saved by fewer ranks): dropout and other random ops will not repeat the "
                              f"uninterrupted run; the data order does (it follows the seed and the step)")
        super()._load_rng_state(checkpoint)


class HyperParallelTrainer(HyperParallelTrainerMixin, Trainer):
    """`Trainer` for a model parallelized by hyper_parallel (see the module docstring)."""


def sft_trainer_class() -> type:
    """TRL's `SFTTrainer` with the same integration: `sft_trainer_class()(model=model, args=SFTConfig(...), ...)`.

    Needs `trl` (pip install trl). SFTTrainer only adds dataset preparation and its own loss and
    metrics on top of `Trainer`; the parallel model's needs are those of `HyperParallelTrainer`."""
    try:
        from trl import SFTTrainer
    except ImportError as e:
        raise ImportError("sft_trainer_class needs TRL: pip install trl") from e
    return type("HyperParallelSFTTrainer", (HyperParallelTrainerMixin, SFTTrainer), {"__doc__": sft_trainer_class.__doc__})


__all__ = ["HyperParallelTrainer", "HyperParallelTrainerMixin", "sft_trainer_class", "data_parallel_coordinates",
           "STATE_DIR"]
