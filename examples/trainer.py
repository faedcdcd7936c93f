"""Hugging Face Trainer on a parallel model: `torchrun --nproc-per-node 4 examples/trainer.py --model DIR`.

The model comes from `hp.from_pretrained` on a ("dp", "tp") mesh; `HyperParallelTrainer` is `Trainer`
with what a parallel model needs (no DDP wrap, the global batch split by data-parallel rank, a plain
logged loss, a collective `save_model`). `per_device_train_batch_size` is per data-parallel rank: the
run equals a one-device Trainer with a batch `dp` times larger.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import TrainingArguments

import hyper_parallel as hp
from hyper_parallel.integrations.transformers import HyperParallelTrainer


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, rows: int = 64, seq: int = 16):
        self.rows = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default="trainer_out")
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    dp = dist.get_world_size() // args.tp
    mesh = hp.init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    model = hp.from_pretrained(args.model, mesh, hsdp={"optimizer_level": "level2", "threshold": 0})
    training = TrainingArguments(output_dir=args.out, per_device_train_batch_size=2, max_steps=5, logging_steps=1,
                                 save_strategy="no", report_to=[], use_cpu=True, learning_rate=1e-3)
    trainer = HyperParallelTrainer(model=model, args=training, train_dataset=RandomTokens(model.config.vocab_size))
    trainer.train()
    trainer.save_model(args.out)   # every rank: a standard Hugging Face folder
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
