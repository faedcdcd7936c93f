"""From a Hugging Face folder to parallel training and back to a Hugging Face folder, with your own loop.

    torchrun --nproc-per-node 4 examples/train.py --model DIR --out OUT [--dp 2 --tp 2] [--steps 5]

1. `hp.from_pretrained(DIR, mesh)` builds the model on the meta device, splits it over "tp" (the
   model's own tp_plan) and shards it over "dp" (hsdp), each rank reading only its slices;
2. every step, each data-parallel rank feeds its micro-batch (its rows of the global batch; ranks of
   one "tp" group feed the same rows), the logged loss is the mean over the "dp" ranks: the loss of
   the global batch;
3. `hyper_parallel.checkpoint.save` writes a resumable checkpoint (model + optimizer + step) that
   `--resume` reads back, on any layout or number of ranks;
4. `hp.save_pretrained(model, OUT)` writes a standard folder that plain transformers loads.
`--check` (used by scripts/main.sh) then loads OUT on rank 0 with plain transformers and compares its
parameters with the parallel model's, and its greedy generation with the parallel model's.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a local Hugging Face folder")
    ap.add_argument("--out", required=True, help="where to write the trained Hugging Face folder")
    ap.add_argument("--dp", type=int, default=None)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per data-parallel rank")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--ckpt", default=None, help="resumable checkpoint folder (default OUT.ckpt)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = args.dp or world // args.tp
    mesh = hp.init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    model = hp.from_pretrained(args.model, mesh, hsdp={"optimizer_level": "level3", "threshold": 0})
    if rank == 0:
        print(hp.summary(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = args.ckpt or args.out.rstrip("/") + ".ckpt"
    start = 0
    if args.resume:
        checkpoint.init_optimizer_state(opt)
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}
        checkpoint.load(state, ckpt)
        checkpoint.apply_optimizer_state(opt, state["optim"])
        start = state["step"]

    share, shares = hp.data_rank(mesh), hp.data_world(mesh)   # API §12: this rank's share of the batch
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    model.train()
    for step in range(start + args.steps):
        batch = torch.randint(0, vocab, (shares * args.micro_batch, args.seq), generator=gen)  # the global batch
        if step < start:
            continue  # the same data stream after a resume
        mine = batch.chunk(shares)[share]  # the "tp" ranks of one data share feed the same rows
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        logged = loss.detach().full_tensor() if isinstance(loss, hp.DTensor) else loss.detach().clone()
        dist.all_reduce(logged)             # mean over every rank = mean over the dp ranks' micro-batches
        if rank == 0:
            print(f"step {step}: loss {logged.item() / world:.5f}", flush=True)

    checkpoint.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": start + args.steps}, ckpt)
    hp.save_pretrained(model, args.out)
    if args.check:
        check(model, args.out, rank)
    dist.destroy_process_group()


def check(model, out: str, rank: int) -> None:
    """Plain transformers loads the folder on one device: same parameters, same greedy tokens."""
    from transformers import AutoModelForCausalLM
    full = {n: p.detach().full_tensor() if isinstance(p, hp.DTensor) else p.detach()
            for n, p in model.named_parameters()}
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    model.eval()
    tokens = model.generate(ids, max_new_tokens=8, do_sample=False)
    tokens = tokens.full_tensor() if isinstance(tokens, hp.DTensor) else tokens
    if rank == 0:
        plain = AutoModelForCausalLM.from_pretrained(out).eval()
        for n, p in plain.named_parameters():
            assert torch.equal(p, full[n]), f"{n} differs after save_pretrained"
        assert torch.equal(plain.generate(ids, max_new_tokens=8, do_sample=False), tokens)
        print(f"check: plain transformers loads {out}: {len(full)} parameters and generated tokens equal")


if __name__ == "__main__":
    main()
