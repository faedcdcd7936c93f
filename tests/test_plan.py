"""hp.plan / `hyper-parallel plan`: the planned bytes and collectives of a rank equal a real run's.

Each layout is planned in this process (fake process group, meta model) and run for real on gloo ranks of
this machine by the same step function (`plan.measure_rank`): parameter, gradient and optimizer bytes and
every collective's count and bytes per mesh axis must be equal; activations within 15%. Mixture-of-experts
all_to_all bytes depend on the router's choices, which a plan cannot know: the plan assumes balanced
routing, so for ("dp", "ep") they are compared as the mean over the ranks (equal to the balanced figure
whatever the routing, since every route leaves one rank and reaches another).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from hyper_parallel.tools import plan as P
from tests.harness import pool

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=None, eos_token_id=None,
             tie_word_embeddings=False)
EXACT = ("param_bytes", "grad_bytes", "optimizer_bytes")


def llama(**kw):
    from transformers import LlamaConfig
    return LlamaConfig(**dict(SMALL, **kw))


def qwen3_moe(**kw):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**dict(SMALL, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                 decoder_sparse_step=1, norm_topk_prob=True, **kw))


def predicted_and_measured(config, mesh: dict, **kw):
    world = 1
    for v in mesh.values():
        world *= v
    args = dict(dict(seq=8, micro_batch=2, dtype="fp32", hsdp={"threshold": 0}), **kw)
    record = P.plan(config=config, world=world, mesh=mesh, **args)
    options = P.step_options(mesh=mesh, **args)
    measured = pool(world).run(P.measure_rank, config, mesh, options)
    return record, measured


def assert_matches(record, measured, balanced_axis=None):
    """Every planned rank (each pipeline stage's first) against its measured twin: bytes, and every collective's
    count and bytes per mesh axis."""
    for stage in record["per_stage"]:
        m = measured[stage["rank"]]
        for key in EXACT:
            assert stage[key] == m[key], (stage["rank"], key, stage[key], m[key])
        assert abs(stage["activation_bytes"] - m["activation_bytes"]) <= 0.15 * m["activation_bytes"], \
            (stage["rank"], stage["activation_bytes"], m["activation_bytes"])
        assert_collectives_match(stage["collectives_by_axis"], m["collectives_by_axis"], measured, balanced_axis)
    busiest = record["busiest_rank"]["rank"]
    assert record["collectives_by_axis"] == next(s for s in record["per_stage"]
                                                 if s["rank"] == busiest)["collectives_by_axis"]


def assert_collectives_match(predicted, got, measured, balanced_axis=None):
    assert set(predicted) == set(got), (predicted, got)
    for axis, kinds in predicted.items():
        assert set(kinds) == set(got[axis]), (axis, kinds, got[axis])
        for kind, c in kinds.items():
            assert c["count"] == got[axis][kind]["count"], (axis, kind, c, got[axis][kind])
            if axis == balanced_axis and kind == "all_to_all":
                mean = sum(m["collectives_by_axis"][axis][kind]["bytes"] for m in measured) / len(measured)
                assert c["bytes"] == mean, (axis, kind, c, mean)
            else:
                assert c["bytes"] == got[axis][kind]["bytes"], (axis, kind, c, got[axis][kind])


def test_llama_dp_tp_level3_plan_equals_real_run():
    record, measured = predicted_and_measured(llama(), {"dp": 2, "tp": 2}, optimizer_level="level3")
    assert_matches(record, measured)
    assert record["collectives_by_axis"]["dp"]["reduce_scatter"]["count"] > 0


def test_llama_dp2_level2_plan_equals_real_run():
    record, measured = predicted_and_measured(llama(), {"dp": 2}, optimizer_level="level2")
    assert_matches(record, measured)


def test_qwen3_moe_dp_ep_plan_equals_real_run_with_balanced_all_to_all():
    record, measured = predicted_and_measured(qwen3_moe(), {"dp": 2, "ep": 2})
    assert_matches(record, measured, balanced_axis="ep")


def test_recompute_full_plan_equals_real_run_and_saves_less():
    """Activation checkpointing of every layer: the plan's recompute runs the same kernels as its forward (it
    used to refuse with a checkpoint metadata mismatch), matches a real run, and saves less than no recompute."""
    record, measured = predicted_and_measured(llama(), {"dp": 2}, optimizer_level="level3", recompute="full")
    assert_matches(record, measured)
    plain, _ = predicted_and_measured(llama(), {"dp": 2}, optimizer_level="level3")
    assert record["busiest_rank"]["activation_bytes"] < plain["busiest_rank"]["activation_bytes"]


@settings(max_examples=6, deadline=None)
@given(layers=st.integers(1, 3), heads=st.sampled_from([(4, 2), (4, 4), (2, 1)]), seq=st.sampled_from([4, 8, 16]),
       rows=st.integers(1, 3), mesh=st.sampled_from([{"dp": 2}, {"tp": 2}]),
       level=st.sampled_from(["level1", "level2", "level3"]), recompute=st.sampled_from(["none", "full"]))
def test_plan_equals_real_run_on_random_small_configs(layers, heads, seq, rows, mesh, level, recompute):
    """Property: for random depths, head counts, sequence lengths, micro-batches, meshes, ZeRO levels and
    recompute policies, the plan's bytes and collectives are a real 2-rank run's (activations within 15%)."""
    config = llama(num_hidden_layers=layers, num_attention_heads=heads[0], num_key_value_heads=heads[1])
    world = 2
    args = dict(seq=seq, micro_batch=rows, dtype="fp32", hsdp={"threshold": 0}, optimizer_level=level,
                recompute=recompute)
    record = P.plan(config=config, world=world, mesh=mesh, **args)
    measured = pool(world).run(P.measure_rank, config, mesh, P.step_options(mesh=mesh, **args))
    assert_matches(record, measured)


@pytest.mark.parametrize("method", ["ring", "ulysses", "allgather"])
def test_llama_dp_cp_plan_equals_real_run(method):
    """Context parallel on the fake group: the ring's point-to-point blocks are posted one by one on meta (no
    backend coalesces there), its skip decisions read CPU indices, and the bytes and sends equal a real run."""
    record, measured = predicted_and_measured(llama(), {"dp": 2, "cp": 2}, seq=16, cp_method=method)
    assert_matches(record, measured)
    assert record["collectives_by_axis"]["cp"]


def test_qwen3_vl_text_batch_plan_equals_real_run_with_unused_vision_tower():
    """The requirement's Qwen3-VL (the built-in tiny config) under hsdp level3 on a text batch: the vision tower
    never runs, hsdp's used-anywhere vote reads CPU flags on meta, and the plan equals a real run."""
    from hyper_parallel.tools.models import _qwen3_vl
    config = _qwen3_vl(0).model.config
    record, measured = predicted_and_measured(config, {"dp": 2}, optimizer_level="level3")
    assert_matches(record, measured)
    assert record["busiest_rank"]["grad_bytes"] < record["busiest_rank"]["param_bytes"]   # no tower gradients


