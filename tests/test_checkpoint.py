"""Distributed checkpoints: reshard on load (4 -> 2 -> 1 ranks), optimizer state, resumed training,
Hugging Face export/import, atomic saves under a crash, and the documented errors."""
import json
import os
import subprocess
import sys

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel import DTensor, Layout, distribute_tensor
from hyper_parallel import checkpoint as ckpt
from hyper_parallel.checkpoint import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError,
                                       CheckpointNotFoundError)
from tests.test_redistribute import make

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- a mixed state: every kind of layout, uneven shapes, dtypes, Partial, plain tensors, values -------------
def _reference():
    g = torch.Generator().manual_seed(42)
    r = lambda *s, dtype=torch.float32: torch.randn(s, generator=g).to(dtype)  # noqa: E731
    return {
        "a": r(8, 6), "b": r(5, 7), "c": r(7, 3, dtype=torch.bfloat16), "d": r(6, 5),
        "e": torch.randint(-1000, 1000, (3, 9), generator=g), "s": r(), "f": r(2, 3, 4), "tiny": r(1, 3),
        "exp_avg": r(5, 7), "step": torch.tensor(3.0), "rng": torch.arange(10, dtype=torch.int32),
        "mask": torch.rand(4, 4, generator=g) > 0.5,
    }


def _state(ref, lay, zero=False):
    def dt(name, layout):
        full = torch.zeros_like(ref[name]) if zero else ref[name]
        if layout.has_partial and not zero:  # exact terms: the value on coordinate 0, zeros elsewhere
            x = make(layout.without_partial(), full)
            local = x.to_local()
            if any(op and layout.mesh.coordinate[a] for a, op in enumerate(layout.partial)):
                local = torch.zeros_like(local)
            return DTensor.from_local(local, layout, shape=tuple(full.shape))
        return distribute_tensor(full, layout)

    def plain(name):
        return torch.zeros_like(ref[name]) if zero else ref[name].clone()

    return {
        "model": {k: dt(k, lay[k]) for k in ("a", "b", "c", "d", "e", "s", "f", "tiny", "mask")},
        "optim": {"state": {0: {"step": plain("step"), "exp_avg": dt("exp_avg", lay["exp_avg"])}},
                  "param_groups": [{"lr": 0.0 if zero else 0.01, "betas": None if zero else (0.9, 0.999),
                                    "params": [] if zero else [0], "eps": 0.0 if zero else 1e-8}]},
        "rng": plain("rng"),
        "epoch": 0 if zero else 3, "note": "" if zero else "run-1", "limit": 0.0 if zero else float("inf"),
    }


def _layouts_2x2():
    L = Layout((2, 2), ("dp", "tp"))
    return {"a": L(("dp", "tp"), "None"), "b": L("tp", "dp"), "c": L("None", "None"),
            "d": L("dp", "None").with_partial("tp"), "e": L("None", ("tp", "dp")), "s": L(),
            "f": L("tp", "None", "dp"), "tiny": L("dp", "None"), "mask": L("None", "tp"), "exp_avg": L("dp", "tp")}


def _layouts_1d():
    M = Layout((2,), ("x",))
    return {"a": M("None", "x"), "b": M("x", "None"), "c": M("x", "None"),
            "d": M("None", "None").with_partial("x"), "e": M("x", "None"), "s": M(),
            "f": M("None", "x", "None"), "tiny": M("None", "x"), "mask": M("x", "None"), "exp_avg": M("None", "x")}


def _check_state(state, ref):
    m = state["model"]
    for k in ("a", "b", "c", "d", "e", "s", "f", "tiny", "mask"):
        got = m[k].full_tensor() if isinstance(m[k], DTensor) else m[k]
        assert got.dtype == ref[k].dtype and torch.equal(got, ref[k]), k
    st = state["optim"]["state"][0]
    assert torch.equal(st["step"], ref["step"])
    got = st["exp_avg"].full_tensor() if isinstance(st["exp_avg"], DTensor) else st["exp_avg"]
    assert torch.equal(got, ref["exp_avg"])
    assert torch.equal(state["rng"], ref["rng"])
    assert state["optim"]["param_groups"] == [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0], "eps": 1e-8}]
    assert (state["epoch"], state["note"], state["limit"]) == (3, "run-1", float("inf"))


