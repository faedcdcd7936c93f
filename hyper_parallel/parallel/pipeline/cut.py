"""Cutting a Hugging Face model with a decoder into pipeline stages that run the model's own code.

Found by structure, not by class name (`find_structure`): the decoder stack is `model.get_decoder()` (the
language model of a multimodal model; the base model where it names the head), its decoder layers the
nn.ModuleList of blocks its forward names, the longest of one class where it names several or none (a list
inside a tower under it is not the decoder's). Walking from the root down to the module holding that list, every other child goes to
the first stage or the last by where the module holding it names it in its forward (`_self_references`):
before the list (or, above the holder, before the last call of the module on the path) to the first,
after it to the last. A child the forward does not name goes by registration order: in the holder, what
is registered before the list (embeddings) to the first, what after it (the final norm) to the last; in
the modules between (a multimodal model) the towers and projectors to the first; at the root, the output
head and what follows the base model to the last.
Modules without parameters (rotary embeddings) stay on every stage.

A stage is a *view* of the model: shallow copies of the modules on that path and of the layer list, in
which every module the stage does not run is None, so parameters keep the model's own names
(`model.language_model.layers.5.mlp.up_proj.weight`) and `shard` plans, `hsdp` and checkpoints address it
as they address the whole model. The view's forward *is the model's own forward*, with three cuts:
- the first stage runs it from the inputs (towers, embeddings, 3-D rotary positions, ...) until the
  input of the next stage's first layer, where a stand-in layer stops it (`_Exit`);
- a later stage runs it from `inputs_embeds` (a placeholder) through stand-in layers that pass their
  input on (`_Skip`), and its first own layer takes the hidden state received from the previous stage
  instead (a one-shot pre-hook); masks and rotary embeddings are the model's own, recomputed per stage;
- the last stage runs on through the final norm and the head; its result is the logits.
What the first stage computed before the decoder stack and handed to it (3-D position ids, Qwen3-VL's
deepstack visual features and their positions, ...) is captured there (a pre-hook on the decoder stack)
and carried along the pipeline with the hidden state (`CarrySpec`), as (batch, sequence, ...) tensors, so
each stage hands the decoder stack what one device would; the inputs every stage receives (the padding
mask, position ids given by the caller) need no carrying. So is what the decoder *loop* hands the next
stage's first layer besides the hidden state, per token (`CarrySpec.layer_entries`: Zamba's clone of the
embeddings, Zaya's router states, Inkling2's block stack, Gemma-style per-layer slices as their whole
tensor): the later stage copies it into the tensor its own loop holds there (`_take_carried`), so its
later layers get the real values too. Besides per-token tensors, what an earlier stage's layers leave for a
later stage's crosses the cut the same way: the K/V that "store" layers put in the dict the loop hands every
layer, for the "reuse" layers after them (Gemma 3n/4's `shared_kv_states`), integer states (HY-V4's shared
DSA top-k indices), a tuple a first-stage module computed before the loop (Mistral-Large-4's rotary (cos,
sin), which has a trained parameter); gradients flow back through all of them. Each cut carries what crosses
it (`CarrySpec.later_entries`: the dict's keys grow as store layers run). The probe's second run on random
placeholders refuses a stage whose layers still get something computed from them (`placeholder_problem`).
A later stage's forward is called with what it cannot be called without (BLIP-2's pixel_values and input_ids:
the caller's own inputs) and the caller's per-token ids, types and flags (`_token_input`), in the model's
train/eval mode; the towers it calls there whatever its inputs are stand-ins giving placeholders in the form
their output had on the first stage (`_AbsentTower`, `CarrySpec.part_forms`), and the first stage's modules
it reads show their parameters as zeros (`_Absent`, `Structure.part_tensors`).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from ...dtensor.dtensor import DTensor
from ..feed import feed_of, named_inputs, positional_names
from ..surgery import embeddings
from .tie import tied_names


# ---- the structure ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Structure:
    """Where a model keeps its decoder layers and which of its other modules go to the first/last stage.

    holders: module paths from the root ("") down to the module holding the layer list; decoder: the path
    of the decoder stack (`get_decoder()`, whose forward pre-hook captures what later stages need);
    first/last: module paths of the parts of the first and the last stage."""
    holders: tuple
    layers_name: str
    n_layers: int
    decoder: str
    first: tuple
    last: tuple
    # parameters held directly by a module on the path (Zaya's input_hidden_states_scale), placed as children
    first_params: tuple = ()
    last_params: tuple = ()
    # the first stage's lists / dicts of modules: (path, is a dict, their keys), whose stand-ins later stages
    # index as the forward does (`_absent`), known after pruning too
    containers: tuple = ()
    # the first stage's modules' own parameters and buffers: (path, ((name, shape, dtype), ...)), which their
    # stand-ins on later stages show as zeros (`_Absent`), known after pruning too
    part_tensors: tuple = ()

    @property
    def layers_path(self) -> str:
        return _join(self.holders[-1], self.layers_name)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _get(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def _has_params(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())


def _layer_lists(root: nn.Module, prefix: str) -> list[tuple[str, nn.ModuleList]]:
    """Every ModuleList under `root` whose entries are blocks with parameters (hybrid models mix classes:
    attention and state-space layers in one list)."""
    out = []
    for name, module in root.named_modules(prefix=prefix):
        if isinstance(module, nn.ModuleList) and len(module) > 0 and all(_has_params(m) for m in module):
            out.append((name, module))
    return out


# where registration order cannot decide: a final norm some models (OPT) register before their layer list
_FINAL_NORMS = frozenset({"norm", "ln_f", "norm_f", "final_layer_norm", "final_layernorm", "final_norm"})


def _function_ast(fn) -> ast.AST | None:
    """The parsed body of `fn` (decorators unwrapped), or None where its source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
        return ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None


@functools.lru_cache(maxsize=None)
def _self_references(cls: type, method: str = "forward", depth: int = 3) -> tuple[str, ...] | None:
    """The attributes `self.X` that `cls.method` names, every mention in the order of its source, where a call
    of another method of the class (`self.get_per_layer_inputs(...)`) stands for the attributes that method
    names (`depth` levels deep). None where the source cannot be read.

    Why: where a child module runs (before or after the layer list) is what places it on the first or the
    last stage, and the forward's own text says that better than the order the children were registered in
    (Gemma 3n/4 register their per-layer input embeddings after the final norm, Kosmos-2 its vision tower
    after the text model, PP-FormulaNet the embeddings' norm after the layers)."""
    fn = getattr(cls, method, None)
    tree = _function_ast(fn) if callable(fn) else None
    if tree is None:
        return None
    nodes = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                    and n.value.id == "self"), key=lambda n: (n.lineno, n.col_offset))
    out: list[str] = []
    for node in nodes:
        name = node.attr
        member = inspect.getattr_static(cls, name, None)
        if depth > 0 and name != method and inspect.isfunction(member) and name not in dir(nn.Module):
            out += _self_references(cls, name, depth - 1) or ()
        out.append(name)
    return tuple(out)


