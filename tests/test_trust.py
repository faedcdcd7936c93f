"""Data is not code (API.md §11): YAML rule files and checkpoint indexes are data that cannot make the
library run code or open files outside their folder; MissingOpError's advice is right for any layout;
hsdp refuses invalid arguments from the arguments alone."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel import DTensor, Layout, distribute_tensor
from hyper_parallel import checkpoint as ckpt
from hyper_parallel.checkpoint import CheckpointCorruptError, CheckpointError
from hyper_parallel.dispatch import registry
from hyper_parallel.dispatch.registry import RuleFileError

from tests.op_check import without_rule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OP = "tests.test_trust.op"  # a name no real op has: registering it cannot change other tests


@pytest.fixture
def forget():
    yield
    registry.unregister(OP)


def _rules(folder, text: str, name: str = "rules.yaml"):
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(text)
    return folder / name


# ---- YAML rule files ------------------------------------------------------------------------------------
def test_shell_command_in_rule_file_does_not_run(tmp_path):
    marker = tmp_path / "pwned"
    yml = _rules(tmp_path / "r", f'"touch {marker}": {{rule: os.system}}\n')
    with pytest.raises(RuleFileError, match=r"rules.yaml: entry 'touch .*pwned'.*os.system.*not a subclass of "
                                            r"hyper_parallel.ops.base.Rule"):
        hp.register_ops(yml)
    with pytest.raises(RuleFileError, match="not a subclass"):
        hp.register_ops(yml.parent)
    assert not marker.exists()
    # the same file through the environment variable, read at import
    env = dict(os.environ, HYPER_PARALLEL_OPS_YAML_DIR=str(yml.parent), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", "import hyper_parallel"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "not a subclass of hyper_parallel.ops.base.Rule" in proc.stderr, proc.stderr
    assert not marker.exists()


def test_rule_must_be_a_rule_class(tmp_path):
    for spec, why in [("subprocess.Popen", "not a subclass"), ("hyper_parallel.ops.misc.NoSuchRule", "names no class"),
                      ("hyper_parallel.ops.base.Signature", "not a subclass"), ("os", "not 'package.module.Class'"),
                      ("os.path.join()", "not 'package.module.Class'")]:
        with pytest.raises(RuleFileError, match=re.escape(why)):
            hp.register_ops(_rules(tmp_path / "r", f"{OP}: {{rule: '{spec}'}}\n"))
    assert OP not in registry.RULES


def test_rule_file_never_imports_a_module(tmp_path, monkeypatch):
    """Importing runs a module's code: only hyper_parallel's own and already imported modules may be named."""
    marker = tmp_path / "imported"
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "trust_evil_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass R: pass\n")
    monkeypatch.syspath_prepend(str(mods))
    with pytest.raises(RuleFileError, match=r"module 'trust_evil_mod' is not imported.*does not import modules"):
        hp.register_ops(_rules(tmp_path / "r", f"{OP}: {{rule: trust_evil_mod.R}}\n"))
    assert not marker.exists() and "trust_evil_mod" not in sys.modules


_MY_RULES = """
from hyper_parallel.ops.misc import Replicated

class Gathered(Replicated):
    \"\"\"A user rule with one option.\"\"\"
    note = "none"

def not_a_rule(name, **kw):
    open({marker!r}, "w").close()
