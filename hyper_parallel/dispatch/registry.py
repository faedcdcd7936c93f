"""YAML rule files -> rule objects, looked up by the op's qualified name."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import sys
import traceback
import types
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
    if name is None and isinstance(func, torch._ops.HigherOrderOperator):  # an instance: no __qualname__
        name = f"torch.ops.higher_order.{func.name()}"
    if name is None:
        owner = getattr(func, "__self__", None)
        name = f"{getattr(func, '__module__', None) or type(owner).__module__}.{getattr(func, '__qualname__', repr(func))}"
    return name


# ---- rule files are data -------------------------------------------------------------------
# A YAML file can name only a class that subclasses hyper_parallel.ops.base.Rule, found without calling
# anything: `module.Class` in hyper_parallel's own modules or in a module the program has already
# imported itself (a rule file never imports a third-party module: importing runs its code), or
# `file.py:Class` for a Python file inside the registered folder (the user's own rule classes, which
# registering the folder asks to run). Options are the class's public class attributes (their defaults).
_OWN_PACKAGE = __name__.split(".")[0]
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class RuleFileError(ValueError):
    """A YAML rule file is malformed or names something that is not a rule class."""


def _rule_base() -> type:
    from ..ops.base import Rule  # ops sit above dispatch: looked up when a file is loaded, not at import
    return Rule


def _check_rule_class(obj, spec: str, where: str) -> type:
    """`obj` if it is a Rule subclass; decided from its type alone (nothing of `obj` is called)."""
    rule = _rule_base()
    if obj is None:
        raise RuleFileError(f"{where}: rule {spec!r} names no class (nothing of that name is defined there)")
    if not issubclass(type(obj), type) or not issubclass(obj, rule):
        raise RuleFileError(f"{where}: rule {spec!r} is a {type(obj).__name__}, not a subclass of "
                            f"hyper_parallel.ops.base.Rule; a rule file may only name rule classes")
    return obj


def _class_from_file(spec: str, root: Path, where: str) -> type:
    rel, cls = spec.split(":", 1)
    if not _IDENT.match(cls):
        raise RuleFileError(f"{where}: rule {spec!r}: {cls!r} is not a class name")
    rel_path = Path(rel)
    if rel_path.is_absolute() or ".." in rel_path.parts or rel_path.suffix != ".py":
        raise RuleFileError(f"{where}: rule {spec!r}: a rule file must be a relative path to a .py file inside "
                            f"the registered folder {root} (no absolute paths, no '..')")
    path = (root / rel_path).resolve()
    if not path.is_relative_to(root.resolve()) or not path.is_file():
        raise RuleFileError(f"{where}: rule {spec!r}: {root / rel_path} is not a file inside the registered folder "
                            f"{root} (symbolic links out of it are refused)")
    mod_name = f"hyper_parallel_user_rules.{path.stem}_{abs(hash(str(path)))}"
    module = sys.modules.get(mod_name)
    if module is None:
        loader = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[mod_name] = module
        try:
            loader.loader.exec_module(module)
        except BaseException:
            del sys.modules[mod_name]
            raise
    return _check_rule_class(vars(module).get(cls), spec, where)


def _class_from_module(spec: str, where: str) -> type:
    module_name, _, cls = spec.rpartition(".")
    if not module_name or not all(_IDENT.match(part) for part in spec.split(".")):
        raise RuleFileError(f"{where}: rule {spec!r} is not 'package.module.Class' or 'file.py:Class'")
    module = sys.modules.get(module_name)
    if module is None:
        if module_name.split(".")[0] != _OWN_PACKAGE:
            raise RuleFileError(f"{where}: rule {spec!r}: module {module_name!r} is not imported, and a rule file "
                                f"does not import modules (importing runs code); import it in your program before "
                                f"register_ops, or put the class in a .py file beside the YAML and name it "
                                f"'file.py:{cls}'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise RuleFileError(f"{where}: rule {spec!r}: {e}") from None
    if not issubclass(type(module), types.ModuleType):
        raise RuleFileError(f"{where}: rule {spec!r}: sys.modules[{module_name!r}] is not a module")
    return _check_rule_class(vars(module).get(cls), spec, where)


def rule_options(cls: type) -> dict:
    """The options a rule class accepts, with their defaults: its public class attributes that hold data
    (declared like `linear = None`), over the class and its bases up to Rule's own."""
    out: dict = {}
    for klass in reversed(cls.__mro__):
        for key, value in vars(klass).items():
            if key.startswith("_") or callable(value) or isinstance(value, (property, staticmethod, classmethod)):
                continue
            out[key] = value
    return out


