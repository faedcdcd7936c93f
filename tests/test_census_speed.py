"""The census's time: scan chunks and attention windows shrunk with the rest of the tiny config, CPU seconds
reported per type, and timeouts counted in CPU time (a loaded machine does not time out a type that waits for a
core), with wall-clock bounds that still catch hangs."""
import multiprocessing as mp
import time

from hyper_parallel.tools import census_types
from hyper_parallel.tools.auto_models import CHUNK, WINDOW, shrink_config_dict, tiny_config


def test_scan_chunks_and_attention_windows_are_shrunk():
    d = shrink_config_dict({"hidden_size": 4096, "num_hidden_layers": 24, "mamba_chunk_size": 256,
                            "text_config": {"chunk_size": 128, "hidden_size": 1024},
                            "attention_window": [512] * 24, "chunk_size_feed_forward": 0})
    assert d["mamba_chunk_size"] == CHUNK and d["text_config"]["chunk_size"] == CHUNK
    assert d["attention_window"] == [WINDOW] * 2 and d["chunk_size_feed_forward"] == 0
    assert shrink_config_dict({"attention_window": 512})["attention_window"] == WINDOW
    assert tiny_config("longformer").attention_window == WINDOW
    assert tiny_config("falcon_h1").mamba_chunk_size == CHUNK


def _burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    time.sleep(30)


def _sleep():
    time.sleep(30)


def _job(target, *args):
    ctx = mp.get_context("fork")
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    return census_types._Job(census_types.TypeResult("t"), [p], None, time.perf_counter())


def _wait_over(job, timeout, limit=40.0):
    end = time.perf_counter() + limit
    while time.perf_counter() < end:
        if census_types._over_time(job, timeout):
            return time.perf_counter() - job.start
        time.sleep(0.05)
    return None


def test_timeout_counts_cpu_seconds_and_catches_hangs(monkeypatch):
    monkeypatch.setattr(census_types, "STALL", 60.0)  # a loaded machine may hold a busy process back for a while
    monkeypatch.setattr(census_types, "WALL_FACTOR", 100)  # so only CPU time (busy) or the stall (hung) decide
    busy = _job(_burn, 1.5)
    try:
        took = _wait_over(busy, 0.5)
        assert took is not None and busy.cpu is not None and busy.cpu > 0.5  # killed for its CPU seconds
    finally:
        busy.procs[0].kill()
    monkeypatch.setattr(census_types, "STALL", 1.0)
    hung = _job(_sleep)
    try:
        took = _wait_over(hung, 0.5)
        assert took is not None and took >= 1.0 and (hung.cpu or 0.0) < 0.5  # no CPU: caught as a stall
    finally:
        hung.procs[0].kill()


def test_type_result_reports_cpu_seconds():
    r = census_types.TypeResult("llama", cpu_seconds=1.234)
    assert r.to_dict()["cpu_seconds"] == 1.23
    c = census_types.TypeCensus(results=[r, census_types.TypeResult("bert", cpu_seconds=2.0)])
    assert c.summary()["cpu_seconds"] == 3.2


def test_unset_forecast_horizon_is_filled_so_time_series_types_build():
    from hyper_parallel.tools.auto_models import PREDICTION
    assert shrink_config_dict({"prediction_length": None})["prediction_length"] == PREDICTION
    assert shrink_config_dict({"prediction_length": 24})["prediction_length"] == 24  # a set horizon stays
    assert tiny_config("autoformer").prediction_length == PREDICTION


def test_cost_keys_are_shrunk_where_they_multiply_the_model():
    """A Perceiver's latent array, an audio codec's base channels and a hashed byte vocabulary follow from no
    other key; at their defaults one tiny type held 10 GB (perceiver) or 6 GB (vibevoice_acoustic_tokenizer)."""
    d = shrink_config_dict({"num_latents": 256, "d_latents": 1280, "num_self_attends_per_block": 26,
                            "num_filters": 32, "emb_dim": 2048, "encoder_hash_byte_group_vocab": 500002})
    assert d == {"num_latents": 16, "d_latents": 64, "num_self_attends_per_block": 2, "num_filters": 8,
                 "emb_dim": 64, "encoder_hash_byte_group_vocab": 256}
    assert tiny_config("vibevoice_acoustic_tokenizer").num_filters == 8


def _die_after_one_run(conn):
    conn.send(("built", "base", (["text"], "")))
    conn.send(("run", "generate", {"model": "t", "mode": "generate", "equal": True, "plain_ok": True}))
    conn.close()
    import os
    os._exit(0)  # no "done": as when the out-of-memory killer takes the process mid-run


