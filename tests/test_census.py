"""The operator census (function and CLI) and a tiny Llama with its batch split over 2 gloo processes."""
import json

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.dispatch import registry
from hyper_parallel.tools import census
from hyper_parallel.tools.cli import main
from hyper_parallel.tools.models import build_model, model_names

pytest.importorskip("transformers")


def _check_runs(report, models, modes):
    assert [(r.model, r.mode) for r in report.runs] == [(m, md) for m in models for md in modes]
    for r in report.runs:
        assert r.error is None, r.error
        assert r.equal is True, (r.model, r.mode, r.detail)
        assert r.ops, "the census saw no ops at all"
        # every op it lists as missing really has no rule, and every op with a rule ran through it
        assert not set(r.missing) & set(registry.RULES), set(r.missing) & set(registry.RULES)
        assert set(r.with_rules) <= set(registry.RULES)
        assert r.missing == {}, f"{r.model} {r.mode} misses {sorted(r.missing)}"
        for op in r.missing:
            assert op in r.locations


def test_census_function_two_models_both_modes():
    report = census.run_census(["llama", "bert"], "all", max_new_tokens=3)
    _check_runs(report, ["llama", "bert"], ["generate", "train"])
    d = report.to_dict()
    assert set(d["models"]) == {"llama", "bert"}
    union = set(d["union"]["ops"])
    assert union == set(d["models"]["llama"]["ops"]) | set(d["models"]["bert"]["ops"])
    assert "torch.nn.functional.linear" in union and "torch.nn.functional.embedding" in union
    assert "llama" in report.table() and "union" in report.table()


