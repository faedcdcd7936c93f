"""shard(): MoE experts modules that cannot run whole experts per rank (plan._not_local).

A single expert (Hunyuan MoE's tiny config), weights holding different numbers of experts and an identity
(zero-compute) expert (LongCat Flash: `moe_identity_expert`) run on DTensors with their weights split on the
intermediate dim by the model's own packed_colwise / rowwise entries; 2 gloo ranks against one process.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel import Shard
from tests.harness import assert_generate_and_step_equal

TOL = dict(rtol=1e-5, atol=1e-5)
_COMMON = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
               max_position_embeddings=64, tie_word_embeddings=False)


def _hunyuan_moe(num_experts=1, **kw):
    import transformers as T
    cfg = dict(_COMMON, intermediate_size=32, num_hidden_layers=2, num_experts=num_experts, moe_topk=1)
    cfg.update(kw)
    torch.manual_seed(0)
    model = T.HunYuanMoEV1ForCausalLM(T.HunYuanMoEV1Config(**cfg)).eval()
    with torch.no_grad():  # expert weights start uninitialised: give them values
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.normal_(0, 0.2)
            layer.mlp.experts.down_proj.normal_(0, 0.2)
    return model


def _longcat(zero_expert_num=4, **kw):
    import transformers as T
    cfg = dict(_COMMON, num_layers=2, ffn_hidden_size=32, expert_ffn_hidden_size=32, q_lora_rank=16,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_topk=2, n_routed_experts=4,
               zero_expert_num=zero_expert_num, routed_scaling_factor=1.0)
    cfg.update(kw)
    torch.manual_seed(0)
    model = T.LongcatFlashForCausalLM(T.LongcatFlashConfig(**cfg)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.normal_(0, 0.2)
            layer.mlp.experts.down_proj.normal_(0, 0.2)
            layer.mlp.router.classifier.weight.normal_(0, 0.5)  # no routing ties
    return model


MODELS = {"hunyuan_moe_1": _hunyuan_moe, "longcat": _longcat}


def _assert_intermediate_split(model) -> None:
    """The experts' weights split on the intermediate dim (packed_colwise / rowwise), not by experts."""
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.placements == (Shard(1),), experts.gate_up_proj.placements
    assert experts.down_proj.placements == (Shard(2),), experts.down_proj.placements
    assert getattr(experts, "_hp_experts_split", None) is None   # not the local whole-experts run


def _identity_routes(model) -> list:
    """A counter of the calls of every identity expert of `model` (LongCat's zero-compute experts)."""
    calls = []
    for module in model.modules():
        if type(module).__name__ == "LongcatFlashExperts":
            module.identity_expert.register_forward_hook(lambda *_: calls.append(1))
    return calls


def _run(rank, world, name):
    ref = MODELS[name]()
    model = hp.shard(copy.deepcopy(ref), "auto")
    _assert_intermediate_split(model)
    calls = _identity_routes(ref)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 6), generator=g)
    got, loss = assert_generate_and_step_equal(model, ref, {"input_ids": ids, "do_sample": False},
                                               {"labels": ids}, 4, TOL)
    if name == "longcat":
        assert calls, "the reference routed nothing to an identity expert: the test would not test it"
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    opt_ref.step()
    opt.step()
    named_ref = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), named_ref[n], **TOL, msg=n)
    return got.tolist()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_experts_run_on_dtensors_equal_one_process(dist2, name):
    tokens = dist2.run(_run, name)
    assert tokens[0] == tokens[1]