def _save_mixed(rank, world, path):
    ckpt.save(_state(_reference(), _layouts_2x2()), path)
    return True


def _load_mixed(rank, world, path):
    state = _state(_reference(), _layouts_1d(), zero=True)
    ckpt.load(state, path)
    for k in ("a", "b", "c", "e"):  # layouts kept
        assert state["model"][k].dist_layout is _layouts_1d()[k]
    _check_state(state, _reference())
    return True


def _load_expect_error(rank, world, path):
    try:
        ckpt.load(_state(_reference(), _layouts_1d(), zero=True), path)
    except CheckpointCorruptError as e:
        return str(e)
    return None


def _pieces_written(index):
    return {k: [(tuple(p["offsets"]), tuple(p["sizes"])) for p in e["pieces"]] for k, e in index["tensors"].items()}


def test_save_4_ranks_load_2_ranks_and_1_process(dist4, dist2, tmp_path):
    path = str(tmp_path / "ck")
    dist4.run(_save_mixed, path)
    index = ckpt.read_index(path)
    pieces = _pieces_written(index)
    assert len(pieces["model.c"]) == 1 and len(pieces["rng"]) == 1  # one copy of replicated data
    assert len(pieces["model.a"]) == 4 and len(pieces["model.d"]) == 2 and len(pieces["model.tiny"]) == 1
    assert sorted(index["files"]) == [f"rank{r:05d}.safetensors" for r in range(4)]
    dist2.run(_load_mixed, path)

    # single process, no torch.distributed: a replicated layout on a (virtual) mesh, plain tensors
    ref = _reference()
    M = Layout((2,), ("x",))
    state = _state(ref, {k: M(*["None"] * ref[k].ndim) for k in _layouts_1d()}, zero=True)
    ckpt.load(state, path)
    _check_state(state, ref)
    state = _state(ref, _layouts_1d(), zero=True)
    plain = {k: torch.zeros_like(ref[k]) for k in ("a", "b", "c", "d", "e", "s", "f", "tiny", "mask")}
    state["model"] = plain
    state["optim"]["state"][0]["exp_avg"] = torch.zeros_like(ref["exp_avg"])
    ckpt.load(state, path)
    _check_state(state, ref)

    # a piece that every 2-rank reader reads only partly is still checksummed (by one rank) -> all ranks raise
    entry = index["tensors"]["model.b"]["pieces"][0]
    _corrupt(os.path.join(path, entry["file"]), entry["name"])
    msgs = dist2.run(_load_expect_error, path)
    assert all(m and "checksum mismatch" in m and "model.b" in m and entry["file"] in m for m in msgs), msgs


def _save_2(rank, world, path):
    M = Layout((2,), ("x",))
    ref = _reference()
    ckpt.save(_state(ref, {k: M(*(["x"] + ["None"] * (ref[k].ndim - 1))[:ref[k].ndim]) for k in _layouts_1d()}),
              path)
    return True


def test_save_2_ranks_load_single_process(dist2, tmp_path):
    path = str(tmp_path / "ck2")
    dist2.run(_save_2, path)
    ref = _reference()
    L = Layout((4, 2), ("dp", "tp"))  # virtual mesh bigger than one process: replicated layouts only
    state = _state(ref, {k: L(*["None"] * ref[k].ndim) for k in _layouts_1d()}, zero=True)
    ckpt.load(state, path)
    _check_state(state, ref)


# ---- training: AdamW with DTensor parameters, saved on 4 ranks, resumed on 2 under other layouts ---------
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def _distribute_params(model, layout_of):
    done = {}  # a tied parameter stays one parameter
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        owner, attr = name.rsplit(".", 1)
        if id(p) not in done:
            done[id(p)] = torch.nn.Parameter(distribute_tensor(p.detach(), layout_of(name, p)))
        setattr(model.get_submodule(owner), attr, done[id(p)])
    return model


