"""Context parallelism (`context_parallel`): whole models on 2 and 4 real processes against one plain process."""
import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

import hyper_parallel as hp
from hyper_parallel.parallel.context.attention import METHODS
from hyper_parallel.parallel.context.ring import (BlockAttention, Visibility, block_backward, block_forward, merge,
                                                  sink_grad, with_sink)

SEQ, BATCH, VOCAB = 16, 2, 96


def _model(name: str, attn: str = "sdpa", kv_heads: int = 4):
    """Tiny Llama (4 heads) or Qwen3 (8 query heads over 4 key/value heads: GQA); "qwen3_window": its second layer
    a sliding-window one (window 4: its cache layer keeps the last 3 keys); no dropout."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False)
    window = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1) if name == "qwen3_window" else {}
    config = (LlamaConfig(num_attention_heads=4, num_key_value_heads=kv_heads, **common) if name == "llama"
              else Qwen3Config(num_attention_heads=8, num_key_value_heads=4, head_dim=8, **common, **window))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).train()


# heads split over "tp" (column-parallel q/k/v and gate/up, row-parallel o/down) on the ("cp", "tp") mesh
TP_PLAN = {f"model.layers.*.{m}.weight": ("tp", "None") for m in
           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
TP_PLAN.update({f"model.layers.*.{m}.weight": ("None", "tp") for m in ("self_attn.o_proj", "mlp.down_proj")})


def _batch(padded: bool):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, 3] = labels[1, 7] = -100
    mask = torch.ones_like(ids)
    if padded:  # right padding of the second row, as tokenizers pad for training
        mask[1, -5:] = 0
        ids[1, -5:] = 0
        labels[1, -5:] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _full(t):
    return t.full_tensor() if isinstance(t, hp.DTensor) else t


def _check_model(mesh, name, method, padded, attn="sdpa", shard_tp=False, via_parallelize=False):
    model = _model(name, attn)
    ref = copy.deepcopy(model)
    if via_parallelize:  # shard on "tp" then context_parallel on "cp", in parallelize's order
        hp.parallelize(model, mesh, tp=hp.ShardingPlan(plan=TP_PLAN), cp=method)
    else:
        if shard_tp:
            hp.shard(model, hp.ShardingPlan(plan=TP_PLAN), mesh)
        hp.context_parallel(model, mesh, "cp", method)
    batch = _batch(padded)
    out = model(**batch)
    out.loss.backward()
    want = ref(**batch)
    want.loss.backward()
    where = f"{name}/{method}/padded={padded}/{attn}"
    assert torch.allclose(_full(out.logits), want.logits, atol=1e-5), where
    _assert_same_loss_and_grads(out, want, model, ref, where)


def _assert_same_loss_and_grads(out, want, model, ref, where: str):
    """The context-parallel step's loss and every parameter's gradient equal one process's (within 1e-5); a
    parameter the loss does not reach on one process (DeepSeek-V3.2's indexer, detached there) gets none."""
    assert torch.allclose(_full(out.loss), want.loss, atol=1e-5), where
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        if r.grad is None:
            assert p.grad is None, f"{where}: {n} has a gradient under cp and none on one process"
            continue
        assert p.grad is not None, f"{where}: {n} has no gradient under cp"
        assert torch.allclose(_full(p.grad), r.grad, atol=1e-5), f"{where}: grad of {n}"


def _every_method(rank, world):
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    for name in ("llama", "qwen3"):
        for method in ("ring", "ulysses", "allgather"):
            _check_model(mesh, name, method, padded=method != "allgather" or name == "llama")
    _check_model(mesh, "llama", "ring", padded=False, attn="eager")
    return True


def test_every_method_on_two_ranks(dist2):
    dist2.run(_every_method)


def test_every_method_on_four_ranks(dist4):
    dist4.run(_every_method)


def _with_tensor_parallel_and_errors(rank, world):
    """cp=2 x tp=2 (heads split over "tp" inside each context rank), then the errors decided up front."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    for name, method in (("qwen3", "ring"), ("llama", "ulysses"), ("qwen3", "allgather")):
        _check_model(mesh, name, method, padded=True, shard_tp=True)
    _check_model(mesh, "qwen3", "ring", padded=True, via_parallelize=True)
    cp_mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = hp.context_parallel(_model("llama"), cp_mesh)
    odd = _batch(False)
    odd = {k: v[:, :SEQ - 3] for k, v in odd.items()}  # 13 tokens: not a multiple of 2 x 4
    with pytest.raises(ValueError, match="multiple of 2 x 'cp' size = 8"):
        model(**odd)
    # inputs already split on the sequence over "cp" (plain order) are taken as they are
    batch = _batch(padded=True)
    ref = _model("llama")
    want = ref(**batch)
    split = {k: hp.DTensor.from_local(v.chunk(world, 1)[rank], hp.Layout(cp_mesh)("None", "cp"), shape=v.shape)
             for k, v in batch.items()}
    out = hp.context_parallel(copy.deepcopy(_model("llama")), cp_mesh, "cp", "ring")(**split)
    assert torch.allclose(_full(out.logits), want.logits, atol=1e-5)
    assert torch.allclose(_full(out.loss), want.loss, atol=1e-5)
    # Ulysses on 4 key/value-head groups of 2: decided from the config, before any communication
    with pytest.raises(ValueError, match="num_key_value_heads=2 does not divide by tp .1. x 'cp' .4."):
        hp.context_parallel(_model("llama", kv_heads=2), cp_mesh, method="ulysses")
    return True


def test_with_tensor_parallel_and_clear_errors(dist4):
    dist4.run(_with_tensor_parallel_and_errors)


def _with_hsdp(rank, world):
    """cp=2 with hsdp (ZeRO-3) on "dp" of a (2, 2) mesh: two AdamW steps equal one process on the whole batch."""
    import torch.distributed as dist
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    ref = _model("qwen3")
    model = hp.hsdp(hp.context_parallel(copy.deepcopy(ref), mesh, "cp", "ring"), optimizer_level="level3",
                    threshold=0, mesh=mesh)
    dp = mesh.get_local_rank("dp")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _batch(padded=False)
    for _ in range(2):
        loss_ref = ref(**batch).loss
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = model(**{k: v[dp:dp + 1] for k, v in batch.items()}).loss
        loss.backward()
        value = _full(loss).detach().clone()
        dist.all_reduce(value)
        # both rows count 14 labels, so the dp mean of the per-row losses is the whole batch's loss
        assert abs(value.item() / world - loss_ref.item()) < 1e-5, (value.item() / world, loss_ref.item())
        opt.step()
        opt.zero_grad()
    sd = model.full_state_dict(rank0_only=False)
    for k, v in ref.state_dict().items():
        assert torch.allclose(sd[k], v, atol=1e-5, rtol=0), k
    return True


def test_with_hsdp_on_a_third_axis(dist4):
    dist4.run(_with_hsdp)


# ---- the block merge, one process -------------------------------------------------------------------
def _blocks_case(data, batch, heads, lq, window=None):
    """q, k, v (float64, requiring grad), the query / key indices (queries the last keys' positions, or past the
    keys), a key padding mask or None, and random block bounds over the keys."""
    hq, hkv = heads
    lk = data.draw(st.one_of(st.just(lq), st.integers(1, 12)))  # square blocks often: the fused diagonal
    torch.manual_seed(data.draw(st.integers(0, 10_000)))
    q, k, v = (torch.randn(batch, h, n, 8, dtype=torch.float64, requires_grad=True)
               for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    q_index = torch.arange(lk - lq, lk) if lq <= lk else torch.arange(lq) - (lq - lk)
    key_ok = torch.rand(batch, lk) > 0.3 if data.draw(st.booleans()) else None
    if key_ok is not None:
        key_ok[:, 0] = True
    cuts = sorted(set(data.draw(st.lists(st.integers(1, lk - 1), max_size=3)) if lk > 1 else []))
    return q, k, v, q_index, torch.arange(lk), key_ok, [0] + cuts + [lk]


def _blockwise(q, k, v, vis, q_index, k_index, bounds, scale, d_out=None, softcap=None, sink=None):
    """Attention by blocks as ring does it: each key block attended alone, folded by the log-sum-exp merge, the
    sink applied last; with `d_out`, the gradients (dq, dk, dv, d_sink) summed from ring's block backward."""
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    lse = q.new_full(q.shape[:-1], float("-inf"))
    masks = [vis.mask(q_index, k_index[a:b], slice(a, b)) for a, b in zip(bounds, bounds[1:])]
    for (a, b), mask in zip(zip(bounds, bounds[1:]), masks):
        o, l = block_forward(q, k[:, :, a:b], v[:, :, a:b], mask, scale, softcap=softcap)
        out, lse = merge(out, lse, o, l)
    out, lse = with_sink(out, lse, sink)
    if d_out is None:
        return out, lse
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (a, b), mask in zip(zip(bounds, bounds[1:]), masks):
        bq, bk, bv = block_backward(q, k[:, :, a:b], v[:, :, a:b], mask, scale, d_out, out, lse, softcap=softcap)
        dq += bq
        dk[:, :, a:b] += bk
        dv[:, :, a:b] += bv
    return out, lse, (dq, dk, dv, sink_grad(d_out, out, lse, sink))


def _eager(q, k, v, mask, scale, softcap=None, sink=None):
    """One device's eager attention, as transformers writes it: scores, softcap, mask, the sink column
    concatenated, softmax, the sink dropped; rows that see no key (and no sink) are 0."""
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask[:, None], float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    p = torch.softmax(s, -1).nan_to_num()
    return p[..., :k.shape[2]] @ v.repeat_interleave(g, 1)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 2), st.sampled_from([(2, 2), (4, 2), (4, 1)]), st.integers(1, 9), st.booleans(), st.data())
