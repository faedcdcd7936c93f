"""context_parallel (ring / ulysses / allgather) vs one process vs torch's experimental context_parallel:
step time, peak activation memory per rank, bytes sent per attention layer.

Run (4 gloo processes on CPU):

    .venv/bin/torchrun --nproc-per-node 4 bench/context_parallel.py [--seq 4096] [--hidden 256] [--layers 2]

Model: Llama (hidden 256, 2 layers, 8 heads, random weights), one sequence of --seq tokens, labels = ids.
Step time = forward + backward (loss.backward()), mean of --steps after one warm-up, slowest rank.
Peak activation memory = the most bytes of live tensors on a rank during one step, above what was live
when the step began (torch.profiler's allocator events): activations, saved tensors, scores, buffers.
Bytes per attention layer = what leaves a rank inside one attention module's forward (from
`comm_counter`: bytes sent point-to-point, (n-1)/n of what is handed to an all_to_all, n-1 times what is
handed to an all_gather), against each method's minimum: ring and allgather must get the rank's K/V piece
to the n-1 others, (n-1) x the local K/V = (n-1)/n of the full K/V; ulysses must move (n-1)/n of its
local q, k, v and out.
"One process" runs the same model unsplit on rank 0 (transformers' sdpa path).

A run on the project's 2 shared cores (load ~20, so times move by tens of percent; 4 ranks, seq 4096,
--steps 1), 2026-12-03:
                             step s  vs 1p act MiB/rank  vs 1p KiB/attn layer  minimum
one process                  22.434   1.00        204.2   1.00
hp ring                       6.690   0.30         53.2   0.26         6144.0   6144.0
hp ulysses                    6.785   0.30         59.2   0.29         3072.0   3072.0
hp allgather                 11.099   0.49         99.1   0.49         6144.0   6144.0
torch context_parallel: does not run here (NotImplementedError: Operator
    aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding)
(An earlier run of the same, one process alone on the machine: 12.1 s; the ratios above flatter the
split runs by up to 2x: treat step times as rough. Memory and bytes do not depend on load.)
Ring and ulysses activation memory falls as ~1/n (0.26, 0.29 at n = 4), allgather's as ~1/2 (full
K/V per rank); bytes per attention layer are at each method's minimum. Unmasked ring blocks run
torch's CPU flash kernel; masked ones (padding, sliding window) a matmul block of (L/2n)^2 scores.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

import hyper_parallel as hp
from hyper_parallel.redistribute import collectives as C


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=args.seq, attention_dropout=0.0)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train()


def step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def time_steps(model, ids, steps):
    step(model, ids)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(model, ids)
        times.append(time.perf_counter() - t0)
    return statistics.mean(times)


def peak_activation(model, ids):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("measured_step"):
            step(model, ids)
    events = prof.profiler.kineto_results.events()
    window = next(e for e in events if e.name() == "measured_step")
    live, peak, base = 0, 0, None
    for t, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        if base is None and t >= window.start_ns():
            base = live
        live += nbytes
        if window.start_ns() <= t <= window.end_ns():
            peak = max(peak, live)
    return peak - (base or 0)


def attention_bytes(model, ids):
    """Bytes counted inside each attention module's forward, averaged over the layers."""
    counts, handles = C.CommCounts(), []
    layers = [m for n, m in model.named_modules() if n.endswith("self_attn")]
    for m in layers:
        handles.append(m.register_forward_pre_hook(lambda *a: C._COUNTERS.append(counts)))
        handles.append(m.register_forward_hook(lambda *a: C._COUNTERS.remove(counts)))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    n = dist.get_world_size()
    leaving = {"send": 1, "all_to_all": (n - 1) / n, "all_gather": n - 1, "reduce_scatter": (n - 1) / n,
               "all_reduce": 2 * (n - 1) / n}  # bytes that leave the rank per byte handed in
    return sum(leaving[k] * b for k, b in counts.bytes.items()) / len(layers)


def torch_context_parallel(model, ids, mesh_cpu, steps):
    """torch.distributed.tensor.experimental.context_parallel on the same model, if it runs here."""
    from torch.distributed.tensor.experimental import context_parallel
    labels = ids.clone()
    pos = torch.arange(ids.shape[1]).unsqueeze(0)

    def one():
        with context_parallel(mesh_cpu, buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1]):
            loss = model(input_ids=ids, labels=labels, position_ids=pos).loss
            loss.backward()

    one()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    return (time.perf_counter() - t0) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = torch.randint(1, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(0))
    kv_local = 2 * args.hidden * (args.seq // world) * 4  # K and V, float32, one rank's piece
    # what must leave a rank at the least: ring and allgather every other rank's K/V piece... from this
    # rank, its own piece to each of the n-1 others; ulysses (n-1)/n of its q, k, v and out
    minimum = {"ring": (world - 1) * kv_local, "ulysses": (world - 1) / world * 2 * kv_local,
               "allgather": (world - 1) * kv_local}
    rows = []
    if rank == 0:
        base = build(args)
        rows.append(("one process", time_steps(base, ids, args.steps), peak_activation(base, ids), None, None))
    dist.barrier()
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    for method in ("ring", "ulysses", "allgather"):
        model = hp.context_parallel(build(args), mesh, "cp", method)
        t = torch.tensor([time_steps(model, ids, args.steps), peak_activation(model, ids)], dtype=torch.float64)
        dist.all_reduce(t, dist.ReduceOp.MAX)
        rows.append((f"hp {method}", t[0].item(), t[1].item(), attention_bytes(model, ids), minimum[method]))
        del model
    try:
        from torch.distributed.device_mesh import init_device_mesh
        t = torch_context_parallel(build(args), ids, init_device_mesh("cpu", (world,)), args.steps)
        rows.append(("torch context_parallel", t, float("nan"), None, None))
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        rows.append((f"torch context_parallel: does not run here ({type(e).__name__}: {str(e)[:90]})",
                     float("nan"), float("nan"), None, None))
    if rank == 0:
        base_t, base_m = rows[0][1], rows[0][2]
        print(f"seq {args.seq}, hidden {args.hidden}, {args.layers} layers, {world} ranks")
        print(f"{'':26s} {'step s':>8s} {'vs 1p':>6s} {'act MiB/rank':>12s} {'vs 1p':>6s} "
              f"{'KiB/attn layer':>14s} {'minimum':>8s}")
        for name, t, m, b, mn in rows:
            extra = f" {b / 1024:14.1f} {mn / 1024:8.1f}" if b is not None else ""
            print(f"{name[:26]:26s} {t:8.3f} {t / base_t:6.2f} {m / 2**20:12.1f} {m / base_m:6.2f}{extra}")
            if len(name) > 26:
                print("   ", name)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
