"""torch.compile of a tiny Llama with replicated hyper_parallel DTensor inputs and parameters: graph breaks.

    .venv/bin/python bench/compile_explain.py [--model llama_ref] [--top 10]

Why: issue 19 asks what it would take to compile the single-card scenario. `torch._dynamo.explain` traces
one forward (no labels, no_grad) and reports graphs, graph breaks and their reasons; the wall time of the
explain call is the compile cost (it is a trace, without inductor codegen). Plain torch runs the same for
comparison. Prints the break count, the most frequent reasons and the seconds taken.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama_ref")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--backends", default="plain,ours")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import model_overhead as mo
    for name in args.backends.split(","):
        backend = {"plain": mo.Plain, "ours": mo.Ours}[name]()
        case, model, inputs, _ = mo._prepared(backend, args.model, 0)
        torch._dynamo.reset()
        t0 = time.perf_counter()
        with torch.no_grad():
            ex = torch._dynamo.explain(model)(**inputs)
        secs = time.perf_counter() - t0
        reasons = collections.Counter(str(b.reason).splitlines()[0][:160] for b in ex.break_reasons)
        print(f"{name}: {ex.graph_count} graphs, {ex.graph_break_count} graph breaks, {ex.op_count} ops in graphs, "
              f"{secs:.1f} s")
        for reason, n in reasons.most_common(args.top):
            print(f"  {n:3d} x {reason}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