def find_structure(model: nn.Module, need_head: bool = True) -> Structure:
    """The decoder layers of `model` and the placement of everything else; a ValueError saying why not.
    `need_head`: the pipeline computes its loss from the head's logits (loss="shifted"), or the model's forward
    takes no labels to compute its own; a model trained on its own loss or a given one needs none (what follows
    the layer list goes to the last stage as usual)."""
    name = type(model).__name__
    head = embeddings(model, "output")
    if not isinstance(head, nn.Module):
        if need_head:
            raise ValueError(f"pipeline: {name} has no output head (get_output_embeddings() is None): loss="
                             f"'shifted' computes the token cross-entropy from the last stage's logits, and "
                             f"loss='own' the model's own loss where its forward takes labels=; pass "
                             f"loss=callable(outputs, micro_batch), or use a model with a language-model head "
                             f"(e.g. AutoModelForCausalLM / AutoModelForImageTextToText)")
        head = None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    paths = {id(m): n for n, m in model.named_modules()}
    if not isinstance(decoder, nn.Module) or id(decoder) not in paths:
        raise ValueError(f"pipeline: {name}.get_decoder() does not name a submodule; the stage cutter needs the "
                         f"decoder stack (the language model) to find its layer list")
    decoder_path = paths[id(decoder)]
    lists = _layer_lists(decoder, decoder_path)
    base = getattr(model, "base_model", None)
    if not lists and isinstance(base, nn.Module) and base is not model and id(base) in paths:
        # get_decoder() naming the head (ModernBERT-decoder calls its output projection `decoder`): the base model
        decoder, decoder_path = base, paths[id(base)]
        lists = _layer_lists(decoder, decoder_path)
    # a list the decoder's own forward names is its layer list: not a longer one inside a tower under it
    # (Evolla's protein encoder's resampler layers)
    named = set(_self_references(type(decoder)) or ())
    own = [(path, m) for path, m in lists if path.rpartition(".")[0] == decoder_path and
           path.rpartition(".")[2] in named]
    lists = own or lists
    if not lists:
        raise ValueError(f"pipeline: {name}'s decoder {type(decoder).__name__} holds no nn.ModuleList of decoder "
                         f"layers; the stage cutter cuts along such a list")
    # the longest list; among equally long ones, blocks of one class, then the shallowest
    layers_path, layers = max(lists, key=lambda item: (len(item[1]), len({type(m) for m in item[1]}) == 1,
                                                       -item[0].count(".")))
    holder_path, _, layers_name = layers_path.rpartition(".")
    if not (decoder_path == holder_path or holder_path.startswith(decoder_path + ".") or decoder_path == ""
            or holder_path == decoder_path):
        raise ValueError(f"pipeline: {name}: the layer list {layers_path} is not inside the decoder {decoder_path}")
    chain = [""]
    parts = holder_path.split(".") if holder_path else []
    for i in range(len(parts)):
        chain.append(".".join(parts[: i + 1]))
    first, last, first_params, last_params = [], [], [], []
    for depth, holder in enumerate(chain):
        module = _get(model, holder)
        on_path = layers_name if depth == len(chain) - 1 else chain[depth + 1].rsplit(".", 1)[-1]
        # the holder's forward names its children before or after the one on the path: that places them;
        # a child it does not name (called by another module's code) goes by registration order
        # (before its *last* mention: a multimodal model takes the language model's embeddings before its towers)
        named = _self_references(type(module)) or ()
        mentions = [i for i, n in enumerate(named) if n == on_path]
        named_before = set(named[:mentions[-1]]) if mentions else set()
        named_after = set(named[mentions[-1] + 1:]) if mentions else set()
        seen_path = False
        for child_name, child in module._modules.items():
            if child_name == on_path:
                seen_path = True
                continue
            if not _has_params(child):
                continue  # rotary embeddings, dropout: kept on every stage
            path = _join(holder, child_name)
            final_norm = depth == len(chain) - 1 and child_name in _FINAL_NORMS
            if child is head:
                last.append(path)
            elif child_name in named_before:
                first.append(path)
            elif child_name in named_after:
                last.append(path)
            elif final_norm or depth == len(chain) - 1 and seen_path or depth == 0 and seen_path:
                last.append(path)
            else:
                first.append(path)
        # its own parameters, by where its forward names them; one it names on both sides (or not at all)
        # stays on every stage
        for param_name, param in module._parameters.items():
            if param is not None and (param_name in named_before) != (param_name in named_after):
                (first_params if param_name in named_before else last_params).append(_join(holder, param_name))
    # the head itself or a module holding it (BERT-generation's lm_head.decoder inside its lm_head)
    if head is not None and not any(any(head is m for m in _get(model, p).modules()) for p in last):
        raise ValueError(f"pipeline: {name}'s output head is not a child of the modules above its layer list "
                         f"{layers_path}; the stage cutter cannot place it on the last stage")
    containers = tuple((path, isinstance(_get(model, path), nn.ModuleDict), tuple(_get(model, path)._modules))
                       for path in first if isinstance(_get(model, path), _CONTAINERS))
    part_tensors = tuple((path, tensors) for path, tensors in
                         ((path, _own_tensors(module)) for path, module in _first_parts(model, first)) if tensors)
    return Structure(tuple(chain), layers_name, len(layers), decoder_path, tuple(first), tuple(last),
                     tuple(first_params), tuple(last_params), containers, part_tensors)


