"""Sharding plans: what the user writes, and what it resolves to on one model.

Three forms are accepted and all resolve to the same `Resolved` (parameter layouts by full parameter
name, input/output rules by module name, expert modules):

- `ShardingPlan(plan=..., input_plan=..., output_plan=..., return_local_tensor=...)`, with specs as
  alias tuples (one entry per tensor dim), Placement tuples (one per mesh axis) or tensor Layouts;
- a Hugging Face style dict, module (or parameter) path -> style name (`STYLES` below);
- `"auto"`: the model's own `tp_plan` (config.base_model_tp_plan under the base model's prefix,
  plus the head's `_tp_plan`).

Paths match atom by atom (split on "."), each atom with shell wildcards (`*` is one atom, e.g. a
layer number). A user entry that matches nothing is an error naming it; entries of an "auto" plan
may match nothing (a MoE model's plan names its dense MLPs too).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Callable, Mapping, Sequence

from torch import nn

from ...layout.layout import Layout, PlacementLayout
from ...layout.mesh import DeviceMesh
from ...layout.placement import Placement, Shard, REPLICATE
from ..dims import TP


@dataclass
class ShardingPlan:
    """Parameter, module-input and module-output layouts by path.

    plan: parameter path (wildcards allowed) -> spec, e.g. `{"model.layers.*.mlp.up_proj.weight": ("tp", "None")}`;
        a value may also be a Hugging Face style name (then the key may name a module).
    input_plan: module path -> spec of its input(s). `"input"` (or `"<path>.input"`) names the root
        module (or `<path>`). A spec is one layout (first tensor input), a list (positional inputs,
        None = leave), or a dict (keyword inputs by name, positions by int).
    output_plan: the same for outputs (`"output"`, `"<path>.output"`); a dict names fields of a
        dict-like output (e.g. `{"logits": ("None", "None", "tp")}`).
    return_local_tensor: module paths whose (DTensor) outputs are handed on as local tensors.
    """

    plan: Mapping[str, Any] | None = None
    input_plan: Mapping[str, Any] | None = None
    output_plan: Mapping[str, Any] | None = None
    return_local_tensor: Sequence[str] | str | None = None


# ---- specs -> layouts ----------------------------------------------------------------------------
LayoutFn = Callable[[int], Layout]


def _spec_to_layout_fn(spec: Any, mesh: DeviceMesh, where: str) -> LayoutFn:
    if isinstance(spec, Layout):
        if spec.tensor_map is None:
            raise ValueError(f"{where}: {spec} is a device matrix; call it with one entry per tensor dim")
        if spec.mesh is not mesh:
            raise ValueError(f"{where}: layout {spec} lives on mesh {spec.mesh}, but shard uses {mesh}")
        return lambda ndim: spec.for_ndim(ndim, f"tensor at {where}")
    if isinstance(spec, PlacementLayout):
        if spec.mesh is not mesh:
            raise ValueError(f"{where}: layout {spec} lives on mesh {spec.mesh}, but shard uses {mesh}")
        return lambda ndim: spec.for_ndim(ndim, f"tensor at {where}")
    if isinstance(spec, Placement):
        spec = (spec,)
    if not isinstance(spec, (tuple, list)):
        raise TypeError(f"{where}: a layout spec is an alias tuple like ('tp', 'None'), a Placement tuple like "
                        f"(Shard(0),) or a Layout, got {spec!r}")
    spec = tuple(spec)
    if spec and all(isinstance(p, Placement) for p in spec):
        if len(spec) != mesh.ndim:
            raise ValueError(f"{where}: {len(spec)} placements {spec} for a mesh with {mesh.ndim} axes "
                             f"{mesh.mesh_dim_names}: give one per mesh axis")
        return lambda ndim: Layout.from_placements(mesh, spec, ndim)
    try:
        layout = Layout(mesh)(*spec)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None

    def fn(ndim: int) -> Layout:
        if ndim != len(spec):
            raise ValueError(f"{where}: layout {spec} has {len(spec)} entries but the tensor has {ndim} dims: "
                             f"give one entry per tensor dim")
        return layout
    return fn


def spec_to_layout_fn(spec: Any, mesh: DeviceMesh, where: str) -> LayoutFn:
    """A function of the tensor's rank giving its Layout; aliases are checked now, the rank at use."""
    return _memo(_spec_to_layout_fn(spec, mesh, where))


