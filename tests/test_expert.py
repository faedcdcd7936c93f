"""expert_parallel(): MoE experts over an axis with all_to_all token dispatch, on real gloo processes, against
the same training on plain tensors in one process (every rank builds the same model and global batch from
one seed and computes the reference itself, so every comparison is local)."""
from __future__ import annotations

import copy

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.parallel.expert import expert_parallel, find_experts

TOL = dict(rtol=1e-5, atol=1e-5)
VOCAB = 96


# ---- tiny MoE models ---------------------------------------------------------------------------------
def _model(name: str):
    import transformers as T
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if name == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=2, head_dim=8,
                               num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, **common)
        cls = T.Qwen3MoeForCausalLM
    elif name == "mixtral":
        cfg = T.MixtralConfig(intermediate_size=16, num_key_value_heads=2, head_dim=8, num_local_experts=8,
                              num_experts_per_tok=2, **common)
        cls = T.MixtralForCausalLM
    elif name == "deepseek_v3":
        cfg = T.DeepseekV3Config(intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=4,
                                 n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                 n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                                 qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, **common)
        cls = T.DeepseekV3ForCausalLM
    else:
        raise ValueError(name)
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():  # DeepSeek-V3's router bias starts at zero: give group routing something to do
        for n, p in model.named_parameters():
            if n.endswith("e_score_correction_bias"):
                p.normal_(0, 0.1)
    return model


def _batch(n: int, seq: int = 8):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (n, seq), generator=g)


def _full(t):
    return t.full_tensor() if isinstance(t, hp.DTensor) else t


def _force_to_rank_zero(model):
    """Every router picks only experts of rank 0's block (ids 0 and 1): the worst skew there is."""
    for m in find_experts(model).values():
        original = m.forward

        def forward(hidden, index, weights, _original=original):
            return _original(hidden, index % 2, weights)
        m.forward = forward


# ---- training on ("ep",) and on ("dp", "ep") with hsdp ------------------------------------------------
def _train(rank, world, name, mesh_shape, level, skew=False, steps=2):
    names = ("dp", "ep") if len(mesh_shape) == 2 else ("ep",)
    mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    ref = _model(name)
    model = copy.deepcopy(ref)
    if skew:
        _force_to_rank_zero(ref)
    model = expert_parallel(model, mesh, "ep")
    if skew:
        _force_to_rank_zero(model)
    ep = mesh.size("ep")
    experts = find_experts(model)
    for m in experts.values():          # each rank holds 1/ep of the experts' bytes
        for p in m._parameters.values():
            assert p._local.numel() * ep == p.numel(), (name, p.shape, p._local.shape)
    if level is not None:
        model = hp.hsdp(model, optimizer_level=level, threshold=0)
    dp = mesh.size("dp") if "dp" in names else 1
    dp_rank = mesh.get_local_rank("dp") if "dp" in names else 0
    ids = _batch(4 * dp)
    mine = ids.chunk(dp)[dp_rank]       # hsdp: each dp rank feeds its own micro-batch; ep splits it further
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    params = dict(model.named_parameters())
    for step in range(steps):
        loss = model(input_ids=mine, labels=mine).loss
        ref_loss = ref(input_ids=ids, labels=ids).loss
        with torch.no_grad():
            ref_mine = ref(input_ids=mine, labels=mine).loss
        torch.testing.assert_close(_full(loss), ref_mine, **TOL)
        loss.backward()
        ref_loss.backward()
        if step == 0:
            for n, rp in ref.named_parameters():
                g = params[n].grad
                assert g is not None, n
                torch.testing.assert_close(_full(g), rp.grad, **TOL, msg=lambda m: f"grad {n}: {m}")
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
    for n, rp in ref.named_parameters():
        torch.testing.assert_close(_full(params[n].detach()), rp.detach(), **TOL, msg=lambda m: f"param {n}: {m}")
    return float(_full(loss))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_train_ep4(dist4, name):
    dist4.run(_train, name, (4,), None)


def test_train_dp_ep_hsdp_level3(dist4):
    dist4.run(_train, "qwen3_moe", (2, 2), "level3")


def test_train_ep2_all_tokens_to_one_rank(dist2):
    dist2.run(_train, "mixtral", (2,), None, True)