def _layout_2x2(name, p):
    L = Layout((2, 2), ("dp", "tp"))
    if p.ndim == 1:
        return L("None")
    if any(s in name for s in ("o_proj", "down_proj")):
        return L("dp", "tp")          # row-parallel on tp, and split over dp like an FSDP shard
    if "embed" in name or "lm_head" in name:
        return L(("dp", "tp"), "None")
    return L("tp", "dp")


def _layout_1d(name, p):
    M = Layout((2,), ("x",))
    if p.ndim == 1:
        return M("x")
    return M("None", "x") if "proj" in name else M("x", "None")


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 96, (2, 12), generator=g)
    return ids


def _train(model, opt, steps, first):
    losses = []
    for s in range(first, first + steps):
        ids = _batch(s)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()))
    return losses


def _full_values(model, opt):
    vals = {f"p.{n}": p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    for i, (p, st) in enumerate(opt.state.items()):
        for k, v in st.items():
            vals[f"o.{i}.{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).clone()
    return vals


def _train_save_4(rank, world, path, ref_path):
    torch.manual_seed(0)
    model = _distribute_params(_tiny_llama(), _layout_2x2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    first = _train(model, opt, 3, 0)
    ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}, path)
    values = _full_values(model, opt)  # collective: every rank gathers
    if rank == 0:
        torch.save(values, ref_path)
    return first


def _resume_2(rank, world, path, ref_path):
    torch.manual_seed(5)  # a different init: everything must come from the checkpoint
    model = _distribute_params(_tiny_llama(), _layout_1d)
    opt = torch.optim.AdamW(model.parameters(), lr=5.0, weight_decay=0.0)
    ckpt.init_optimizer_state(opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}
    ckpt.load(state, path)
    ckpt.apply_optimizer_state(opt, state["optim"])
    assert state["step"] == 3 and opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.1
    for n, p in model.named_parameters():
        assert p.dist_layout is _layout_1d(n, p)
    saved = torch.load(ref_path)
    now = _full_values(model, opt)
    assert saved.keys() == now.keys()
    for k in saved:
        assert saved[k].dtype == now[k].dtype and torch.equal(saved[k], now[k]), k
    return _train(model, opt, 2, 3)


def test_llama_adamw_resume_on_other_layout(dist4, dist2, tmp_path):
    """3 steps on a 2x2 mesh, save, resume on 2 ranks under other layouts for 2 steps: the losses match an
    uninterrupted 5-step single-device run (the reference for every layout, by the single-device promise)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    plain = _tiny_llama()
    uninterrupted = _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1), 5, 0)
    path, ref_path = str(tmp_path / "llama"), str(tmp_path / "ref.pt")
    first = dist4.run(_train_save_4, path, ref_path)[0]
    assert first == pytest.approx(uninterrupted[:3], abs=1e-5), (first, uninterrupted)
    resumed = dist2.run(_resume_2, path, ref_path)[0]
    assert resumed == pytest.approx(uninterrupted[3:], abs=1e-5), (resumed, uninterrupted)


# ---- Hugging Face round trip -----------------------------------------------------------------------------
def _hf_round_trip(rank, world, path, ref_path):
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    plain = _tiny_llama()
    ref = {k: v.clone() for k, v in plain.state_dict().items()}
    model = _distribute_params(plain, _layout_2x2)
    ckpt.export_hf(model, path)
    if rank == 0:
        back = LlamaForCausalLM.from_pretrained(path)
        got = back.state_dict()
        assert got.keys() == ref.keys()
        for k in ref:
            assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
    torch.manual_seed(9)
    L = Layout((2, 2), ("dp", "tp"))  # other layouts than the exported model's: each rank reads its own slices
    fresh = _distribute_params(_tiny_llama(), lambda n, p: L("tp") if p.ndim == 1 else L("None", ("tp", "dp")))
    ckpt.load_hf(fresh, path)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, ref[k]), k
    return True


def test_hf_export_and_load(dist4, tmp_path):
    pytest.importorskip("transformers")
    path = str(tmp_path / "hf")
    dist4.run(_hf_round_trip, path, None)
    assert {"config.json", "model.safetensors"} <= set(os.listdir(path))
    # load the HF folder in one process, into a model laid out on a virtual mesh (replicated)
    ref_model = _hf_reference()
    L = Layout((2, 2), ("dp", "tp"))
    fresh = _distribute_params(_tiny_llama(), lambda n, p: L(*["None"] * p.ndim))
    ckpt.load_hf(fresh, path)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.full_tensor(), ref_model[k]), k


def _hf_reference():
    torch.manual_seed(0)
    return _tiny_llama().state_dict()


# ---- atomicity ---------------------------------------------------------------------------------------------
_CRASH = r"""
import os, sys, torch
sys.path.insert(0, {root!r})
from hyper_parallel import checkpoint as ckpt
import hyper_parallel.checkpoint.saver as S
S.commit = lambda tmp, path: os._exit(3)  # every file and the index written, killed before the rename
ckpt.save({{"w": torch.full((64, 64), 7.0), "step": 99}}, {path!r})
"""


def test_crash_between_writing_and_rename_keeps_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    good = torch.randn(64, 64)
    ckpt.save({"w": good, "step": 1}, path)
    proc = subprocess.run([sys.executable, "-c", _CRASH.format(root=ROOT, path=path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert any(n.startswith(".ck.tmp-") for n in os.listdir(tmp_path))  # the crashed save's leftovers
    state = {"w": torch.zeros(64, 64), "step": 0}
    ckpt.load(state, path)
    assert torch.equal(state["w"], good) and state["step"] == 1
    ckpt.save({"w": good * 2, "step": 2}, path)  # the next save succeeds and clears the leftovers
    assert os.listdir(tmp_path) == ["ck"]


def test_interrupted_folder_swap_falls_back_to_previous(tmp_path):
    path = tmp_path / "ck"
    ckpt.save({"w": torch.ones(3)}, path)
    os.rename(path, tmp_path / ".ck.old-123456")  # a crash between the two renames of the fallback swap
    state = {"w": torch.zeros(3)}
    with pytest.warns(UserWarning, match="interrupted"):
        ckpt.load(state, path)
    assert torch.equal(state["w"], torch.ones(3))


# ---- documented errors ------------------------------------------------------------------------------------
def _corrupt(file, piece_name):
    """Flip one byte inside the stored piece `piece_name` of a safetensors file."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    start = 8 + n + header[piece_name]["data_offsets"][0]
    with open(file, "r+b") as f:
        f.seek(start + 1)
        b = f.read(1)
        f.seek(start + 1)
        f.write(bytes([b[0] ^ 0xFF]))


def _small(tmp_path):
    path = str(tmp_path / "ck")
    ckpt.save({"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}, "step": 5}, path)
    fresh = lambda: {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}, "step": 0}  # noqa: E731
    return path, fresh


def test_corrupt_piece_is_a_checksum_error(tmp_path):
    path, fresh = _small(tmp_path)
    _corrupt(os.path.join(path, "rank00000.safetensors"), "model.w@0,0")
    state = fresh()
    with pytest.raises(CheckpointCorruptError, match=r"checksum mismatch for 'model.w'.*rank00000.safetensors"):
        ckpt.load(state, path)
    assert torch.equal(state["model"]["b"], torch.zeros(4))  # nothing was filled
    ckpt.load(fresh(), path, verify=False)  # opt-out loads the (corrupt) bytes


def test_truncated_file_names_the_file(tmp_path):
    path, fresh = _small(tmp_path)
    f = os.path.join(path, "rank00000.safetensors")
    os.truncate(f, os.path.getsize(f) - 10)
    with pytest.raises(CheckpointCorruptError, match=r"rank00000.safetensors is truncated"):
        ckpt.load(fresh(), path)
    os.truncate(f, 5)
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        ckpt.load(fresh(), path)


def test_mismatches_name_the_key(tmp_path):
    path, fresh = _small(tmp_path)
    s = fresh()
    s["model"]["w"] = torch.zeros(4, 3)
    with pytest.raises(CheckpointMismatchError, match=r"'model.w': shape mismatch, checkpoint \(3, 4\) vs state \(4, 3\)"):
        ckpt.load(s, path)
    s = fresh()
    s["model"]["b"] = torch.zeros(4, dtype=torch.float16)
    with pytest.raises(CheckpointMismatchError, match=r"'model.b': dtype mismatch, checkpoint float32 vs state float16"):
        ckpt.load(s, path)
    s = fresh()
    s["model"]["extra"] = torch.zeros(2)
    with pytest.raises(CheckpointMismatchError, match=r"missing from the checkpoint: 'model.extra'"):
        ckpt.load(s, path)
    s = fresh()
    del s["model"]["b"]
    with pytest.raises(CheckpointMismatchError, match=r"in the checkpoint but not in the state: 'model.b'"):
        ckpt.load(s, path)
    res = ckpt.load(s, path, strict=False)
    assert res.unexpected_keys == ["model.b"] and torch.equal(s["model"]["w"], torch.arange(12.0).reshape(3, 4))
    s = fresh()
    s["step"] = torch.zeros(())
    with pytest.raises(CheckpointMismatchError, match=r"'step': the checkpoint holds a Python value"):
        ckpt.load(s, path)


def test_missing_or_broken_index(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        ckpt.load({}, tmp_path / "nothing")
    path, fresh = _small(tmp_path)
    with open(os.path.join(path, "index.json"), "r+") as f:
        f.truncate(20)
    with pytest.raises(CheckpointCorruptError, match=r"index.json is not valid JSON"):
        ckpt.load(fresh(), path)
    os.remove(os.path.join(path, "index.json"))
    with pytest.raises(CheckpointNotFoundError, match="no index.json"):
        ckpt.load(fresh(), path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("x")
    with pytest.raises(CheckpointError, match="refusing to replace"):
        ckpt.save({"w": torch.ones(2)}, tmp_path / "other")
    with pytest.raises(TypeError, match="'bad': cannot store a object"):
        ckpt.save({"bad": object()}, tmp_path / "x")
    L = Layout((2,), ("x",))  # one process cannot save a tensor split over a virtual mesh: it holds one piece
    with pytest.raises(CheckpointError, match=r"'w' is split over .* needs torch.distributed"):
        ckpt.save({"w": distribute_tensor(torch.ones(4), L("x"))}, tmp_path / "x")


def test_fresh_optimizer_hint_and_init(tmp_path):
    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.AdamW([w], lr=0.1)
    (w * w).sum().backward()
    opt.step()
    ckpt.save({"optim": opt.state_dict()}, tmp_path / "o")
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = torch.optim.AdamW([w2], lr=0.5)
    with pytest.raises(CheckpointMismatchError, match="init_optimizer_state"):
        ckpt.load({"optim": opt2.state_dict()}, tmp_path / "o")
    before = w2.detach().clone()
    ckpt.init_optimizer_state(opt2)
    assert torch.equal(w2.detach(), before) and w2.grad is None
    state = {"optim": opt2.state_dict()}
    ckpt.load(state, tmp_path / "o")
    opt2.load_state_dict(state["optim"])
    for k in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt2.state[w2][k], opt.state[w][k])
    assert opt2.param_groups[0]["lr"] == 0.1


def test_inspect_cli(tmp_path, capsys):
    from hyper_parallel.checkpoint.inspect import main
    path, _ = _small(tmp_path)
    from hyper_parallel.tools.cli import main as cli_main
    assert cli_main(["checkpoint", "inspect", path]) == 0  # the `hyper-parallel` script
    out = capsys.readouterr().out
    assert main(["inspect", path]) == 0
    assert capsys.readouterr().out == out
    assert "model.w" in out and "(3, 4)" in out and "float32" in out and "plain" in out and "step = 5" in out
    assert main(["inspect", path, "--json", "-"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert {r["key"]: r["bytes"] for r in listing["tensors"]} == {"model.w": 48, "model.b": 16}
    _corrupt(os.path.join(path, "rank00000.safetensors"), "model.w@0,0")
    assert main(["inspect", path, "--verify"]) == 1
    assert main(["inspect", str(tmp_path / "none")]) == 1


# ---- optimizer state alone (no model forward): AdamW on DTensor params, resumed under other layouts ------
_SHAPES = {"w1": (8, 6), "w2": (5, 7), "b": (6,)}


def _grads(step):
    g = torch.Generator().manual_seed(1000 + step)
    return {k: torch.randn(s, generator=g) for k, s in _SHAPES.items()}


def _adamw_steps(params, opt, first, steps):
    for s in range(first, first + steps):
        for k, full in _grads(s).items():
            p = params[k]
            p.grad = distribute_tensor(full, p.dist_layout) if isinstance(p, DTensor) else full
        opt.step()
        opt.zero_grad(set_to_none=True)


def _make_params(layouts, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=g), layouts[k]))
            for k, s in _SHAPES.items()}


def _optim_save_4(rank, world, path):
    L = Layout((2, 2), ("dp", "tp"))
    lay = {"w1": L(("dp", "tp"), "None"), "w2": L("tp", "dp"), "b": L("dp")}
    params = _make_params(lay, 0)
    opt = torch.optim.AdamW(params.values(), lr=0.05, weight_decay=0.1, amsgrad=True)
    _adamw_steps(params, opt, 0, 3)
    ckpt.save({"model": params, "optim": opt.state_dict()}, path)
    _adamw_steps(params, opt, 3, 2)
    return {k: p.detach().full_tensor() for k, p in params.items()}


def _optim_load_2(rank, world, path):
    M = Layout((2,), ("x",))
    lay = {"w1": M("None", "x"), "w2": M("x", "None"), "b": M("None")}
    params = _make_params(lay, 1)
    opt = torch.optim.AdamW(params.values(), lr=1.0, weight_decay=0.0, amsgrad=True)
    ckpt.init_optimizer_state(opt)
    state = {"model": params, "optim": opt.state_dict()}
    ckpt.load(state, path)
    ckpt.apply_optimizer_state(opt, state["optim"])
    for k, p in params.items():
        assert p.dist_layout is lay[k]
        assert opt.state[p]["exp_avg"].dist_layout is lay[k]
    _adamw_steps(params, opt, 3, 2)
    return {k: p.detach().full_tensor() for k, p in params.items()}


def test_optimizer_state_resumes_bit_exact(dist4, dist2, tmp_path):
    path = str(tmp_path / "opt")
    uninterrupted = dist4.run(_optim_save_4, path)[0]
    resumed = dist2.run(_optim_load_2, path)[0]
    for k in uninterrupted:
        assert torch.equal(resumed[k], uninterrupted[k]), k  # elementwise updates: bit-identical


# ---- the scenario: TP=2 x hsdp=2 on 4 ranks -> hsdp only on 2 ranks ----------------------------------
_TP_PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
            "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise"}


def _dp_batch(step):
    """The global batch of a step: one micro-batch of 2 sequences per data-parallel rank (2 of them)."""
    return torch.randint(0, 96, (2, 2, 12), generator=torch.Generator().manual_seed(200 + step))


def _dp_train(model, opt, first, steps, dp_rank, dp_group_size):
    import torch.distributed as dist
    losses = []
    for s in range(first, first + steps):
        x = _dp_batch(s)[dp_rank]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())  # tp ranks hold the same dp loss: mean = dp mean
        opt.step()
        opt.zero_grad()
    return losses


