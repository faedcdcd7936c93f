"""shard(): tensor parallelism on real gloo processes, compared with the same computation on plain tensors.

Every rank builds the same full model from one seed, computes the single-device reference itself,
then shards a copy; so each comparison is local and needs no cross-process reference.
"""
from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
from torch import nn

import hyper_parallel as hp
from hyper_parallel import Replicate, Shard, ShardingPlan
from hyper_parallel.parallel.shard.plan import sequence_parallel_plan
from tests.harness import assert_generate_and_step_equal

TOL = dict(rtol=1e-5, atol=1e-5)


# ---- models ------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, d=16, h=32):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.down(torch.nn.functional.silu(self.up(x))))


def _llama(**kw):
    import transformers as T
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    cfg.update(kw)
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(**cfg)).eval()


def _qwen3(**kw):
    import transformers as T
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    cfg.update(kw)
    torch.manual_seed(0)
    return T.Qwen3ForCausalLM(T.Qwen3Config(**cfg)).eval()


def _qwen3_moe(**kw):
    import transformers as T
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
               num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=64, tie_word_embeddings=False)
    cfg.update(kw)
    torch.manual_seed(0)
    model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**cfg)).eval()
    with torch.no_grad():  # the router starts at zero: give it weights so that routing is not a tie
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model


def _llama4(**kw):
    """Llama 4's text model: every layer MoE, its experts fed rows grouped expert by expert (no routing ids)."""
    import transformers as T
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
               max_position_embeddings=64, attention_chunk_size=64, tie_word_embeddings=False)
    cfg.update(kw)
    torch.manual_seed(0)
    model = T.Llama4ForCausalLM(T.Llama4TextConfig(**cfg)).eval()
    with torch.no_grad():  # the expert weights start at zero / uninitialised: give them values
        for layer in model.model.layers:
            layer.feed_forward.experts.gate_up_proj.normal_(0, 0.2)
            layer.feed_forward.experts.down_proj.normal_(0, 0.2)
    return model


MODELS = {"llama": _llama, "llama4": _llama4,
          "llama_mqa": lambda: _llama(num_key_value_heads=1),  # one key/value head: attention stays replicated
          "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "llama_kv4": lambda: _llama(num_key_value_heads=4),
          "llama_uneven": lambda: _llama(vocab_size=97, intermediate_size=65),  # 49/48 vocab, 33/32 MLP
          "qwen3_tied": lambda: _qwen3(tie_word_embeddings=True)}


def _llama_plan(moe=False, prefix="model.layers.*"):
    """A hand-written plan for Llama/Qwen3 blocks: alias tuples and Placement tuples mixed; for the MoE
    model its experts module takes the "moe_tp_experts" style (whole experts per rank, run locally)."""
    col, row = ("tp", "None"), ("None", "tp")
    plan = {f"{prefix}.self_attn.q_proj.weight": col, f"{prefix}.self_attn.k_proj.weight": col,
            f"{prefix}.self_attn.v_proj.weight": (Shard(0),), f"{prefix}.self_attn.o_proj.weight": row,
            "model.embed_tokens.weight": col, "lm_head.weight": col}
    outputs = {f"{prefix}.self_attn.o_proj": (Replicate(),), "model.embed_tokens": ("None", "None", "None"),
               "lm_head.output": ("None", "None", "None")}
    if moe:
        plan[f"{prefix}.mlp.experts"] = "moe_tp_experts"
    else:
        plan.update({f"{prefix}.mlp.gate_proj.weight": col, f"{prefix}.mlp.up_proj.weight": col,
                     f"{prefix}.mlp.down_proj.weight": (Shard(1),)})
        outputs[f"{prefix}.mlp.down_proj"] = (Replicate(),)
    return ShardingPlan(plan=plan, output_plan=outputs, return_local_tensor=["lm_head"])