def test_ring_merge_matches_sdpa(batch, heads, lq, causal, data):
    """Keys cut into random blocks, each attended alone and folded by the log-sum-exp merge, equal
    plain sdpa over all keys (causal or not, with a key padding mask), and so do the recomputed
    block gradients of ring's backward."""
    q, k, v, q_index, k_index, key_ok, bounds = _blocks_case(data, batch, heads, lq)
    vis = Visibility(causal, None, key_ok)
    full_mask = vis.mask(q_index, k_index, slice(None))
    ok_rows = None if full_mask is None else full_mask.any(-1)  # rows that see no key come out 0
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=None if full_mask is None else full_mask[:, None], scale=0.3,
        enable_gqa=heads[0] != heads[1])
    if ok_rows is not None:
        want = torch.where(ok_rows[:, None, :, None], want, torch.zeros_like(want))
    d_out = torch.randn_like(want)
    out, lse, grads = _blockwise(q, k, v, vis, q_index, k_index, bounds, 0.3, d_out)
    assert torch.allclose(out, want, atol=1e-10)
    gq, gk, gv = torch.autograd.grad(want, (q, k, v), d_out)
    for got, exp in zip(grads, (gq, gk, gv)):
        assert torch.allclose(got, torch.nan_to_num(exp), atol=1e-9)
    if causal and q.shape[2] == k.shape[2] and key_ok is None:  # a diagonal block through torch's fused kernel
        o, l = block_forward(q, k, v, None, 0.3, causal=True)
        assert torch.allclose(o, want, atol=1e-10) and torch.allclose(l, lse, atol=1e-10)
        grads = block_backward(q, k, v, None, 0.3, d_out, out, lse, causal=True)
        for got, exp in zip(grads, (gq, gk, gv)):
            assert torch.allclose(got, exp, atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 2), st.sampled_from([(2, 2), (4, 2), (4, 1)]), st.integers(1, 9), st.booleans(),
       st.sampled_from([None, 1, 3, 5]), st.sampled_from([None, 0.2, 1.5]), st.booleans(), st.data())
