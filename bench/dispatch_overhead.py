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

    .venv/bin/python bench/dispatch_overhead.py --instructions [--calls 2000]

counts the same calls in instructions with valgrind (callgrind), which the machine's load does not move: one
process, instrumentation off while it imports and warms up, then per subject --calls calls counted alone
(callgrind client requests through a tiny C helper compiled on the spot; needs `cc` and valgrind's headers).
Split inputs are Shard(0) on a 1-rank mesh: the same decision-path cache hit as on 2 ranks (key, lookup, no
move, local op, wrap), on a 64x64 local.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
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


OPS = {
    "add": lambda x, y: x + y,
    "matmul": lambda x, y: x @ y,
    "view": lambda x, y: x.view(x.shape[0] * 64),
    "transpose": lambda x, y: x.transpose(0, 1),
}
# (backend, op, grad mode) counted by --instructions; "dec" is ours with a split input (the decision path)
INSTR_SUBJECTS = [(b, op, g) for op in ("add", "view", "transpose") for g in (True, False)
                  for b in ("plain", "ours rep", "ours dec", "torch DT split")]


_CALLGRIND_C = """
#include <valgrind/callgrind.h>
void hp_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void hp_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void hp_zero(void) { CALLGRIND_ZERO_STATS; }
void hp_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""


def instr_child(calls: int, lib: str) -> None:
    """Inside valgrind (instrumentation off until the subjects are made and warm): per subject, `calls` calls
    with collection on, dumped under the subject's index; nothing else is counted."""
    import ctypes
    cg = ctypes.CDLL(lib)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port to collide on
    from torch.distributed.tensor import DTensor as TorchDTensor, Shard, init_device_mesh
    import hyper_parallel as hp
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    L = hp.Layout((1,), ("tp",))
    tmesh = init_device_mesh("cpu", (1,))
    pairs = {"plain": (a, b), "ours rep": tuple(hp.DTensor.from_local(t, L("None", "None")) for t in (a, b)),
             "ours dec": tuple(hp.DTensor.from_local(t, L("tp", "None")) for t in (a, b)),
             "torch DT split": tuple(TorchDTensor.from_local(t, tmesh, [Shard(0)]) for t in (a, b))}

    def loop(fn, x, y, n):
        for _ in range(n):
            fn(x, y)
    for backend, op, grad_mode in INSTR_SUBJECTS:
        with torch.set_grad_enabled(grad_mode):
            loop(OPS[op], *pairs[backend], 50)
    cg.hp_start()
    for i, (backend, op, grad_mode) in enumerate(INSTR_SUBJECTS):
        with torch.set_grad_enabled(grad_mode):
            loop(OPS[op], *pairs[backend], 20)  # instrumented once before counting
            cg.hp_zero()
            cg.hp_toggle()
            loop(OPS[op], *pairs[backend], calls)
            cg.hp_toggle()
            cg.hp_dump(f"subject {i}".encode())
    dist.destroy_process_group()


def instructions(calls: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "cg.c"), os.path.join(tmp, "libcg.so")
        with open(src, "w") as f:
            f.write(_CALLGRIND_C)
        subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", lib, src], check=True)
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               f"--callgrind-out-file={tmp}/cg.out", sys.executable, os.path.abspath(__file__),
               "--instr-child", str(calls), lib]
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"valgrind failed: {(out.stderr or out.stdout).strip().splitlines()[-5:]}")
        per = {}
        for name in os.listdir(tmp):
            if not name.startswith("cg.out"):
                continue
            text = open(os.path.join(tmp, name)).read()
            trigger = re.search(r"Client Request: subject (\d+)", text)
            total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
            if trigger and total:
                per[INSTR_SUBJECTS[int(trigger.group(1))]] = int(total.group(1)) / calls / 1e3
    print(f"torch {torch.__version__}, 64x64 fp32, 1-rank mesh, thousands of instructions per call "
          f"(callgrind, {calls} calls each); added = minus plain")
    print(f"{'mode':10} {'op':10} {'plain':>7} {'ours rep+':>10} {'ours dec+':>10} {'torchDT split+':>15}")
    for op in ("add", "view", "transpose"):
        for g in (True, False):
            plain = per[("plain", op, g)]
            print(f"{'grad mode' if g else 'no_grad':10} {op:10} {plain:7.1f} {per[('ours rep', op, g)] - plain:10.1f} "
                  f"{per[('ours dec', op, g)] - plain:10.1f} {per[('torch DT split', op, g)] - plain:15.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--instructions", action="store_true", help="count instructions with valgrind instead")
    ap.add_argument("--calls", type=int, default=2000, help="with --instructions: calls per subject")
    ap.add_argument("--instr-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.instr_child:
        instr_child(int(args.instr_child[0]), args.instr_child[1])
        return
    if args.instructions:
        instructions(args.calls)
        return
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

    ops = OPS
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
