"""Rank the meshes a model can take by a predicted step time: the cost model and the search behind
`hyper-parallel plan --search` (API §13).

The planner (`hp.plan`) answers, for one mesh, what the busiest rank computes, holds and sends in one
training step (a *record*, see `step_time`). This module turns a record into seconds on a device and
searches every mesh of a world size for the fastest one that fits in memory.

The cost model, stated once (every function below follows it):

- **Compute**: ``compute_s = flops_per_rank / (peak_flops[dtype] * mfu)``: the busiest rank's FLOPs of
  one step (forward + backward, every micro-batch, recomputation included) at a stated fraction of the
  device's dense peak.
- **Communication**: an alpha-beta model per collective, ring algorithms, over the link the axis's
  group uses (`link_of`): ``count * steps(n) * alpha + wire_bytes(n, bytes) / bandwidth``, with `n` the
  group size and `bytes` what the planner counts (what this rank passes in, as `comm_counter` does):

  ============== ================ ================================ ===============================
  kind           bytes counted    steps per call                   wire bytes per rank
  ============== ================ ================================ ===============================
  all_reduce     the full tensor  2 (n-1)   (reduce-scatter+gather) 2 (n-1)/n * bytes
  all_gather     the local shard  n-1                              (n-1) * bytes
  reduce_scatter the full input   n-1                              (n-1)/n * bytes
  all_to_all     the local tensor n-1       (pairwise exchange)    bytes  (conservative, below)
  broadcast      the full tensor  n-1       (pipelined chain)      bytes
  send, recv     the message      1                                bytes
  ============== ================ ================================ ===============================

  all_to_all: the even exchange counts the whole local tensor, of which (n-1)/n leaves; the expert
  exchange counts only the rows that leave. One record mixes both, so the model takes the counted
  bytes as wire bytes: exact for experts, at most n/(n-1) high for Ulysses.
- **Pipeline bubble**: ``bubble_s = (pp-1)/m * compute_s`` for gpipe and 1f1b, ``(pp-1)/(m*v) *
  compute_s`` for interleaved schedules (`v` stages per rank), with `m` micro-batches. The zero-bubble
  schedules are charged the interleaved bubble (an upper bound: they fill part of it).
- **No overlap**: ``total_s = compute_s + comm_s + bubble_s``. Real runs overlap gradient reductions and
  parameter gathers with compute, so the prediction is conservative, and it penalises communication
  most where it is most exposed.
- **Ranking**: meshes process different numbers of tokens per step (each data share -- `dp` x `ep`,
  API §12 -- feeds its own micro-batches), so they are ranked by seconds per token (equivalently
  tokens/s), not by step time.
"""
from __future__ import annotations

import math
import os
import re
import socket
import time
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Callable, Iterable, Mapping

AXES = ("pp", "dp", "ep", "tp", "cp")
DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
          "fp32": "fp32", "float32": "fp32", "float": "fp32", "tf32": "fp32"}
GiB = 2 ** 30
GB = 10 ** 9


