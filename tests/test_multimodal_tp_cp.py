"""Tensor parallelism by structure on the requirement's multimodal models (API §16), on 2 and 4 gloo ranks
against one plain process: `shard(model, "auto")` splits every decoder layer's attention and MLP even where the
model's own tp_plan does not name them, and replicates only K/V when tp exceeds the key/value heads."""
import copy

import pytest
import torch

import hyper_parallel as hp
from tests.harness import assert_generate_and_step_equal

TOL = dict(atol=1e-5, rtol=1e-5)


def _layer_bytes(model, part: str = "") -> tuple[int, int]:
    """(bytes this rank holds, bytes of the whole) of the decoder layers' attention + MLP parameters."""
    held = whole = 0
    for name, p in model.named_parameters():
        if ".layers." not in name or not any(k in name for k in (("self_attn",) if part else ("self_attn", "mlp"))):
            continue
        if "language_model" not in name:
            continue
        local = p.to_local() if isinstance(p, hp.DTensor) else p
        held += local.numel() * local.element_size()
        whole += p.numel() * p.element_size()
    return held, whole


def _tp_auto(rank, world, name):
    from hyper_parallel.tools.models import build_model
    case = build_model(name)
    ref = case.model
    model = hp.shard(copy.deepcopy(ref), "auto")
    assert_generate_and_step_equal(model, ref, case.inputs, case.labels, 3, TOL)
    held, whole = _layer_bytes(model)
    attn_held, attn_whole = _layer_bytes(model, "attn")
    return held / whole, attn_held / attn_whole, hp.summary(model)


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_omni_thinker"])
def test_auto_plan_splits_decoder_layers_of_multimodal_models_on_two_ranks(dist2, name):
    (share, _, summary), _ = dist2.run(_tp_auto, name)
    assert share <= 0.5 + 0.1 * 0.5, f"{name}: {share:.2%} of the layers' bytes held per rank\n{summary}"
    assert "found by structure" in summary or name == "qwen3_omni_thinker", summary


def test_tp4_over_two_kv_heads_replicates_only_k_and_v(dist4):
    results = dist4.run(_tp_auto, "qwen3_vl")
    share, attn_share, summary = results[0]
    assert attn_share <= 0.6, f"{attn_share:.2%} of the attention bytes per rank\n{summary}"
    assert "k_proj/v_proj replicated" in summary, summary


def test_structure_plan_property():
    """Random tiny decoder attentions (heads, key/value heads, head size) and tp sizes: the by-structure plan
    splits q/o exactly when the query heads divide, k/v exactly when the key/value heads divide too, and
    otherwise records the reason; the MLP splits exactly when its hidden size divides."""
    from hypothesis import given, settings, strategies as st
    from torch import nn
    from hyper_parallel.parallel.shard.structure import structure_plan

    class Attn(nn.Module):
        def __init__(self, heads, kv, hd):
            super().__init__()
            self.head_dim = hd
            self.q_proj, self.k_proj = nn.Linear(8, heads * hd), nn.Linear(8, kv * hd)
            self.v_proj, self.o_proj = nn.Linear(8, kv * hd), nn.Linear(heads * hd, 8)

    class MLP(nn.Module):
        def __init__(self, inter):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, inter), nn.Linear(8, inter), nn.Linear(inter, 8)

    @settings(max_examples=30, deadline=None)
    @given(st.integers(1, 4), st.integers(1, 3), st.sampled_from([2, 4]), st.integers(1, 4), st.integers(2, 12))
    def check(kv, groups, hd, tp, inter):
        model = nn.ModuleDict({"self_attn": Attn(kv * groups, kv, hd), "mlp": MLP(inter)})
        found = structure_plan(model, tp)
        heads = kv * groups
        assert ("self_attn.q_proj" in found.styles) == (heads % tp == 0)
        assert ("self_attn.k_proj" in found.styles) == (heads % tp == 0 and kv % tp == 0)
        if heads % tp or kv % tp:
            assert str(heads if heads % tp else kv) in found.notes["self_attn"]
        assert (found.styles.get("mlp.down_proj") == "rowwise") == (inter % tp == 0)

    check()
