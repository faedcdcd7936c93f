"""Checkpoint save/load throughput: hyper_parallel.checkpoint vs torch.distributed.checkpoint (DCP).

    torchrun --nproc-per-node 4 bench/checkpoint_io.py [--size-mb 1024] [--dir /tmp/hp_ckpt_bench]

A 2x2 mesh ("dp", "tp") holds --size-mb of fp32 tensors (16 MB each) in four layouts: split over
both axes, split on one dim by both, split by tp and replicated over dp (written once), split by
dp on dim 1. Both libraries save the same local shards (DCP through torch DTensors built from them)
and load them back into the same layouts; hyper_parallel also loads into different layouts
(resharding on read) and without checksums. MB/s = global bytes / wall time (barrier to barrier).
Both write with fsync; loads read through the page cache of the save just made (no cache drop).
"""
from __future__ import annotations

import argparse
import os
import shutil
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--dir", default="/tmp/hp_ckpt_bench")
    ap.add_argument("--repeat", type=int, default=1, help="best of N per measurement")
    args = ap.parse_args()

    torch.set_num_threads(1)
    from hyper_parallel import DTensor, Layout
    from hyper_parallel import checkpoint as ckpt
    from hyper_parallel.layout.placement import Shard as HpShard
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor as TorchDTensor, Replicate, Shard

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "run with torchrun --nproc-per-node 4"
    L = Layout((2, 2), ("dp", "tp"))
    kinds = [L("dp", "tp"), L(("dp", "tp"), "None"), L("tp", "None"), L("None", "dp")]
    other = [L("tp", "dp"), L("None", ("tp", "dp")), L("None", "tp"), L("dp", "None")]
    rows, cols = 4096, 1024  # 16 MB fp32
    n = max(1, args.size_mb // 16)
    total = n * rows * cols * 4

    def make_state(layouts, zero):
        out = {}
        for i in range(n):
            lay = layouts[i % len(layouts)]
            local_shape = lay.local_shape((rows, cols))
            if zero:
                local = torch.zeros(local_shape)
            else:
                off = lay.local_offset((rows, cols))
                full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(i))
                local = full[off[0]:off[0] + local_shape[0], off[1]:off[1] + local_shape[1]].clone()
            out[f"layer{i}.weight"] = DTensor.from_local(local, lay, shape=(rows, cols))
        return out

    tmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def to_torch(state):
        out = {}
        for k, v in state.items():
            pl = tuple(Shard(p.dim) if isinstance(p, HpShard) else Replicate() for p in v.placements)
            # hyper_parallel splits a dim by its axes outer first; torch orders repeated Shard(d) by mesh dim
            out[k] = TorchDTensor.from_local(v.to_local(), tmesh, pl, run_check=False, shape=v.shape,
                                             stride=(cols, 1))
        return out

    def timed(fn):
        best = float("inf")
        for _ in range(args.repeat):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            best = min(best, time.perf_counter() - t0)
        return best

    src = make_state(kinds, zero=False)
    hp_dir, dcp_dir = os.path.join(args.dir, "hp"), os.path.join(args.dir, "dcp")
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    dist.barrier()
    results = []
    results.append(("hyper_parallel save", timed(lambda: ckpt.save(src, hp_dir))))
    same = make_state(kinds, zero=True)
    results.append(("hyper_parallel load (same layouts)", timed(lambda: ckpt.load(same, hp_dir))))
    results.append(("hyper_parallel load (same, no checksum)", timed(lambda: ckpt.load(same, hp_dir, verify=False))))
    resharded = make_state(other, zero=True)
    results.append(("hyper_parallel load (other layouts)", timed(lambda: ckpt.load(resharded, hp_dir))))
    for k in list(src)[:4]:  # spot-check: resharded values equal the source
        assert torch.equal(resharded[k].full_tensor(), src[k].full_tensor()), k
    tsrc = to_torch(src)
    results.append(("torch DCP save", timed(lambda: dcp.save(tsrc, checkpoint_id=dcp_dir))))
    tdst = to_torch(make_state(kinds, zero=True))
    results.append(("torch DCP load (same layouts)", timed(lambda: dcp.load(tdst, checkpoint_id=dcp_dir))))
    tother = to_torch(make_state(other, zero=True))
    results.append(("torch DCP load (other layouts)", timed(lambda: dcp.load(tother, checkpoint_id=dcp_dir))))
    k0 = next(iter(tdst))
    assert torch.equal(tdst[k0].to_local(), same[k0].to_local())
    if rank == 0:
        mb = total / 2**20
        print(f"{n} tensors x 16 MB = {mb:.0f} MB fp32 on {world} ranks (2x2 mesh), dir {args.dir}")
        for name, t in results:
            print(f"{name:<42} {t:8.3f} s  {mb / t:8.1f} MB/s")
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