def tp_size(mesh: DeviceMesh) -> int:
    """Ranks of the tensor-parallel axis: the whole of a 1-D mesh, else the axis named "tp"."""
    return mesh.size() if mesh.ndim == 1 else mesh.size(TP)


def placement_fn(placement: Placement, mesh: DeviceMesh) -> LayoutFn:
    """Layouts for one placement on the tensor-parallel axis: a 1-D mesh, or the "tp" axis of a mesh with
    more axes (e.g. ("cp", "tp")), replicated on the others, so that expert and context parallelism find
    every parameter on the one mesh they are given. The result carries `tp_axis` and `placement`: module
    boundaries then move only the tp axis of a DTensor input and keep its other axes (a sequence split
    over "cp" stays split)."""
    if mesh.ndim == 1:
        return _memo(lambda ndim: Layout.from_placements(mesh, (placement,), ndim))
    tp_axis = mesh.axis_index(TP)
    placements = tuple(placement if a == tp_axis else REPLICATE for a in range(mesh.ndim))
    fn = _memo(lambda ndim: Layout.from_placements(mesh, placements, ndim))
    fn.tp_axis, fn.placement = tp_axis, placement
    return fn


def _memo(fn: LayoutFn) -> LayoutFn:
    """Hooks ask for a layout on every call: remember it per tensor rank."""
    cache: dict = {}

    def get(ndim: int) -> Layout:
        layout = cache.get(ndim)
        if layout is None:
            layout = cache[ndim] = fn(ndim)
        return layout
    return get


# ---- path matching -------------------------------------------------------------------------------
def path_matches(pattern: str, name: str) -> bool:
    pat, parts = pattern.split("."), name.split(".")
    return len(pat) == len(parts) and all(fnmatchcase(n, p) for n, p in zip(parts, pat))


def find(pattern: str, names) -> list[str]:
    if "*" not in pattern and "?" not in pattern and "[" not in pattern:
        return [pattern] if pattern in names else []
    return [n for n in names if path_matches(pattern, n)]


# ---- Hugging Face styles -------------------------------------------------------------------------
def _col(ndim: int) -> Placement:      # Linear weight [out, in], experts [E, out, in], bias [out]
    return Shard(ndim - 2) if ndim >= 2 else Shard(0)


def _row(ndim: int) -> Placement:      # weight split on its input dim; the bias is added after the reduce
    return Shard(ndim - 1) if ndim >= 2 else REPLICATE


def _rep(ndim: int) -> Placement:
    return REPLICATE


def _dim0(ndim: int) -> Placement:
    return Shard(0)


def _dim1(ndim: int) -> Placement:
    return Shard(1) if ndim >= 2 else REPLICATE


@dataclass(frozen=True)
class Style:
    """One Hugging Face style as DTensor layouts on the tp axis.

    `param` gives a parameter's placement from its rank; `inp`/`out` are the placements the module's
    first input / its output are moved to (None: untouched). A Replicate output is handed on as a plain
    tensor, as transformers does (`use_local_output`): it is the full value, so nothing is lost, and the
    code after it (sampling in generate, the loss) runs on plain tensors. `experts`: a MoE experts
    module whose experts are split over the axis and run locally (see api.py), where `_not_local` allows.
    `heads`: check that an attention projection splits whole heads. `identity`: the identity
    (zero-compute) expert inside an experts module, which keeps that module off the local run.
    """

    param: Callable[[int], Placement]
    inp: Placement | None = None
    out: Placement | None = None
    experts: bool = False
    heads: bool = False
    identity: bool = False


