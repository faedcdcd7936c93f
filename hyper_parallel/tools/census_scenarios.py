"""The scenarios of the type census: how each of a type's processes lays out its model and inputs.

- single: one process; inputs (and parameters, in training) replicated on the census layout.
- plain: one process, plain tensors only (a check of the tiny configs and inputs).
- dp N: the batch split over N gloo processes, parameters replicated; every run of the scenario (plain, DTensor,
  float64) with oneDNN off (`native_kernels`): oneDNN picks its fp32 convolution algorithm by the batch size, so
  a rank's batch of 1 rounds otherwise than the plain batch of 2 (levit's grads 17x their magnitude apart, 1e-7
  with native kernels, which compute sample by sample).
- tp N: `shard(model, "auto")` over N processes, inputs replicated.
- ep N: `expert_parallel(model, mesh, "ep")`: experts spread, the batch split by the model's own hook;
  a model without MoE experts is "not applicable".
- cp N: `context_parallel(model, mesh, "cp")`: the sequence split by the model's own hook (the tiny inputs padded
  to a multiple of 2N tokens, mask 0 and labels -100, for both runs: on the left in generate mode, as prompts
  are); generate mode compares the generated tokens (the prompt forward split, the decoding steps whole);
  types without a decoder, and encoder-decoder types, are "not applicable".
- pp N: `pipeline(model, mesh, "pp")`: one training step through the stages (1F1B, 2 micro-batches), loss
  and every rank's gradients compared with the plain step; types without a decoder, and encoder-decoder
  types (as the seq2seq-lm head's), are "not applicable".
"""
from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from ..dispatch.registry import MissingOpRecord, record_missing_ops
from .census import (GRAD_TOLERANCE, TOLERANCE, RunReport, _max_diff, _run_one, _train_step, full, output_loss,
                     replicated)
from ..parallel.pipeline.tie import ALIASES as TIED_NAMES
from .models import ModelCase

PARALLEL = ("dp", "tp", "ep", "cp", "pp")
SCENARIOS = ("single", "plain") + PARALLEL
DECODER_HEADS = ("causal-lm", "image-text-to-text", "multimodal-lm")
PIPELINE_MICROBATCHES = 2


def _same(t):
    return t


@dataclass
class Scenario:
    """One scenario on this process: the input and parameter wrappers, the model surgery, and what applies."""

    name: str = "single"
    world: int = 1
    mesh: object = None
    wrap_input: Callable = replicated
    wrap_param: Callable = replicated
    shard_model: Callable | None = None
    native_kernels: bool = False  # every run with oneDNN off (a scenario that changes the batch size per rank)

    def not_applicable(self, case: ModelCase) -> str | None:
        """Why the scenario does not apply to this model (None: it does). Decided from the model alone, the
        same on every rank."""
        if self.name == "ep":
            experts = _find_experts(case.model)
            if not experts:
                return "dense model: no MoE experts module (stacked expert weights routed by the model)"
        if self.name in ("cp", "pp") and getattr(getattr(case.model, "config", None), "is_encoder_decoder", False):
            # counted as the seq2seq-lm head's types are: both parallelisms refuse such a model at the call
            return (f"encoder-decoder model (config.is_encoder_decoder), not applicable as seq2seq-lm types: "
                    f"{'context' if self.name == 'cp' else 'pipeline'} parallel works on a decoder-only model")
        return None if self.name == "ep" else not_applicable_before_building(self.name, "", case.head)

    def modes(self, modes: tuple) -> tuple:
        return tuple(m for m in modes if m == "train") if self.name == "pp" else modes

    def run(self, name: str, mode: str, build: Callable[[], ModelCase], max_new_tokens: int,
            record: bool) -> RunReport:
        kernels = torch.backends.mkldnn.flags(enabled=False) if self.native_kernels else contextlib.nullcontext()
        with kernels:
            return self._run(name, mode, build, max_new_tokens, record)

    def _run(self, name: str, mode: str, build: Callable[[], ModelCase], max_new_tokens: int,
             record: bool) -> RunReport:
        if self.name == "pp":
            return pipeline_run(name, build, self.mesh, record)
        if self.name == "cp":
            build = _padded(build, 2 * self.world, left=mode == "generate")
        return _run_one(name, mode, build, max_new_tokens, self.wrap_input, self.wrap_param, record,
                        self.shard_model, plain_only=self.name == "plain")


