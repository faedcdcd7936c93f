"""The requirement's own models (Qwen3-VL, Qwen3-VL-MoE, Qwen3-Omni thinker) and other families under
pipeline parallel (stages cut by structure) and expert parallel, against one plain process on the same
global batch: loss and every gradient within 1e-5."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyper_parallel.tools.model_inputs import pad_tokens

VOCAB = 128
IMAGE, VIDEO, VSTART, VEND, AUDIO, ASTART, AEND = 120, 121, 122, 123, 124, 125, 126
BATCH = 4
TOL = dict(atol=1e-5, rtol=0)
_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
               spatial_merge_size=2, in_channels=3, num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
_GRID = (1, 4, 4)  # one image of 4x4 patches -> 4 merged tokens
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0, rope_parameters=_MROPE,
             tie_word_embeddings=False)
_MOE = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)


def _untie(model):
    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    for c in {id(model.config): model.config, id(model.config.get_text_config()): model.config.get_text_config()}.values():
        c.tie_word_embeddings = False
    return model


def _pixels(gen, n_images):
    return torch.randn(n_images * 16, 3 * 2 * 4 * 4, generator=gen)


def _image_row(gen, seq_text=6):
    row = [5, 6, VSTART] + [IMAGE] * 4 + [VEND] + [7 + i for i in range(seq_text)]
    return row


def build(kind: str, layers: int = 4, even_labels: bool = False, pad_to: int = 1):
    """(model, inputs, labels): a tiny random model, identical in every process, and its global batch (one
    image per sample; audio too for the Omni thinker), right-padded to a multiple of `pad_to` tokens (mask 0,
    labels -100: what context parallelism asks for)."""
    import transformers
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(7)
    text = dict(_TEXT, num_hidden_layers=layers)
    if kind in ("qwen3_vl", "qwen3_vl_moe"):
        moe = kind == "qwen3_vl_moe"
        name = "Qwen3VLMoe" if moe else "Qwen3VL"
        cfg = getattr(transformers, f"{name}Config")(
            text_config=dict(text, **(_MOE if moe else {})), vision_config=dict(_VISION, out_hidden_size=32),
            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
            tie_word_embeddings=False)
        model = getattr(transformers, f"{name}ForConditionalGeneration")(cfg)
        row = _image_row(gen)
        ids = torch.tensor([row] * BATCH)
        ids[:, :2] = torch.randint(1, 100, (BATCH, 2), generator=gen)
        ids[:, -4:] = torch.randint(1, 100, (BATCH, 4), generator=gen)
        inputs = {"attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == IMAGE).long(),
                  "pixel_values": _pixels(gen, BATCH), "image_grid_thw": torch.tensor([_GRID] * BATCH)}
        inputs["attention_mask"][1, :2] = 0   # left padding on one row
    elif kind == "qwen3_omni_thinker":
        audio = dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                     output_dim=32, downsample_hidden_size=8, max_source_positions=64, n_window=50,
                     n_window_infer=100, conv_chunksize=50)
        cfg = transformers.Qwen3OmniMoeThinkerConfig(
            text_config=dict(text, **_MOE), vision_config=dict(_VISION, out_hidden_size=32), audio_config=audio,
            audio_token_id=AUDIO, image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART,
            vision_end_token_id=VEND, audio_start_token_id=ASTART, audio_end_token_id=AEND, user_token_id=3)
        model = transformers.Qwen3OmniMoeThinkerForConditionalGeneration(cfg)
        row = [1, 3, 5, ASTART] + [AUDIO] * 3 + [AEND, 6, VSTART] + [IMAGE] * 4 + [VEND, 7, 8, 9, 10]
        ids = torch.tensor([row] * BATCH)
        ids[:, 2] = torch.randint(10, 100, (BATCH,), generator=gen)
        ids[:, -4:] = torch.randint(10, 100, (BATCH, 4), generator=gen)
        inputs = {"attention_mask": torch.ones_like(ids),
                  "input_features": torch.randn(BATCH, 16, 20, generator=gen),
                  "feature_attention_mask": torch.ones(BATCH, 20, dtype=torch.long),
                  "pixel_values": _pixels(gen, BATCH), "image_grid_thw": torch.tensor([_GRID] * BATCH)}
    elif kind == "llava":
        cfg = transformers.LlavaConfig(
            text_config=dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, tie_word_embeddings=False),
            vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4),
            image_token_index=IMAGE, vision_feature_layer=-1, vision_feature_select_strategy="default",
            tie_word_embeddings=False)
        model = transformers.LlavaForConditionalGeneration(cfg)
        row = [5, 6] + [IMAGE] * 16 + [7, 8, 9, 10]
        ids = torch.tensor([row] * BATCH)
        ids[:, -4:] = torch.randint(1, 100, (BATCH, 4), generator=gen)
        inputs = {"attention_mask": torch.ones_like(ids),
                  "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=gen)}
    else:
        raise KeyError(kind)
    model = _untie(model.float())
    model.train()
    labels = ids.clone()
    labels[ids >= IMAGE] = -100
    if not even_labels:   # micro-batches / shares with different numbers of valid tokens
        labels[2, :3] = -100
    return model, *pad_tokens(dict(input_ids=ids, **inputs), labels, pad_to)


def reference(kind: str, even_labels: bool = False, names: tuple | None = None, pad_to: int = 1):
    """One plain process: the loss and every gradient of one step on the global batch (only the inputs
    `names`, if given)."""
    model, inputs, labels = build(kind, even_labels=even_labels, pad_to=pad_to)
    inputs = inputs if names is None else {k: inputs[k] for k in names}
    loss = model(**inputs, labels=labels).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _full(t):
    from hyper_parallel import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _share(mesh, inputs: dict, labels):
    """This rank's share of the global batch over the data axes (API §12); image rows go with their samples."""
    import hyper_parallel as hp
    n = hp.data_world(mesh)
    if n == 1:
        return inputs, labels
    r = hp.data_rank(mesh)
    return {k: v.chunk(n)[r] for k, v in inputs.items()}, labels.chunk(n)[r]