def test_block_merge_with_sinks_and_softcap_matches_eager(batch, heads, lq, causal, window, softcap, sinks, data):
    """Attention sinks (one logit per query head in the softmax's denominator, applied after the merge) and
    logit softcapping (tanh in the block kernel), with causal, sliding-window and padding masks and random
    key blocks: the merged blocks, ring's block backward (the sink's gradient too) and the one-block kernel of
    ulysses / allgather (`BlockAttention`, through autograd) equal eager attention with the sink column and
    the tanh applied."""
    q, k, v, q_index, k_index, key_ok, bounds = _blocks_case(data, batch, heads, lq)
    sink = (torch.randn(heads[0], dtype=torch.float64) * 2).requires_grad_() if sinks else None
    vis = Visibility(causal, window, key_ok)
    mask = vis.mask(q_index, k_index, slice(None))
    want = _eager(q, k, v, mask, 0.3, softcap, sink)
    d_out = torch.randn_like(want)
    inputs = (q, k, v) + ((sink,) if sinks else ())
    expect = torch.autograd.grad(want, inputs, d_out)
    out, _, grads = _blockwise(q, k, v, vis, q_index, k_index, bounds, 0.3, d_out, softcap, sink)
    assert torch.allclose(out, want, atol=1e-10)
    for got, exp in zip(grads, expect):
        assert torch.allclose(got, exp, atol=1e-9)
    one = BlockAttention.apply(q, k, v, sink, mask, 0.3, softcap)
    assert torch.allclose(one, want, atol=1e-10)
    for got, exp in zip(torch.autograd.grad(one, inputs, d_out), expect):
        assert torch.allclose(got, exp, atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 2), st.integers(2, 12), st.sampled_from([None, 2, 4]), st.booleans(), st.booleans(), st.data())
