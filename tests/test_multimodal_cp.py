"""Context parallelism on the requirement's multimodal models fed an image (and audio for the Omni thinker), on 2
gloo ranks against one plain process on the same global batch (API §9, §16): the language sequence, placeholder
tokens included, is split; the 3-D rotary positions stay global; the towers run as on one device and keep their
own attention. Loss and every gradient within 1e-5; greedy generate gives the same tokens; unsplittable inputs
refused on every rank."""
from __future__ import annotations

import pytest

from tests.test_multimodal_pp_ep import IMAGE, _untie, build, check, expert_step, reference



def _pad(world: int) -> int:
    return 2 * world  # each rank holds two chunks of the sequence


def _cp_step(rank, world, kind, method, tp=1):
    """Worker: one training step of context_parallel over "cp" (with `shard(model, "auto")` on "tp" inside each
    context rank where tp > 1, through parallelize), every rank fed the whole global batch; the loss, every
    gradient (whole) and the attention implementation of each config."""
    import hyper_parallel as hp
    cp = world // tp
    model, inputs, labels = build(kind, pad_to=_pad(cp))
    if tp == 1:
        hp.context_parallel(model, hp.init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)), "cp", method)
    else:
        hp.parallelize(model, hp.init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp")), tp="auto", cp=method)
    loss = model(**inputs, labels=labels).loss
    loss.backward()
    full = hp.DTensor.full_tensor
    grads = {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    towers = {name: getattr(model.config, name)._attn_implementation
              for name in ("text_config", "vision_config", "audio_config") if hasattr(model.config, name)}
    return (full(loss).item(), grads), towers


def _reference(world: int):
    return lambda kind: reference(kind, pad_to=_pad(world))


@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_vl_moe", "qwen3_omni_thinker", "llava"])
def test_cp2_with_image_matches_one_process(dist2, kind, method):
    results = dist2.run(_cp_step, kind, method)
    check([step for step, _ in results], kind, _reference(2))
    towers = results[0][1]
    assert towers.pop("text_config").startswith(f"hyper_parallel_cp_{method}"), towers
    assert all(not impl.startswith("hyper_parallel") for impl in towers.values()), towers


def test_cp2_allgather_qwen3_vl(dist2):
    results = dist2.run(_cp_step, "qwen3_vl", "allgather")
    check([step for step, _ in results], "qwen3_vl", _reference(2))


def test_cp4_ring_qwen3_vl_some_ranks_without_image_tokens(dist4):
    """Chunks of 2 of 16 tokens: the image (positions 3-6) lies on ranks 1-3 (chunks 1-3), rank 0 adds no
    deepstack row."""
    results = dist4.run(_cp_step, "qwen3_vl", "ring")
    check([step for step, _ in results], "qwen3_vl", _reference(4))


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_vl_moe"])
def test_cp2_tp2_with_image(dist4, kind):
    """Under tp the towers' outputs reach the language model as plain tensors, the same on every rank: their
    gradients (embeddings, deepstack rows) are summed back whole over "cp"."""
    results = dist4.run(_cp_step, kind, "ring", 2)
    check([step for step, _ in results], kind, _reference(2))


def _image_and_video(rank, world):
    """Worker: the built-in Qwen3-VL case (an image and a two-frame video per sample, mm_token_type_ids) under
    cp=2 against a copy run plainly in the same process; the loss and worst gradient difference, the summary."""
    import copy
    import hyper_parallel as hp
    from hyper_parallel.tools.model_inputs import pad_tokens
    from hyper_parallel.tools.models import build_model
    case = build_model("qwen3_vl")
    inputs, labels = pad_tokens(case.inputs, case.labels, _pad(world))
    ref = copy.deepcopy(case.model)
    model = hp.context_parallel(case.model, hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    loss, want = model(**inputs, **labels).loss, ref(**inputs, **labels).loss
    loss.backward()
    want.backward()
    worst = max((hp.DTensor.full_tensor(p.grad) - r.grad).abs().max().item()
                for p, r in zip(model.parameters(), ref.parameters()) if r.grad is not None)
    return abs(hp.DTensor.full_tensor(loss).item() - want.item()), worst, hp.summary(model)


def test_cp2_qwen3_vl_with_image_and_video(dist2):
    loss, grad, summary = dist2.run(_image_and_video)[0]
    assert loss < 1e-5 and grad < 1e-5, (loss, grad)
    assert "at the entry of Qwen3VLTextModel" in summary, summary


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_omni_thinker"])
def test_dp2_cp2_hsdp_with_image(dist4, kind):
    """Each dp rank feeds its share (images included) whole over "cp"; hsdp averages the dp replicas (shares
    with equal valid tokens)."""
    results = dist4.run(expert_step, kind, (2, 2), ("dp", "cp"), True, True, None, _pad(2))
    check(results, kind, lambda kind: reference(kind, even_labels=True, pad_to=_pad(2)))


def _generate_with_image(rank, world, method):
    """Worker: greedy generate with an image per prompt (prompts left-padded to a multiple of 2 x cp): the prompt
    forward split at the language model's entry fills the KV cache whole, the decoding steps run as on one
    device (the 3-D positions from the model's own rope deltas); the tokens of one plain process."""
    import copy
    import torch
    import hyper_parallel as hp
    from hyper_parallel.tools.model_inputs import pad_tokens
    model, inputs, labels = build("qwen3_vl", layers=2)
    inputs, _ = pad_tokens(inputs, labels, _pad(world), left=True)
    ref = copy.deepcopy(model).eval()
    hp.context_parallel(model, hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)), "cp", method).eval()
    with torch.no_grad():
        want = ref.generate(**inputs, max_new_tokens=4, do_sample=False)
        got = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert not isinstance(got, hp.DTensor) and torch.equal(got, want), (got, want)  # plain tokens, as on one device
    return True


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_cp2_generate_with_image_matches_one_process(dist2, method):
    dist2.run(_generate_with_image, method)


def _refusals(rank, world):
    """Worker: what context parallelism cannot take is refused on every rank, from shapes, with the fix named."""
    import torch
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model, inputs, labels = build("qwen3_vl", layers=1)
    hp.context_parallel(model, mesh, "cp", "ring")
    seen = []
    with pytest.raises(hp.FeedError, match=f"multiple of 2 x 'cp' size = {_pad(world)}") as e:
        model(**inputs, labels=labels)   # 14 tokens
    seen.append(str(e.value))
    _, inputs, labels = build("qwen3_vl", layers=1, pad_to=_pad(world))
    batch, seq = labels.shape
    with pytest.raises(hp.FeedError, match=r"position_ids of shape \(3, 4, 12\) do not match"):
        model(**inputs, labels=labels, position_ids=torch.zeros(3, batch, seq - 4, dtype=torch.long))
    model.eval()
    _, inputs, _ = build("qwen3_vl", layers=1)
    with pytest.raises(hp.FeedError, match="14 must be a multiple of 2 x 'cp' size = 4.*left-pad the prompts") as e:
        model.generate(**inputs, max_new_tokens=2)   # 14 tokens
    seen.append(str(e.value))
    return seen


def test_refusals_on_every_rank(dist2):
    messages = dist2.run(_refusals)
    assert messages[0] == messages[1]


def _pipeline_refusal(rank, world):
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (2, 2), ("pp", "cp"))
    model, _, _ = build("qwen3_vl", layers=2)
    with pytest.raises(NotImplementedError, match="context parallelism .'cp' axis. inside the stages"):
        hp.pipeline(model, mesh, schedule="1f1b", n_microbatches=2, cp="ring")
    return True