def _ids(batch=2, seq=6, vocab=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _full(t):
    return t.full_tensor() if isinstance(t, hp.DTensor) else t


# ---- rank functions (module level: the harness imports them by name) ---------------------------
def _assert_grads_match(model, ref):
    """Every parameter's gathered gradient equals the single-process reference's, by name."""
    named_ref = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), named_ref[n].grad, **TOL, msg=n)


def _mlp_step(rank, world):
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    plan = ShardingPlan(plan={"up.weight": ("tp", "None"), "up.bias": ("tp",), "down.weight": ("None", "tp")},
                        output_plan={"down": ("None", "None")})
    out = hp.shard(model, plan)
    assert out is model
    w = model.up.weight
    assert isinstance(w, nn.Parameter) and isinstance(w, hp.DTensor)
    assert w.shape == (32, 16) and w.to_local().shape == (32 // world, 16)
    assert isinstance(model.norm.weight, hp.DTensor) and model.norm.weight.dist_layout.is_replicate
    x = torch.randn(4, 16)
    y_ref = ref(x)
    y = model(x)
    torch.testing.assert_close(_full(y), y_ref, **TOL)
    y_ref.square().sum().backward()
    y.square().sum().backward()
    for (n, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        assert isinstance(p.grad, hp.DTensor) and p.grad.dist_layout is p.dist_layout, n
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, **TOL, msg=n)
    # the root module's boundaries ("input" / "output" keys): a batch-split input and output
    plan = ShardingPlan(plan={"up.weight": (Shard(0),)}, input_plan={"input": ("tp", "None")},
                        output_plan={"output": ("tp", "None")})
    model = hp.shard(copy.deepcopy(ref), plan)
    y = model(x)
    assert y.placements == (Shard(0),) and y.to_local().shape == (4 // world, 16)
    torch.testing.assert_close(y.full_tensor(), ref(x), **TOL)
    return True


def _broadcast_first(rank, world):
    """Ranks that built different weights agree after shard: rank 0's copy is the one laid out."""
    torch.manual_seed(rank)
    model = hp.shard(MLP(), {"up": "colwise", "down": "rowwise"})
    torch.manual_seed(0)
    want = MLP()
    for (n, p), (_, w) in zip(model.named_parameters(), want.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), w, rtol=0, atol=0, msg=n)
    return True


def _generate(rank, world, name, plan_kind):
    ref = MODELS[name]()
    model = _shard_checked(copy.deepcopy(ref), name, plan_kind)
    if "moe" in name:  # whole experts per rank
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.to_local().shape == (4 // world, 32, 32)
        assert experts.down_proj.to_local().shape == (4 // world, 32, 16)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(_full(model(ids).logits), ref(ids).logits, **TOL)
        want = ref.generate(ids, max_new_tokens=5, do_sample=False)
        got = model.generate(ids, max_new_tokens=5, do_sample=False)
    got = _full(got)
    assert torch.equal(got, want), (got, want)
    return got.tolist()


def _shard_checked(model, name, plan_kind):
    """`shard` with the plan kind; for the models "auto" splits only in part, check what it split."""
    if name == "llama_mqa":  # its 1 key/value head cannot split: k/v replicated (Megatron), q/o and the MLPs split
        hp.shard(model, "auto")
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert attn.k_proj.weight.dist_layout.is_replicate and attn.v_proj.weight.dist_layout.is_replicate
        assert attn.q_proj.weight.placements == (Shard(0),) and attn.o_proj.weight.placements == (Shard(1),)
        assert "k_proj/v_proj replicated" in hp.summary(model)
        assert mlp.up_proj.weight.placements == (Shard(0),) and mlp.down_proj.weight.placements == (Shard(1),)
        return model
    model = hp.shard(model, "auto" if plan_kind == "auto" else _llama_plan(moe="moe" in name))
    if name == "llama4":  # whole experts per rank
        experts = model.model.layers[0].feed_forward.experts
        assert experts.gate_up_proj.placements == (Shard(0),) and experts.down_proj.placements == (Shard(0),)
    return model


def _train_step(rank, world, name, plan_kind):
    ref = MODELS[name]().train()
    model = _shard_checked(copy.deepcopy(ref), name, plan_kind)
    if ref.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = _ids(seed=2)
    # Adam divides by sqrt(v) + eps: with the default eps a gradient entry near 1e-9 (tiny MoE expert
    # gradients) turns a 1e-9 reduction-order difference into a 1e-5 step difference; eps=1e-6 keeps
    # the comparison about the sharding, not about float summation order.
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    loss_ref = ref(ids, labels=ids).loss
    loss = model(ids, labels=ids).loss
    torch.testing.assert_close(_full(loss), loss_ref, **TOL)
    loss_ref.backward()
    loss.backward()
    named_ref = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert isinstance(p, hp.DTensor), n
        assert p.grad is not None and p.grad.dist_layout is p.dist_layout, (n, p.grad)
        torch.testing.assert_close(p.grad.full_tensor(), named_ref[n].grad, **TOL, msg=n)
    opt_ref.step()
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), named_ref[n], **TOL, msg=n)
    return float(_full(loss))


def _loss_parallel(rank, world):
    """lm_head left vocab-split ("colwise"): the loss is computed on sharded logits, never gathered."""
    ref = _llama().train()
    plan = dict(ref.tp_plan, lm_head="colwise")
    model = hp.shard(copy.deepcopy(ref), plan)
    ids = _ids(seed=3)
    with hp.comm_counter() as c:
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
    assert out.logits.dist_layout.placements == (Shard(2),), out.logits.dist_layout
    assert "all_gather" not in c.counts, dict(c.counts)
    loss_ref = ref(ids, labels=ids, use_cache=False).loss
    loss_ref.backward()
    torch.testing.assert_close(_full(out.loss), loss_ref, **TOL)
    _assert_grads_match(model, ref)
    return dict(c.counts)


def _sequence_parallel(rank, world):
    ref = _llama().train()
    model = hp.shard(copy.deepcopy(ref), sequence_parallel_plan())  # Megatron SP as a ShardingPlan
    ids = _ids(seed=4)
    with hp.comm_counter() as c:
        loss = model(ids, labels=ids, use_cache=False).loss
    layers = ref.config.num_hidden_layers
    # per layer: a reduce-scatter after attention and after the MLP, an all-gather before each;
    # plus the embedding's reduce-scatter, the gather before lm_head and the gathered logits; and, on the
    # first forward only, the feed check (the tp ranks compare what they were fed)
    assert c.counts == {"reduce_scatter": 2 * layers + 1, "all_gather": 2 * layers + 2, "feed_check": 1}, \
        dict(c.counts)
    loss_ref = ref(ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(_full(loss), loss_ref, **TOL)
    loss_ref.backward()
    loss.backward()
    _assert_grads_match(model, ref)
    return dict(c.counts)


def _kv_cache_local(rank, world):
    """The KV cache holds DTensors split on the KV-head dim: each rank stores only its heads."""
    model = hp.shard(_llama(), "auto")
    with torch.no_grad():
        out = model(_ids(), use_cache=True)
        out = model(_ids(batch=2, seq=1), past_key_values=out.past_key_values, use_cache=True)
    keys = out.past_key_values.layers[0].keys
    assert isinstance(keys, hp.DTensor) and keys.shape == (2, 2, 7, 8), keys
    assert keys.placements == (Shard(1),) and keys.to_local().shape == (2, 2 // world, 7, 8), keys.dist_layout
    return True


def _qwen3_vl(rank, world):
    """Qwen3-VL: its own plan (embedding, lm_head) plus the language model's layers; vision tower replicated."""
    from hyper_parallel.tools.models import build_model
    case = build_model("qwen3_vl")
    ref = case.model
    layers = "model.language_model.layers.*."
    plan = dict(ref.tp_plan)
    plan.update({layers + "self_attn.q_proj": "colwise", layers + "self_attn.k_proj": "colwise",
                 layers + "self_attn.v_proj": "colwise", layers + "self_attn.o_proj": "rowwise",
                 layers + "mlp.gate_proj": "colwise", layers + "mlp.up_proj": "colwise",
                 layers + "mlp.down_proj": "rowwise"})
    model = hp.shard(copy.deepcopy(ref), plan)
    assert model.model.visual.blocks[0].attn.qkv.weight.dist_layout.is_replicate
    got, _ = assert_generate_and_step_equal(model, ref, case.inputs, case.labels, 4, TOL)
    return got.tolist()


def _meta_load(rank, world, path):
    import torch.distributed as dist
    ref = _llama()
    if rank == 0:  # several files and an index, as a real checkpoint has
        ref.save_pretrained(path, max_shard_size="40KB")
    dist.barrier()
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    with torch.device("meta"):
        model = _llama_meta()
    hp.shard(model, "auto")
    assert model.model.layers[0].mlp.up_proj.weight.to_local().is_meta
    hp.init_parameters(model)
    w = model.model.layers[0].mlp.up_proj.weight
    assert not w.to_local().is_meta and w.to_local().shape == (64 // world, 32)
    assert torch.isfinite(w.to_local()).all() and w.to_local().std() > 0
    full = w.full_tensor()
    assert not torch.equal(full[:32], full[32:])  # each piece drawn on its own
    torch.testing.assert_close(model.model.norm.weight.full_tensor(), torch.ones(32))
    ids = _ids()
    with torch.no_grad():
        model(ids)  # runs with fresh random weights
        hp.load_sharded(model, path)
        torch.testing.assert_close(_full(model(ids).logits), ref(ids).logits, **TOL)
    return True


def _llama_meta():
    import transformers as T
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                            tie_word_embeddings=False))


def _mesh_2d(rank, world):
    """A (dp, tp) mesh: shard uses its tp axis; each dp row runs its own batch."""
    ref = _llama()
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = hp.shard(copy.deepcopy(ref), "auto", mesh)
    w = model.model.layers[0].self_attn.q_proj.weight
    assert w.device_mesh.mesh_dim_names == ("tp",) and w.to_local().shape == (16, 32)
    ids = _ids(seed=10 + mesh.get_local_rank("dp"))
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=4, do_sample=False)
        got = _full(model.generate(ids, max_new_tokens=4, do_sample=False))
    assert torch.equal(got, want)
    return True


# ---- tests -------------------------------------------------------------------------------------
def test_mlp_sharding_plan(dist2):
    assert dist2.run(_mlp_step) == [True, True]
    assert dist2.run(_broadcast_first) == [True, True]


@pytest.mark.parametrize("name,plan_kind", [("llama", "auto"), ("llama", "plan"), ("qwen3", "auto"),
                                            ("qwen3", "plan"), ("qwen3_moe", "auto"), ("qwen3_moe", "plan"),
                                            ("llama_uneven", "auto"), ("llama_mqa", "auto"), ("llama4", "auto")])
def test_generate(dist2, name, plan_kind):
    tokens = dist2.run(_generate, name, plan_kind)
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("name,plan_kind", [("llama", "auto"), ("llama", "plan"), ("qwen3", "auto"),
                                            ("qwen3_moe", "auto"), ("qwen3_moe", "plan"), ("llama_uneven", "auto"),
                                            ("qwen3_tied", "auto"), ("llama_mqa", "auto"), ("llama4", "auto")])
def test_train_step(dist2, name, plan_kind):
    losses = dist2.run(_train_step, name, plan_kind)
    assert losses[0] == losses[1]


def test_qwen3_vl(dist2):
    tokens = dist2.run(_qwen3_vl)
    assert tokens[0] == tokens[1]


def test_loss_parallel(dist2):
    counts = dist2.run(_loss_parallel)
    assert counts[0] == counts[1]


def test_sequence_parallel(dist2):
    counts = dist2.run(_sequence_parallel)
    assert counts[0] == counts[1]


def test_kv_cache_holds_local_heads(dist2):
    assert dist2.run(_kv_cache_local) == [True, True]


def test_meta_init_and_load_sharded(dist2):
    with tempfile.TemporaryDirectory() as d:
        assert dist2.run(_meta_load, d) == [True, True]


def test_four_ranks(dist4):
    """TP=4 on a 1-D mesh (4 heads and 4 KV heads: one of each per rank), then a (dp=2, tp=2) mesh."""
    tokens = dist4.run(_generate, "llama_kv4", "auto")
    assert all(t == tokens[0] for t in tokens)
    assert dist4.run(_mesh_2d) == [True] * 4


# ---- bad plans (one process: a virtual mesh, nothing is communicated) ---------------------------
def test_unknown_style():
    with pytest.raises(ValueError, match="unknown tensor-parallel style 'colwize'.*model.layers.*q_proj"):
        hp.shard(_llama(), {"model.layers.*.self_attn.q_proj": "colwize"}, hp.Layout((2,), ("tp",)))


def test_unmatched_path():
    with pytest.raises(ValueError, match="'model.layers.*.mlp.fc1.weight' matches no parameter"):
        hp.shard(MLP(), ShardingPlan(plan={"model.layers.*.mlp.fc1.weight": ("tp", "None")}),
                 hp.Layout((2,), ("tp",)))
    with pytest.raises(ValueError, match="'layers.*.attn.qkv'.*matches no module"):
        hp.shard(_llama(), {"layers.*.attn.qkv": "colwise"}, hp.Layout((2,), ("tp",)))


def test_indivisible_heads():
    """A plan the user wrote that splits inside a head is refused; "auto" keeps such attention whole."""
    model = _llama(num_attention_heads=6, num_key_value_heads=6, hidden_size=48)
    with pytest.raises(ValueError, match="q_proj: its 6 heads .* over 4 ranks"):
        hp.shard(model, dict(model.tp_plan), hp.Layout((4,), ("tp",)))
    with pytest.raises(ValueError, match="k_proj: its 2 heads .* over 4 ranks"):
        hp.shard(_llama(), _llama_plan(), hp.Layout((4,), ("tp",)))
    model = hp.shard(_llama(), "auto", hp.Layout((4,), ("tp",)))   # 4 query heads, 2 key/value heads
    attn = model.model.layers[1].self_attn
    assert attn.k_proj.weight.dist_layout.is_replicate and attn.v_proj.weight.dist_layout.is_replicate
    assert attn.q_proj.weight.placements == (Shard(0),) and attn.o_proj.weight.placements == (Shard(1),)
    assert model.model.layers[1].mlp.gate_proj.weight.placements == (Shard(0),)
    with pytest.warns(UserWarning, match="attention module.* run replicated.*q_proj: its 6 heads .* over 4 ranks"):
        model = hp.shard(_llama(num_attention_heads=6, num_key_value_heads=6, hidden_size=48), "auto",
                         hp.Layout((4,), ("tp",)))
    assert all(p.dist_layout.is_replicate for p in model.model.layers[1].self_attn.parameters())


def test_per_head_gate_splits_whole_heads():
    """A projection with one output per head (Laguna's gate, `num_heads` wide) splits whole heads."""
    from hyper_parallel.parallel.shard.plan import check_heads, resolve_styles

    class Attention(nn.Module):
        def __init__(self, heads=6, head_dim=4):
            super().__init__()
            self.num_heads, self.head_dim = heads, head_dim
            self.q_proj = nn.Linear(8, heads * head_dim)
            self.g_proj = nn.Linear(8, heads)   # 6 = 1.5 head_dims, but 6 whole heads of one value each

    model = nn.Sequential(Attention())
    mesh = hp.Layout((2,), ("tp",)).mesh
    check_heads(model, resolve_styles(model, {"0.q_proj": "colwise", "0.g_proj": "colwise"}, mesh, True))
    with pytest.raises(ValueError, match="0.g_proj: its 6 heads .* over 4 ranks"):
        mesh4 = hp.Layout((4,), ("tp",)).mesh
        check_heads(model, resolve_styles(model, {"0.g_proj": "colwise"}, mesh4, True))


def test_auto_plan_heads_property():
    """Random head counts and tensor-parallel sizes: "auto" splits an attention module's projections where its
    attention and key/value heads both divide; where only the query heads divide, q and o split and k / v stay
    replicated (Megatron); else none of them (and says so); a written plan is refused unless both divide; the
    MLPs split either way."""
    from hypothesis import given, settings, strategies as st
    from hyper_parallel.parallel.shard.api import _resolve

    @settings(max_examples=15, deadline=None)
    @given(st.integers(1, 4), st.sampled_from([1, 2, 3]), st.sampled_from([2, 3, 4]), st.sampled_from([4, 8]))
    def check(kv, groups, tp, head_dim):
        heads = kv * groups
        model = _llama(num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                       hidden_size=heads * head_dim, intermediate_size=12 * tp)
        mesh = hp.Layout((tp,), ("tp",)).mesh
        divides = heads % tp == 0 and kv % tp == 0
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = _resolve(model, "auto", mesh, mesh)
        said = [w for w in caught if "run replicated" in str(w.message)]
        for i in range(2):
            attn = [n for n, _ in model.named_parameters() if n.startswith(f"model.layers.{i}.self_attn.")]
            planned = [n for n in attn if n in res.params]
            q_only = [n for n in attn if "k_proj" not in n and "v_proj" not in n]
            want = attn if divides else q_only if heads % tp == 0 else []
            assert planned == want, (heads, kv, tp, planned)
            assert f"model.layers.{i}.mlp.down_proj.weight" in res.params
        assert bool(said) == (heads % tp != 0)
        if divides:
            _resolve(model, dict(model.tp_plan), mesh, mesh)
        else:
            with pytest.raises(ValueError, match="heads .* cannot be split evenly"):
                _resolve(model, dict(model.tp_plan), mesh, mesh)

    check()


def test_mesh_without_named_axis():
    with pytest.raises(ValueError, match="unknown alias 'tp'.*\\('dp',\\)"):
        hp.shard(MLP(), ShardingPlan(plan={"up.weight": ("tp", "None")}), hp.Layout((2,), ("dp",)))
    with pytest.raises(ValueError, match="needs a mesh axis named 'tp'.*\\('dp', 'cp'\\)"):
        hp.shard(_llama(), "auto", hp.Layout((2, 2), ("dp", "cp")))


def test_bad_spec_rank():
    with pytest.raises(ValueError, match="has 1 entries but the tensor has 2 dims"):
        hp.shard(MLP(), ShardingPlan(plan={"up.weight": ("tp",)}), hp.Layout((2,), ("tp",)))


def test_one_rank_returns_model():
    """No torch.distributed: the default mesh is one rank named "tp"."""
    ref = _llama()
    model = hp.shard(copy.deepcopy(ref), "auto")
    assert model.lm_head.weight.device_mesh.mesh_dim_names == ("tp",)
    assert isinstance(model.lm_head.weight, hp.DTensor)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(_full(model(ids).logits), ref(ids).logits, **TOL)
    other = hp.shard_module(copy.deepcopy(ref), hp.Layout((1,), ("tp",)), _llama_plan())  # torch's argument order
    with torch.no_grad():
        torch.testing.assert_close(_full(other(ids).logits), ref(ids).logits, **TOL)


def test_a_model_without_embeddings_has_none():
    """transformers raises NotImplementedError from get_input_embeddings on models that have none (vision
    towers such as Gemma4VisionModel): shard's report and the pipeline's cutter take that as no embeddings."""
    from torch import nn
    from hyper_parallel.parallel.surgery import embeddings

    class Tower(nn.Module):
        def get_input_embeddings(self):
            raise NotImplementedError("not auto-handled")

    class WithEmbeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(4, 2)

        def get_input_embeddings(self):
            return self.embed

    assert embeddings(Tower(), "input") is None and embeddings(Tower(), "output") is None
    model = WithEmbeddings()
    assert embeddings(model, "input") is model.embed
