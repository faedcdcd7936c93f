"""Generate docs/ops.md from the YAML rule files: every supported op, its rule, what layouts it accepts.

    .venv/bin/python -m hyper_parallel.tools.ops_doc > docs/ops.md
"""
from __future__ import annotations

import inspect
from collections import defaultdict
from pathlib import Path

import hyper_parallel  # noqa: F401  (loads the built-in rules)
from hyper_parallel.dispatch import registry

HEADER = """# Supported ops

Generated from `hyper_parallel/ops/yaml/*.yaml` by `python -m hyper_parallel.tools.ops_doc`; do not edit.
{count} ops have rules. An op's rule decides, from its inputs' layouts, the layouts the inputs are moved to
and the outputs get; the rule's own summary below says which layouts it keeps without communication
(anything else is redistributed to a layout it accepts, or is refused with an error naming the op).

## Adding an op
1. Find what is missing: `hyper-parallel census --model NAME` (or `--model-path DIR`) lists every op a
   model calls that has no rule, with the line of model code that called it.
2. If a family's rule fits, add one YAML line: `torch.Tensor.foo:` under that family's file (its
   `__default__` rule applies) or `torch.Tensor.foo: {{rule: hyper_parallel.ops.family.Rule, option: value}}`.
   Names are `torch.overrides.resolve_name(func)`.
3. Otherwise write a rule class (see `docs/architecture.md`; most are a `SignatureRule` listing
   single-mesh-axis signatures) and point the YAML entry at it. Your own files load with
   `hyper_parallel.register_ops(path)` or `HYPER_PARALLEL_OPS_YAML_DIR`.
"""


def _summary(cls) -> str:
    doc = inspect.getdoc(cls) or ""
    return " ".join(doc.split("\n\n")[0].split())


def render() -> str:
    by_file = defaultdict(list)
    for name, rule in registry.RULES.items():
        by_file[Path(registry._SOURCES[name]).name].append((name, rule))
    out = [HEADER.format(count=len(registry.RULES))]
    for fname in sorted(by_file):
        out.append(f"\n## {fname}\n")
        rules = defaultdict(list)
        for name, rule in sorted(by_file[fname]):
            rules[type(rule)].append((name, rule))
        for cls, entries in rules.items():
            out.append(f"\n### `{cls.__module__}.{cls.__name__}`\n\n{_summary(cls)}\n\n| op | options |\n|---|---|")
            for name, rule in entries:
                opts = ", ".join(f"{k}={v!r}" for k, v in sorted(rule.options.items()))
                out.append(f"| `{name}` | {opts} |")
        out.append("")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