_R, _S_LAST = REPLICATE, Shard(-1)
STYLES: dict[str, Style] = {
    "colwise": Style(_col, inp=_R, out=_S_LAST, heads=True),
    "colwise_rep": Style(_col, inp=_R, out=_R),
    "colwise_gather_output": Style(_col, inp=_R, out=_R),
    "rowwise": Style(_row, inp=_S_LAST, out=_R, heads=True),
    "rowwise_rep": Style(_row, inp=_S_LAST, out=_R, heads=True),
    "rowwise_split_input": Style(_row, inp=_S_LAST, out=_R, heads=True),
    "embedding_rowwise": Style(_dim0, inp=_R, out=_R),
    "embedding_colwise": Style(_dim1, inp=_R, out=_R),
    # Packed [gate; up] weights split plainly on the output dim: the model's later chunk(2) then sees a
    # split dim and its rule moves data (correct, one extra collective). Inside an experts module the
    # experts style decides (whole experts per rank), so no packing issue arises there.
    "packed_colwise": Style(_col, inp=_R),
    "packed_rowwise": Style(_row),
    "sequence_parallel": Style(_rep, inp=Shard(1)),
    "replicated_with_grad_allreduce": Style(_rep),   # gradients of replicated DTensors are already summed
    "replicate": Style(_rep),
    "local_params": Style(_rep),
    "mla_kv_a_proj": Style(_rep),                    # DTensor tracks the rope part's gradient itself
    "all_reduce": Style(_rep, out=_R),
    "moe_tp_experts": Style(_dim0, experts=True),
    "ep_dispatch_experts": Style(_dim0, experts=True),
    "grouped_gemm": Style(_dim0),
    # transformers divides the identity expert's input by the tp size, since its moe_tp_experts sums every
    # rank's local output; on DTensors the experts module runs on the full values and the identity expert
    # passes on its input once, so no scaling: the style only keeps its experts module off the local run
    "moe_identity_expert": Style(_rep, identity=True),
}


# ---- the resolved plan -----------------------------------------------------------------------------
@dataclass
class Boundary:
    """How to move a module's inputs or outputs: `first` applies to the first tensor, `positional` by index,
    `named` by keyword / field name. `local` hands DTensor results on as local tensors."""

    first: LayoutFn | None = None
    positional: dict = field(default_factory=dict)
    named: dict = field(default_factory=dict)
    local: bool = False
    local_if_replicated: bool = False


@dataclass
class Resolved:
    mesh: DeviceMesh
    params: dict = field(default_factory=dict)        # full param name -> LayoutFn
    sources: dict = field(default_factory=dict)       # full param name -> plan entry (for messages)
    inputs: dict = field(default_factory=dict)        # module name -> Boundary
    outputs: dict = field(default_factory=dict)       # module name -> Boundary
    experts: set = field(default_factory=set)         # module names
    head_checks: list = field(default_factory=list)   # (module, param, dim, parts): must split whole heads
    notes: list = field(default_factory=list)         # what was laid out otherwise than the plan says, and why


def _split_spec(spec, mesh, where) -> Boundary:
    b = Boundary()
    if isinstance(spec, list):
        for i, s in enumerate(spec):
            if s is not None:
                b.positional[i] = spec_to_layout_fn(s, mesh, f"{where}[{i}]")
    elif isinstance(spec, dict):
        for k, s in spec.items():
            if s is None:
                continue
            fn = spec_to_layout_fn(s, mesh, f"{where}[{k!r}]")
            (b.positional if isinstance(k, int) else b.named)[k] = fn
    else:
        b.first = spec_to_layout_fn(spec, mesh, where)
    return b


def _module_key(key: str, suffix: str) -> str:
    if key == suffix:
        return ""
    if key.endswith("." + suffix):
        return key[: -len(suffix) - 1]
    return key


