"""`pipeline(model, mesh, axis="pp", ...)`: pipeline parallelism on torch.distributed.pipelining's schedules.

    mesh = init_device_mesh("cpu", (2, 2), ("pp", "dp"))
    pipe = pipeline(model, mesh, schedule="1f1b", n_microbatches=4, hsdp={})
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    loss = pipe.step(input_ids, labels=labels)     # this rank's micro-batch (API §12); loss on every rank
    opt.step(); opt.zero_grad()

What happens (top to bottom in `pipeline`): the model is cut into pp * stages_per_rank stages along its
decoder layer list (cut.py); each rank keeps the stages the schedule gives it and drops every other
module; each stage is parallelised over the mesh's other axes with `parallelize`'s own steps (`shard` on
"tp", expert parallel on "ep", `context_parallel` on "cp", `hsdp` on "dp"); torch's PipelineStage
objects run the stages over the pp axis's process group, driven by the chosen torch schedule. The ranks
of one pp group feed the same micro-batch, each data-parallel ("dp", "ep") rank its own share; the
first stage splits it as the stage's parallelisms say, and what crosses a stage boundary is each rank's
local piece of the hidden state. The last stage trains on the model's own loss (`loss="auto"`: the shifted
token cross-entropy computed from the logits where that is it, else `output.loss` itself) or a given one,
each micro-batch's weighted by its share of the global batch's counted labels (`LossRule`), so the loss and
the gradients equal one device's `model(input_ids, labels=labels).loss` on the whole batch, whatever the
micro-batching or the padding; what cannot be weighted exactly is refused on every rank.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from ...layout.mesh import DeviceMesh
from ...redistribute import collectives
from ...redistribute import check as _check
from .. import feed
from ..dims import CP, DP, EP, TP, ParallelDims
from ..shard import init_parameters
from ..surgery import embeddings, export, record_applied
from . import cut, tie
from .state import stage_owner_meshes, whole_state_dict

# name -> (torch schedule class, placement of stages on ranks: "loop" (stage s on rank s % pp) or "v")
SCHEDULES: dict[str, tuple[str, str]] = {
    "gpipe": ("ScheduleGPipe", "loop"),
    "1f1b": ("Schedule1F1B", "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
}
_SINGLE_STAGE = {"gpipe", "1f1b"}
IGNORE_INDEX = -100
STAGE_ARGUMENTS = ("tp", "ep", "cp", "hsdp")
LOSSES = ("auto", "shifted", "own")
LossArgument = Union[str, Callable[[Any, dict], torch.Tensor]]


@dataclass(frozen=True)
class LossRule:
    """What the last stage trains on and how the micro-batches' losses make the global batch's (decided by the
    probe once per input shape, the same on every rank): each micro-batch's loss is weighted by its share of
    the global batch's `count`, so the sum is one device's loss on the whole batch.

    kind: "shifted" (the token cross-entropy against the labels shifted by one, from the last stage's logits),
    "own" (the model's `output.loss`, its forward handed labels=) or "given" (the `loss=` callable).
    count: "shifted" (labels shifted by one other than -100: a token mean of that rule), "tokens" (labels other
    than -100, unshifted: TrOCR's, XLNet's), "micro" (one per micro-batch: a mean of the micro-batches' means,
    exact for a per-sample mean on equal micro-batches, and for the model's own loss only where every
    micro-batch counts as many labels: `Pipeline._check_label_counts`)."""
    kind: str = "shifted"
    count: str = "shifted"


def stage_rank(stage: int, pp: int, style: str) -> int:
    """pp coordinate that runs global stage `stage`."""
    if style == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def pipeline(model: nn.Module, mesh: DeviceMesh, axis: str = "pp", *, schedule: str = "1f1b",
             n_microbatches: int = 4, stages_per_rank: int = 1, split_points=None, loss: LossArgument = "auto",
             **parallelize_kwargs: Any) -> "Pipeline":
    """Cut `model` into pipeline stages over `mesh`'s `axis` and return the `Pipeline` that trains it.

    schedule: "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb" (stages_per_rank >= 1)
    or "zbv" (stages_per_rank == 2). split_points: the first layer of stages 1.. (indices or names like
    "model.layers.4"); by default stages are balanced by parameter count. parallelize_kwargs: `tp=`
    (a `shard` plan, "auto" for the model's own), `ep=`, `cp=` (context-parallel method) and `hsdp=` (a dict
    of `hsdp` arguments), as `hyper_parallel.parallelize` takes them, applied to every stage over the mesh's
    other axes ("tp", "ep", "cp", "dp"). The model is pruned in place: afterwards it holds only this rank's
    stages. A model on the meta device gets memory for this rank's stages only (random values, as
    `init_parameters` gives; `from_pretrained` loads them instead).

    loss: what `Pipeline.step` trains on, always one device's loss on the whole batch whatever the micro-batching
    (`LossRule`), else refused on every rank before any stage runs:
    - "shifted": the token cross-entropy against the labels shifted by one (transformers' causal-LM loss),
      computed from the last stage's logits and divided by the global batch's count of valid tokens; refused
      where the model's own loss is another one;
    - "own": the model's own `output.loss`, its last stage's forward handed the micro-batch's labels; its
      micro-batches weighted by their label counts where it is a token cross-entropy (shifted or not), else
      averaged, which needs every micro-batch to count as many labels (other than -100, or the pad token);
    - "auto" (default): "shifted" where that is the model's own loss (or it computes none), else "own";
    - a callable `loss(outputs, micro_batch) -> scalar tensor`: the mean loss of one micro-batch, from the last
      stage's model output (its forward run without labels=) and the micro-batch's inputs as this rank feeds
      them (input_ids, the other inputs, "labels" when given); the global loss is the mean of the micro-batches'
      (over every data-parallel rank), one device's for a loss that averages per-sample terms (the micro-batches
      are equal: the batch must divide into them). Labels are optional then.
    """
    return build_pipeline(model, mesh, axis, schedule=schedule, n_microbatches=n_microbatches,
                          stages_per_rank=stages_per_rank, split_points=split_points, loss=loss,
                          initialize=True, **parallelize_kwargs)


def build_pipeline(model: nn.Module, mesh: DeviceMesh, axis: str = "pp", *, schedule: str = "1f1b",
                   n_microbatches: int = 4, stages_per_rank: int = 1, split_points=None, initialize: bool = True,
                   loss: LossArgument = "auto", **parallelize_kwargs: Any) -> "Pipeline":
    """`pipeline`'s body; `initialize=False` leaves a meta model's stages on the meta device, laid out (for
    `from_pretrained`, which allocates each rank's pieces and reads them from the folder)."""
    dims = ParallelDims.of(mesh, "pipeline", allow_other_axes=True)
    _check_loss(loss, dims)
    # a model without a head trains on its own loss only where its forward takes labels (else on a given loss)
    structure = cut.find_structure(model, need_head=loss == "shifted" or not callable(loss)
                                   and not cut.forward_names(model, "labels"))
    pp = mesh.size(axis)
    _check_arguments(model, schedule, n_microbatches, stages_per_rank, pp)
    cut.check_model(model, structure, pp * stages_per_rank)
    stage_dims = _check_parallelize_kwargs(dims, axis, parallelize_kwargs)
    _check_stage_context(model, stage_dims)
    style = SCHEDULES[schedule][1]
    n_stages = pp * stages_per_rank

    layer_weights, first_weight, last_weight = cut.part_weights(model, structure)
    if split_points is None:
        ranges = cut.balance(layer_weights, n_stages, first_weight, last_weight)
    else:
        ranges = cut.stages_from_split_points(split_points, len(layer_weights), n_stages, structure.layers_path)
    specs = [cut.StageSpec(s, n_stages, ranges[s]) for s in range(n_stages)]
    owner = [stage_rank(s, pp, style) for s in range(n_stages)]
    me = mesh.get_local_rank(axis)
    mine = [spec for spec in specs if owner[spec.index] == me]

    whole_meta = {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()}
    key_owner = _key_owners(whole_meta, specs, owner, structure)

    attributes = cut.layer_attributes(model, structure)
    has_head = isinstance(embeddings(model, "output"), nn.Module)   # before pruning, which may remove what it reads
    tied = tie.tied_names(model, structure.last)
    cut.prune(model, structure, {i for spec in mine for i in spec.layers},
              any(s.first for s in mine), any(s.last for s in mine))
    if initialize and any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        init_parameters(model)   # a meta build: materialise only this rank's stages
    tied = tie.tie_across_stages(model, mesh, axis, tied, owner[0], owner[-1])
    if tied is not None and initialize:
        tied.broadcast_values(model)
    carry: dict = {}   # what the first stage hands the decoder stack besides the hidden state (cut.CarrySpec)
    views = [cut.stage_view(model, structure, spec, carry, attributes) for spec in mine]
    _parallelize_stages(model, views, stage_dims, parallelize_kwargs)
    if tied is not None:
        tied.check_layouts(model, mesh)

    pipe = Pipeline(model, views, mine, mesh, axis, schedule, n_microbatches, structure, key_owner, whole_meta,
                    carry, owner[0], tied, loss, has_head)
    layout = ", ".join(f"stage {s.index}: layers {s.layers.start}-{s.layers.stop - 1} on {axis}={owner[s.index]}"
                       for s in specs)
    record_applied(model, f"pp: {n_stages} stages over {axis!r} ({schedule}, {n_microbatches} micro-batches; "
                          f"{layout})")
    return pipe


def _check_arguments(model: nn.Module, schedule: str, n_microbatches: int, stages_per_rank: int, pp: int) -> None:
    """Everything decided from arguments alone, so that an error is raised on every rank."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline: unknown schedule {schedule!r}; use one of {sorted(SCHEDULES)}")
    if stages_per_rank < 1 or n_microbatches < 1:
        raise ValueError(f"pipeline: stages_per_rank ({stages_per_rank}) and n_microbatches ({n_microbatches}) "
                         f"must be positive")
    if schedule in _SINGLE_STAGE and stages_per_rank != 1:
        raise ValueError(f"pipeline: schedule {schedule!r} runs one stage per rank; use 'interleaved_1f1b' "
                         f"(or 'interleaved_zb', 'zbv') for stages_per_rank={stages_per_rank}")
    if schedule == "zbv" and stages_per_rank != 2:
        raise ValueError("pipeline: schedule 'zbv' runs exactly two stages per rank (a V): stages_per_rank=2")


def _check_loss(loss: LossArgument, dims: ParallelDims) -> None:
    """The `loss=` argument, checked before anything changes (every rank alike). The model's own loss and a given
    one are a micro-batch's whole loss: with the sequence split over "cp" each rank holds a chunk of it."""
    if not callable(loss) and loss not in LOSSES:
        raise ValueError(f"pipeline: unknown loss {loss!r}; use one of {', '.join(map(repr, LOSSES))} or a callable "
                         f"loss(outputs, micro_batch) -> tensor")
    if loss not in ("auto", "shifted") and dims.size(CP) > 1:
        raise NotImplementedError(f"pipeline: loss={'a callable' if callable(loss) else repr(loss)} with context "
                                  f"parallelism ('cp' axis): each cp rank holds a chunk of the sequence, not the "
                                  f"micro-batch the loss is computed on; use loss='shifted' with 'cp'")


def _check_stage_context(model: nn.Module, stage_dims: ParallelDims | None) -> None:
    """A multimodal model's sequence is split at its language model's entry (context/multimodal.py), which a
    pipeline's later stages never call (they run the decoder layers on the hidden state they receive): refused
    before anything changes, on every rank alike."""
    from ..context.multimodal import language_model_of
    if stage_dims is not None and stage_dims.size(CP) > 1 and language_model_of(model) is not None:
        raise NotImplementedError(
            f"pipeline: context parallelism ('cp' axis) inside the stages of the multimodal "
            f"{type(model).__name__} is not supported; use 'cp' without 'pp', or 'pp' with 'dp'/'tp'/'ep'")


def _check_parallelize_kwargs(dims: ParallelDims, axis: str, kwargs: dict) -> ParallelDims | None:
    """parallelize's own request check on the stage mesh (the mesh without `axis`), before anything changes;
    returns the stage mesh's dims (None: the mesh is the pp axis alone)."""
    unknown = set(kwargs) - set(STAGE_ARGUMENTS)
    if unknown:
        raise ValueError(f"pipeline: unknown arguments {sorted(unknown)}; besides its own, pipeline takes "
                         f"{', '.join(a + '=' for a in STAGE_ARGUMENTS)} (applied by hyper_parallel.parallelize to "
                         f"each stage)")
    stage_mesh = dims.without(axis)
    from ..parallelize import check_request
    if stage_mesh is None:
        asked = [k for k, v in kwargs.items() if v not in (None, False) and not (k == "tp" and v == "auto")]
        if asked:
            raise ValueError(f"pipeline: {sorted(asked)} need 'dp'/'tp'/'ep'/'cp' axes beside {axis!r}; the mesh "
                             f"has {dims.names}")
        return None
    stage_dims = ParallelDims.of(stage_mesh, "pipeline")
    check_request(stage_dims, where="pipeline", **kwargs)
    return stage_dims


def _parallelize_stages(model: nn.Module, views: list, stage_dims: ParallelDims | None, kwargs: dict) -> None:
    """`parallelize` each stage over the mesh's other axes: shard on "tp", experts on "ep", the sequence on
    "cp", then hsdp on "dp".

    Stage by stage, not the whole pruned model: every stage is a root the schedule calls, so hsdp's
    root hooks must sit on it; the stages share no parameters, so each is laid out once. What each
    applied is noted on the model too (for `summary`).
    """
    if stage_dims is None:
        return
    from ..parallelize import apply_parallelisms
    applied = model.__dict__.setdefault("_hp_applied", [])
    kwargs = {k: v for k, v in kwargs.items() if k != "ep"}
    for view in views:
        apply_parallelisms(view, stage_dims, **kwargs)
        applied += [text for text in view.__dict__.get("_hp_applied", []) if text not in applied]


def _key_owners(whole_meta: dict, specs: list, owner: list, structure: cut.Structure) -> dict:
    """state_dict key -> pp coordinate of the rank that holds it (buffers of modules every stage keeps: the
    first stage's)."""
    prefix = f"{structure.layers_path}."
    first_keys = tuple(f"{p}." for p in structure.first)
    last_keys = tuple(f"{p}." for p in structure.last)
    layer_owner = {i: owner[s.index] for s in specs for i in s.layers}
    out = {}
    for key in whole_meta:
        if key in structure.last_params:
            out[key] = owner[-1]
        elif key.startswith(prefix):
            out[key] = layer_owner[int(key[len(prefix):].split(".", 1)[0])]
        elif key.startswith(first_keys):
            out[key] = owner[0]
        elif key.startswith(last_keys):
            out[key] = owner[-1]
        else:
            out[key] = owner[0]  # a buffer of a module without parameters, which every stage keeps
    return out


class Pipeline:
    """This rank's stages of a pipelined model and the torch schedule that runs them."""

    def __init__(self, model: nn.Module, views: list, specs: list, mesh: DeviceMesh, axis: str, schedule: str,
                 n_microbatches: int, structure: cut.Structure, key_owner: dict, whole_meta: dict,
                 carry: dict | None = None, first_owner: int = 0, tied: tie.Tie | None = None,
                 loss: LossArgument = "auto", has_head: bool = True):
        self.model = model                  # pruned: holds this rank's stages, under the original names
        self.stages = views                 # one module per local stage (cut.stage_view)
        self.specs = specs
        self.mesh, self.axis, self.schedule_name = mesh, axis, schedule
        self.n_microbatches = n_microbatches
        self.structure = structure
        self._carry = carry if carry is not None else {}   # shared with the stages (cut.stage_view)
        self._first_owner = first_owner
        self._tied = tied                   # the embeddings' weight tied to the head on another stage (tie.py)
        self.pp = mesh.size(axis)
        self.group = mesh.get_group(axis)
        dims = ParallelDims.of(mesh, "pipeline", allow_other_axes=True)
        self.dp = dims.size(DP)  # hsdp averages gradients over "dp": each rank's loss is scaled back up by it
        # the ranks whose losses are pieces of the global one: data shares ("dp", "ep") and sequence chunks ("cp")
        self._piece_groups = [mesh.get_group(a) for a in (DP, EP, CP) if dims.size(a) > 1]
        self._data_groups = [mesh.get_group(a) for a in (DP, EP) if dims.size(a) > 1]
        self.cp, self.cp_rank = dims.size(CP), dims.coordinate(CP)
        self.cp_group = mesh.get_group(CP) if self.cp > 1 else None
        # what the ranks feed: the same micro-batch over pp, "tp" and "cp", equal-shaped shares over "ep"
        self._feed = feed.Feed(mesh.root, same_feed_axes={axis, TP, CP} & set(mesh.root.mesh_dim_names),
                               equal_share_axes={EP} & set(mesh.root.mesh_dim_names))
        first_feed = feed.feed_of(views[0]) if views else None
        self._stage_refusals = [s.refuse for s in first_feed.steps] if first_feed is not None else []
        self.device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
            else torch.device(mesh.device_type)
        n_stages = specs[0].n_stages
        self.last_owner = stage_rank(n_stages - 1, self.pp, SCHEDULES[schedule][1])
        self._schedules: dict = {}
        self._carry_specs: dict = {}   # (input shapes, labels shape, train) -> (cut.CarrySpec, LossRule)
        self._key_owner = key_owner          # state_dict key -> pp coordinate holding it
        self._whole_meta = whole_meta        # state_dict key -> (shape, dtype) of the whole model
        self._owner_meshes = stage_owner_meshes(mesh, mesh.axis_index(axis))
        self.loss = loss                     # the `loss=` argument (pipeline)
        self._has_head = has_head            # the model has an output head (logits for loss="shifted")
        self._rule = LossRule()              # this step's
        self._valid_tokens = 1               # the global batch's count of the rule's counted labels
        self._loss_scale = 1.0
        # hp.plan's stand-ins for the other stages' ranks when this rank is played on meta tensors over a fake
        # process group, which moves nothing (tools/plan.py, PipelinePeers): what the probe's broadcasts would
        # have brought, and the schedule that replaces torch's (whose P2P warm-up reads values)
        self.stand_ins = None

    # ---- the parameters, as the optimizer and the checkpoint see them --------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the original model names (`model.layers.3.mlp.up_proj.weight`)."""
        return self.model.named_parameters()

    def state_dict(self) -> dict:
        """Every key of the whole model; this rank's tensors for its stages, placeholders for the others.

        Tensors are DTensors whose mesh holds exactly the ranks that own them, so `checkpoint.save`
        writes the whole model across the pp ranks and `checkpoint.load` fills only this rank's part.
        """
        return whole_state_dict(self)

    def save_pretrained(self, path, *, max_shard_size: int | str = "50GB", overwrite: bool = True) -> None:
        """The whole model as a standard Hugging Face folder (every rank calls it): each tensor is sent to
        rank 0 by its stage's owners, so plain transformers loads the folder on one device."""
        export(self, path, overwrite=overwrite, max_shard_size=max_shard_size)

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Load a whole-model state dict (plain tensors): each rank takes its stages' entries."""
        own = self.model.state_dict()
        picked = {k: v for k, v in state_dict.items() if k in own}
        missing = set(own) - set(picked)
        if strict and missing:
            raise KeyError(f"Pipeline.load_state_dict: missing {sorted(missing)[:5]}")
        return self.model.load_state_dict(picked, strict=strict)

    def train(self, mode: bool = True) -> "Pipeline":
        self.model.train(mode)
        return self

    def eval(self) -> "Pipeline":
        return self.train(False)

    # ---- running --------------------------------------------------------------------------------------
    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor:
        """Forward and backward over the micro-batches; the loss of the global batch on every rank.

        Each rank passes its own micro-batch (API §12): the ranks of one pp, "tp" or "cp" group the same
        one, each data-parallel rank its share. Gradients accumulate into the parameters' `.grad` (call the
        optimizer's zero_grad between steps, as usual). `labels` may be omitted with a `loss=` callable; with
        loss="own" or a callable they may have another shape than input_ids (MusicGen's codebooks), rows that
        divide into the micro-batches as the inputs' do.
        """
        inputs = _positions_per_row(input_ids, inputs)
        self._check_feed("Pipeline.step", input_ids, labels, inputs, need_labels=not callable(self.loss))
        inputs = cut.with_batch_positions(self.model, input_ids, inputs, self.n_microbatches)
        schedule = self._prepare(input_ids, inputs, train=True, labels=labels)
        rule = self._rule
        kwargs = dict(input_ids=input_ids, **inputs)
        if rule.kind == "shifted":
            target = labels
            counted = (_shifted(labels) != IGNORE_INDEX).sum().to(torch.float32).reshape(1).to(self.device)
        else:
            target = _row_counts(labels, rule.count, self.n_microbatches).to(self.device)
            counted = target.sum().reshape(1)
            if labels is not None:
                kwargs[cut.LABELS] = labels
        for group in self._data_groups:   # the counted labels of the global batch
            collectives.all_reduce_(counted, group)
        self._valid_tokens = 1.0 if counted.is_meta else max(float(counted), 1.0)   # meta (hp.plan): no values
        self._loss_scale = float(self.dp)
        if rule.kind == "own":
            self._check_label_counts(rule, labels, target)
        losses: list = []
        args = (input_ids,) if self._has_first() else ()
        held = self._tied.hold_gradient(self.model) if self._tied is not None else None
        last = [view.__dict__["_hp_stage"] for view, spec in zip(self.stages, self.specs) if spec.last]
        for state in last:   # the last stage returns the micro-batch's loss (cut.stage_forward)
            state.loss = None if rule.kind == "shifted" else _own_loss if rule.kind == "own" else self.loss
            state.loss_takes_labels = rule.kind == "own"
        try:
            self._run(schedule, args, kwargs, target=target, losses=losses, return_outputs=False)
        finally:
            for state in last:
                state.loss, state.loss_takes_labels = None, False
        if self._tied is not None:
            self._tied.sum_gradients(self.model, held)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses:
            total = torch.stack([loss.detach().float() for loss in losses]).sum() / self._loss_scale
        for group in self._piece_groups:
            collectives.all_reduce_(total, group)
        return self._from_last(total)

    @torch.no_grad()
    def eval_forward(self, input_ids: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """Logits of this rank's micro-batch, on every rank (forward only, through the same stages)."""
        inputs = _positions_per_row(input_ids, inputs)
        self._check_feed("Pipeline.eval_forward", input_ids, None, inputs, need_labels=False)
        inputs = cut.with_batch_positions(self.model, input_ids, inputs, self.n_microbatches)
        schedule = self._prepare(input_ids, inputs, train=False)
        args = (input_ids,) if self._has_first() else ()
        out = self._run(schedule, args, dict(input_ids=input_ids, **inputs))
        config = self.model.config
        vocab = (config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size
        shape = (input_ids.shape[0], input_ids.shape[1] // self.cp, vocab)
        logits = out if out is not None else torch.zeros(shape, device=self.device)
        logits = self._from_last(logits.float().contiguous())
        if self.cp_group is not None:  # each cp rank holds a chunk of the sequence
            logits = collectives.all_gather(logits, 1, self.cp_group, [logits.shape[1]] * self.cp)
        return logits

    # ---- helpers ----------------------------------------------------------------------------------------
    def _has_first(self) -> bool:
        return any(s.first for s in self.specs)

    def _check_feed(self, call: str, input_ids, labels, inputs: dict, need_labels: bool) -> None:
        """Every rank's inputs compared and refused alike, before any stage runs (feed.py)."""
        named = {"input_ids": input_ids, **inputs}
        if labels is not None:
            named["labels"] = labels
        refusals = [lambda _: self._refuse(call, input_ids, labels, inputs, need_labels)] + self._stage_refusals
        feed.check_feed(self._feed, named, refusals, call=call)

    def _refuse(self, call: str, input_ids, labels, inputs: dict, need_labels: bool) -> str | None:
        """Why this rank's inputs cannot run through the pipeline (local shapes only), or None."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            return f"{call}: input_ids must be a (batch, sequence) tensor, got {getattr(input_ids, 'shape', input_ids)}"
        batch = input_ids.shape[0]
        if need_labels and labels is None:
            return (f"{call} needs labels= (the loss is computed on the last stage; pipeline(loss=callable) trains "
                    f"on a loss of the model's outputs, with or without labels)")
        shape = tuple(getattr(labels, "shape", ()))
        if labels is not None and (not isinstance(labels, torch.Tensor) or shape != tuple(input_ids.shape)):
            # labels of another shape (MusicGen's per codebook) only for a loss that reads them itself: by default
            # they are one per token, and another shape is the feed's mistake
            if self.loss in ("auto", "shifted") or not isinstance(labels, torch.Tensor) or labels.ndim == 0:
                return (f"{call}: labels of shape {shape} do not match input_ids {tuple(input_ids.shape)}; give one "
                        f"label per token (-100 where no loss is wanted), or pipeline(loss='own') to train on the "
                        f"model's own loss of its labels")
            if shape[0] % self.n_microbatches:
                return (f"{call}: labels of shape {shape} have rows that do not divide into n_microbatches="
                        f"{self.n_microbatches} equal parts")
        problem = feed.token_inputs_problem(call, inputs, batch, input_ids.shape[1], ("attention_mask", "position_ids"))
        if problem:   # a stage would fail on its own while the others wait for its activations
            return problem
        if batch % self.n_microbatches:
            return (f"{call}: this rank's batch of {batch} rows must divide into n_microbatches="
                    f"{self.n_microbatches} equal micro-batches")
        for name, value in inputs.items():
            if not isinstance(value, torch.Tensor) or value.ndim == 0:
                return (f"{call}: input {name!r} must be a tensor with the batch ({batch}) first; got "
                        f"{type(value).__name__} {tuple(getattr(value, 'shape', ()))}")
            if value.shape[0] == 1 and batch > 1 and self.n_microbatches > 1:
                return (f"{call}: input {name!r} of shape {tuple(value.shape)} packs the whole batch into one row "
                        f"(image patches of every sample along one dimension: NaViT packing); the schedule cuts "
                        f"every input into micro-batches along dim 0 and cannot give each micro-batch its samples' "
                        f"part of it: use n_microbatches=1, or dp/tp for this model")
            if value.shape[0] != batch and value.shape[0] % self.n_microbatches:
                return (f"{call}: input {name!r} of shape {tuple(value.shape)} has neither the batch ({batch}) "
                        f"first nor rows (images, patches) that divide into n_microbatches={self.n_microbatches} "
                        f"equal parts")
        if any(v.shape[0] != batch for v in inputs.values()):
            # rows of images/patches are cut into equal parts, one per micro-batch: right only when every
            # micro-batch holds the same number of placeholder tokens of each modality
            for token_name, token in _placeholder_tokens(self.model.config):
                counts = [int((chunk == token).sum()) for chunk in input_ids.tensor_split(self.n_microbatches)]
                if len(set(counts)) > 1:
                    return (f"{call}: the micro-batches hold {counts} {token_name} placeholder tokens; the "
                            f"multimodal inputs (pixel values, grids) are cut into {self.n_microbatches} equal "
                            f"parts, so every micro-batch must hold as many (order the batch so they do, or use "
                            f"n_microbatches that groups the rows evenly)")
        return None

    def _run(self, schedule, args: tuple, kwargs: dict, **extra):
        """The torch schedule's step; a failed send or receive (a peer gone, a timeout) is a CollectiveError."""
        try:
            return schedule.step(*args, **kwargs, **extra)
        except RuntimeError as e:
            if not _is_communication_failure(e):
                raise
            raise _check.CollectiveError(_check.failure_message("pipeline send/recv", self.schedule_name,
                                                                self.group, e)) from e

    def _from_last(self, t: torch.Tensor) -> torch.Tensor:
        """Broadcast a tensor from the pp rank holding the last stage to every pp rank."""
        if self.group is not None:
            collectives.broadcast(t, dist.get_global_rank(self.group, self.last_owner), self.group)
        return t

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The micro-batch's part of the global loss (`LossRule`). "shifted": `output` the logits, `target` the
        labels: summed token cross-entropy over the global count of valid tokens (transformers' shift); with
        "cp" the logits are this rank's chunk of the sequence (plain order), so the labels are cut the same way.
        Else `output` is the micro-batch's mean loss, `target` its rows' counts: weighted by their share of the
        global count."""
        if self._rule.kind != "shifted":
            return output.float().reshape(()) * (target.sum() * (self._loss_scale / self._valid_tokens))
        logits, labels = output, target
        shift = _shifted(labels)
        if self.cp > 1:
            shift = shift.chunk(self.cp, dim=1)[self.cp_rank]
        total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift.reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="sum")
        return total * (self._loss_scale / self._valid_tokens)

    def _prepare(self, input_ids: torch.Tensor, inputs: dict, train: bool, labels: torch.Tensor | None = None):
        """The schedule for these inputs' shapes, and what the first stage carries besides the hidden state
        (cut.CarrySpec): found once per input shape by running the first stage on the first micro-batch
        (no gradients) and sent to the other stages, which receive its pieces positionally; in training, the
        `LossRule` of this step (`self._rule`), found by the same dry run on the last stage."""
        shapes = (tuple(input_ids.shape), tuple(sorted((k, tuple(v.shape)) for k, v in inputs.items())))
        key = (shapes, tuple(getattr(labels, "shape", ())), train)
        if key not in self._carry_specs:
            try:
                if self.pp > 1 or len(self.stages) > 1:   # the dry run's checks of the cuts
                    found = self._probe(input_ids, inputs, labels, train)
                else:   # one stage, the whole model: only the loss to decide
                    found = (None, self._single_stage_rule(input_ids, inputs, labels) if train else None)
                refusal = None
            except Exception as e:   # every kind: the other data-parallel replicas must hear of it, not wait
                found, refusal = None, e
            self._agree_refusal(refusal)
            self._carry_specs[key] = found
            spec, rule = self._carry_specs[key]
            if train:   # hp.plan's stand-ins of the last stage send no rule: the default one
                self._carry_specs[key] = spec, rule or LossRule()
                self._agree(self._carry_specs[key][1])
        spec, rule = self._carry_specs[key]
        self._rule = rule or LossRule()
        if self.pp > 1:
            self._carry["spec"] = spec
        else:
            self._carry.pop("spec", None)   # every stage here: the first stage's forward sets it
        return self._schedule(shapes, train)

    def _single_stage_rule(self, input_ids: torch.Tensor, inputs: dict, labels: torch.Tensor | None) -> LossRule:
        """The loss rule of a pipeline of one stage (the whole model, on one pp rank), raising its refusal."""
        micro = {k: v.tensor_split(self.n_microbatches)[0] for k, v in dict(input_ids=input_ids, **inputs).items()}
        view = self.stages[0]
        rule, problem = self._loss_rule(view, view.__dict__["_hp_stage"], (micro["input_ids"],), micro,
                                        _first_micro(labels, self.n_microbatches), type(self.model).__name__)
        if problem:
            raise ValueError(f"pipeline: stage 0 refused this micro-batch: {problem}")
        return rule

    def _agree_refusal(self, refusal: Exception | None) -> None:
        """Raise the probe's refusal on every rank of every data-parallel replica, or on none.

        Why: the probe's result reaches every rank of one pipeline (its pp group), but each data-parallel
        replica probes its own micro-batch, and what it refuses may depend on the values (a forward that mixes
        the samples of one batch and not another's): a replica that raised alone would leave the others waiting
        in their first collective. One max all-reduce of a flag over the data-parallel ranks, once per input
        shape."""
        if self._data_groups:
            flag = torch.tensor([0.0 if refusal is None else 1.0], device=self.device)
            for group in self._data_groups:
                collectives.all_reduce_(flag, group, op="max")
            if refusal is None and not flag.is_meta and float(flag) > 0:
                raise ValueError("pipeline: another data-parallel replica's pipeline refused its micro-batch (its "
                                 "ranks raise the reason); every replica stops at the same step")
        if refusal is not None:
            raise refusal

    def _agree(self, rule: LossRule) -> None:
        """The data-parallel ranks' probes each decide the loss rule on their own micro-batch: refused on every rank
        unless they decided alike (the loss's weights would differ between the ranks' pieces)."""
        if not self._data_groups:
            return
        kinds = [(k, c) for k in ("shifted", "own", "given") for c in ("shifted", "tokens", "micro")]
        votes = torch.zeros(len(kinds), device=self.device)
        votes[kinds.index((rule.kind, rule.count))] = 1
        for group in self._data_groups:
            collectives.all_reduce_(votes, group)
        if not votes.is_meta and int((votes > 0).sum()) > 1:
            seen = [kinds[i] for i in range(len(kinds)) if votes[i] > 0]
            raise ValueError(f"pipeline: the data-parallel ranks' first micro-batches decide the loss differently "
                             f"(kind, count): {seen} (a rank whose first micro-batch holds no counted label cannot "
                             f"compare the model's own loss); feed every rank's first micro-batch labels, or pass "
                             f"loss='own' or 'shifted'")

    def _check_label_counts(self, rule: LossRule, labels: torch.Tensor, counts: torch.Tensor) -> None:
        """The model's own loss is each micro-batch's mean: weighted by their label counts (rule.count "shifted",
        "tokens") every micro-batch must count one (its mean is NaN otherwise); averaged ("micro", a loss that
        is not a token cross-entropy the probe recognised), every micro-batch on every data-parallel rank must
        count as many labels, under each rule a model's loss may count by: labels other than -100, and other
        than -100 and the pad token (MusicGen's), per channel (codebook). Decided from every rank's labels
        (one max all-reduce over the data-parallel ranks), so every rank raises or none."""
        n = self.n_microbatches
        name = type(self.model).__name__
        if rule.count != "micro":
            flag = torch.stack([c.sum() == 0 for c in counts.tensor_split(n)]).any().float().reshape(1)
            for group in self._data_groups:
                collectives.all_reduce_(flag, group, op="max")
            if not flag.is_meta and float(flag) > 0:
                raise ValueError(f"pipeline: a micro-batch holds no counted label (the labels {rule.count} other "
                                 f"than -100), on which {name}'s own loss is NaN; order the batch so every "
                                 f"micro-batch holds labels, or use fewer micro-batches")
            return
        pad = getattr(self.model.config, "pad_token_id", None)
        per_micro = torch.stack([_label_counts(chunk, pad) for chunk in labels.tensor_split(n)]).float()
        first = per_micro[0]
        local = torch.cat([first, -first, (per_micro != first).any().float().reshape(1)]).to(self.device)
        for group in self._data_groups:
            collectives.all_reduce_(local, group, op="max")
        if local.is_meta:
            return
        high, low = local[:first.numel()], -local[first.numel():-1]
        if float(local[-1]) > 0 or not torch.equal(high, low):
            raise ValueError(f"pipeline: {name}'s own loss is not a token cross-entropy the pipeline can weigh by its "
                             f"label counts, so the micro-batches' losses are averaged, which is one device's loss "
                             f"only when every micro-batch (on every data-parallel rank) counts as many labels; "
                             f"these count from {low.long().tolist()} to {high.long().tolist()} (labels other than "
                             f"-100, then other than -100 and the pad token, per channel): order the batch so they "
                             f"count alike, use n_microbatches=1, or pass loss=callable")

    def _probe(self, input_ids: torch.Tensor, inputs: dict, labels: torch.Tensor | None = None,
               train: bool = False) -> tuple:
        """(the first stage's CarrySpec, the LossRule in training) on every pp rank, from a dry run of every stage
        in order on the first micro-batch (no gradients), each stage's output broadcast over the pp group to the
        next.

        Why every stage and not the first only: a stage that fails inside torch's schedule (a layer stand-in
        its model's loop cannot take, a carried input it cannot use) fails on its own rank while the others
        wait for its activations, and they see a timeout instead of its error. Here every rank is inside the
        same broadcast when a stage fails, so every rank raises that stage's error, naming it (API §11).
        The dry run also compares, at each cut, the per-token inputs the loop hands the layer there on both
        sides (`cut.cut_inputs_problem`): a stage that recomputes them otherwise (from placeholders of the
        first stage's modules) would run without an error and give a wrong result, so it is refused; and it
        runs every later stage a second time with random placeholders for the first stage's values
        (`cut.placeholder_problem`): what its layers get must not change, or something the stages do not
        hand each other reaches them (its output included: a second stream past the layers, HRM's).
        The first stage runs the first two micro-batches together and each alone: a forward that mixes a
        batch's samples gives them other values alone, and is refused (`_coupling_problem`).
        In training the last stage also decides what it trains on (`_loss_rule`: the model's own loss compared
        with the token cross-entropies on the micro-batch, a given loss function tried).
        Once per input shape; pieces are this rank's local pieces, as the schedule sends them."""
        micro = {k: v.tensor_split(self.n_microbatches)[0] for k, v in dict(input_ids=input_ids, **inputs).items()}
        views = {s.index: view for view, s in zip(self.stages, self.specs)}
        n_stages = self.specs[0].n_stages
        style = SCHEDULES[self.schedule_name][1]
        self._carry.pop("spec", None)
        spec, received, exits, rule = None, (micro["input_ids"],), None, None
        for index in range(n_stages):
            owner = stage_rank(index, self.pp, style)
            result = None
            if index in views:
                state = views[index].__dict__["_hp_stage"]
                state.recording, state.exit_inputs, state.entry_inputs = True, None, None
                try:
                    out, prints = self._dry_run(views[index], state, received, micro, scramble=False)
                    spec = self._carry["spec"]   # a middle stage adds what its cut carries (cut.CarrySpec)
                    if index == 0:
                        problem = self._coupling_problem(views[index], state, input_ids, inputs)
                    else:
                        problem = cut.cut_inputs_problem(exits, state.entry_inputs, type(self.model).__name__, index)
                    if problem is None and index > 0:
                        exit_inputs = state.exit_inputs
                        _, scrambled = self._dry_run(views[index], state, received, micro, scramble=True)
                        problem = cut.placeholder_problem(prints, scrambled, type(self.model).__name__, index)
                        state.exit_inputs = exit_inputs
                    if problem is None and index == n_stages - 1 and train:
                        rule, problem = self._loss_rule(views[index], state, received, micro,
                                                        _first_micro(labels, self.n_microbatches),
                                                        type(self.model).__name__)
                    result = ("error", problem, index) if problem else \
                        ("ok", spec, None if index == n_stages - 1 else tuple(out), state.exit_inputs, rule)
                except Exception as e:   # every kind: the other ranks must hear of it, not wait
                    result = ("error", _stage_failure(type(self.model).__name__, index, e), index)
                finally:
                    state.recording, state.exit_inputs, state.entry_inputs = False, None, None
            result = self._share(result, index, owner)
            if result[0] == "error":
                self._carry.pop("spec", None)
                raise ValueError(f"pipeline: stage {result[2]} (on pp rank {owner}) refused this micro-batch: "
                                 f"{result[1]}")
            spec, received = result[1], result[2]
            exits = result[3] if len(result) > 3 else None   # hp.plan's stand-ins send none
            rule = result[4] if len(result) > 4 else rule
            self._carry["spec"] = spec
        return spec, rule

    def _coupling_problem(self, view: nn.Module, state, input_ids: torch.Tensor,
                          inputs: dict) -> str | None:
        """Why the first stage's output for each of the first two micro-batches alone is not its rows of the
        output for the two together, or None: equal, or not comparable (one micro-batch, a stage that
        splits its inputs itself: expert/context parallel's steps).

        Why: the schedule runs the model's forward on each micro-batch alone, one device on the whole batch; a
        forward that mixes samples (InstructBLIP fed fewer image tokens than it has query features scatters one
        sample's features into the next's tokens, across the batch) gives each micro-batch other values than
        its rows have on one device, a wrong result no error would show. Run in eval mode (dropout draws other
        masks for another batch size), with no gradients; the carried spec of the first micro-batch is kept."""
        stage_feed = feed.feed_of(view)
        if self.n_microbatches < 2 or (stage_feed is not None and stage_feed.steps):
            return None
        pair = {k: torch.cat(v.tensor_split(self.n_microbatches)[:2])
                for k, v in dict(input_ids=input_ids, **inputs).items()}
        modes = [(m, m.training) for m in view.modules()]
        saved, exit_inputs, recording = self._carry.pop("spec", None), state.exit_inputs, state.recording
        state.recording = False
        try:
            view.eval()
            both, _ = self._dry_run(view, state, (pair["input_ids"],), pair, scramble=False)
            alone = []
            for half in range(2):
                self._carry.pop("spec", None)
                alone.append(self._dry_run(view, state, (pair["input_ids"].tensor_split(2)[half],),
                                           {k: v.tensor_split(2)[half] for k, v in pair.items()}, scramble=False)[0])
        except Exception:   # the stage cannot run on two micro-batches at once (a carried input of one row per
            return None     # micro-batch: PaliGemma's position_ids): nothing to compare; the real run stands
        finally:
            for m, mode in modes:
                m.training = mode
            self._carry["spec"], state.exit_inputs, state.recording = saved, exit_inputs, recording
        rows = pair["input_ids"].shape[0] // 2
        compared = [(i, half, a, b) for half in range(2) for i, (a, b) in enumerate(zip(alone[half], both))]
        for i, half, a, b in compared:
            if not isinstance(a, torch.Tensor) or a.is_meta or not a.is_floating_point():
                continue
            if b.ndim and b.shape[0] == 2 * a.shape[0] == 2 * rows and b.shape[1:] == a.shape[1:]:
                b = b[half * rows:(half + 1) * rows]
            elif b.ndim > 1 and b.shape[1] == 2 * a.shape[1] == 2 * rows and b.shape[0] == a.shape[0]:
                b = b[:, half * rows:(half + 1) * rows]   # sequence first (XLNet's hidden state)
            else:
                continue
            scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
            if b.numel() and float((a.float() - b.float()).abs().max()) > 1e-4 * scale:
                return (f"pipeline: {type(self.model).__name__}'s first stage gives a micro-batch other values "
                        f"(its output {i}) alone than in a batch with the next one: the model's forward mixes the "
                        f"samples of a batch (features scattered into placeholder tokens of another sample: fewer "
                        f"placeholder tokens than features), so the pipeline's micro-batches would train on other "
                        f"values than one device does; feed as many placeholder tokens as the model has features "
                        f"per sample, or use n_microbatches=1 or dp/tp for this model")
        return None

    def _dry_run(self, view: nn.Module, state, received: tuple, micro: dict, scramble: bool):
        """One run of a stage in the probe (no gradients) from the random generators' current state, which is
        kept (dropout draws the same masks in both runs of a later stage); returns its output and the
        fingerprints of what its own layers got (`cut._print_hook`) and of its output. `scramble`: the
        placeholders of the first stage's values are random instead of zeros (`cut.placeholder_problem`)."""
        devices = [self.device] if self.device.type == "cuda" else []
        state.prints = []
        state.scramble = torch.Generator().manual_seed(0x5EED) if scramble else None
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                out = view(*received, **micro)
            outputs = out if isinstance(out, tuple) else (out,)
            prints = state.prints + [(None, f"output {i}", cut.fingerprint(o)) for i, o in enumerate(outputs)
                                     if isinstance(o, torch.Tensor)]
        finally:
            state.prints, state.scramble = None, None
        return out, prints

    def _loss_rule(self, view: nn.Module, state: cut.StageState, received: tuple, micro: dict,
                   labels: torch.Tensor | None, model_name: str) -> tuple[LossRule | None, str | None]:
        """(what the last stage trains on, why it cannot: None), decided on the probe's micro-batch (`LossRule`).

        Why the model's own loss is computed and compared: the pipeline's own "shifted" loss is computed from the
        logits; a model whose loss differs (TrOCR's unshifted cross-entropy, label smoothing, codebooks) would
        train another objective than one device does, with no error. loss="auto" trains such a model on its
        own loss; loss="shifted" refuses it. A token cross-entropy (shifted or not) is recognised by comparing it
        with the model's on the same forward's logits, and its micro-batches are weighted by their label counts;
        any other own loss is averaged over the micro-batches (`_check_label_counts`)."""
        given = self.loss
        if self.cp > 1:   # the shifted loss on each rank's chunk (an own or given one is refused at the call)
            return LossRule(), None
        if callable(given):
            state.loss, state.loss_takes_labels = given, False
            extra = {} if labels is None else {cut.LABELS: labels}
            try:
                out, _ = self._dry_run(view, state, received, {**micro, **extra}, scramble=False)
            finally:
                state.loss = None
            if not (isinstance(out, torch.Tensor) and out.numel() == 1 and out.is_floating_point()):
                return None, (f"pipeline: the loss= callable returned {type(out).__name__} "
                              f"{tuple(getattr(out, 'shape', ()))} for {model_name}'s micro-batch; it must return "
                              f"the micro-batch's mean loss, a floating tensor of one element")
            return LossRule("given", "micro"), None
        state.own_loss, error = None, None
        try:
            logits, _ = self._dry_run(view, state, received, {**micro, cut.LABELS: labels}, scramble=False)
        except Exception as e:   # a forward that cannot take labels on this stage: no own loss
            logits, error = None, e
        own, state.own_loss = state.own_loss, None
        has_own = isinstance(own, torch.Tensor) and own.numel() == 1 and own.is_floating_point()
        token_labels = self._has_head and tuple(labels.shape) == tuple(micro["input_ids"].shape)
        matches = {}   # count rule -> whether the own loss is that token cross-entropy (None: not comparable)
        for count, target in (("shifted", _shifted(labels)), ("tokens", labels)):
            comparable = (has_own and not own.is_meta and isinstance(logits, torch.Tensor) and logits.ndim >= 2
                          and tuple(logits.shape[:-1]) == tuple(target.shape) and bool((target != IGNORE_INDEX).any()))
            if comparable:
                mine = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                                       ignore_index=IGNORE_INDEX)
                matches[count] = abs(float(own) - float(mine)) <= 1e-5 * max(1.0, abs(float(mine)))
        if given == "shifted" or given == "auto" and token_labels and matches.get("shifted", True) is not False:
            if matches.get("shifted", True) is False:
                return None, (f"pipeline: {model_name}'s own loss ({float(own):.6g} on the first micro-batch) is "
                              f"not the token cross-entropy against the labels shifted by one that loss='shifted' "
                              f"computes on the last stage's logits (transformers' causal-LM loss): it labels tokens "
                              f"otherwise (unshifted labels, label smoothing, an auxiliary term); use loss='own' "
                              f"(or 'auto') to train on the model's own loss")
            return LossRule("shifted", "shifted"), None
        if not has_own:
            why = f" ({type(error).__name__}: {error})" if error is not None else ""
            return None, (f"pipeline: {model_name}'s forward on the last stage, handed labels=, gives no loss "
                          f"(output.loss){why}, and loss={given!r} trains on it there"
                          f"{'' if self._has_head else ' (the model has no output head for the shifted one)'}; "
                          f"pass pipeline(loss=callable(outputs, micro_batch)), or use dp/tp for this model")
        count = "shifted" if matches.get("shifted") else "tokens" if matches.get("tokens") else "micro"
        return LossRule("own", count), None

    def _share(self, result, index: int, owner: int):
        """The probe's result for stage `index`, from its owner (a broadcast over the pp group)."""
        if self.stand_ins is not None:
            return self.stand_ins.share(result, index, owner == self.mesh.get_local_rank(self.axis))
        if self.pp == 1:   # every stage on this rank
            return result
        return collectives.broadcast_object(result, dist.get_global_rank(self.group, owner), self.group)

    def _schedule(self, batch_shape: tuple, train: bool):
        """The torch schedule for this micro-batch shape (stages infer their P2P shapes on first use); on a pp
        axis of size 1 (every stage here), the stages run one after the other with no schedule.

        Training runs the chosen schedule. Evaluation runs torch's schedule runtime on a forward-only
        order (each rank: its stages in order, every micro-batch), which every stage placement (loop or
        V) admits; the training schedules' own orders contain backward actions that a run without a
        loss function cannot execute (ZBV's local V turn, for one).
        """
        if self.pp == 1:
            return _Sequential(self, train)
        if self.stand_ins is not None:
            return self.stand_ins.schedule(self, train)
        key = (batch_shape, train)
        if key not in self._schedules:
            stages = [CountedStage(view, spec.index, spec.n_stages, self.device, group=self.group)
                      for view, spec in zip(self.stages, self.specs)]
            if train:
                cls = getattr(torch_schedules, SCHEDULES[self.schedule_name][0])
                schedule = cls(stages[0] if self.schedule_name in _SINGLE_STAGE else stages, self.n_microbatches,
                               loss_fn=self._loss, scale_grads=False)
            else:
                schedule = _forward_only(stages, self.n_microbatches, self.pp, SCHEDULES[self.schedule_name][1])
            self._schedules[key] = schedule
        return self._schedules[key]

    def __repr__(self) -> str:
        stages = ", ".join(f"{s.index} (layers {s.layers.start}-{s.layers.stop - 1})" for s in self.specs)
        return f"Pipeline({self.schedule_name}, {self.n_microbatches} micro-batches, stages {stages})"


def _placeholder_tokens(config) -> list[tuple[str, int]]:
    """The image/video/audio placeholder token ids a multimodal config names (e.g. image_token_id)."""
    out = []
    for name in dir(config):
        if any(m in name for m in ("image", "video", "audio")) and name.endswith(("_token_id", "_token_index")):
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                out.append((name, value))
    return out


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """Each token's label for the next token (transformers' causal-LM shift), -100 after the last."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _first_micro(labels: torch.Tensor | None, n_microbatches: int) -> torch.Tensor | None:
    return None if labels is None else labels.tensor_split(n_microbatches)[0]


def _row_counts(labels: torch.Tensor | None, count: str, n_microbatches: int) -> torch.Tensor:
    """What each row weighs in the global loss (`LossRule.count`), the schedule's target: cut into micro-batches
    with the inputs, each micro-batch's loss is weighted by its rows' sum. "micro": one per micro-batch."""
    if count == "micro":
        return torch.ones(n_microbatches)
    target = _shifted(labels) if count == "shifted" else labels
    return (target != IGNORE_INDEX).reshape(target.shape[0], -1).sum(1).to(torch.float32)


def _label_counts(labels: torch.Tensor, pad: Any) -> torch.Tensor:
    """A micro-batch's labels other than -100, then other than -100 and `pad` (an int pad token id), per channel
    (the dims after (batch, sequence): codebooks)."""
    flat = labels.reshape(-1, labels.shape[-1]) if labels.ndim > 2 else labels.reshape(-1, 1)
    counted = flat != IGNORE_INDEX
    padded = counted & (flat != pad) if isinstance(pad, int) and not isinstance(pad, bool) else counted
    return torch.cat([counted.sum(0), padded.sum(0)])


def _own_loss(out, micro_batch: dict) -> torch.Tensor:
    """The model's own loss of a micro-batch (its forward was handed the labels), as the last stage returns it."""
    loss = getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError("pipeline: the model's forward on the last stage, handed labels=, gave no loss this time "
                         "(the probe found one on the first micro-batch); feed micro-batches of one kind")
    return loss


_COMMUNICATION_WORDS = ("gloo", "nccl", "timed out", "timeout", "connection", "peer", "socket", "broken pipe")


def _positions_per_row(input_ids, inputs: dict) -> dict:
    """position_ids of shape (1, sequence), which a model broadcasts over the batch, given one row per sample:
    the schedule cuts every input into micro-batches along dim 0."""
    positions = inputs.get("position_ids")
    if (isinstance(positions, torch.Tensor) and isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2
            and positions.ndim == 2 and positions.shape[0] == 1 and input_ids.shape[0] > 1):
        inputs = {**inputs, "position_ids": positions.expand(input_ids.shape[0], -1)}
    return inputs


def _stage_failure(model_name: str, index: int, error: Exception) -> str:
    """Why stage `index` failed in the probe, said as a refusal: the pipeline's own errors as they are, the
    model code's (a TypeError, an IndexError, a size mismatch) with what the cut did to that code.

    A later stage runs the model's own forward from the hidden state it receives, with placeholders for the
    first stage's modules and without the inputs only the first stage takes (pixel values, encoder inputs);
    the first stage runs it with stand-ins for the later stages' layers. A forward that needs more than that
    there (an encoder's inputs on every stage, a loop that reads the next layer's submodules) cannot be cut
    this way, which is said rather than the bare error of the line that failed."""
    text = f"{type(error).__name__}: {error}"
    if str(error).startswith("pipeline:"):
        return text
    if index == 0:
        return (f"{model_name}'s forward fails on the first stage ({text}): the stage cutter runs it with stand-ins "
                f"for the later stages' decoder layers, which this model's code cannot take; use dp/tp for this "
                f"model")
    return (f"{model_name}'s forward fails on stage {index} ({text}): a later stage runs the model's own forward "
            f"from the hidden state it receives, with placeholders for the first stage's modules and without the "
            f"inputs only the first stage takes (pixel values, encoder inputs), which this model's code needs "
            f"there; use dp/tp for this model")


def _is_communication_failure(error: RuntimeError) -> bool:
    """A failed send or receive inside torch's schedule (the backend's own error type, or its words)."""
    if isinstance(error, getattr(dist, "DistBackendError", ())):
        return True
    text = str(error).lower()
    return any(word in text for word in _COMMUNICATION_WORDS)


class _Sequential:
    """The schedule of a pp axis of size 1: each micro-batch through every stage in order, then its loss's
    backward (what any schedule computes, with nothing to overlap)."""

    def __init__(self, pipe: "Pipeline", train: bool):
        self.pipe, self.train = pipe, train

    def step(self, *args, target=None, losses=None, return_outputs=True, **kwargs):
        n = self.pipe.n_microbatches
        chunks = [torch.tensor_split(t, n) for t in args]
        kw_chunks = {k: torch.tensor_split(v, n) for k, v in kwargs.items()}
        targets = torch.tensor_split(target, n) if target is not None else [None] * n
        outputs = []
        for i in range(n):
            out = chunks[0][i]
            micro = {k: v[i] for k, v in kw_chunks.items()}
            for stage in self.pipe.stages:
                out = stage(*(out if isinstance(out, tuple) else (out,)), **micro)
            if self.train:
                loss = self.pipe._loss(out, targets[i])
                loss.backward()
                losses.append(loss.detach())
            else:
                outputs.append(out)
        return torch.cat(outputs) if outputs and return_outputs else None


class CountedStage(PipelineStage):
    """torch's PipelineStage whose sends are counted by `comm_counter` (collectives.record_p2p): torch's
    schedules post the stage's P2P operations themselves."""

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        return collectives.record_p2p(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        return collectives.record_p2p(super().get_bwd_send_ops(bwd_chunk_id))

    def _to_tensor(self, arg):
        """torch's metadata inference runs a later stage's forward on tensors made from the received pieces'
        metadata, uninitialised: zeros instead, so that an integer piece (the top-k token indices a DSA layer
        hands the next, cut.CarrySpec.layer_entries) indexes within bounds there as the real values do."""
        tensor = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor) and isinstance(tensor, torch.Tensor) and not tensor.is_floating_point():
            with torch.no_grad():
                tensor.zero_()
        return tensor


def _forward_only(stages: list, n_microbatches: int, pp: int, style: str):
    """torch's schedule runtime on a forward-only order: rank r runs its stages in order, all micro-batches.

    Lowered to send/recv actions by torch's own `_add_send_recv`; `_prepare_schedule_with_comms` is not
    used because its validation insists on a backward for every micro-batch.
    """
    schedule = torch_schedules._PipelineScheduleRuntime(stages=stages, n_microbatches=n_microbatches, loss_fn=None)
    n_stages = stages[0].num_stages
    owner = {s: stage_rank(s, pp, style) for s in range(n_stages)}
    order = {r: [torch_schedules._Action(s, torch_schedules._ComputationType.FORWARD, mb)
                 for s in range(n_stages) if owner[s] == r for mb in range(n_microbatches)]
             for r in range(pp)}
    schedule.stage_index_to_group_rank = owner
    for stage in stages:
        stage.stage_index_to_group_rank = owner
    schedule.pipeline_order_with_comms = torch_schedules._add_send_recv(
        order, stage_to_rank=owner.__getitem__, num_stages=n_stages)
    return schedule
