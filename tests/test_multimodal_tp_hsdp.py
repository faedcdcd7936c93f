"""Tensor parallel, hsdp level3 and their 2x2 compositions on the requirement's multimodal models with an image
(and audio for the Omni thinker), against one plain process on the same global batch (API §5, §6, §16): loss and
every gradient within 1e-5; under tp alone generate gives the same tokens too."""
from __future__ import annotations

import pytest

from tests.harness import assert_generate_and_step_equal
from tests.test_multimodal_pp_ep import TOL, build, check, expert_step, reference
from tests.test_multimodal_tp_cp import _layer_bytes

_LEVEL3 = {"threshold": 0, "optimizer_level": "level3"}


def _tp_step(rank, world, kind):
    """Worker: shard(model, "auto") over ("tp",): generate and one step against the plain model; the share of
    the decoder layers' attention + MLP (experts included) bytes this rank holds, and the summary."""
    import hyper_parallel as hp
    model, inputs, labels = build(kind)
    ref, _, _ = build(kind)
    model.eval()
    ref.eval()
    hp.shard(model, "auto")
    assert_generate_and_step_equal(model, ref, inputs, {"labels": labels}, 3, TOL)
    held, whole = _layer_bytes(model)
    return held / whole, hp.summary(model)


def test_tp2_auto_qwen3_vl_moe_splits_layers_and_experts(dist2):
    (share, summary), _ = dist2.run(_tp_step, "qwen3_vl_moe")
    assert share <= 0.5 + 0.1 * 0.5, f"{share:.2%} of the layers' bytes held per rank\n{summary}"


def test_tp2_auto_llava_splits_its_llama_decoder_layers(dist2):
    """The fourth image-text family: Llava (a CLIP tower, a projector, a Llama decoder), fed an image."""
    (share, summary), _ = dist2.run(_tp_step, "llava")
    assert share <= 0.5 + 0.1 * 0.5, f"{share:.2%} of the layers' bytes held per rank\n{summary}"


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_vl_moe", "qwen3_omni_thinker", "llava"])
def test_hsdp_level3_with_image(dist2, kind):
    results = dist2.run(expert_step, kind, (2,), ("dp",), True, True, _LEVEL3)
    check(results, kind, lambda kind: reference(kind, even_labels=True))


@pytest.mark.parametrize("kind", ["qwen3_vl", "llava"])
def test_dp2_tp2_parallelize_with_image(dist4, kind):
    results = dist4.run(expert_step, kind, (2, 2), ("dp", "tp"), True, True, _LEVEL3)
    check(results, kind, lambda kind: reference(kind, even_labels=True))


@pytest.mark.parametrize("kind", ["qwen3_vl_moe", "qwen3_omni_thinker"])
def test_tp2_ep2_parallelize_with_image(dist4, kind):
    results = dist4.run(expert_step, kind, (2, 2), ("tp", "ep"), False, True)
    check(results, kind)


def test_pp2_tp2_qwen3_vl_with_image(dist4):
    """pipeline(..., tp="auto") on a ("pp", "tp") mesh: each stage's layers split over tp, the vision tower on
    the first stage, the image's deepstack features carried across the boundary."""
    from tests.test_multimodal_pp_ep import pipelined_step
    kwargs = dict(schedule="1f1b", n_microbatches=2, tp="auto")
    check(dist4.run(pipelined_step, "qwen3_vl", (2, 2), ("pp", "tp"), kwargs), "qwen3_vl")
