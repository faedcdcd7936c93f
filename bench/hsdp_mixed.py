"""hsdp level3 with the bf16 mixed-precision policy vs FSDP2 with the same policy: step time and peak memory.

Run (4 gloo processes on CPU):

    .venv/bin/torchrun --nproc-per-node 4 bench/hsdp_mixed.py [--steps 5] [--hidden 512] [--layers 4] [--rounds 2]

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

import os
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


if __name__ == "__main__":
    hsdp_step.main(WRAPS, reference="FSDP2 bf16", setting="AdamW, bf16 params / fp32 reduce / fp32 masters")
