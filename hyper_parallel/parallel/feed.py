"""What each rank feeds (API §12), checked, and the one forward pre-hook that splits a model's inputs.

The convention, the same for every mesh: each rank feeds its own micro-batch, its share of the global
batch over the *data axes* ("dp", "ep"); the ranks of one "tp", "cp" or "pp" group feed the same
micro-batch (whole sequences for "cp": the library splits them). A DTensor input is taken as laid out.

Every parallelism that splits inputs registers an `InputStep` on the model (`expert_parallel`: the
rank's rows become its share of a batch split over "ep"; `context_parallel`: the sequence is split over
"cp"); one forward pre-hook runs them in order. Before the steps run, the ranks compare what they were
fed (`check_feed`): a fingerprint per rank (input names, shapes, dtypes, a checksum of the values, and
whether a step refused this rank's inputs) is all-gathered over the model's mesh (one all_gather of a
few int64 per rank) and every rank judges all of them the same way, so a wrong feed raises the same
`FeedError` on every rank, before any other collective:
- ranks that differ only on same-feed axes must have fed identical inputs;
- ranks that differ only on "equal share" axes ("ep": the experts' batch is one DTensor) must have fed
  inputs of the same shapes;
- an input a step refuses (a sequence that does not split, a mask of the wrong length) on any rank.
When: always on the first forward; afterwards on every forward of a model whose steps can refuse inputs
(context and expert parallel, whose input shapes change from step to step) or in check mode
(HYPER_PARALLEL_CHECK=1), else never (a tensor-parallel model's steps cost nothing). The environment
variable HYPER_PARALLEL_FEED_CHECK=first|always overrides that choice.
"""
from __future__ import annotations

import inspect
import os
import types
import zlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ..dtensor.dtensor import DTensor
from ..layout.mesh import DeviceMesh
from ..redistribute import check as _check
from ..redistribute import collectives

_FIELDS = 5  # refused, number of tensors, shapes hash, values hash, which call
_MASK = (1 << 61) - 1


class FeedError(ValueError):
    """Ranks fed inputs that break the data convention (API §12), or inputs a parallelism cannot split.
    Raised on every rank, with every rank's view of the problem."""