def pipelined_step(rank, world, kind, shape, names, kwargs):
    """Worker: one training step through pipeline(); loss and this rank's gradients (full)."""
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", shape, names)
    model, inputs, labels = build(kind)
    pipe = hp.pipeline(model, mesh, **kwargs)
    inputs, labels = _share(mesh, inputs, labels)
    ids = inputs.pop("input_ids")
    loss = pipe.step(ids, labels=labels, **inputs).item()
    grads = {n: _full(p.grad).detach().clone() for n, p in pipe.named_parameters() if p.grad is not None}
    return loss, grads


def check(results, kind, ref=None):
    want_loss, want_grads = (ref or reference)(kind)
    seen = set()
    for rank, (loss, grads) in enumerate(results):
        assert loss == pytest.approx(want_loss, abs=1e-5), (rank, loss, want_loss)
        for name, g in grads.items():
            torch.testing.assert_close(g, want_grads[name], **TOL, msg=lambda m: f"rank {rank} {name}: {m}")
            seen.add(name)
    assert seen == set(want_grads), sorted(set(want_grads) ^ seen)[:5]


MODELS = ["qwen3_vl", "qwen3_vl_moe", "qwen3_omni_thinker", "llava"]


@pytest.mark.parametrize("kind", MODELS)
def test_pp2_1f1b_matches_one_process(dist2, kind):
    check(dist2.run(pipelined_step, kind, (2,), ("pp",), dict(schedule="1f1b", n_microbatches=2)), kind)


@pytest.mark.parametrize("kind", MODELS)
def test_pp2_interleaved_1f1b_four_stages_matches_one_process(dist2, kind):
    """Four stages over two ranks: the deepstack features (layers 0-1) and the 3-D positions are carried
    across three stage boundaries."""
    kwargs = dict(schedule="interleaved_1f1b", stages_per_rank=2, n_microbatches=2)
    check(dist2.run(pipelined_step, kind, (2,), ("pp",), kwargs), kind)


def test_pp4_1f1b_qwen3_vl_moe(dist4):
    check(dist4.run(pipelined_step, "qwen3_vl_moe", (4,), ("pp",), dict(schedule="1f1b", n_microbatches=4)),
          "qwen3_vl_moe")


def test_pp2_dp2_hsdp_qwen3_vl(dist4):
    kwargs = dict(schedule="1f1b", n_microbatches=2, hsdp={"threshold": 0})
    check(dist4.run(pipelined_step, "qwen3_vl", (2, 2), ("pp", "dp"), kwargs), "qwen3_vl")


# ---- expert parallel ------------------------------------------------------------------------------------
_TEXT_INPUTS = ("input_ids", "attention_mask")


def text_reference(kind: str, even_labels: bool = False):
    return reference(kind, even_labels, _TEXT_INPUTS)


