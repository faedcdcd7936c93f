"""`hp.plan` / `hyper-parallel plan`: what each rank of a run will hold and send, without its hardware.

One CPU process plays one rank of the run at a time: torch.distributed's fake process group (every
collective returns at once, nothing moves) at the run's world size and that rank, the model built on the
meta device (no memory, no weights) from its config, and the library's own entry functions
(`parallelize`, `pipeline`) lay it out exactly as a real run would. Then one training step runs on meta
tensors through the same dispatch and the same `redistribute/collectives.py` a real run uses, so:

- parameter, gradient and optimizer-state bytes are what that rank's real run allocates: the unique
  storages behind the parameters' local shards, their `.grad`s and the optimizer's state after a step
  (a parameter that is a view of a bigger tensor counts the whole storage, as the allocator holds it);
- collectives (kind, mesh axis, count, bytes this rank passes in) are `comm_counter()`'s books of that step;
- activation bytes are the unique storages autograd saves for backward during one micro-batch's forward
  (`saved_tensors_hooks`), parameters excluded, under the recompute policy;
- FLOPs are `FlopCounterMode`'s count of the local ops of forward + backward.

With a "pp" axis the plan plays each stage's first rank, in stage order, laid out by the library's
`pipeline` (the schedule, micro-batches and stage parallelisms a real run uses). torch's schedules cannot run
on meta tensors (their P2P warm-up reads values), so `MetaSchedule` replays torch's gpipe / 1f1b order for
the rank's stage itself (forward, loss on the last stage, backward per micro-batch) and books the sends
torch's stage posts (activations forward, input gradients backward, each on axis "pp" as "send", as
`CountedStage` counts them on a real run); what the previous stage hands on comes from its own plan
(`PipelinePeers`). Both sides count a steady-state step: the first `Pipeline.step` (the once-per-shape
stage probe, and on a real run torch's metadata inference, an extra forward and input-gradient pass) runs
uncounted. A stage's activation bytes are one micro-batch's saved storages (`FirstMicroBatch`, the same
hooks on meta and on a real run) times the micro-batches in flight on it: 1f1b min(microbatches,
pp - stage), gpipe all of them. Interleaved and zero-bubble schedules are refused (PP_NOT_YET).

Two things are assumptions, stated in the record: a mixture-of-experts router has no values on meta, so
the token exchange assumes balanced routing (every rank sends and receives an even share; counts are exact,
all_to_all bytes are the balanced figure); and the predicted peak is parameters + gradients + optimizer
state + the activations of the micro-batches in flight (no allocator fragmentation, no transient buffers).
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

AXES = ("pp", "dp", "ep", "tp", "cp")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
LEVELS = ("level1", "level2", "level3")
RECOMPUTE = ("none", "full")
PP_NOT_YET = ("pipeline schedule {schedule!r} cannot be planned yet: the planner replays the gpipe and 1f1b orders "
              "(one stage per rank) itself, not the interleaved or zero-bubble ones; plan with --schedule 1f1b or "
              "gpipe")
PP_RECOMPUTE_NOT_YET = ("recompute 'full' with a 'pp' axis cannot be planned: the library's pipeline does not run "
                        "checkpointed decoder layers yet (a stage's first layer takes the received hidden state from "
                        "a one-shot hook that a recomputation would not see), so a real run refuses it too; plan "
                        "this mesh with --recompute none")
BYTE_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "peak_bytes")


# ---- arguments -----------------------------------------------------------------------------------------------
def parse_mesh(text: str | Mapping[str, int], world: int | None = None) -> dict:
    """"pp=8,dp=4,ep=8,tp=4" (outer -> inner) as an ordered dict; unknown axes and a product that is not the
    world are ValueErrors that say what to write instead."""
    if isinstance(text, Mapping):
        items = [(str(k), v) for k, v in text.items()]
    else:
        items = []
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            name, eq, size = part.partition("=")
            if not eq:
                raise ValueError(f"mesh entry {part!r}: write axis=size, e.g. --mesh dp=4,tp=2")
            items.append((name.strip(), size.strip()))
    mesh: dict = {}
    for name, size in items:
        if name not in AXES:
            raise ValueError(f"unknown mesh axis {name!r}: the axes are {', '.join(AXES)}")
        if name in mesh:
            raise ValueError(f"mesh axis {name!r} given twice")
        try:
            mesh[name] = int(size)
        except (TypeError, ValueError):
            raise ValueError(f"mesh axis {name}={size!r}: the size must be a whole number") from None
        if mesh[name] < 1:
            raise ValueError(f"mesh axis {name}={size}: the size must be at least 1")
    if not mesh:
        raise ValueError("empty mesh: give e.g. --mesh dp=4,tp=2")
    if world is not None and math.prod(mesh.values()) != world:
        raise ValueError(f"mesh {mesh_str(mesh)} holds {math.prod(mesh.values())} ranks, not the world of {world}: "
                         f"make the sizes multiply to {world}")
    return mesh


def mesh_str(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items())


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _config_keys(config) -> set:
    """The keys a config class takes: its attributes and its constructor's arguments (some, like head_dim,
    are attributes only once given)."""
    import inspect
    keys = set(config.to_dict())
    for cls in type(config).__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            keys |= set(inspect.signature(init).parameters) - {"self", "kwargs"}
    return keys


def apply_overrides(config, overrides: Mapping[str, Any] | list | None):
    """`key=value` (or a dict) onto `config` before the model is built; `text_config.x` sets a sub-config's key.
    A key the config does not have is a ValueError (a typo would otherwise plan the default)."""
    if not overrides:
        return config
    if not isinstance(overrides, Mapping):
        pairs = {}
        for item in overrides:
            key, eq, value = str(item).partition("=")
            if not eq:
                raise ValueError(f"--set {item!r}: write key=value, e.g. --set num_hidden_layers=4")
            pairs[key.strip()] = _value(value.strip())
        overrides = pairs
    for key, value in overrides.items():
        obj = config
        parts = key.split(".")
        for part in parts[:-1]:
            obj = getattr(obj, part, None)
            if obj is None:
                raise ValueError(f"--set {key}: the config has no sub-config {part!r}")
        name = parts[-1]
        if not hasattr(obj, name) and name not in _config_keys(obj):
            import warnings   # modeling code reads some keys with getattr(config, key, default) (head_dim)
            warnings.warn(f"--set {key}: {type(obj).__name__} does not declare {name!r}; set anyway (the modeling "
                          f"code may read it with a default, as head_dim; a typo plans the default)", stacklevel=2)
        setattr(obj, name, value)
    return config


def load_config(model_type: str | None = None, *, config=None, config_file: str | None = None,
                model_path: str | None = None, overrides=None):
    """The model's config from one of: a config object, a model type (its default config), a config.json, or a
    checkpoint folder (its config only: no weights are read)."""
    import os
    from transformers import AutoConfig, PretrainedConfig
    given = [x is not None for x in (model_type, config, config_file, model_path)]
    if sum(given) != 1:
        raise ValueError("give exactly one of --model-type, --config FILE, --model-path DIR (or config=)")
    if config is not None:
        import copy
        cfg = copy.deepcopy(config)
    elif model_type is not None:
        from .auto_models import all_model_types
        if model_type not in set(all_model_types()):
            raise ValueError(f"unknown model type {model_type!r}: give a transformers model_type with a model class "
                             f"(e.g. llama, qwen3_moe, qwen3_vl), or --config FILE / --model-path DIR")
        cfg = AutoConfig.for_model(model_type)
    elif config_file is not None:
        if not os.path.isfile(config_file):
            raise ValueError(f"--config {config_file}: no such file (a config.json)")
        with open(config_file) as f:
            d = json.load(f)
        if "model_type" not in d:
            raise ValueError(f"--config {config_file}: no model_type in it")
        cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    else:
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ValueError(f"--model-path {model_path}: no config.json there (a local folder; nothing is downloaded)")
        cfg = AutoConfig.from_pretrained(model_path, local_files_only=True)
    assert isinstance(cfg, PretrainedConfig)
    return apply_overrides(cfg, overrides)


def _text_config(config):
    sub = getattr(config, "get_text_config", None)
    return sub() if sub is not None else config


def _layers_key(config) -> tuple[Any, str]:
    text = _text_config(config)
    return text, "num_hidden_layers"


# ---- one rank ------------------------------------------------------------------------------------------------
def _fresh_group(world: int, rank: int) -> None:
    """torch.distributed as rank `rank` of a fake world of `world`, and every cache keyed without the rank
    emptied (meshes, axis names, layouts, decisions, redistribution plans)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError("hp.plan runs in a process without torch.distributed (it plays each rank on a fake "
                               "process group); call it before init_process_group, or in its own process")
        dist.destroy_process_group()
    _clear_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _clear_caches() -> None:
    from ..dispatch import dispatcher
    from ..layout import layout as layout_mod
    from ..layout import mesh as mesh_mod
    from ..redistribute import planner
    mesh_mod.clear_caches()
    layout_mod._LAYOUTS.clear()
    dispatcher._CACHE.clear()
    planner._PLANS.clear()


