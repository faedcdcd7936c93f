"""The operator census: which torch ops a model hits through DTensor, which have rules, which are missing.

It runs the requirement's flow on one process without torch.distributed: the model's inputs (and, in
train mode, its parameters) become DTensors replicated on `Layout((4, 2), ("dp", "tp"))`, and the
whole run happens inside `record_missing_ops()`, so ops without a rule are recorded (count and the
model-code line that called them) and run locally instead of stopping the run at the first one.
Each run is repeated with plain tensors, and the census says whether the results are equal, so a
rule that is present but wrong shows up too.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from ..dispatch import registry
from ..dispatch.registry import MissingOpRecord, record_missing_ops
from ..dtensor.dtensor import DTensor, distribute_tensor
from ..layout.layout import Layout
from .model_inputs import fed_modalities
from .models import ModelCase, build_model, load_pretrained, model_names

MODES = ("generate", "train")
TOLERANCE = 1e-5
# gradients get more room: a gradient that sums many O(1) terms to a small total (a norm's bias over every
# token and patch, a convolution over every pixel) keeps the absolute rounding of its terms, and the same sum
# taken in another order (a split batch, a gathered then re-split input) moves it by ~sqrt(terms) ulps of the
# terms; a wrong rule moves it by far more (a dropped or doubled contribution is O(1) of the gradient)
GRAD_TOLERANCE = 1e-4
RUN_SEED = 1234  # the torch seed each run (plain, then on DTensors) starts from
# A tiny random model can be ill-conditioned (BatchNorm over 2 samples of a random CNN, a detector's matching):
# then float32 rounding alone, the same sums taken in another order, moves its outputs and gradients by more than
# the fixed tolerances. A comparison that fails is measured once more against the model's own conditioning: the
# plain run in float64 against the plain run in float32. The DTensor run passes if it differs from the plain
# float32 run by at most CONDITIONING_FACTOR times that gap (it rounds no worse than float32 does); a wrong rule
# differs by far more (a dropped or doubled term is O(1) of the value). Types that compare equal never pay for
# the float64 run.
CONDITIONING_FACTOR = 2.0


def census_layout() -> Layout:
    """The requirement's device matrix: 4 x 2 ranks named dp and tp (nothing is split in the census)."""
    return Layout((4, 2), ("dp", "tp"))


def replicated(t: torch.Tensor, layout: Layout | None = None) -> DTensor:
    """`DTensor.from_local(t, Layout((4, 2), ("dp", "tp"))("None", ...))`, as the requirement writes it."""
    layout = layout or census_layout()
    return DTensor.from_local(t, layout(*(["None"] * t.ndim)))


def to_dtensor_inputs(inputs: dict, wrap: Callable[[torch.Tensor], DTensor] = replicated) -> dict:
    return {k: wrap(v) if isinstance(v, torch.Tensor) and type(v) is not DTensor else v for k, v in inputs.items()}


def distribute_parameters(model: nn.Module, wrap: Callable[[torch.Tensor], DTensor] = replicated) -> nn.Module:
    """Replace every parameter by an nn.Parameter holding a DTensor (tied parameters stay tied)."""
    done: dict = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or type(p) is DTensor:
                continue
            new = done.get(id(p))
            if new is None:
                new = nn.Parameter(wrap(p.detach()), requires_grad=p.requires_grad)
                done[id(p)] = new
            module._parameters[name] = new
    return model


def full(t):
    """A plain full tensor from a DTensor (or the tensor itself)."""
    if type(t) is DTensor:
        with torch.no_grad():
            return t.full_tensor()
    return t


