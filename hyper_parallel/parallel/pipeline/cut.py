"""Cutting a Hugging Face decoder-only causal LM into pipeline stages that keep its own layer code.

A stage is a *view* of the model: a shallow copy of the root, of its base model and of the layer list, in
which every module the stage does not run is None. The view keeps the original attribute paths, so its
parameters carry the model's own names (`model.layers.5.mlp.up_proj.weight`) and `shard` plans, `hsdp`
and checkpoints address it exactly as they address the whole model. Its forward is the base model's
forward restricted to its layers: embeddings on the first stage, then per stage the rotary position
embeddings and the attention masks are recomputed from the positions (so only the hidden state travels
between stages), the stage's decoder layers are called with the model's own forward code, and the last
stage applies the final norm and the head (the loss is the pipeline's loss function).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ...dtensor.dtensor import DTensor
from ..feed import feed_of


@dataclass(frozen=True)
class Recipe:
    """Where a known causal-LM class keeps its parts and how it picks each layer's attention mask.

    mask: "causal" (one causal mask), "layer_types" (config.layer_types[i] names a full or sliding
    mask per layer, as Qwen2/Qwen3 do), "sliding_if_window" (a sliding mask for every layer when
    config.sliding_window is set, as Mistral/Qwen3-MoE do).
    """
    mask: str
    base: str = "model"
    embed: str = "embed_tokens"
    layers: str = "layers"
    rotary: str = "rotary_emb"
    norm: str = "norm"
    head: str = "lm_head"


# The classes whose forward the stage forward reproduces (checked against transformers' modeling code).
RECIPES: dict[str, Recipe] = {
    "LlamaForCausalLM": Recipe("causal"),
    "DeepseekV3ForCausalLM": Recipe("causal"),
    "Qwen3ForCausalLM": Recipe("layer_types"),
    "Qwen2ForCausalLM": Recipe("layer_types"),
    "Qwen3MoeForCausalLM": Recipe("sliding_if_window"),
    "MistralForCausalLM": Recipe("sliding_if_window"),
}


def recipe_for(model: nn.Module) -> Recipe:
    """The recipe of `model`'s class, or a ValueError that names the class and the known ones."""
    name = type(model).__name__
    recipe = RECIPES.get(name)
    if recipe is None:
        raise ValueError(f"pipeline: the stage cutter does not know {name}; it cuts "
                         f"{', '.join(sorted(RECIPES))}. Add a Recipe for it in "
                         f"hyper_parallel/parallel/pipeline/cut.py (base model, layer list, mask rule) once "
                         f"its base model forward matches the Llama pattern")
    base = getattr(model, recipe.base, None)
    for part in (recipe.embed, recipe.layers, recipe.rotary, recipe.norm):
        if base is None or not hasattr(base, part):
            raise ValueError(f"pipeline: {name} has no {recipe.base}.{part}; the cutter expects the standard "
                             f"transformers layout")
    config = model.config
    if getattr(config, "output_router_logits", False):
        raise ValueError(f"pipeline: {name} has config.output_router_logits=True: the router auxiliary loss "
                         f"spans every stage and the pipeline's loss does not add it; set it to False")
    return recipe


def layer_list(model: nn.Module, recipe: Recipe) -> nn.ModuleList:
    return getattr(getattr(model, recipe.base), recipe.layers)


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def part_weights(model: nn.Module, recipe: Recipe) -> tuple[list[int], int, int]:
    """Parameter counts: per decoder layer, of what the first stage adds, of what the last stage adds."""
    base = getattr(model, recipe.base)
    layers = [_numel(layer) for layer in layer_list(model, recipe)]
    first = _numel(getattr(base, recipe.embed))
    last = _numel(getattr(base, recipe.norm)) + _numel(getattr(model, recipe.head, None))
    return layers, first, last


# ---- balancing --------------------------------------------------------------------------------------
def balance(layer_weights: Sequence[int], n_stages: int, first: int = 0, last: int = 0) -> list[range]:
    """Cut layers 0..L-1 into `n_stages` contiguous non-empty runs minimising the heaviest stage.

    Stage 0 also carries `first` (embeddings), the last stage `last` (norm and head). Exact dynamic
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
    # best[s][j]: minimal max over stages 0..s covering layers 0..j-1; cut[s][j]: where stage s starts
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
            if not tail.isdigit() or not (point == tail or point.endswith(f"layers.{tail}")):
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


def prune(model: nn.Module, recipe: Recipe, keep_layers: set, first: bool, last: bool) -> None:
    """Drop, in place, every part of `model` that none of this rank's stages runs (set to None)."""
    base = getattr(model, recipe.base)
    layers = layer_list(model, recipe)
    for i in range(len(layers)):
        if i not in keep_layers:
            layers._modules[str(i)] = None
    if not first:
        setattr(base, recipe.embed, None)
    if not last:
        setattr(base, recipe.norm, None)
        setattr(model, recipe.head, None)


