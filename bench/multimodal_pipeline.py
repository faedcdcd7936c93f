"""Pipeline parallel on a Qwen3-VL-like model (stages cut by structure): step time and peak memory per rank.

Run (4 gloo processes on CPU, pp=4, 1F1B):

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 4 bench/multimodal_pipeline.py [--steps 2]

Model: Qwen3VLForConditionalGeneration, random weights: text hidden 512, 4 decoder layers, vocab 8192; a
2-block vision tower (hidden 512) with deepstack features into layers 0-1; one 224x224 image per sample
(patch 16 -> 196 patches -> 49 image tokens), sequence 1024, global batch 4, AdamW. The first stage holds
the vision tower and the embeddings, the last the final norm and the head; the 3-D rotary positions and
the deepstack features travel with the hidden state. Step time: pipe.step + optimizer step, mean over the
timed steps after a warm-up step, slowest rank, against one process training the plain model on the same
global batch (rank 0 alone, same run). Peak MiB/rank: the most bytes of live tensors during one profiled
step (torch.profiler allocator events, from before the model is built). On the project's 2 shared cores the
4 ranks do not run in parallel: the step time measures the pipeline's overheads, not its speed-up; the
memory per rank is what the cut buys.

A run on the project's 2 shared cores (other jobs running, 2026-12-05), defaults (47.1M params):
one process: 4.889 s/step, peak 1561.0 MiB
rank   layers  step (s) vs 1 proc  peak MiB vs 1 proc
   0      0-0     4.526      0.93     530.5      0.34     (vision tower, embeddings, layer 0)
   1      1-1     4.029      0.82     270.0      0.17
   2      2-2     4.372      0.89     211.3      0.14
   3      3-3     4.385      0.90     280.7      0.18     (layer 3, norm, head)
slowest rank: 4.526 s/step (0.93x one process); busiest rank: 530.5 MiB (0.34x one process)
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


def make_pipeline(args):
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), ("pp",))
    pipe = hp.pipeline(build(args), mesh, schedule="1f1b", n_microbatches=args.microbatches)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-4)


def pipe_step(pipe, opt, batch):
    ids, labels, inputs = batch
    pipe.step(ids, labels=labels, **inputs)
    opt.step()
    opt.zero_grad(set_to_none=True)


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


def one_process(args, batch):
    """Rank 0 trains the plain model on the global batch while the others wait: (seconds, peak bytes)."""
    out = torch.zeros(2, dtype=torch.float64)
    if dist.get_rank() == 0:
        model = build(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        plain_step(model, opt, batch)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            plain_step(model, opt, batch)
            times.append(time.perf_counter() - t0)
        del model, opt
        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model = build(args)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            with record_function("measured_step"):
                plain_step(model, opt, batch)
            del model, opt
            gc.collect()
        out[0], out[1] = statistics.mean(times), peak_in_window(prof, "measured_step")
    dist.broadcast(out, 0)
    return out[0].item(), out[1].item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences, one image each)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    batch = global_batch(args)
    single, single_peak = one_process(args, batch)
    pipe, opt = make_pipeline(args)
    step = timed(lambda: pipe_step(pipe, opt, batch), args.steps)
    layers = [list(s.layers) for s in pipe.specs]
    del pipe, opt
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pipe, opt = make_pipeline(args)
        with record_function("measured_step"):
            pipe_step(pipe, opt, batch)
        del pipe, opt
        gc.collect()
    peak = peak_in_window(prof, "measured_step")
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (step, peak, layers))
    if dist.get_rank() == 0:
        n = sum(p.numel() for p in build(args).parameters())
        print(f"Qwen3-VL-like: text hidden {args.hidden}, {args.layers} layers, 2-block vision tower, "
              f"{n / 1e6:.1f}M params; global batch {args.batch} x {args.seq} tokens, one 224x224 image each; "
              f"pp={len(rows)} 1F1B, {args.microbatches} micro-batches; AdamW")
        print(f"one process: {single:.3f} s/step, peak {single_peak / 2**20:.1f} MiB")
        print(f"{'rank':>4s} {'layers':>8s} {'step (s)':>9s} {'vs 1 proc':>9s} {'peak MiB':>9s} {'vs 1 proc':>9s}")
        for r, (s, p, lay) in enumerate(rows):
            print(f"{r:4d} {str(lay[0][0]) + '-' + str(lay[0][-1]):>8s} {s:9.3f} {s / single:9.2f} "
                  f"{p / 2**20:9.1f} {p / single_peak:9.2f}")
        print(f"slowest rank: {max(r[0] for r in rows):.3f} s/step ({max(r[0] for r in rows) / single:.2f}x one "
              f"process); busiest rank: {max(r[1] for r in rows) / 2**20:.1f} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