def not_applicable_before_building(scenario: str, model_type: str, head: str) -> str | None:
    """Why a scenario does not apply to a type, where that is known before its model is built (None: it may
    apply): context and pipeline parallel work on a decoder's sequence and layers; expert parallel needs a
    config that counts experts (a model built from one is checked again for an experts module)."""
    if scenario == "ep" and not _counts_experts(_default_config_dict(model_type)):
        return "dense model: no MoE experts module (stacked expert weights routed by the model)"
    if scenario in ("cp", "pp") and head not in DECODER_HEADS:
        what = "splits a decoder's sequence" if scenario == "cp" else "cuts a decoder's layer list"
        return f"{'context' if scenario == 'cp' else 'pipeline'} parallel {what}; a {head} model has none"
    return None


def _default_config_dict(model_type: str) -> dict:
    from transformers import AutoConfig
    try:
        return AutoConfig.for_model(model_type).to_dict()
    except Exception:  # a default config that does not validate: let the build say what fails
        return {"num_experts": 2}


def _counts_experts(d: dict) -> bool:
    from .auto_models import _EXPERT_KEYS
    return any((k in _EXPERT_KEYS and isinstance(v, int) and v > 1) or (isinstance(v, dict) and _counts_experts(v))
               for k, v in d.items())


def _padded(build: Callable[[], ModelCase], multiple: int, left: bool = False) -> Callable[[], ModelCase]:
    """Context parallel takes sequences of a multiple of 2 x cp tokens: the tiny inputs padded as a tokenizer's
    pad_to_multiple_of pads them (mask 0, labels -100; on the left for generate, `left`), for the plain and the
    parallel run alike."""
    from .model_inputs import pad_tokens

    def built() -> ModelCase:
        case = build()
        case.inputs, case.labels = pad_tokens(case.inputs, case.labels, multiple, left=left)
        return case
    return built


def _find_experts(model) -> dict:
    from ..parallel.expert.api import find_experts
    return find_experts(model)


def _batch_split(layout, world: int) -> Callable:
    """Inputs split on their batch dim over the layout's one axis (replicated where the batch does not divide)."""
    from ..dtensor.dtensor import distribute_tensor
    axis = layout.alias_name[0]

    def split(t):
        if t.ndim and t.shape[0] % world == 0:
            return distribute_tensor(t, layout(axis, *(["None"] * (t.ndim - 1))))
        return replicated(t, layout)
    return split


def make_scenario(name: str, world: int = 1) -> Scenario:
    """The scenario on this process (torch.distributed already initialised when `world` > 1)."""
    if name not in SCENARIOS:
        raise ValueError(f"census: unknown scenario {name!r}; use one of {', '.join(SCENARIOS)}")
    if name in ("single", "plain"):
        return Scenario(name)
    from ..layout.layout import Layout
    if name in ("dp", "tp"):
        mesh = Layout((world,), (name,))
        repl = lambda t: replicated(t, mesh)  # noqa: E731
        if name == "dp":
            return Scenario(name, world, mesh, _batch_split(mesh, world), repl, native_kernels=True)
        from ..parallel.shard import shard
        return Scenario(name, world, mesh, repl, repl, lambda m: shard(m, "auto", mesh, src_data_rank=None))
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (world,), (name,))
    layout = Layout((world,), (name,))
    repl = lambda t: replicated(t, layout)  # noqa: E731
    if name == "ep":  # "ep" is a data axis (API §12): each rank feeds its share of the batch, said as Shard(0)
        return Scenario(name, world, mesh, _batch_split(layout, world), repl,
                        lambda m: hp.expert_parallel(m, mesh, "ep"))
    if name == "cp":
        return Scenario(name, world, mesh, _same, repl, lambda m: hp.context_parallel(m, mesh, "cp"))
    return Scenario(name, world, mesh)