def resolve_sharding_plan(model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh, tp_mesh) -> Resolved:
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    res = Resolved(mesh)
    styled = {}
    for key, spec in (plan.plan or {}).items():
        if isinstance(spec, str):
            styled[key] = spec
            continue
        names = find(key, params)
        if not names:
            raise ValueError(f"ShardingPlan entry {key!r} matches no parameter of {type(model).__name__} "
                             f"(e.g. {_examples(params)})")
        fn = spec_to_layout_fn(spec, mesh, f"plan[{key!r}]")
        for n in names:
            res.params[n] = fn
            res.sources[n] = key
            layout = fn(params[n].ndim)
            res.head_checks += [(n.rpartition(".")[0], n, d, layout.shard_count(d)) for d in range(params[n].ndim)
                                if layout.shard_count(d) > 1]
    if styled:
        if tp_mesh is None:
            raise ValueError(f"style entries {sorted(styled)} need a mesh axis named 'tp'; the mesh has "
                             f"{mesh.mesh_dim_names}")
        if tp_mesh is not mesh and res.params:
            raise ValueError(f"a ShardingPlan on the {mesh.ndim}-D mesh {mesh.mesh_dim_names} mixes style entries "
                             f"{sorted(styled)} (laid out on its 'tp' axis) with layout specs (on the whole mesh): "
                             f"use one kind, or give styles' layouts as specs")
        _apply_styles(model, styled, tp_mesh, res, strict=True, modules=modules, params=params)
    for key, spec in (plan.input_plan or {}).items():
        mod = _module_key(key, "input")
        for m in _find_modules(mod, modules, key, model):
            res.inputs[m] = _split_spec(spec, mesh, f"input_plan[{key!r}]")
    for key, spec in (plan.output_plan or {}).items():
        mod = _module_key(key, "output")
        for m in _find_modules(mod, modules, key, model):
            res.outputs[m] = _split_spec(spec, mesh, f"output_plan[{key!r}]")
    local = plan.return_local_tensor or []
    if isinstance(local, str):
        local = [local]
    for key in local:
        mod = _module_key(key, "output")
        for m in _find_modules(mod, modules, key, model):
            res.outputs.setdefault(m, Boundary()).local = True
    return res


def _find_modules(pattern, modules, key, model) -> list[str]:
    found = [""] if pattern == "" else find(pattern, modules)
    if not found:
        raise ValueError(f"ShardingPlan entry {key!r} matches no module of {type(model).__name__} "
                         f"(e.g. {_examples(modules)})")
    return found


def _examples(names) -> str:
    shown = [n for n in names if n][:4]
    return ", ".join(repr(n) for n in shown) + (", ..." if len(names) > 4 else "")


def sequence_parallel_plan(base: str = "model", head: str = "lm_head", attn: str = "self_attn",
                           mlp: str = "mlp") -> ShardingPlan:
    """Megatron tensor + sequence parallelism for Llama-style decoders (Llama, Qwen2/3, Mistral, ...).

    Activations between blocks stay split on the sequence dim: row-parallel outputs are
    reduce-scattered onto it, and each block's input is all-gathered once, at the attention / MLP
    module (not at each of q, k, v). Embedding and lm_head are vocabulary-parallel. `base` is the
    decoder's path (e.g. "model.language_model" for Qwen3-VL).
    """
    col, row, rep3, seq3 = ("tp", "None"), ("None", "tp"), ("None", "None", "None"), ("None", "tp", "None")
    layer = f"{base}.layers.*"
    plan = {f"{layer}.{m}.weight": col for m in (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj",
                                                   f"{mlp}.gate_proj", f"{mlp}.up_proj")}
    plan.update({f"{layer}.{attn}.o_proj.weight": row, f"{layer}.{mlp}.down_proj.weight": row,
                 f"{base}.embed_tokens.weight": col, f"{head}.weight": col})
    return ShardingPlan(
        plan=plan,
        input_plan={f"{layer}.{attn}": {"hidden_states": rep3}, f"{layer}.{mlp}": rep3, head: rep3},
        output_plan={f"{layer}.{attn}.o_proj": seq3, f"{layer}.{mlp}.down_proj": seq3,
                     f"{base}.embed_tokens": seq3, head: rep3},
        return_local_tensor=[head])


