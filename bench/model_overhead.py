"""Model-level overhead: plain torch vs hyper_parallel DTensor vs torch.distributed.tensor.DTensor.

    .venv/bin/python bench/model_overhead.py [--models llama_ref,llama,...] [--repeat 30] [--quick] [--profile]
        [--backends plain,ours,"torch DT"] [--clock cpu|wall] [--cold-repeat 3] [--new-tokens 8]

Why: every op of a transformers model goes through our dispatcher, so per-op cost adds up per forward,
per generated token and per training step. This measures it on whole tiny models (issue 6), one
process, one thread, a world-size-1 gloo group:

- plain: the model as built, plain tensors;
- ours: inputs and every parameter as hyper_parallel DTensors replicated on a 1-rank mesh
  (`nn.Parameter(DTensor.from_local(p.detach(), layout("None", ...)))`, the single-card scenario);
- torch DT: Replicate parameters via `distribute_module`, inputs as torch DTensors, run inside
  `implicit_replication()`; eager attention if sdpa fails.

Per model and backend: forward (median ms), greedy `generate` time per new token (total time of one
generate call / new tokens, prefill included), one training step (forward with labels, backward,
AdamW step), each with its ratio to plain; cold forward (the first call on a fresh model with our and
torch DT's decision caches cleared, median over --cold-repeat fresh models); for ours the ops dispatched
per forward (`hyper_parallel.dispatch.count_calls`) and the decision-cache hit rate (hits / (hits +
misses); replicated calls need no decision). The backends of a model take turns in blocks of calls, so
drift of the machine's speed moves them alike. Times are thread CPU time by default (`--clock wall` for
perf_counter): the same as wall time for one thread on an idle machine, but not inflated by waiting for
a core on a busy one. `bench/model_instructions.py` counts instructions instead, which no load moves.
A failing cell shows the error and the run goes on. `llama_ref` is the issue's reference size
(Llama, hidden 64, 2 layers, batch 1, sequence 16); the others are `hyper_parallel.tools.models`.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import platform
import pstats
import statistics
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_MODELS = ("llama_ref", "llama", "qwen3", "qwen3_moe", "qwen3_vl")
BACKENDS = ("plain", "ours", "torch DT")
ATOL = 1e-5


# ---- models ----------------------------------------------------------------------------------
def _llama_ref(seed: int):
    """The issue's reference: Llama hidden 64, 2 layers, sequence 16 (batch 1), so figures compare to it."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from hyper_parallel.tools.models import ModelCase, _finish
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0,
                      bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = _finish(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"))
    ids = torch.randint(1, 100, (1, 16), generator=torch.Generator().manual_seed(seed))
    return ModelCase("llama_ref", model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                     labels={"labels": ids.clone()})


def build(name: str, seed: int = 0):
    """A fresh ModelCase (same seed -> same weights and inputs), so every backend starts equal."""
    if name == "llama_ref":
        return _llama_ref(seed)
    from hyper_parallel.tools.models import build_model
    return build_model(name, seed)


# ---- backends: how a model and its inputs are prepared, and the context ops run in ------------
class Plain:
    name = "plain"

    def prepare(self, model: nn.Module) -> nn.Module:
        return model

    def wrap(self, inputs: dict) -> dict:
        return dict(inputs)

    def context(self):
        return nullcontext()

    def unwrap(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def clear(self) -> None:
        pass


class Ours:
    """hyper_parallel DTensors replicated on a 1-rank mesh: inputs and parameters."""

    name = "ours"

    def __init__(self) -> None:
        import hyper_parallel as hp
        self.hp = hp
        self.layout = hp.Layout((1,), ("tp",))

    def _rep(self, t: torch.Tensor):
        return self.hp.DTensor.from_local(t, self.layout(*(["None"] * t.ndim)))

    def prepare(self, model: nn.Module) -> nn.Module:
        done: dict = {}
        for module in model.modules():
            for pname, p in list(module._parameters.items()):
                if p is None:
                    continue
                new = done.get(id(p))  # tied weights stay tied
                if new is None:
                    new = done[id(p)] = nn.Parameter(self._rep(p.detach()), requires_grad=p.requires_grad)
                module._parameters[pname] = new
        return model

    def wrap(self, inputs: dict) -> dict:
        return {k: self._rep(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def context(self):
        return nullcontext()

    def unwrap(self, t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if type(t) is self.hp.DTensor else t

    def clear(self) -> None:
        from hyper_parallel.dispatch import clear_caches
        clear_caches()


class TorchDT:
    """torch.distributed.tensor: Replicate parameters (distribute_module), DTensor inputs, implicit replication."""

    name = "torch DT"

    def __init__(self) -> None:
        from torch.distributed.tensor import DTensor, Replicate, distribute_module, init_device_mesh
        self.DTensor, self.Replicate, self.distribute_module = DTensor, Replicate, distribute_module
        self.mesh = init_device_mesh("cpu", (1,))

    def prepare(self, model: nn.Module) -> nn.Module:
        return self.distribute_module(model, self.mesh)  # default partition: every parameter Replicate

    def wrap(self, inputs: dict) -> dict:
        return {k: self.DTensor.from_local(v, self.mesh, [self.Replicate()]) if isinstance(v, torch.Tensor) else v
                for k, v in inputs.items()}

    def context(self):
        from torch.distributed.tensor.experimental import implicit_replication
        return implicit_replication()

    def unwrap(self, t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, self.DTensor) else t

    def clear(self) -> None:
        """Clear torch's sharding-propagation caches (decisions, tensor metadata) for an honest cold time."""
        prop = self.DTensor._op_dispatcher.sharding_propagator
        for cached in (getattr(prop, "propagate_op_sharding", None),
                       getattr(type(prop), "_propagate_tensor_meta_cached", None)):
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()
        native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's
        if native is not None:
            native()


# ---- measurements ----------------------------------------------------------------------------
@dataclass
class Cell:
    """One measurement: median ms, or the error that stopped it."""

    ms: float | None = None
    err: str | None = None


@dataclass
class Row:
    model: str
    backend: str
    note: str = ""
    fwd: Cell = field(default_factory=Cell)
    gen: Cell = field(default_factory=Cell)
    train: Cell = field(default_factory=Cell)
    cold: Cell = field(default_factory=Cell)
    ops: int | None = None
    hit_rate: float | None = None
    replicated: int | None = None
    default_err: str | None = None   # why torch DT fell back to eager implementations


# Thread CPU time by default: with one thread and no I/O it equals wall time on an idle machine, and on a
# loaded one it leaves out the time spent waiting for a core, which otherwise swamps the differences.
CLOCK: Callable[[], float] = time.thread_time


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def _prepared(backend, name: str, seed: int, fallback: tuple = ()):
    """Build and convert a fresh model; `fallback` names the eager implementations to switch to first."""
    case = build(name, seed)
    if "eager attn" in fallback:
        case.model.set_attn_implementation("eager")
    if "eager experts" in fallback:
        case.model.set_experts_implementation("eager")
    model = backend.prepare(case.model)
    return case, model, backend.wrap(case.inputs), backend.wrap(case.labels)


# torch DT has no sharding strategy for sdpa on CPU and its meta kernel of grouped_mm wants bf16:
# these are the eager implementations it is retried with, in order
_FALLBACKS = (("eager attn",), ("eager attn", "eager experts"))


@dataclass
class Subject:
    """One model on one backend, ready to be timed: a callable per measurement (None where it failed)."""

    row: Row
    calls: dict = field(default_factory=dict)   # "fwd" / "gen" / "train" -> callable
    per: dict = field(default_factory=dict)     # divisor of a call's time (gen: new tokens)
    logits: torch.Tensor | None = None


def prepare(backend, name: str, seed: int, new_tokens: int, ref_logits: torch.Tensor | None,
            cold_repeat: int = 3) -> Subject:
    """Build the model on `backend`, time its cold forward, check its logits, count its ops; then the
    forward, generate and training-step callables that `measure` times side by side with the other backends."""
    row = Row(name, backend.name)
    subject = Subject(row)
    try:
        case, model, inputs, labels = _prepared(backend, name, seed)
    except Exception as e:
        row.fwd = row.gen = row.train = row.cold = Cell(err="setup: " + _err(e))
        return subject

    def forward_of(model, inputs):
        def forward():
            with torch.no_grad(), backend.context():
                return model(**inputs)
        return forward

    def cold(model, inputs) -> tuple[Any, float]:
        backend.clear()
        t0 = CLOCK()
        result = forward_of(model, inputs)()
        return result, (CLOCK() - t0) * 1e3

    # cold forward (torch DT: retried with eager attention / experts when the default implementation fails)
    out, fallback = None, ()
    try:
        out, ms = cold(model, inputs)
        row.cold = Cell(ms)
    except Exception as e:
        row.cold = row.fwd = Cell(err=_err(e))
        if isinstance(backend, TorchDT):
            row.default_err = _err(e)
            for fb in _FALLBACKS:
                try:
                    case, model, inputs, labels = _prepared(backend, name, seed, fb)
                    out, ms = cold(model, inputs)
                    row.cold, row.note, fallback = Cell(ms), ", ".join(fb), fb
                    break
                except Exception as e2:
                    row.cold = row.fwd = Cell(err=_err(e2))
    if out is None:
        row.gen = row.train = Cell(err=row.cold.err)
        return subject
    if cold_repeat > 1:  # a single first call is too noisy: median over fresh models
        colds = [row.cold.ms]
        for _ in range(cold_repeat - 1):
            _, m2, i2, _ = _prepared(backend, name, seed, fallback)
            colds.append(cold(m2, i2)[1])
        row.cold = Cell(statistics.median(colds))
    with torch.no_grad(), backend.context():
        subject.logits = backend.unwrap(_logits(out)).detach().clone()
    if ref_logits is not None and not (subject.logits.shape == ref_logits.shape and
                                       torch.allclose(subject.logits, ref_logits, atol=ATOL, rtol=ATOL)):
        same_shape = subject.logits.shape == ref_logits.shape
        diff = (subject.logits - ref_logits).abs().max().item() if same_shape else float("nan")
        print(f"WARNING: {name} {backend.name}: forward logits differ from plain (max abs diff {diff:.2e})")
    forward = forward_of(model, inputs)
    subject.calls["fwd"] = forward
    if isinstance(backend, Ours):
        from hyper_parallel.dispatch import count_calls
        with count_calls() as d:
            forward()
        row.ops = sum(d.values())
        row.replicated = d["replicated"]
        looked_up = d["hits"] + d["misses"]
        row.hit_rate = d["hits"] / looked_up if looked_up else None

    if case.can_generate:
        def generate():
            with torch.no_grad(), backend.context():
                return model.generate(**inputs, **{case.max_tokens_arg: new_tokens}, do_sample=False,
                                      **case.generate_kwargs)
        subject.calls["gen"], subject.per["gen"] = generate, new_tokens
    else:
        row.gen = Cell(err="no generate")

    state: dict = {}

    def step():  # forward with labels, backward, AdamW step; the optimizer is made on the first call
        if "opt" not in state:
            model.train()
            params = [p for p in model.parameters() if p.requires_grad]
            state["opt"] = torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.01, **OPTIMIZER_KWARGS)
        opt = state["opt"]
        with backend.context():
            opt.zero_grad(set_to_none=True)
            loss = model(**inputs, **labels).loss
            loss.backward()
            opt.step()
    subject.calls["train"] = step
    return subject


# --optimizer: torch's choice on this device (on CPU the per-tensor loop, for plain tensors and DTensors alike),
# or its multi-tensor kernels (what CUDA picks by default), for every backend alike
OPTIMIZER_KWARGS: dict = {}
BLOCK = 5  # consecutive calls of one backend per turn; the first of each block is not timed


def measure(subjects: list[Subject], repeat: int) -> None:
    """Median times, with the backends of one model taking turns, so that drift of the machine's speed (other
    jobs, frequency) moves every backend alike. A turn is a block of consecutive calls whose first call only
    warms the caches the other backend used, so each is timed as if it ran alone. Forwards about `repeat`
    times, generates and training steps half as often; the training step comes last (it switches the models
    to train mode)."""
    for metric, times in (("fwd", repeat), ("gen", max(1, repeat // 2)), ("train", max(1, repeat // 2))):
        live = []
        for s in subjects:
            fn = s.calls.get(metric)
            if fn is None:
                continue
            try:
                fn()  # warm-up (and the first training step builds the optimizer state)
                live.append(s)
            except Exception as e:
                setattr(s.row, metric, Cell(err=_err(e)))
        block = min(BLOCK, times + 1)
        samples: dict = {id(s): [] for s in live}
        gc.collect()
        for _ in range(-(-times // (block - 1))):
            for s in list(live):
                fn, per = s.calls[metric], s.per.get(metric, 1)
                try:
                    fn()
                    for _ in range(block - 1):
                        t0 = CLOCK()
                        fn()
                        samples[id(s)].append((CLOCK() - t0) * 1e3 / per)
                except Exception as e:
                    setattr(s.row, metric, Cell(err=_err(e)))
                    live.remove(s)
        for s in live:
            setattr(s.row, metric, Cell(statistics.median(samples[id(s)])))


# ---- report ----------------------------------------------------------------------------------
def _cell(c: Cell, base: Cell | None, errors: list[str]) -> str:
    if c.err is not None:
        if c.err not in errors:
            errors.append(c.err)
        return f"error [{errors.index(c.err) + 1}]"
    if c.ms is None:
        return "-"
    if base is None or base.ms is None or base is c:
        return f"{c.ms:.2f}"
    return f"{c.ms:.2f} ({c.ms / base.ms:.2f}x)"


def table(rows: list[Row]) -> tuple[str, list[str]]:
    """The markdown table (ratios to the same model's plain row) and the numbered error texts."""
    errors: list[str] = []
    plain = {r.model: r for r in rows if r.backend == "plain"}
    lines = ["| model | backend | forward ms | generate ms/token | train step ms | cold forward ms "
             "| ops/forward | cache hit rate |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = plain.get(r.model)
        ops = "-" if r.ops is None else f"{r.ops} ({r.replicated} rep)"
        hit = "-" if r.hit_rate is None else f"{100 * r.hit_rate:.1f}%"
        if r.ops is not None and r.hit_rate is None:
            hit = "n/a (all replicated)"
        backend = r.backend + (f" ({r.note})" if r.note else "")
        lines.append(f"| {r.model} | {backend} | {_cell(r.fwd, p and p.fwd, errors)} "
                     f"| {_cell(r.gen, p and p.gen, errors)} | {_cell(r.train, p and p.train, errors)} "
                     f"| {_cell(r.cold, p and p.cold, errors)} | {ops} | {hit} |")
    return "\n".join(lines), errors


def machine_line(repeat: int, new_tokens: int, cold_repeat: int) -> str:
    try:
        import transformers
        tv = transformers.__version__
    except Exception:
        tv = "?"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (load {load:.1f}), "
            f"Python {platform.python_version()}, torch {torch.__version__}, transformers {tv}, "
            f"1 thread, fp32, {'thread CPU' if CLOCK is time.thread_time else 'wall'} time, median of {repeat} "
            f"forwards / {max(1, repeat // 2)} generates and train steps / {cold_repeat} cold forwards on fresh "
            f"models, {new_tokens} new tokens, AdamW {', '.join(OPTIMIZER_KWARGS) or 'default'}")


def profile_ours(name: str, seed: int, calls: int = 50, top: int = 10) -> str:
    """cProfile of warm 'ours' forwards: where the dispatcher's time goes (top functions by tottime).

    Timed with the bench's clock (thread CPU time by default), so a loaded machine does not skew the shares."""
    backend = Ours()
    case, model, inputs, _ = _prepared(backend, name, seed)
    with torch.no_grad():
        model(**inputs)
        prof = cProfile.Profile(CLOCK)
        prof.enable()
        for _ in range(calls):
            model(**inputs)
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    clock = "thread CPU" if CLOCK is time.thread_time else "wall"
    return f"cProfile ({clock} time) of {calls} 'ours' {name} forwards, top {top} by tottime:\n" + buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help="comma-separated: llama_ref or names from hyper_parallel.tools.models")
    ap.add_argument("--repeat", type=int, default=30, help="forwards per median (generate/train: half)")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--quick", action="store_true", help="repeat 3, 4 new tokens")
    ap.add_argument("--profile", action="store_true", help="also cProfile the 'ours' llama_ref forward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cold-repeat", type=int, default=3, help="fresh models per cold-forward median")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: thread CPU time (robust on a loaded machine); wall: perf_counter")
    ap.add_argument("--optimizer", choices=("default", "foreach", "fused"), default="default",
                    help="the training step's AdamW: torch's default for the device, foreach=True or fused=True")
    args = ap.parse_args()
    if args.optimizer != "default":
        OPTIMIZER_KWARGS[args.optimizer] = True
    if args.quick:
        args.repeat, args.new_tokens, args.cold_repeat = 3, 4, 1
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29612")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    import logging
    import transformers
    transformers.logging.set_verbosity_error()
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)  # torch DT's failed meta runs

    makers = {"plain": Plain, "ours": Ours, "torch DT": TorchDT}
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    backends = []
    for b in wanted:
        try:
            backends.append(makers[b]())
        except Exception as e:
            print(f"backend {b} unavailable: {_err(e)}")
    # one throwaway plain forward, so torch's one-time lazy initialisation is not charged to the first cold cell
    with torch.no_grad():
        warm = build("llama_ref", args.seed)
        warm.model(**warm.inputs)
    rows: list[Row] = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        ref, subjects = None, []
        t0 = time.perf_counter()
        for backend in backends:
            try:
                subject = prepare(backend, name, args.seed, args.new_tokens, ref, args.cold_repeat)
            except Exception as e:  # never lose the other rows
                traceback.print_exc()
                subject = Subject(Row(name, backend.name, fwd=Cell(err=_err(e))))
            if backend.name == "plain":
                ref = subject.logits
            subjects.append(subject)
        measure(subjects, args.repeat)
        rows += [s.row for s in subjects]
        print(f"  done {name} in {time.perf_counter() - t0:.1f}s", flush=True)
    md, errors = table(rows)
    print("\n" + machine_line(args.repeat, args.new_tokens, args.cold_repeat) + "\n")
    print(md)
    for i, e in enumerate(errors, 1):
        print(f"[{i}] {e}")
    for r in rows:
        if r.default_err and r.note:
            print(f"{r.model} / {r.backend}: {r.note} because the default fails: {r.default_err}")
        elif r.default_err and r.default_err != r.cold.err:
            print(f"{r.model} / {r.backend}: default implementation fails with {r.default_err}; "
                  f"with eager attention and experts: the error above")
    if args.profile:
        print()
        try:
            print(profile_ours("llama_ref", args.seed))
        except Exception as e:
            print(f"profile failed: {_err(e)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