# ---- the report ------------------------------------------------------------------------------
@dataclass
class RunReport:
    """One model in one mode."""

    model: str
    mode: str
    ops: dict = field(default_factory=dict)          # op -> calls that reached the dispatcher
    missing: dict = field(default_factory=dict)      # op -> calls without a rule
    locations: dict = field(default_factory=dict)    # missing op -> first model-code line that called it
    equal: bool | None = None                        # results equal to the plain-tensor run
    detail: str = ""                                 # what was compared, or what differed
    error: str | None = None
    seconds: float = 0.0
    plain_ok: bool | None = None                     # the plain-tensor run finished (None: not reached)
    fed: list = field(default_factory=list)          # the modalities its inputs fed (text, image, video, audio)
    conditioning: float | None = None                # plain fp32 vs plain float64 gap, where it decided `equal`

    @property
    def with_rules(self) -> list[str]:
        return sorted(op for op in self.ops if op not in self.missing)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.missing and bool(self.equal)


@dataclass
class CensusReport:
    runs: list = field(default_factory=list)

    def models(self) -> list[str]:
        return list(dict.fromkeys(r.model for r in self.runs))

    def model_ops(self, model: str) -> Counter:
        c = Counter()
        for r in self.runs:
            if r.model == model:
                c.update(r.ops)
        return c

    def model_missing(self, model: str) -> Counter:
        c = Counter()
        for r in self.runs:
            if r.model == model:
                c.update(r.missing)
        return c

    def union_ops(self) -> list[str]:
        return sorted({op for r in self.runs for op in r.ops})

    def union_missing(self) -> list[str]:
        return sorted({op for r in self.runs for op in r.missing})

    def locations(self) -> dict:
        out: dict = {}
        for r in self.runs:
            for op, loc in r.locations.items():
                out.setdefault(op, loc)
        return out

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.runs)

    def to_dict(self) -> dict:
        models = {}
        for m in self.models():
            ops, missing = self.model_ops(m), self.model_missing(m)
            models[m] = {
                "ops": dict(sorted(ops.items())),
                "with_rules": sorted(op for op in ops if op not in missing),
                "missing": dict(sorted(missing.items())),
                "runs": {r.mode: {**{k: v for k, v in asdict(r).items() if k not in ("model", "mode")},
                                  "with_rules": r.with_rules, "ok": r.ok}
                         for r in self.runs if r.model == m},
            }
        union, miss = self.union_ops(), self.union_missing()
        return {"models": models,
                "union": {"ops": union, "with_rules": [o for o in union if o not in miss], "missing": miss,
                          "locations": {op: loc for op, loc in self.locations().items() if op in miss}},
                "ok": self.ok}

    def op_listing(self) -> str:
        """Every op each model hit: calls, and the rule class that handles it (or MISSING with the call site)."""
        lines = []
        locs = self.locations()
        for m in self.models():
            ops, missing = self.model_ops(m), self.model_missing(m)
            lines.append(f"{m}: {len(ops)} ops, {len(missing)} missing")
            for op in sorted(ops):
                rule = registry.RULES.get(op)
                where = f"MISSING  {locs.get(op, '?')}" if op in missing or rule is None else type(rule).__name__
                lines.append(f"  {op:<52} {ops[op]:>6}  {where}")
        return "\n".join(lines)

    def table(self) -> str:
        """The terminal table: one row per model and mode, then the de-duplicated union."""
        w = max([20] + [len(m) for m in self.models()])  # long checkpoint paths keep the columns aligned
        head = f"{'model':<{w}} {'mode':<9} {'ops':>4} {'rules':>5} {'miss':>4}  {'equal':<5} {'time':>6}  note"
        lines = [head, "-" * len(head)]
        for r in self.runs:
            note = r.error.splitlines()[-1][:60] if r.error else r.detail[:60]
            eq = "-" if r.equal is None else ("yes" if r.equal else "NO")
            lines.append(f"{r.model:<{w}} {r.mode:<9} {len(r.ops):>4} {len(r.with_rules):>5} {len(r.missing):>4}  "
                         f"{eq:<5} {r.seconds:>5.1f}s  {note}")
        fed = {r.model: r.fed for r in self.runs if r.fed}
        if fed:
            lines.append("-" * len(head))
            lines += [f"{m:<{w}} fed: {', '.join(f)}" for m, f in fed.items()]
        models = self.models()
        if len(models) > 1:
            lines.append("-" * len(head))
            for m in models:
                ops, missing = self.model_ops(m), self.model_missing(m)
                lines.append(f"{m:<{w}} {'all':<9} {len(ops):>4} {len(ops) - len(missing):>5} {len(missing):>4}")
        union, miss = self.union_ops(), self.union_missing()
        lines.append("-" * len(head))
        lines.append(f"{'union':<{w}} {'':<9} {len(union):>4} {len(union) - len(miss):>5} {len(miss):>4}")
        if miss:
            lines.append("")
            lines.append("missing ops (calls, first call site):")
            locs = self.locations()
            calls = Counter()
            for r in self.runs:
                calls.update(r.missing)
            for op in miss:
                lines.append(f"  {op:<48} {calls[op]:>6}  {locs.get(op, '?')}")
        return "\n".join(lines)