def _check_options(cls: type, options: dict, where: str) -> None:
    accepted = rule_options(cls)
    for key, value in options.items():
        if not isinstance(key, str) or key not in accepted:
            raise RuleFileError(f"{where}: unknown option {key!r} for {cls.__module__}.{cls.__qualname__}; it "
                                f"accepts {sorted(accepted) or 'no options'} (a rule class declares its options as "
                                f"class attributes holding their defaults)")
        default = accepted[key]
        if isinstance(default, bool) and not isinstance(value, bool):
            raise RuleFileError(f"{where}: option {key!r} must be true or false, got {value!r}")


def _load_class(spec, root: Path, where: str) -> type:
    if not isinstance(spec, str):
        raise RuleFileError(f"{where}: rule must be a string naming a rule class, got {spec!r}")
    if ":" in spec:  # file.py:Class, inside the registered folder
        return _class_from_file(spec, root, where)
    return _class_from_module(spec, where)


def _string_mapping(value, where: str, what: str, keys: str) -> dict:
    """`value` as a dict with string keys (None: empty), or a RuleFileError naming `where`."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RuleFileError(f"{where}: {what}, got {type(value).__name__} {value!r:.100}")
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise RuleFileError(f"{where}: {keys} must be strings, got {bad!r}")
    return dict(value)


def _entry(value, where: str) -> dict:
    return _string_mapping(value, where, "an entry must be a mapping of options (e.g. {rule: package.module.Class}) "
                                         "or empty", "option names")


def _read_rule_file(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RuleFileError(f"{path}: not valid YAML: {e}") from None
    return _string_mapping(data, str(path), "a rule file must be a mapping from op names to entries", "op names")


def load_yaml(path: str | os.PathLike, root: str | os.PathLike | None = None) -> list[str]:
    """Register every op in one YAML file; returns the op names. A name declared twice is an error.

    `root`: the registered folder that `file.py:Class` rule paths must stay inside (default: the file's own
    folder). The whole file is checked before any op is registered, so a bad entry registers nothing."""
    path = Path(path)
    root = Path(root) if root is not None else path.parent
    data = _read_rule_file(path)
    default = _entry(data.pop("__default__", None), f"{path}: __default__")
    loaded = []
    pending = {}
    for name, entry in data.items():
        where = f"{path}: entry {name!r}"
        options = dict(default)
        options.update(_entry(entry, where))
        spec = options.pop("rule", None)
        if spec is None:
            raise RuleFileError(f"{where} has no rule and the file has no __default__ rule")
        if name in RULES or name in pending:
            other = _SOURCES.get(name, path)
            raise ValueError(f"op {name!r} is declared twice: in {other} and in {path}")
        cls = _load_class(spec, root, where)
        _check_options(cls, options, where)
        pending[name] = (cls, options)
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
    """Load extra rule files: a YAML file, or every *.yaml in a folder (rule classes may live beside them).

    Rule files are data: an entry names a subclass of hyper_parallel.ops.base.Rule, either
    `package.module.Class` (hyper_parallel's own modules, or a module your program already imported) or
    `file.py:Class` (a Python file inside the registered folder, which is run to define the class)."""
    path = Path(path)
    if path.is_dir():
        names = []
        for f in sorted(path.glob("*.yaml")) + sorted(path.glob("*.yml")):
            names += load_yaml(f, root=path)
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


GATHER_RULE = "hyper_parallel.ops.misc.Replicated"  # right for any layout: gather, run locally, replicate


def missing_op_error(name: str, layouts: str) -> MissingOpError:
    """The error for an op without a rule. The rule it suggests is correct whatever the op computes and
    however its inputs are laid out (every input gathered, pending sums resolved, outputs replicated); a
    faster rule that keeps inputs split must know the op, so the message points to how to write one."""
    return MissingOpError(
        f"no distributed rule for {name} (inputs: {layouts}). To run it correctly for any layout, gathering its "
        f"inputs first, add '{name}: {{rule: {GATHER_RULE}}}' to a YAML file loaded with "
        f"hyper_parallel.register_ops(path) or HYPER_PARALLEL_OPS_YAML_DIR (or under hyper_parallel/ops/yaml/). "
        f"A rule that keeps inputs split must match what the op computes (an elementwise rule is wrong for an op "
        f"that mixes positions): see \"Writing a rule\" in docs/architecture.md. "
        f"`hyper-parallel census --model NAME` lists every missing op of a model in one run.")
