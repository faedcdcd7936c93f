"""hsdp mixed precision and offload (API.md §15) on real gloo processes: the bf16 policy against FSDP2
(torch.distributed.fsdp.fully_shard with the same MixedPrecisionPolicy) on the same data, fp32 against one
plain process, offload against no offload; and fused optimizer kernels, whose writes bump no version counter."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from tests.harness import pool
from tests.test_workflow import tiny

BF16, FP32 = torch.bfloat16, torch.float32
STEPS = 4
ROWS = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(1))


def _share(rank, world):
    n = ROWS.shape[0] // world
    return ROWS[rank * n:(rank + 1) * n]


def _train(model, rows, steps=STEPS, **opt_kw) -> tuple[list, torch.optim.Optimizer]:
    """Global mean losses of `steps` AdamW steps (each rank's loss is the mean over its rows)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **opt_kw)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().float().clone()
        if dist.is_initialized():
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses, opt


def _ours(world, level, mp=None, **kw):
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    kw.setdefault("threshold", 0)
    return hp.hsdp(tiny("llama"), optimizer_level=level, mesh=mesh, mixed_precision=mp, **kw)


def _fsdp2(world, param_dtype, reduce_dtype):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model, mesh = tiny("llama"), init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _dtypes(model, opt) -> tuple[set, set]:
    params = {p.dtype for p in model.parameters()}
    state = {v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"}
    return params, state


def bf16_against_fsdp2(rank, world, variants):
    rows = _share(rank, world)
    want, _ = _train(_fsdp2(world, BF16, FP32), rows)
    out = {}
    for name, (level, kw) in variants.items():
        model = _ours(world, level, hp.MixedPrecision(param_dtype=BF16, reduce_dtype=FP32), **kw)
        seen = []
        model.model.layers[0].mlp.register_forward_hook(lambda m, a, o: seen.append((m.up_proj.weight.dtype, o.dtype)))
        got, opt = _train(model, rows)
        out[name] = (got, _dtypes(model, opt), set(seen))
    return want, out


VARIANTS = {"level1": ("level1", {}), "level2": ("level2", {}), "level3": ("level3", {}),
            "level3 fused async": ("level3", {"comm_fusion": True, "comm_async": True}),
            "level2 offload": ("level2", {"offload": "cpu"})}


def test_bf16_policy_matches_fsdp2_with_fp32_masters():
    for want, out in pool(2).run(bf16_against_fsdp2, VARIANTS):
        for name, (got, (params, state), seen) in out.items():
            assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(got, want)), (name, got, want)
            assert params == {FP32} and state == {FP32}, (name, params, state)  # masters and AdamW state
            assert seen == {(BF16, BF16)}, (name, seen)  # compute: gathered weights and activations in bf16


def fp32_policy_against_one_device(rank, world):
    want, _ = _train(tiny("llama"), ROWS)  # one plain process' computation on the global batch, here
    out = {}
    for level in ("level1", "level3"):
        out[level] = _train(_ours(world, level, hp.MixedPrecision(param_dtype=FP32)), _share(rank, world))[0]
    return want, out


def test_fp32_policy_equals_one_device():
    for want, out in pool(2).run(fp32_policy_against_one_device):
        for level, got in out.items():
            assert all(abs(a - b) <= 1e-5 for a, b in zip(got, want)), (level, got, want)


def offload_against_none(rank, world, level, mixed):
    rows = _share(rank, world)
    mp = hp.MixedPrecision(param_dtype=BF16, reduce_dtype=FP32) if mixed else None
    runs = {}
    for offload in (None, "cpu"):
        model = _ours(world, level, mp, offload=offload, threshold=0.2)  # norms stay unsharded
        losses, opt = _train(model, rows)
        state = model._hsdp_state
        separate = all(p.separate == (mixed or offload is not None) for p in state.params)
        assert any(not p.sharded for p in state.params) and any(p.sharded for p in state.params)
        full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        runs[offload] = (losses, full, separate, {p.device.type for p in model.parameters()})
    return runs


@pytest.mark.parametrize("level,mixed", [("level1", False), ("level3", False), ("level2", True), ("level3", True)])
def test_offload_equals_no_offload(level, mixed):
    for runs in pool(2).run(offload_against_none, level, mixed):
        (l0, p0, sep0, dev0), (l1, p1, sep1, dev1) = runs[None], runs["cpu"]
        assert sep0 and sep1 and dev1 == {"cpu"}
        assert l1 == l0, (l1, l0)
        assert all(torch.equal(p1[n], p0[n]) for n in p0)


def fused_adamw_levels(rank, world):
    want, _ = _train(tiny("llama"), ROWS, steps=3, fused=True)
    return want, {level: _train(_ours(world, level, mp), _share(rank, world), steps=3, fused=True)[0]
                  for level in ("level1", "level2", "level3")
                  for mp in (None, hp.MixedPrecision(param_dtype=FP32))}


def test_fused_adamw_updates_are_gathered_at_every_level():
    """torch's fused AdamW writes the shards without bumping their version: level1/2 must still re-gather."""
    for want, out in pool(2).run(fused_adamw_levels):
        for level, got in out.items():
            assert all(abs(a - b) <= 1e-5 for a, b in zip(got, want)), (level, got, want)


def mixed_with_checkpointing_and_tp(rank, world):
    """bf16 policy with activation checkpointing (equal to without), and composed with shard on ("dp", "tp")."""
    rows = _share(rank, world)
    mp = hp.MixedPrecision(param_dtype=BF16, reduce_dtype=FP32)
    plain = _train(_ours(world, "level3", mp), rows)[0]
    model = _ours(world, "level3", mp)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = _train(model, rows)[0]
    mesh = hp.init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    tp = hp.parallelize(tiny("llama"), mesh, hsdp={"threshold": 0, "optimizer_level": "level3",
                                                   "mixed_precision": mp})
    n = ROWS.shape[0] // (world // 2)
    dp_rank = mesh.coordinate[0]
    tp_losses, opt = _train(tp, ROWS[dp_rank * n:(dp_rank + 1) * n])
    return plain, checkpointed, tp_losses, _dtypes(tp, opt)


def test_bf16_policy_with_activation_checkpointing_and_tp(dist4):
    for plain, checkpointed, tp, (params, state) in dist4.run(mixed_with_checkpointing_and_tp):
        assert checkpointed == plain, (checkpointed, plain)
        # tp splits the bf16 matmuls differently: bf16 rounding apart, the same training
        assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(tp, plain)), (tp, plain)
        assert params == {FP32} and state == {FP32}


