"""Expert parallel vs today's tensor-parallel experts (`shard` "auto") vs one process: MoE training step.

Run (4 gloo processes on CPU):

    .venv/bin/torchrun --nproc-per-node 4 bench/expert_parallel.py [--hidden 256] [--experts 16] [--layers 4]

Model: a Qwen3-MoE (hidden 256, 16 experts, top-2, 4 layers, random weights from a config), trained with
AdamW on one global batch (`--batch` sequences per rank x `--seq`, the same global batch for everyone):
expert parallel splits it over the 4 ranks of "ep" and sends tokens to their experts by all_to_all;
`shard(model, "auto")` runs the model's own tp_plan (attention split by heads, experts split over "tp",
every rank sees every token, results all-reduced); one process runs it alone on rank 0. Step time =
forward + backward + optimizer step, mean over timed steps after warm-up, slowest rank. Peak memory =
most bytes of live tensors on a rank during one profiled step (torch.profiler allocator events, counted
from before the model is built). all_to_all: calls and bytes this rank sent per MoE layer in one training
step (comm_counter), against the minimum: 2 forward + 2 backward token exchanges, each moving
routed tokens x hidden x 4 bytes x (ep-1)/ep. Our count also has one counts exchange per layer (forward
only, ep-1 rows of experts-per-rank int64). On an oversubscribed host step times vary; use --rounds.

Two runs on 2 shared cores, defaults (hidden 256, 16 experts, top-2, 4 layers, seq 256, global batch
4x256, 14.2M params), --rounds 2; the second ran beside a test suite (load average ~45):
                         step time (s) vs 1 proc  peak MiB/rank  experts MiB/rank
expert parallel           1.639 / 1.539  0.51/0.26   89.7 / 103.6             12.00
TP experts (shard auto)   2.043 / 4.305  0.64/0.74  122.0 / 124.3             12.00
one process               3.189 / 5.809  1.00/1.00  232.3 / 232.3             48.00
all_to_all per MoE layer per rank: 5 calls (4 token exchanges + 1 counts exchange), 1.604 MiB sent
(mean over ranks; busiest rank 1.771) vs 1.500 MiB for uniform routing. Every byte counted is a routed
row leaving its rank, so the token traffic is the minimum for the routing the model chose; the excess
over 1.500 is the router's imbalance (plus 96 bytes of counts).
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


def build(args):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                         moe_intermediate_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=args.hidden // 4, num_experts=args.experts,
                         num_experts_per_tok=args.top_k, max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).float()


def expert_parallel(model):
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    return hp.expert_parallel(model, mesh, "ep")


def tp_experts(model):
    import hyper_parallel as hp
    return hp.shard(model, "auto")


def one_process(model):
    return model


WRAPS = {"expert parallel": expert_parallel, "TP experts (shard auto)": tp_experts, "one process": one_process}


def batches(args, n):
    gen = torch.Generator().manual_seed(100)   # the same global batch on every rank
    return [torch.randint(0, args.vocab, (args.batch * dist.get_world_size(), args.seq), generator=gen)
            for _ in range(n)]


def step(model, opt, x):
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def runs_here(name) -> bool:
    return name != "one process" or dist.get_rank() == 0


def time_steps(name, args) -> float:
    times = []
    if runs_here(name):
        model = WRAPS[name](build(args))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        data = batches(args, args.warmup + args.steps)
        for x in data[: args.warmup]:
            step(model, opt, x)
        for x in data[args.warmup:]:
            t0 = time.perf_counter()
            step(model, opt, x)
            times.append(time.perf_counter() - t0)
        del model, opt
        gc.collect()
    dist.barrier()
    return statistics.mean(times) if times else 0.0


def peak_memory(name, args) -> tuple[float, float]:
    """(peak live bytes during one step, bytes of the experts' weights held by this rank)."""
    if not runs_here(name):
        dist.barrier()
        return 0.0, 0.0
    x = batches(args, 1)[0]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = WRAPS[name](build(args))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        with record_function("measured_step"):
            step(model, opt, x)
        experts = sum(_local(p).numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
        del model, opt
        gc.collect()
    dist.barrier()
    events = prof.profiler.kineto_results.events()
    window = next(e for e in events if e.name() == "measured_step")
    live, peak = 0, 0
    for t, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        if window.start_ns() <= t <= window.end_ns():
            peak = max(peak, live)
    return float(peak), float(experts)


def _local(p):
    return p._local if hasattr(p, "_local") else p


def all_to_all_per_layer(args) -> tuple[float, float, float]:
    """(calls, bytes sent, minimum bytes) per MoE layer in one expert-parallel training step, this rank."""
    import hyper_parallel as hp
    model = expert_parallel(build(args))
    x = batches(args, 1)[0]
    with hp.comm_counter() as c:
        model(input_ids=x, labels=x).loss.backward()
    ep = dist.get_world_size()
    routed = x.numel() // ep * args.top_k
    minimum = 4 * routed * args.hidden * 4 * (ep - 1) / ep
    return c.counts["all_to_all"] / args.layers, c.bytes["all_to_all"] / args.layers, minimum


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank (global batch = this x ranks)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="timing rounds (interleaved; best round kept)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {name: {"time": [], "peak": [], "experts": 0.0} for name in WRAPS}
    for _ in range(args.rounds):  # interleave the contenders so load changes hit them alike
        for name in WRAPS:
            peak, experts = peak_memory(name, args)
            t = torch.tensor([time_steps(name, args), peak, experts], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank, the fullest rank
            results[name]["time"].append(t[0].item())
            results[name]["peak"].append(t[1].item())
            results[name]["experts"] = t[2].item()
    calls, sent, minimum = all_to_all_per_layer(args)
    a2a = torch.tensor([calls, sent, minimum], dtype=torch.float64)
    most = a2a.clone()
    dist.all_reduce(a2a)                                  # mean over ranks
    dist.all_reduce(most, op=dist.ReduceOp.MAX)           # the busiest rank
    a2a /= world
    if rank == 0:
        n = sum(p.numel() for p in build(args).parameters())
        print(f"Qwen3-MoE hidden={args.hidden} experts={args.experts} top-{args.top_k} layers={args.layers} "
              f"seq={args.seq}: {n / 1e6:.1f}M params, {world} gloo ranks, global batch "
              f"{args.batch * world}x{args.seq}, AdamW")
        ref = results["one process"]
        print(f"{'':24s} {'step time (s)':>14s} {'vs 1 proc':>9s} {'peak MiB/rank':>14s} {'experts MiB/rank':>17s}")
        for name, r in results.items():
            t, p = min(r["time"]), statistics.median(r["peak"])
            print(f"{name:24s} {t:14.3f} {t / min(ref['time']):9.2f} {p / 2**20:14.1f} {r['experts'] / 2**20:17.2f}")
        print(f"all_to_all per MoE layer per rank (one training step): {a2a[0].item():.0f} calls "
              f"({a2a[0].item() - 1:.0f} token exchanges + 1 counts exchange; minimum 4), "
              f"{a2a[1].item() / 2**20:.3f} MiB sent (mean over ranks; busiest rank {most[1].item() / 2**20:.3f}) "
              f"vs minimum {a2a[2].item() / 2**20:.3f} MiB (uniform routing)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
