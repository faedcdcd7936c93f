"""torch.distributed.checkpoint (DCP) interop (API.md §15): a checkpoint FSDP2 saved with DCP loads into our
layouts, and `checkpoint.save(..., format="dcp")` writes one that DCP loads into FSDP2; both against the
values the saving side holds (full tensors), on real gloo processes."""
from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import checkpoint as ckpt
from hyper_parallel.checkpoint import CheckpointCorruptError, CheckpointMismatchError
from tests.harness import pool
from tests.test_workflow import _full, tiny

BATCH = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(11))


def _fsdp2(seed: int):
    """tiny llama under FSDP2 (fully_shard per layer and at the root) on all ranks, with AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = _reseeded(tiny("llama"), seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _reseeded(model, seed: int):
    if seed:
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(std=0.05)
    return model


def _ours(layout: str, world: int, seed: int):
    model = _reseeded(tiny("llama"), seed)
    if layout == "tp":
        model = hp.parallelize(model, hp.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    else:
        model = hp.parallelize(model, hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)),
                               hsdp={"threshold": 0, "optimizer_level": "level3"})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, rows=BATCH) -> float:
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return _full(loss).item() if isinstance(loss, hp.DTensor) else loss.item()


def _full_any(t):
    """Full value of one of our DTensors, a torch DTensor (FSDP2) or a plain tensor."""
    from torch.distributed.tensor import DTensor as TorchDTensor
    if isinstance(t, TorchDTensor):
        return t.full_tensor()
    return _full(t).detach()


def _full_state(model, opt) -> dict:
    out = {f"model.{k}": _full_any(v).clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            out[f"optim.{i}.{name}"] = _full_any(v).clone()
    return out


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for k in want:
        assert torch.equal(got[k], want[k]), (k, (got[k] - want[k]).abs().max())


def fsdp2_to_ours(rank, world, path, layout):
    fsdp, fopt = _fsdp2(seed=0)
    _step(fsdp, fopt)
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": fsdp.state_dict(), "optim": fopt.state_dict()}, checkpoint_id=path)
    want = _full_state(fsdp, fopt)
    model, opt = _ours(layout, world, seed=5)
    ckpt.init_optimizer_state(opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    ckpt.load(state, path)
    ckpt.apply_optimizer_state(opt, state["optim"])
    _assert_equal(_full_state(model, opt), want)
    assert opt.param_groups[0]["lr"] == fopt.param_groups[0]["lr"]
    return _step(fsdp, fopt), _step(model, opt)  # the next step from the loaded state: same loss


def ours_to_fsdp2(rank, world, path, layout):
    model, opt = _ours(layout, world, seed=0)
    _step(model, opt)
    ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "note": ("ours", 1)}, path, format="dcp")
    want = {k: v for k, v in _full_state(model, opt).items() if k.startswith("model.")}
    import torch.distributed.checkpoint as dcp
    fsdp, fopt = _fsdp2(seed=5)
    state = {"model": fsdp.state_dict(), "note": None}
    dcp.load(state, checkpoint_id=path)
    assert state["note"] == ("ours", 1)
    _assert_equal({k: v for k, v in _full_state(fsdp, fopt).items() if k.startswith("model.")}, want)
    return _loss(model), _loss(fsdp)


def _loss(model) -> float:
    with torch.no_grad():
        loss = model(input_ids=BATCH, labels=BATCH).loss
    return _full_any(loss).item()


@pytest.mark.parametrize("layout", ["tp", "hsdp"])
def test_fsdp2_dcp_checkpoint_loads_into_our_layout(tmp_path, layout):
    for theirs, ours in pool(2).run(fsdp2_to_ours, str(tmp_path / "fsdp2"), layout):
        assert abs(theirs - ours) <= 1e-5 * abs(theirs), (theirs, ours)


@pytest.mark.parametrize("layout", ["tp", "hsdp"])
def test_our_dcp_checkpoint_loads_into_fsdp2(tmp_path, layout):
    for ours, theirs in pool(2).run(ours_to_fsdp2, str(tmp_path / "ours"), layout):
        assert abs(theirs - ours) <= 1e-5 * abs(ours), (ours, theirs)


# ---- every kind of layout (uneven, Partial, bf16, bool, int, scalars, Python values): 4 ranks -> 2 -> 1 -------
def _save_mixed_dcp(rank, world, path):
    from tests.test_checkpoint import _layouts_2x2, _reference, _state
    ckpt.save(_state(_reference(), _layouts_2x2()), path, format="dcp")
    return True


def test_dcp_format_reshards_every_layout_kind(dist4, dist2, tmp_path):
    from tests.test_checkpoint import _check_state, _layouts_1d, _load_mixed, _reference, _state
    path = str(tmp_path / "dcp")
    dist4.run(_save_mixed_dcp, path)
    assert sorted(os.listdir(path)) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    dist2.run(_load_mixed, path)
    ref = _reference()
    state = _state(ref, _layouts_1d(), zero=True)  # one process: plain tensors
    state["model"] = {k: torch.zeros_like(ref[k]) for k in state["model"]}
    state["optim"]["state"][0]["exp_avg"] = torch.zeros_like(ref["exp_avg"])
    ckpt.load(state, path)
    _check_state(state, ref)
    import torch.distributed.checkpoint as dcp  # DCP's own loader reads it too (one process)
    plain = {"model": {k: torch.zeros_like(ref[k]) for k in state["model"]}, "epoch": None}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(plain, checkpoint_id=path)
    assert plain["epoch"] == 3 and all(torch.equal(plain["model"][k], ref[k]) for k in plain["model"])


# ---- property: random shapes and layouts, both directions against torch's own DTensor ---------------------------
def dcp_random_case(rank, world, path, case):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor as torch_distribute
    full = torch.randn(case["shape"], generator=torch.Generator().manual_seed(case["seed"])).to(case["dtype"])
    mesh = init_device_mesh("cpu", (world,))
    theirs = lambda dim: torch_distribute(full.clone(), mesh, [Shard(dim) if dim is not None else Replicate()])  # noqa: E731
    M = hp.Layout((world,), ("x",))

    def ours(dim, partial, value):
        names = ["x" if d == dim else "None" for d in range(full.ndim)]
        layout = M(*names).with_partial("x") if partial else M(*names)
        if not partial:
            return hp.distribute_tensor(value.clone(), layout)
        local = hp.distribute_tensor(value.clone(), M(*names)).to_local()
        return hp.DTensor.from_local(local if rank == 0 else torch.zeros_like(local), layout, shape=full.shape)

    # FSDP2-style torch DTensor saved by DCP -> ours under another layout
    dcp.save({"w": theirs(case["theirs_save"]), "n": case["seed"]}, checkpoint_id=f"{path}/theirs")
    mine = {"w": ours(case["ours_load"], False, torch.zeros_like(full)), "n": -1}
    ckpt.load(mine, f"{path}/theirs")
    assert torch.equal(mine["w"].full_tensor(), full) and mine["n"] == case["seed"], case
    # ours (Partial too, on a 1-D mesh where the axis splits no dim) -> DCP -> a torch DTensor, another placement
    partial = case["partial"] and case["ours_save"] is None
    ckpt.save({"w": ours(case["ours_save"], partial, full), "n": case["seed"]}, f"{path}/ours", format="dcp")
    target = {"w": torch_distribute(torch.zeros_like(full), mesh,
                                    [Shard(case["theirs_load"]) if case["theirs_load"] is not None else Replicate()]),
              "n": -1}
    dcp.load(target, checkpoint_id=f"{path}/ours")
    assert torch.equal(target["w"].full_tensor(), full) and target["n"] == case["seed"], case
    return True


def test_property_dcp_random_layouts_both_directions(dist2, tmp_path_factory):
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st

    @st.composite
    def cases(draw):
        shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
        dim = st.one_of(st.none(), st.integers(0, len(shape) - 1))
        return {"shape": shape, "seed": draw(st.integers(0, 10_000)), "partial": draw(st.booleans()),
                "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
                "theirs_save": draw(dim), "ours_load": draw(dim), "ours_save": draw(dim), "theirs_load": draw(dim)}

    @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None, phases=(Phase.explicit, Phase.generate))
    @given(cases())
    def check(case):
        dist2.run(dcp_random_case, str(tmp_path_factory.mktemp("dcp")), case)

    check()


# ---- correct or loud ------------------------------------------------------------------------------------------
def _dcp_of(tmp_path, state) -> str:
    import torch.distributed.checkpoint as dcp
    path = str(tmp_path / "dcp")
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=path)
    return path


def test_dcp_mismatches_name_the_key(tmp_path):
    path = _dcp_of(tmp_path, {"w": torch.ones(3, 4), "b": torch.ones(4), "step": 2})
    with pytest.raises(CheckpointMismatchError, match=r"'w': shape mismatch, checkpoint \(3, 4\) vs state \(4, 3\)"):
        ckpt.load({"w": torch.zeros(4, 3), "b": torch.zeros(4), "step": 0}, path)
    with pytest.raises(CheckpointMismatchError, match=r"'b': dtype mismatch, checkpoint torch.float32 vs state"):
        ckpt.load({"w": torch.zeros(3, 4), "b": torch.zeros(4, dtype=torch.float16), "step": 0}, path)
    with pytest.raises(CheckpointMismatchError, match=r"missing from the checkpoint: 'extra'"):
        ckpt.load({"w": torch.zeros(3, 4), "b": torch.zeros(4), "step": 0, "extra": 1}, path)
    with pytest.raises(CheckpointMismatchError, match=r"'step': the checkpoint holds a Python value"):
        ckpt.load({"w": torch.zeros(3, 4), "b": torch.zeros(4), "step": torch.zeros(())}, path)
    state = {"w": torch.zeros(3, 4)}
    assert ckpt.load(state, path, strict=False).unexpected_keys == ["b", "step"]
    assert torch.equal(state["w"], torch.ones(3, 4))


class _Boom:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('PWNED').touch()",))


def test_dcp_metadata_and_values_are_data_not_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _dcp_of(tmp_path, {"w": torch.ones(2), "v": _Boom()})  # a value DCP pickles whole
    with pytest.raises(CheckpointCorruptError, match=r"'v': the stored value is not plain data"):
        ckpt.load({"w": torch.zeros(2), "v": None}, path)
    with open(os.path.join(path, ".metadata"), "wb") as f:  # a metadata file that runs code when unpickled
        pickle.dump(_Boom(), f)
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata is not a torch.distributed.checkpoint metadata"):
        ckpt.load({"w": torch.zeros(2)}, path)
    assert not (tmp_path / "PWNED").exists()


def test_dcp_save_is_atomic_and_refuses_foreign_folders(tmp_path):
    path = tmp_path / "ck"
    ckpt.save({"w": torch.ones(2)}, path, format="dcp")
    ckpt.save({"w": torch.full((2,), 2.0)}, path, format="dcp")  # replaces its own kind of folder
    state = {"w": torch.zeros(2)}
    ckpt.load(state, path)
    assert torch.equal(state["w"], torch.full((2,), 2.0))
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary folder left
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(hp.checkpoint.CheckpointError, match="refusing to replace"):
        ckpt.save({"w": torch.ones(2)}, tmp_path / "other", format="dcp")
    with pytest.raises(ValueError, match="unknown format 'torch'"):
        ckpt.save({"w": torch.ones(2)}, tmp_path / "x", format="torch")


def test_inspect_lists_a_dcp_checkpoint(tmp_path, capsys):
    from hyper_parallel.checkpoint.inspect import main
    path = _dcp_of(tmp_path, {"w": torch.ones(3, 4), "step": 2})
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "1 tensors" in out and "1 values" in out and "(3, 4)" in out and "dcp chunks" in out
    assert main(["inspect", path, "--verify"]) == 1
    assert "DCP stores no checksums" in capsys.readouterr().err
