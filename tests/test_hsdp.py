"""hsdp on real gloo processes: training equals single-process training on the global batch.

Every rank builds the same tiny model (same seed), trains a reference copy on the whole global batch
locally, and trains the hsdp copy on its own micro-batch; losses (averaged over dp ranks) and final
parameters must agree within 1e-5 (fp32). Memory: bytes of parameters + gradients + optimizer state
actually held (distinct storages) must match the level.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp

STEPS = 5
MICRO = 2   # sequences per rank per micro-batch
SEQ = 8
TOL = 1e-5


def _llama(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def _moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).float()


_MODELS = {"llama": _llama, "moe": _moe}


def _held_bytes(model, opt) -> int:
    """Distinct storages behind parameters, gradients, optimizer state and hsdp's own buffers."""
    tensors = list(model.hsdp_held_tensors())
    for p in model.parameters():
        tensors.append(p.to_local() if isinstance(p, hp.DTensor) else p)
        if p.grad is not None:
            tensors.append(p.grad._local if isinstance(p.grad, hp.DTensor) else p.grad)
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                tensors.append(v._local if isinstance(v, hp.DTensor) else v)
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _train(rank, world, name, level, shard_size=-1, accum=1, opts=None, freeze_embed=False):
    opts = dict(opts or {})
    ref = _MODELS[name]()
    if freeze_embed:
        ref.get_input_embeddings().weight.requires_grad_(False)
    model = hp.hsdp(copy.deepcopy(ref), shard_size=shard_size, optimizer_level=level,
                    enable_grad_accumulation=accum > 1, threshold=opts.pop("threshold", 0), **opts)
    assert all(isinstance(p, hp.DTensor) for p in model.parameters())
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gen = torch.Generator().manual_seed(7)
    vocab = ref.config.vocab_size
    held = None
    for step in range(STEPS):
        data = torch.randint(0, vocab, (accum, world, MICRO, SEQ), generator=gen)
        full = data.reshape(-1, SEQ)  # global batch: micro-batches of every rank
        loss_ref = ref(input_ids=full, labels=full).loss
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        total = torch.zeros(())
        for mb in range(accum):
            if accum > 1:
                model.set_requires_grad_sync(mb == accum - 1)
            x = data[mb, rank]
            loss = model(input_ids=x, labels=x).loss / accum
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        total /= world
        assert abs(total.item() - loss_ref.item()) < TOL, (step, total.item(), loss_ref.item())
        opt.step()
        if step == STEPS - 1:
            held = _held_bytes(model, opt)
        opt.zero_grad()
    sd = model.full_state_dict(rank0_only=False)
    for k, v in ref.state_dict().items():
        assert not isinstance(sd[k], hp.DTensor)
        assert torch.allclose(sd[k], v, atol=TOL, rtol=0), (k, (sd[k] - v).abs().max().item())
    n_bytes = sum(p.numel() * p.element_size() for p in ref.parameters() if p.requires_grad)
    return held / n_bytes


def _train_cases(rank, world, cases):
    return [_train(rank, world, *c[:2], **c[2]) for c in cases]


def _expected_ratio(level: str, S: int) -> float:
    """(params + grads + 2 AdamW moments) / params: full copies where the level does not shard."""
    return {"level1": 1 + 1 + 2 / S, "level2": 1 + 3 / S, "level3": 4 / S}[level]


def _check_ratios(results, cases, S):
    for ratios, case in zip(zip(*results), cases):
        level = case[1]
        for r in ratios:
            assert abs(r - _expected_ratio(level, S)) < 0.12 * _expected_ratio(level, S), (case, r)


CASES_2 = [
    ("llama", "level1", {}),
    ("llama", "level2", {}),
    ("llama", "level3", {}),
    ("moe", "level1", {}),
    ("moe", "level3", {"opts": {"comm_fusion": True, "comm_async": True}}),
]


def test_levels_two_ranks(dist2):
    _check_ratios(dist2.run(_train_cases, CASES_2), CASES_2, 2)


def test_accumulation_fusion_frozen_two_ranks(dist2):
    cases = [
        ("llama", "level2", {"accum": 2}),
        ("llama", "level3", {"accum": 2, "opts": {"comm_fusion": True, "bucket_size": 8}}),
        ("moe", "level3", {"freeze_embed": True, "opts": {"reduce_dtype": torch.float64, "comm_async": True}}),
        ("llama", "level2", {"opts": {"comm_async": True, "comm_fusion": True}}),
        ("llama", "level1", {"accum": 2, "opts": {"comm_async": True}}),
    ]
    dist2.run(_train_cases, cases)


CASES_4 = [
    ("llama", "level3", {"shard_size": 2}),
    ("moe", "level2", {"shard_size": 2, "accum": 2}),
    ("llama", "level3", {"shard_size": 4, "opts": {"comm_fusion": True, "comm_async": True}}),
    ("llama", "level1", {"shard_size": 2}),
]


