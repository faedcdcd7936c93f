"""Optimizer step on DTensor parameters vs plain tensors: AdamW / Adam / SGD, per-tensor loop, foreach, fused.

    OMP_NUM_THREADS=1 .venv/bin/python bench/optimizer_step.py [--repeat 200]
    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 bench/optimizer_step.py   (split rows on 2 real ranks)

The parameters have the shapes of the tiny Llama of bench/model_overhead.py (hidden 64, 2 layers, vocab 128:
21 tensors). "ours rep": DTensors replicated on the mesh; "ours split": every matrix split over the mesh along
dim 0 (vectors replicated), gradients laid out like their parameter, as backward gives them. Under torchrun the
plain row runs each rank's local shapes, so every row does the same arithmetic. Thread CPU time per step,
median of --repeat steps after a warm-up, rank 0 prints; ratios are to the plain row of the same optimizer and path.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

SHAPES = [(128, 64)] + [(64, 64)] * 4 * 2 + [(172, 64), (172, 64), (64, 172)] * 2 + [(64,)] * 5 + [(128, 64)]
OPTIMIZERS = {"AdamW": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01)),
              "Adam": (torch.optim.Adam, dict(lr=1e-3)),
              "SGD": (torch.optim.SGD, dict(lr=1e-3, momentum=0.9))}
PATHS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def step_time(params, grads, cls, kw, repeat: int) -> float:
    for p, g in zip(params, grads):
        p.grad = g
    opt = cls(params, **kw)
    for _ in range(5):
        opt.step()
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        opt.step()
        times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world, rank = dist.get_world_size(), dist.get_rank()
    import hyper_parallel as hp
    mesh = hp.Layout((world,), ("tp",))
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=g) for s in SHAPES]
    full_grads = [torch.randn(s, generator=g) for s in SHAPES]

    def split_layout(t):
        return mesh("tp", *["None"] * (t.ndim - 1)) if t.ndim > 1 else mesh(*["None"] * t.ndim)

    def backend(name):
        if name == "plain":  # each rank's local shapes, so every row does the same arithmetic
            lay = [split_layout(t) for t in full] if world > 1 else None
            ps = [hp.distribute_tensor(t, l).to_local() if lay else t.clone() for t, l in zip(full, lay or full)]
            gs = [hp.distribute_tensor(t, l).to_local() if lay else t.clone() for t, l in zip(full_grads, lay or full)]
            return [torch.nn.Parameter(p) for p in ps], gs
        layouts = [mesh(*["None"] * t.ndim) if name == "ours rep" else split_layout(t) for t in full]
        ps = [torch.nn.Parameter(hp.distribute_tensor(t.clone(), l)) for t, l in zip(full, layouts)]
        return ps, [hp.distribute_tensor(t.clone(), l) for t, l in zip(full_grads, layouts)]

    rows = []
    for opt_name, (cls, kw) in OPTIMIZERS.items():
        for path, extra in PATHS.items():
            cells = {}
            for name in ("plain", "ours rep", "ours split"):
                params, grads = backend(name)
                try:
                    cells[name] = step_time(params, grads, cls, {**kw, **extra}, args.repeat)
                except Exception as e:  # a path without a rule shows as an error cell, not a crash
                    cells[name] = f"error: {type(e).__name__}: {str(e)[:60]}"
            rows.append((opt_name, path, cells))
    if rank == 0:
        print(f"torch {torch.__version__}, {world}-rank mesh, {len(SHAPES)} parameters (tiny Llama shapes), thread "
              f"CPU ms per step, median of {args.repeat}; load {os.getloadavg()[0]:.1f}\n")
        print("| optimizer | path | plain | ours replicated | ours split (dim 0) |")
        print("|---|---|---|---|---|")
        for opt_name, path, cells in rows:
            base = cells["plain"]

            def cell(v):
                if isinstance(v, str) or isinstance(base, str):
                    return str(v)
                return f"{v:.3f} ({v / base:.2f}x)"
            print(f"| {opt_name} | {path} | {cell(base).split(' ')[0]} | {cell(cells['ours rep'])} | "
                  f"{cell(cells['ours split'])} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