def test_search_caps_tp_at_a_node_and_cp_at_256_token_chunks_unless_told():
    assert P.search_limits(4096) == {"tp": 8, "cp": 8}
    assert P.search_limits(4096, {"tp": 16}) == {"tp": 16, "cp": 8}
    with pytest.raises(ValueError, match="one of"):
        P.search_limits(4096, {"xp": 2})


def assert_pipeline_sends(record, microbatches):
    """Each stage sends one activation forward (all but the last) or one gradient backward (all but the
    first) per micro-batch: with two stages, `microbatches` sends on each rank."""
    for stage in record["per_stage"]:
        assert stage["collectives_by_axis"]["pp"]["send"]["count"] == microbatches, stage


def test_llama_pp2_plan_equals_real_run():
    record, measured = predicted_and_measured(llama(), {"pp": 2})
    assert_matches(record, measured)
    assert [s["rank"] for s in record["per_stage"]] == [0, 1]
    assert_pipeline_sends(record, record["pipeline"]["microbatches"])
    assert "micro-batches in flight" in record["assumptions"]


def test_llama_pp2_dp2_plan_equals_real_run():
    record, measured = predicted_and_measured(llama(), {"pp": 2, "dp": 2}, schedule="gpipe", microbatches=2)
    assert_matches(record, measured)
    assert [s["rank"] for s in record["per_stage"]] == [0, 2]
    assert_pipeline_sends(record, 2)
    assert all(s["collectives_by_axis"]["dp"]["all_reduce"]["count"] > 0 for s in record["per_stage"])


def test_interleaved_schedule_is_refused_with_what_to_use():
    with pytest.raises(ValueError, match="--schedule 1f1b or gpipe"):
        P.plan(config=llama(num_hidden_layers=4), world=2, mesh={"pp": 2}, seq=8, schedule="interleaved_1f1b")


def test_pipeline_with_full_recompute_is_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="plan this mesh with --recompute none"):
        P.plan(config=llama(num_hidden_layers=4), world=2, mesh={"pp": 2}, seq=8, recompute="full")


@pytest.mark.parametrize("argv, says", [
    (["--model-type", "llama", "--world", "8", "--mesh", "dp=2,tp=2"], "multiply to 8"),
    (["--model-type", "no_such_model", "--world", "2", "--mesh", "dp=2"], "unknown model type 'no_such_model'"),
    (["--model-type", "llama", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
      "--set", "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=2",
      "--set", "vocab_size=128", "--world", "2", "--seq", "16", "--search", "--memory", "1KiB"], "fits 1.0 KiB per rank"),
])
def test_cli_bad_requests_exit_2_with_one_line_saying_what_is_wrong(argv, says, capsys):
    from hyper_parallel.tools.cli import main
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hyper-parallel plan: ") and says in err and "\n" not in err, err
