"""What the data-convention check (API §12, parallel/feed.py) costs: a training step with the feed checked on every
forward against the same step checked only on the first, and the check alone, in one run.

Run (2 gloo processes on CPU):

    .venv/bin/torchrun --nproc-per-node 2 bench/feed_check.py [--seq 256] [--hidden 256] [--layers 2] [--steps 20]

Model: Llama (random weights), one micro-batch of 2 x --seq tokens per rank, laid out by `parallelize` on a
("cp",) mesh (ring attention: its input step can refuse a batch, so its feed is checked on every forward by
default) and on a ("tp",) mesh. Each configuration runs --steps steps after two warm-ups with
HYPER_PARALLEL_FEED_CHECK=always and =first alternately, medians of the slowest rank; "check alone" times
`check_feed` on the same inputs. Ratios within one run are what to read on a loaded machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.parallel import feed


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=args.seq, attention_dropout=0.0)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train()


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed_steps(model, ids, policy: str, steps: int) -> float:
    os.environ["HYPER_PARALLEL_FEED_CHECK"] = policy
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(slowest(time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    ids = torch.randint(0, 1024, (2, args.seq), generator=torch.Generator().manual_seed(0))
    rows = []
    for axis, kwargs in (("cp", {"cp": "ring"}), ("tp", {"tp": "auto"})):
        mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
        model = hp.parallelize(build(args), mesh, **kwargs)
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
        every, first = [], []
        for _ in range(2):   # alternate, so that load changes hit both alike
            every.append(timed_steps(model, ids, "always", args.steps // 2))
            first.append(timed_steps(model, ids, "first", args.steps // 2))
        state = feed.feed_of(model)
        named = {"input_ids": ids, "labels": ids}
        checks = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            feed.check_feed(state, named, [s.refuse for s in state.steps])
            checks.append(slowest(time.perf_counter() - start))
        rows.append((axis, statistics.median(every), statistics.median(first), statistics.median(checks)))
    if dist.get_rank() == 0:
        print(f"{world} ranks, Llama hidden {args.hidden}, {args.layers} layers, 2 x {args.seq} tokens per rank")
        print(f"{'mesh':<6} {'step, check every forward (s)':>30} {'step, first only (s)':>21} {'ratio':>6} "
              f"{'check alone (ms)':>17}")
        for axis, every, first, check in rows:
            print(f"{axis:<6} {every:>30.4f} {first:>21.4f} {every / first:>6.3f} {check * 1e3:>17.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