def expert_step(rank, world, kind, shape, names, even_labels=False, media=False, hsdp=None, pad_to=1):
    """Worker: one training step of expert_parallel (names ("ep",)) / parallelize on `names` (hsdp: its
    arguments, {"threshold": 0} by default on a "dp" axis), each data rank feeding its share of the batch: text
    only, or with `media` its samples' images (pixel rows and grids) and audio too; loss (mean over the global
    batch) and gradients; sequences padded to a multiple of `pad_to` (2 x cp on a "cp" axis)."""
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", shape, names)
    model, inputs, labels = build(kind, even_labels=even_labels, pad_to=pad_to)
    inputs = inputs if media else {k: inputs[k] for k in _TEXT_INPUTS}
    if names == ("ep",):
        hp.expert_parallel(model, mesh, "ep")
    else:
        hp.parallelize(model, mesh, hsdp=(hsdp or {"threshold": 0}) if "dp" in names else None)
    if "ep" in names:
        assert any("ep:" in a and "experts modules" in a for a in model._hp_applied), model._hp_applied
    inputs, labels = _share(mesh, inputs, labels)
    loss = model(**inputs, labels=labels).loss
    loss.backward()
    loss = _full(loss).detach().clone()
    if "dp" in names:   # each dp replica's loss is the mean over its share
        torch.distributed.all_reduce(loss, group=mesh.get_group("dp"))
        loss /= mesh.size("dp")
    grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


@pytest.mark.parametrize("kind", ["qwen3_vl_moe", "qwen3_omni_thinker"])
def test_ep2_matches_one_process(dist2, kind):
    check(dist2.run(expert_step, kind, (2,), ("ep",)), kind, text_reference)


def test_dp2_ep2_parallelize_qwen3_vl_moe(dist4):
    """hsdp averages the dp replicas (each the mean over its share, as DDP): shares with equal valid tokens."""
    results = dist4.run(expert_step, "qwen3_vl_moe", (2, 2), ("dp", "ep"), True)
    check(results, "qwen3_vl_moe", lambda kind: text_reference(kind, even_labels=True))


MOE_MODELS = ["qwen3_vl_moe", "qwen3_omni_thinker"]


@pytest.mark.parametrize("kind", MOE_MODELS)
def test_ep2_with_images_and_audio_fed_per_rank(dist2, kind):
    """Each ep rank feeds its own samples' pixel rows and image grids (and audio features): the towers see
    the global batch's images in the ranks' order, as one process does."""
    check(dist2.run(expert_step, kind, (2,), ("ep",), False, True), kind)


@pytest.mark.parametrize("kind", MOE_MODELS)
def test_dp2_ep2_parallelize_with_images_and_audio(dist4, kind):
    results = dist4.run(expert_step, kind, (2, 2), ("dp", "ep"), True, True)
    check(results, kind, lambda kind: reference(kind, even_labels=True))


def test_experts_it_cannot_spread_are_refused_by_name():
    import transformers
    import hyper_parallel as hp
    from hyper_parallel.parallel.expert import unsupported_experts
    cfg = transformers.Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                        intermediate_size_mlp=64, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=8, num_local_experts=4)
    model = transformers.Llama4ForCausalLM(cfg)
    refused = unsupported_experts(model)
    assert list(refused) == ["model.layers.0.feed_forward.experts"], refused
    assert "Llama4TextExperts.forward" in refused["model.layers.0.feed_forward.experts"]
    mesh = hp.init_device_mesh("cpu", (1,), ("ep",))
    with pytest.raises(ValueError, match="cannot spread: model.layers.0.feed_forward.experts"):
        hp.expert_parallel(model, mesh, "ep")


# ---- the structural cutter: property test ----------------------------------------------------------------
_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "sliding_window": 4}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=8, **_MOE)),
}


def _family_model(family: str, layers: int):
    import transformers
    config_name, model_name, extra = _FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).float()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(_FAMILIES) + ["qwen3_vl"]), st.integers(1, 4), st.integers(1, 5),
       st.sampled_from([1, 2]))
def test_structural_cutter_property(family, layers, n_stages, n_micro):
    """Any family, layer count and stage count: the stages run in sequence in one process give the plain
    model's loss and gradients, or a clear refusal (more stages than layers)."""
    import hyper_parallel as hp
    if family == "qwen3_vl":
        model, inputs, labels = build("qwen3_vl", layers=layers)
        plain, _, _ = build("qwen3_vl", layers=layers)
    else:
        model, plain = _family_model(family, layers), _family_model(family, layers)
        g = torch.Generator().manual_seed(layers)
        ids = torch.randint(0, VOCAB, (4, 8), generator=g)
        inputs, labels = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids.clone()
    mesh = hp.init_device_mesh("cpu", (1,), ("pp",))
    schedule = "gpipe" if n_stages == 1 else "interleaved_1f1b"
    if n_stages > layers:
        with pytest.raises(ValueError, match="each stage needs at least one layer"):
            hp.pipeline(model, mesh, schedule=schedule, stages_per_rank=n_stages, n_microbatches=n_micro)
        return
    pipe = hp.pipeline(model, mesh, schedule=schedule, stages_per_rank=n_stages, n_microbatches=n_micro)
    assert [len(s.layers) > 0 for s in pipe.specs] == [True] * n_stages
    inputs = dict(inputs)
    ids = inputs.pop("input_ids")
    loss = pipe.step(ids, labels=labels, **inputs)
    want = plain(input_ids=ids, labels=labels, **inputs).loss
    want.backward()
    assert float(loss) == pytest.approx(want.item(), abs=1e-5)
    grads = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        if grads[name].grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, grads[name].grad, **TOL, msg=lambda m: f"{name}: {m}")


