"""Hugging Face Trainer on a parallel model, with Trainer's default checkpointing and a resume.

    python examples/tiny_checkpoint.py /tmp/tiny
    torchrun --nproc-per-node 4 examples/trainer.py --model /tmp/tiny --out /tmp/run --steps 4
    torchrun --nproc-per-node 2 examples/trainer.py --model /tmp/tiny --out /tmp/run --steps 6 --resume  # other mesh

The model comes from `hp.from_pretrained` on a ("dp", "tp") mesh; `HyperParallelTrainer` is `Trainer`
with what a parallel model needs (no DDP wrap, the global batch split by data-parallel rank, a plain
logged loss, collective saving). `per_device_train_batch_size` is per data-parallel rank: the run
equals a one-device Trainer with a batch `dp` times larger, so this script keeps the global batch at
`GLOBAL_BATCH` whatever the mesh. Checkpoints land in `--out/checkpoint-N` every `save_steps` (the
sharded model and optimizer state under `hyper_parallel/`); `--resume` continues from the last one,
on this run's mesh and layout, whatever the saving run's were.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import TrainingArguments

import hyper_parallel as hp
from hyper_parallel.integrations.transformers import HyperParallelTrainer

GLOBAL_BATCH = 4


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, rows: int = 64, seq: int = 16, seed: int = 0):
        self.rows = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default="trainer_out")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    tp = min(args.tp, dist.get_world_size())
    dp = dist.get_world_size() // tp
    mesh = hp.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = hp.from_pretrained(args.model, mesh, hsdp={"optimizer_level": "level2", "threshold": 0})
    training = TrainingArguments(output_dir=args.out, per_device_train_batch_size=GLOBAL_BATCH // dp,
                                 max_steps=args.steps, logging_steps=1, save_steps=2, eval_strategy="steps",
                                 eval_steps=2, report_to=[], use_cpu=True, learning_rate=1e-3,
                                 lr_scheduler_type="constant")  # so that a resumed run may go on longer
    vocab = model.config.vocab_size
    trainer = HyperParallelTrainer(model=model, args=training, train_dataset=RandomTokens(vocab),
                                   eval_dataset=RandomTokens(vocab, rows=8, seed=1))
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(args.out)   # every rank: a standard Hugging Face folder
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
