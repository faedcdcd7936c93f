"""Model-level overhead in instructions: the same subjects as bench/model_overhead.py, counted by valgrind.

    .venv/bin/python bench/model_instructions.py [--models llama_ref] [--backends plain,ours,"torch DT"]
        [--metrics fwd,gen,train] [--calls 10] [--jobs 2]

Why: on a shared 2-core machine times move by tens of percent between runs, so a change of a few percent
in the dispatcher cannot be seen in seconds. `valgrind --tool=callgrind` counts the instructions a process
executes, and the count does not depend on what else the machine does. Each (backend, metric) runs in its
own process: one with `--calls` calls after the warm-up and one with none; the difference divided by
`--calls` is the cost of one call (a forward, one greedy `generate` of --new-tokens tokens per token, one
training step). Instructions are not time: interpreter code retires fewer instructions per cycle than
the BLAS kernels plain torch spends its time in, so time ratios come out higher than these.
Needs valgrind (Debian package `valgrind`); about a minute per process.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
METRICS = ("fwd", "gen", "train")


def child(backend_name: str, model: str, metric: str, calls: int, new_tokens: int) -> None:
    """Inside valgrind: prepare the subject, warm every metric up, then `calls` calls of `metric`."""
    sys.path.insert(0, HERE)
    import torch
    import torch.distributed as dist
    import model_overhead as mo
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = os.environ.get("HP_BENCH_PORT", "29650")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import transformers
    transformers.logging.set_verbosity_error()
    backend = {"plain": mo.Plain, "ours": mo.Ours, "torch DT": mo.TorchDT}[backend_name]()
    subject = mo.prepare(backend, model, 0, new_tokens, None, cold_repeat=1)
    fn = subject.calls.get(metric)
    if fn is None:
        raise SystemExit(f"{model} / {backend_name}: no {metric}: {getattr(subject.row, metric).err}")
    for m in METRICS:  # the same warm-up in every process, whatever it counts
        if subject.calls.get(m) is not None and m != "train":
            subject.calls[m]()
    if metric == "train":
        fn()
    for _ in range(calls):
        fn()
    dist.destroy_process_group()


def count(backend: str, model: str, metric: str, calls: int, new_tokens: int, port: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out", sys.executable,
               os.path.abspath(__file__), "--child", backend, model, metric, str(calls), str(new_tokens)]
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", HP_BENCH_PORT=str(port))
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    found = re.search(r"Collected : ([\d,]+)", out.stderr)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"{backend} {model} {metric}: {(out.stderr or out.stdout).strip().splitlines()[-1:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama_ref")
    ap.add_argument("--backends", default="plain,ours,torch DT")
    ap.add_argument("--metrics", default=",".join(METRICS))
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=2, help="valgrind processes at once")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        b, m, metric, calls, new_tokens = args.child
        child(b, m, metric, int(calls), int(new_tokens))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found: install it (Debian: apt-get install valgrind)")
    models = [m for m in args.models.split(",") if m]
    backends = [b for b in args.backends.split(",") if b]
    metrics = [m for m in args.metrics.split(",") if m]
    unknown = sorted(set(metrics) - set(METRICS))
    if unknown:
        raise SystemExit(f"unknown metric(s) {unknown}: choose from {','.join(METRICS)}")
    jobs = [(b, m, metric, n) for m in models for b in backends for metric in metrics for n in (0, args.calls)]
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {job: pool.submit(count, *job[:3], job[3], args.new_tokens, 29650 + i)
                   for i, job in enumerate(jobs)}
    per: dict = {}
    for (b, m, metric, n), f in futures.items():
        try:
            per.setdefault((m, b, metric), {})[n] = f.result()
        except Exception as e:
            per.setdefault((m, b, metric), {})["err"] = str(e)
    unit = {"fwd": "forward", "gen": "generate, per token", "train": "train step"}
    print(f"instructions per call (millions), {args.calls} calls minus none; ratio to plain\n")
    print("| model | backend | " + " | ".join(unit[m] for m in metrics) + " |")
    print("|---|---|" + "---|" * len(metrics))
    for m in models:
        for b in backends:
            cells = []
            for metric in metrics:
                got = per.get((m, b, metric), {})
                if "err" in got:
                    cells.append("error: " + got["err"][:80])
                    continue
                div = args.calls * (args.new_tokens if metric == "gen" else 1)
                value = (got[args.calls] - got[0]) / div
                base = per.get((m, "plain", metric), {})
                ratio = ""
                if b != "plain" and "err" not in base and base:
                    ratio = f" ({value / ((base[args.calls] - base[0]) / div):.2f}x)"
                cells.append(f"{value / 1e6:.2f}{ratio}")
            print(f"| {m} | {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