def test_a_type_whose_process_dies_mid_run_is_never_ok():
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_die_after_one_run, args=(send,), daemon=True)
    p.start()
    send.close()
    job = census_types._Job(census_types.TypeResult("t"), [p], recv, time.perf_counter())
    p.join(10)
    census_types._drain(job)
    result = census_types._finish_job(job, timed_out=False)
    assert result.status != "ok" and "died after 1 run" in result.why, (result.status, result.why)


def test_stage_widths_and_their_neck_are_scaled_together():
    """SAM 2's Hiera widths per stage and the neck's channel list (another sub-config) keep agreeing."""
    d = shrink_config_dict({"backbone_config": {"hidden_size": 96, "embed_dim_per_stage": [96, 192, 384, 768]},
                            "backbone_channel_list": [768, 384, 192, 96], "fpn_hidden_size": 256})
    assert d["backbone_config"]["embed_dim_per_stage"] == [64, 128, 256, 512]
    assert d["backbone_channel_list"] == [512, 256, 128, 64] and d["fpn_hidden_size"] == 64
    assert d["backbone_config"]["hidden_size"] == 64


def test_derived_widths_follow_what_they_were_derived_from():
    """Rules of the census-600 work, on config dicts alone: a convolution grouped over the whole width (Mimi's
    upsample_groups == hidden_size), a Swin backbone that keeps 3 stages for 3 outputs (Grounding DINO), a
    neck's feature-map sizes with its backbone's image (SAM 2), Qwen2.5-VL's window in pixels, stages named
    without a stem (PVTv2), a projector dict keyed by patch count (Aria) and several vision feature layers."""
    d = shrink_config_dict({"hidden_size": 512, "upsample_groups": 512, "num_groups": 4})
    assert d["upsample_groups"] == d["hidden_size"] == 64 and d["num_groups"] == 4
    swin = shrink_config_dict({"backbone_config": {
        "embed_dim": 96, "depths": [2, 2, 6, 2], "num_heads": [3, 6, 12, 24], "num_layers": 4,
        "stage_names": ["stem", "stage1", "stage2", "stage3", "stage4"], "out_features": ["stage2", "stage3", "stage4"],
        "out_indices": [2, 3, 4]}})["backbone_config"]
    assert swin["num_layers"] == len(swin["depths"]) == len(swin["num_heads"]) == 3
    assert swin["out_features"] == ["stage1", "stage2", "stage3"]
    sam2 = shrink_config_dict({"backbone_config": {"hidden_size": 96, "image_size": [1024, 1024]},
                               "backbone_feature_sizes": [[256, 256], [128, 128], [64, 64]]})
    assert sam2["backbone_feature_sizes"] == [[16, 16], [8, 8], [4, 4]]
    vl = shrink_config_dict({"patch_size": 14, "window_size": 112, "spatial_merge_size": 2})
    assert vl["window_size"] // vl["spatial_merge_size"] // vl["patch_size"] == 2
    assert shrink_config_dict({"patch_size": 4, "window_size": 7})["window_size"] == 4  # Swin's, in patches
    pvt = shrink_config_dict({"stage_names": ["stage1", "stage2", "stage3", "stage4"], "out_indices": [3],
                              "out_features": ["stage4"]})
    assert pvt["out_features"] == ["stage4"] and pvt["out_indices"] == [3]
    aria = shrink_config_dict({"projector_patch_to_query_dict": {"1225": 128, "4900": 256}})
    assert aria["projector_patch_to_query_dict"] == {"1225": 128, "4900": 256}
    molmo = shrink_config_dict({"num_hidden_layers": 25, "vision_feature_layer": [24, 18]})
    assert molmo["vision_feature_layer"] == [1, 0]


def test_lagged_time_series_and_small_vocabularies_get_fitting_inputs():
    """Time Series Transformer's past values cover the context and the largest lag, with their time features
    and the horizon; a protein model's 64-token vocabulary gets ids inside it (ESMC)."""
    import torch
    from hyper_parallel.tools.auto_models import build_model_type
    case = build_model_type("time_series_transformer")
    cfg = case.model.config
    assert case.inputs["past_values"].shape[1] == cfg.context_length + max(cfg.lags_sequence)
    assert case.inputs["future_values"].shape[1] == cfg.prediction_length
    with torch.no_grad():
        case.model(**case.inputs)
    case = build_model_type("esmc")
    assert int(case.inputs["input_ids"].max()) < case.model.config.vocab_size