def test_census_cli_json(tmp_path, capsys):
    out = tmp_path / "census.json"
    rc = main(["census", "--model", "qwen3_moe", "--model", "t5", "--mode", "train", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "[1/2] qwen3_moe train" in text and "census took" in text
    data = json.loads(out.read_text())
    assert data["ok"] is True
    assert set(data["models"]) == {"qwen3_moe", "t5"}
    for m in data["models"].values():
        assert m["missing"] == {}
        assert set(m["runs"]) == {"train"}
        assert all(run["equal"] for run in m["runs"].values())
    assert data["union"]["missing"] == []


def test_census_list(capsys):
    assert main(["census", "--list"]) == 0
    text = capsys.readouterr().out
    for name in ("llama", "qwen3_vl", "qwen3_omni_thinker", "qwen3_omni", "t5", "bert"):
        assert name in text
    assert set(model_names()) >= {"llama", "qwen3", "qwen3_moe", "mistral", "mixtral", "deepseek_v3", "gemma3",
                                  "bert", "t5", "qwen3_vl", "qwen3_omni_thinker", "qwen3_omni"}


def test_census_records_missing_with_location():
    """An op without a rule is listed with its count and the model-code line, and the run still finishes."""
    saved = registry.RULES.pop("torch.Tensor.__invert__", None)
    try:
        from hyper_parallel.dispatch.dispatcher import clear_caches
        clear_caches()
        x = census.replicated(torch.tensor([True, False]))
        with hp.record_missing_ops() as rec:
            y = ~x
            y = ~y
        assert rec.counts["torch.Tensor.__invert__"] == 2
        assert "test_census.py" in rec.locations["torch.Tensor.__invert__"]
        assert torch.equal(y.full_tensor(), torch.tensor([True, False]))
        with pytest.raises(hp.MissingOpError, match="torch.Tensor.__invert__"):
            ~x
    finally:
        if saved is not None:
            registry.RULES["torch.Tensor.__invert__"] = saved
        clear_caches()


def test_models_are_deterministic():
    a, b = build_model("qwen3_vl", seed=3), build_model("qwen3_vl", seed=3)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n
    for k, v in a.inputs.items():
        assert torch.equal(v, b.inputs[k]), k
    assert "mm_token_type_ids" in a.inputs and "pixel_values_videos" in a.inputs


def test_requirement_example(tmp_path):
    """The requirement's code example, as written: a local Qwen3-VL checkpoint (a tiny one saved here),
    processor-style inputs (a BatchFeature with mm_token_type_ids, as the processor returns them),
    every input wrapped with Layout((4, 2), ("dp", "tp"))("None", "None"), then generate(max_new_tokens=40).
    (`device_map="auto"` needs the `accelerate` package, which this environment does not install.)"""
    from transformers import AutoModelForImageTextToText, BatchFeature

    case = build_model("qwen3_vl", seed=2)
    case.model.save_pretrained(tmp_path)
    keep = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw")
    # an image-only prompt: the video tokens become text
    ids = case.inputs["input_ids"].clone()
    types = case.inputs["mm_token_type_ids"].clone()
    ids[ids == 121] = 7
    types[types == 2] = 0
    data = {**{k: case.inputs[k] for k in keep}, "input_ids": ids, "mm_token_type_ids": types}

    model_id = str(tmp_path)
    model = AutoModelForImageTextToText.from_pretrained(model_id, local_files_only=True,
                                                        attn_implementation="sdpa")
    model.generation_config.do_sample = False
    ref = model.generate(**BatchFeature(dict(data)), max_new_tokens=40)

    inputs = BatchFeature(dict(data))
    from hyper_parallel import DTensor, Layout
    layout = Layout((4, 2), ("dp", "tp"))
    input_layout = layout("None", "None")
    inputs.data["input_ids"] = DTensor.from_local(inputs.data["input_ids"], input_layout)
    inputs.data["attention_mask"] = DTensor.from_local(inputs.data["attention_mask"], input_layout)
    inputs.data["pixel_values"] = DTensor.from_local(inputs.data["pixel_values"], input_layout)
    inputs.data["image_grid_thw"] = DTensor.from_local(inputs.data["image_grid_thw"], input_layout)
    inputs.data["mm_token_type_ids"] = DTensor.from_local(inputs.data["mm_token_type_ids"], input_layout)
    outputs = model.generate(**inputs, max_new_tokens=40)
    assert isinstance(outputs, DTensor)
    assert torch.equal(outputs.full_tensor(), ref)
    assert outputs.shape[-1] == ids.shape[-1] + 40


def test_adamw_foreach_on_dtensor_params():
    """The optimizers' multi-tensor path (_foreach ops) keeps each state laid out like its parameter."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 2))
    model = census.distribute_parameters(__import__("copy").deepcopy(ref))
    x = torch.randn(3, 4)
    for m, inp in ((ref, x), (model, census.replicated(x))):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
        for _ in range(2):
            m(inp).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert isinstance(q, hp.DTensor)
        assert torch.allclose(p, q.full_tensor(), atol=1e-6), n


# ---- 2 processes: the batch split over the ranks -------------------------------------------------
def _llama_batch_split(rank, world):
    from hyper_parallel.tools.census import _train_step, distribute_parameters, full

    mesh = hp.Layout((world,), ("dp",))
    split = lambda t: hp.distribute_tensor(t, mesh("dp", *(["None"] * (t.ndim - 1))))
    repl = lambda t: hp.distribute_tensor(t, mesh(*(["None"] * t.ndim)))

    # generate: identical tokens
    case = build_model("llama", seed=1)
    with torch.no_grad():
        ref = case.model.generate(**case.inputs, max_new_tokens=3)
        out = case.model.generate(**{k: split(v) for k, v in case.inputs.items()}, max_new_tokens=3)
    assert isinstance(out, hp.DTensor)
    assert torch.equal(out.full_tensor(), ref), (out.full_tensor(), ref)

    # one training step: loss, every gradient and the parameters after AdamW
    case = build_model("llama", seed=1)
    ref_loss, ref_grads, ref_params = _train_step(case.model, case.inputs, case.labels)
    case = build_model("llama", seed=1)
    model = distribute_parameters(case.model, repl)
    loss, grads, params = _train_step(model, {k: split(v) for k, v in case.inputs.items()},
                                      {k: split(v) for k, v in case.labels.items()})
    assert abs(float(loss) - float(ref_loss)) <= 1e-5, (float(loss), float(ref_loss))
    for n, g in ref_grads.items():
        assert grads[n] is not None, n
        assert torch.allclose(grads[n], g, atol=1e-5, rtol=0), (n, (grads[n] - g).abs().max())
    for n, p in ref_params.items():
        assert torch.allclose(params[n], p, atol=1e-5, rtol=0), (n, (params[n] - p).abs().max())
    assert all(full(p).shape == ref_params[n].shape for n, p in model.named_parameters())
    return True


def test_llama_batch_split_two_ranks(dist2):
    assert dist2.run(_llama_batch_split) == [True, True]


def test_ops_doc_is_generated_from_the_yaml():
    from pathlib import Path
    from hyper_parallel.tools.ops_doc import render
    doc = Path(__file__).resolve().parent.parent / "docs" / "ops.md"
    assert doc.read_text() == render(), "docs/ops.md is stale: python -m hyper_parallel.tools.ops_doc > docs/ops.md"


# ---- any transformers model type, built tiny on the spot ----------------------------------------------------
def test_type_census_sample_generates_report(tmp_path, capsys):
    """The generator of docs/census.md still runs: a sample of types, JSON and markdown."""
    out, md = tmp_path / "types.json", tmp_path / "census.md"
    rc = main(["census", "--model-type", "llama", "--model-type", "bert", "--model-type", "t5", "--jobs", "2",
               "--json", str(out), "--markdown", str(md)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "[3/3]" in text and "3 types, 3 run plain, 3 ok" in text
    data = json.loads(out.read_text())
    assert data["summary"]["ok"] == 3 and data["summary"]["plain_ok"] == 3
    heads = {t: v["head"] for t, v in data["types"].items()}
    assert heads == {"llama": "causal-lm", "bert": "masked-lm", "t5": "seq2seq-lm"}
    for t, v in data["types"].items():
        assert v["built"] and v["plain_ok"] and v["equal"] is True and v["missing"] == {}, (t, v["why"])
        assert set(v["runs"]) == {"generate", "train"} and v["ops"] and v["seconds"] > 0
    page = md.read_text()
    assert page.startswith("# Census of transformers model types")
    assert "| llama | causal-lm | text | ok |" in page and "--model-type llama" in page
    assert "| causal-lm | 1 | 1 | 1 | 0 |" in page  # the per-head table

    # --rerun: only the types a fix may change run again (here bert, marked failed), merged into the report
    data["types"]["bert"]["runs"]["generate"]["error"] = "Traceback ...\nRuntimeError: boom"
    data["types"]["t5"].update(built=False, status="not built", why="ValueError: not buildable")
    data["types"]["t5"]["runs"] = {}
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(data))
    merged, md2 = tmp_path / "merged.json", tmp_path / "merged.md"
    rc = main(["census", "--rerun", str(earlier), "--json", str(merged), "--markdown", str(md2)])
    text = capsys.readouterr().out
    assert rc == 0, text  # t5 stays "not built" (settled statuses are not re-run), which is not counted
    assert "[1/1] bert: ok" in text and "llama:" not in text.split("[1/1]")[0]
    again = json.loads(merged.read_text())
    assert list(again["types"]) == ["llama", "bert", "t5"]
    assert {t: v["status"] for t, v in again["types"].items()} == {"llama": "ok", "bert": "ok", "t5": "not built"}
    assert again["types"]["t5"]["why"] == "ValueError: not buildable"
    assert again["types"]["llama"] == data["types"]["llama"]  # kept as it was
    assert again["summary"]["ok"] == 2 and again["summary"]["plain_ok"] == 2
    assert len(again["commands"]) == 2 and f"--rerun {earlier}" in again["commands"][1]
    assert f"--rerun {earlier}" in md2.read_text().splitlines()[2]
    # --rerun-plain: the types that did not build or run plain run again too (after a tiny-config fix)
    rc = main(["census", "--rerun", str(merged), "--rerun-plain", "--json", str(merged)])
    text = capsys.readouterr().out
    assert rc == 0 and "[1/1] t5: ok" in text, text
    assert json.loads(merged.read_text())["summary"]["ok"] == 3
    # a rerun in another scenario than its report's is refused before anything runs
    assert main(["census", "--rerun", str(earlier), "--tp", "2"]) == 2
    assert "is a 'single' report" in capsys.readouterr().err


def test_heads_cover_every_mapping_transformers_registers():
    """Every MODEL_FOR_*_MAPPING_NAMES auto mapping is a census head, every type with a model class is in
    `all`, and each type gets its most capable head (the whole encoder-decoder over its decoder's causal LM)."""
    from transformers.models.auto import modeling_auto
    from hyper_parallel.tools.heads import all_model_types, head_of, unlisted_mappings
    assert unlisted_mappings() == []
    with_class = {t for k, m in vars(modeling_auto).items()
                  if k.startswith("MODEL_") and k.endswith("_MAPPING_NAMES") and isinstance(m, dict)
                  for t, cls in m.items() if cls}
    assert set(all_model_types()) == with_class and len(with_class) > 600
    expected = {"llama": "causal-lm", "bert": "masked-lm", "bart": "seq2seq-lm", "whisper": "speech-seq2seq",
                "vit": "image-classification", "wav2vec2": "ctc", "clip": "zero-shot-image-classification",
                "detr": "object-detection", "videomae": "video-classification", "qwen2_vl": "image-text-to-text",
                "dinov2_with_registers": "image-classification", "clip_vision_model": "base"}
    assert {t: head_of(t)[0] for t in expected} == expected
    assert head_of("llama", "classification") == ("classification", "LlamaForSequenceClassification")
    with pytest.raises(KeyError, match="no 'ctc' head"):
        head_of("llama", "ctc")


def test_type_census_every_modality_single_card():
    """One type per modality and new head kind, on DTensors against plain: image classification, CTC on a
    waveform, video classification, a contrastive image-text model, a speech encoder-decoder that generates."""
    from hyper_parallel.tools.census_types import run_type_census
    report = run_type_census(["vit", "wav2vec2", "videomae", "clip", "whisper"], jobs=2)
    got = {r.model_type: (r.head, r.fed, r.status, r.why) for r in report.results}
    assert {t: g[2] for t, g in got.items()} == dict.fromkeys(got, "ok"), got
    assert {t: g[1] for t, g in got.items()} == {"vit": ["image"], "wav2vec2": ["audio"], "videomae": ["video"],
                                                 "clip": ["text", "image"], "whisper": ["audio"]}
    whisper = next(r for r in report.results if r.model_type == "whisper")
    assert "tokens identical" in whisper.runs[0].detail  # it generated
    vit = next(r for r in report.results if r.model_type == "vit")
    assert "outputs" in vit.runs[0].detail and "torch.nn.functional.conv2d" in vit.ops
    assert report.summary()["heads"]["ctc"] == {"types": 1, "plain_ok": 1, "ok": 1, "not applicable": 0}


def test_tiny_configs_the_generic_shrinking_broke():
    """Types whose tiny config once broke a config check or left no attention layer now run plain: a state-space
    mixer's heads fill its width (mamba2), hybrids keep an attention layer (jamba, by the overrides table),
    unset expert counts are filled (deepseek_v2), backbone stages follow the shrunk layers (dinov2's
    out_features), a timm backbone becomes a tiny ResNet (detr)."""
    from hyper_parallel.tools.census_types import run_type_census
    from hyper_parallel.tools.tiny_overrides import OVERRIDES
    report = run_type_census(["mamba2", "jamba", "deepseek_v2", "depth_anything", "detr"], jobs=2, plain=True)
    assert {r.model_type: r.status for r in report.results} == dict.fromkeys(
        ["mamba2", "jamba", "deepseek_v2", "depth_anything", "detr"], "ok"), [r.why for r in report.results]
    assert "jamba" in OVERRIDES and "| jamba |" in report.markdown().split("overrides")[-1]


def test_tiny_config_is_small_and_consistent():
    from hyper_parallel.tools.auto_models import all_model_types, tiny_config
    types = all_model_types()
    assert len(types) > 200 and {"llama", "bert", "t5", "qwen2_vl", "qwen3_next"} <= set(types)
    cfg = tiny_config("qwen2_vl")
    text = cfg.text_config
    assert text.num_hidden_layers == 2 and text.hidden_size <= 64 and text.vocab_size <= 256
    assert text.num_attention_heads % text.num_key_value_heads == 0
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert cfg.vision_config.depth == 2 and cfg.image_token_id < text.vocab_size
    hybrid = tiny_config("qwen3_next")
    assert len(hybrid.layer_types) == 2 and len(set(hybrid.layer_types)) == 2  # one linear, one full attention


def test_model_type_inputs_feed_every_modality():
    from hyper_parallel.tools.auto_models import build_model_type, fed_modalities
    case = build_model_type("qwen2_vl")
    assert fed_modalities(case.inputs) == ["text", "image", "video"]
    cfg = case.model.config
    grid = case.inputs["image_grid_thw"]
    merged = int(grid[0].prod()) // cfg.vision_config.spatial_merge_size ** 2
    assert int((case.inputs["input_ids"][0] == cfg.image_token_id).sum()) == merged
    with torch.no_grad():
        case.model(**case.inputs)  # the placeholders match the features the vision tower makes


def test_model_path_feeds_vision(tmp_path):
    """census --model-path on a saved tiny Qwen3-VL runs its vision tower (conv3d and the rest)."""
    build_model("qwen3_vl", seed=0).model.save_pretrained(tmp_path / "a-rather-long-checkpoint-folder-name")
    path = str(tmp_path / "a-rather-long-checkpoint-folder-name")
    report = census.run_census([], "generate", model_paths=[path], max_new_tokens=2)
    r = report.runs[0]
    assert r.error is None and r.equal is True, r.error or r.detail
    assert "torch.nn.functional.conv3d" in r.ops and r.missing == {}
    assert r.fed == ["text", "image", "video"] and "fed: text, image, video" in report.table()  # what the checkpoint was fed
    lines = report.table().splitlines()
    assert len({line.index(" generate ") for line in lines if " generate " in line} |
               {lines[0].index(" mode ")}) == 1  # the long path keeps the columns aligned


def test_model_path_missing_is_one_clear_error(tmp_path, capsys):
    rc = main(["census", "--model-path", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("no such local checkpoint") == 1 and "nowhere" in err


def test_type_census_expert_context_pipeline_scenarios():
    """--ep / --cp / --pp: an MoE model through expert_parallel, a decoder through context_parallel and
    pipeline, on 2 gloo processes each; a dense model is not applicable to ep, an encoder to cp, both with why."""
    from hyper_parallel.tools.census_types import run_type_census
    ep = run_type_census(["qwen3_moe", "llama"], ep=2, jobs=2)
    assert [(r.model_type, r.status) for r in ep.results] == [("qwen3_moe", "ok"), ("llama", "not applicable")], \
        [r.why for r in ep.results]
    assert "no MoE experts" in ep.results[1].why and ep.summary()["plain_ok"] == 1
    cp = run_type_census(["llama", "bert"], cp=2, jobs=2)
    assert [r.status for r in cp.results] == ["ok", "not applicable"], [r.why for r in cp.results]
    assert "tokens identical" in cp.results[0].runs[0].detail, cp.results[0].runs[0].detail  # generate
    pp = run_type_census(["llama"], "train", pp=2)
    assert pp.results[0].status == "ok", pp.results[0].why
    assert "over 2 stages" in pp.results[0].runs[0].detail
    page = ep.markdown()
    assert "## Not run (not applicable: dense model" in page and "llama" in page.split("## Not run")[-1]


def test_type_census_tensor_parallel():
    from hyper_parallel.tools.census_types import run_type_census
    report = run_type_census(["llama", "bert"], "generate", tp=2)
    llama, bert = report.results
    assert llama.status == "ok", llama.why
    assert bert.status == "no tp plan"


def test_has_tp_plan_reads_the_config_classes():
    """Whether a type declares a base_model_tp_plan, from its config classes: sub-configs given as AutoConfig
    resolve through their default model type, and a default config that does not validate is not built."""
    from transformers import AutoConfig
    from hyper_parallel.tools.auto_models import has_tp_plan
    assert has_tp_plan("gemma4_assistant")   # its default config fails validation; its text config has a plan
    assert has_tp_plan("llava") and has_tp_plan("t5gemma") and has_tp_plan("llama")
    assert not has_tp_plan("bert") and not has_tp_plan("gpt2")

    def declared(cfg):  # the same question asked of built configs, through every sub-config
        subs = [getattr(cfg, k, None) for k in (getattr(cfg, "sub_configs", None) or {})]
        return bool(getattr(cfg, "base_model_tp_plan", None)) or any(declared(s) for s in subs if s is not None)

    for t in ("llama", "qwen3_vl", "gemma3", "t5gemma", "llava", "bert", "phi4_multimodal", "qwen2_audio"):
        assert has_tp_plan(t) == declared(AutoConfig.for_model(t)), t


def test_train_comparison_steps_on_the_run_s_own_gradients():
    """A split run's gradients are compared with the plain ones (relative to their size above 1), its
    parameters with a plain AdamW step on its own gradients: the optimizer is checked exactly, and float
    rounding of a gradient near Adam's eps (sums in another order) is not taken for a wrong result."""
    case = build_model("llama", seed=1)
    _, grads, params = census._train_step(case.model, case.inputs, case.labels)
    again = census._step_with(build_model("llama", seed=1).model, grads)
    assert all(torch.equal(again[n], params[n]) for n in params)
    rounded = {n: None if g is None else g * (1 + 2 ** -22) for n, g in grads.items()}
    assert census._max_diff(grads, rounded, relative=True)[0] <= census.TOLERANCE
    wrong = dict(grads, **{n: g * 1.01 for n, g in list(grads.items())[:1]})
    assert census._max_diff(grads, wrong, relative=True)[0] > census.GRAD_TOLERANCE
    scaled = {n: None if g is None else g * 1e3 for n, g in grads.items()}
    assert census._max_diff(scaled, {n: g * (1 + 2 ** -22) for n, g in scaled.items()}, relative=True)[0] \
        <= census.TOLERANCE


def test_op_name_of_a_higher_order_operator_is_stable():
    """Reports name a higher-order operator (custom autograd.Function under functorch) by its name, not by
    an object address that changes from run to run."""
    from torch._functorch.autograd_function import custom_function_call
    assert registry.op_name(custom_function_call) == "torch.ops.higher_order.custom_function_call"


def test_output_comparison_matches_the_same_infinities_and_catches_a_lone_one():
    """Grounding DINO's encoder_logits hold -inf at masked positions in every run: equal there is equal (as in
    torch.testing.assert_close); an infinity or NaN that only one side has is a difference."""
    ref = {"logits_a": torch.tensor([[1.0, float("-inf"), 2.0]])}
    close = {"logits_a": torch.tensor([[1.0 + 1e-7, float("-inf"), 2.0]])}
    assert census._output_diff(ref, close)[0] < 1e-6
    for bad in ([1.0, 0.0, 2.0], [1.0, float("inf"), 2.0], [float("nan"), float("-inf"), 2.0]):
        assert census._output_diff(ref, {"logits_a": torch.tensor([bad])})[0] == float("inf"), bad
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert census._output_diff({"z": z}, {"z": z + 1e-3j})[0] == pytest.approx(1e-3 / 3.1623, rel=1e-3)


def test_model_type_inputs_a_forward_requires():
    """Inputs a forward requires beyond the modalities, derived from the config: a sub-model's vector sequence
    (a Q-Former's queries), patches with their grid positions (Gemma 4's vision tower), one token type per
    kind (TAPAS); and a default config built from an override's `base` where the type's own fails its checks."""
    from hyper_parallel.tools.auto_models import build_model_type, tiny_config
    for model_type, shapes in (("blip_2_qformer", {"query_embeds": 3}), ("gemma4_vision", {"pixel_position_ids": 3}),
                               ("tapas", {"token_type_ids": 3})):
        case = build_model_type(model_type)
        assert {k: case.inputs[k].ndim for k in shapes} == shapes, case.inputs.keys()
        with torch.no_grad():
            case.model(**case.inputs)
    assert tiny_config("gemma4_assistant").text_config.hidden_size_per_layer_input == 0


def test_dp_scenario_runs_plain_and_dtensor_with_onednn_off_and_others_leave_it():
    """oneDNN picks its fp32 convolution algorithm by the batch size, so the dp scenario (a rank's share of
    the batch against the plain whole batch) runs every one of its runs with native kernels; the flag is
    restored after, and scenarios that keep the batch leave it as it is."""
    from hyper_parallel.tools.census_scenarios import Scenario, make_scenario
    seen = []

    def build():
        seen.append(torch._C._get_mkldnn_enabled())
        raise RuntimeError("recorded")   # _run_one reports it; the flag is what this test reads

    before = torch._C._get_mkldnn_enabled()
    assert make_scenario("dp", 2).native_kernels and not make_scenario("single").native_kernels
    report = Scenario("dp", native_kernels=True).run("t", "train", build, 1, False)
    assert "recorded" in report.error and seen == [False]
    assert torch._C._get_mkldnn_enabled() == before
    Scenario("single").run("t", "train", build, 1, False)
    assert seen == [False, before]
