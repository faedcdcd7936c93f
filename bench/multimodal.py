"""The requirement's Qwen3-VL-like model under tensor, context and pipeline parallel: step time and peak
memory per rank against one process.

Run (4 gloo processes on CPU):

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 4 bench/multimodal.py [--modes tp,cp,pp] [--steps 2]

Model: Qwen3VLForConditionalGeneration, random weights: text hidden 512, 4 decoder layers, vocab 8192; a
2-block vision tower (hidden 512) with deepstack features into layers 0-1; one 224x224 image per sample
(patch 16 -> 196 patches -> 49 image tokens), sequence 1024, global batch 4, AdamW. Modes:
- tp: `shard(model, "auto")` over the 4 ranks (decoder layers, vision blocks, merger by structure); every
  rank feeds the whole batch.
- cp: `context_parallel(model, mesh, method="ring")` over the 4 ranks: the language sequence split (image
  placeholders included), the vision tower whole on every rank; every rank feeds the whole batch.
- pp: `pipeline(model, mesh, schedule="1f1b")`, 4 micro-batches: the first stage holds the vision tower
  and the embeddings, the last the final norm and the head.
Step time: forward + backward + optimizer step, mean over the timed steps after a warm-up step, slowest
rank, against one process training the plain model on the same global batch (rank 0 alone, same run).
Peak MiB/rank: the most bytes of live tensors during one profiled step (torch.profiler allocator events,
from before the model is built). On the project's 2 shared cores the 4 ranks do not run in parallel: step
time measures each parallelism's overheads, not its speed-up; memory per rank is what the split buys.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from hsdp_step import peak_in_window

IMAGE, VSTART, VEND = 8190, 8188, 8189


def build(args):
    import transformers
    torch.manual_seed(0)
    text = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                max_position_embeddings=4096, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [16, 8, 8],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_heads=8, patch_size=16,
                  temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=256,
                  out_hidden_size=args.hidden, deepstack_visual_indexes=[0, 1])
    cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                     video_token_id=8187, vision_start_token_id=VSTART, vision_end_token_id=VEND,
                                     tie_word_embeddings=False)
    return transformers.Qwen3VLForConditionalGeneration(cfg).float().train()


def global_batch(args):
    """One 224x224 image per sample (49 image tokens after the 2x2 merge), text to `seq` tokens."""
    gen = torch.Generator().manual_seed(100)
    grid = (1, 14, 14)
    row = [VSTART] + [IMAGE] * 49 + [VEND]
    ids = torch.randint(0, 8000, (args.batch, args.seq), generator=gen)
    ids[:, 1:1 + len(row)] = torch.tensor(row)
    inputs = {"attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == IMAGE).long(),
              "pixel_values": torch.randn(args.batch * 196, 3 * 2 * 16 * 16, generator=gen),
              "image_grid_thw": torch.tensor([grid] * args.batch)}
    labels = ids.clone()
    labels[ids == IMAGE] = -100
    return ids, labels, inputs


def make_pipeline(args, mesh):
    import hyper_parallel as hp
    pipe = hp.pipeline(build(args), mesh, schedule="1f1b", n_microbatches=args.microbatches)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)

    def step(batch):
        ids, labels, inputs = batch
        pipe.step(ids, labels=labels, **inputs)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def make_model(args, mesh, mode):
    """tp or cp on the whole mesh: every rank feeds the same global batch, the model does the split."""
    import hyper_parallel as hp
    model = build(args)
    model = hp.shard(model, "auto", mesh=mesh) if mode == "tp" else hp.context_parallel(model, mesh, method="ring")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return lambda batch: plain_step(model, opt, batch)


def make(args, mode):
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), (mode,))
    return make_pipeline(args, mesh) if mode == "pp" else make_model(args, mesh, mode)


def plain_step(model, opt, batch):
    ids, labels, inputs = batch
    model(input_ids=ids, labels=labels, **inputs).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(step, steps):
    step()   # warm-up: builds the stages, infers the P2P shapes
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.mean(times)


def profiled_peak(make_step, batch) -> int:
    """Peak bytes of live tensors during one step of a fresh `make_step()`, counted from before it is built."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = make_step()
        with record_function("measured_step"):
            step(batch)
        del step
        gc.collect()
    return peak_in_window(prof, "measured_step")


def make_plain(args):
    model = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return lambda batch: plain_step(model, opt, batch)


def one_process(args, batch):
    """Rank 0 trains the plain model on the global batch while the others wait: (seconds, peak bytes)."""
    out = torch.zeros(2, dtype=torch.float64)
    if dist.get_rank() == 0:
        step = make_plain(args)
        step(batch)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - t0)
        del step
        out[0], out[1] = statistics.mean(times), profiled_peak(lambda: make_plain(args), batch)
    dist.broadcast(out, 0)
    return out[0].item(), out[1].item()


def measure(args, mode: str, batch) -> list:
    """Every rank's (mean step seconds, peak bytes of one profiled step) under `mode`."""
    step = make(args, mode)
    seconds = timed(lambda: step(batch), args.steps)
    del step
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (seconds, profiled_peak(lambda: make(args, mode), batch)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences, one image each)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--modes", default="tp,cp,pp", help="comma-separated among tp, cp, pp")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    batch = global_batch(args)
    single, single_peak = one_process(args, batch)
    results = {mode: measure(args, mode, batch) for mode in args.modes.split(",")}
    if dist.get_rank() == 0:
        n = sum(p.numel() for p in build(args).parameters())
        print(f"Qwen3-VL-like: text hidden {args.hidden}, {args.layers} layers, 2-block vision tower, "
              f"{n / 1e6:.1f}M params; global batch {args.batch} x {args.seq} tokens, one 224x224 image each; "
              f"{dist.get_world_size()} ranks; AdamW")
        print(f"one process: {single:.3f} s/step, peak {single_peak / 2**20:.1f} MiB")
        print(f"{'mode':>4s} {'slowest s':>9s} {'vs 1 proc':>9s} {'peak MiB per rank':>36s} {'busiest vs 1':>12s}")
        for mode, rows in results.items():
            slowest, peaks = max(r[0] for r in rows), [r[1] / 2**20 for r in rows]
            print(f"{mode:>4s} {slowest:9.3f} {slowest / single:9.2f} {' / '.join(f'{p:.0f}' for p in peaks):>36s} "
                  f"{max(peaks) * 2**20 / single_peak:12.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