def pipeline_run(name: str, build: Callable[[], ModelCase], mesh, record: bool = True) -> RunReport:
    """One training step through `pipeline` over `mesh`'s "pp" axis, compared with the plain step: the loss,
    and the gradients of every rank's stages (gathered, so rank 0 reports every stage)."""
    import hyper_parallel as hp
    from ..redistribute.collectives import gather_objects
    report = RunReport(name, "train")
    start = time.perf_counter()
    rec = None
    try:
        case = build()
        ref_loss, ref_grads, _ = _train_step(case.model, case.inputs, case.labels)
        report.plain_ok = True
        case = build()
        inputs = dict(case.inputs)
        if "input_ids" not in inputs:   # an encoder-decoder fed pixels or patches, its tokens as decoder inputs
            raise ValueError(f"pipeline: {type(case.model).__name__} is fed no input_ids (its inputs: "
                             f"{sorted(inputs)}); Pipeline.step takes the token ids its first stage embeds and "
                             f"one label per token, as a decoder-only language model is fed: use dp/tp for this "
                             f"model")
        ids, labels = inputs.pop("input_ids"), case.labels.get("labels")
        # the plain step's loss: the model's own given labels (loss="auto"), else its outputs' mean squares, which a
        # user trains on as the pipeline's loss= callable (a mean over the equal micro-batches' samples)
        loss_fn = "auto" if labels is not None else (lambda out, micro_batch: output_loss(out))
        with (record_missing_ops() if record else contextlib.nullcontext(MissingOpRecord())) as rec:
            pipe = hp.pipeline(case.model, mesh, "pp", schedule="1f1b", n_microbatches=PIPELINE_MICROBATCHES,
                               loss=loss_fn)
            case.model.train()
            loss = pipe.step(ids, labels=labels, **inputs)
        # a stage's copy of a weight tied across stages (the head's) compares with the plain model's one weight
        tied = pipe.model.__dict__.get(TIED_NAMES, ())
        plain_name = {n: next((a for a in tied if a in ref_grads), n) if n in tied else n
                      for n, _ in pipe.named_parameters()}
        grads = {plain_name[n]: None if p.grad is None else full(p.grad).detach() for n, p in pipe.named_parameters()}
        dg, where = _max_diff({n: ref_grads.get(n) for n in grads}, grads, relative=True)
        stages = gather_objects(mesh, (dg, where, sorted(grads)))
        dg, where = max(((d, w) for _, (d, w, _) in stages), key=lambda dw: dw[0])
        held = {n for _, (_, _, names) in stages for n in names}
        lost = sorted(n for n, g in ref_grads.items() if g is not None and n not in held)
        dl = abs(float(ref_loss) - float(full(loss))) / max(1.0, abs(float(ref_loss)))
        report.equal = not lost and dl <= TOLERANCE and dg <= GRAD_TOLERANCE
        report.detail = (f"loss {dl:.1e}, grads {dg:.1e} over {len(stages)} stages"
                         + (f" (worst: {where})" if dg > GRAD_TOLERANCE else "")
                         + (f"; no stage holds {lost[:3]}" if lost else ""))
        report.ops, report.missing, report.locations = dict(rec.seen), dict(rec.counts), dict(rec.locations)
    except Exception:
        report.error = traceback.format_exc()
        report.equal = False
        if rec is not None:
            report.ops, report.missing, report.locations = dict(rec.seen), dict(rec.counts), dict(rec.locations)
    report.seconds = time.perf_counter() - start
    return report

__all__ = ["Scenario", "make_scenario", "pipeline_run", "not_applicable_before_building", "SCENARIOS", "PARALLEL", "DECODER_HEADS"]
