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
    elif name == "gpt_oss":
        cfg = T.GptOssConfig(intermediate_size=16, num_key_value_heads=2, head_dim=8, num_local_experts=8,
                             num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                             **common)
        cls = T.GptOssForCausalLM
    elif name == "qwen3_vl_moe":   # the text path of the vision-language MoE (experts stored transposed)
        text = dict(intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=2, head_dim=8, num_experts=8,
                    num_experts_per_tok=2, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]},
                    **{k: v for k, v in common.items() if k != "tie_word_embeddings"})
        cfg = T.Qwen3VLMoeConfig(text_config=text, tie_word_embeddings=False,
                                 vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4,
                                                    out_hidden_size=32))
        cls = T.Qwen3VLMoeForConditionalGeneration
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
def _train(rank, world, name, mesh_shape, level, skew=False, steps=2, via_parallelize=False):
    names = ("dp", "ep") if len(mesh_shape) == 2 else ("ep",)
    mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    ref = _model(name)
    model = copy.deepcopy(ref)
    if skew:
        _force_to_rank_zero(ref)
    if via_parallelize:   # expert_parallel on "ep", then hsdp on "dp"
        model = hp.parallelize(model, mesh, ep=True, hsdp=dict(optimizer_level=level, threshold=0))
        assert any(t.startswith("ep: ") for t in model._hp_applied), model._hp_applied
        level = None
    else:
        model = expert_parallel(model, mesh, "ep")
    if skew:
        _force_to_rank_zero(model)
    ep = mesh.size("ep")
    experts = find_experts(model)
    for m in experts.values():          # each rank holds 1/ep of the experts' bytes
        for p in m._parameters.values():
            assert via_parallelize or p._local.numel() * ep == p.numel(), (name, p.shape, p._local.shape)
    if level is not None:
        model = hp.hsdp(model, optimizer_level=level, threshold=0)
    dp = mesh.size("dp") if "dp" in names else 1
    dp_rank = mesh.get_local_rank("dp") if "dp" in names else 0
    ids = _batch(2 * hp.data_world(mesh))                 # the global batch: 2 rows per data share
    mine = ids.chunk(hp.data_world(mesh))[hp.data_rank(mesh)]   # API §12: each (dp, ep) rank feeds its share
    dp_rows = ids.chunk(dp)[dp_rank]    # what one dp replica's ep group holds together
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    params = dict(model.named_parameters())
    for step in range(steps):
        loss = model(input_ids=mine, labels=mine).loss
        ref_loss = ref(input_ids=ids, labels=ids).loss
        with torch.no_grad():
            ref_mine = ref(input_ids=dp_rows, labels=dp_rows).loss
        torch.testing.assert_close(_full(loss), ref_mine, **TOL)
        loss.backward()
        ref_loss.backward()
        if step == 0:
            for n, rp in ref.named_parameters():
                g = params[n].grad
                if rp.grad is None:      # unused here (a vision tower on text input)
                    assert g is None or not _full(g).any(), n
                    continue
                assert g is not None, n
                torch.testing.assert_close(_full(g), rp.grad, **TOL, msg=lambda m: f"grad {n}: {m}")
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
    for n, rp in ref.named_parameters():
        torch.testing.assert_close(_full(params[n].detach()), rp.detach(), **TOL, msg=lambda m: f"param {n}: {m}")
    return float(_full(loss))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_train_ep4(dist4, name):
    dist4.run(_train, name, (4,), None)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_train_dp_ep_hsdp_level3(dist4, name):
    dist4.run(_train, name, (2, 2), "level3")


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_vl_moe"])
def test_train_ep2_more_models(dist2, name):
    dist2.run(_train, name, (2,), None)


def test_train_dp_ep_through_parallelize(dist4):
    dist4.run(_train, "mixtral", (2, 2), "level3", False, 1, True)


def test_train_ep2_all_tokens_to_one_rank(dist2):
    dist2.run(_train, "mixtral", (2,), None, True)


# ---- generate with the batch split over the axis ------------------------------------------------------
def _generate(rank, world, name):
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    ref = _model(name).eval()
    model = expert_parallel(copy.deepcopy(ref), mesh)
    ids = _batch(world, seq=5)
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = ref.generate(input_ids=ids, attention_mask=mask, **kw)
    mine = slice(rank, rank + 1)   # each rank its share (API §12): the generated tokens are the global batch's
    got = model.generate(input_ids=ids[mine], attention_mask=mask[mine], **kw)
    assert torch.equal(_full(got), want), (_full(got), want)


def test_generate_ep2(dist2):
    dist2.run(_generate, "qwen3_moe")