# ---- one run ---------------------------------------------------------------------------------
def _tokens(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return full(out)
    seq = getattr(out, "sequences", None)
    if seq is None and isinstance(out, (tuple, list)):
        seq = out[0]
    return full(seq)


def _generate(case: ModelCase, inputs: dict, max_new_tokens: int):
    with torch.no_grad():
        if not case.can_generate:  # an encoder, a vision or audio head: one forward, every output compared
            return case.model(**inputs)
        return case.model.generate(**inputs, **{case.max_tokens_arg: max_new_tokens}, **case.generate_kwargs)


def output_tensors(out, prefix: str = "") -> dict:
    """Every tensor in a model's output (a ModelOutput, dict, tuple or list, nested), by its path."""
    if isinstance(out, torch.Tensor):
        return {prefix or "output": out}
    if isinstance(out, dict):  # ModelOutput is an OrderedDict of its non-None fields
        items = out.items()
    elif isinstance(out, (tuple, list)):
        items = ((str(i), v) for i, v in enumerate(out))
    else:
        return {}
    found: dict = {}
    for k, v in items:
        found.update(output_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return found


def _output_diff(ref, out, argmax: bool = True) -> tuple[float, str, str | None]:
    """(worst, where, mismatch) over every output tensor of a forward: `worst` the largest difference of a float
    output relative to its magnitude above 1 (inf for NaN, or an infinity the other lacks; the same infinities
    in the same places are equal); `mismatch` says what differs that no tolerance covers (the outputs named,
    a shape, integer values, a logits argmax when `argmax`), else None."""
    refs, outs = output_tensors(ref), output_tensors(out)
    if set(refs) != set(outs):
        return float("inf"), "", f"outputs differ: {sorted(set(refs) ^ set(outs))[:4]}"
    worst, where = 0.0, ""
    for k, r in refs.items():
        r, o = full(r), full(outs[k])
        if r.shape != o.shape:
            return float("inf"), k, f"{k}: shape {tuple(r.shape)} vs {tuple(o.shape)}"
        if not (r.is_floating_point() or r.is_complex()):
            if not torch.equal(r, o):
                return float("inf"), k, f"{k}: values differ"
            continue
        if argmax and k.split(".")[-1] == "logits" and r.ndim and r.numel() and \
                not torch.equal(r.argmax(-1), o.argmax(-1)):
            return float("inf"), k, f"{k}: argmax differs"
        wide = torch.complex128 if r.is_complex() else torch.float64   # .double() would drop an imaginary part
        r, o = r.to(wide), o.to(wide)
        infinite = torch.isinf(r)
        if infinite.any() and torch.equal(infinite, torch.isinf(o)) and torch.equal(r[infinite], o[infinite]):
            r, o = r[~infinite], o[~infinite]  # the same infinities in the same places match (as assert_close)
        if r.numel():
            d = (r - o).abs().max().item() / max(1.0, r.abs().max().item())
            if not d <= worst:  # NaN counts as a difference
                worst, where = (d if d == d else float("inf")), k
    return worst, where, None


def _compare_outputs(ref, out) -> tuple[bool, str]:
    """Every output tensor of a forward: float ones within TOLERANCE (relative to their magnitude above 1),
    others (token ids, masks) identical; a `logits` output also picks the same argmax."""
    worst, where, mismatch = _output_diff(ref, out)
    if mismatch:
        return False, mismatch
    same = worst <= TOLERANCE
    return same, f"{len(output_tensors(ref))} outputs, max diff {worst:.2e}" + ("" if same else f" ({where})")


def within_conditioning(diff: float, gap: float | None, tolerance: float) -> bool:
    """Whether a difference between the DTensor and the plain float32 run is explained: within `tolerance`, or
    within CONDITIONING_FACTOR times `gap`, the plain float32 run's own difference from float64 (None: not
    measured). NaN and inf are never explained."""
    if not diff == diff or diff == float("inf"):
        return False
    if diff <= tolerance:
        return True
    return gap is not None and gap == gap and gap != float("inf") and diff <= CONDITIONING_FACTOR * gap


def _in_float64(case: ModelCase) -> ModelCase:
    """The case with its model and every float input and label in float64 (the conditioning reference)."""
    case.model.double()
    cast = lambda d: {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
                      for k, v in d.items()}
    case.inputs, case.labels = cast(case.inputs), cast(case.labels)
    return case


def _conditioned_generate(case_fn: Callable[[], ModelCase], ref, out, max_new_tokens: int,
                          report: "RunReport") -> None:
    """A forward's outputs that failed the fixed tolerance, judged against the model's own float32 vs float64 gap
    (see CONDITIONING_FACTOR); a mismatch no tolerance covers (shapes, integer outputs) stays unequal."""
    diff, where, mismatch = _output_diff(ref, out, argmax=False)
    if mismatch:
        return
    try:
        case = _in_float64(case_fn())
        torch.manual_seed(RUN_SEED)
        ref64 = _generate(case, case.inputs, max_new_tokens)
    except Exception as e:  # a model that cannot run in float64: the fixed tolerance stands
        report.detail += f"; float64 run failed ({type(e).__name__}), no conditioning measured"
        return
    gap, _, mismatch = _output_diff(ref64, ref, argmax=False)
    if mismatch:
        return
    report.conditioning = gap
    report.equal = within_conditioning(diff, gap, TOLERANCE)
    report.detail += (f"; ill-conditioned: plain fp32 vs float64 differ by {gap:.1e}, the DTensor run by "
                      f"{diff:.1e} ({'within' if report.equal else 'MORE than'} {CONDITIONING_FACTOR:g}x)")


def _compare_generate(case: ModelCase, ref, out) -> tuple[bool, str]:
    if not case.can_generate:
        return _compare_outputs(ref, out)
    ref, out = _tokens(ref), _tokens(out)
    same = ref.shape == out.shape and torch.equal(ref, out)
    return same, f"{out.shape[-1]} tokens {'identical' if same else 'DIFFER'}"


def _train_module(case: ModelCase) -> nn.Module:
    thinker = getattr(case.model, "thinker", None)  # the full Omni model trains through its thinker
    return thinker if isinstance(thinker, nn.Module) else case.model


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Adam's first step is lr * g / (|g| + eps): for |g| near eps a last-bit difference in g (a sum taken in
    # another order across ranks) moves the update by up to lr * dg / eps, so eps is kept well above 1e-8
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6,
                             weight_decay=0.01)


def _train_step(model: nn.Module, inputs: dict, labels: dict):
    model.train()
    opt = _optimizer(model)
    out = model(**inputs, **labels)
    loss = getattr(out, "loss", None)
    if loss is None:  # a head that computes no loss from labels: train on a sum of its outputs
        loss = output_loss(out)
    elif loss.ndim:  # a loss per sample (an audio codec's commitment loss): their mean
        loss = loss.float().mean()
    loss.backward()
    grads = {n: (None if p.grad is None else full(p.grad).detach().clone()) for n, p in model.named_parameters()}
    opt.step()
    after = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    return full(loss).detach(), grads, after


def output_loss(out) -> torch.Tensor:
    """A loss from a model's outputs when its head computes none: the sum of the mean squares of every float
    output that carries a gradient (so every parameter that shapes an output gets one)."""
    terms = [t.float().pow(2).mean() for t in output_tensors(out).values()
             if t.is_floating_point() and t.requires_grad and t.numel()]
    if not terms:
        raise ValueError("census: the model's outputs carry no gradient, so there is nothing to train on")
    return sum(terms[1:], terms[0])


def _max_diff(a: dict, b: dict, relative: bool = False) -> tuple[float, str]:
    """The largest difference between same-named tensors, and where. `relative`: each tensor's difference is
    divided by its magnitude when that is above 1 (float32 rounding grows with the values summed)."""
    worst, where = 0.0, ""
    for k, x in a.items():
        y = b.get(k)
        if (x is None) != (y is None):
            return float("inf"), f"{k}: gradient present in only one run"
        if x is None:
            continue
        if x.shape != y.shape:
            return float("inf"), f"{k}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
        d = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0  # double: a float64 run's too
        if relative and x.numel():
            d /= max(1.0, x.double().abs().max().item())
        if d > worst:
            worst, where = d, k
    return worst, where


def _step_with(model: nn.Module, grads: dict) -> dict:
    """The plain model's parameters after the census's AdamW step taken with the given (full) gradients.

    A split run's gradients are sums taken in another order, equal to the plain ones up to float rounding; Adam's
    first step turns such a last-bit difference of a gradient near eps into a visible one of the parameter. So the
    split run's parameters are compared with a plain step on its own gradients (the optimizer checked exactly),
    and its gradients with the plain gradients."""
    named = dict(model.named_parameters())
    for n, p in named.items():
        p.grad = None if grads.get(n) is None else grads[n].clone()
    _optimizer(model).step()
    return {n: p.detach().clone() for n, p in named.items()}


def _run_one(name: str, mode: str, build: Callable[[], ModelCase], max_new_tokens: int,
             wrap_input: Callable = replicated, wrap_param: Callable = replicated, record: bool = True,
             shard_model: Callable[[nn.Module], nn.Module] | None = None, plain_only: bool = False) -> RunReport:
    """One mode of one model: the plain run, then the same on DTensors, compared.

    `shard_model` (tensor parallel) lays out the model's parameters before the DTensor run; parameters it
    leaves plain are replicated with `wrap_param` in train mode. `plain_only`: the plain run alone (a check
    of the tiny model and its inputs)."""
    report = RunReport(name, mode)
    shard_model = shard_model or (lambda m: m)

    def recorder():  # without recording, calls take the fast paths a user's calls take (and report no ops)
        return record_missing_ops() if record else contextlib.nullcontext(MissingOpRecord())

    start = time.perf_counter()
    try:
        if mode == "generate":
            case = build()
            report.fed = fed_modalities(case.inputs)
            torch.manual_seed(RUN_SEED)  # random ops (dropout-like sampling, Gumbel noise) draw alike in both runs
            ref = _generate(case, case.inputs, max_new_tokens)
            report.plain_ok = True
            if plain_only:
                return _plain_only(report, start)
            case = build()
            shard_model(case.model)
            inputs = to_dtensor_inputs(case.inputs, wrap_input)
            with recorder() as rec:
                torch.manual_seed(RUN_SEED)
                out = _generate(case, inputs, max_new_tokens)
            report.equal, report.detail = _compare_generate(case, ref, out)
            if not report.equal and not case.can_generate:
                _conditioned_generate(build, ref, out, max_new_tokens, report)
        elif mode == "train":
            case = build()
            report.fed = fed_modalities(case.inputs)
            torch.manual_seed(RUN_SEED)
            ref_loss, ref_grads, _ = _train_step(_train_module(case), case.inputs, case.labels)
            if not math.isfinite(float(ref_loss)):   # nothing to compare a DTensor run against: the tiny config's fault
                raise FloatingPointError(f"the plain run's loss is {float(ref_loss)} (the tiny config trains to no "
                                         f"number; give the type an override in tiny_overrides.py)")
            report.plain_ok = True
            if plain_only:
                return _plain_only(report, start)
            case = build()
            shard_model(case.model)
            module = distribute_parameters(_train_module(case), wrap_param)
            inputs, labels = to_dtensor_inputs(case.inputs, wrap_input), to_dtensor_inputs(case.labels, wrap_input)
            with recorder() as rec:
                torch.manual_seed(RUN_SEED)
                loss, grads, params = _train_step(module, inputs, labels)
            dl = abs(float(ref_loss) - float(loss)) / max(1.0, abs(float(ref_loss)))
            dg, wg = _max_diff(ref_grads, grads, relative=True)
            dp, wp = _max_diff(_step_with(_train_module(build()), grads), params)
            report.equal = max(dl, dp) <= TOLERANCE and dg <= GRAD_TOLERANCE
            report.detail = f"loss {dl:.1e}, grads {dg:.1e}, params {dp:.1e}" + (
                "" if report.equal else f" (worst: {wg if dg > GRAD_TOLERANCE else wp})")
            if not report.equal and dp <= TOLERANCE:  # the optimizer step itself is checked exactly
                _conditioned_train(build, ref_loss, ref_grads, dl, dg, report)
        else:
            raise ValueError(f"unknown census mode {mode!r}; use generate, train or all")
        report.ops = dict(rec.seen)
        report.missing = dict(rec.counts)
        report.locations = dict(rec.locations)
    except Exception:
        report.error = traceback.format_exc()
        report.equal = False
        rec = locals().get("rec")
        if rec is not None:
            report.ops, report.missing, report.locations = dict(rec.seen), dict(rec.counts), dict(rec.locations)
    report.seconds = time.perf_counter() - start
    return report


def _conditioned_train(case_fn: Callable[[], ModelCase], ref_loss, ref_grads: dict, dl: float, dg: float,
                       report: RunReport) -> None:
    """A training step that failed the fixed tolerances, judged against the model's own float32 vs float64 gap
    of the loss and of the gradients (each against its own; see CONDITIONING_FACTOR)."""
    try:
        case = _in_float64(case_fn())
        torch.manual_seed(RUN_SEED)
        loss64, grads64, _ = _train_step(_train_module(case), case.inputs, case.labels)
    except Exception as e:  # a model that cannot run in float64: the fixed tolerances stand
        report.detail += f"; float64 run failed ({type(e).__name__}), no conditioning measured"
        return
    gap_l = abs(float(loss64) - float(ref_loss)) / max(1.0, abs(float(loss64)))
    gap_g, _ = _max_diff(grads64, ref_grads, relative=True)
    report.conditioning = max(gap_l, gap_g)
    report.equal = within_conditioning(dl, gap_l, TOLERANCE) and within_conditioning(dg, gap_g, GRAD_TOLERANCE)
    report.detail += (f"; ill-conditioned: plain fp32 vs float64 differ by loss {gap_l:.1e}, grads {gap_g:.1e}, "
                      f"the DTensor run by loss {dl:.1e}, grads {dg:.1e} "
                      f"({'within' if report.equal else 'MORE than'} {CONDITIONING_FACTOR:g}x)")


def _plain_only(report: RunReport, start: float) -> RunReport:
    report.equal, report.detail = True, "plain run only"
    report.seconds = time.perf_counter() - start
    return report


def _modes(mode: str) -> tuple:
    if mode == "all":
        return MODES
    if mode not in MODES:
        raise ValueError(f"unknown census mode {mode!r}; use generate, train or all")
    return (mode,)


def run_census(models: Iterable[str] | str = "all", mode: str = "all", *, max_new_tokens: int = 4,
               model_paths: Iterable[str] = (), seed: int = 0,
               progress: Callable[[str], None] | None = None, record: bool = True) -> CensusReport:
    """Run the census on built-in models (names or "all") and local checkpoints; returns the report.

    `progress` receives one line per finished run (the CLI prints them as they come). `record=False` runs
    without `record_missing_ops` (ops are then not listed, and one without a rule fails the run): the
    comparison with plain torch then covers the fast paths too.
    """
    if isinstance(models, str):
        models = [models]
    names = []
    for m in models:
        names.extend(model_names() if m == "all" else [m])
    jobs = [(n, (lambda n=n: build_model(n, seed))) for n in dict.fromkeys(names)]
    for path in model_paths:
        jobs.append((str(path), (lambda path=path: load_pretrained(path, seed))))
    import transformers  # noqa: F401  (imported once here, so the first model's time is its own)
    report = CensusReport()
    modes = _modes(mode)
    total = len(jobs) * len(modes)
    i = 0
    for name, build in jobs:
        for md in modes:
            i += 1
            r = _run_one(name, md, build, max_new_tokens, record=record)
            report.runs.append(r)
            if progress is not None:
                progress(_progress_line(i, total, r))
    return report


# ---- the batch split over local processes ----------------------------------------------------------
def _split_worker(rank: int, world: int, port: int, names: list, modes: tuple, max_new_tokens: int, seed: int,
                  queue, record: bool = True) -> None:
    import os
    from datetime import timedelta

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    mesh = Layout((world,), ("dp",))
    split = lambda t: (distribute_tensor(t, mesh("dp", *(["None"] * (t.ndim - 1)))) if t.ndim  # noqa: E731
                       else replicated(t, mesh))
    repl = lambda t: replicated(t, mesh)  # noqa: E731
    import transformers  # noqa: F401
    try:
        for name in names:
            for md in modes:
                r = _run_one(name, md, lambda: build_model(name, seed), max_new_tokens, split, repl, record)
                if rank == 0:
                    queue.put(asdict(r))
    finally:
        if rank == 0:
            queue.put(None)
        dist.destroy_process_group()


def run_split_census(models: Iterable[str] | str = "all", mode: str = "all", *, world: int = 2,
                     max_new_tokens: int = 4, seed: int = 0, timeout: float = 600.0,
                     progress: Callable[[str], None] | None = None, record: bool = True) -> CensusReport:
    """The census with the batch split over `world` local gloo processes: inputs laid out ("dp", "None", ...),
    parameters replicated. Results are compared with the single-process plain run (reported by rank 0).
    `record` as for `run_census`."""
    import multiprocessing as mp
    import queue as queue_mod
    import socket
    if isinstance(models, str):
        models = [models]
    names = list(dict.fromkeys(n for m in models for n in (model_names() if m == "all" else [m])))
    modes = _modes(mode)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_split_worker, args=(r, world, port, names, modes, max_new_tokens, seed, q, record),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    report = CensusReport()
    total = len(names) * len(modes)
    try:
        while True:
            item = q.get(timeout=timeout)
            if item is None:
                break
            r = RunReport(**{k: v for k, v in item.items()})
            report.runs.append(r)
            if progress is not None:
                progress(_progress_line(len(report.runs), total, r))
    except queue_mod.Empty:
        report.runs.append(RunReport("?", "?", error=f"no result within {timeout}s: a rank hung", equal=False))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return report


def _progress_line(i: int, total: int, r: RunReport) -> str:
    status = "ERROR" if r.error else ("ok" if r.ok else "incomplete")
    why = r.detail or " ".join((r.error or "").strip().splitlines()[-1:])
    return (f"[{i}/{total}] {r.model} {r.mode}: {len(r.ops)} ops, {len(r.missing)} missing, equal={r.equal} "
            f"({why[:160]}) {r.seconds:.1f}s {status}")


def write_json(report: CensusReport, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_dict(), f, indent=2, default=str)


__all__ = ["within_conditioning", "CONDITIONING_FACTOR", "run_census", "run_split_census", "CensusReport", "RunReport", "distribute_parameters", "to_dtensor_inputs", "replicated",
           "census_layout", "write_json"]