# ---- refusals on every rank ------------------------------------------------------------------------------
def _failing_stage_step(rank, world, failing_layer):
    """Worker: a pp=2 llama whose layer `failing_layer` raises in forward (on one rank only); the error each
    rank gets."""
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (2,), ("pp",))
    model = _family_model("llama", 4)

    def fail(*args, **kwargs):
        raise RuntimeError(f"layer {failing_layer} cannot take this")
    model.model.layers[failing_layer].forward = fail
    pipe = hp.pipeline(model, mesh, schedule="1f1b", n_microbatches=2)
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    try:
        pipe.step(ids, labels=ids)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("failing_layer, stage", [(3, 1), (0, 0)])
def test_a_stage_that_fails_fails_on_every_rank(dist2, failing_layer, stage):
    """A stage's forward that fails on its own rank (here a layer raising; in the census, layers whose loop a
    stand-in could not satisfy) raises the same error on every pp rank, naming the stage, instead of leaving
    the other ranks waiting for its activations until a timeout."""
    errors = dist2.run(_failing_stage_step, failing_layer)
    assert errors[0] == errors[1], errors
    assert f"stage {stage} (on pp rank {stage}) refused this micro-batch" in errors[0], errors
    assert f"layer {failing_layer} cannot take this" in errors[0], errors


@pytest.mark.parametrize("model_type", ["zaya", "inkling2_text"])
def test_a_second_state_flowing_through_the_layers_is_carried_across_the_cut(model_type):
    """Zaya's layers return (hidden, router states) and its loop hands the router states to the next layer;
    Inkling2's loop stacks block outputs and hands the stack to every layer: a later stage starting from None /
    an empty stack would train a different model (the census found losses 8e-5 and 4e-3 off). The cut carries
    what the loop hands the next stage's first layer with the hidden state, and two stages in one process
    train as the plain model: the loss and every gradient."""
    import copy
    import transformers
    import hyper_parallel as hp
    from hyper_parallel.tools.auto_models import tiny_config
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type)).float()
    plain = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    want = plain(input_ids=ids, labels=ids).loss
    want.backward()
    pipe = hp.pipeline(model, hp.init_device_mesh("cpu", (1,), ("pp",)), schedule="interleaved_1f1b",
                       stages_per_rank=2, n_microbatches=2)
    assert float(pipe.step(ids, labels=ids)) == pytest.approx(float(want.detach()), abs=1e-5)
    grads = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        if p.grad is not None or grads[name].grad is not None:
            torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("model_type", ["hunyuan_vl", "deepseek_v4"])
def test_models_whose_stages_differ_from_the_usual_shape_pipeline_as_one_device(model_type):
    """Two models the census found apart from the usual embeddings -> layers -> head shape:
    HunYuan-VL numbers the images of a batch in its 3-D rotary positions (row 1's image is image 1), so a
    micro-batch computing its own gave row 1 other positions (loss 2e-4 off): the pipeline computes them on
    the whole batch and hands each micro-batch its rows. DeepSeek-V4 widens the embeddings into hc_mult
    residual streams before its layers: a later stage's placeholder embeddings take the embeddings' shape,
    not the (wider) hidden state's."""
    import copy
    import hyper_parallel as hp
    from hyper_parallel.tools.auto_models import build_model_type
    case = build_model_type(model_type, 0)
    plain, model = case.model, copy.deepcopy(case.model)
    inputs = dict(case.inputs)
    ids, labels = inputs.pop("input_ids"), case.labels["labels"]
    want = plain(input_ids=ids, labels=labels, **inputs).loss
    want.backward()
    pipe = hp.pipeline(model, hp.init_device_mesh("cpu", (1,), ("pp",)), schedule="interleaved_1f1b",
                       stages_per_rank=2, n_microbatches=2)
    loss = pipe.step(ids, labels=labels, **inputs)
    assert float(loss) == pytest.approx(want.item(), abs=1e-6)
    grads = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, **TOL, msg=lambda m: f"{name}: {m}")
