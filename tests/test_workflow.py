"""The transformers workflow on real gloo processes, always against one plain process on the global batch:
module methods on parallelized models (§7), clip_grad_norm_, parallelize, from_pretrained / save_pretrained,
custom_shard. Several checks share one pool call to keep the suite fast."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from tests.harness import pool

SEQ = 8


def tiny(family: str, tie: bool = False):
    """A tiny random model of a family (same weights on every rank: seeded)."""
    torch.manual_seed(0)
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=tie)
        return LlamaForCausalLM(cfg).float()
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    return Qwen3ForCausalLM(cfg).float()


def _full(t):
    return t.full_tensor() if isinstance(t, hp.DTensor) else t


def _parallel(model, how: str, world: int):
    if how in ("shard", "both"):
        mesh = hp.init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp")) if how == "both" else None
        model = hp.shard(model, "auto", mesh)
        if how == "both":
            return hp.hsdp(model, mesh=mesh, threshold=0, optimizer_level="level3")
        return model
    return hp.hsdp(model, threshold=0, optimizer_level=how)


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


# ---- module methods ---------------------------------------------------------------------------------
def _check_dtype(model, dtype):
    for name, p in model.named_parameters():
        assert p.dtype == dtype and p.to_local().dtype == dtype, (name, p.dtype, p.to_local().dtype)
    for p in getattr(model, "_hsdp_state", None).params if hasattr(model, "_hsdp_state") else ():
        assert p.buffer.dtype == dtype and p.compute.dtype == dtype and p.sparam._local.dtype == dtype, p.fqn


def module_methods(rank, world, family, how):
    ref = tiny(family, tie=True)
    model = _parallel(copy.deepcopy(ref), how, world)
    ids = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(3))
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    params_before = list(model.parameters())
    # dtype conversions really change every face of the parameters, and keep them the same objects
    for convert, dtype in ((lambda m: m.to(torch.bfloat16), torch.bfloat16), (lambda m: m.float(), torch.float32),
                           (lambda m: m.half(), torch.float16), (lambda m: m.bfloat16(), torch.bfloat16),
                           (lambda m: m.to(dtype=torch.float32), torch.float32)):
        assert convert(model) is model
        convert(ref)
        _check_dtype(model, dtype)
        if dtype is not torch.float16:  # CPU half matmuls are slow and loose
            with torch.no_grad():
                got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            assert got.dtype == dtype
            torch.testing.assert_close(_full(got), want, atol=tol, rtol=tol)
    after = list(model.parameters())
    assert len(after) == len(params_before) and all(a is b for a, b in zip(after, params_before))
    assert (model.get_input_embeddings().weight is model.get_output_embeddings().weight) == tied
    assert model.to("cpu") is model and model.cpu() is model
    _check_dtype(model, torch.float32)
    # state_dict / load_state_dict round trip (values, not only keys)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(0.5)
    model.load_state_dict(sd)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(_full(v), _full(ref.state_dict()[k]), atol=0, rtol=0)
    # clip_grad_norm_: the single-device norm, and clipping as on one device
    dp = 1 if how == "shard" else (world // 2 if how == "both" else world)
    dp_rank = 0 if how == "shard" else (rank // 2 if how == "both" else rank)
    full_ids = torch.randint(0, 96, (2 * dp, SEQ), generator=torch.Generator().manual_seed(5))
    mine = full_ids[2 * dp_rank: 2 * dp_rank + 2]
    _loss(ref, full_ids).backward()
    _loss(model, mine).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    torch.testing.assert_close(_full(got), want, atol=1e-6, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.grad), q.grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family,how", [("llama", "shard"), ("qwen3", "level1"), ("llama", "level3")])
def test_module_methods_2(family, how):
    pool(2).run(module_methods, family, how)


def test_module_methods_shard_hsdp_4():
    pool(4).run(module_methods, "qwen3", "both")


# ---- from_pretrained / save_pretrained ----------------------------------------------------------------
def _generate(model, ids):
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    return _full(out)


def _same_params(model, ref, atol=0.0):
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(_full(p.detach()), want[name].detach(), atol=atol, rtol=0 if not atol else 1e-5,
                                   msg=name)


def _plain_load(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def pretrained_roundtrip(rank, world, family, tmp, max_shard_size):
    """transformers folder -> hp.from_pretrained (tp, then dp) -> generate -> save_pretrained -> plain load."""
    ref = tiny(family, tie=family == "qwen3").eval()
    src = f"{tmp}/src"
    if rank == 0:
        ref.save_pretrained(src, max_shard_size=max_shard_size)
    dist.barrier()
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    want = ref.generate(ids, max_new_tokens=6, do_sample=False)
    for how, mesh_names, kwargs in (("tp", ("tp",), {}), ("dp", ("dp",), {"hsdp": {"threshold": 0,
                                                                                  "optimizer_level": "level3"}})):
        mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=mesh_names)
        model = hp.from_pretrained(src, mesh, **kwargs)
        assert not model.training
        if family == "qwen3":
            assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
        if how == "tp":
            assert any(p.dist_layout.sharded_axes for p in model.parameters())
            assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
        _same_params(model, ref)
        assert torch.equal(_generate(model, ids), want), how
        out = f"{tmp}/out_{how}"
        model.save_pretrained(out, max_shard_size=max_shard_size)
        if rank == 0:
            import json
            import os
            files = sorted(os.listdir(out))
            assert ("model.safetensors.index.json" in files) == (max_shard_size != "50GB"), files
            plain = _plain_load(out).eval()
            assert json.load(open(f"{out}/config.json"))["architectures"] == [type(ref).__name__]
            _same_params(plain, ref)
            assert torch.equal(plain.generate(ids, max_new_tokens=6, do_sample=False), want)
        dist.barrier()


@pytest.mark.parametrize("family,max_shard_size", [("llama", "50GB"), ("qwen3", "20KB")])
def test_pretrained_roundtrip(tmp_path, family, max_shard_size):
    pool(2).run(pretrained_roundtrip, family, str(tmp_path), max_shard_size)


# ---- parallelize on a (dp, tp) mesh ----------------------------------------------------------------
def parallelize_2x2(rank, world, family, tmp):
    ref = tiny(family, tie=family == "qwen3")
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = hp.parallelize(copy.deepcopy(ref), mesh, hsdp={"threshold": 0, "optimizer_level": "level3"})
    text = hp.summary(model)
    assert "tp:" in text and "dp: hsdp level3" in text, text
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(7)
    dp_rank = mesh.get_coordinate()[0] if hasattr(mesh, "get_coordinate") else rank // 2
    for step in range(3):
        batch = torch.randint(0, 96, (4, SEQ), generator=gen)
        want = _loss(ref, batch)
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = _loss(model, batch[2 * dp_rank: 2 * dp_rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = _full(loss).detach().clone()
        dist.all_reduce(mean)
        assert abs(mean.item() / world - want.item()) < 1e-5, (step, mean.item() / world, want.item())
    _same_params(model, ref, atol=1e-5)
    model.save_pretrained(f"{tmp}/trained", max_shard_size="30KB")
    if rank == 0:
        plain = _plain_load(f"{tmp}/trained").eval()
        _same_params(plain, ref, atol=1e-5)
    dist.barrier()
    for bad in ({"ep": True}, {"cp": "ring"}, {"tp": {"model.layers.*.mlp.up_proj": "colwise"},
                                               "hsdp": {}}):
        with pytest.raises(ValueError, match="asks for mesh axis"):
            hp.parallelize(tiny(family), hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), **bad)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_parallelize_2x2(tmp_path, family):
    pool(4).run(parallelize_2x2, family, str(tmp_path))


# ---- custom_shard -------------------------------------------------------------------------------------
def custom_shard_check(rank, world):
    from hyper_parallel import Partial, Replicate, Shard
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    gen = torch.Generator().manual_seed(11)
    x_full = torch.randn(8, 6, generator=gen)
    w_full = torch.randn(4, 6, generator=gen)
    # plain torch reference
    xr, wr = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
    ref_rows = torch.nn.functional.gelu(xr @ wr.T)
    ref_cols = xr @ wr.T
    (ref_rows.square().sum() + ref_cols.sum()).backward()

    x = hp.distribute_tensor(x_full, mesh, [Replicate()]).requires_grad_()
    w = hp.distribute_tensor(w_full, mesh, [Replicate()]).requires_grad_()
    # rows: x redistributed to Shard(0) first; w replicated, its local gradient a partial sum
    rows_fn = hp.custom_shard(lambda a, b: torch.nn.functional.gelu(a @ b.T), mesh, out_placements=(Shard(0),),
                              in_placements=((Shard(0),), None), in_grad_placements=(None, (Partial(),)))
    rows = rows_fn(x, w)
    assert rows.placements == (Shard(0),) and rows.to_local().shape == (8 // world, 4)
    # columns: w split on its rows -> output split on its last dim; x's local gradient a partial sum
    w_split = w.redistribute(mesh, [Shard(0)])
    cols = hp.custom_shard(lambda a, b: a @ b.T, mesh, (Shard(1),), in_grad_placements=((Partial(),), None))(x, w_split)
    torch.testing.assert_close(rows.full_tensor(), ref_rows)
    torch.testing.assert_close(cols.full_tensor(), ref_cols)
    (rows.square().sum() + cols.sum()).backward()
    torch.testing.assert_close(_full(x.grad), xr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_full(w.grad), wr.grad, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="in_placements has 1 entries"):
        hp.custom_shard(torch.neg, mesh, (Shard(0),), in_placements=((Shard(0),),))(x, w)


def test_custom_shard():
    pool(2).run(custom_shard_check)


# ---- Hugging Face Trainer -------------------------------------------------------------------------------
class _TokenData(torch.utils.data.Dataset):
    def __init__(self):
        self.rows = torch.randint(0, 96, (24, SEQ), generator=torch.Generator().manual_seed(21))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _trainer_losses(model, trainer_cls, batch, out):
    from transformers import TrainingArguments
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=3, logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, learning_rate=1e-2, seed=3,
                             disable_tqdm=True, max_grad_norm=0.5)
    trainer = trainer_cls(model=model, args=args, train_dataset=_TokenData())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def trainer_parallel(rank, world, tmp):
    from hyper_parallel.integrations.transformers import HyperParallelTrainer
    out = {}
    for axis in ("dp", "tp"):
        mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
        kwargs = {"hsdp": {"threshold": 0, "optimizer_level": "level2"}} if axis == "dp" else {}
        model = hp.parallelize(tiny("llama"), mesh, **kwargs)
        batch = 4 // world if axis == "dp" else 4
        out[axis], trainer = _trainer_losses(model, HyperParallelTrainer, batch, f"{tmp}/{axis}")
    trainer.save_model(f"{tmp}/final")
    return out


def test_trainer_matches_one_device(tmp_path):
    from transformers import Trainer
    want, _ = _trainer_losses(tiny("llama"), Trainer, 4, str(tmp_path / "one"))
    assert len(want) == 3
    results = pool(2).run(trainer_parallel, str(tmp_path))
    for got in results:
        for axis in ("dp", "tp"):
            assert len(got[axis]) == 3 and all(abs(a - b) < 1e-5 for a, b in zip(got[axis], want)), (axis, got, want)
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "final")) is not None


# ---- loud when a request had no effect, or the model is not ours to parallelize ------------------------
def warnings_and_refusals(rank, world):
    import warnings
    from hyper_parallel.tools.models import build_model
    with pytest.warns(UserWarning, match="left every parameter .* unsharded"):
        hp.hsdp(tiny("llama"))  # default threshold (64 KB) on a tiny model
    with warnings.catch_warnings():  # its tp_plan names only the embedding and the head: structure fills the layers
        warnings.simplefilter("error")
        vl = hp.shard(build_model("qwen3_vl").model, "auto")
    assert vl.model.language_model.layers[0].mlp.up_proj.weight.dist_layout.sharded_axes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = hp.shard(tiny("qwen3"), "auto")  # splits the layers: no warning
    assert "tp: " in hp.summary(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    foreign = tiny("llama")
    w = foreign.model.layers[0].mlp.up_proj
    w.weight = torch.nn.Parameter(distribute_tensor(w.weight.detach(), init_device_mesh("cpu", (world,)), [Shard(0)]))
    for fn in (lambda m: hp.shard(m, "auto"), lambda m: hp.hsdp(m, threshold=0),
               lambda m: hp.parallelize(m, hp.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))):
        with pytest.raises(ValueError, match="hyper_parallel.from_pretrained"):
            fn(foreign)


def test_warnings_and_refusals():
    pool(2).run(warnings_and_refusals)