def test_index_masks_of_the_mask_builders_match_their_own_mask_in_any_order(batch, seq, window, prefix, padded,
                                                                              data):
    """The mask functions transformers' builders make for image / prefix blocks (`block_sequence_ids`: Gemma 3's
    image runs, PaliGemma's prefix), on causal or sliding-window masks, evaluated per block on the original token
    indices of a random held order with random key blocks (`IndexMask`, ring's blocks): the merged attention and
    ring's block backward equal eager attention under the builder's own 4-D mask (`sdpa_mask`) in the plain
    order."""
    from transformers import masking_utils as mu
    from hyper_parallel.parallel.context.ring import IndexMask
    torch.manual_seed(data.draw(st.integers(0, 10_000)))
    kinds = torch.randint(0, 2, (batch, seq)) if not prefix else (torch.arange(seq) < data.draw(
        st.integers(0, seq))).long().expand(batch, seq)
    blocks = mu.maybe_pad_block_sequence_ids(
        torch.where(kinds == 1, 0, -1) if prefix else
        torch.where(kinds == 1, torch.cumsum(kinds * (1 - torch.nn.functional.pad(kinds, (1, 0))[:, :-1]), 1) - 1, -1),
        None, seq, 0)
    base = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
    function = mu.or_masks(base, mu.blockwise_overlay(blocks))
    key_ok = (torch.rand(batch, seq) > 0.3) if padded else None
    if key_ok is not None:
        key_ok[:, 0] = True
    want_mask = mu.sdpa_mask(batch_size=batch, q_length=seq, kv_length=seq, mask_function=function,
                             attention_mask=key_ok, allow_is_causal_skip=False)[:, 0]
    order = torch.randperm(seq)   # the held order: position i holds original token order[i]
    q, k, v = (torch.randn(batch, 2, seq, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    vis = Visibility(True, window, None if key_ok is None else key_ok[:, order], IndexMask(function, batch))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, seq - 1), max_size=3))))
    d_out = torch.randn(batch, 2, seq, 8, dtype=torch.float64)
    out, _, grads = _blockwise(q, k, v, vis, order, order, [0] + cuts + [seq], 0.3, d_out)
    assert torch.equal(vis.mask(order, order, slice(None)), want_mask[:, order][:, :, order])
    plain = torch.argsort(order)   # held -> plain
    want = _eager(q[:, :, plain], k[:, :, plain], v[:, :, plain], want_mask, 0.3)[:, :, order]
    assert torch.allclose(out, want, atol=1e-10)
    for got, exp in zip(grads, torch.autograd.grad(want, (q, k, v), d_out)):
        assert torch.allclose(got, exp, atol=1e-9)


def _refuses_what_it_would_split_wrong(rank, world):
    """Models whose sequence split cannot be kept exact are refused on every rank, never run wrong: an `s_aux`
    that is not one sink logit per query head (GPT-OSS's made a bias per head and key: in its first attention,
    before any communication) and encoder-decoder models (whose decoder inputs are the shifted labels): those
    at the call, before any collective, the model left as it was. (Kosmos-2.5's positions from the token ids
    are split in order: `test_language_model_of_its_own_kind_runs_split_in_order_with_an_image`.)"""
    from hyper_parallel.tools.auto_models import build_model_type
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    said = []
    for model_type, at_call in (("gpt_oss", False), ("vision-encoder-decoder", True)):
        case = build_model_type(model_type)
        if model_type == "gpt_oss":
            for layer in case.model.model.layers:
                layer.self_attn.sinks = torch.nn.Parameter(torch.zeros(layer.self_attn.sinks.shape[0], 8))
        ids = torch.randint(1, 50, (2, 8))
        attn = case.model.config._attn_implementation
        try:
            with hp.comm_counter() as comms:
                model = hp.context_parallel(case.model, mesh)
            assert not at_call, f"{model_type}: context_parallel accepted it"
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        except ValueError as e:
            said.append(str(e).split(";")[0])
            if at_call:  # refused before any collective, the model as it was
                assert not any(comms.counts.values()), (model_type, comms.counts)
                assert case.model.config._attn_implementation == attn, model_type
        else:
            raise AssertionError(f"{model_type} ran under context parallelism")
    return said


def test_models_it_would_split_wrong_are_refused_on_every_rank(dist2):
    said = dist2.run(_refuses_what_it_would_split_wrong)
    assert said[0] == said[1], said
    sinks, encoder_decoder = said[0]
    assert "is an encoder-decoder model" in encoder_decoder, said[0]
    assert "s_aux of shape (4, 8)" in sinks, said[0]


# ---- attention the registered function cannot take over: the sequence split in order, through the dispatcher --
@pytest.mark.parametrize("model_type", ["bloom", "deepseek_v32", "inkling_text"])
def test_attention_of_its_own_runs_split_in_order_and_matches_one_process(dist2, model_type):
    """Bloom's attention code of its own (ALiBi), DeepSeek-V3.2's indexed sparse attention (its indexer's keys
    cached too) and Inkling's relative position bias (with its short convolutions over keys and values): the
    sequence is split in order and the model's own code runs through the dispatcher; a training step (the loss,
    every gradient) and greedy generate (its prompt forward split, its KV cache filled whole) equal one process,
    and the summary says which path it took."""
    notes = dist2.run(_matches_one_process, model_type, ("ring",), ("ring",))
    assert all("split over 'cp' in order" in note for note in notes), notes