def test_policy_arguments_are_checked():
    with pytest.raises(TypeError, match="param_dtype must be a floating-point torch.dtype"):
        hp.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(ValueError, match="offload='gpu'"):
        hp.hsdp(tiny("llama"), offload="gpu")
    with pytest.raises(ValueError, match="disagree"):
        hp.hsdp(tiny("llama"), reduce_dtype=BF16, mixed_precision=hp.MixedPrecision(BF16, reduce_dtype=FP32))
    with pytest.raises(TypeError, match="must be a hyper_parallel.MixedPrecision"):
        hp.hsdp(tiny("llama"), mixed_precision={"param_dtype": BF16})


def bf16_policy_equals_bf16_parameters(device: str = "cpu", level: str = "level3") -> None:
    """One process: the bf16 policy computes exactly what the model does with its parameters (not its
    buffers) cast to bf16; the gradients land on the fp32 masters as the bf16 gradients upcast."""
    ours = hp.hsdp(tiny("llama").to(device), threshold=0, optimizer_level=level,
                   mixed_precision=hp.MixedPrecision(param_dtype=BF16, reduce_dtype=FP32))
    ref = tiny("llama").to(device)
    for p in ref.parameters():
        p.data = p.data.to(BF16)
    rows = ROWS.to(device)
    got, want = ours(input_ids=rows, labels=rows).loss, ref(input_ids=rows, labels=rows).loss
    got.backward()
    want.backward()
    assert torch.equal(got.float(), want.float())
    for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert p.dtype == FP32 and p.grad.dtype == FP32, n
        assert torch.equal(p.grad.full_tensor(), q.grad.float()), n


