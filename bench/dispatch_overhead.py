"""Per-op dispatch overhead: plain torch vs torch.distributed.tensor.DTensor vs hyper_parallel.DTensor.

    .venv/bin/python bench/dispatch_overhead.py [--iters 20000]
    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 bench/dispatch_overhead.py   (a real 2-rank mesh)

One process, one thread, 64x64 fp32, a 1-rank mesh (gloo), once in grad mode (inputs not requiring grad,
a forward as written) and once under torch.no_grad() (inference, generate: the C fast path's case).
"ours (replicated)" is the all-replicated fast path; "ours (decision cache)" uses Shard(0) on the 1-rank
axis, so every call goes through the cached decision (key build, lookup, redistribution check, wrap) as
a sharded call would.
Cache miss: first call of a new (op, layout, shape) combination, median over fresh shapes.
Under torchrun the mesh has every rank: "split" inputs are then really split over 2 ranks (each rank's 64x64
shard of a 128x64 tensor; a cache hit that needs no communication), and "torch DT split" is torch's DTensor
with Shard(0) on the same mesh, the same pair. Rank 0 prints.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def per_call_us(fn, iters: int) -> float:
    try:
        fn()
    except Exception as e:  # an op without a rule shows up as a NaN row, not a crash
        print(f"skipped: {type(e).__name__}: {str(e)[:120]}")
        return float("nan")
    for _ in range(200):
        fn()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best.append((time.perf_counter() - t0) / iters * 1e6)
    return min(best)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:  # torchrun
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", rank=0, world_size=1)
    world = dist.get_world_size()
    from torch.distributed.tensor import DTensor as TorchDTensor, Replicate, Shard, init_device_mesh
    import hyper_parallel as hp
    from hyper_parallel.dispatch import STATS, clear_caches

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    tmesh = init_device_mesh("cpu", (world,))
    ta, tb = (TorchDTensor.from_local(t, tmesh, [Replicate()]) for t in (a, b))
    tsa, tsb = (TorchDTensor.from_local(t, tmesh, [Shard(0)]) for t in (a, b))
    L = hp.Layout((world,), ("tp",))
    ra, rb = (hp.DTensor.from_local(t, L("None", "None")) for t in (a, b))
    sa, sb = (hp.DTensor.from_local(t, L("tp", "None")) for t in (a, b))

    ops = {
        "add": lambda x, y: x + y,
        "matmul": lambda x, y: x @ y,
        "view": lambda x, y: x.view(x.shape[0] * 64),
    }
    rows = []
    for grad_mode in (True, False):  # a forward as written / under torch.no_grad() (generate, inference)
        with torch.set_grad_enabled(grad_mode):
            for name, op in ops.items():
                plain = per_call_us(lambda: op(a, b), args.iters)
                torch_dt = per_call_us(lambda: op(ta, tb), args.iters // 4)
                rep = per_call_us(lambda: op(ra, rb), args.iters // 2)
                dec = per_call_us(lambda: op(sa, sb), args.iters // 2)
                torch_split = per_call_us(lambda: op(tsa, tsb), args.iters // 4) if name != "matmul" else float("nan")
                rows.append(("grad mode" if grad_mode else "no_grad", name, plain, torch_dt, rep, dec, torch_split))

    # cache misses: a new shape each call
    clear_caches()
    misses = []
    for n in range(8, 72):
        x = hp.DTensor.from_local(torch.randn(n, 16), L("tp", "None"))
        y = hp.DTensor.from_local(torch.randn(n, 16), L("tp", "None"))
        t0 = time.perf_counter()
        x + y
        misses.append((time.perf_counter() - t0) * 1e6)
    miss = statistics.median(misses)

    if dist.get_rank() != 0:
        dist.destroy_process_group()
        return
    print(f"\ntorch {torch.__version__}, 1 thread, 64x64 fp32 (local), {world}-rank mesh, per call (us), cache hits "
          f"(split: Shard(0) over the mesh; matmul of two row-split inputs would need communication, so no split row)")
    print(f"{'mode':10} {'op':8} {'plain':>8} {'torch DT':>9} {'ours rep':>9} {'ours dec':>9} "
          f"{'torchDT+':>9} {'ours+ rep':>9} {'ours+ dec':>9} {'torchDT split+':>15}")
    for mode, name, plain, tdt, rep, dec, tsplit in rows:
        print(f"{mode:10} {name:8} {plain:8.2f} {tdt:9.2f} {rep:9.2f} {dec:9.2f} {tdt - plain:9.2f} "
              f"{rep - plain:9.2f} {dec - plain:9.2f} {tsplit - plain:15.2f}")
    print(f"\nadded cost = time minus plain; cache miss (new shape, add): median {miss:.0f} us; stats {STATS}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