def _key(t: torch.Tensor):
    return t.untyped_storage()._cdata


def _local(t):
    from ..dtensor.dtensor import DTensor
    return t._local if isinstance(t, DTensor) else t


def _storages(tensors, skip: set | None = None) -> tuple[int, set]:
    """Bytes of the distinct storages behind `tensors` (DTensors by their local shard), minus those in `skip`."""
    seen: dict = {}
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        k = _key(t)
        if (skip and k in skip) or k in seen:
            continue
        seen[k] = t.untyped_storage().nbytes()
    return sum(seen.values()), set(seen)


class SavedTensors:
    """Unique storages autograd saves for backward while recording, the parameters' own storages left out:
    the activation memory one forward holds until its backward.

    Storages are told apart by their StorageImpl address, so each one counted is held here until `bytes()`:
    a storage freed mid-forward could otherwise hand its address to a new one, and addresses compared after
    the step (the gradients') could match a freed activation's. Either made the figure vary run to run."""

    def __init__(self, skip: set):
        self.skip = skip
        self.storages: dict = {}

    def pack(self, t):
        local = _local(t)
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):   # a tensor without storage (a wrapper): its local counts
            return t
        key = storage._cdata
        if key not in self.skip and key not in self.storages:
            self.storages[key] = storage
        return t

    def bytes(self) -> int:
        """The recorded bytes; releases the storages held for counting."""
        total = sum(s.nbytes() for s in self.storages.values())
        self.storages.clear()
        return total

    @contextlib.contextmanager
    def recording(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield self


class FusedSdpa(TorchFunctionMode):
    """sdpa on meta tensors by the CPU flash kernel, as a CPU run picks it (see `meta_kernels`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args:
            if type(args[0]) is torch.Tensor:
                if args[0].is_meta:
                    out = _flash_cpu(*args, **kwargs)
                    if out is not None:
                        return out
                return func(*args, **kwargs)
            with self:   # a DTensor call, run by the DTensor: its local sdpa call must meet this mode too
                return type(args[0]).__torch_function__(func, types, args, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_kernels():
    """On meta, the same kernels a CPU run picks: sdpa's fused CPU flash kernel (the math path meta would take
    saves the attention matrix the fused kernel never holds), and a grouped matmul in float32 through
    transformers' fallback op (the meta grouped_mm kernel takes bf16 only)."""
    stack = contextlib.ExitStack()
    try:
        import transformers.integrations.moe as moe
        original_can = moe._can_use_grouped_mm

        def can_use(input, weight, offs):
            if weight.is_meta and weight.dtype != torch.bfloat16:
                return False
            return original_can(input, weight, offs)
        moe._can_use_grouped_mm = can_use
        stack.callback(setattr, moe, "_can_use_grouped_mm", original_can)
    except (ImportError, AttributeError):
        pass

    try:   # position ids on meta have no values to find packed sequences in: the plan feeds unpacked rows
        import transformers.masking_utils as masking
        original_find = masking.find_packed_sequence_indices

        def find_packed(position_ids, *a, **k):
            return None if position_ids.is_meta else original_find(position_ids, *a, **k)
        masking.find_packed_sequence_indices = find_packed
        stack.callback(setattr, masking, "find_packed_sequence_indices", original_find)
    except (ImportError, AttributeError):
        pass

    with stack, FusedSdpa():
        yield