@pytest.mark.parametrize("model_type", ["gpt2", "opt"])
def test_keys_gathered_by_a_flatten_are_split_again_or_split_in_order(dist2, model_type):
    """GPT-2's and OPT's projections flatten (batch, seq), so the dispatcher gathers their keys: GPT-2's are split
    again locally at the attention (the zigzag split, every method) and cached in the plain order; OPT counts its
    positions along the padding mask, so its sequence is split in order. Training and greedy generate (a padded
    prompt) equal one process."""
    methods = METHODS if model_type == "gpt2" else ("ring",)
    notes = dist2.run(_matches_one_process, model_type, methods, methods)
    assert all(("in order" in note) == (model_type == "opt") for note in notes), notes


def _split_property(rank, world, model_type, method, batch, seq, pads):
    """Worker: `model_type` under context_parallel(method): a training step on a random batch with right padding
    per row equals one process, loss and every gradient."""
    from hyper_parallel.tools.auto_models import build_model_type
    base = build_model_type(model_type).model.train()
    torch.manual_seed(5)
    ids = torch.randint(1, base.config.vocab_size, (batch, seq))
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        if pad:
            mask[row, -pad:] = 0
    labels = torch.where(mask.bool(), ids, -100)
    ref = copy.deepcopy(base)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    model = hp.context_parallel(copy.deepcopy(base), hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)),
                                "cp", method)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    _assert_same_loss_and_grads(out, want, model, ref, f"{model_type}/{method} {batch}x{seq} pads {pads}")
    return True


@settings(max_examples=6, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), st.data())
def test_split_in_order_property(dist2, batch, chunks, data):
    """Random batch, sequence (any multiple of the axis size) and right padding per row (a row may be padding but
    its first two tokens: one label after the shift): GPT-Neo's own attention over the sequence split in order
    equals one process."""
    seq = 2 * chunks
    pads = tuple(data.draw(st.integers(0, seq - 2)) for _ in range(batch))
    dist2.run(_split_property, "gpt_neo", "ring", batch, seq, pads)


@settings(max_examples=6, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.sampled_from(METHODS), st.data())
def test_keys_split_again_after_a_flatten_property(dist2, batch, chunks, method, data):
    """Random batch, sequence (any multiple of 2 x the axis size), method and right padding per row: GPT-2's keys,
    gathered by the dispatcher after its (batch, seq) flatten and split again at the attention, give one
    process's loss and gradients."""
    seq = 4 * chunks
    pads = tuple(data.draw(st.integers(0, seq - 2)) for _ in range(batch))
    dist2.run(_split_property, "gpt2", method, batch, seq, pads)


# ---- layers that mix the sequence by a scan run whole --------------------------------------------------------
def _tiny_batch(vocab: int) -> dict:
    batch = _batch(padded=True)
    batch["input_ids"] = batch["input_ids"] % vocab
    batch["labels"] = torch.where(batch["labels"] >= 0, batch["labels"] % vocab, -100)
    return batch


def _scan_layers(rank, world, model_type, methods):
    """Worker: a model with scan layers (Qwen3-Next: gated delta net layers between attention ones; Mamba: scans
    only; Falcon-H1: attention and Mamba side by side in every layer): a training step on a right-padded batch
    under each method, and greedy generate of left-padded prompts (the scan states and the attention keys filled
    whole by the split prompt forward), equal one process."""
    from hyper_parallel.tools.auto_models import build_model_type
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    base = build_model_type(model_type).model.train()
    batch = _tiny_batch(base.config.vocab_size)
    ref = copy.deepcopy(base)
    want = ref(**batch)
    want.loss.backward()
    for method in methods:
        model = hp.context_parallel(copy.deepcopy(base), mesh, "cp", method)
        assert "run whole" in model._hp_applied[-1], model._hp_applied
        out = model(**batch)
        out.loss.backward()
        _assert_same_loss_and_grads(out, want, model, ref, f"{model_type}/{method}")
    ref.eval()
    model = hp.context_parallel(copy.deepcopy(ref), mesh).eval()
    prompts = _prompts(2, 8, (0, 3))
    prompts["input_ids"] = prompts["input_ids"] % base.config.vocab_size
    assert torch.equal(_generated(model, prompts, 4), _generated(ref, prompts, 4)), model_type
    return True


@pytest.mark.parametrize("model_type,methods", [("qwen3_next", ("ring", "allgather")), ("mamba", ("ring",)),
                                                ("falcon_h1", ("ring",))])
def test_scan_layers_run_whole_and_match_one_process(dist2, model_type, methods):
    dist2.run(_scan_layers, model_type, methods)