@pytest.mark.parametrize("level", ["level1", "level3"])
def test_bf16_policy_in_one_process_equals_bf16_parameters(level):
    bf16_policy_equals_bf16_parameters("cpu", level)


# ---- with expert, context and pipeline parallelism -------------------------------------------------------------
def mixed_with_ep_and_cp(rank, world, param_dtype):
    """(our loss, one process' loss) over 2 AdamW steps: ("dp", "ep") via parallelize(ep=True, hsdp=...), and
    ("dp", "cp") with context_parallel then hsdp; the policy's param_dtype given, reduce in fp32."""
    import copy
    from tests.test_context import _batch as cp_batch, _model as cp_model
    from tests.test_expert import _batch as ep_batch, _model as ep_model
    mp = hp.MixedPrecision(param_dtype=param_dtype, reduce_dtype=FP32)
    out = {}
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    ref = ep_model("qwen3_moe")
    model = hp.parallelize(copy.deepcopy(ref), mesh, ep=True,
                           hsdp={"optimizer_level": "level3", "threshold": 0, "mixed_precision": mp})
    ids = ep_batch(8)
    mine = ids.chunk(hp.data_world(mesh))[hp.data_rank(mesh)]
    out["ep"] = _steps(model, ref, lambda m: m(input_ids=mine, labels=mine).loss,
                       lambda m: m(input_ids=ids, labels=ids).loss)
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    ref = cp_model("qwen3")
    model = hp.hsdp(hp.context_parallel(copy.deepcopy(ref), mesh, "cp", "ring"), optimizer_level="level3",
                    threshold=0, mesh=mesh, mixed_precision=mp)
    batch, dp = cp_batch(padded=False), mesh.get_local_rank("dp")
    out["cp"] = _steps(model, ref, lambda m: m(**{k: v[dp:dp + 1] for k, v in batch.items()}).loss,
                       lambda m: m(**batch).loss)  # both rows count 14 labels: the dp mean is the batch loss
    return out


def _steps(model, ref, ours_loss, ref_loss, steps=2):
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref)]
    got, want = [], []
    for _ in range(steps):
        for m, opt, fn, into in ((model, opts[0], ours_loss, got), (ref, opts[1], ref_loss, want)):
            loss = fn(m)
            loss.backward()
            opt.step()
            opt.zero_grad()
            value = loss.full_tensor() if isinstance(loss, hp.DTensor) else loss
            value = value.detach().float().clone()
            if m is model:
                dist.all_reduce(value)
                value /= dist.get_world_size()
            into.append(value.item())
    assert {p.dtype for p in model.parameters()} == {FP32}
    return got, want


@pytest.mark.parametrize("param_dtype,tol", [(FP32, 1e-5), (BF16, 2e-2)])
def test_policy_with_expert_and_context_parallel(dist4, param_dtype, tol):
    """fp32 compute copies (the policy's separate masters) equal one process; bf16 trains alike."""
    for out in dist4.run(mixed_with_ep_and_cp, param_dtype):
        for name, (got, want) in out.items():
            assert all(abs(a - b) <= tol * abs(b) for a, b in zip(got, want)), (name, got, want)


def test_policy_with_pipeline_equals_one_process(dist4):
    from tests.test_pipeline import check_against_reference, train_pipelined
    kwargs = dict(schedule="1f1b", n_microbatches=2,
                  hsdp={"threshold": 0, "optimizer_level": "level3", "mixed_precision": hp.MixedPrecision(FP32)})
    check_against_reference(dist4.run(train_pipelined, "llama", (2, 2), ("pp", "dp"), kwargs), "llama", pp=2)