# ---- property: the token dispatch against a plain reference ---------------------------------------------
def _dispatch_case(rank, world, seed, tokens, top_k, n_local, mode, target):
    """Every rank builds every rank's tokens and all experts from `seed`; it dispatches its own tokens and
    checks the output, the gradients of its tokens, weights and experts, and the all_to_all accounting."""
    import torch.distributed as dist
    from hyper_parallel.parallel.expert.dispatch import dispatch_combine
    hidden_dim, n_experts = 4, world * n_local
    g = torch.Generator().manual_seed(seed)
    experts = torch.randn(n_experts, hidden_dim, hidden_dim, generator=g, dtype=torch.float64)
    data = []
    for r in range(world):
        h = torch.randn(tokens[r], hidden_dim, generator=g, dtype=torch.float64)
        idx = torch.randint(0, n_experts, (tokens[r], top_k), generator=g)
        if mode == "one_rank":                  # every route to `target`'s experts
            idx = target * n_local + idx % n_local
        elif mode == "skip_rank":               # nobody routes to `target`: its experts get nothing
            idx = torch.where(idx // n_local == target, (idx + n_local) % n_experts, idx)
        w = torch.rand(tokens[r], top_k, generator=g, dtype=torch.float64)
        cot = torch.randn(tokens[r], hidden_dim, generator=g, dtype=torch.float64)
        data.append((h, idx, w, cot))

    # plain reference over every rank's tokens
    ref_experts = experts.clone().requires_grad_()
    ref_inputs = []
    total = 0
    for h, idx, w, cot in data:
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        per_route = torch.einsum("tkij,tj->tki", ref_experts[idx], h)
        out = (per_route * w.unsqueeze(-1)).sum(1)
        total = total + (out * cot).sum()
        ref_inputs.append((h, w, out))
    total.backward()

    h, idx, w, cot = data[rank]
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    mine = experts[rank * n_local:(rank + 1) * n_local].clone().requires_grad_()
    calls = []

    def compute(received, local_ids):
        calls.append(int(local_ids.numel()))
        return torch.einsum("rij,rj->ri", mine[local_ids], received) + received.sum() * 0

    with hp.comm_counter() as c:
        out = dispatch_combine(h, idx, w, n_local, dist.group.WORLD, compute)
        forward_calls = c.counts["all_to_all"]
        (out * cot).sum().backward()
    rh, rw, rout = ref_inputs[rank]
    torch.testing.assert_close(out, rout.detach())
    torch.testing.assert_close(h.grad, rh.grad)
    torch.testing.assert_close(w.grad, rw.grad)
    torch.testing.assert_close(mine.grad, ref_experts.grad[rank * n_local:(rank + 1) * n_local])
    # one counts exchange + tokens there and back; backward: the two token exchanges reversed
    assert forward_calls == 3 and c.counts["all_to_all"] == 5, c.counts
    owner = [i // n_local for _, i, _, _ in data]
    sent_away = int((owner[rank] != rank).sum())
    received_from_others = sum(int((o == rank).sum()) for r, o in enumerate(owner) if r != rank)
    row = hidden_dim * 8
    expect = (world - 1) * n_local * 8 + 2 * (sent_away + received_from_others) * row
    assert c.bytes["all_to_all"] == expect, (c.bytes, expect)
    assert calls == [sum(int((o == rank).sum()) for o in owner)]


try:
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st
except ImportError:  # pragma: no cover - hypothesis is in requirements-dev.txt
    given = None


if given is not None:
    # no shrinking: a failing example restarts the process pool, and the failing case is printed as drawn
    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.reuse, Phase.generate])
    @given(seed=st.integers(0, 2**31 - 1), tokens=st.lists(st.integers(0, 5), min_size=4, max_size=4),
           top_k=st.integers(1, 3), n_local=st.integers(1, 3),
           mode=st.sampled_from(["random", "one_rank", "skip_rank"]), target=st.integers(0, 3))
    def test_dispatch_property_four_ranks(dist4, seed, tokens, top_k, n_local, mode, target):
        dist4.run(_dispatch_case, seed, tokens, top_k, n_local, mode, target)


# ---- loud errors, decided from global metadata (one process, virtual mesh) --------------------------------
def test_errors_and_record_single_process():
    import transformers as T
    virtual3 = hp.init_device_mesh("cpu", (3,), mesh_dim_names=("ep",))
    with pytest.raises(ValueError, match="divide evenly over the 3 ranks"):
        expert_parallel(_model("qwen3_moe"), virtual3)
    with pytest.raises(ValueError, match="no axis named 'ep'"):
        expert_parallel(_model("qwen3_moe"), hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    llama = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(ValueError, match="no MoE experts module"):
        expert_parallel(llama, hp.init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))
    virtual2 = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    other = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    with pytest.raises(ValueError, match="already live on"):
        expert_parallel(expert_parallel(_model("mixtral"), other, "x"), virtual2)
    model = expert_parallel(_model("mixtral"), virtual2)
    assert model._hp_applied == ["ep: 2 experts modules of 8 experts over 'ep' (4 per rank), each rank's rows a "
                                 "share of the batch over 'ep'"]
    with pytest.raises(RuntimeError, match="needs torch.distributed"):   # a virtual mesh cannot exchange tokens
        model(input_ids=_batch(3))


# ---- checkpoints: experts are Shard(0) pieces, saved on ep=4 and loaded (resharded) on ep=2 --------------
def _save_ep(rank, world, path):
    from hyper_parallel import checkpoint
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    model = expert_parallel(_model("mixtral"), mesh)
    checkpoint.save({"model": model.state_dict()}, path)


def _load_ep(rank, world, path):
    from hyper_parallel import checkpoint
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    ref = _model("mixtral")
    model = _model("mixtral")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model = expert_parallel(model, mesh)
    state = {"model": model.state_dict()}
    checkpoint.load(state, path)
    params = dict(model.named_parameters())
    for n, rp in ref.named_parameters():
        torch.testing.assert_close(_full(params[n].detach()), rp.detach(), rtol=0, atol=0)
    ids = _batch(4)
    torch.testing.assert_close(_full(model(input_ids=ids, labels=ids).loss), ref(input_ids=ids, labels=ids).loss, **TOL)


def test_checkpoint_reshard_ep4_to_ep2(dist4, dist2, tmp_path):
    path = str(tmp_path / "ckpt")
    dist4.run(_save_ep, path)
    dist2.run(_load_ep, path)


# ---- check mode: every rank runs the same collectives (the splits differ, the fingerprints do not) ---------
def _train_checked(rank, world):
    hp.set_check(True)
    try:
        return _train(rank, world, "mixtral", (2,), None, steps=1)
    finally:
        hp.set_check(False)


def test_check_mode_ep2(dist2):
    dist2.run(_train_checked)
