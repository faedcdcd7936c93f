"""Activation checkpointing (`model.gradient_checkpointing_enable()`) on hsdp and shard models.

transformers recomputes each decoder layer's `forward` inside backward (module hooks stay outside the
checkpoint), and `torch.utils.checkpoint` around a whole module call reruns its hooks too. hsdp's hooks
swap the unsharded compute parameters into a module only around its forward and backward, so a
recomputation must find them there again (as FSDP2's pre-backward unshard does). Each case runs two
training steps on real gloo processes and compares the loss and every gradient with one plain process
computing the global batch without checkpointing.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp

MICRO = 2
SEQ = 8
TOL = 1e-5
TP_PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
           "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
           "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
           "model.layers.*.mlp.down_proj": "rowwise"}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def _moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).float()


_MODELS = {"llama": _llama, "moe": _moe}


def _full(t):
    return t.full_tensor() if isinstance(t, hp.DTensor) else t


def _parallel(model, rank, world, level, tp):
    """(model, batch index of this rank, number of data-parallel ranks)."""
    if tp and level:  # 2-D: shard on "tp", hsdp on "dp"
        mesh = hp.init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        model = hp.shard(model, TP_PLAN, mesh=mesh)
        return hp.hsdp(model, optimizer_level=level, threshold=0), mesh.get_local_rank("dp"), world // 2
    if tp:  # shard alone: every rank computes the whole batch
        mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        return hp.shard(model, TP_PLAN, mesh=mesh), 0, 1
    return hp.hsdp(model, optimizer_level=level, threshold=0), rank, world


def _train_checkpointed(rank, world, name, level, tp, reentrant):
    ref = _MODELS[name]()
    ref.train()
    model = copy.deepcopy(ref)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model, me, dp = _parallel(model, rank, world, level, tp)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    names = [n for n, _ in ref.named_parameters()]
    gen = torch.Generator().manual_seed(7)
    for step in range(2):
        data = torch.randint(0, ref.config.vocab_size, (dp, MICRO, SEQ), generator=gen)
        full = data.reshape(-1, SEQ)
        loss_ref = ref(input_ids=full, labels=full).loss
        loss_ref.backward()
        loss = model(input_ids=data[me], labels=data[me]).loss
        loss.backward()
        value = _full(loss.detach()).clone()
        dist.all_reduce(value)  # tp ranks hold the same loss: the mean over all ranks is the dp mean
        assert abs(value.item() / world - loss_ref.item()) < TOL, (step, value.item() / world, loss_ref.item())
        got = dict(model.named_parameters())
        wrong = []
        for n, p in ref.named_parameters():
            g = got[n].grad
            if g is None or not torch.allclose(_full(g), p.grad, atol=TOL, rtol=0):
                err = None if g is None else (_full(g) - p.grad).abs().max().item()
                wrong.append((n, err))
        assert not wrong, f"step {step}: {len(wrong)} of {len(names)} gradients differ: {wrong[:6]}"
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    return True


def _cases(rank, world, cases):
    for c in cases:
        _train_checkpointed(rank, world, *c)
    return True


@pytest.mark.parametrize("reentrant", [False, True])
def test_hsdp_levels_with_checkpointing(dist2, reentrant):
    dist2.run(_cases, [("llama", level, False, reentrant) for level in ("level1", "level2", "level3")]
              + [("moe", "level3", False, reentrant)])


@pytest.mark.parametrize("reentrant", [False, True])
def test_shard_alone_with_checkpointing(dist2, reentrant):
    dist2.run(_cases, [("llama", None, True, reentrant)])


@pytest.mark.parametrize("reentrant", [False, True])
def test_shard_and_hsdp_2d_with_checkpointing(dist4, reentrant):
    dist4.run(_cases, [("llama", level, True, reentrant) for level in ("level1", "level2", "level3")])


# ---- property: random models, unit granularity, checkpoint placement and settings vs plain torch ----------
class _Block(torch.nn.Module):
    """One or more Linear+tanh layers; `inner` checkpoints its own body (module hooks stay outside)."""

    def __init__(self, dims, inner, reentrant):
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.inner, self.reentrant = inner, reentrant

    def body(self, x):
        for lin in self.lins:
            x = torch.tanh(lin(x))
        return x

    def forward(self, x):
        if self.inner and self.training:
            return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=self.reentrant)
        return self.body(x)


class _Net(torch.nn.Module):
    """Blocks, some checkpointed around their whole call (their hooks run again in the recomputation)."""

    def __init__(self, case):
        super().__init__()
        torch.manual_seed(case["seed"])
        self.blocks = torch.nn.ModuleList(_Block(d, mode == "inner", case["reentrant"])
                                          for d, mode in zip(case["dims"], case["modes"]))
        self.modes, self.reentrant = case["modes"], case["reentrant"]
        self.head = torch.nn.Linear(case["dims"][-1][-1], 3)
        if case["block_units"]:
            self._no_split_modules = ["_Block"]

    def forward(self, x):
        for block, mode in zip(self.blocks, self.modes):
            if mode == "outer":
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
            else:
                x = block(x)
        return self.head(x)


def _random_net_case(rank, world, case):
    ref = _Net(case)
    model = hp.hsdp(copy.deepcopy(ref), optimizer_level=case["level"], threshold=case["threshold"],
                    comm_fusion=case["fusion"], comm_async=case["async"])
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.3), torch.optim.SGD(model.parameters(), lr=0.3)
    gen = torch.Generator().manual_seed(case["seed"])
    for step in range(2):
        data = torch.randn(world, 3, case["dims"][0][0], generator=gen)
        ref(data.reshape(-1, data.shape[-1]).requires_grad_()).square().mean().backward()
        model(data[rank].clone().requires_grad_()).square().mean().backward()
        got = dict(model.named_parameters())
        for n, p in ref.named_parameters():
            assert torch.allclose(got[n].grad.full_tensor(), p.grad, atol=TOL, rtol=0), (step, n, case)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    return True


def test_property_random_checkpointed_models(dist2):
    """Random widths and depths, checkpoints inside a block's forward or around its whole call, units per
    block or per Linear, every level, threshold, fusion and async, reentrant or not: grads == plain."""
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st

    dims = st.lists(st.integers(1, 6), min_size=2, max_size=3)
    cases = st.fixed_dictionaries({
        "seed": st.integers(0, 10_000), "reentrant": st.booleans(), "block_units": st.booleans(),
        "level": st.sampled_from(["level1", "level2", "level3"]), "threshold": st.sampled_from([0, 0.05, 64]),
        "fusion": st.booleans(), "async": st.booleans(),
        "blocks": st.lists(st.tuples(dims, st.sampled_from(["none", "inner", "outer"])), min_size=1, max_size=3)})

    # no shrinking: a failure restarts the process pool, and the drawn case is printed as it is
    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None, phases=(Phase.explicit, Phase.generate))
    @given(cases)
    def check(case):
        blocks, chain, width = case.pop("blocks"), [], None
        for d, _ in blocks:
            d = [width or d[0]] + d[1:]  # each block starts where the previous one ended
            chain.append(d)
            width = d[-1]
        case["dims"], case["modes"] = chain, [mode for _, mode in blocks]
        dist2.run(_random_net_case, case)

    check()