def test_cp_inside_pipeline_stages_of_a_multimodal_model_refused(dist4):
    """Later stages never call the language model, where the split is made: refused up front on every rank."""
    dist4.run(_pipeline_refusal)


def _census_type_with_image(rank, world, model_type, methods):
    """Worker: the census's tiny build and inputs (an image) of `model_type`: a training step under every method
    (the loss and every gradient) and greedy generate under ring (prompts left-padded) equal one process; the
    model's summary. Labels: the text tokens where the model marks its image tokens (`token_type_ids`), else the
    census's."""
    import copy
    import torch
    import hyper_parallel as hp
    from hyper_parallel.tools.auto_models import build_model_type
    from hyper_parallel.tools.model_inputs import pad_tokens
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    case = build_model_type(model_type)
    base = _untie(case.model.float()).train()
    labels = (torch.where(case.inputs["token_type_ids"] == 0, case.inputs["input_ids"], -100)
              if "token_type_ids" in case.inputs else case.labels["labels"])
    inputs, labels = pad_tokens(dict(case.inputs), labels, _pad(world))
    ref = copy.deepcopy(base)
    want = ref(**inputs, labels=labels)
    want.loss.backward()
    want_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    for method in methods:
        model = hp.context_parallel(copy.deepcopy(base), mesh, "cp", method)
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        assert abs(hp.DTensor.full_tensor(loss).item() - want.loss.item()) < 1e-5, (model_type, method)
        for name, param in model.named_parameters():
            if name in want_grads:
                want_grad = want_grads[name]   # gradients of up to ~1e7 here (Gemma's scaled embeddings): 1e-5 of it
                torch.testing.assert_close(hp.DTensor.full_tensor(param.grad), want_grad, rtol=0,
                                           atol=1e-5 * max(1.0, want_grad.abs().max().item()),
                                           msg=lambda m: f"{model_type}/{method} {name}: {m}")
    prompts, _ = pad_tokens(dict(case.inputs), labels[:, :case.inputs["input_ids"].shape[1]], _pad(world), left=True)
    ref.eval()
    model = hp.context_parallel(copy.deepcopy(ref), mesh, "cp", "ring").eval()
    with torch.no_grad():
        expected = ref.generate(**prompts, max_new_tokens=3, do_sample=False)
        got = model.generate(**prompts, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, expected), (model_type, got, expected)
    return str(hp.summary(model))


@pytest.mark.parametrize("model_type,methods", [("gemma3", ("ring", "ulysses", "allgather")),
                                               ("paligemma", ("ring", "allgather"))])   # its one key/value head
def test_bidirectional_image_and_prefix_blocks_match_one_process(dist2, model_type, methods):
    """Gemma 3's image blocks and PaliGemma's prefix (`block_sequence_ids`: image / prefix tokens see each other
    both ways): the mask builders' own mask function is evaluated per block on original token indices."""
    dist2.run(_census_type_with_image, model_type, methods)


@pytest.mark.parametrize("model_type", ["blip-2", "kosmos-2"])
def test_language_model_of_its_own_kind_runs_split_in_order_with_an_image(dist2, model_type):
    """BLIP-2's OPT counts its positions along the padding mask, Kosmos-2's text model derives them from the token
    ids: the language model's sequence is split in order at its entry (the towers and the image features whole)
    and its own code runs through the dispatcher; training and generate equal one process."""
    notes = dist2.run(_census_type_with_image, model_type, ("ring",))
    assert all("in order" in note and "at the entry of" in note for note in notes), notes