def stage_view(model: nn.Module, recipe: Recipe, spec: StageSpec) -> nn.Module:
    """A view of the (pruned) model that runs only stage `spec`; see the module docstring."""
    view = _shallow(model)
    base = _shallow(getattr(model, recipe.base))
    layers = _shallow(layer_list(model, recipe))
    for key in list(layers._modules):
        if int(key) not in spec.layers:
            layers._modules[key] = None
    base._modules[recipe.layers] = layers
    if not spec.first:
        base._modules[recipe.embed] = None
    if not spec.last:
        base._modules[recipe.norm] = None
        view._modules[recipe.head] = None
    view._modules[recipe.base] = base
    view.__class__ = _stage_class(type(model))
    view.__dict__["_hp_stage"] = (recipe, spec)
    return view


_STAGE_CLASSES: dict = {}


def _stage_class(cls: type) -> type:
    if cls not in _STAGE_CLASSES:
        _STAGE_CLASSES[cls] = type(f"PipelineStage{cls.__name__}", (cls,), {"forward": stage_forward})
    return _STAGE_CLASSES[cls]


def stage_forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None,
                  attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """input_ids (first stage) or the previous stage's local piece of the hidden state -> this rank's
    piece of the hidden state, or of the logits (last stage).

    Every stage receives the micro-batch's `input_ids` too: the stage's input steps (expert parallel's
    batch shares, context parallel's sequence split; feed.py) run on them, giving the split masks and
    positions and the layout of the tokens, which the hidden state piece received from the previous stage
    is wrapped in."""
    recipe, spec = self.__dict__["_hp_stage"]
    base = getattr(self, recipe.base)
    ids = x if spec.first else input_ids
    inputs = {k: v for k, v in (("input_ids", ids), ("attention_mask", attention_mask),
                                ("position_ids", position_ids)) if v is not None}
    stage_feed = feed_of(self)
    steps = stage_feed.steps if stage_feed is not None else []
    for step in steps:
        _, inputs = step.apply(self, (), inputs)
    ids, attention_mask, position_ids = (inputs.get(k) for k in ("input_ids", "attention_mask", "position_ids"))
    hidden = getattr(base, recipe.embed)(ids) if spec.first else _enter(x, ids)
    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    masks = _masks(recipe, self.config, hidden, attention_mask, position_ids)
    position_embeddings = getattr(base, recipe.rotary)(hidden, position_ids)
    layers = getattr(base, recipe.layers)
    for i in spec.layers:
        hidden = layers[i](hidden, attention_mask=masks[i], position_embeddings=position_embeddings,
                           position_ids=position_ids, use_cache=False)
    if spec.last:
        for step in steps:
            restore = getattr(step, "restore_order", None)
            hidden = restore(hidden) if restore is not None else hidden
        hidden = getattr(self, recipe.head)(getattr(base, recipe.norm)(hidden))
    return _leave(hidden)


def _enter(x: torch.Tensor, ids) -> torch.Tensor:
    """The hidden state piece received from the previous stage, as the DTensor it was there: laid out as
    the split tokens are (batch over "ep", sequence over "cp"), the hidden dim whole. Plain when the
    tokens are (tensor parallel alone: the hidden state between layers is whole on every rank)."""
    if not isinstance(ids, DTensor):
        return x
    layout = ids.dist_layout
    hidden_layout = layout.with_map(tuple(layout.tensor_map) + ((),), layout.partial)
    return DTensor.from_local(x, hidden_layout, shape=tuple(ids.shape) + (x.shape[-1],))


def _leave(t: torch.Tensor) -> torch.Tensor:
    """What crosses a stage boundary is this rank's local piece, a plain tensor (torch's P2P knows nothing of
    our DTensors): a pending sum is reduced first, a split stays split."""
    if isinstance(t, DTensor):
        if t.dist_layout.has_partial:
            t = t.redistribute(t.dist_layout.without_partial())
        return t.to_local()
    return t


def _masks(recipe: Recipe, config, hidden: torch.Tensor, attention_mask, position_ids) -> dict:
    """Layer index -> the attention mask the model's own forward would hand that layer."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    kwargs = dict(config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None,
                  position_ids=position_ids)
    n = config.num_hidden_layers
    if recipe.mask == "layer_types":
        types = config.layer_types
        made = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in types:
            made["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return {i: made[types[i]] for i in range(n)}
    if recipe.mask == "sliding_if_window" and getattr(config, "sliding_window", None) is not None:
        mask = create_sliding_window_causal_mask(**kwargs)
    else:
        mask = create_causal_mask(**kwargs)
    return dict.fromkeys(range(n), mask)
