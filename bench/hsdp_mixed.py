"""hsdp level3 with the bf16 mixed-precision policy vs FSDP2 with the same policy: step time and peak memory.

Run (4 gloo processes on CPU):

    .venv/bin/torchrun --nproc-per-node 4 bench/hsdp_mixed.py [--steps 4] [--hidden 512] [--layers 4] [--rounds 2]

Both sides: `param_dtype=bfloat16, reduce_dtype=float32` (`hp.MixedPrecision` / FSDP2's
`MixedPrecisionPolicy`), fp32 sharded master parameters and AdamW state, every decoder layer and then the
root gathered as units. Model, batches, step and memory accounting are bench/hsdp_step.py's: step time =
forward + backward + AdamW step, mean over timed steps after warm-up, slowest rank; peak memory = the most
bytes of live tensors on a rank during two profiled steps (torch.profiler's allocator events). The
contenders take turns within one run (`--rounds`), so the ratios compare like with like on a loaded host.
hsdp runs fused (one collective per unit, `comm_fusion=True, comm_async=True`) and per parameter
(each shard gathered straight into its parameter's storage).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hsdp_step  # noqa: E402  (its model, batches, timing and memory accounting)


def _policy_ours():
    import hyper_parallel as hp
    return hp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def wrap_fsdp2(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def wrap_ours(fused: bool):
    def wrap(model):
        import hyper_parallel as hp
        return hp.hsdp(model, optimizer_level="level3", threshold=0, comm_async=fused, comm_fusion=fused,
                       mixed_precision=_policy_ours())
    return wrap


WRAPS = {"hsdp level3 bf16 fused": wrap_ours(True), "hsdp level3 bf16": wrap_ours(False),
         "FSDP2 bf16": wrap_fsdp2}
hsdp_step.WRAPS.update(WRAPS)  # hsdp_step's time_steps / peak_memory look the contenders up by name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds (interleaved; best round kept)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    results = {name: {"time": [], "peak": []} for name in WRAPS}
    for _ in range(args.rounds):  # interleaved, so that load changes hit every contender alike
        for name in WRAPS:
            t = torch.tensor([hsdp_step.time_steps(name, args), hsdp_step.peak_memory(name, args)],
                             dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank, the fullest rank
            results[name]["time"].append(t[0].item())
            results[name]["peak"].append(t[1].item())
    if dist.get_rank() == 0:
        n = sum(p.numel() for p in hsdp_step.build_llama(args).parameters())
        print(f"Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}: {n / 1e6:.1f}M params, "
              f"{dist.get_world_size()} gloo ranks, batch {args.batch}x{args.seq} per rank, AdamW, "
              f"bf16 params / fp32 reduce / fp32 masters, {args.rounds} rounds")
        print(f"{'':24s} {'step time (s)':>14s} {'vs FSDP2':>9s} {'peak MiB/rank':>14s} {'vs FSDP2':>9s}")
        best = {name: (min(r["time"]), statistics.median(r["peak"])) for name, r in results.items()}
        ref_t, ref_m = best["FSDP2 bf16"]
        for name, (t, m) in best.items():
            print(f"{name:24s} {t:14.3f} {t / ref_t:9.2f} {m / 2**20:14.1f} {m / ref_m:9.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