def _first_parts(model: nn.Module, first: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The first stage's modules by path, a list's or dict's entries as `path.key` (as their stand-ins are)."""
    out = []
    for path in first:
        module = _get(model, path)
        out += ([(_join(path, key), part) for key, part in module._modules.items() if part is not None]
                if isinstance(module, _CONTAINERS) else [(path, module)])
    return out


def _own_tensors(module: nn.Module) -> tuple:
    """`module`'s own parameters and buffers (not its children's) as (name, shape, dtype)."""
    tensors = {**module._parameters, **module._buffers}
    return tuple((name, tuple(t.shape), t.dtype) for name, t in tensors.items() if t is not None)


def check_model(model: nn.Module, structure: Structure, n_stages: int) -> None:
    """What makes a model uncuttable or the pipeline's loss wrong, refused before anything changes."""
    name = type(model).__name__
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for c in {id(config): config, id(text): text}.values():
        if getattr(c, "output_router_logits", False):
            raise ValueError(f"pipeline: {name} has config.output_router_logits=True: the router auxiliary loss "
                             f"spans every stage and the pipeline's loss does not add it; set it to False")
    flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    if getattr(model, flag, False):
        raise ValueError(f"pipeline: {name} has gradient checkpointing on; a stage's first layer takes the "
                         f"received hidden state from a one-shot hook that a recomputation would not see: call "
                         f"model.gradient_checkpointing_disable() before pipeline()")
    if n_stages > 1:
        # the embeddings' weight tied to the head is the one weight two stages may share (pipeline/tie.py)
        embed = embeddings(model, "input")
        tied = getattr(embed, "weight", None) if tied_names(model, structure.last) else None
        owner: dict = {}
        parts = [(f"layer {i}", layer) for i, layer in enumerate(layer_list(model, structure))]
        parts += [(path, _get(model, path)) for path in structure.first + structure.last]
        for part, module in parts:
            for p in module.parameters():
                if p is not tied and owner.setdefault(id(p), part) != part:
                    raise ValueError(f"pipeline: {name}'s {owner[id(p)]} and {part} share parameters (tied weights, "
                                     f"or a block reused across the layer list); the stage "
                                     f"cutter places each parameter on one stage and cannot cut this model: use "
                                     f"dp/tp instead")


def layer_list(model: nn.Module, structure: Structure) -> nn.ModuleList:
    return getattr(_get(model, structure.holders[-1]), structure.layers_name)


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def part_weights(model: nn.Module, structure: Structure) -> tuple[list[int], int, int]:
    """Parameter counts: per decoder layer, of what the first stage adds, of what the last stage adds."""
    layers = [_numel(layer) for layer in layer_list(model, structure)]
    first = sum(_numel(_get(model, p)) for p in structure.first)
    last = sum(_numel(_get(model, p)) for p in structure.last)
    return layers, first, last


# ---- balancing --------------------------------------------------------------------------------------
def balance(layer_weights: Sequence[int], n_stages: int, first: int = 0, last: int = 0) -> list[range]:
    """Cut layers 0..L-1 into `n_stages` contiguous non-empty runs minimising the heaviest stage.

    Stage 0 also carries `first` (embeddings, towers), the last stage `last` (norm and head). Exact dynamic
    programme over cut positions, O(stages * layers^2); ties go to the earliest cut.
    """
    n = len(layer_weights)
    if n_stages < 1 or n < n_stages:
        raise ValueError(f"pipeline: cannot cut {n} decoder layers into {n_stages} stages (each stage needs at "
                         f"least one layer): use fewer stages (pp * stages_per_rank)")
    prefix = [0]
    for w in layer_weights:
        prefix.append(prefix[-1] + int(w))

    def cost(stage: int, a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (first if stage == 0 else 0) + (last if stage == n_stages - 1 else 0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], cost(s, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [n], n
    for s in range(n_stages - 1, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(n_stages)]


def stages_from_split_points(split_points: Sequence, n_layers: int, n_stages: int, layers_path: str) -> list[range]:
    """Stages starting at the named layers: ints, or names like "model.layers.4" / "layers.4"."""
    starts = []
    for point in split_points:
        if isinstance(point, str):
            tail = point.rsplit(".", 1)[-1]
            if not tail.isdigit() or not (point == tail or point.endswith(f"{layers_path.rsplit('.', 1)[-1]}.{tail}")):
                raise ValueError(f"pipeline: split point {point!r} does not name a decoder layer; give an index "
                                 f"or a name like {layers_path}.4")
            point = int(tail)
        starts.append(int(point))
    if len(starts) != n_stages - 1:
        raise ValueError(f"pipeline: {len(starts)} split points {list(split_points)} for {n_stages} stages: give "
                         f"pp * stages_per_rank - 1 = {n_stages - 1} layer indices where stages 1.. begin")
    bounds = [0] + starts + [n_layers]
    if any(b <= a for a, b in zip(bounds, bounds[1:])) or starts and (starts[0] < 1 or starts[-1] >= n_layers):
        raise ValueError(f"pipeline: split points {starts} must increase strictly within 1..{n_layers - 1} "
                         f"(the model has {n_layers} decoder layers; every stage needs one)")
    return [range(bounds[s], bounds[s + 1]) for s in range(n_stages)]


# ---- stage views --------------------------------------------------------------------------------------
def _shallow(module: nn.Module) -> nn.Module:
    """A new module object sharing `module`'s children and tensors, with its own registries and hooks."""
    view = object.__new__(type(module))
    view.__dict__.update(module.__dict__)
    for key, value in module.__dict__.items():
        if isinstance(value, dict):
            view.__dict__[key] = type(value)(value)
    return view


@dataclass(frozen=True)
class StageSpec:
    index: int          # global stage index 0..n_stages-1
    n_stages: int
    layers: range       # decoder layer indices this stage runs

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.n_stages - 1


def _set_child(model: nn.Module, path: str, value) -> None:
    parent, _, name = path.rpartition(".")
    _get(model, parent)._modules[name] = value


def prune(model: nn.Module, structure: Structure, keep_layers: set, first: bool, last: bool) -> None:
    """Drop, in place, every part of `model` that none of this rank's stages runs (set to None)."""
    layers = layer_list(model, structure)
    for i in range(len(layers)):
        if i not in keep_layers:
            layers._modules[str(i)] = None
    for paths, keep in ((structure.first, first), (structure.last, last)):
        if not keep:
            for path in paths:
                _set_child(model, path, None)
    for paths, keep in ((structure.first_params, first), (structure.last_params, last)):
        if not keep:
            for path in paths:
                # still read by the forward on the other stages (on placeholders, whose result is discarded): a
                # plain tensor there, so that only the stage that uses it trains it and a checkpoint has it once
                parent, _, name = path.rpartition(".")
                module = _get(model, parent)
                value = module._parameters.pop(name)
                module.register_buffer(name, value.detach(), persistent=False)


class _StageExit(Exception):
    """Raised by the stand-in for the next stage's first layer: this stage's output is its input."""

    def __init__(self, hidden):
        super().__init__("pipeline stage exit")
        self.hidden = hidden


def _hidden_arg(args: tuple, kwargs: dict):
    return args[0] if args else kwargs.get("hidden_states")


class _Skip(nn.Module):
    """A layer of an earlier stage: passes its input on (the stage's first own layer replaces it), in the form
    the real layers return (`CarrySpec.layer_output`): a loop that unpacks `hidden, weights = layer(...)`
    (Bamba, XLNet, Zaya) gets a tuple of as many entries, the hidden state first, None after."""

    def forward(self, *args, **kwargs):
        hidden = _hidden_arg(args, kwargs)
        state = self.__dict__.get("_hp_state")
        spec = state.carry.get("spec") if state is not None else None
        n = spec.layer_output if spec is not None else 0
        received = state.pending if state is not None and self.__dict__.get("_hp_entry") else None
        if isinstance(received, torch.Tensor) and isinstance(hidden, torch.Tensor) and received.shape == hidden.shape:
            # the layer before the stage's first own one: the loop's own hidden-state variable becomes the
            # received one, as on one device (a loop that reuses it after the call, Inkling2's block stack)
            hidden = received
        return hidden if n == 0 else (hidden,) + (None,) * (n - 1)


class _Exit(_Skip):
    """The next stage's first layer, seen from this stage: stops the forward with the hidden state it gets,
    noting the other keywords the loop hands a layer (`StageState.layer_kwargs`)."""

    def forward(self, *args, **kwargs):
        state = self.__dict__.get("_hp_state")
        if state is not None:
            state.layer_kwargs = _layer_inputs(args, kwargs)
        raise _StageExit(_hidden_arg(args, kwargs))


def _stand_in(cls: type, attributes: dict) -> nn.Module:
    """A stand-in layer carrying the real layer's plain attributes (a hybrid model's loop reads
    `layer.block_type` or `layer.attention_type` before calling it)."""
    module = cls()
    for key, value in attributes.items():
        if not hasattr(module, key):
            module.__dict__[key] = value
    return module


def layer_attributes(model: nn.Module, structure: Structure) -> list[dict]:
    """Per decoder layer, its plain attributes (str, int, float, bool, None), read before pruning: its own and
    its class's (Inkling2's layer classes say `attention_type = "sliding_attention"`)."""
    plain = (str, int, float, bool, type(None))

    def attributes(layer: nn.Module) -> dict:
        found = {}
        for cls in reversed(type(layer).__mro__[:type(layer).__mro__.index(nn.Module)]):
            found.update(vars(cls))
        found.update(layer.__dict__)
        return {k: v for k, v in found.items() if not k.startswith("_") and isinstance(v, plain)}
    return [attributes(layer) for layer in layer_list(model, structure)]


class _Absent(nn.Module):
    """On a later stage, a module of the first stage that the decoder stack still calls before its layers
    (GPT-2's position embeddings, Gemma 3n's per-layer projection): placeholders of the shape it gave on the
    first stage, per token (`CarrySpec.part_tails`); where that is not known, placeholders of the hidden width
    for integer inputs and for floating (batch, sequence) ones (TrOCR's learned positions read
    `inputs_embeds[:, :, -1]`), the input itself for floating ones with a width (an embedding norm). Whatever
    it gives is replaced by the carried values at the stage's first layer, or is refused by the probe where
    the stage depends on it (`placeholder_problem`)."""

    def __init__(self, state: "StageState", path: str = "", tensors: tuple = ()):
        super().__init__()
        self.__dict__["_hp_state"] = state
        self.__dict__["_hp_path"] = path
        self.__dict__["_hp_tensors"] = {name: (shape, dtype) for name, shape, dtype in tensors}

    def __getattr__(self, name: str):
        """The real module's own parameters and buffers, as zeros of their shapes (no memory: one element
        expanded) on the stage's device: a forward reads them besides calling the module (Kosmos-2.5's
        `self.segment_emb.weight.device`); what it computes from them is a placeholder's value too."""
        tensors = self.__dict__.get("_hp_tensors") or {}
        if name in tensors:
            shape, dtype = tensors[name]
            return torch.zeros((), dtype=dtype, device=self.__dict__["_hp_state"].device).expand(shape)
        return super().__getattr__(name)

    def forward(self, *args, **kwargs):
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        state = self.__dict__["_hp_state"]
        hidden = state.pending
        if x is None or hidden is None:
            return x
        spec = state.carry.get("spec")
        tail = dict(spec.part_tails).get(self.__dict__["_hp_path"]) if spec is not None else None
        dtype = x.dtype if x.is_floating_point() else hidden.dtype
        if isinstance(tail, tuple) and tail[:1] == ("tuple",) and x.ndim >= 2:
            # a tuple the module gave (Mistral-Large-4's rotary embedding, which has a parameter: (cos, sin)),
            # each entry batch-first or broadcast over the batch as there (`_part_shape_hook`)
            out = tuple(_placeholder(state, (1 if one else x.shape[0], x.shape[1]) + rest, dtype, hidden.device)
                        for one, rest in tail[1:])
            state.part_tuples.append(out)   # the carried values go into it, and on to the next cut
            return out
        if tail is not None and x.ndim >= 2:
            return _placeholder(state, tuple(x.shape[:2]) + tail, dtype, hidden.device)
        if x.is_floating_point() and not (x.ndim == 2 and tuple(x.shape) == tuple(hidden.shape[:2])):
            return x
        if x.ndim == 0 and not x.is_floating_point():
            # one token's embedding, which a forward compares with its input embeddings to find that token's
            # positions when it is given no ids (InstructBLIP's image tokens, on a later stage): NaN, equal to no
            # placeholder, so the stage finds none rather than every position (a placeholder equals a placeholder)
            return torch.full((hidden.shape[-1],), float("nan"), dtype=hidden.dtype, device=hidden.device)
        return _placeholder(state, tuple(x.shape) + (hidden.shape[-1],), hidden.dtype, hidden.device)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


class _AbsentTower(_Absent):
    """On a later stage, a module of the first stage outside the decoder stack (a vision tower, a Q-Former, a
    projector) that the model's forward calls there too, whatever its inputs (BLIP-2 runs its towers before
    anything else): placeholders in the form the real module's output had on the first stage
    (`CarrySpec.part_forms`: the same model output class, tensors of the same shapes), which the forward turns
    into a placeholder input of the decoder stack, replaced by the received hidden state at the stage's first
    layer (the probe refuses a stage whose layers get something computed from them). A module whose output is
    not known there (not called on the first stage, or not a form `_form` describes) is refused."""

    def forward(self, *args, **kwargs):
        state = self.__dict__["_hp_state"]
        spec = state.carry.get("spec")
        form = dict(spec.part_forms).get(self.__dict__["_hp_path"]) if spec is not None else None
        if form is None:
            raise RuntimeError(f"pipeline: stage {state.spec.index} calls {self.__dict__['_hp_path']}, a module of "
                               f"the first stage whose output there is not known (not called there, or not "
                               f"tensors in tuples or model outputs); the stage cannot stand in for it: use dp/tp "
                               f"for this model")
        return _from_form(form, state)


def _form(value) -> tuple | None:
    """A description of a module's output from which a later stage builds placeholders of it (`_from_form`):
    ("tensor", shape, dtype), ("value", a constant), ("output", model output class, ((key, form), ...)),
    ("tuple" | "list", (form, ...)); None where it holds anything else (a DTensor: a split the stages would
    have to lay out alike)."""
    if isinstance(value, DTensor):
        return None
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    if isinstance(value, dict) and dataclasses.is_dataclass(value):   # transformers' ModelOutput
        fields = tuple((key, _form(v)) for key, v in value.items())
        return None if any(f is None for _, f in fields) else ("output", type(value), fields)
    if type(value) in (tuple, list):
        items = tuple(_form(v) for v in value)
        return None if any(f is None for f in items) else (type(value).__name__, items)
    return None


def _from_form(form: tuple, state: "StageState"):
    """Placeholders in the form `form` describes (`_form`), on the stage's device."""
    kind = form[0]
    if kind == "tensor":
        return _placeholder(state, form[1], form[2], state.device)
    if kind == "value":
        return form[1]
    if kind == "output":
        return form[1](**{key: _from_form(f, state) for key, f in form[2]})
    return (tuple if kind == "tuple" else list)(_from_form(f, state) for f in form[1])


def _absent(structure: "Structure", state: "StageState", path: str, tower: bool = False) -> nn.Module:
    """The `_Absent` (`tower`: `_AbsentTower`) stand-in of a first-stage module on a later stage; of a list or
    dict of modules, one of the same kind holding a stand-in per entry (Gemma 3n's altup projections, indexed
    by its forward)."""
    cls = _AbsentTower if tower else _Absent
    tensors = dict(structure.part_tensors)
    for where, is_dict, keys in structure.containers:
        if where == path:
            parts = {key: cls(state, f"{path}.{key}", tensors.get(f"{path}.{key}", ())) for key in keys}
            return nn.ModuleDict(parts) if is_dict else nn.ModuleList(parts.values())
    return cls(state, path, tensors.get(path, ()))


def _placeholder(state: "StageState", shape: tuple, dtype, device) -> torch.Tensor:
    """What a later stage puts where the first stage's modules computed values: zeros, or (the probe's second
    run, `StageState.scramble`) random values, which show whether the stage's result depends on them."""
    if state.scramble is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.randn(shape, generator=state.scramble, dtype=torch.float32).to(device=device, dtype=dtype)


@dataclass
class CarrySpec:
    """What the first stage carries besides the hidden state, in order: (name, kind) entries, kind "bs" (a
    (batch, sequence, ...) tensor), "kbs" (a (k, batch, sequence, ...) tensor, carried with k last),
    "b" (a (batch, ...) tensor of another length than the tokens': per-sample features),
    "dict:b:KEY" / "dict:none:KEY" (entry KEY of a dict of batch-first tensors, or None), "rows:M"
    (a list of (rows, hidden) tensors, the rows at the True positions of the carried mask M, carried dense);
    and the constants handed to the decoder stack."""
    entries: tuple = ()
    constants: tuple = ()
    layer_output: int = 0   # what a decoder layer returns: 0 a tensor, n a tuple of n (the stand-ins mimic it)
    embed_tail: tuple | None = None   # the embeddings' dims after (batch, sequence), when not the hidden state's
    # what the loop hands a stage's first layer besides the hidden state, carried after the entries' pieces:
    # (name, "value") the tensor itself, (name, "base") the per-token tensor it is a view of, (name,
    # "dict:I:KEY") entry I of the tuple at KEY of a dict of batch-first tensors the layers fill and read
    # (`_shared_states`: Gemma 3n/4's and Mistral-Large-4's shared K/V), (name, "tuple:I") entry I of a tuple a
    # first-stage module gave (Mistral-Large-4's rotary (cos, sin)) (`_layer_pieces`)
    layer_entries: tuple = ()
    # the same at the cuts after stages 1, 2, ... (one tuple per cut), found in the probe by the stage before
    # each cut: what crosses a cut may differ from cut to cut (the shared K/V are there only once their
    # "store" layers have run)
    later_entries: tuple = ()
    # the first stage's modules the decoder stack calls before its layers: (path, output dims after (batch,
    # sequence)), which their stand-ins on later stages give (`_Absent`)
    part_tails: tuple = ()
    # the first stage's modules outside the decoder stack that its forward called: (path, `_form` of their
    # output), which their stand-ins on later stages give (`_AbsentTower`)
    part_forms: tuple = ()

    def cut_entries(self, cut: int) -> tuple | None:
        """The layer entries carried at the cut after stage `cut` (None: not known yet)."""
        if cut == 0:
            return self.layer_entries
        return self.later_entries[cut - 1] if cut <= len(self.later_entries) else None


@dataclass
class StageState:
    """One stage view's runtime state (its hooks read it); `carry` is shared by the pipeline's stages."""
    structure: Structure
    spec: StageSpec
    forward: Any                       # the model class's own forward
    carry: dict = field(default_factory=dict)   # {"spec": CarrySpec} once known
    capture: dict | None = None
    inject: dict | None = None
    pending: Any = None
    layer_kwargs: dict | None = None   # what the loop handed the next stage's first layer (first stage)
    layer_output: int = 0              # the form of a real layer's output, seen on the first stage
    embed_tail: tuple | None = None    # the input embeddings' dims after (batch, sequence), seen on the first stage
    part_tails: dict = field(default_factory=dict)   # first-stage module path -> its output's dims after (b, s)
    part_tuples: list = field(default_factory=list)  # the tuples of tensors those modules gave in this forward
    part_forms: dict = field(default_factory=dict)   # first-stage tower path -> `_form` of its output (this forward)
    recording: bool = False            # the probe's dry run: note what the loop hands the layers at the cuts
    exit_inputs: dict | None = None    # per-token inputs the loop handed the next stage's first layer (here)
    entry_inputs: dict | None = None   # per-token inputs the loop handed this stage's first own layer
    layer_inject: dict | None = None   # name -> (kind, received tensor): the carried layer inputs (later stages)
    scramble: Any = None               # a torch.Generator: placeholders are random (the probe's second run)
    prints: list | None = None         # (layer, name, fingerprint) of what each own layer got (the probe)
    own_loss: Any = None               # the model's own loss, when its forward was handed labels (last stage)
    device: Any = None                 # where this forward's received hidden state lies (later stages)
    holders: list = field(default_factory=list)   # (the view's copy, the model's module) on the path to the layers
    # what the last stage returns: None its logits; else a function (model output, micro-batch) -> the loss
    # of the micro-batch, and whether the model's forward is handed the labels (the model's own loss)
    loss: Any = None
    loss_takes_labels: bool = False


def stage_view(model: nn.Module, structure: Structure, spec: StageSpec, carry: dict,
               attributes: list[dict] | None = None) -> nn.Module:
    """A view of the (pruned) model that runs only stage `spec`; see the module docstring. `attributes`:
    `layer_attributes` of the unpruned model, copied onto the stand-ins of other stages' layers."""
    copies = {}
    for holder in structure.holders:
        original = _get(model, holder)
        copy = _shallow(original)
        copies[holder] = copy
        if holder:
            parent, _, name = holder.rpartition(".")
            copies[parent]._modules[name] = copy
    view = copies[""]
    original_layers = layer_list(model, structure)
    layers = _shallow(original_layers)
    copies[structure.holders[-1]]._modules[structure.layers_name] = layers
    attributes = attributes or [{} for _ in layers._modules]
    for key in list(layers._modules):
        i = int(key)
        if i in spec.layers:
            continue
        stand_in = _Exit if i == spec.layers.stop else _Skip if i < spec.layers.start else None
        layers._modules[key] = stand_in and _stand_in(stand_in, attributes[i])
    state = StageState(structure, spec, type(model).forward, carry)
    state.holders = [(copies[holder], _get(model, holder)) for holder in structure.holders]
    for i in range(spec.layers.start):
        layers._modules[str(i)].__dict__["_hp_state"] = state
    if spec.first:
        original_layers[spec.layers.start].register_forward_hook(_output_form_hook(state))
        embed = embeddings(model, "input")
        if isinstance(embed, nn.Module):
            embed.register_forward_hook(_embed_shape_hook(state))
        for path in structure.first:
            hook = _part_shape_hook if _in_decoder(path, structure.decoder) else _part_form_hook
            for part_path, part in _first_parts(model, [path]):
                part.register_forward_hook(hook(state, part_path))
    if spec.layers.stop < len(layers._modules):
        layers._modules[str(spec.layers.stop)].__dict__["_hp_state"] = state
    inside = structure.decoder
    for paths, keep in ((structure.first, spec.first), (structure.last, spec.last)):
        if not keep:
            for path in paths:
                parent, _, name = path.rpartition(".")
                # the decoder stack's own embeddings are still called on later stages; the towers are where the
                # model's forward calls them whatever its inputs (BLIP-2's vision tower and Q-Former)
                copies[parent]._modules[name] = (_absent(structure, state, path, tower=not _in_decoder(path, inside))
                                                 if paths is structure.first else None)
    decoder = copies.get(structure.decoder) if structure.decoder in copies else _get(view, structure.decoder)
    decoder.register_forward_pre_hook(_decoder_hook(state), with_kwargs=True)
    if not spec.first:
        original_layers[spec.layers.start].register_forward_pre_hook(_entry_hook(state), with_kwargs=True)
        layers._modules[str(spec.layers.start - 1)].__dict__["_hp_entry"] = True
        for i in spec.layers:   # after the entry hook: what the layers get once the carried values are in
            original_layers[i].register_forward_pre_hook(_print_hook(state, i), with_kwargs=True)
    view.__class__ = _stage_class(type(model))
    view.__dict__["_hp_stage"] = state
    return view


def _decoder_hook(state: StageState):
    """The decoder stack's pre-hook: on the first stage, note what it is handed; on later stages, hand it
    what the first stage's was handed (carried)."""
    def hook(module, args, kwargs):
        if state.capture is not None:
            state.capture.update(named_inputs(module, args, kwargs))
        if state.inject:
            inject = dict(state.inject)
            # what the caller hands positionally (CPM-Ant passes return_dict so) is replaced in place: a keyword
            # of the same name would be given twice
            names = positional_names(module)[:len(args)]
            args = tuple(inject.pop(n) if n in inject else a for n, a in zip(names, args)) + tuple(args[len(names):])
            return args, {**kwargs, **inject}
        return None
    return hook


def _output_form_hook(state: StageState):
    """The first stage's first layer's forward hook: note the form of a real layer's output."""
    def hook(module, args, output):
        state.layer_output = len(output) if isinstance(output, tuple) else 0
    return hook


def _in_decoder(path: str, decoder: str) -> bool:
    """Whether the module at `path` is a child of the decoder stack (or of a module inside it)."""
    parent = path.rpartition(".")[0]
    return parent == decoder or parent.startswith(decoder + ".") or not decoder


def _part_shape_hook(state: StageState, path: str):
    """A first-stage module's forward hook (one the decoder stack holds): note its output's dims after (batch,
    sequence), None where its calls differ or it gives no tensor (`_Absent` then keeps its old rule); for a
    tuple of tensors ("tuple", (broadcast over the batch, dims after (batch, sequence)) per entry), the tuple
    itself noted too, to carry it where the loop hands it to the layers (`_layer_entries`)."""
    def hook(module, args, output):
        tail = tuple(output.shape[2:]) if isinstance(output, torch.Tensor) and output.ndim >= 2 else None
        if isinstance(output, tuple) and output and all(isinstance(o, torch.Tensor) and o.ndim >= 2 for o in output):
            tail = ("tuple",) + tuple((o.shape[0] == 1, tuple(o.shape[2:])) for o in output)
            state.part_tuples.append(output)
        if state.part_tails.setdefault(path, tail) != tail:
            state.part_tails[path] = None
    return hook


def _part_form_hook(state: StageState, path: str):
    """A first-stage module's forward hook (one outside the decoder stack): note the form of its output in this
    forward (`_form`), None where its calls differ."""
    def hook(module, args, output):
        form = _form(output)
        if state.part_forms.setdefault(path, form) != form:
            state.part_forms[path] = None
    return hook


def _embed_shape_hook(state: StageState):
    """The first stage's input embeddings' forward hook: note their dims after (batch, sequence), which a
    model may widen before its layers (DeepSeek-V4's hc_mult residual streams: (b, s, hidden) becomes
    (b, s, streams, hidden)), so that a later stage's placeholder embeddings have the model's shape."""
    def hook(module, args, output):
        if isinstance(output, torch.Tensor) and output.ndim >= 2:
            state.embed_tail = tuple(output.shape[2:])
    return hook


def _layer_inputs(args: tuple, kwargs: dict) -> dict:
    """What the loop hands a layer besides the hidden state, by the names `_Exit` notes them under."""
    return {**{f"argument {i}": a for i, a in enumerate(args[1:], 1)}, **kwargs}


def _entry_hook(state: StageState):
    """The stage's first own layer's pre-hook: its input is the received hidden state (once per forward), and
    what else the loop hands it is the carried value (`_take_carried`)."""
    def hook(module, args, kwargs):
        hidden, state.pending = state.pending, None
        if hidden is None:
            return None
        if args:
            args = (hidden,) + tuple(args[1:])
        else:
            kwargs = {**kwargs, "hidden_states": hidden}
        args, kwargs = _take_carried(state.layer_inject or [], args, kwargs)
        if state.recording:
            state.entry_inputs = per_token_inputs(_layer_inputs(args, kwargs), hidden)
        return args, kwargs
    return hook


def _take_carried(carried: list, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The first own layer's call with the carried layer inputs (`_layer_pieces`) in place of what this stage's
    loop computed from placeholders, so that its later layers get the real values as on one device too:
    - the loop handed None (a state the layers return and the loop passes on, Zaya's router states, which the
      stand-ins return as None): the carried value is handed instead; the later layers get what the real
      layers return;
    - it handed a tensor of the carried value's shape (Zamba's clone of the embeddings handed to every layer,
      Inkling2's stack of block outputs that the loop grows): the carried value is copied into that very
      tensor, in place (autograd records the copy: the gradient flows back to the received piece), so every
      later use of the object the loop holds (the same tensor handed to every layer, or a stack it grows
      from it) sees the real values;
    - the carried value is the base of the view it handed (Gemma 3n's per_layer_inputs[:, :, i, :]): copied
      into the base of that view, so the slices the loop takes for the later layers are real too;
    - the carried values are the entries of a dict the layers fill and read (`_shared_states`: the K/V an
      earlier stage's layer stored for the "reuse" layers of this one): put into the dict the loop handed,
      the one object every later layer gets, where it has no entry of that key yet;
    - the carried value is an entry of a tuple a first-stage module gave (its stand-in's placeholders here):
      copied into that entry, as a tensor of its own is.
    Anything else is left as the loop computed it: the probe compares it with the stage before
    (`cut_inputs_problem`) and checks that the stage's result does not depend on placeholders, which refuses it
    where it differs."""
    args, kwargs = list(args), dict(kwargs)
    shared: dict = {}
    for name, kind, value in carried:
        if name.startswith("argument "):
            i = int(name.split(" ", 1)[1])
            got = args[i] if i < len(args) else None
        else:
            i, got = None, kwargs.get(name)
        if kind.startswith("dict:"):
            _, _, key = kind.split(":", 2)
            shared.setdefault((name, key), (got, []))[1].append(value)
            continue
        if kind.startswith("tuple:"):
            index = int(kind.split(":", 1)[1])
            got = got[index] if isinstance(got, tuple) and len(got) > index else None
            if got is None:
                continue
            kind = "value"
        if kind == "value" and got is None:
            if i is None:
                kwargs[name] = value
            elif i < len(args):
                args[i] = value
            continue
        if not isinstance(got, torch.Tensor) or isinstance(got, DTensor) or got.dtype != value.dtype:
            continue
        target = got if kind == "value" else got._base
        if target is None or target.is_leaf and target.requires_grad:
            continue
        if kind == "value" and (got._base is not None or tuple(target.shape) != tuple(value.shape)
                                or any(st == 0 and n > 1 for st, n in zip(target.stride(), target.shape))):
            continue
        if kind == "base":
            # the same elements in the same memory order (the view at the same place in it: the probe checks
            # the values the layers get), whatever shape the loop's code gave the base here
            if not (target.is_contiguous() and value.is_contiguous() and target.numel() == value.numel()):
                continue
            value = value.view(target.shape)
        target.copy_(value)
    for (name, key), (got, values) in shared.items():
        if isinstance(got, MutableMapping) and key not in got:
            got[key] = tuple(values)
    return tuple(args), kwargs


def _print_hook(state: StageState, index: int):
    """An own layer's pre-hook on a later stage (the probe only): a fingerprint of each floating tensor it gets
    (the hidden state, what the loop hands it, tensors in tuples such as rotary (cos, sin)), to compare a run
    on zero placeholders with one on random ones."""
    def hook(module, args, kwargs):
        if state.prints is None:
            return None
        hidden = _hidden_arg(args, kwargs)
        found = {"the hidden state": hidden, **_layer_inputs(args, kwargs)}
        for name, value in found.items():
            values = value if isinstance(value, (tuple, list)) else (value,)
            state.prints += [(index, name, fingerprint(v)) for v in values
                             if isinstance(v, torch.Tensor) and v.is_floating_point()]
        return None
    return hook


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Sums that tell two runs' values apart (this rank's local piece, in double)."""
    v = _leave(t).detach().double()
    return torch.stack([v.sum(), v.abs().sum(), (v * v).sum()])


def placeholder_problem(plain: list, scrambled: list, model_name: str, index: int) -> str | None:
    """Why stage `index`'s result depends on the placeholders it runs on in place of the first stage's values:
    the fingerprints of what its own layers got and of its output (`_print_hook`), with zero placeholders
    (`plain`) and random ones (`scrambled`). On one device those values are the first stage's; a later stage
    whose layers get something computed from them (a per-layer input the loop derives anew at each layer
    from the embeddings, a state the stages cannot hand over) would train on wrong values without an error.
    None when every fingerprint agrees."""
    for (layer, name, a), (_, _, b) in zip(plain, scrambled):
        if a.is_meta or b.is_meta:
            continue
        if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            where = f"its layer {layer} gets {name!r}" if layer is not None else f"its {name}"
            return (f"pipeline: stage {index} of {model_name} runs on placeholders where the first stage computed "
                    f"values, and {where} computed from them (other with other placeholders): the decoder loop "
                    f"derives it from values of the first stage that the stages do not hand each other, so "
                    f"stage {index}'s layers would get wrong values: use dp/tp for this model")
    if len(plain) != len(scrambled):
        return (f"pipeline: stage {index} of {model_name} calls its layers otherwise when its placeholders for the "
                f"first stage's values change: use dp/tp for this model")
    return None


_STAGE_CLASSES: dict = {}


def _stage_class(cls: type) -> type:
    if cls not in _STAGE_CLASSES:
        _STAGE_CLASSES[cls] = type(f"PipelineStage{cls.__name__}", (cls,), {"forward": stage_forward})
    return _STAGE_CLASSES[cls]


# the caller's inputs that later stages hand the model again (the rest feed the first stage's towers)
_EVERY_STAGE_INPUTS = ("attention_mask", "position_ids")
# transformers' name of the (batch, sequence, layers, width) per-layer input embeddings a model's forward takes
# precomputed (Gemma 3n, Gemma 4)
PER_LAYER_INPUTS = "per_layer_inputs"


# the micro-batch's labels for the last stage (the schedule cuts them with the inputs): the model's own loss
# (handed to its forward as labels=) or a given loss function's micro-batch; the probe's comparison of losses
LABELS = "_hp_labels"

# the whole batch's 3-D rotary positions, batch first: the schedule cuts every input into micro-batches on dim 0
BATCH_POSITIONS = "_hp_batch_positions"
_GRID_INPUTS = ("image_grid_thw", "video_grid_thw")


def with_batch_positions(model: nn.Module, input_ids, inputs: dict, n_microbatches: int) -> dict:
    """`inputs` plus a multimodal model's 3-D rotary positions computed on the whole batch, as one device
    computes them, when they depend on the batch: a model may number images across the batch (HunYuan-VL's
    image index), so a micro-batch alone would get other positions than its rows have in the batch.

    Decided by computing them both ways with the model's own `compute_3d_position_ids` (integer work on the
    token ids, the same on every rank of a pp group, which feed the same batch): equal, or not computable
    from the caller's inputs alone (Qwen3-Omni derives audio lengths first), and each micro-batch computes
    its own as before, exact for positions per row; different, and the whole batch's are handed on."""
    if inputs.get("position_ids") is not None or not any(inputs.get(k) is not None for k in _GRID_INPUTS):
        return inputs
    holder = next((m for m in model.modules() if hasattr(type(m), "compute_3d_position_ids")), None)
    if holder is None or n_microbatches == 1:
        return inputs
    whole = _rotary_positions(holder, {"input_ids": input_ids, **inputs})
    if whole is None:
        return inputs
    micro = [_rotary_positions(holder, {k: v.tensor_split(n_microbatches)[i] if isinstance(v, torch.Tensor) and v.ndim
                                        else v for k, v in {"input_ids": input_ids, **inputs}.items()})
             for i in range(n_microbatches)]   # as the schedule cuts them: dim 0 in equal parts
    if all(m is not None for m in micro) and torch.equal(torch.cat(micro, dim=1), whole):
        return inputs
    return {**inputs, BATCH_POSITIONS: whole.movedim(1, 0).contiguous()}


def _rotary_positions(holder: nn.Module, given: dict):
    """`holder.compute_3d_position_ids` on `given` (None for a required argument not given), or None when it
    cannot run on them or returns no (rows, batch, seq) tensor."""
    params = inspect.signature(holder.compute_3d_position_ids).parameters
    given = {"inputs_embeds": None, "cache": None, **given}
    kwargs = {k: given.get(k) for k, p in params.items()
              if k in given or p.default is inspect.Parameter.empty and p.kind in
              (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    try:
        with torch.no_grad():
            positions = holder.compute_3d_position_ids(**kwargs)
    except (TypeError, ValueError, IndexError, RuntimeError):
        return None
    ids = given["input_ids"]
    if not (isinstance(positions, torch.Tensor) and positions.ndim == 3 and tuple(positions.shape[1:]) == tuple(ids.shape)):
        return None
    return positions


def stage_forward(self, *received: torch.Tensor, **inputs: Any):
    """The stage's part of the model's own forward (see the module docstring).

    First stage: `received` is (input_ids,); later: (hidden piece, *carried pieces) from the previous stage.
    Every stage gets the micro-batch's inputs as keywords too (input_ids included): the stage's input steps
    (expert parallel's batch shares, context parallel's sequence split; feed.py) run on them, giving the
    layout of the tokens, which the received pieces are wrapped in. Returns this rank's local pieces:
    (hidden, *carried), or the logits on the last stage."""
    state: StageState = self.__dict__["_hp_stage"]
    spec = state.spec
    # the view's copies of the modules on the path are in the model's mode (`model.train()` sets the model's own
    # modules, the children the copies share, not the copies): RWKV rescales its blocks when its mode changes
    for copy, original in state.holders:
        copy.training = original.training
    if BATCH_POSITIONS in inputs:   # this micro-batch's rows of the whole batch's positions (rows, batch, seq)
        inputs["position_ids"] = inputs.pop(BATCH_POSITIONS).movedim(0, 1)
    labels = inputs.pop(LABELS, None)
    given = {**inputs, **({} if labels is None else {"labels": labels})}   # the micro-batch, for a loss function
    call = {"input_ids": received[0] if spec.first and received else inputs.get("input_ids")}
    call.update((k, v) for k, v in inputs.items() if k != "input_ids")
    stage_feed = feed_of(self)
    for step in (stage_feed.steps if stage_feed is not None else []):
        _, call = step.apply(self, (), call)
    ids = call["input_ids"]
    if accepts(state.forward, "use_cache"):
        call["use_cache"] = False
    if not spec.first:
        carried = state.carry.get("spec")
        if carried is None:
            raise RuntimeError("pipeline: a later stage ran before the first stage's carried inputs were known")
        hidden_in = _enter(received[0], ids)
        state.device = received[0].device
        n_entries = _piece_count(carried)
        state.inject = _decode(carried, received[1:1 + n_entries], ids, hidden_in)
        state.layer_inject = [(name, kind, _ContiguousGrad.apply(p) if kind.startswith("dict:")
                               else _enter(_ContiguousGrad.apply(p), ids))
                              for (name, kind), p in zip(carried.cut_entries(spec.index - 1) or (),
                                                         received[1 + n_entries:])]
        state.pending = hidden_in
        # what the forward cannot be called without (BLIP-2's pixel_values and input_ids) is the caller's own input,
        # as on the first stage: the towers that take it are stand-ins here (`_AbsentTower`)
        call = {k: v for k, v in call.items() if k in _EVERY_STAGE_INPUTS + ("use_cache",) + _required(state.forward)
                or _token_input(v, ids)}
        # per-sample features the decoder stack is handed, which the model's forward takes in place of its towers'
        # inputs (Kosmos-2's image_embeds for pixel_values): handed to it too, as one device's forward passes them on
        call.update((name, state.inject[name]) for name, kind in carried.entries
                    if kind == "b" and name in _parameters(state.forward))
        # a placeholder of the embeddings' shape (models scale their embeddings in place: CTRL; the hidden state
        # between layers may be wider: DeepSeek-V4's residual streams)
        local = received[0]
        tail = carried.embed_tail
        # (batch, sequence) first as the tokens are, whatever the layers' layout (XLNet's is sequence first; Gemma
        # 3n's hidden state leads with its altup streams)
        lead = tuple(_leave(ids).shape[:2])
        shape = lead + (tail if tail is not None else tuple(local.shape[2:]))
        call["inputs_embeds"] = _enter(_placeholder(state, shape, local.dtype, local.device), ids)
        per_layer = next((p for _, kind, p in state.layer_inject if kind == "base" and p.ndim == 4), None)
        if per_layer is not None and PER_LAYER_INPUTS in _parameters(state.forward):
            # the per-layer inputs the model's forward takes precomputed, which it otherwise derives from the
            # token ids or reverses from the embeddings' table (Gemma 4's get_per_layer_inputs, which a later
            # stage, without the first stage's embeddings, cannot): a placeholder of the carried per-layer
            # inputs' shape, which the carried ones replace at the stage's first layer (`_take_carried`)
            local_shape = tuple(_leave(per_layer).shape)
            call[PER_LAYER_INPUTS] = _enter(_placeholder(state, local_shape, per_layer.dtype, local.device), ids)
    else:
        state.capture = {} if not spec.last else None
        state.part_forms = {}
    if (labels is not None and spec.last and not isinstance(ids, DTensor)
            and (state.loss is None or state.loss_takes_labels)):
        # the model's own loss (api.Pipeline._loss_rule); not on split tokens (ep/cp DTensors), whose logits the
        # model's loss code would take as DTensors against plain labels: there the probe finds no own loss
        call["labels"] = labels
    try:
        out = state.forward(self, **call)
        hidden = None
    except _StageExit as e:
        out, hidden = None, e.hidden
    except TypeError as e:
        if "'NoneType' object is not callable" not in str(e):
            raise
        raise RuntimeError(f"pipeline: stage {spec.index} of {type(self).__mro__[1].__name__} called a module "
                           f"that the structural cutter placed on another stage ({e}); this model's forward "
                           f"does not follow the embeddings -> layer list -> norm/head pattern") from e
    finally:
        captured, state.capture, state.inject, state.pending = state.capture, None, None, None
        state.layer_inject = None
        layer_kwargs, state.layer_kwargs = state.layer_kwargs, None
        part_tuples, state.part_tuples = state.part_tuples, []
    if state.recording and hidden is not None:
        state.exit_inputs = per_token_inputs(layer_kwargs or {}, hidden)
    if spec.last:
        if "labels" in call:
            state.own_loss = getattr(out, "loss", None)
        if state.loss is not None:
            return _leave(state.loss(out, given))
        logits = getattr(out, "logits", None)
        if logits is None:
            logits = out[0] if isinstance(out, (tuple, list)) else out
        return _leave(logits)
    if spec.first:
        if (hidden is not None and hidden.ndim >= 2 and hidden.shape[0] == ids.shape[0]
                and hidden.shape[1] != ids.shape[1]):
            raise ValueError(f"pipeline: {type(self).__mro__[1].__name__} hands its layers a sequence of "
                             f"{hidden.shape[1]} positions for {ids.shape[1]} tokens (the layers' sequence is not "
                             f"the tokens': image features or prompt positions joined to them, or patches of them: "
                             f"GIT, CPM-Ant, BLT); a later stage rebuilds its masks and positions from "
                             f"the tokens and cannot run on the longer sequence: use dp/tp for this model")
        carry_spec, pieces = _encode(captured, call, ids)
        layer_entries = _layer_entries(layer_kwargs or {}, hidden, ids, part_tuples)
        part_tails = tuple(sorted((k, v) for k, v in state.part_tails.items() if v is not None))
        part_forms = tuple(sorted(((k, v) for k, v in state.part_forms.items() if v is not None), key=lambda kv: kv[0]))
        carry_spec = dataclasses.replace(carry_spec, layer_output=state.layer_output, embed_tail=state.embed_tail,
                                         layer_entries=layer_entries, part_tails=part_tails, part_forms=part_forms)
        known = state.carry.setdefault("spec", carry_spec)
        if dataclasses.replace(known, later_entries=()) != carry_spec:
            raise ValueError(f"pipeline: this micro-batch hands the decoder stack {carry_spec} besides the hidden "
                             f"state, the first one handed it {known}; feed micro-batches of one kind (the same "
                             f"modalities in every step of one input shape)")
    else:
        carry_spec = _later_cut_entries(state, _layer_entries(layer_kwargs or {}, hidden, ids, part_tuples))
        pieces = [p.view_as(p) if p.requires_grad else p for p in received[1:1 + _piece_count(carry_spec)]]
    pieces += _layer_pieces(carry_spec.cut_entries(spec.index), layer_kwargs or {}, spec.index)
    if spec.first:
        pieces = [_NoGradForZeros.apply(p) if p.requires_grad and not isinstance(p, DTensor) else p for p in pieces]
    return (_leave(hidden).contiguous(),) + tuple(_leave(p).contiguous() for p in pieces)


def _later_cut_entries(state: StageState, entries: tuple) -> CarrySpec:
    """The carried spec with what a middle stage's loop hands the next stage's first layer (`entries`, its
    `_layer_entries`) as the entries of the cut after it: noted the first time (the probe runs the stages in
    order, and shares the spec with every rank), compared afterwards."""
    spec, cut = state.carry["spec"], state.spec.index
    known = spec.cut_entries(cut)
    if known is None and len(spec.later_entries) == cut - 1:
        spec = dataclasses.replace(spec, later_entries=spec.later_entries + (entries,))
        state.carry["spec"] = spec
    elif known != entries:
        raise ValueError(f"pipeline: the decoder loop hands stage {cut + 1}'s first layer {entries} besides the "
                         f"hidden state, the first micro-batch handed it {known}; feed micro-batches of one kind "
                         f"(the same modalities in every step of one input shape)")
    return spec


class _NoGradForZeros(torch.autograd.Function):
    """The identity on a piece the first stage carries, whose gradient is none where the later stages sent back
    zeros: torch's schedule sends zeros for a received piece the later stage's loss does not depend on
    (Kosmos-2.5's image features, handed to its text model, which scatters them into nothing when fed text
    alone), which would give the modules that computed it zero gradients where one device gives none (an
    optimizer treats them otherwise: weight decay, moments); a gradient that is exactly zero everywhere adds
    nothing either way."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad if grad.is_meta or bool(grad.any()) else None   # meta (hp.plan): no values to look at


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose gradient is made contiguous: what a stage sends back for a received piece is its
    gradient, and torch's P2P receives it into a buffer of those strides, which gloo takes only contiguous
    (a carried layer input copied into a tensor the layer concatenates, Zamba's, gets a slice of the
    concatenation's gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _carried_layer_input(value, hidden, lead: tuple) -> bool:
    """Whether the loop's `value` for a layer is carried to the next stage: a floating or integer tensor per
    token (`lead`: the tokens' (batch, sequence)), with trailing dims, other than the hidden state (a constant
    computed before the loop, a state passed from layer to layer, a slice of per-layer inputs; integer: the
    top-k token indices a DSA layer selects and the next "shared" layers reuse, HY-V4's and Mistral-Large-4's
    `prev_topk_indices`, which carry no gradient). What a later stage's loop computes alike from the inputs
    every stage gets is carried too: copied over an equal value, it changes nothing. Not boolean masks,
    which every stage rebuilds from the inputs it gets."""
    return (isinstance(value, torch.Tensor) and value is not hidden and value.dtype != torch.bool
            and not value.is_complex() and value.ndim > 2 and tuple(value.shape[:2]) == lead)


def _carried_base(value: torch.Tensor, lead: tuple) -> bool:
    """Whether `value` is a view of a larger per-token tensor (the loop's slice of per-layer inputs computed
    before it, Gemma 3n's per_layer_inputs[:, :, i, :]), which is carried whole: the next stage's later
    layers take their own slices of it. Not integer values: indices a layer selects and hands on (a top-k's
    first k of a sort), a state the next stage's loop holds as None and takes as it is."""
    base = value._base
    return (base is not None and value.is_floating_point() and base.ndim >= 2 and tuple(base.shape[:2]) == lead
            and base.numel() > value.numel())


def _layer_entries(layer_kwargs: dict, hidden, ids, part_tuples: Sequence = ()) -> tuple:
    """The first stage's `CarrySpec.layer_entries`: what the loop hands the next stage's first layer that is
    carried (`_carried_layer_input`), "value" or "base" (`_carried_base`). None with a tensor-parallel,
    expert or context split of the tokens (DTensors): the carried values are copied into the later stage's
    own tensors in place (`_take_carried`), which the stages do not do on split tensors; there the later
    stage's loop computes them itself, and the probe refuses it where that differs (`cut_inputs_problem`,
    `placeholder_problem`). `part_tuples`: the tuples of tensors the first stage's modules inside the decoder
    stack gave (their stand-ins on a later stage), carried entry by entry ("tuple:I") where the loop hands one
    to the layers (Mistral-Large-4's rotary (cos, sin), from a rotary embedding with a parameter)."""
    if isinstance(ids, DTensor):
        return ()
    lead = tuple(ids.shape[:2])
    entries = []
    for name, value in layer_kwargs.items():
        if _carried_layer_input(value, hidden, lead) and not isinstance(value, DTensor):
            entries.append((name, "base" if _carried_base(value, lead) else "value"))
        elif _shared_states(value, lead[0]):
            entries += [(name, f"dict:{i}:{key}") for key, states in value.items() for i in range(len(states))]
        elif any(value is t for t in part_tuples) and all(
                v.is_floating_point() and v.ndim > 2 and v.shape[0] in (1, lead[0]) and v.shape[1] == lead[1]
                and not isinstance(v, DTensor) for v in value):
            entries += [(name, f"tuple:{i}") for i in range(len(value))]
    return tuple(entries)


def _shared_states(value, batch: int) -> bool:
    """Whether the loop's `value` for a layer is a dict the layers fill and read, of tuples of batch-first
    tensors under string keys: the K/V a "store" layer leaves for the "reuse" layers after it (transformers'
    KVSharingDict: Gemma 3n's and Gemma 4's `shared_kv_states` per attention type, Mistral-Large-4's per rope
    kind). Entries there at a cut were stored by an earlier stage's layers for the next stage's: carried
    whole, each tensor a piece, the gradient flowing back through them to the layer that computed them."""
    return (isinstance(value, Mapping) and bool(value) and all(
        isinstance(k, str) and isinstance(v, tuple) and v and all(
            isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.ndim >= 2 and t.shape[0] == batch
            for t in v) for k, v in value.items()))


def _layer_pieces(entries: tuple, layer_kwargs: dict, index: int) -> list:
    """The pieces of `entries` from what this stage's loop handed the next stage's first layer (`_Exit`): the
    real values, on a middle stage the carried ones it took in (or what its own layers made of them)."""
    pieces = []
    for name, kind in entries:
        value = layer_kwargs.get(name)
        if kind == "base" and isinstance(value, torch.Tensor):
            value = value._base
        if kind.startswith("tuple:"):
            i = int(kind.split(":", 1)[1])
            value = value[i] if isinstance(value, tuple) and len(value) > i else None
        if kind.startswith("dict:"):
            _, i, key = kind.split(":", 2)
            states = value.get(key) if isinstance(value, Mapping) else None
            if not (isinstance(states, tuple) and len(states) > int(i) and isinstance(states[int(i)], torch.Tensor)):
                raise ValueError(f"pipeline: the decoder loop handed stage {index + 1}'s first layer no {key!r} "
                                 f"entry in {name!r} (states its layers store and later layers reuse), which the "
                                 f"first stage carries (it handed it one there): the stages cannot agree on what "
                                 f"they carry; split the stages elsewhere (split_points), or use dp/tp for this "
                                 f"model")
            pieces.append(states[int(i)])
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"pipeline: the decoder loop handed stage {index + 1}'s first layer no {name!r} "
                             f"{'view of a tensor' if kind == 'base' else 'tensor'}, which the first stage "
                             f"carries (it handed it one there): the stages cannot agree on what they carry; "
                             f"use dp/tp for this model")
        pieces.append(value)
    return pieces


def _piece_count(carry: CarrySpec) -> int:
    """How many pieces the decoder stack's entries of `carry` take (before the layer entries')."""
    count = 0
    for _, kind in carry.entries:
        if kind.startswith("dict:none:"):
            continue
        count += int(kind.split(":")[2]) if kind.startswith("rows:") else 1
    return count


def per_token_inputs(layer_inputs: dict, hidden: torch.Tensor | None) -> dict:
    """The floating (batch, sequence, ...) tensors among what the loop hands a layer besides the hidden state
    (this rank's local pieces, detached): per-layer input embeddings, a second residual stream."""
    if hidden is None:
        return {}
    lead = tuple(hidden.shape[:2])
    return {name: _leave(v).detach() for name, v in layer_inputs.items()
            if isinstance(v, torch.Tensor) and v is not hidden and v.is_floating_point() and v.ndim >= 2
            and tuple(v.shape[:2]) == lead}


def cut_inputs_problem(exit_inputs: dict | None, entry_inputs: dict | None, model_name: str, index: int) -> str | None:
    """Why the per-token inputs the loop hands stage `index`'s first layer on that stage differ from what it
    handed the same layer on the stage before (`exit_inputs`, the whole model's values): computed there from
    modules or inputs of the first stage (Gemma 4's per-layer input embeddings projected from the token
    embeddings), they would reach the layer as placeholders' values, a wrong result no error would show.
    None when they agree (recomputed alike: positions, masks) or cannot be compared (meta tensors)."""
    if exit_inputs is None or entry_inputs is None:
        return None
    for name, want in exit_inputs.items():
        got = entry_inputs.get(name)
        if want.is_meta or got is not None and got.is_meta:
            continue
        if (got is None or got.shape != want.shape or got.dtype != want.dtype
                or not torch.allclose(got.float(), want.float(), rtol=1e-5, atol=1e-6)):
            return (f"pipeline: the decoder loop of {model_name} hands the layers {name!r} (per token, "
                    f"{tuple(want.shape)}), which stage {index} computes otherwise than the stage before it (from "
                    f"modules or inputs only the first stage has: per-layer input embeddings, a second residual "
                    f"stream); the stages hand each other the hidden state only, so stage {index}'s layers would "
                    f"get wrong values: use dp/tp for this model")
    return None


def _encode(captured: dict, call: dict, ids) -> tuple[CarrySpec, list]:
    """What the first stage handed the decoder stack that later stages cannot compute themselves, as
    (batch, sequence, ...) tensors, and the spec that decodes them (what the loop hands the layers besides
    the hidden state: `_layer_entries`)."""
    batch, seq = tuple(ids.shape[:2])
    entries, constants, pieces, masks = [], [], [], {}
    lists = []
    for name, value in captured.items():
        if name in ("input_ids", "inputs_embeds", "use_cache") or value is None:
            continue
        if name in call and value is call[name]:
            continue  # the caller's own input, which every stage gets
        if isinstance(value, (bool, int, float, str)):
            constants.append((name, value))
        elif isinstance(value, torch.Tensor) and tuple(value.shape[:2]) == (batch, seq):
            entries.append((name, "bs"))
            pieces.append(value)
            if value.dtype == torch.bool and value.ndim == 2:
                masks[name] = value
        elif isinstance(value, torch.Tensor) and value.ndim >= 3 and tuple(value.shape[1:3]) == (batch, seq):
            entries.append((name, "kbs"))
            pieces.append(value.movedim(0, -1))
        elif (isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[0] == batch
              and not isinstance(ids, DTensor)):
            # per sample, not per token (Kosmos-2's image embeddings, its text model scatters into its embeddings):
            # carried whole where the tokens are plain tensors (no batch or sequence split to lay it out by)
            entries.append((name, "b"))
            pieces.append(value)
        elif (isinstance(value, dict) and value and not isinstance(ids, DTensor)
              and all(v is None or isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == batch
                      for v in value.values())):
            # masks per attention type (Gemma 3's bidirectional image blocks), batch first
            for key, v in value.items():
                entries.append((name, f"dict:{'none' if v is None else 'b'}:{key}"))
                if v is not None:
                    pieces.append(v)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) and v.ndim == 2
                                                               for v in value):
            lists.append((name, value))
        else:
            raise ValueError(f"pipeline: the decoder stack is handed {name!r} ({type(value).__name__} "
                             f"{tuple(getattr(value, 'shape', ()))}) computed before the decoder layers; the stage "
                             f"cutter carries (batch, ...) tensors to later stages and cannot carry this")
    for name, value in lists:
        rows = value[0].shape[0]
        mask = next((m for m, t in masks.items() if int(t.sum()) == rows), None)
        if mask is None or any(v.shape[0] != rows for v in value):
            raise ValueError(f"pipeline: the decoder stack is handed {name!r}, a list of {len(value)} tensors of "
                             f"{rows} rows, and no (batch, sequence) mask with as many positions to carry them at")
        entries.append((name, f"rows:{mask}:{len(value)}"))
        for v in value:
            dense = v.new_zeros((batch, seq, v.shape[-1]))
            dense[masks[mask]] = v
            pieces.append(dense)
    return CarrySpec(tuple(entries), tuple(constants)), pieces


def _decode(carry: CarrySpec, pieces: Sequence[torch.Tensor], ids, hidden) -> dict:
    """The decoder stack's carried keywords from the received pieces (wrapped in the tokens' layout)."""
    out = dict(carry.constants)
    it = iter(pieces)
    dense_lists = []
    for name, kind in carry.entries:
        if kind.startswith("dict:"):
            _, what, key = kind.split(":", 2)
            out.setdefault(name, {})[key] = None if what == "none" else next(it)
            continue
        if kind.startswith("rows:"):
            _, mask, n = kind.split(":")
            dense_lists.append((name, mask, [_enter(next(it), ids) for _ in range(int(n))]))
            continue
        if kind == "b":
            out[name] = next(it)
            continue
        value = _enter(next(it), ids)
        out[name] = value.movedim(-1, 0) if kind == "kbs" else value
    for name, mask, dense in dense_lists:
        out[name] = [d[out[mask]] for d in dense]
    return out


def _enter(x: torch.Tensor, ids) -> torch.Tensor:
    """A piece received from the previous stage, as the DTensor it was there: laid out as the split tokens
    are (batch over "ep", sequence over "cp"), its trailing dims whole. Plain when the tokens are (tensor
    parallel alone: the hidden state between layers is whole on every rank)."""
    if not isinstance(ids, DTensor):
        return x
    layout = ids.dist_layout
    extra = x.ndim - 2
    piece_layout = layout.with_map(tuple(layout.tensor_map) + ((),) * extra, layout.partial)
    return DTensor.from_local(x, piece_layout, shape=tuple(ids.shape) + tuple(x.shape[2:]))


def _leave(t: torch.Tensor) -> torch.Tensor:
    """What crosses a stage boundary is this rank's local piece, a plain tensor (torch's P2P knows nothing of
    our DTensors): a pending sum is reduced first, a split stays split."""
    if isinstance(t, DTensor):
        if t.dist_layout.has_partial:
            t = t.redistribute(t.dist_layout.without_partial())
        return t.to_local()
    return t


@functools.lru_cache(maxsize=None)
def _signature_parameters(forward) -> tuple | None:
    """`forward`'s parameters (inspect.Parameter), None where it has no signature; once per function (every
    stage's forward call asks)."""
    try:
        return tuple(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None


def _parameters(forward) -> tuple:
    """The names of `forward`'s own parameters (not what a **kwargs takes)."""
    return tuple(p.name for p in _signature_parameters(forward) or ())


def _token_input(value, ids) -> bool:
    """Whether a caller's input is one per token of ids, types or flags (Kosmos-2's image_embeds_position_mask,
    Molmo2's mm_token_type_ids), which a later stage hands the model's forward as the first stage does, as it
    does the attention mask: the forward reads it beside the towers (where an image's features go, which
    positions attend both ways), not only in them."""
    return (isinstance(value, torch.Tensor) and value is not ids and not value.is_floating_point()
            and value.ndim >= 2 and tuple(value.shape[:2]) == tuple(ids.shape[:2]))


def _required(forward) -> tuple:
    """The names of `forward`'s parameters that have no default (after `self`): a call must give them."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in (_signature_parameters(forward) or ())[1:]
                 if p.default is inspect.Parameter.empty and p.kind in kinds)


def forward_names(model: nn.Module, name: str) -> bool:
    """Whether the model class's forward names parameter `name` itself (a **kwargs does not count)."""
    return name in _parameters(type(model).forward)


def accepts(forward, name: str) -> bool:
    """Whether `forward` takes keyword `name` (or any keyword)."""
    params = _signature_parameters(forward)
    return params is None or any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
