"""Peak memory of loading a Hugging Face folder: hp.from_pretrained on N ranks vs transformers on one device.

    python bench/load_memory.py [--hidden 1024 --layers 6 --vocab 16000] [--ranks 2] [--dir /tmp/hp_load_bench]

Writes a random Llama checkpoint (fp32, a few hundred MB, split into 100 MB safetensors files with an
index, as transformers saves big models), then loads it in fresh processes and reports each process's
peak resident set size (ru_maxrss) and its growth over the same process right before the load (after
importing torch and transformers), next to the checkpoint's size:
- transformers: `AutoModelForCausalLM.from_pretrained(path)` in one process;
- hyper_parallel tp: `hp.from_pretrained(path, mesh)` on a ("tp",) mesh of --ranks gloo processes;
- hyper_parallel dp: the same on a ("dp",) mesh with hsdp level3 (threshold 0).
"private peak growth" is the peak of RssAnon (sampled every ms) over the load: the memory the process
itself allocated. Safetensors files are memory-mapped: the pages a loader reads count in RSS too while
mapped (page cache, shared between ranks and reclaimable), hence the separate RSS columns.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KB


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _anon_mb() -> float:
    """Private (anonymous) resident memory: RSS less the memory-mapped file pages (page cache, shared)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _AnonPeak:
    """Samples RssAnon every millisecond in a thread: its peak over a block."""

    def __enter__(self):
        import threading
        self.peak, self.stop = _anon_mb(), threading.Event()
        self.before = self.peak

        def sample():
            while not self.stop.is_set():
                self.peak = max(self.peak, _anon_mb())
                self.stop.wait(0.001)
        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, _anon_mb())


def write_checkpoint(path: str, hidden: int, layers: int, vocab: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="100MB")
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def run_one(kind: str, path: str) -> None:
    """In a fresh process: load, then write its figures as JSON next to the checkpoint."""
    import torch
    import transformers  # noqa: F401  (imported before the baseline, as by any user)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    if kind == "transformers":
        before = _current_rss_mb()
        with _AnonPeak() as anon:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        import torch.distributed as dist
        import hyper_parallel as hp
        dist.init_process_group("gloo")
        world = dist.get_world_size()
        axis = "tp" if kind == "hp_tp" else "dp"
        mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
        kwargs = {"hsdp": {"threshold": 0, "optimizer_level": "level3"}} if axis == "dp" else {}
        dist.barrier()
        before = _current_rss_mb()
        with _AnonPeak() as anon:
            model = hp.from_pretrained(path, mesh, **kwargs)
        dist.barrier()
    held = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
               for p in model.parameters()) / 2**20
    with open(os.path.join(path, f".bench_{kind}_{rank}.json"), "w") as f:
        json.dump({"kind": kind, "rank": rank, "before_mb": before, "peak_mb": _rss_mb(), "params_mb": held,
                   "anon_growth_mb": anon.peak - anon.before}, f)


def _launch(kind: str, path: str, ranks: int) -> list:
    if kind == "transformers":
        cmd = [sys.executable, __file__, "--worker", kind, "--dir", path]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-port=29531",
               __file__, "--worker", kind, "--dir", path]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    files = [f for f in os.listdir(path) if f.startswith(f".bench_{kind}_")]
    return [json.load(open(os.path.join(path, f))) for f in files]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--worker", default=None)
    args = ap.parse_args()
    if args.worker:
        return run_one(args.worker, args.dir)
    path = args.dir or tempfile.mkdtemp(prefix="hp_load_bench_")
    size = write_checkpoint(path, args.hidden, args.layers, args.vocab) / 2**20
    print(f"checkpoint: {size:.0f} MB of fp32 safetensors in {path}")
    print(f"{'loader':<34} {'rank':>4} {'params held MB':>15} {'private peak growth MB':>23} "
          f"{'RSS growth MB':>14} {'peak RSS MB':>12}")
    for kind, label in (("transformers", "transformers, one process"),
                        ("hp_tp", f"hp.from_pretrained tp={args.ranks}"),
                        ("hp_dp", f"hp.from_pretrained hsdp dp={args.ranks} level3")):
        for r in sorted(_launch(kind, path, args.ranks), key=lambda r: r["rank"]):
            print(f"{label:<34} {r['rank']:>4} {r['params_mb']:>15.0f} {r['anon_growth_mb']:>23.0f} "
                  f"{r['peak_mb'] - r['before_mb']:>14.0f} "
                  f"{r['peak_mb']:>12.0f}")


if __name__ == "__main__":
    main()