def _whole_scan_property(rank, world, batch, chunks, hidden, pad):
    """Worker: a causal scan (cumulative sum over the sequence, padding zeroed by the 2D mask, as Mamba's mixer
    zeroes it) run through `run_whole` on a zigzag-split input equals the plain scan, values and gradient."""
    from hyper_parallel.parallel.context.api import plain_order, split, _padding_mask
    from hyper_parallel.parallel.context.attention import ContextSettings
    from hyper_parallel.parallel.context.scan_layers import run_whole
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    settings = ContextSettings(mesh, "cp", "ring")
    seq = 2 * world * chunks
    gen = torch.Generator().manual_seed(batch * 100 + seq * 10 + hidden + pad)
    x = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - pad:] = 0

    class Scan(torch.nn.Module):
        def forward(self, hidden_states, attention_mask=None):
            if attention_mask is not None:
                hidden_states = hidden_states * attention_mask[:, :, None]
            return hidden_states.cumsum(1) * 0.5, hidden_states.sum()

    layer = Scan()
    run_whole(settings, [layer])
    settings.split_pending = True
    dx = x.detach().clone().requires_grad_(True)
    got, total = layer(split(settings, dx, zigzag=True), attention_mask=_padding_mask(settings, mask))
    assert got.dist_layout.tensor_map[1] == (settings.axis_index,)   # split again for the layers after it
    got = plain_order(settings, got)
    (got * got).sum().backward()
    want = (x * mask[:, :, None]).cumsum(1) * 0.5
    (want * want).sum().backward()
    assert torch.allclose(got.full_tensor(), want, atol=1e-12)
    assert torch.allclose(_full(total), (x * mask[:, :, None]).sum().detach(), atol=1e-12)
    assert torch.allclose(dx.grad, x.grad, atol=1e-12)
    return True


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 5), st.data())
def test_scan_run_whole_equals_the_plain_scan(dist2, batch, chunks, hidden, data):
    """Random batch, sequence (a multiple of 2 x cp), width and padding of the last row."""
    pad = data.draw(st.integers(0, 4 * chunks - 1))
    dist2.run(_whole_scan_property, batch, chunks, hidden, pad)


# ---- generate: the prompt forward split, decoding as on one device ------------------------------------------
def _prompts(batch: int, seq: int, pads: tuple, seed: int = 3):
    """`batch` prompts of `seq` tokens, row r left-padded by pads[r] tokens (ids 0, attention_mask 0)."""
    ids = torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return dict(input_ids=ids, attention_mask=mask)


def _generated(model, prompts: dict, new: int):
    with torch.no_grad():
        tokens = model.generate(**prompts, max_new_tokens=new, do_sample=False)
    assert not isinstance(tokens, hp.DTensor), tokens.dist_layout  # generate's loop ran on plain tokens
    return tokens


def _generate_cases(rank, world, cases):
    """Worker: for each (model, method, batch, seq, pads, new tokens) greedy generate under context_parallel equals
    the plain model's tokens."""
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    models = {}
    for name, method, batch, seq, pads, new in cases:
        if (name, method) not in models:
            ref = _model(name).eval()
            models[name, method] = ref, hp.context_parallel(copy.deepcopy(ref), mesh, "cp", method).eval()
        ref, model = models[name, method]
        prompts = _prompts(batch, seq, pads)
        want, got = _generated(ref, prompts, new), _generated(model, prompts, new)
        assert torch.equal(got, want), (name, method, pads, got, want)
    return True


def _generate_and_cache(rank, world):
    """Worker: generate under cp equals the plain model (Llama and Qwen3's GQA, ring and ulysses, left padding
    of rows of different lengths, a sliding-window layer; sampling with one seed); the prompt forward leaves the KV cache whole (replicated over "cp") and in
    the plain order, equal to the plain model's; a prompt that does not split and a static cache are refused
    (the messages are compared across ranks by the caller)."""
    from transformers import DynamicCache
    cases = [(name, method, 2, 8, pads, 5) for name in ("llama", "qwen3") for method in ("ring", "ulysses")
             for pads in ((0, 0), (0, 3))] + [("qwen3_window", "ring", 2, 8, (0, 3), 5)]
    _generate_cases(rank, world, cases)
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ref = _model("qwen3").eval()
    model = hp.context_parallel(copy.deepcopy(ref), mesh, "cp", "ring").eval()
    prompts = _prompts(2, 8, (0, 3))
    with torch.no_grad():
        out = model(**prompts, cache=DynamicCache(config=model.config), use_cache=True)
        want = ref(**prompts, cache=DynamicCache(config=ref.config), use_cache=True)
    assert torch.allclose(_full(out.logits), want.logits, atol=1e-5)
    for layer, plain in zip(out.cache.layers, want.cache.layers):
        for got, exp in ((layer.keys, plain.keys), (layer.values, plain.values)):
            assert got.placements == (hp.Replicate(),) and torch.allclose(got.to_local(), exp, atol=1e-5)
    # sampling: the same seed on every rank gives one process's tokens; ranks that sample apart are stopped
    torch.manual_seed(5)
    want = ref.generate(**prompts, max_new_tokens=3, do_sample=True)
    torch.manual_seed(5)
    assert torch.equal(model.generate(**prompts, max_new_tokens=3, do_sample=True), want)
    torch.manual_seed(rank)
    with pytest.raises(hp.FeedError, match="fed different micro-batches"):
        model.generate(**prompts, max_new_tokens=3, do_sample=True)
    said = []
    for prompts, kwargs in ((_prompts(2, 7, (0, 0)), {}), (_prompts(2, 8, (0, 0)), {"cache_implementation": "static"})):
        with pytest.raises(hp.FeedError) as e:
            model.generate(**prompts, max_new_tokens=2, do_sample=False, **kwargs)
        said.append(str(e.value))
    assert "multiple of 2 x 'cp' size = 4" in said[0] and "left-pad the prompts" in said[0], said[0]
    assert "KV cache of type StaticCache is not supported" in said[1], said[1]
    return said


