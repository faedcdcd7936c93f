"""YAML rule files -> rule objects, looked up by the op's qualified name."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch
import yaml

_BUILTIN_DIR = Path(__file__).resolve().parent.parent / "ops" / "yaml"
RULES: dict = {}        # qualified op name -> rule object
_SOURCES: dict = {}     # qualified op name -> yaml file that declared it
_RECORDERS: list = []


class MissingOpError(NotImplementedError):
    """An op reached a DTensor and no rule says how to run it distributed."""


def op_name(func) -> str:
    name = torch.overrides.resolve_name(func)
    if name is None and getattr(torch, getattr(func, "__name__", ""), None) is func:
        name = f"torch.{func.__name__}"  # torch._foreach_add_, torch._grouped_mm: builtins resolve_name skips
    if name is None:
        owner = getattr(func, "__self__", None)
        name = f"{getattr(func, '__module__', None) or type(owner).__module__}.{getattr(func, '__qualname__', repr(func))}"
    return name


def _load_class(spec: str, base: Path):
    if ":" in spec:  # file.py:Class, relative to the yaml file
        path, cls = spec.split(":", 1)
        path = (base / path).resolve()
        mod_name = f"hyper_parallel_user_rules.{path.stem}_{abs(hash(str(path)))}"
        module = sys.modules.get(mod_name)
        if module is None:
            loader = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[mod_name] = module
            loader.loader.exec_module(module)
        return getattr(module, cls)
    module, _, cls = spec.rpartition(".")
    return getattr(importlib.import_module(module), cls)


def load_yaml(path: str | os.PathLike) -> list[str]:
    """Register every op in one YAML file; returns the op names. A name declared twice is an error."""
    path = Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    default = dict(data.pop("__default__", None) or {})
    loaded = []
    pending = {}
    for name, entry in data.items():
        options = dict(default)
        options.update(entry or {})
        spec = options.pop("rule", None)
        if spec is None:
            raise ValueError(f"{path}: op {name!r} has no rule and the file has no __default__ rule")
        if name in RULES or name in pending:
            other = _SOURCES.get(name, path)
            raise ValueError(f"op {name!r} is declared twice: in {other} and in {path}")
        pending[name] = (_load_class(spec, path.parent), options)
    for name, (cls, options) in pending.items():
        RULES[name] = cls(name, **options)
        _SOURCES[name] = path
        loaded.append(name)
    from .dispatcher import clear_caches
    clear_caches()
    return loaded


def unregister(name: str) -> None:
    """Forget one op's rule (tests, or replacing a built-in rule with register_ops)."""
    RULES.pop(name, None)
    _SOURCES.pop(name, None)
    from .dispatcher import clear_caches
    clear_caches()


def register_ops(path: str | os.PathLike) -> list[str]:
    """Load extra rule files: a YAML file, or every *.yaml in a folder (rule classes may live beside them)."""
    path = Path(path)
    if path.is_dir():
        names = []
        for f in sorted(path.glob("*.yaml")) + sorted(path.glob("*.yml")):
            names += load_yaml(f)
        return names
    if not path.exists():
        raise FileNotFoundError(f"register_ops: no such file or folder {path}")
    return load_yaml(path)


def load_builtin_rules() -> None:
    for f in sorted(_BUILTIN_DIR.glob("*.yaml")):
        load_yaml(f)
    for extra in filter(None, os.environ.get("HYPER_PARALLEL_OPS_YAML_DIR", "").split(os.pathsep)):
        register_ops(extra)


# ---- the census ------------------------------------------------------------------------------
class MissingOpRecord:
    """Ops without rules seen inside `record_missing_ops()`, with call counts and where they were called."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.locations: dict = {}
        self.seen: Counter = Counter()  # every op that reached the dispatcher, with or without a rule

    def missing(self) -> list[str]:
        return sorted(self.counts)

    def __repr__(self):
        return f"MissingOpRecord({dict(self.counts)})"


@contextlib.contextmanager
def record_missing_ops():
    from .dispatcher import python_path_only  # the fast path does not note ops
    record = MissingOpRecord()
    _RECORDERS.append(record)
    try:
        with python_path_only():
            yield record
    finally:
        _RECORDERS.remove(record)


def recording() -> bool:
    return bool(_RECORDERS)


def note_op(name: str, missing: bool) -> None:
    for r in _RECORDERS:
        r.seen[name] += 1
        if missing:
            r.counts[name] += 1
            if name not in r.locations:
                r.locations[name] = caller_location()


def caller_location() -> str:
    """The innermost frame outside torch and hyper_parallel: where the model called the op."""
    here = str(Path(__file__).resolve().parent.parent)
    torch_dir = str(Path(torch.__file__).resolve().parent)
    for frame in reversed(traceback.extract_stack()[:-2]):
        f = frame.filename
        if not f.startswith(here) and not f.startswith(torch_dir) and "contextlib" not in f and not f.startswith("<"):
            return f"{f}:{frame.lineno} ({frame.name})"
    return "?"


def missing_op_error(name: str, layouts: str) -> MissingOpError:
    return MissingOpError(
        f"no distributed rule for {name} (inputs: {layouts}). Add it to a YAML file under "
        f"hyper_parallel/ops/yaml/ (or your own file loaded with hyper_parallel.register_ops(path) or "
        f"HYPER_PARALLEL_OPS_YAML_DIR), mapping '{name}' to a rule class, e.g. "
        f"'{name}: {{rule: hyper_parallel.ops.elementwise.Elementwise}}'. "
        f"`hyper-parallel census --model NAME` lists every missing op of a model in one run.")
