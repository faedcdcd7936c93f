"""`parallelize` composing tensor parallel (tp="auto", a style plan) with context and expert parallelism on
multi-axis meshes, on real gloo processes against the same model in one plain process."""
from __future__ import annotations

import copy

import torch

import hyper_parallel as hp
from hyper_parallel.parallel.expert import find_experts
from tests.test_context import _batch as _cp_batch, _model as _cp_model
from tests.test_expert import _batch as _ep_batch, _model as _ep_model

TOL = dict(rtol=1e-5, atol=1e-5)


def _full(t):
    return t.full_tensor() if isinstance(t, hp.DTensor) else t


def _same_grads(model, ref, where):
    params = dict(model.named_parameters())
    for n, r in ref.named_parameters():
        if r.grad is None:
            continue
        torch.testing.assert_close(_full(params[n].grad), r.grad, **TOL, msg=lambda m: f"{where}: grad {n}: {m}")


def _cp_tp(rank, world):
    """cp=2 x tp=2 with the model's own tp plan: the style plan lays parameters out on the whole ("cp", "tp")
    mesh (replicated over "cp"), and the embedding's boundary keeps the sequence split over "cp"."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    ref = _cp_model("llama")
    model = hp.parallelize(copy.deepcopy(ref), mesh, tp="auto", cp="ring")
    assert all(p.device_mesh is mesh for p in model.parameters())
    assert any(p.dist_layout.sharded_axes == (mesh.axis_index("tp"),) for p in model.parameters())
    batch = _cp_batch(padded=True)
    out = model(**batch)
    out.loss.backward()
    want = ref(**batch)
    want.loss.backward()
    torch.testing.assert_close(_full(out.loss), want.loss, **TOL)
    _same_grads(model, ref, "cp x tp")
    return True


def test_parallelize_tp_auto_with_cp_ring(dist4):
    dist4.run(_cp_tp)


def _ep_tp(rank, world, name):
    """ep=2 x tp=2 with the model's own tp plan: expert_parallel owns the experts (whole experts over "ep",
    undoing the plan's split of them over "tp"); attention is split over "tp", the batch over "ep"."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    ref = _ep_model(name)
    model = hp.parallelize(copy.deepcopy(ref), mesh, tp="auto", ep=True)
    assert all(p.device_mesh is mesh for p in model.parameters())
    ep_axis = mesh.axis_index("ep")
    for m in find_experts(model).values():
        for p in m._parameters.values():
            assert p.dist_layout.sharded_axes == (ep_axis,) and p._local.shape[0] * 2 == p.shape[0]
    ids = _ep_batch(4)
    mine = ids.chunk(hp.data_world(mesh))[hp.data_rank(mesh)]   # each ep rank its share; tp ranks the same one
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(2):
        loss = model(input_ids=mine, labels=mine).loss
        ref_loss = ref(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(_full(loss), ref_loss, **TOL)
        loss.backward()
        ref_loss.backward()
        if step == 0:
            _same_grads(model, ref, f"{name} ep x tp")
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
    return True


def test_parallelize_tp_auto_with_ep(dist4):
    dist4.run(_ep_tp, "qwen3_moe")
