"""The cost model and mesh search of `hyper-parallel plan --search` (hyper_parallel/tools/plan_cost.py).

Formulas are checked against values computed by hand from the module docstring's table; the search runs
on a synthetic planner (records from simple closed forms), so its ranking and memory filter are known."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from hyper_parallel.tools import plan_cost as pc

FAST = pc.Link(alpha=1e-6, bandwidth=1e9)
SLOW = pc.Link(alpha=1e-5, bandwidth=1e8)
DEV = pc.Device("test", {"bf16": 1e12, "fp32": 0.5e12}, mfu=0.5, memory_bytes=100 * pc.GiB, ranks_per_node=4,
                intra=FAST, inter=SLOW)


def record(mesh, flops=1e12, collectives=None, pipeline=None, peak=1, dtype="bf16", seq=16, micro_batch=1):
    return {"mesh": dict(mesh), "world": math.prod(mesh.values()), "flops_per_rank": flops,
            "collectives_by_axis": collectives or {}, "pipeline": pipeline, "dtype": dtype, "seq": seq,
            "micro_batch": micro_batch, "recompute": "none",
            "busiest_rank": {"param_bytes": 0, "grad_bytes": 0, "optimizer_bytes": 0, "activation_bytes": 0,
                             "peak_bytes": peak}}


# ---- compute ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,seconds", [("bf16", 2.0), ("torch.bfloat16", 2.0), ("fp32", 4.0),
                                           ("float16", 2.0)])  # fp16 falls back to the bf16 peak
def test_compute_is_flops_over_peak_times_mfu(dtype, seconds):
    t = pc.step_time(record({"dp": 1}, flops=1e12, dtype=dtype), DEV)
    assert t["compute_s"] == pytest.approx(seconds)
    assert t["total_s"] == pytest.approx(seconds) and t["comm_s"] == 0 and t["bubble_s"] == 0


def test_a_dtype_without_a_peak_is_refused_naming_the_ones_stated():
    dev = pc.Device("bf16 only", {"bf16": 1e12}, 0.5, 1, 1, FAST, FAST)
    with pytest.raises(ValueError, match=r"no peak FLOP/s for dtype 'fp32'.*\['bf16'\]"):
        dev.peak("fp32")
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        dev.peak("int3")


# ---- collectives --------------------------------------------------------------------------------------------
# n=4 ranks, 2 calls passing 1000 bytes in all, alpha 1 us, 1 GB/s
@pytest.mark.parametrize("kind,seconds", [
    ("all_reduce", 2 * 2 * 3 * 1e-6 + 2 * 3 / 4 * 1000 / 1e9),  # 2(n-1) steps, 2(n-1)/n bytes
    ("all_gather", 2 * 3 * 1e-6 + 3 * 1000 / 1e9),              # n-1 steps, (n-1) x the shard
    ("reduce_scatter", 2 * 3 * 1e-6 + 3 / 4 * 1000 / 1e9),      # n-1 steps, (n-1)/n of the input
    ("all_to_all", 2 * 3 * 1e-6 + 1000 / 1e9),                  # n-1 steps, the counted bytes
    ("broadcast", 2 * 3 * 1e-6 + 1000 / 1e9),                   # pipelined chain
    ("send", 2 * 1e-6 + 1000 / 1e9),                            # one step each
    ("recv", 2 * 1e-6 + 1000 / 1e9),
])
def test_each_collective_kind_follows_its_ring_formula(kind, seconds):
    assert pc.collective_seconds(kind, 2, 1000, 4, FAST) == pytest.approx(seconds)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"])
def test_a_collective_over_one_rank_costs_nothing(kind):
    assert pc.collective_seconds(kind, 5, 10 ** 6, 1, SLOW) == 0


def test_an_unknown_collective_kind_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"'gossip'.*all_gather"):
        pc.collective_seconds("gossip", 1, 1, 2, FAST)


def test_step_time_adds_compute_each_axis_on_its_link_and_the_bubble():
    mesh = {"pp": 2, "dp": 2, "tp": 4}  # 4 ranks a node: tp (span 4) inside, dp (8) and pp (16) across
    rec = record(mesh, flops=1e12, pipeline={"schedule": "1f1b", "microbatches": 4, "stages_per_rank": 1},
                 collectives={"tp": {"all_reduce": {"count": 1, "bytes": 4000}},
                              "dp": {"reduce_scatter": {"count": 1, "bytes": 2000}},
                              "pp": {"send": {"count": 4, "bytes": 10 ** 5}}})
    t = pc.step_time(rec, DEV)
    tp = 2 * 3 * 1e-6 + 6000 / 1e9
    dp = 1 * 1e-5 + 1000 / 1e8
    pp = 4 * 1e-5 + 10 ** 5 / 1e8
    assert t["links"] == {"tp": "intra", "dp": "inter", "pp": "inter"}
    assert t["by_axis"] == pytest.approx({"tp": tp, "dp": dp, "pp": pp})
    assert t["by_kind"] == pytest.approx({"all_reduce": tp, "reduce_scatter": dp, "send": pp})
    assert t["compute_s"] == pytest.approx(2.0)
    assert t["bubble_s"] == pytest.approx(2.0 * (2 - 1) / 4)
    assert t["total_s"] == pytest.approx(2.0 + 0.5 + tp + dp + pp)


def test_a_group_over_two_axes_spans_both():
    mesh = {"dp": 2, "ep": 2, "tp": 2}
    rec = record(mesh, flops=0, collectives={"dp+ep": {"all_reduce": {"count": 1, "bytes": 800}}})
    t = pc.step_time(rec, DEV)  # n = 4 ranks over span 8 > 4 ranks a node: the slow link
    assert t["comm_s"] == pytest.approx(2 * 3 * 1e-5 + 2 * 3 / 4 * 800 / 1e8)


# ---- pipeline bubble ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule,v,fraction", [("gpipe", 1, 3 / 8), ("1f1b", 1, 3 / 8), ("1F1B", 1, 3 / 8),
                                                 ("interleaved_1f1b", 2, 3 / 16), ("Interleaved1F1B", 2, 3 / 16),
                                                 ("ScheduleInterleavedZeroBubble", 2, 3 / 16)])
def test_bubble_is_pp_minus_one_over_microbatches_and_virtual_stages(schedule, v, fraction):
    assert pc.bubble_fraction(schedule, 4, 8, v) == pytest.approx(fraction)


def test_one_stage_has_no_bubble_and_an_unknown_schedule_is_refused():
    assert pc.bubble_fraction("gpipe", 1, 1) == 0
    with pytest.raises(ValueError, match="'zigzag'.*gpipe, 1f1b"):
        pc.bubble_fraction("zigzag", 2, 4)


# ---- links --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mesh,axis,node,link", [
    ({"dp": 4, "tp": 8}, "tp", 8, "intra"),       # span 8 fills a node
    ({"dp": 4, "tp": 8}, "dp", 8, "inter"),       # span 32
    ({"tp": 2, "dp": 4}, "dp", 8, "intra"),       # span 4: the inner axis
    ({"tp": 2, "dp": 4}, "tp", 8, "intra"),       # span 8: 2 x the 4 inner ranks
    ({"dp": 2, "tp": 3}, "tp", 8, "inter"),       # span 3 does not divide 8: some groups straddle
    ({"dp": 2, "ep": 2, "tp": 2}, "dp+ep", 8, "intra"),
    ({"dp": 2, "ep": 2, "tp": 2}, "dp+ep", 4, "inter"),
    ({"dp": 2, "tp": 2}, "world", 4, "intra"),
])
def test_an_axis_is_intra_node_when_its_span_fits_and_divides_a_node(mesh, axis, node, link):
    dev = pc.Device("n", 1e12, 0.5, 1, node, FAST, SLOW)
    assert pc.link_of(mesh, axis, dev) == link


def test_a_collective_on_an_axis_the_mesh_lacks_is_refused():
    with pytest.raises(ValueError, match="'cp'.*not an axis of the mesh"):
        pc.link_of({"dp": 2}, "cp", DEV)


# ---- sizes --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,value", [("80GiB", 80 * 2 ** 30), ("64GB", 64 * 10 ** 9), ("512 MiB", 512 * 2 ** 20),
                                        ("1.5KiB", 1536), ("2kb", 2000), ("100", 100), ("7B", 7), (5, 5)])
def test_parse_bytes_reads_binary_and_decimal_units(text, value):
    assert pc.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["80G", "lots", "", "1.2.3GB", "-5GB"])
def test_parse_bytes_refuses_anything_else_with_an_example(text):
    with pytest.raises(ValueError, match="not a size.*80GiB"):
        pc.parse_bytes(text)


# ---- meshes -------------------------------------------------------------------------------------------------
DENSE = {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 11008, "num_hidden_layers": 4}
GQA = {"num_attention_heads": 16, "num_key_value_heads": 2, "intermediate_size": 4096, "num_hidden_layers": 8}
MOE = {"num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 64, "moe_intermediate_size": 32,
       "num_experts": 6, "num_hidden_layers": 2}


def reasons(world, config, **kw):
    skipped = []
    kept = pc.enumerate_meshes(world, config=config, skipped=skipped, **kw)
    return kept, {pc.mesh_str(m): r for m, r in skipped}


def test_a_dense_model_takes_no_expert_axis_and_no_more_stages_than_layers():
    kept, why = reasons(8, DENSE)
    assert all("ep" not in m for m in kept)
    assert why["ep=8"] == "ep=8 on a model without experts (not a MoE config)"
    assert why["pp=8"] == "pp=8 exceeds the 4 layers"
    assert {"tp": 8} in kept and {"pp": 4, "dp": 2} in kept and {"pp": 2, "dp": 2, "tp": 2} in kept


def test_tp_may_exceed_the_kv_heads_but_must_divide_the_query_heads():
    kept, _ = reasons(8, GQA)
    assert {"tp": 8} in kept  # 2 KV heads: the library replicates K/V over tp=8
    kept, why = reasons(8, dict(GQA, num_attention_heads=12))
    assert {"tp": 8} not in kept and why["tp=8"] == "tp=8 does not divide the 12 attention heads"
    assert {"dp": 2, "tp": 4} in kept


def test_tp_must_divide_the_mlp_widths():
    _, why = reasons(4, MOE)
    assert "tp=4" not in why  # 64 and 32 divide by 4
    _, why = reasons(4, dict(MOE, moe_intermediate_size=30))
    assert why["tp=4"] == "tp=4 does not divide moe_intermediate_size=30"


def test_ep_must_divide_the_experts_whatever_the_config_calls_them():
    for config in (MOE, {"n_routed_experts": 6, "num_hidden_layers": 2},
                   SimpleNamespace(text_config=SimpleNamespace(num_local_experts=6, num_hidden_layers=2))):
        kept, why = reasons(4, config)
        assert {"dp": 2, "ep": 2} in kept
        assert why["ep=4"] == "ep=4 does not divide the 6 experts"


def test_ring_context_parallel_needs_two_chunks_per_rank():
    kept, why = reasons(4, DENSE, seq=12)
    assert {"dp": 2, "cp": 2} in kept
    assert why["cp=4"].startswith("cp=4 needs seq divisible by 8 (ring")
    kept, _ = reasons(4, DENSE, seq=12, cp_method="allgather")
    assert {"cp": 4} in kept


PARAMS, HIDDEN, LAYERS, SEQ = 2e9, 4096, 8, 2048


def synthetic_plan(mesh, microbatches, recompute):
    """A 2B-parameter decoder's record in closed form: 6 P FLOPs a token (8 P with full recompute),
    parameters/gradients bf16 split by tp x pp, optimizer state fp32 x3 split by dp too, activations per
    layer 34 s h bytes (2 s h with full recompute) for the micro-batches a stage keeps (up to pp of them)."""
    tp, dp, pp, ep, cp = (mesh.get(a, 1) for a in ("tp", "dp", "pp", "ep", "cp"))
    tokens = SEQ / cp
    split = tp * pp
    flops = (8 if recompute == "full" else 6) * PARAMS / split * tokens * microbatches
    params = 2 * PARAMS / split
    optimizer = 12 * PARAMS / (split * dp)
    per_layer = (2 if recompute == "full" else 34) * tokens * HIDDEN / tp
    activations = per_layer * LAYERS / pp * min(microbatches, pp)
    act_msg = 2 * tokens * HIDDEN
    collectives = {}
    if tp > 1:
        collectives["tp"] = {"all_reduce": {"count": 4 * LAYERS // pp * microbatches,
                                            "bytes": 4 * LAYERS // pp * microbatches * act_msg}}
    if dp > 1:
        collectives["dp"] = {"reduce_scatter": {"count": 1, "bytes": params},
                             "all_gather": {"count": 1, "bytes": params / dp}}
    if pp > 1:
        collectives["pp"] = {"send": {"count": 2 * microbatches, "bytes": 2 * microbatches * act_msg}}
    pipeline = {"schedule": "1f1b", "microbatches": microbatches, "stages_per_rank": 1} if pp > 1 else None
    return {"mesh": dict(mesh), "world": tp * dp * pp * ep * cp, "flops_per_rank": flops,
            "collectives_by_axis": collectives, "pipeline": pipeline, "seq": SEQ, "micro_batch": 1,
            "dtype": "bf16", "recompute": recompute,
            "busiest_rank": {"param_bytes": params, "grad_bytes": params, "optimizer_bytes": optimizer,
                             "activation_bytes": activations,
                             "peak_bytes": 2 * params + optimizer + activations}}


CONFIG = {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
          "num_hidden_layers": LAYERS}
H100 = pc.PRESETS["h100"]


def seconds_per_token(entry):
    return entry["step_time"]["total_s"] / entry["tokens_per_step"]


def test_search_winner_keeps_tp_inside_the_node_and_says_so():
    results = pc.search(16, synthetic_plan, H100, 16 * pc.GiB, config=CONFIG, seq=SEQ, axes=("pp", "dp", "tp"))
    best = results[0]
    assert best["mesh"].get("tp", 1) <= 8  # tp=16 would cross the 8-GPU node
    assert best["reason"].startswith(pc.mesh_str(best["mesh"]))
    assert "more tokens/s than the runner-up" in best["reason"]
    assert all("reason" not in r for r in results[1:])
    table = pc.format_ranking(results, top=3)
    assert table.splitlines()[0].split()[:3] == ["#", "mesh", "mb"]
    assert f"... {len(results) - 3} more" in table and table.endswith(best["reason"])


def test_search_tries_each_pipeline_microbatch_count_and_more_hide_the_bubble():
    results = pc.search(4, synthetic_plan, H100, "1TiB", config=CONFIG, seq=SEQ, axes=("pp",),
                        recompute_choices=("none",))
    assert [r["microbatches"] for r in results] == [16, 8, 4]
    bubbles = [r["step_time"]["bubble_s"] / r["step_time"]["compute_s"] for r in results]
    assert bubbles == pytest.approx([3 / 16, 3 / 8, 3 / 4])
    custom = pc.search(4, synthetic_plan, H100, "1TiB", config=CONFIG, seq=SEQ, axes=("pp",),
                       microbatch_choices=[6], recompute_choices=("none",), limit=1)
    assert len(custom) == 1 and custom[0]["microbatches"] == 6


def test_when_nothing_fits_the_error_names_the_smallest_peak_the_limit_and_what_to_do():
    with pytest.raises(ValueError) as e:
        pc.search(2, synthetic_plan, H100, "1GiB", config=CONFIG, seq=SEQ, axes=("dp", "tp"))
    smallest = min(synthetic_plan(m, 1, r)["busiest_rank"]["peak_bytes"]
                   for m in ({"dp": 2}, {"tp": 2}) for r in ("none", "full"))
    msg = str(e.value)
    assert "\n" not in msg and "fits 1.0 GiB per rank" in msg
    assert f"smallest predicted peak is {pc.format_bytes(smallest)}" in msg
    assert "more ranks" in msg and "optimizer level" in msg
    assert "recompute full, " not in msg   # the search tried it already


def test_a_mesh_the_planner_refuses_is_skipped_with_its_message():
    def picky(mesh, m, recompute):
        if mesh.get("tp", 1) > 1:
            raise ValueError("tp not supported here")
        return synthetic_plan(mesh, m, recompute)
    skipped = []
    results = pc.search(2, picky, H100, "1TiB", config=CONFIG, seq=SEQ, axes=("dp", "tp"), skipped=skipped)
    assert [r["mesh"] for r in results] == [{"dp": 2}, {"dp": 2}]
    assert results[0]["reason"].endswith("recompute full)") is False and "runner-up" in results[0]["reason"]
    assert ({"tp": 2, "microbatches": 1, "recompute": "none"}, "tp not supported here") in skipped


# ---- presets and calibration --------------------------------------------------------------------------------
def test_presets_are_named_and_sane():
    assert set(pc.PRESETS) == {"h100", "h200", "a100", "910b"}
    for dev in pc.PRESETS.values():
        assert dev.peak("bf16") > dev.peak("fp32") > 0 and dev.intra.bandwidth > dev.inter.bandwidth
    assert pc.device("H100") is pc.PRESETS["h100"]
    with pytest.raises(ValueError, match=r"unknown device 'tpu'.*calibrate"):
        pc.device("tpu")


def test_fit_link_recovers_alpha_and_bandwidth_from_exact_samples():
    alpha, bw, n = 2e-5, 3e9, 2
    samples = [(kind, b, pc.collective_seconds(kind, 1, b, n, pc.Link(alpha, bw)))
               for kind in ("all_reduce", "all_gather") for b in (1e3, 1e5, 1e7)]
    link = pc.fit_link(samples, n)
    assert link.alpha == pytest.approx(alpha, rel=1e-6) and link.bandwidth == pytest.approx(bw, rel=1e-6)


def test_calibrate_measures_positive_finite_flops_and_link():
    dev = pc.calibrate(world=2, sizes=(2 ** 12, 2 ** 18), repeats=3)
    for value in (dev.peak("fp32"), dev.peak("bf16"), dev.intra.alpha, dev.intra.bandwidth, dev.memory_bytes):
        assert 0 < value < math.inf
    assert dev.ranks_per_node == 2 and dev.inter == dev.intra


# ---- properties ---------------------------------------------------------------------------------------------
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
meshes = st.sampled_from([{"dp": 8}, {"dp": 2, "tp": 4}, {"pp": 2, "dp": 2, "tp": 2}, {"dp": 4, "ep": 2}])


@settings(max_examples=60, deadline=None)
@given(mesh=meshes, kind=st.sampled_from(KINDS), count=st.integers(1, 100), nbytes=st.floats(0, 1e12),
       extra=st.floats(0, 1e12), flops=st.floats(0, 1e18), more=st.floats(0, 1e18))
def test_step_time_never_falls_when_bytes_or_flops_grow(mesh, kind, count, nbytes, extra, flops, more):
    axis = next(iter(mesh))
    def total(b, f):
        return pc.step_time(record(mesh, flops=f, collectives={axis: {kind: {"count": count, "bytes": b}}}),
                            DEV)["total_s"]
    assert total(nbytes + extra, flops) >= total(nbytes, flops)
    assert total(nbytes, flops + more) >= total(nbytes, flops)


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(1, 64), m=st.integers(1, 256), extra=st.integers(0, 256), v=st.integers(1, 4),
       schedule=st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]))
def test_more_microbatches_never_grow_the_bubble(pp, m, extra, v, schedule):
    assert pc.bubble_fraction(schedule, pp, m + extra, v) <= pc.bubble_fraction(schedule, pp, m, v)


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 96), heads=st.sampled_from([None, 8, 12, 32]))
def test_enumerated_meshes_are_unique_and_multiply_to_world(world, heads):
    config = {"num_attention_heads": heads} if heads else None
    out = pc.enumerate_meshes(world, config=config)
    assert all(math.prod(m.values()) == world for m in out)
    assert len({tuple(m.items()) for m in out}) == len(out)
    assert all(list(m) == [a for a in pc.AXES if a in m] for m in out)  # mesh order outer -> inner


@settings(max_examples=15, deadline=None)
@given(world=st.sampled_from([2, 4, 8, 16]), gib=st.floats(2, 64))
def test_search_results_are_sorted_and_all_fit(world, gib):
    try:
        results = pc.search(world, synthetic_plan, H100, gib * pc.GiB, config=CONFIG, seq=SEQ,
                            axes=("pp", "dp", "tp"))
    except ValueError as e:
        assert "fits" in str(e)
        return
    keys = [seconds_per_token(r) for r in results]
    assert keys == sorted(keys) and all(r["peak_bytes"] <= gib * pc.GiB for r in results)