def _flash_cpu(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The CPU flash kernel on meta tensors (it has a meta kernel and an autograd formula), as the CPU dispatcher
    picks it, a mask included (a boolean one made additive first, as sdpa does); None where the CPU dispatcher
    would not pick it either (dropout)."""
    if attn_mask is not None and is_causal:
        return None   # sdpa refuses both at once
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attn_mask.to(query.device), float("-inf"))
    if dropout_p:
        return None
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
    try:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, bool(is_causal),
                                                                          attn_mask=attn_mask, scale=scale)
    except (RuntimeError, NotImplementedError):
        return None
    return out[0]


def local_flop_counter():
    """`FlopCounterMode` that counts the local ops only: a call on DTensors is left to the DTensor (which runs
    the local op, counted then), so nothing is counted twice and the wrapper's own dispatch is untouched."""
    from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

    class LocalOnly(_FlopCounterMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types):
                return NotImplemented
            return super().__torch_dispatch__(func, types, args, kwargs)
    class Counter(FlopCounterMode):
        def __enter__(self):
            self.flop_counts.clear()
            self.mod_tracker.__enter__()
            self.mode = LocalOnly(self)
            self.mode.__enter__()
            return self
    from torch.utils.flop_counter import sdpa_backward_flop, sdpa_flop
    aten = torch.ops.aten   # the CPU flash kernel has no formula of its own: the same count as the fused ones
    def raw(formula):   # torch's formulas are already shape-wrapped: passed through as they are
        def count(*args, **kwargs):
            return formula(*args, **kwargs)
        count._get_raw = True
        return count
    return Counter(display=False, custom_mapping={aten._scaled_dot_product_flash_attention_for_cpu: raw(sdpa_flop),
                                                  aten._scaled_dot_product_flash_attention_for_cpu_backward:
                                                  raw(sdpa_backward_flop)})


def _build(config, dtype: torch.dtype, device: str = "meta"):
    from transformers import AutoModelForCausalLM
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        except ValueError:
            from transformers import AutoModelForImageTextToText
            model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.train()
    return model


def _inputs(rows: int, seq: int, config, device: str) -> dict:
    """Token ids (labels = ids): zeros on meta (no values), random ones for a measured run. Every rank draws
    the same ids (the same seed): the ranks of a tp/cp/pp group must feed the same batch (API §12)."""
    if device == "meta":
        ids = torch.zeros((rows, seq), dtype=torch.long, device="meta")
    else:
        vocab = int(getattr(_text_config(config), "vocab_size", 100))
        ids = torch.randint(1, max(vocab - 1, 2), (rows, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _hsdp_kwargs(options: dict) -> dict:
    kw = {"optimizer_level": options["optimizer_level"]}
    kw.update(options.get("hsdp") or {})
    return kw


def _recompute(model, policy: str) -> None:
    """Full recompute: transformers' activation checkpointing of every decoder layer. The recompute runs in
    backward, outside `meta_kernels`' mode, so it gets the same mode of its own: otherwise sdpa would take
    another kernel there than in the forward, and checkpoint refuses recomputed values whose shapes differ."""
    if policy == "full":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": lambda: (contextlib.nullcontext(), FusedSdpa())})


def plan_rank(config, mesh: Mapping[str, int], rank: int, options: dict,
              peers: "PipelinePeers | None" = None) -> dict:
    """Play `rank` of the run on a fake process group: lay the meta model out with the library, run one
    training step on meta tensors, and return what that rank holds and sends. `peers`: with pp, what the
    stages planned before this one sent (plan() plays the stages in order)."""
    _fresh_group(math.prod(mesh.values()), rank)
    return run_step(config, mesh, options, "meta", peers=peers)


def run_step(config, mesh: Mapping[str, int], options: dict, device: str,
             peers: "PipelinePeers | None" = None) -> dict:
    """One training step of this rank on the process group that is up (the fake one when planning, gloo when
    `--verify` measures), the model built on `device` ("meta": nothing allocated; "cpu": a real run), laid
    out by the library's entry functions; returns what the step allocated and sent. Planning and measuring
    run this same function: the only difference is the device and the process group (and, with pp, the
    schedule: torch's on a real run, `MetaSchedule` on meta)."""
    import hyper_parallel as hp
    if device != "meta":
        torch.manual_seed(0)
    model = _build(config, options["dtype"], device)
    _recompute(model, options["recompute"])
    dmesh = hp.init_device_mesh("cpu", tuple(mesh.values()), mesh_dim_names=tuple(mesh))
    hsdp = _hsdp_kwargs(options) if "dp" in mesh else None
    cp = (options.get("cp_method") or "ring") if "cp" in mesh else None
    with meta_kernels():
        if "pp" in mesh:
            return _pipeline_step(model, config, dmesh, options, device, hsdp, cp, peers or PipelinePeers())
        hp.parallelize(model, dmesh, hsdp=hsdp, cp=cp)
        params = list(model.parameters())
        param_bytes, param_keys = _storages(params)
        saved = SavedTensors(skip=param_keys)
        batch = _inputs(options["micro_batch"], options["seq"], config, device)
        opt = torch.optim.AdamW(params, lr=1e-4)
        flops = local_flop_counter()
        with hp.comm_counter() as comm:   # the step only: laying out (a real run's broadcast of the init) is not
            with flops:
                with saved.recording():
                    out = model(**batch)
                activation_bytes = saved.bytes()
                out.loss.backward()
            opt.step()
    return _step_record(params, param_bytes, opt, activation_bytes, comm, flops)


def _step_record(params: list, param_bytes: int, opt, activation_bytes: int, comm, flops) -> dict:
    """What one step left this rank holding (gradients, optimizer state) and what it sent."""
    param_keys = {_key(_local(p)) for p in params}
    grad_bytes, grad_keys = _storages([p.grad for p in params], skip=param_keys)
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    optimizer_bytes, _ = _storages(state, skip=param_keys | grad_keys)
    peak = param_bytes + grad_bytes + optimizer_bytes + activation_bytes
    return {"rank": dist.get_rank(), "param_bytes": param_bytes, "grad_bytes": grad_bytes,
            "optimizer_bytes": optimizer_bytes, "activation_bytes": activation_bytes, "peak_bytes": peak,
            "collectives": {k: {"count": comm.counts[k], "bytes": comm.bytes[k]} for k in sorted(comm.counts)},
            "collectives_by_axis": {a: {k: {"count": c, "bytes": b} for k, (c, b) in sorted(kinds.items())}
                                    for a, kinds in sorted(comm.by_axis.items())},
            "flops": int(flops.get_total_flops())}


# ---- pipeline parallel ---------------------------------------------------------------------------------------
PLANNED_SCHEDULES = ("1f1b", "gpipe")


def in_flight(schedule: str, microbatches: int, pp: int, stage: int) -> int:
    """Micro-batches whose saved activations a stage holds at once: gpipe runs every forward before any
    backward (all of them); 1f1b starts backwards once the pipe is full, after pp - stage forwards (torch's
    Schedule1F1B warm-up), so the first stage holds the most."""
    if schedule == "gpipe":
        return microbatches
    return min(microbatches, pp - stage)


def _order(schedule: str, microbatches: int, pp: int, stage: int) -> list[tuple[str, int]]:
    """The (forward "F" / backward "B", micro-batch) order torch's schedule runs on `stage`."""
    warm = in_flight(schedule, microbatches, pp, stage)
    order = [("F", i) for i in range(warm)]
    for i in range(microbatches):
        order.append(("B", i))
        if warm + i < microbatches:
            order.append(("F", warm + i))
    return order


def _pipeline_step(model, config, dmesh, options: dict, device: str, hsdp, cp, peers: "PipelinePeers") -> dict:
    """`run_step` for a mesh with "pp": the model cut and laid out by the library's pipeline (the schedule,
    micro-batches and stage parallelisms a real run uses), then two `Pipeline.step`s, the second counted.
    The first is the once-per-shape warm-up (the stage probe; on a real run torch's metadata inference too,
    an extra forward and input-gradient pass), so what is counted is a steady-state step. On meta the
    pipeline's schedule is `MetaSchedule`, on a real run torch's; both run this rank's stage through the
    same hooks, so the activations of its first micro-batch are recorded the same way."""
    import hyper_parallel as hp
    from ..parallel.pipeline.api import build_pipeline
    m = int(options["microbatches"])
    pipe = build_pipeline(model, dmesh, "pp", schedule=options["schedule"], n_microbatches=m,
                          initialize=device != "meta", hsdp=hsdp, cp=cp)
    if device == "meta":
        peers.install(pipe)
    params = list(pipe.parameters())
    param_bytes, param_keys = _storages(params)
    first = FirstMicroBatch(pipe, SavedTensors(skip=param_keys))
    batch = _inputs(options["micro_batch"] * m, options["seq"], config, device)
    opt = torch.optim.AdamW(params, lr=1e-4)
    pipe.step(batch["input_ids"], labels=batch["labels"])
    opt.zero_grad(set_to_none=True)
    first.arm()
    flops = local_flop_counter()
    with hp.comm_counter() as comm:
        with flops:
            pipe.step(batch["input_ids"], labels=batch["labels"])
        opt.step()
    stage = pipe.specs[0].index
    activation_bytes = first.bytes * in_flight(options["schedule"], m, pipe.pp, stage)
    return _step_record(params, param_bytes, opt, activation_bytes, comm, flops)


class FirstMicroBatch:
    """`SavedTensors` over the first micro-batch this rank's stage trains on once armed: the stage's
    forward, and on the last stage the loss after it (its log-softmax is held for backward too).

    Hooks on the stage module and a wrapper over the pipeline's loss, put in before the first step: torch's
    schedule keeps the loss function it was built with, so it must be built calling the wrapper. The same
    recorder serves a real run (torch's schedule) and a meta one (`MetaSchedule`). Forwards without
    gradients (the stage probe) are not recorded."""

    def __init__(self, pipe, saved: SavedTensors):
        self.saved, self.state, self.bytes = saved, "idle", 0
        self.last = pipe.specs[0].last
        self._recording = None
        view = pipe.stages[0]
        view.register_forward_pre_hook(lambda module, args: self._start())
        view.register_forward_hook(lambda module, args, out: None if self.last else self._stop())
        loss = pipe._loss

        def recorded_loss(*args, **kwargs):
            out = loss(*args, **kwargs)
            self._stop()
            return out
        pipe._loss = recorded_loss

    def arm(self) -> None:
        self.state = "armed"

    def _start(self) -> None:
        if self.state == "armed" and torch.is_grad_enabled():
            self._recording = self.saved.recording()
            self._recording.__enter__()
            self.state = "recording"

    def _stop(self) -> None:
        if self.state == "recording":
            self._recording.__exit__(None, None, None)
            self.bytes = self.saved.bytes()
            self.state = "done"


class PipelinePeers:
    """What the other stages' ranks would have sent, for a pipeline played on meta tensors over the fake
    process group (which moves nothing): `plan` plays the stages' first ranks in order, so stage s finds
    here the outputs stage s - 1 handed on in the probe (`Pipeline._probe`), and a `MetaSchedule` replays
    the schedule with stand-ins of those shapes."""

    def __init__(self):
        self.sent: dict = {}

    def install(self, pipe) -> None:
        pipe.stand_ins = self
        pipe.device = torch.device("meta")

    def share(self, result, index: int, mine: bool):
        """The probe's broadcast of stage `index`'s result: this rank's own, or what that stage's rank sent."""
        if mine:
            self.sent[index] = result
            return result
        if index in self.sent:
            return self.sent[index]
        if 0 not in self.sent:
            raise RuntimeError(f"hp.plan: stage {index} was not planned before the stages after it; plan the "
                               f"pipeline's stages in order (plan() does)")
        return ("ok", self.sent[0][1], None)   # a later stage: the probe reads only the first stage's carry

    def received(self, stage: int) -> tuple:
        """Fresh stand-ins (meta) of what stage `stage` receives each micro-batch: the previous stage's
        outputs, floating ones requiring gradients (as torch's stage makes its receive buffers)."""
        return tuple(torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(t.is_floating_point())
                     for t in self.sent[stage - 1][2])

    def schedule(self, pipe, train: bool) -> "MetaSchedule":
        if not train:
            raise ValueError("hp.plan plans training steps only (Pipeline.step)")
        return MetaSchedule(pipe, self)


class MetaSchedule:
    """torch's gpipe / 1f1b order for this rank's one stage, replayed on meta tensors: each micro-batch's
    forward (and, on the last stage, its loss) then backward, in `_order`, with the sends torch's stage
    would post booked on `comm_counter` (collectives.record_send): the outputs to the next stage after
    each forward, the gradients of the floating inputs to the previous one after each backward."""

    def __init__(self, pipe, peers: PipelinePeers):
        self.pipe, self.peers = pipe, peers
        self.spec, self.view = pipe.specs[0], pipe.stages[0]

    def step(self, *args, target=None, losses=None, return_outputs=True, **kwargs):
        pipe, spec = self.pipe, self.spec
        n = pipe.n_microbatches
        chunks = [torch.tensor_split(t, n) for t in args]
        kw = {k: torch.tensor_split(v, n) for k, v in kwargs.items()}
        targets = torch.tensor_split(target, n) if target is not None else [None] * n
        held: dict = {}
        for action, i in _order(pipe.schedule_name, n, pipe.pp, spec.index):
            if action == "F":
                held[i] = self._forward(tuple(c[i] for c in chunks), {k: v[i] for k, v in kw.items()},
                                        targets[i], losses)
            else:
                self._backward(*held.pop(i))
        return None

    def _forward(self, args: tuple, kwargs: dict, target, losses: list):
        from ..redistribute import collectives
        inputs = args if self.spec.first else self.peers.received(self.spec.index)
        out = self.view(*inputs, **kwargs)
        if self.spec.last:
            loss = self.pipe._loss(out, target)
            losses.append(loss.detach())
            return inputs, (loss,)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            collectives.record_send(t, self.pipe.group)
        return inputs, outs

    def _backward(self, inputs: tuple, outs: tuple) -> None:
        from ..redistribute import collectives
        outs = [t for t in outs if t.requires_grad or t.grad_fn is not None]
        grads = None if self.spec.last else [torch.ones_like(t) for t in outs]
        torch.autograd.backward(outs, grad_tensors=grads)
        if not self.spec.first:
            for t in inputs:
                if isinstance(t, torch.Tensor) and t.grad is not None:
                    collectives.record_send(t.grad, self.pipe.group)
                    t.grad = None


def _stage_ranks(mesh: Mapping[str, int]) -> list[int]:
    """The first rank of each pipeline stage (coordinate s on "pp", 0 elsewhere); [0] without pp."""
    if "pp" not in mesh:
        return [0]
    names = list(mesh)
    stride = math.prod(mesh[n] for n in names[names.index("pp") + 1:])
    return [s * stride for s in range(mesh["pp"])]


# ---- the record ----------------------------------------------------------------------------------------------
def plan(model_type: str | None = None, *, world: int, mesh: str | Mapping[str, int], config=None,
         config_file: str | None = None, model_path: str | None = None, overrides=None, seq: int = 4096,
         micro_batch: int = 1, dtype: str = "bf16", optimizer_level: str = "level1", schedule: str = "1f1b",
         microbatches: int | None = None, cp_method: str | None = None, recompute: str = "none",
         hsdp: dict | None = None, layers: int | None = None) -> dict:
    """What each rank of a run holds and sends per training step, planned on this one CPU process (API §13).

    The model comes from `model_type` (its default config), `config` (a transformers config), `config_file`
    or `model_path` (config.json only), with `overrides` ({key: value} or ["key=value"]) applied before it is
    built. `mesh` ("pp=2,dp=4,tp=2", or a dict; outer -> inner) must multiply to `world`. `hsdp`: further hsdp
    arguments (e.g. {"threshold": 0}). `layers`: plan this many decoder layers instead of the config's (the
    search's reduced-depth plans). Returns a JSON-serialisable dict: busiest_rank, per_stage, collectives,
    collectives_by_axis, flops_per_rank, mesh, world, pipeline and the arguments.
    """
    start = time.perf_counter()
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if optimizer_level not in LEVELS:
        raise ValueError(f"unknown optimizer level {optimizer_level!r}: use one of {', '.join(LEVELS)}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute policy {recompute!r}: use one of {', '.join(RECOMPUTE)}")
    sizes = parse_mesh(mesh, world)
    if sizes.get("pp", 1) > 1 and schedule not in PLANNED_SCHEDULES:
        raise ValueError(PP_NOT_YET.format(schedule=schedule))
    if sizes.get("pp", 1) > 1 and recompute != "none":
        raise ValueError(PP_RECOMPUTE_NOT_YET)
    cfg = load_config(model_type, config=config, config_file=config_file, model_path=model_path,
                      overrides=overrides)
    if layers is not None:
        text, key = _layers_key(cfg)
        setattr(text, key, int(layers))
    if "pp" in sizes and microbatches is None:
        microbatches = 2 * sizes["pp"]
    options = step_options(seq=seq, micro_batch=micro_batch, dtype=dtype, optimizer_level=optimizer_level,
                           schedule=schedule, microbatches=microbatches, cp_method=cp_method, recompute=recompute,
                           hsdp=hsdp, mesh=sizes)
    try:
        peers = PipelinePeers()   # stage s's plan reads what stage s - 1's handed on: planned in order
        stages = [plan_rank(cfg, sizes, r, options, peers) for r in _stage_ranks(sizes)]
    finally:
        if dist.is_initialized() and dist.get_backend() == "fake":
            dist.destroy_process_group()
        _clear_caches()
    busiest = max(stages, key=lambda s: s["peak_bytes"])
    record = {
        "world": world, "mesh": dict(sizes), "model_type": getattr(cfg, "model_type", None),
        "layers": getattr(_text_config(cfg), "num_hidden_layers", None),
        "busiest_rank": {k: busiest[k] for k in ("rank",) + BYTE_KEYS},
        "per_stage": [{k: s[k] for k in ("rank",) + BYTE_KEYS + ("collectives_by_axis",)} for s in stages],
        "collectives": busiest["collectives"], "collectives_by_axis": busiest["collectives_by_axis"],
        "flops_per_rank": busiest["flops"],
        "pipeline": ({"schedule": schedule, "microbatches": microbatches, "stages_per_rank": 1}
                     if "pp" in sizes else None),
        "seq": int(seq), "micro_batch": int(micro_batch), "dtype": dtype, "recompute": recompute,
        "optimizer_level": optimizer_level, "cp_method": cp_method,
        "assumptions": ("mixture-of-experts routing balanced (all_to_all bytes are the even-share figure); peak = "
                        "parameters + gradients + optimizer state + activations of the micro-batches in flight"
                        + ("; pipeline: a steady-state step (the first step's once-per-shape probe and torch's "
                           "metadata inference not counted), activations = one micro-batch's saved bytes x the "
                           "micro-batches in flight on the stage (1f1b: min(microbatches, pp - stage); gpipe: "
                           "all microbatches)" if "pp" in sizes else "")),
    }
    record["elapsed_s"] = round(time.perf_counter() - start, 3)
    return record


def extrapolated_plan(layers: int, low: int, high: int, **kwargs) -> dict:
    """`plan` at `low` and `high` decoder layers, every count and byte figure extended linearly to `layers`
    (exact when the layers are identical: each adds the same bytes, collectives and FLOPs); the record says
    `extrapolated_from_layers: [low, high]`."""
    start = time.perf_counter()
    a, b = plan(layers=low, **kwargs), plan(layers=high, **kwargs)
    if layers in (low, high):
        out = a if layers == low else b
        out["elapsed_s"] = round(time.perf_counter() - start, 3)
        return out
    f = (layers - low) / (high - low)

    def line(x, y):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            return y
        return int(round(x + (y - x) * f))

    def walk(x, y, key=None):
        if isinstance(x, dict) and isinstance(y, dict):
            return {k: walk(x.get(k, 0 if isinstance(y[k], (int, float)) else y[k]), y[k], k) for k in y}
        if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            return [walk(u, v) for u, v in zip(x, y)]
        if key in ("rank", "world", "seq", "micro_batch"):
            return y
        return line(x, y)
    out = {k: walk(a[k], b[k], k) for k in ("busiest_rank", "per_stage", "collectives", "collectives_by_axis",
                                             "flops_per_rank")}
    record = dict(b, **out)
    record["layers"] = layers
    record["extrapolated_from_layers"] = [low, high]
    record["elapsed_s"] = round(time.perf_counter() - start, 3)
    return record


def format_record(record: Mapping[str, Any]) -> str:
    """The record as a few readable lines (the CLI's output)."""
    def gib(n):
        for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
            if n >= size:
                return f"{n / size:,.2f} {unit}"
        return f"{n} B"
    lines = [f"plan: {record.get('model_type')} ({record.get('layers')} layers) on {record['world']} ranks, mesh "
             f"{mesh_str(record['mesh'])}, seq {record['seq']} x micro-batch {record['micro_batch']}, {record['dtype']}, "
             f"hsdp {record['optimizer_level']}, recompute {record['recompute']}"]
    rows = [("busiest rank", record["busiest_rank"])] + [(f"stage {i}", s) for i, s in enumerate(record["per_stage"])
                                                         if len(record["per_stage"]) > 1]
    lines.append(f"{'':<14}{'rank':>6} {'params':>12} {'grads':>12} {'optimizer':>12} {'activations':>12} "
                 f"{'peak':>12}")
    for name, r in rows:
        lines.append(f"{name:<14}{r['rank']:>6} " + " ".join(f"{gib(r[k]):>12}" for k in BYTE_KEYS))
    lines.append("collectives per step (this rank: count, bytes passed in), by mesh axis:")
    for axis, kinds in record["collectives_by_axis"].items():
        for kind, c in kinds.items():
            lines.append(f"  {axis:<8} {kind:<16} {c['count']:>8} {gib(c['bytes']):>14}")
    lines.append(f"FLOPs per rank per step (forward + backward): {record['flops_per_rank']:.3e}")
    if record.get("extrapolated_from_layers"):
        lines.append(f"extrapolated linearly from {record['extrapolated_from_layers']} layers")
    lines.append(f"planned in {record['elapsed_s']:.2f} s")
    return "\n".join(lines)


# ---- predicted vs measured -----------------------------------------------------------------------------------
def step_options(*, seq: int, micro_batch: int, dtype: str = "fp32", optimizer_level: str = "level1",
                 schedule: str = "1f1b", microbatches: int | None = None, cp_method: str | None = None,
                 recompute: str = "none", hsdp: dict | None = None, mesh: Mapping[str, int] | None = None) -> dict:
    """The options `run_step` takes, from `plan`'s arguments (one place, so plan and verify agree)."""
    if "pp" in (mesh or {}) and microbatches is None:
        microbatches = 2 * mesh["pp"]
    return {"dtype": DTYPES[dtype], "optimizer_level": optimizer_level, "schedule": schedule,
            "microbatches": microbatches, "cp_method": cp_method, "recompute": recompute, "seq": int(seq),
            "micro_batch": int(micro_batch), "hsdp": hsdp}


def measure_rank(rank: int, world: int, config, mesh: Mapping[str, int], options: dict) -> dict:
    """On a real process group (gloo, this machine): one real step of this rank, measured the way `plan`
    predicts it (`run_step` on "cpu"). tests/harness.py's `pool(n).run(measure_rank, ...)` calls it."""
    return run_step(config, dict(mesh), options, "cpu")


def _verify_worker(rank: int, world: int, port: int, config, mesh: dict, options: dict, box) -> None:
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        box.put((rank, measure_rank(rank, world, config, mesh, options), None))
    except BaseException as e:  # every rank reports, so the parent never waits on a dead child
        import traceback
        box.put((rank, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def verify(record: Mapping[str, Any], config, options: dict) -> dict:
    """Run the record's mesh for real on this machine (world gloo processes, one real step with AdamW) and
    return {rank: measured} for every rank (the planned ranks are among them)."""
    import socket
    import torch.multiprocessing as mp
    world, mesh = int(record["world"]), dict(record["mesh"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    box = ctx.Queue()
    procs = [ctx.Process(target=_verify_worker, args=(r, world, port, config, mesh, options, box))
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    for _ in range(world):
        rank, measured, error = box.get(timeout=900)
        if error:
            errors.append(f"rank {rank}: {error}")
        else:
            results[rank] = measured
    for p in procs:
        p.join()
    if errors:
        raise RuntimeError("plan --verify: the real run failed:\n" + "\n".join(errors))
    return results


def comparison(record: Mapping[str, Any], measured: Mapping[int, dict]) -> list[tuple[str, Any, Any, bool]]:
    """(quantity, predicted, measured, equal) for every planned rank (each pipeline stage's first): bytes, and
    each collective's count and bytes per axis; activation and peak bytes are compared within 15%, the rest
    exactly."""
    rows = []
    for stage in record["per_stage"]:
        rank = stage["rank"]
        m = measured[rank]
        for key in BYTE_KEYS:
            p, v = stage[key], m[key]
            ok = p == v if key in ("param_bytes", "grad_bytes", "optimizer_bytes") else abs(p - v) <= 0.15 * max(v, 1)
            rows.append((f"rank {rank} {key}", p, v, ok))
        pred = stage.get("collectives_by_axis", record["collectives_by_axis"])
        got = m["collectives_by_axis"]
        for axis in sorted(set(pred) | set(got)):
            for kind in sorted(set(pred.get(axis, {})) | set(got.get(axis, {}))):
                a = pred.get(axis, {}).get(kind, {"count": 0, "bytes": 0})
                b = got.get(axis, {}).get(kind, {"count": 0, "bytes": 0})
                rows.append((f"rank {rank} {axis} {kind} count", a["count"], b["count"], a["count"] == b["count"]))
                rows.append((f"rank {rank} {axis} {kind} bytes", a["bytes"], b["bytes"], a["bytes"] == b["bytes"]))
    return rows


# ---- search (the cost model and the driver: tools/plan_cost.py) -----------------------------------------------
def _cost_module():
    try:
        from . import plan_cost
    except ImportError:
        raise ValueError("--search is not yet available: its cost model (hyper_parallel/tools/plan_cost.py) is not "
                         "in this install; plan one mesh with --mesh") from None
    return plan_cost


def search_plan_fn(world: int, config, **common):
    """`plan_fn(mesh, microbatches, recompute) -> record` for `plan_cost.search`: each candidate planned at
    pp and 2 x pp decoder layers and extended linearly to the config's depth (`extrapolated_plan`: exact for
    identical layers), so a search over dozens of meshes takes seconds per mesh whatever the depth."""
    text, key = _layers_key(config)
    depth = int(getattr(text, key))

    def plan_fn(mesh: dict, microbatches: int | None, recompute: str) -> dict:
        mesh = {k: int(v) for k, v in mesh.items() if int(v) > 1} or {"dp": 1}
        pp = mesh.get("pp", 1)
        kwargs = dict(world=world, mesh=mesh, config=config, recompute=recompute,
                      microbatches=microbatches if pp > 1 else None, **common)
        if depth <= 2 * pp:
            return plan(**kwargs)
        return extrapolated_plan(depth, pp, 2 * pp, **kwargs)
    return plan_fn


def search_limits(seq: int, given: Mapping[str, int] | None = None) -> dict:
    """The axis caps of `--search` (`--max axis=size` overrides each): tp within one node of 8 accelerators
    (the presets' fast link spans a node; tensor parallelism across nodes is what no one runs), and cp no
    finer than 256 tokens per sequence chunk (ring: two chunks per rank). A plan's cost grows with the cp size
    (the ring's steps are traced one by one), and these are the meshes a user would not take anyway."""
    limits = {"tp": 8, "cp": max(1, int(seq) // 512)}
    for axis, size in (given or {}).items():
        if axis not in AXES:
            raise ValueError(f"--max {axis}={size}: the axis must be one of {', '.join(AXES)}")
        limits[axis] = int(size)
    return limits


def search_main(world: int, *, source: dict, overrides=None, memory=None, device: str = "h100",
                calibrate: bool = False, limits: Mapping[str, int] | None = None, **common) -> list[dict]:
    """`plan --search`: every mesh of `world` that fits `memory`, fastest first (plan_cost.search's ranking),
    among the meshes within `search_limits`."""
    cost = _cost_module()
    config = load_config(**source, overrides=overrides)
    caps = search_limits(common.get("seq") or 4096, limits)
    if calibrate:
        dev = cost.calibrate()
    else:
        if device not in cost.PRESETS:
            raise ValueError(f"unknown --device {device!r}: presets are {', '.join(cost.PRESETS)} (or --calibrate)")
        dev = cost.PRESETS[device]
    return cost.search(world, search_plan_fn(world, config, **common), dev, memory, config=config,
                       seq=common.get("seq"), micro_batch=common.get("micro_batch", 1),
                       **{f"max_{axis}": size for axis, size in caps.items()})


def format_search(results: list[dict], top: int = 10) -> str:
    cost = _cost_module()
    return cost.format_ranking(results, top=top)