def test_generate_equals_one_process_and_refusals_on_every_rank(dist2):
    said = dist2.run(_generate_and_cache)
    assert said[0] == said[1], said


def _generate_with_tensor_parallel(rank, world):
    """Worker: cp=2 x tp=2 (the cache's heads split over "tp", its sequence whole), left padding."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    ref = _model("qwen3").eval()
    prompts = _prompts(2, 8, (2, 0))
    want = _generated(ref, prompts, 4)
    for method in ("ring", "ulysses"):
        model = hp.context_parallel(hp.shard(copy.deepcopy(ref), hp.ShardingPlan(plan=TP_PLAN), mesh), mesh, "cp",
                                    method).eval()
        got = _generated(model, prompts, 4)
        assert torch.equal(got, want), (method, got, want)
    return True


def test_generate_with_tensor_parallel(dist4):
    dist4.run(_generate_with_tensor_parallel)


def _generate_of_layers_that_reshape_their_cache(rank, world):
    """Worker: JetMoE repeats its key/value heads and DiffLlama regroups its values after caching them: the cache
    is filled where the layer caches (its `update`), not from what reaches the attention, and equals one
    process's tokens."""
    from hyper_parallel.tools.auto_models import build_model_type
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    for model_type in ("jetmoe", "diffllama"):
        ref = build_model_type(model_type).model.eval()
        model = hp.context_parallel(copy.deepcopy(ref), mesh).eval()
        prompts = _prompts(2, 8, (0, 2))
        prompts["input_ids"] = prompts["input_ids"] % 50
        want, got = _generated(ref, prompts, 4), _generated(model, prompts, 4)
        assert torch.equal(got, want), (model_type, got, want)
    return True


def test_generate_of_layers_that_reshape_their_cache(dist2):
    dist2.run(_generate_of_layers_that_reshape_their_cache)


@settings(max_examples=6, deadline=None)
@given(st.sampled_from(["llama", "qwen3"]), st.sampled_from(METHODS), st.integers(1, 2), st.integers(1, 3),
       st.data())
def test_generate_property(dist2, name, method, batch, chunks, data):
    """Random prompts whose length divides by 2 x cp (4, 8, 12 tokens), left padding per row (a row may be all
    padding but its last token), 1 to 4 new tokens, any method: the same tokens as one process."""
    seq = 4 * chunks
    pads = tuple(data.draw(st.integers(0, seq - 1)) for _ in range(batch))
    new = data.draw(st.integers(1, 4))
    dist2.run(_generate_cases, [(name, method, batch, seq, pads, new)])


def _sharpened(model):
    """q/k projections scaled up (scores of size ~1 instead of ~0.01 in a tiny random model), so that a softcap
    of 0.5 bends them (Gemma 2) and sink logits drawn at std 1 weigh against them (GPT-OSS)."""
    torch.manual_seed(2)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "q_proj") and hasattr(module, "k_proj"):
                module.q_proj.weight.mul_(8)
                module.k_proj.weight.mul_(8)
            if getattr(module, "attn_logit_softcapping", None) is not None:
                module.attn_logit_softcapping = 0.5
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_()
    return model


# GPT-OSS's attention heads split over "tp" (its q/k/v projections have biases; its experts stay whole)
ATTENTION_TP_PLAN = {k: v for k, v in TP_PLAN.items() if "self_attn" in k}
ATTENTION_TP_PLAN.update({f"model.layers.*.self_attn.{m}.bias": ("tp",) for m in ("q_proj", "k_proj", "v_proj")})


