"""Whole models with real sharding of their inputs, against the single-process plain run."""
import copy

import torch

import hyper_parallel as hp
from hyper_parallel.tools.census import distribute_parameters, full, run_split_census
from hyper_parallel.tools.models import build_model


def test_every_model_with_the_batch_split_over_two_ranks():
    """generate and a training step of every built-in model, inputs laid out ("dp", "None", ...).

    Unrecorded, so the calls take the paths a user's calls take (the census tests cover the recorded ones)."""
    report = run_split_census("all", "all", world=2, timeout=400, record=False)
    bad = [f"{r.model}/{r.mode}: {r.error.splitlines()[-1] if r.error else r.detail}" for r in report.runs
           if not r.ok]
    assert len(report.runs) == 24 and not bad, bad


def _sequence_split(rank, world, name):
    case = build_model(name, seed=0)
    ref = copy.deepcopy(case.model).train()
    L = hp.Layout((world,), ("sp",))
    model = distribute_parameters(case.model.train(), lambda t: hp.DTensor.from_local(t, L(*["None"] * t.ndim)))
    ids, labels = case.inputs["input_ids"], case.labels["labels"]
    out = model(input_ids=hp.distribute_tensor(ids, L("None", "sp")), labels=hp.distribute_tensor(labels, L("None", "sp")))
    out.loss.backward()
    want = ref(input_ids=ids, labels=labels)
    want.loss.backward()
    assert torch.allclose(full(out.logits), want.logits, atol=1e-5)
    assert torch.allclose(full(out.loss), want.loss, atol=1e-5)
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(full(p.grad), r.grad, atol=1e-5), n
    return True


def test_llama_and_qwen3_with_the_sequence_split(dist2):
    for name in ("llama", "qwen3"):
        dist2.run(_sequence_split, name)