def auto_plan(model: nn.Module) -> dict:
    """The model's own tensor-parallel plan, with full paths (empty if it declares none)."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not base and hasattr(config, "get_text_config"):
        base = dict(getattr(config.get_text_config(), "base_model_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    out = {}
    if prefix and hasattr(model, prefix):
        out.update({f"{prefix}.{k}": v for k, v in base.items()})
    else:
        out.update(base)
    out.update(getattr(model, "_tp_plan", None) or {})
    return out


def resolve_styles(model: nn.Module, plan: Mapping[str, str], tp_mesh: DeviceMesh, strict: bool) -> Resolved:
    res = Resolved(tp_mesh)
    _apply_styles(model, plan, tp_mesh, res, strict, dict(model.named_modules()),
                  dict(model.named_parameters(remove_duplicate=False)))
    return res


def _apply_styles(model, plan, tp_mesh, res: Resolved, strict: bool, modules, params) -> None:
    prefix = getattr(model, "base_model_prefix", "")
    # experts first: they decide the layout of their own parameters, whatever other entries say
    ordered = sorted(plan.items(), key=lambda kv: not (kv[1] in STYLES and STYLES[kv[1]].experts))
    entries = []
    for key, name in ordered:
        style = STYLES.get(name)
        if style is None:
            raise ValueError(f"unknown tensor-parallel style {name!r} for {key!r}; known styles: "
                             f"{', '.join(sorted(STYLES))}")
        mods = find(key, modules)
        pars = [] if mods else find(key, params)
        if not mods and not pars and prefix:  # a base-model plan given to a model with a head
            mods = find(f"{prefix}.{key}", modules)
            pars = [] if mods else find(f"{prefix}.{key}", params)
        if not mods and not pars:
            if strict:
                raise ValueError(f"plan entry {key!r} ({name}) matches no module or parameter of "
                                 f"{type(model).__name__} (e.g. {_examples(modules)})")
            continue
        entries.append((key, name, style, mods, pars))
    with_identity = {m.rpartition(".")[0] for _, _, style, mods, _ in entries if style.identity for m in mods}
    for key, name, style, mods, pars in entries:
        for p in pars:
            if p.rpartition(".")[0] in res.experts:
                continue
            ndim = params[p].ndim
            res.params[p] = placement_fn(style.param(ndim), tp_mesh)
            res.sources[p] = f"{key}: {name}"
        for m in mods:
            module = modules[m]
            own = list(module.named_parameters(recurse=False))
            if style.experts:
                if not own:
                    raise ValueError(f"{m}: style {name!r} needs an experts module holding the expert weights")
                why = _not_local(m, own, tp_size(tp_mesh), with_identity)
                if why is not None:
                    res.notes.append(f"{m}: run on DTensors, its weights split by their own plan entries ({why})")
                    continue
                res.experts.add(m)
            elif m in res.experts:
                continue
            for pn, p in own:
                full = f"{m}.{pn}" if m else pn
                res.params[full] = placement_fn(style.param(p.ndim), tp_mesh)
                res.sources[full] = f"{key}: {name}"
                if style.heads and pn == "weight":
                    dim = p.ndim - 2 if style.param(p.ndim) == Shard(p.ndim - 2) else p.ndim - 1
                    res.head_checks.append((m, full, dim, tp_size(tp_mesh)))
            if style.inp is not None and not style.experts:
                res.inputs[m] = Boundary(first=placement_fn(style.inp, tp_mesh))
            if style.out is not None:
                res.outputs[m] = Boundary(first=placement_fn(style.out, tp_mesh),
                                          local_if_replicated=style.out == REPLICATE)


def _not_local(m: str, own: list, ranks: int, with_identity: set) -> str | None:
    """Why the experts module `m` (its own weights `own`) cannot run whole experts per rank, locally; None if it can.

    The local run (api.py) splits every weight's first dim as one block of experts per rank and masks the
    routes to other ranks' experts. That needs:
    - one expert count for all weights: LongCat's gate_up_proj also holds rows for its zero-compute experts,
      its down_proj does not, so their blocks would hold different experts;
    - at least one expert per rank: fewer leave ranks idle, and a single expert cannot stay split (its dim
      of one is one row on one rank and none on the others, a split the elementwise rules do not keep:
      `detach` in nn.Parameter already moves it to another dim, inside an expert);
    - no identity expert (`moe_identity_expert`): its routes carry ids past the weights' experts, which the
      masking drops on every rank, and the module tells them apart by counts of its own the local run
      cannot know.
    Otherwise the module's forward runs on DTensors through the op rules, its weights laid out by the plan's
    entries for them (packed_colwise / rowwise split the intermediate dim, as transformers' own tp does) or
    replicated: the identity expert then passes on the full value once, as in one process."""
    counts = {p.shape[0] for _, p in own if p.ndim}
    if len(counts) > 1:
        return f"its weights hold different numbers of experts {sorted(counts)}"
    if counts and min(counts) < ranks:
        return f"{min(counts)} experts < {ranks} ranks"
    if m in with_identity:
        return "it has an identity expert"
    return None


def _heads_in(parent: nn.Module, size: int, head_dim: int) -> int | None:
    """How many heads a projection of `size` outputs (or inputs) holds: whole heads of `head_dim`, or one number
    per head where the size is the attention module's head count (a per-head gate, e.g. Laguna's g_proj)."""
    counts = {getattr(parent, n, None) for n in ("num_heads", "num_attention_heads", "num_key_value_heads")}
    if size in counts:
        return size
    return size // head_dim if size % head_dim == 0 else None


def check_heads(model: nn.Module, res: Resolved, strict: bool = True) -> list[str]:
    """An attention projection must split whole heads (its parent module's `head_dim`): a split inside a
    head would make the model's (B, S, heads, head_dim) view move data on every call, or fail.

    A plan the user wrote (`strict`) is refused with an error naming the projection. The model's own plan
    ("auto") is kept where it splits correctly. Where only the key/value projections do not divide (fewer
    key/value heads than ranks) and the query heads do, k and v are replicated and q / o stay split, as
    Megatron does; an attention module whose query heads do not divide runs replicated, every plan entry
    below it dropped, with a warning. Returns notes on what was replicated and why (for `summary`)."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    uneven: dict = {}   # attention module -> {projection module: message} for those that do not divide
    heads_of: dict = {}  # attention module -> the largest head count among its checked projections
    for m, full, dim, parts in res.head_checks:
        if parts <= 1:
            continue
        owner = m.rpartition(".")[0]
        parent = modules.get(owner)
        head_dim = getattr(parent, "head_dim", None)
        if not isinstance(head_dim, int) or head_dim <= 0:
            continue
        heads = _heads_in(parent, params[full].shape[dim], head_dim)
        if heads is None:
            continue
        heads_of[owner] = max(heads_of.get(owner, 0), heads)
        if heads % parts == 0:
            continue
        msg = (f"{m}: its {heads} heads (head_dim {head_dim}) cannot be split evenly over {parts} ranks "
               f"({full} dim {dim}, plan entry {res.sources.get(full)!r})")
        if strict:
            raise ValueError(f"{msg}; use a tensor-parallel size that divides the numbers of attention and "
                             f"key/value heads")
        uneven.setdefault(owner, {}).setdefault(m, (heads, parts, msg))
    notes, whole = [], {}
    for owner, projections in uneven.items():
        most = heads_of[owner]
        if all(h < most for h, _, _ in projections.values()) and most % next(iter(projections.values()))[1] == 0:
            for m in projections:      # the key/value projections only: replicated, q and o stay split
                replicate_below(res, m)
            h, parts, _ = next(iter(projections.values()))
            notes.append(f"{owner}: {'/'.join(p.rpartition('.')[2] for p in projections)} replicated "
                         f"({h} key/value heads < {parts} ranks; query heads split)")
        else:
            whole[owner] = next(iter(projections.values()))[2]
            replicate_below(res, owner)
            notes.append(f"{owner}: attention replicated ({whole[owner]})")
    if whole:
        names = list(whole)
        warnings.warn(f"shard(plan='auto'): {len(names)} attention module(s) run replicated on every rank "
                      f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}), their heads not dividing over "
                      f"the tensor-parallel ranks: {next(iter(whole.values()))}", stacklevel=4)
    return notes


def replicate_below(res: Resolved, owner: str) -> None:
    """Drop every plan entry for `owner` and the parameters and modules below it: they stay replicated,
    unmoved (attention whose heads do not divide; experts that expert parallelism owns)."""
    below = owner + "." if owner else ""

    def inside(name: str) -> bool:
        return name == owner or name.startswith(below)

    for table in (res.params, res.sources, res.inputs, res.outputs):
        for key in [k for k in table if inside(k)]:
            del table[key]
    res.experts = {m for m in res.experts if not inside(m)}
    res.head_checks = [c for c in res.head_checks if not inside(c[0])]


__all__ = ["ShardingPlan", "STYLES", "sequence_parallel_plan", "Style", "Resolved", "Boundary", "auto_plan",
           "resolve_styles", "resolve_sharding_plan", "spec_to_layout_fn", "check_heads", "path_matches", "tp_size",
           "replicate_below"]