def test_hybrid_four_ranks(dist4):
    results = dist4.run(_train_cases, CASES_4)
    for ratios, (name, level, kw) in zip(zip(*results), CASES_4):
        S = kw["shard_size"]
        for r in ratios:
            assert abs(r - _expected_ratio(level, S)) < 0.12 * _expected_ratio(level, S), (name, level, S, r)


def _threshold_and_grad_scale(rank, world):
    model = hp.hsdp(_llama(tie=True), threshold=2, optimizer_level="level3", grad_scale=2.0)
    small = [p for p in model.parameters() if p.numel() * 4 < 2 * 1024]
    big = [p for p in model.parameters() if p.numel() * 4 >= 2 * 1024]
    assert small and big
    assert all(p.dist_layout.is_replicate for p in small)
    assert all(not p.dist_layout.is_replicate for p in big)
    ref = _llama(tie=True)
    x = torch.arange(2 * SEQ).reshape(2, SEQ) % 96
    ref(input_ids=x, labels=x).loss.backward()
    model(input_ids=x, labels=x).loss.backward()  # the same batch on both ranks: dp mean = that gradient
    grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        g = p.grad.full_tensor()
        assert torch.allclose(g, 2.0 * grads[n].grad, atol=1e-6), n
    return True


def test_threshold_tied_grad_scale(dist2):
    dist2.run(_threshold_and_grad_scale)


def _state_dict_round_trip(rank, world):
    model = hp.hsdp(_llama(), optimizer_level="level2", threshold=0)
    sd = model.full_state_dict()
    assert (len(sd) > 0) == (rank == 0)
    if rank == 0:
        assert all(type(v) is torch.Tensor for v in sd.values())
        sd = {k: v + 1 for k, v in sd.items()}
    model.load_full_state_dict(sd if rank == 0 else None)
    again = model.full_state_dict(rank0_only=False)
    ref = _llama().state_dict()
    for k, v in ref.items():
        assert torch.allclose(again[k], v + 1), k
    x = torch.arange(2 * SEQ).reshape(2, SEQ) % 96
    ref_model = _llama()
    ref_model.load_state_dict({k: v + 1 for k, v in ref.items()})
    assert torch.allclose(model(input_ids=x).logits, ref_model(input_ids=x).logits, atol=1e-5)
    return True


def test_state_dict_round_trip(dist2):
    dist2.run(_state_dict_round_trip)


def _bad_inputs(rank, world):
    with pytest.raises(ValueError, match="shard_size"):
        hp.hsdp(_llama(), shard_size=3)
    with pytest.raises(ValueError, match="optimizer_level"):
        hp.hsdp(_llama(), optimizer_level="level4")
    model = hp.hsdp(_llama())
    with pytest.raises(ValueError, match="already wrapped"):
        hp.hsdp(model)
    with pytest.raises(ValueError, match="enable_grad_accumulation"):
        model.set_requires_grad_sync(False)
    return True


def test_bad_inputs(dist2):
    dist2.run(_bad_inputs)


def _with_shard(rank, world):
    """shard TP=2 on "tp", hsdp on "dp" of a (2, 2) mesh: training still equals single-process."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref = _llama()
    model = copy.deepcopy(ref)
    plan = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
            "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise"}
    model = hp.shard(model, plan, mesh=mesh)
    model = hp.hsdp(model, optimizer_level="level3", threshold=0)
    dp = mesh.get_local_rank("dp")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(7)
    for step in range(3):
        data = torch.randint(0, 96, (2, MICRO, SEQ), generator=gen)
        full = data.reshape(-1, SEQ)
        loss_ref = ref(input_ids=full, labels=full).loss
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = model(input_ids=data[dp], labels=data[dp]).loss
        loss.backward()
        value = loss.full_tensor() if isinstance(loss, hp.DTensor) else loss.detach()
        value = value.clone()
        dist.all_reduce(value)
        assert abs(value.item() / world - loss_ref.item()) < TOL, (step, value.item() / world, loss_ref.item())
        opt.step()
        opt.zero_grad()
    sd = model.full_state_dict(rank0_only=False)
    for k, v in ref.state_dict().items():
        assert torch.allclose(sd[k], v, atol=TOL, rtol=0), k
    return True


def test_compose_with_shard(dist4):
    dist4.run(_with_shard)


def test_single_process_plain_module():
    """One process, no torch.distributed: hsdp is a no-op wrapper that still trains like the original."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = hp.hsdp(copy.deepcopy(ref), optimizer_level="level3", threshold=0)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        x = torch.randn(5, 8)
        ref(x).square().mean().backward()
        model(x).square().mean().backward()
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        model.zero_grads()
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.allclose(a, b.full_tensor(), atol=1e-6), n