def _tp_hsdp_save(rank, world, path, ref_path):
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = hp.hsdp(hp.shard(_tiny_llama(), _TP_PLAN, mesh=mesh), optimizer_level="level3", threshold=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    first = _dp_train(model, opt, 0, 3, mesh.get_local_rank("dp"), 2)
    ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    values = _full_values(model, opt)
    if rank == 0:
        torch.save(values, ref_path)
    return first


def _hsdp_resume(rank, world, path, ref_path):
    torch.manual_seed(3)
    model = hp.hsdp(_tiny_llama(), optimizer_level="level3", threshold=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    ckpt.init_optimizer_state(opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    ckpt.load(state, path)
    ckpt.apply_optimizer_state(opt, state["optim"])
    saved, now = torch.load(ref_path), _full_values(model, opt)
    assert saved.keys() == now.keys()
    for k in saved:
        assert torch.equal(saved[k], now[k]), k
    return _dp_train(model, opt, 3, 2, rank, 2)


def test_tp_hsdp_4_ranks_resume_hsdp_2_ranks(dist4, dist2, tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = _tiny_llama()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    uninterrupted = []
    for s in range(5):
        x = _dp_batch(s).reshape(-1, 12)
        loss = ref(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        uninterrupted.append(loss.item())
    path, ref_path = str(tmp_path / "tp_hsdp"), str(tmp_path / "ref.pt")
    first = dist4.run(_tp_hsdp_save, path, ref_path)[0]
    assert first == pytest.approx(uninterrupted[:3], abs=1e-5), (first, uninterrupted)
    resumed = dist2.run(_hsdp_resume, path, ref_path)[0]
    assert resumed == pytest.approx(uninterrupted[3:], abs=1e-5), (resumed, uninterrupted)


def test_hf_export_tied_single_process(tmp_path):
    """One process: a tied model exports its shared weight once and from_pretrained re-ties it."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    L = Layout((2,), ("x",))
    _distribute_params(model, lambda n, p: L(*["None"] * p.ndim))
    ckpt.export_hf(model, tmp_path / "hf")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys()) and "model.embed_tokens.weight" in set(f.keys())
    back = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert back.lm_head.weight is back.model.embed_tokens.weight
    for k, v in back.state_dict().items():
        assert torch.equal(v, ref[k]), k
    ckpt.export_hf(model, tmp_path / "hf")  # replacing an export is allowed
    with pytest.raises(CheckpointError, match="refusing to replace"):
        ckpt.export_hf(model, tmp_path)  # a folder that is not an export


_CRASH_2 = r"""
import os, sys
from datetime import timedelta
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
from hyper_parallel import Layout, distribute_tensor
from hyper_parallel import checkpoint as ckpt
import hyper_parallel.checkpoint.format as F
L = Layout((2,), ("x",))
full = torch.arange(48.0).reshape(8, 6)
ckpt.save({{"w": distribute_tensor(full, L("x", "None")), "step": 1}}, {path!r})
if dist.get_rank() == 1:  # killed while writing its pieces of the next save
    original = F.SafetensorsWriter.write
    def write(self, t):
        original(self, t)
        os._exit(3)
    F.SafetensorsWriter.write = write
ckpt.save({{"w": distribute_tensor(full * 0, L("None", "x")), "step": 2}}, {path!r})
"""


def test_rank_killed_mid_save_keeps_previous_checkpoint(tmp_path):
    """Two real processes; rank 1 dies while writing: rank 0 fails instead of committing, the last good
    checkpoint stays loadable."""
    path = str(tmp_path / "ck")
    code = _CRASH_2.format(root=ROOT, path=path)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert procs[1].returncode == 3, outs[1][1]
    assert procs[0].returncode != 0, outs[0]
    L = Layout((2,), ("x",))
    state = {"w": distribute_tensor(torch.zeros(8, 6), L("None", "None")), "step": 0}
    ckpt.load(state, path)
    assert torch.equal(state["w"].full_tensor(), torch.arange(48.0).reshape(8, 6)) and state["step"] == 1


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