class InputStep(Protocol):
    """One parallelism's treatment of the model's inputs (registered with `add_input_step`)."""

    name: str
    may_refuse: bool  # its `refuse` depends on per-step shapes: the feed is then checked on every forward
    for_generate: bool  # also applied to `model.generate`'s inputs (a step that splits the batch)

    def refuse(self, inputs: dict[str, Any]) -> str | None:
        """Why this rank's inputs (name -> value) cannot be split, or None. Local: no communication."""

    def apply(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The inputs as the model's forward receives them."""


@dataclass
class Feed:
    """What the ranks of one model feed: the mesh the check runs over, the roles of its axes, the steps."""

    mesh: DeviceMesh
    same_feed_axes: set = field(default_factory=set)
    equal_share_axes: set = field(default_factory=set)
    steps: list = field(default_factory=list)
    forwards: int = 0

    def due(self) -> bool:
        policy = os.environ.get("HYPER_PARALLEL_FEED_CHECK", "")
        if self.forwards == 0 or policy == "always" or _check.CHECK[0]:
            return True
        return policy != "first" and any(s.may_refuse for s in self.steps)


def feed_of(model: nn.Module) -> Feed | None:
    return model.__dict__.get("_hp_feed")


def register(model: nn.Module, mesh: DeviceMesh, *, same_feed: tuple = (), equal_shares: tuple = (),
             step: InputStep | None = None) -> Feed | None:
    """Declare what a parallelism adds to the model's feed: axes of `mesh` whose ranks feed the same inputs
    (`same_feed`) or equal-shaped shares (`equal_shares`), and an input step. Installs the hook once.

    The check runs over the root of `mesh` (the mesh it was taken from by name), which every parallelism of
    one model shares; a pipeline stage (`_hp_stage`) gets no hook: the pipeline feeds its stages itself."""
    feed = feed_of(model)
    root = mesh.root
    if feed is None and not (same_feed or equal_shares or step):
        return None  # nothing to check or split (hsdp alone: every rank feeds its own micro-batch)
    if feed is None:
        feed = Feed(root)
        model.__dict__["_hp_feed"] = feed
        if "_hp_stage" not in model.__dict__:
            model.register_forward_pre_hook(_split_inputs, with_kwargs=True)
            if callable(getattr(model, "generate", None)):
                model.generate = types.MethodType(_generating(type(model).generate), model)
    elif len(root.ranks) > len(feed.mesh.ranks):
        feed.mesh = root
    feed.same_feed_axes.update(a for a in same_feed if a in feed.mesh.mesh_dim_names)
    feed.equal_share_axes.update(a for a in equal_shares if a in feed.mesh.mesh_dim_names)
    if step is not None:
        feed.steps.append(step)
    return feed


def _split_inputs(module: nn.Module, args: tuple, kwargs: dict):
    """The model's forward pre-hook: check the feed when due, then every registered step in order."""
    feed = feed_of(module)
    if feed.due():
        check_feed(feed, named_inputs(module, args, kwargs), [s.refuse for s in feed.steps])
    feed.forwards += 1
    for step in feed.steps:
        args, kwargs = step.apply(module, args, kwargs)
    return args, kwargs


def _generating(generate):
    """`model.generate` whose inputs are split first by the steps that split the batch (expert parallel's
    shares), so that the generation loop, which concatenates the caller's tokens with the model's, runs
    on the same DTensors the forward sees; the result is the generated tokens of the global batch (a
    DTensor: `.to_local()` is this rank's share)."""
    def run(self, *args, **kwargs):
        feed = feed_of(self)
        steps = [s for s in feed.steps if getattr(s, "for_generate", False)]
        if steps:
            check_feed(feed, named_inputs(self, args, kwargs), [s.refuse for s in feed.steps], call="generate")
            for step in steps:
                args, kwargs = step.apply(self, args, kwargs)
        return generate(self, *args, **kwargs)
    return run


def named_inputs(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's inputs by the names of the module's forward (positional ones too)."""
    out = dict(zip(positional_names(module), args)) if args else {}
    out.update(kwargs)
    return out


def positional_names(module: nn.Module) -> tuple:
    """The names the module's forward gives its positional arguments, in order (`self` left out)."""
    names = _positional_names(type(module).forward)
    return names[1:] if names and names[0] == "self" else names


_NAMES: dict = {}


def _positional_names(forward) -> tuple:
    names = _NAMES.get(forward)
    if names is None:
        try:
            params = inspect.signature(forward).parameters.values()
        except (TypeError, ValueError):
            params = ()
        names = _NAMES[forward] = tuple(p.name for p in params
                                        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return names


def token_inputs_problem(where: str, inputs: dict[str, Any], batch: int, seq_len: int,
                         names: tuple = ("attention_mask", "labels", "position_ids")) -> str | None:
    """Why the per-token inputs among `names` do not fit a (batch, seq_len) batch of tokens, or None: a 2D
    padding mask and labels of exactly that shape, position_ids of that shape or (1, seq_len). Decided from
    shapes alone, so an `InputStep.refuse` can call it before any rank communicates (a parallelism that splits
    or cuts the sequence cannot take the lengths a single-device model would slice or broadcast)."""
    for name in names:
        value = inputs.get(name)
        if value is None:
            continue
        if not isinstance(value, Tensor):
            return f"{where}: {name} must be a tensor, got {type(value).__name__}"
        shape = tuple(value.shape)
        if name == "position_ids":
            if shape not in ((batch, seq_len), (1, seq_len)):
                return (f"{where}: position_ids of shape {shape} do not match the inputs' (batch, sequence) = "
                        f"{(batch, seq_len)}; give ({batch}, {seq_len}) or (1, {seq_len})")
        elif shape != (batch, seq_len):
            what = "a 2D padding mask" if name == "attention_mask" else "one label per token"
            return (f"{where}: {name} of shape {shape} does not match the inputs' (batch, sequence) = "
                    f"{(batch, seq_len)}; give {what} of that shape")
    return None


# ---- the check -----------------------------------------------------------------------------------------
def check_feed(feed: Feed, inputs: dict[str, Any], refusers: list, call: str = "forward") -> None:
    """Compare every rank's inputs over the feed's mesh; FeedError on every rank if the feed is wrong.

    `call` names what the ranks are about to run (a pipeline's step or eval_forward): every rank of the mesh
    must be about to run the same."""
    mesh = feed.mesh
    refused = next((why for why in (r(inputs) for r in refusers) if why), None)
    if not mesh.distributed or len(mesh.ranks) == 1:
        if refused:
            raise FeedError(refused)
        return
    tensors = {k: v for k, v in sorted(inputs.items()) if isinstance(v, Tensor)}
    mine = torch.tensor([int(refused is not None), len(tensors), _shapes_hash(tensors), _values_hash(tensors),
                         zlib.crc32(call.encode())], dtype=torch.int64, device=_device(mesh))
    everyone = collectives.gather_over_mesh(mesh, mine, kind="feed_check").tolist()
    problems = _judge(feed, everyone)
    if len({row[4] for row in everyone}) > 1:
        problems.append(("call", list(range(len(everyone)))))
    if problems or any(row[0] for row in everyone):
        # a second exchange, only on failure and on every rank alike: the descriptions for the message
        described = collectives.gather_objects(mesh, (f"{call}: {_describe(tensors)}", refused))
        raise FeedError(_message(feed, problems, described))


def _judge(feed: Feed, rows: list) -> list[tuple[str, list[int]]]:
    """(what broke, the mesh positions involved) for every group whose ranks' fingerprints disagree."""
    mesh = feed.mesh
    names = mesh.mesh_dim_names
    same = [names.index(a) for a in feed.same_feed_axes]
    shares = [names.index(a) for a in feed.equal_share_axes]
    problems = []
    for label, free, column in (("same", same, slice(1, 4)), ("shares", same + shares, slice(1, 3))):
        if not free or (label == "shares" and not shares):
            continue
        groups: dict = {}
        for position, row in enumerate(rows):
            coord = list(_coordinate(position, mesh.shape))
            for a in free:
                coord[a] = 0
            groups.setdefault(tuple(coord), []).append(position)
        for members in groups.values():
            if len({tuple(rows[p][column]) for p in members}) > 1:
                problems.append((label, members))
                break
    return problems


def _message(feed: Feed, problems: list, described: list) -> str:
    """One message, the same on every rank: what each rank refused, and each group whose feeds disagree.
    `described`: per mesh position (row-major), (coordinate, (description of the inputs, refusal or None))."""
    mesh = feed.mesh
    lines = []
    refusals: dict = {}
    for position, (_, (_, why)) in enumerate(described):
        if why:
            refusals.setdefault(why, []).append(mesh.ranks[position])
    for why, ranks in refusals.items():
        lines.append(f"{why} (on ranks {ranks})")
    for label, members in problems:
        if label == "call":
            what = "are about to run different calls (every rank must run the same, SPMD)"
        else:
            axes = "/".join(repr(a) for a in sorted(feed.same_feed_axes if label == "same" else feed.equal_share_axes))
            what = (f"fed different micro-batches, but ranks that differ only in their {axes} coordinate feed the "
                    f"same one" if label == "same" else
                    f"fed shares of different shapes over {axes}, whose shares form one batch and must have the "
                    f"same shapes")
        shown = "\n".join(f"    rank {mesh.ranks[p]} (coordinate {described[p][0]}): {described[p][1][0]}"
                          for p in members)
        lines.append(f"the ranks of one group {what}:\n{shown}")
    advice = ("Each rank feeds its share of the global batch over the data axes 'dp' and 'ep'; ranks of one "
              "'tp', 'cp' or 'pp' group feed the same micro-batch (API §12), e.g. "
              "DistributedSampler(dataset, num_replicas=hp.data_world(mesh), rank=hp.data_rank(mesh)).")
    return f"hyper_parallel: wrong model inputs on {mesh}:\n  " + "\n  ".join(lines) + "\n" + advice


def _coordinate(position: int, shape: tuple) -> tuple:
    coord = []
    for size in reversed(shape):
        coord.append(position % size)
        position //= size
    return tuple(reversed(coord))


def _describe(tensors: dict) -> str:
    parts = []
    for name, t in tensors.items():
        kind = f" {t.dist_layout.alias_entries()}" if isinstance(t, DTensor) else ""
        parts.append(f"{name} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}{kind} "
                     f"[checksum {_values_hash({name: t}) & 0xFFFFFF:06x}]")
    return ", ".join(parts) or "no tensors"


def _shapes_hash(tensors: dict) -> int:
    text = ";".join(f"{k}:{tuple(v.shape)}:{v.dtype}:{isinstance(v, DTensor)}" for k, v in tensors.items())
    return zlib.crc32(text.encode())


def _values_hash(tensors: dict) -> int:
    """A checksum of the values of the plain tensors (a DTensor is taken as laid out: its shape counts)."""
    h = _shapes_hash(tensors)
    for t in tensors.values():
        if isinstance(t, DTensor) or t.is_meta:
            continue
        x = t.detach()
        if x.is_complex():
            x = torch.view_as_real(x)
        if x.dtype.is_floating_point:
            x = x.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
        x = x.reshape(-1).to(torch.int64)
        weights = torch.arange(1, x.numel() + 1, dtype=torch.int64, device=x.device)
        h = (h * 1000003 + int(x.sum()) * 31 + int((x * weights).sum())) & _MASK
    return h


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


__all__ = ["FeedError", "InputStep", "Feed", "register", "feed_of", "check_feed", "named_inputs",
           "token_inputs_problem"]