def _matches_one_process(rank, world, model_type, methods=METHODS, methods_generating=("ring",), tp_plan=None):
    """Worker: a tiny `model_type`: a training step under `methods` (loss and every gradient) and greedy generate
    under `methods_generating` equal one process; with `tp_plan`, on a ("cp", "tp") mesh of (world / 2, 2) with
    the model sharded by it first."""
    from hyper_parallel.tools.auto_models import build_model_type
    mesh = (hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)) if tp_plan is None else
            hp.init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("cp", "tp")))

    def parallel(model):
        return model if tp_plan is None else hp.shard(model, hp.ShardingPlan(plan=tp_plan), mesh)
    base = _sharpened(build_model_type(model_type).model).train()
    vocab = base.config.vocab_size
    batch = _batch(padded=True)
    batch["input_ids"] = batch["input_ids"] % vocab
    batch["labels"] = torch.where(batch["labels"] >= 0, batch["labels"] % vocab, -100)
    ref = copy.deepcopy(base)
    want = ref(**batch)
    want.loss.backward()
    for method in methods:
        model = hp.context_parallel(parallel(copy.deepcopy(base)), mesh, "cp", method)
        out = model(**batch)
        out.loss.backward()
        _assert_same_loss_and_grads(out, want, model, ref, f"{model_type}/{method}")
    ref.eval()
    prompts = _prompts(2, 8, (0, 3))
    prompts["input_ids"] = prompts["input_ids"] % vocab
    expected = _generated(ref, prompts, 4)
    for method in methods_generating:
        model = hp.context_parallel(parallel(copy.deepcopy(ref)), mesh, "cp", method).eval()
        assert torch.equal(_generated(model, prompts, 4), expected), (model_type, method)
    return str(hp.summary(model))


def test_latent_attention_of_deepseek_v3_matches_one_process(dist2):
    """DeepSeek-V3's multi-head latent attention (keys built in `kv.new_empty(...)` from the split parts; values
    narrower than the keys, which torch's CPU flash kernel does not take)."""
    dist2.run(_matches_one_process, "deepseek_v3")


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma2"])
def test_sinks_and_softcapping_match_one_process(dist2, model_type):
    """GPT-OSS's attention sinks (their gradient included) on sliding-window and full layers, and Gemma 2's logit
    softcapping (with its sliding layers and final logit softcap): training and greedy generate under every
    method equal one process."""
    dist2.run(_matches_one_process, model_type, METHODS, METHODS)


def test_sinks_with_tensor_parallel_match_one_process(dist4):
    """cp=2 x tp=2: each rank's sink logits are those of its "tp" heads, their gradient gathered back whole
    (ulysses would need 4 key/value heads)."""
    dist4.run(_matches_one_process, "gpt_oss", ("ring", "allgather"), ("ring",), ATTENTION_TP_PLAN)


# ---- forwards run whole; inputs split over the axis on another dim ------------------------------------------------
def _generate_without_a_cache(rank, world):
    """Worker: MPT keeps no KV cache (`use_cache=False` in its config), so generate runs the whole sequence, one
    token longer, at every step: training and greedy generate equal one process (the steps whose length does
    not divide run whole on every rank; those that divide are split again, their tokens grown from logits the
    dispatcher left split on the batch), and a training forward of such a length is still refused."""
    summary = _matches_one_process(rank, world, "mpt", ("ring",), ("ring",))
    from hyper_parallel.tools.auto_models import build_model_type
    model = hp.context_parallel(build_model_type("mpt").model.train(),
                                hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    ids = torch.randint(1, 50, (2, 9))
    with pytest.raises(hp.FeedError, match="sequence length 9 must be a multiple of 'cp' size = 2"):
        model(input_ids=ids, labels=ids)
    return summary


def test_generate_without_a_cache_matches_one_process_and_odd_training_lengths_are_refused(dist2):
    notes = dist2.run(_generate_without_a_cache)
    assert all("in order" in note for note in notes), notes


def _split_of_any_layout(rank, world, batch, chunks, zigzag, batch_split):
    """Worker: `split` of a DTensor (b, s, 3), replicated or split on the batch over the axis, gives the sequence
    split over the axis alone, with the held order's values (the zigzag order where `zigzag`)."""
    from hyper_parallel.parallel.context.api import split
    from hyper_parallel.parallel.context.attention import ContextSettings
    from hyper_parallel.parallel.context.zigzag import zigzag_slice
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    cp = ContextSettings(mesh, "cp", "ring")
    x = torch.randn(batch, 2 * world * chunks, 3, generator=torch.Generator().manual_seed(batch * 10 + chunks))
    d = hp.distribute_tensor(x, mesh, [hp.Shard(0) if batch_split else hp.Replicate()])
    out = split(cp, d, zigzag=zigzag)
    assert tuple(out.dist_layout.tensor_map) == ((), (cp.axis_index,), ()), out.dist_layout
    held = torch.cat([zigzag_slice(x, 1, r, world) for r in range(world)], 1) if zigzag else x
    assert torch.equal(out.full_tensor(), held), (batch, chunks, zigzag, batch_split)
    return True


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 2), st.integers(1, 3), st.booleans(), st.booleans())
def test_split_of_an_input_split_on_another_dim_property(dist2, half_batch, chunks, zigzag, batch_split):
    dist2.run(_split_of_any_layout, 2 * half_batch, chunks, zigzag, batch_split)