# ---- a space of experts modules: the decision, and the values on 2 ranks -----------------------------------
class _Experts(torch.nn.Module):
    """An eager experts loop in transformers' form: `n` experts, `extra` unused gate_up rows (LongCat keeps its
    zero-compute experts' rows there), and with `identity` routes past the experts to an identity expert."""

    def __init__(self, n, extra, identity, hidden=8, inter=6):
        super().__init__()
        self.num_experts = n
        self.gate_up_proj = torch.nn.Parameter(torch.randn(n + extra, 2 * inter, hidden) * 0.3)
        self.down_proj = torch.nn.Parameter(torch.randn(n, hidden, inter) * 0.3)
        self.identity_expert = torch.nn.Identity() if identity else None

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):  # a routed-away id (the local run's `num_experts`) matches none
            token, pos = torch.where(top_k_index == e)
            gate, up = torch.nn.functional.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down_proj[e])
            out = out.index_add(0, token, y * top_k_weights[token, pos, None])
        if self.identity_expert is not None:
            token, pos = torch.where(top_k_index >= self.num_experts)
            y = self.identity_expert(hidden_states[token])
            out = out.index_add(0, token, y * top_k_weights[token, pos, None])
        return out


class _Moe(torch.nn.Module):
    def __init__(self, n, extra, identity, hidden=8):
        super().__init__()
        routes = n + (2 if identity else 0)
        self.router = torch.nn.Linear(hidden, routes, bias=False)
        self.experts = _Experts(n, extra, identity, hidden)
        self.top_k = min(2, routes)

    def forward(self, x):
        weights, index = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        return self.experts(x, index, weights)


def _moe_plan(identity):
    plan = {"experts": "moe_tp_experts", "experts.gate_up_proj": "packed_colwise", "experts.down_proj": "rowwise"}
    if identity:
        plan["experts.identity_expert"] = "moe_identity_expert"
    return plan


def _runs_locally(n, extra, identity, ranks) -> bool:
    return extra == 0 and not identity and n >= ranks


def _moe_step(rank, world, n, extra, identity, seed):
    torch.manual_seed(seed)
    ref = _Moe(n, extra, identity)
    x = torch.randn(10, 8)
    model = hp.shard(copy.deepcopy(ref), _moe_plan(identity))
    local = _runs_locally(n, extra, identity, world)
    assert (model.experts.down_proj.placements == (Shard(0),)) == local
    assert (model.experts.down_proj.placements == (Shard(2),)) == (not local)
    want, got = ref(x), model(x)
    torch.testing.assert_close(got.full_tensor() if isinstance(got, hp.DTensor) else got, want, **TOL)
    want.square().sum().backward()
    got.square().sum().backward()
    named_ref = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), named_ref[name].grad, **TOL, msg=name)
    return True


def test_experts_space_equal_one_process(dist2):
    """Random experts modules (expert count, unused rows, identity expert) on 2 ranks: locally run or on
    DTensors as `_not_local` decides, the output and every gradient as in one process."""
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=12, deadline=None)
    @given(st.integers(1, 5), st.sampled_from([0, 0, 2]), st.booleans(), st.integers(0, 99))
    def check(n, extra, identity, seed):
        assert dist2.run(_moe_step, n, extra, identity, seed) == [True, True]

    check()


# ---- which experts modules run locally (one process: a virtual mesh, nothing is communicated) --------------
@pytest.mark.parametrize("build,ranks,local,why", [
    (lambda: _hunyuan_moe(num_experts=4), 2, True, None),
    (lambda: _hunyuan_moe(num_experts=4), 4, True, None),
    (lambda: _hunyuan_moe(num_experts=1), 2, False, "1 experts < 2 ranks"),
    (lambda: _hunyuan_moe(num_experts=2), 4, False, "2 experts < 4 ranks"),
    (lambda: _longcat(), 2, False, r"different numbers of experts \[4, 8\]"),
    (lambda: _longcat(zero_expert_num=0), 2, False, "it has an identity expert"),
])
def test_experts_local_or_on_dtensors(build, ranks, local, why):
    model = hp.shard(build(), "auto", hp.Layout((ranks,), ("tp",)))
    experts = model.model.layers[0].mlp.experts
    if local:
        assert experts.gate_up_proj.placements == (Shard(0),) and experts.down_proj.placements == (Shard(0),)
        assert "run on DTensors" not in hp.summary(model)
    else:
        _assert_intermediate_split(model)
        assert hp.summary(model).count("run on DTensors") == 1   # one note for all layers
        assert re.search(why, hp.summary(model)), hp.summary(model)