# ---- devices ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """One kind of link: `alpha` seconds per algorithm step (latency), `bandwidth` bytes/s that one rank
    sends in one direction while it receives as much (what a ring step moves)."""
    alpha: float
    bandwidth: float

    def __post_init__(self):
        if not (self.alpha >= 0 and math.isfinite(self.alpha)):
            raise ValueError(f"Link: alpha must be a finite number of seconds >= 0, got {self.alpha!r}")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"Link: bandwidth must be a finite number of bytes/s > 0, got {self.bandwidth!r}")


@dataclass(frozen=True)
class Device:
    """What the cost model needs to know about an accelerator and how its ranks are wired.

    `peak_flops`: dense FLOP/s per rank, one number or a dict by dtype ("bf16", "fp16", "fp32"; a missing
    "fp16" falls back to "bf16", the same tensor cores). `mfu`: the fraction of that peak a training step
    achieves (stated, not measured: 0.4 is typical of large dense models). `memory_bytes`: memory per
    rank. `ranks_per_node`: ranks that share the fast `intra` link; groups that cross nodes use `inter`.
    """
    name: str
    peak_flops: float | Mapping[str, float] = field(hash=False)
    mfu: float
    memory_bytes: int
    ranks_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self):
        if not 0 < self.mfu <= 1:
            raise ValueError(f"Device {self.name!r}: mfu is a fraction of peak in (0, 1], got {self.mfu!r}")
        if self.ranks_per_node < 1:
            raise ValueError(f"Device {self.name!r}: ranks_per_node must be >= 1, got {self.ranks_per_node!r}")

    def peak(self, dtype: str) -> float:
        """Dense FLOP/s for `dtype` (any spelling in DTYPES, `torch.bfloat16` included)."""
        if not isinstance(self.peak_flops, Mapping):
            return float(self.peak_flops)
        key = _dtype_key(dtype)
        if key not in self.peak_flops and key == "fp16":
            key = "bf16"
        if key not in self.peak_flops:
            raise ValueError(f"Device {self.name!r} states no peak FLOP/s for dtype {dtype!r}; it has "
                             f"{sorted(self.peak_flops)}: add one to peak_flops or plan in one of those")
        return float(self.peak_flops[key])


def _dtype_key(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def _preset(name: str, bf16: float, fp32: float, memory: int, node: int, intra_bw: float, inter_bw: float,
            intra_alpha: float = 5e-6, inter_alpha: float = 10e-6, mfu: float = 0.4) -> Device:
    return Device(name, {"bf16": bf16, "fp32": fp32}, mfu, memory, node, Link(intra_alpha, intra_bw),
                  Link(inter_alpha, inter_bw))


PRESETS: dict[str, Device] = {
    # NVIDIA H100 SXM5 datasheet: BF16 989 TFLOPS dense (1979 with sparsity), FP32 67 TFLOPS, 80 GB HBM3,
    # NVLink 4 900 GB/s per GPU (both directions: 450 GB/s each way); DGX/HGX H100: 8 GPUs per node, one
    # ConnectX-7 400 Gb/s InfiniBand NDR port per GPU (50 GB/s).
    "h100": _preset("h100", 989e12, 67e12, 80 * GB, 8, 450e9, 50e9),
    # NVIDIA H200 SXM datasheet: the H100's compute (BF16 989 TFLOPS dense, FP32 67 TFLOPS), 141 GB HBM3e,
    # NVLink 4 900 GB/s per GPU; HGX H200: 8 GPUs per node, 400 Gb/s InfiniBand/RoCE per GPU.
    "h200": _preset("h200", 989e12, 67e12, 141 * GB, 8, 450e9, 50e9),
    # NVIDIA A100 SXM4 80GB datasheet: BF16 312 TFLOPS dense, FP32 19.5 TFLOPS, 80 GB HBM2e, NVLink 3
    # 600 GB/s per GPU (300 GB/s each way); DGX A100: 8 GPUs per node, 200 Gb/s HDR InfiniBand per GPU.
    "a100": _preset("a100", 312e12, 19.5e12, 80 * GB, 8, 300e9, 25e9),
    # Huawei Ascend 910B (Atlas 800T A2 figures): FP16/BF16 about 313 TFLOPS dense, 64 GB HBM2e, 8 NPUs per
    # node on a full HCCS mesh (7 links of 56 GB/s: 392 GB/s per NPU, which HCCL's mesh algorithms use
    # together), 200 Gb/s RoCE per NPU (25 GB/s). FP32 is not in the datasheet: taken as a quarter of BF16.
    "910b": _preset("910b", 313e12, 313e12 / 4, 64 * GB, 8, 392e9, 25e9),
}
PRESETS_NOTE = ("alpha (5 us within a node, 10 us across) is the order of a NCCL/HCCL step's latency, not a "
                "datasheet figure; mfu 0.4 is a stated assumption, not a measurement")


def device(name: str) -> Device:
    """The preset `name` (case-insensitive), or a ValueError naming the presets."""
    key = name.lower().replace("-", "").replace(" ", "")
    if key not in PRESETS:
        raise ValueError(f"unknown device {name!r}; presets are {sorted(PRESETS)}, or measure this machine "
                         f"with calibrate() (--calibrate)")
    return PRESETS[key]


# ---- sizes --------------------------------------------------------------------------------------------------
_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: str | int) -> int:
    """"80GiB" -> 85899345920. Units B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024),
    any case; a bare number is bytes. Anything else (e.g. "80G", which could mean either) is refused."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or (unit and unit not in _UNITS):
        raise ValueError(f"{text!r} is not a size: write a number and a unit, e.g. 80GiB, 64GB, 512MiB "
                         f"(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return int(float(m.group(1)) * _UNITS[unit or "b"])


def format_bytes(n: float) -> str:
    """GiB from a tenth of one, MiB from a tenth of one, else KiB or bytes: a limit or peak never reads 0.0."""
    for unit, size in (("GiB", GiB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size / 10:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# ---- links --------------------------------------------------------------------------------------------------
def _group_axes(mesh: Mapping[str, int], axis: str) -> list[str]:
    """The mesh axes one group spans: an axis name, several joined by '+', ',' or '_' (e.g. "dp+ep", a
    group over both), or "world" (every axis)."""
    if axis in mesh:
        return [axis]
    if axis == "world":
        return list(mesh)
    parts = [p for p in re.split(r"[+,_/ ]", axis) if p]
    unknown = [p for p in parts if p not in mesh]
    if not parts or unknown:
        raise ValueError(f"collectives over {axis!r}: {unknown or axis!r} is not an axis of the mesh {dict(mesh)}; "
                         f"name an axis, several joined by '+', or 'world'")
    return parts


def group_size(mesh: Mapping[str, int], axis: str) -> int:
    return math.prod(mesh[a] for a in _group_axes(mesh, axis))


def link_of(mesh: Mapping[str, int], axis: str, device: Device) -> str:
    """"intra" when every group of `axis` lies inside one node, else "inter".

    Ranks are numbered consecutively, nodes hold `ranks_per_node` consecutive ranks, and the mesh is laid
    out row-major over its axes in order (outer -> inner), so the ranks of one group of an axis sit in a
    block of ``span = size(axis) * product of the sizes of the axes inner to it`` consecutive ranks,
    aligned on multiples of the span. The rule: intra iff ``span <= ranks_per_node`` and the span divides
    ``ranks_per_node`` (otherwise some blocks straddle two nodes, and the slowest link sets a ring's pace).
    For a group over several axes the span starts at its outermost axis.
    """
    names = list(mesh)
    members = _group_axes(mesh, axis)
    outer = min(names.index(a) for a in members)
    span = math.prod(mesh[a] for a in names[outer:])
    return "intra" if span <= device.ranks_per_node and device.ranks_per_node % span == 0 else "inter"


# ---- the cost of one step -----------------------------------------------------------------------------------
def _ring(kind: str, n: int, nbytes: float) -> tuple[float, float]:
    """(algorithm steps per call, wire bytes per rank) for `nbytes` counted as `comm_counter` counts them
    over a group of `n` ranks; the table in the module docstring."""
    if kind in ("send", "recv"):
        return 1.0, float(nbytes)
    if n <= 1:
        return 0.0, 0.0
    table = {
        "all_reduce": (2 * (n - 1), 2 * (n - 1) / n * nbytes),
        "all_gather": (n - 1, (n - 1) * nbytes),
        "reduce_scatter": (n - 1, (n - 1) / n * nbytes),
        "all_to_all": (n - 1, nbytes),
        "broadcast": (n - 1, nbytes),
    }
    table["feed_check"] = table["all_gather"]  # the feed check's exchange is an all_gather (collectives.py)
    if kind not in table:
        raise ValueError(f"no cost formula for collective kind {kind!r}; known kinds: "
                         f"{sorted(table) + ['recv', 'send']}")
    return float(table[kind][0]), float(table[kind][1])


def collective_seconds(kind: str, count: int, nbytes: float, n: int, link: Link) -> float:
    """``count * steps(n) * alpha + wire(n, bytes) / bandwidth``: `count` calls of `kind` that together
    passed `nbytes` in, over a group of `n` ranks on `link` (formulas in the module docstring)."""
    steps, wire = _ring(kind, n, nbytes)
    return count * steps * link.alpha + wire / link.bandwidth


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The pipeline's idle time as a fraction of a rank's compute: (pp-1)/m for gpipe and 1f1b,
    (pp-1)/(m*v) for the interleaved and zero-bubble schedules (v = stages per rank; for zero-bubble an
    upper bound). One stage (pp == 1) has no bubble."""
    if pp <= 1:
        return 0.0
    if microbatches < 1:
        raise ValueError(f"a pipeline needs at least one micro-batch, got {microbatches}")
    key = re.sub(r"[^a-z0-9]", "", schedule.lower()).removeprefix("schedule")
    if key in ("gpipe", "1f1b"):
        return (pp - 1) / microbatches
    if key in ("interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev",
               "zerobubble", "zbv", "interleaved"):
        return (pp - 1) / (microbatches * max(1, stages_per_rank))
    raise ValueError(f"no bubble formula for pipeline schedule {schedule!r}; known: gpipe, 1f1b, "
                     f"interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv_zero_bubble, dualpipev")


def step_time(record: Mapping[str, Any], device: Device) -> dict:
    """Predicted seconds of one training step for a planner record on `device`.

    The record (what `hp.plan` returns) is read for: `mesh` (axis -> size, outer -> inner),
    `flops_per_rank`, `dtype`, `collectives_by_axis` ({axis: {kind: {"count", "bytes"}}}) and `pipeline`
    (None or {"schedule", "microbatches", "stages_per_rank"}).

    Returns {total_s, compute_s, comm_s, bubble_s, by_axis: {axis: s}, by_kind: {kind: s}, links: {axis:
    "intra"|"inter"}}, with (the module docstring states each formula and why):
      compute_s = flops_per_rank / (peak[dtype] * mfu)
      comm_s    = sum over axes and kinds of count*steps*alpha + wire_bytes/bandwidth (ring algorithms)
      bubble_s  = bubble_fraction(schedule, pp, m, v) * compute_s
      total_s   = compute_s + comm_s + bubble_s   (no overlap: conservative)
    """
    mesh = dict(record["mesh"])
    compute_s = float(record["flops_per_rank"]) / (device.peak(record.get("dtype", "bf16")) * device.mfu)
    by_axis: dict[str, float] = {}
    by_kind: dict[str, float] = {}
    links: dict[str, str] = {}
    for axis, kinds in (record.get("collectives_by_axis") or {}).items():
        n = group_size(mesh, axis)
        links[axis] = link_of(mesh, axis, device)
        link = device.intra if links[axis] == "intra" else device.inter
        for kind, c in kinds.items():
            s = collective_seconds(kind, int(c.get("count", 0)), float(c.get("bytes", 0)), n, link)
            by_axis[axis] = by_axis.get(axis, 0.0) + s
            by_kind[kind] = by_kind.get(kind, 0.0) + s
    pipe = record.get("pipeline")
    bubble_s = 0.0
    if pipe:
        bubble_s = compute_s * bubble_fraction(pipe["schedule"], mesh.get("pp", 1), int(pipe["microbatches"]),
                                               int(pipe.get("stages_per_rank", 1)))
    comm_s = sum(by_axis.values())
    return {"total_s": compute_s + comm_s + bubble_s, "compute_s": compute_s, "comm_s": comm_s,
            "bubble_s": bubble_s, "by_axis": by_axis, "by_kind": by_kind, "links": links}


def tokens_per_step(record: Mapping[str, Any], seq: int | None = None) -> int:
    """Tokens one step trains on, over the whole world: seq x micro_batch per micro-batch, one set of
    micro-batches per data share (dp x ep, API §12); tp, cp and pp groups share theirs."""
    mesh = record["mesh"]
    seq = record.get("seq") or seq
    if not seq:
        raise ValueError("the record has no 'seq' and search() was given none: pass seq=")
    pipe = record.get("pipeline")
    m = int(pipe["microbatches"]) if pipe else 1
    return int(seq) * int(record.get("micro_batch") or 1) * m * mesh.get("dp", 1) * mesh.get("ep", 1)


# ---- which meshes the model can take ------------------------------------------------------------------------
def _field(config: Any, *names: str) -> Any:
    """The first of `names` that the config (a dict or a transformers config; its `text_config` for
    multimodal models) sets, else None."""
    if config is None:
        return None
    get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
    for name in names:
        value = get(name, None)
        if value is not None:
            return value
    text = get("text_config", None)
    return _field(text, *names) if text is not None and text is not config else None


def _factorisations(n: int, k: int) -> Iterable[tuple[int, ...]]:
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorisations(n // d, k - 1):
                yield (d,) + rest


def _skip_reason(sizes: Mapping[str, int], config: Any, seq: int | None, cp_method: str,
                 limits: Mapping[str, int | None]) -> str | None:
    """Why the model cannot take this mesh, or None when it can."""
    for axis, top in limits.items():
        if top is not None and sizes.get(axis, 1) > top:
            return f"{axis}={sizes[axis]} exceeds max_{axis}={top}"
    tp, ep, pp, cp = (sizes.get(a, 1) for a in ("tp", "ep", "pp", "cp"))
    heads = _field(config, "num_attention_heads", "n_head", "num_heads")
    if tp > 1 and heads and heads % tp:
        return f"tp={tp} does not divide the {heads} attention heads"
    for name in ("intermediate_size", "moe_intermediate_size", "ffn_dim"):
        width = _field(config, name)
        if tp > 1 and width and width % tp:
            return f"tp={tp} does not divide {name}={width}"
    experts = _field(config, "num_experts", "n_routed_experts", "num_local_experts")
    if ep > 1 and not experts:
        return f"ep={ep} on a model without experts (not a MoE config)"
    if ep > 1 and experts % ep:
        return f"ep={ep} does not divide the {experts} experts"
    layers = _field(config, "num_hidden_layers", "n_layer", "num_layers")
    if layers and pp > layers:
        return f"pp={pp} exceeds the {layers} layers"
    if cp > 1 and seq:
        chunks = 2 * cp if cp_method == "ring" else cp
        if seq % chunks:
            return (f"cp={cp} needs seq divisible by {chunks} ({cp_method}: "
                    f"{'two chunks per rank' if cp_method == 'ring' else 'one chunk per rank'}); seq={seq}")
        if cp_method == "ulysses" and heads and (heads // max(tp, 1)) % cp:
            return f"cp={cp} (ulysses) does not divide the {heads // max(tp, 1)} heads per tp rank"
    return None


def enumerate_meshes(world: int, *, config: Any = None, axes: tuple[str, ...] = ("pp", "dp", "ep", "tp", "cp"),
                     seq: int | None = None, max_tp: int | None = None, max_pp: int | None = None,
                     max_cp: int | None = None, max_ep: int | None = None, cp_method: str = "ring",
                     skipped: list | None = None) -> list[dict]:
    """Every factorisation of `world` into `axes` (in that order, outer -> inner) that the model can take.

    Axes of size 1 are left out of each mesh (a mesh of one rank is {"dp": 1}). With a `config` (a dict
    or transformers config; `text_config` for multimodal ones): tp divides the attention heads and the
    MLP's intermediate sizes (KV heads may be fewer than tp: the library then replicates K/V, as Megatron
    does); ep > 1 only for MoE configs and divides the experts (num_experts / n_routed_experts /
    num_local_experts); pp <= the layers; cp divides `seq` (twice over for "ring", whose ranks hold two
    chunks each). `max_*` cap an axis. Pass a list as `skipped` to receive (mesh, reason) for each mesh
    left out. The result is unique and every mesh's sizes multiply to `world`.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    bad = [a for a in axes if a not in AXES] or ([a for a in axes if axes.count(a) > 1])
    if bad:
        raise ValueError(f"axes must be distinct names among {AXES}, got {axes}")
    limits = {"tp": max_tp, "pp": max_pp, "cp": max_cp, "ep": max_ep}
    out = []
    for sizes in _factorisations(world, len(axes)):
        mesh = {a: s for a, s in zip(axes, sizes) if s > 1} or {"dp": 1}
        reason = _skip_reason(mesh, config, seq, cp_method, limits)
        if reason is None:
            out.append(mesh)
        elif skipped is not None:
            skipped.append((mesh, reason))
    return out


# ---- search -------------------------------------------------------------------------------------------------
def mesh_str(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{a}={s}" for a, s in mesh.items())


def search(world: int, plan_fn: Callable[[dict, int, str], Mapping[str, Any]], device: Device,
           memory_bytes: int | str | None = None, *, config: Any = None, seq: int | None = None,
           micro_batch: int = 1, microbatch_choices: Iterable[int] | None = None,
           recompute_choices: Iterable[str] = ("none", "full"), limit: int | None = None,
           skipped: list | None = None, **mesh_options: Any) -> list[dict]:
    """Every candidate that fits in `memory_bytes` per rank, fastest first.

    Candidates: each mesh of `enumerate_meshes(world, config=config, seq=seq, **mesh_options)`, with, for
    a mesh with pp > 1, each micro-batch count of `microbatch_choices` (default pp, 2pp, 4pp; a mesh
    without pp runs one micro-batch, `plan_fn` gets 1), and each recompute policy. `plan_fn(mesh,
    microbatches, recompute)` returns the planner's record; a ValueError from it (a mesh the planner
    cannot lay out) skips the candidate, with its message in `skipped` when a list is given.
    `memory_bytes` defaults to the device's memory.

    Ranked by predicted seconds per token (step_time's total over tokens_per_step: meshes differ in how
    many data shares train per step, so a raw step time would favour the smallest batch), ties by peak
    memory. Each entry: mesh, microbatches, recompute, step_time (the dict of `step_time`), peak_bytes,
    tokens_per_step, tokens_per_s; the first also has `reason`, why it beats the runner-up. `limit` keeps
    the first `limit` entries (`micro_batch` is what each record is expected to plan with; it is passed
    through to the ranking only when a record lacks it).

    Nothing fits: a ValueError naming the smallest peak found and the limit, and what to try next.
    """
    memory = parse_bytes(memory_bytes) if memory_bytes is not None else device.memory_bytes
    recompute_choices = tuple(recompute_choices)   # read again by the nothing-fits message
    meshes = enumerate_meshes(world, config=config, seq=seq, skipped=skipped, **mesh_options)
    results, smallest = [], None
    for mesh in meshes:
        pp = mesh.get("pp", 1)
        choices = sorted(set(microbatch_choices or (pp, 2 * pp, 4 * pp))) if pp > 1 else [1]
        for m, recompute in product(choices, recompute_choices):
            try:
                record = plan_fn(dict(mesh), m, recompute)
            except ValueError as e:
                if skipped is not None:
                    skipped.append((dict(mesh, microbatches=m, recompute=recompute), str(e)))
                continue
            peak = int(record["busiest_rank"]["peak_bytes"])
            if smallest is None or peak < smallest[0]:
                smallest = (peak, mesh, m, recompute)
            if peak > memory:
                continue
            record = dict(record)
            record.setdefault("micro_batch", micro_batch)
            t = step_time(record, device)
            tokens = tokens_per_step(record, seq)
            results.append({"mesh": dict(mesh), "microbatches": m, "recompute": recompute, "step_time": t,
                            "peak_bytes": peak, "tokens_per_step": tokens, "tokens_per_s": tokens / t["total_s"]})
    if not results:
        if smallest is None:
            raise ValueError(f"no mesh of world {world} could be planned ({len(meshes)} candidates); "
                             f"pass a list as skipped= to see why each was left out")
        peak, mesh, m, recompute = smallest
        raise ValueError(f"no mesh of world {world} fits {format_bytes(memory)} per rank: the smallest predicted "
                         f"peak is {format_bytes(peak)} ({mesh_str(mesh)}, microbatches={m}, recompute={recompute}); "
                         f"use more ranks, a shorter sequence or micro-batch, "
                         f"{'' if 'full' in recompute_choices else 'recompute full, '}"
                         f"or a higher optimizer level (level3) if not already")
    results.sort(key=lambda r: (r["step_time"]["total_s"] / r["tokens_per_step"], r["peak_bytes"], len(r["mesh"])))
    results[0]["reason"] = _reason(results[0], results[1] if len(results) > 1 else None)
    return results[:limit] if limit else results


def _per_token(entry: Mapping[str, Any], key: str) -> float:
    return entry["step_time"][key] / entry["tokens_per_step"]


def _link_notes(entry: Mapping[str, Any], axes: Iterable[str]) -> list[str]:
    links = entry["step_time"]["links"]
    return [f"{a}={group_size(entry['mesh'], a)} {'stays inside the node' if links[a] == 'intra' else 'crosses nodes'}"
            for a in axes if a in links]


def _reason(best: Mapping[str, Any], other: Mapping[str, Any] | None) -> str:
    """One sentence: by how much the winner beats the runner-up per token, and which part of the cost
    (communication and its links, compute and recomputation, the pipeline bubble) makes the difference."""
    name = f"{mesh_str(best['mesh'])} (microbatches={best['microbatches']}, recompute={best['recompute']})"
    if other is None:
        return f"{name} is the only candidate that fits"
    gain = best["tokens_per_s"] / other["tokens_per_s"] - 1
    rival = f"{mesh_str(other['mesh'])} (microbatches={other['microbatches']}, recompute={other['recompute']})"
    parts = []
    for key, what in (("comm_s", "communication"), ("compute_s", "compute"), ("bubble_s", "pipeline bubble")):
        mine, theirs = _per_token(best, key), _per_token(other, key)
        if theirs > mine:
            pct = 100 * (1 - mine / theirs)
            detail = ""
            if key == "comm_s":
                notes = _link_notes(best, [a for a, s in best["step_time"]["by_axis"].items() if s > 0])
                notes += [f"the runner-up's {n}" for n in _link_notes(other, other["step_time"]["links"])
                          if n.endswith("crosses nodes")]
                detail = f" ({'; '.join(notes)})" if notes else ""
            elif key == "compute_s" and best["recompute"] != other["recompute"]:
                detail = f" (recompute {best['recompute']} vs {other['recompute']})"
            parts.append((theirs - mine, f"{pct:.0f}% less {what} per token{detail}"))
    parts.sort(key=lambda p: -p[0])
    why = "; ".join(p[1] for p in parts) or "no part of the cost is lower; it wins on peak memory"
    return f"{name}: {gain:.1%} more tokens/s than the runner-up {rival}: {why}"


def format_ranking(results: list[Mapping[str, Any]], top: int = 10) -> str:
    """The ranking as a table (per step: total, compute, communication, bubble in ms; tokens/s; peak per
    rank), then the winner's reason. For `hyper-parallel plan --search`."""
    head = f"{'#':>3}  {'mesh':<28} {'mb':>3} {'recomp':<6} {'step ms':>9} {'compute':>9} {'comm':>9} " \
           f"{'bubble':>8} {'tokens/s':>11} {'peak':>10}"
    lines = [head]
    for i, r in enumerate(results[:top], 1):
        t = r["step_time"]
        lines.append(f"{i:>3}  {mesh_str(r['mesh']):<28} {r['microbatches']:>3} {r['recompute']:<6} "
                     f"{1e3 * t['total_s']:>9.2f} {1e3 * t['compute_s']:>9.2f} {1e3 * t['comm_s']:>9.2f} "
                     f"{1e3 * t['bubble_s']:>8.2f} {r['tokens_per_s']:>11.0f} {format_bytes(r['peak_bytes']):>10}")
    if len(results) > top:
        lines.append(f"     ... {len(results) - top} more")
    if results and results[0].get("reason"):
        lines.append(f"winner: {results[0]['reason']}")
    return "\n".join(lines)


# ---- calibration: measure the machine at hand -----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn: Callable[[], Any], repeats: int, sync: Callable[[], Any]) -> float:
    """Median seconds of one call of `fn` over `repeats` calls, `sync` (a barrier) before each."""
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _calibrate_worker(rank: int, world: int, port: int, sizes: tuple[int, ...], repeats: int, box) -> None:
    """One rank of the calibration: all_reduce and all_gather of each size through the library's
    collectives (what a real run goes through), timed; rank 0 reports [(kind, counted bytes, seconds)]."""
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    from ..redistribute import collectives as C

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        out = []
        sync = lambda: C.barrier()  # noqa: E731
        for nbytes in sizes:
            full = torch.ones(max(1, nbytes // 4))
            shard = torch.ones(max(1, nbytes // 4 // world))
            C.all_reduce(full, "sum", None, world)  # warm-up: connections, buffers
            out.append(("all_reduce", full.numel() * 4,
                        _timed(lambda: C.all_reduce(full, "sum", None, world), repeats, sync)))
            out.append(("all_gather", shard.numel() * 4,
                        _timed(lambda: C.all_gather(shard, 0, None, [shard.shape[0]] * world), repeats, sync)))
        if rank == 0:
            box.put(out)
    finally:
        dist.destroy_process_group()


def fit_link(samples: Iterable[tuple[str, float, float]], n: int) -> Link:
    """alpha and bandwidth from measured (kind, counted bytes, seconds) of single calls over `n` ranks, by
    least squares on ``seconds = steps * alpha + wire / bandwidth`` (steps and wire bytes as `step_time`
    prices them), each sample weighted by 1/seconds so that small messages (which set alpha) count as much
    as large ones (which set the bandwidth). Where noise makes a coefficient come out <= 0, it is bounded
    from one sample instead: alpha from the smallest message (all its time taken as latency), bandwidth from
    the largest (all its time taken as transfer): both pessimistic."""
    import numpy as np

    rows = [(*_ring(kind, n, b), t) for kind, b, t in samples]
    if not rows or any(t <= 0 for *_, t in rows):
        raise ValueError("fit_link needs samples with positive times")
    a = np.array([[s / t, w / t] for s, w, t in rows])
    alpha, inv_bw = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)[0]
    if not alpha > 0:
        s, w, t = min(rows, key=lambda r: r[1])
        alpha = t / max(s, 1.0)
    if not inv_bw > 0:
        s, w, t = max(rows, key=lambda r: r[1])
        inv_bw = t / w
    return Link(float(alpha), float(1 / inv_bw))


def measure_matmul(dtype: str = "fp32", n: int = 512, seconds: float = 0.3, device_type: str | None = None) -> float:
    """Dense matmul FLOP/s in this process: n x n products (2 n^3 FLOPs each) repeated for about
    `seconds`, after one warm-up; on CUDA when it is available (or `device_type`), else on the CPU."""
    import torch

    dev = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[_dtype_key(dtype)]
    a = torch.randn(n, n, device=dev).to(dt)
    b = torch.randn(n, n, device=dev).to(dt)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    a @ b
    sync()
    start, calls = time.perf_counter(), 0
    while calls == 0 or time.perf_counter() - start < seconds:
        a @ b
        calls += 1
        if dev == "cuda" and calls % 10:
            continue
        sync()
    sync()
    return 2 * n ** 3 * calls / (time.perf_counter() - start)


def calibrate(world: int = 2, *, sizes: tuple[int, ...] = (2 ** 12, 2 ** 16, 2 ** 19, 2 ** 21), repeats: int = 5,
              mfu: float = 0.5, ranks_per_node: int | None = None, memory_bytes: int | None = None,
              name: str = "calibrated") -> Device:
    """A Device measured on this machine, in a few seconds.

    - peak_flops: fp32 and bf16 matmul FLOP/s in this process (`measure_matmul`); `mfu` (stated, default
      0.5) is the share of that rate a whole step keeps (a step is not only matmuls).
    - the link: `world` local processes (spawned) on gloo time all_reduce and all_gather of `sizes` bytes
      through the library's collectives, and `fit_link` fits alpha and bandwidth. One machine has one
      link, so `intra` and `inter` are both the measured one; `ranks_per_node` defaults to `world`.
    - memory_bytes: the GPU's memory when there is one, else the host's physical memory / ranks_per_node.
    """
    import torch
    import torch.multiprocessing as tmp

    if world < 2:
        raise ValueError(f"calibrate measures a link between processes: world must be >= 2, got {world}")
    peak = {"fp32": measure_matmul("fp32"), "bf16": measure_matmul("bf16")}
    box = tmp.get_context("spawn").SimpleQueue()
    tmp.spawn(_calibrate_worker, args=(world, _free_port(), tuple(sizes), repeats, box), nprocs=world, join=True)
    link = fit_link(box.get(), world)
    node = ranks_per_node or world
    if memory_bytes is None:
        memory_bytes = (torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available()
                        else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // node)
    return Device(name, peak, mfu, int(memory_bytes), node, link, link)
