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
