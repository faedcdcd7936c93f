"""Pipeline parallel (hyper_parallel.pipeline on torch's schedules): step time, bubble, peak memory per rank.

Run (4 gloo processes on CPU, pp=4):

    .venv/bin/torchrun --nproc-per-node 4 bench/pipeline.py [--hidden 256] [--layers 8] [--steps 2]

Model: a Llama (hidden 256, 8 layers, random weights) trained with AdamW on one global batch per step,
the same on every rank. For each schedule and n_microbatches in {4, 8}:
- step time: pipe.step + optimizer step, mean over timed steps after a warm-up step, slowest rank;
  "vs 1 proc": against one process training the plain model on the same global batch (rank 0 alone,
  measured in the same run);
- bubble: per rank, 1 - (time inside the stage's forward/backward chunks) / (step time), mean over
  ranks, next to the schedule's theory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for the
  interleaved schedules with v stages per rank, ~0 for the zero-bubble ones when F = B = W;
- peak MiB/rank: the most bytes of live tensors during one profiled step (torch.profiler allocator
  events, from before the model is built: parameters, gradients, optimizer state, activations).
On an oversubscribed CPU host (4 ranks on 2 shared cores) ranks do not really run in parallel, so step
times and bubbles measure the schedule's structure only loosely: a waiting rank's core goes to another,
and a rank descheduled inside a chunk counts as busy, outside one as bubble.

A run on the project's 2 shared cores (load average ~35, 2026-12-03), defaults (7.1M params, global batch
16x64, pp=4); one process: 5.10 s/step:
schedule            v   m  step (s) vs 1 proc  bubble  theory  peak MiB/rank
gpipe               1   4     3.207      0.63   0.503   0.429           70.9
gpipe               1   8     3.971      0.78   0.451   0.273           69.7
1f1b                1   4     3.667      0.72   0.486   0.429           51.8
1f1b                1   8     3.958      0.78   0.375   0.273           38.2
interleaved_1f1b    2   4     4.105      0.81   0.455   0.273           53.8
interleaved_1f1b    2   8     4.106      0.81   0.390   0.158           49.2
interleaved_zb      2   4     3.544      0.70   0.419   0.000           80.0
interleaved_zb      2   8     4.383      0.86   0.350   0.000           54.7
zbv                 2   4     3.118      0.61   0.307   0.000           54.5
zbv                 2   8     5.456      1.07   0.281   0.000           48.7
Memory follows the schedules' structure (GPipe keeps every micro-batch's activations, 1F1B at most p);
the bubbles sit 5-25 points above theory here, where the ranks share two cores with other jobs.
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

from hsdp_step import build_llama, peak_in_window  # same model and memory accounting as the hsdp bench

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2), ("zbv", 2)]


def global_batch(args):
    gen = torch.Generator().manual_seed(100)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)


def make_pipeline(args, schedule, spr, m):
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), ("pp",))
    pipe = hp.pipeline(build_llama(args), mesh, schedule=schedule, n_microbatches=m, stages_per_rank=spr)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-4)


def train_step(pipe, opt, x):
    pipe.step(x, labels=x)
    opt.step()
    opt.zero_grad(set_to_none=True)


class Busy:
    """Time spent inside the stages' forward and backward chunks (the rest of a step is bubble)."""

    def __init__(self, pipe, x):
        self.seconds = 0.0
        schedule = pipe._schedules[((tuple(x.shape), ()), True)]
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
        return run


def time_pipeline(args, schedule, spr, m):
    pipe, opt = make_pipeline(args, schedule, spr, m)
    x = global_batch(args)
    train_step(pipe, opt, x)                       # warm-up: builds the stages, infers P2P shapes
    busy = Busy(pipe, x)
    times, bubbles = [], []
    for _ in range(args.steps):
        dist.barrier()
        busy.seconds = 0.0
        t0 = time.perf_counter()
        train_step(pipe, opt, x)
        dt = time.perf_counter() - t0
        times.append(dt)
        bubbles.append(1 - busy.seconds / dt)
    del pipe, opt
    gc.collect()
    return statistics.mean(times), statistics.mean(bubbles)


def peak_pipeline(args, schedule, spr, m):
    x = global_batch(args)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pipe, opt = make_pipeline(args, schedule, spr, m)
        with record_function("measured_step"):
            train_step(pipe, opt, x)
        del pipe, opt
        gc.collect()
    return peak_in_window(prof, "measured_step")


def time_one_process(args):
    """Rank 0 trains the plain model on the global batch while the other ranks wait."""
    out = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        model = build_llama(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = global_batch(args)
        times = []
        for i in range(args.steps + 1):
            t0 = time.perf_counter()
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i:
                times.append(time.perf_counter() - t0)
        out[0] = statistics.mean(times)
    dist.broadcast(out, 0)
    return out.item()


def theory(schedule, spr, p, m):
    if schedule in ("interleaved_zb", "zbv"):
        return 0.0
    return (p - 1) / (spr * m + p - 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--microbatches", default="4,8")
    ap.add_argument("--schedules", default=",".join(s for s, _ in CASES))
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    p = dist.get_world_size()
    wanted = args.schedules.split(",")
    single = time_one_process(args)
    rows = []
    for schedule, spr in [c for c in CASES if c[0] in wanted]:
        for m in [int(v) for v in args.microbatches.split(",")]:
            step, bubble = time_pipeline(args, schedule, spr, m)
            peak = peak_pipeline(args, schedule, spr, m)
            t = torch.tensor([step, bubble, peak], dtype=torch.float64)
            worst = t.clone()
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            mean = t.clone()
            dist.all_reduce(mean)
            rows.append((schedule, spr, m, worst[0].item(), mean[1].item() / p, worst[2].item()))
    if dist.get_rank() == 0:
        n = sum(q.numel() for q in build_llama(args).parameters())
        print(f"Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}: {n / 1e6:.1f}M params; "
              f"global batch {args.batch}x{args.seq}; pp={p} gloo ranks; AdamW; one process: {single:.3f} s/step")
        print(f"{'schedule':18s} {'v':>2s} {'m':>3s} {'step (s)':>9s} {'vs 1 proc':>9s} {'bubble':>7s} "
              f"{'theory':>7s} {'peak MiB/rank':>14s}")
        for schedule, spr, m, step, bubble, peak in rows:
            print(f"{schedule:18s} {spr:2d} {m:3d} {step:9.3f} {step / single:9.2f} {bubble:7.3f} "
                  f"{theory(schedule, spr, p, m):7.3f} {peak / 2**20:14.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