"""


def test_rule_class_from_a_file_in_the_folder(tmp_path, forget):
    folder = tmp_path / "r"
    marker = tmp_path / "called"
    folder.mkdir()
    (folder / "my_rules.py").write_text(_MY_RULES.format(marker=str(marker)))
    hp.register_ops(_rules(folder, f"{OP}: {{rule: 'my_rules.py:Gathered', note: hi}}\n"))
    assert type(registry.RULES[OP]).__name__ == "Gathered" and registry.RULES[OP].note == "hi"
    registry.unregister(OP)
    with pytest.raises(RuleFileError, match="my_rules.py:not_a_rule.*function, not a subclass"):
        hp.register_ops(_rules(folder, f"{OP}: {{rule: 'my_rules.py:not_a_rule'}}\n"))
    assert not marker.exists()


def test_rule_file_paths_stay_inside_the_folder(tmp_path):
    marker = tmp_path / "ran"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                     f"from hyper_parallel.ops.misc import Replicated as R\n")
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "link.py").symlink_to(outside / "evil.py")
    for spec in ["../outside/evil.py:R", f"{outside / 'evil.py'}:R", "link.py:R", "sub/../../outside/evil.py:R"]:
        with pytest.raises(RuleFileError, match="inside the registered folder"):
            hp.register_ops(_rules(folder, f"{OP}: {{rule: '{spec}'}}\n"))
    assert not marker.exists()
    # a rule file may live in a subfolder of the registered folder, and name a class beside it
    (folder / "sub").mkdir()
    shutil.copy(outside / "evil.py", folder / "sub" / "ok.py")
    (folder / "rules.yaml").unlink()
    _rules(folder / "sub", f"{OP}: {{rule: 'ok.py:R'}}\n")
    try:
        hp.register_ops(folder / "sub" / "rules.yaml")
        assert OP in registry.RULES and marker.exists()  # the user's own file, inside the folder, does run
    finally:
        registry.unregister(OP)


@pytest.mark.parametrize("text, where", [
    ("- a\n- b\n", r"rules.yaml: a rule file must be a mapping"),
    (f"{OP}: [1, 2]\n", rf"rules.yaml: entry '{re.escape(OP)}': an entry must be a mapping"),
    (f"{OP}: just-a-string\n", rf"entry '{re.escape(OP)}': an entry must be a mapping"),
    (f"{OP}: {{rule: 5}}\n", rf"entry '{re.escape(OP)}': rule must be a string"),
    (f"{OP}: {{linear: add}}\n", rf"entry '{re.escape(OP)}' has no rule"),
    ("1: {rule: hyper_parallel.ops.misc.Replicated}\n", r"rules.yaml: op names must be strings"),
    ("__default__: oops\nx.y:\n", r"rules.yaml: __default__: an entry must be a mapping"),
    (f"{OP}: {{rule: hyper_parallel.ops.misc.Replicated\n", r"rules.yaml: not valid YAML"),
    (f"{OP}: {{rule: hyper_parallel.ops.elementwise.Elementwise, linaer: add}}\n",
     r"entry '.*': unknown option 'linaer' for hyper_parallel.ops.elementwise.Elementwise; it accepts \[.*'linear'"),
    (f"{OP}: {{rule: hyper_parallel.ops.indexing.Scatter, accumulate: maybe}}\n",
     r"option 'accumulate' must be true or false"),
    (f"{OP}: {{rule: hyper_parallel.ops.misc.Replicated, strategy: 1}}\n", r"unknown option 'strategy'"),
])
def test_malformed_rule_file_names_file_and_entry(tmp_path, text, where):
    with pytest.raises(RuleFileError, match=where):
        hp.register_ops(_rules(tmp_path / "r", text))
    assert OP not in registry.RULES


def test_builtin_rules_and_their_options_pass_the_checks():
    """Every built-in entry went through the same checks at import; each option is one its class declares."""
    assert len(registry.RULES) > 300
    for name, rule in registry.RULES.items():
        assert set(rule.options) <= set(registry.rule_options(type(rule))), name


# ---- MissingOpError's advice, followed literally ---------------------------------------------------------
def _follow_missing_op_advice(rank, world, folder):
    """unfold mixes rows: an elementwise rule would give each rank windows of its own rows only."""
    from tests.test_redistribute import make
    name = "torch.Tensor.unfold"
    L = Layout((world,), ("tp",))
    x = torch.randn(8, 3)
    want = x.unfold(0, 3, 1)
    with without_rule(name):
        with pytest.raises(hp.MissingOpError) as err:
            distribute_tensor(x, L("tp", "None")).unfold(0, 3, 1)
        msg = str(err.value)
        assert "docs/architecture.md" in msg and "Writing a rule" in msg
        entry = re.search(r"add '(.+?)' to a YAML file", msg).group(1)
        yml = os.path.join(folder, f"advice{rank}.yaml")
        with open(yml, "w") as f:
            f.write(entry + "\n")
        hp.register_ops(yml)
        for layout in (L("tp", "None"), L("None", "tp"), L("None", "None").with_partial("tp")):
            got = make(layout, x).unfold(0, 3, 1).full_tensor()  # Partial: terms summed after the gather
            assert torch.allclose(got, want, atol=1e-6), (layout, (got - want).abs().max())
        w = torch.nn.Parameter(distribute_tensor(x, L("tp", "None")))
        c = torch.randn(want.shape)
        (w.unfold(0, 3, 1) * distribute_tensor(c, L("None", "None", "None"))).sum().backward()
        ref = x.clone().requires_grad_()
        (ref.unfold(0, 3, 1) * c).sum().backward()
        assert torch.allclose(w.grad.full_tensor(), ref.grad, atol=1e-6)
    return entry


def test_missing_op_advice_is_right_for_split_inputs(dist2, tmp_path):
    entries = dist2.run(_follow_missing_op_advice, str(tmp_path))
    assert entries[0] == "torch.Tensor.unfold: {rule: hyper_parallel.ops.misc.Replicated}"


# ---- checkpoint indexes --------------------------------------------------------------------------------
def _saved(tmp_path):
    path = tmp_path / "ck"
    ckpt.save({"w": torch.arange(12.0).reshape(3, 4), "dtype": torch.bfloat16, "step": 5}, path)
    fresh = lambda: {"w": torch.zeros(3, 4), "dtype": torch.float32, "step": 0}  # noqa: E731
    return path, fresh


def _edit_index(path, edit):
    index = json.loads((path / "index.json").read_text())
    edit(index)
    (path / "index.json").write_text(json.dumps(index))


def _rename_file(index, new):
    (old,) = index["files"]
    index["files"] = {new: index["files"][old]}
    for entry in index["tensors"].values():
        for piece in entry["pieces"]:
            piece["file"] = new


def test_index_names_only_files_inside_its_folder(tmp_path):
    path, fresh = _saved(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(path / "rank00000.safetensors", outside / "x.safetensors")  # a valid file: opening it would load
    ckpt.load(fresh(), path)
    for name in ["../outside/x.safetensors", str(outside / "x.safetensors")]:
        _edit_index(path, lambda ix: _rename_file(ix, name))
        with pytest.raises(CheckpointCorruptError, match=r"files\[.*outside the checkpoint folder"):
            ckpt.load(fresh(), path)
        with pytest.raises(CheckpointCorruptError, match="outside the checkpoint folder"):
            ckpt.read_index(path)
    (path / "link.safetensors").symlink_to(outside / "x.safetensors")
    _edit_index(path, lambda ix: _rename_file(ix, "link.safetensors"))
    with pytest.raises(CheckpointCorruptError, match="is a link to .*outside the checkpoint folder"):
        ckpt.load(fresh(), path)


def test_index_dtypes_must_be_torch_dtypes(tmp_path):
    path, fresh = _saved(tmp_path)
    state = fresh()
    ckpt.load(state, path)
    assert state["dtype"] is torch.bfloat16 and state["step"] == 5
    for bad in ["load", "nn", "Tensor", "__builtins__"]:  # torch attributes that are not dtypes
        _edit_index(path, lambda ix: ix["values"].__setitem__("dtype", {"__dtype__": bad}))
        with pytest.raises(CheckpointCorruptError, match=r"values\['dtype'\].*not a value a checkpoint stores"):
            ckpt.load(fresh(), path)
    _edit_index(path, lambda ix: ix["values"].__setitem__("dtype", {"__dtype__": "float32"}))
    _edit_index(path, lambda ix: ix["tensors"]["w"].__setitem__("dtype", "load"))
    with pytest.raises(CheckpointCorruptError, match=r"tensors\['w'\]\['dtype'\]: must name a torch dtype"):
        ckpt.load(fresh(), path)


@pytest.mark.parametrize("edit, where", [
    (lambda ix: ix.__setitem__("files", list(ix["files"])), r"'files': must be a mapping"),
    (lambda ix: ix.__setitem__("tensors", None), r"'tensors': must be a mapping"),
    (lambda ix: ix.pop("values"), r"'values': must be a mapping"),
    (lambda ix: ix.__setitem__("world_size", "2"), r"'world_size': must be an integer"),
    (lambda ix: ix.__setitem__("version", "1"), r"'version' must be an integer"),
    (lambda ix: ix["files"].__setitem__(next(iter(ix["files"])), 7), r"files\['rank00000.safetensors'\]: must be a "
                                                                      r"mapping with an integer 'bytes'"),
    (lambda ix: ix["tensors"]["w"].pop("pieces"), r"tensors\['w'\]\['pieces'\]: must be a list"),
    (lambda ix: ix["tensors"].__setitem__("w", [1]), r"tensors\['w'\]: must be a mapping"),
    (lambda ix: ix["tensors"]["w"].__setitem__("shape", "3x4"), r"tensors\['w'\]\['shape'\]: must be a list"),
    (lambda ix: ix["tensors"]["w"]["pieces"][0].__setitem__("offsets", ["0", 0]),
     r"tensors\['w'\]\['pieces'\]\[0\]: 'offsets' and 'sizes'"),
    (lambda ix: ix["tensors"]["w"]["pieces"][0].__setitem__("sizes", [9, 4]),
     r"tensors\['w'\]\['pieces'\]\[0\]: 'offsets' and 'sizes' must be 2 non-negative integers inside the shape"),
    (lambda ix: ix["tensors"]["w"]["pieces"][0].__setitem__("file", "other.safetensors"),
     r"\['file'\]: must be one of the index's 'files'"),
    (lambda ix: ix["tensors"]["w"]["pieces"][0].pop("crc32"), r"\['crc32'\]: must be an integer"),
    (lambda ix: ix["values"].__setitem__("step", {"__tuple__": 3}), r"values\['step'\]"),
])
def test_malformed_index_is_a_checkpoint_error_naming_the_entry(tmp_path, edit, where):
    path, fresh = _saved(tmp_path)
    _edit_index(path, edit)
    with pytest.raises(CheckpointError, match=where):
        ckpt.load(fresh(), path)


def test_hf_index_names_only_files_inside_its_folder(tmp_path):
    from safetensors.torch import save_file
    model = torch.nn.Linear(4, 3)
    folder, outside = tmp_path / "hf", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    save_file({k: torch.ones_like(v) for k, v in model.state_dict().items()}, str(outside / "x.safetensors"))
    for name in ["../outside/x.safetensors", str(outside / "x.safetensors")]:
        index = {"metadata": {}, "weight_map": {"weight": name, "bias": name}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointCorruptError, match=r"weight_map\['weight'\]: file .* is outside the checkpoint"):
            ckpt.load_hf(model, folder)
    assert not torch.equal(model.weight, torch.ones_like(model.weight))
    for bad, where in [([1, 2], "'weight_map': must be a mapping"), ({"weight_map": ["a"]}, "'weight_map': must be"),
                       ({"weight_map": {"weight": 3}}, r"weight_map\['weight'\]: a file name must be a non-empty")]:
        (folder / "model.safetensors.index.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointCorruptError, match=where):
            ckpt.load_hf(model, folder)
    # a name inside the folder still loads (Hugging Face cache snapshots are links into ../../blobs: allowed)
    (folder / "model-00001.safetensors").symlink_to(outside / "x.safetensors")
    index = {"weight_map": {"weight": "model-00001.safetensors", "bias": "model-00001.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt.load_hf(model, folder)
    assert torch.equal(model.weight, torch.ones_like(model.weight))


# ---- hsdp arguments ---------------------------------------------------------------------------------------
def _bad_hsdp_arguments(rank, world):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    cases = [({"threshold": -1}, "threshold=-1 must be a size in KB >= 0"),
             ({"threshold": float("nan")}, "threshold=nan"),
             ({"threshold": "64"}, "threshold='64'"),
             ({"bucket_size": -2}, r"bucket_size=-2 must be a size in KB >= 0, or -1"),
             ({"optimizer_level": "level0"}, r"unknown optimizer_level 'level0'; use one of \['level1', 'level2'"),
             ({"shard_size": 0}, "shard_size=0 must be -1"),
             ({"shard_size": 3}, "shard_size=3 must be -1 or a positive divisor of the data-parallel size 2"),
             ({"shard_size": 1.5}, "shard_size=1.5"),
             ({"grad_scale": float("inf")}, "grad_scale=inf must be a finite number")]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            hp.hsdp(model, **kwargs)
        assert not hasattr(model, "_hsdp_state"), kwargs  # refused before anything was changed
    hp.hsdp(model, threshold=0, bucket_size=0)
    return True


def test_hsdp_refuses_invalid_arguments(dist2):
    dist2.run(_bad_hsdp_arguments)


# ---- properties: any edit of an index or a rule file is loaded, or refused with the library's own error ----
def _json_values():
    from hypothesis import strategies as st
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-3, 20),
                       st.sampled_from(["", "..", "../x.safetensors", "/etc/passwd", "float32", "load",
                                        "rank00000.safetensors", "__tuple__", "w@0,0"]))
    keys = st.sampled_from(["files", "tensors", "values", "pieces", "dtype", "shape", "__dtype__", "__tuple__",
                            "bytes", "file", "w"])
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(keys, inner, max_size=3)), max_leaves=6)


def _nodes(obj, path=()):
    yield path
    children = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in children:
        yield from _nodes(v, path + (k,))


def test_property_edited_index_loads_or_raises_checkpoint_error(tmp_path):
    from hypothesis import HealthCheck, given, settings, strategies as st
    path, fresh = _saved(tmp_path)
    original = json.loads((path / "index.json").read_text())
    paths = list(_nodes(original))[1:]

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    @given(st.sampled_from(paths), _json_values())
    def check(where, value):
        index = json.loads(json.dumps(original))
        node = index
        for k in where[:-1]:
            node = node[k]
        node[where[-1]] = value
        (path / "index.json").write_text(json.dumps(index))
        try:
            ckpt.load(fresh(), path)
        except CheckpointError:
            pass

    check()


def test_property_any_rule_file_loads_or_raises_rule_file_error(tmp_path):
    """Random YAML structures and rule names: a Rule instance is registered, or RuleFileError; nothing runs."""
    import yaml
    from hypothesis import HealthCheck, given, settings, strategies as st
    marker = tmp_path / "ran"
    specs = st.sampled_from(["os.system", "builtins.exec", "subprocess.Popen", "hyper_parallel.ops.misc.Replicated",
                             "hyper_parallel.ops.elementwise.Elementwise", "../x.py:R", "x.py:R", "os.path", 5, None])
    entries = st.one_of(st.none(), st.integers(), st.lists(st.integers(), max_size=2), st.fixed_dictionaries(
        {"rule": specs}, optional={"linear": st.sampled_from(["add", 1, None]), "accumulate": st.booleans(),
                                   "cmd": st.just(f"touch {marker}")}))
    files = st.one_of(st.dictionaries(st.sampled_from([OP, f"touch {marker}", "__default__", 1]), entries, max_size=3),
                      st.lists(st.integers(), max_size=2), st.text(max_size=5))

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    @given(files)
    def check(data):
        yml = _rules(tmp_path / "r", yaml.safe_dump(data))
        try:
            names = hp.register_ops(yml)
        except RuleFileError:
            names = []
        try:
            for name in names:
                assert isinstance(registry.RULES[name], registry._rule_base())
        finally:
            for name in names:
                registry.unregister(name)
        assert not marker.exists()

    check()
