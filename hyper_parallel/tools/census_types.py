"""The census over transformers model types: each type built tiny on the spot, in its own process.

`run_type_census(["llama", "bert"])` (or `["all"]`) runs every type's generate (or forward) and training
step, plain and on DTensors, in a forked child per type (per rank with `dp` / `tp`), `jobs` at a time,
each under a timeout, so a type that hangs or crashes costs its own slot only. A type whose plain run fails
is reported as such ("plain failed") and not counted against the library: the targets count the types
whose plain run works.
"""
from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import resource
import socket
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

from .census import MODES, RunReport, _modes, _run_one, replicated

SKIPS = ("no tp plan", "not applicable")  # types a scenario does not run, and says why
STATUSES = ("ok", "missing ops", "not equal", "failed", "plain failed", "not built", "timeout") + SKIPS
SETTLED = ("ok", "plain failed", "not built") + SKIPS  # statuses a rerun leaves alone: fixes cannot change them


@dataclass
class TypeResult:
    """One model type: how far it got, and its runs (one per mode)."""

    model_type: str
    head: str = ""
    built: bool = False
    build_error: str | None = None
    runs: list = field(default_factory=list)   # RunReport
    seconds: float = 0.0
    cpu_seconds: float | None = None           # CPU time of the type's process (the slowest rank's), from /proc
    rss_mb: float | None = None                # the peak resident memory of its rank 0 (MiB): what crowds a machine
    timed_out: bool = False
    skipped: str | None = None                 # why the type was not run (e.g. no tp plan for --tp)
    fed: list = field(default_factory=list)    # the modalities its inputs feed (text, image, video, audio)
    note: str = ""                             # what the builder left out (e.g. a head loss that fails plain)

    @property
    def plain_ok(self) -> bool:
        return self.built and bool(self.runs) and all(r.plain_ok for r in self.runs)

    def _calls(self, which: str) -> dict:
        """op -> calls over the runs, of `ops` (every op hit) or `missing` (those without a rule)."""
        out: dict = {}
        for r in self.runs:
            for op, n in getattr(r, which).items():
                out[op] = out.get(op, 0) + n
        return out

    @property
    def ops(self) -> dict:
        return self._calls("ops")

    @property
    def missing(self) -> dict:
        return self._calls("missing")

    @property
    def equal(self) -> bool | None:
        if not self.runs or any(r.equal is None for r in self.runs):
            return None
        return all(r.equal for r in self.runs)

    @property
    def status(self) -> str:
        if self.skipped:
            return self.skipped
        if self.timed_out and not self.plain_ok:
            return "timeout"
        if not self.built:
            return "not built"
        if not self.plain_ok:
            return "plain failed"
        if self.timed_out:
            return "timeout"
        if any(r.error for r in self.runs):
            return "failed"
        if self.missing:
            return "missing ops"
        if not self.equal:
            return "not equal"
        return "ok"

    @property
    def conditioning(self) -> str:
        """For a type judged against its own float32 vs float64 gap (see census.CONDITIONING_FACTOR): what the
        runs measured; empty where the fixed tolerances decided."""
        return "; ".join(f"{r.mode}: {r.detail.split('; ', 1)[-1]}" for r in self.runs
                         if getattr(r, "conditioning", None) is not None)

    @property
    def why(self) -> str:
        """The one line that says what went wrong (empty when ok), or why a scenario does not apply."""
        if self.skipped:
            return self.note
        if self.build_error:
            return _last_line(self.build_error)
        for r in self.runs:  # a plain run that failed says why the type is not counted
            if r.error and not r.plain_ok:
                return f"{r.mode} (plain): {_last_line(r.error)}"
        for r in self.runs:
            if r.error:
                return f"{r.mode}: {_last_line(r.error)}"
        if self.missing:
            return "missing " + ", ".join(sorted(self.missing))
        for r in self.runs:
            if r.equal is False:
                return f"{r.mode}: {r.detail}"
        if self.timed_out:
            return "no result within the timeout"
        return ""

    @classmethod
    def from_dict(cls, model_type: str, d: dict) -> "TypeResult":
        """The inverse of `to_dict` (a report's JSON entry), so that a report can be merged with a rerun."""
        status = d.get("status", "")
        runs = [RunReport(model_type, mode, **{k: v for k, v in run.items() if k in _RUN_FIELDS})
                for mode, run in (d.get("runs") or {}).items()]
        return cls(model_type, head=d.get("head", ""), built=bool(d.get("built")),
                   build_error=(d.get("why") or "the type was not built") if status == "not built" else None,
                   runs=runs, seconds=float(d.get("seconds") or 0.0), cpu_seconds=d.get("cpu_seconds"),
                   rss_mb=d.get("rss_mb"),
                   timed_out=status == "timeout",
                   skipped=status if status in SKIPS else None, fed=list(d.get("fed") or []),
                   note=d.get("note") or "")

    def to_dict(self) -> dict:
        return {"head": self.head, "fed": self.fed, "note": self.note, "built": self.built, "plain_ok": self.plain_ok, "status": self.status,
                "ops": dict(sorted(self.ops.items())), "missing": dict(sorted(self.missing.items())),
                "equal": self.equal, "seconds": round(self.seconds, 2),
                "cpu_seconds": None if self.cpu_seconds is None else round(self.cpu_seconds, 2),
                "rss_mb": None if self.rss_mb is None else round(self.rss_mb), "why": self.why,
                "runs": {r.mode: {k: v for k, v in asdict(r).items() if k not in ("model", "mode")}
                         for r in self.runs}}


_RUN_FIELDS = {f for f in RunReport.__dataclass_fields__ if f not in ("model", "mode")}


def _last_line(text: str) -> str:
    """The exception line of a traceback; of a FeedError (its header, then a line per reason, then advice) the
    first reason, which says what was refused."""
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    header = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith(_FEED_ERROR)), None)
    if header is not None and header + 1 < len(lines):
        return f"FeedError: {lines[header + 1].strip()}"[:200]
    return lines[-1].strip()[:200] if lines else ""


_FEED_ERROR = "hyper_parallel.parallel.feed.FeedError: "


@dataclass
class TypeCensus:
    """The results of a type census, with the counts the targets are stated in."""

    results: list = field(default_factory=list)   # TypeResult
    scenario: str = "single"
    seconds: float = 0.0
    commands: list = field(default_factory=list)  # the command lines that made it (a run, then its reruns)

    def counted(self) -> list:
        """The types whose plain run works (the ones the targets count)."""
        return [r for r in self.results if r.plain_ok and not r.skipped]

    def summary(self) -> dict:
        counted = self.counted()
        ok = [r for r in counted if r.status == "ok"]
        statuses: dict = {}
        for r in self.results:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        cpu = [r.cpu_seconds for r in self.results if r.cpu_seconds is not None]
        return {"scenario": self.scenario, "types": len(self.results), "plain_ok": len(counted), "ok": len(ok),
                "ok_by_conditioning": sum(bool(r.conditioning) for r in ok),
                "ok_share": round(len(ok) / len(counted), 4) if counted else None,
                "statuses": statuses, "heads": self.by_head(), "seconds": round(self.seconds, 1),
                "cpu_seconds": round(sum(cpu), 1)}

    def by_head(self) -> dict:
        """head -> {"types", "plain_ok", "ok", "not applicable"}: the counts per head kind, most types first."""
        out: dict = {}
        for r in self.results:
            c = out.setdefault(r.head or "?", {"types": 0, "plain_ok": 0, "ok": 0, "not applicable": 0})
            c["types"] += 1
            c["not applicable"] += bool(r.skipped)
            if r.plain_ok and not r.skipped:
                c["plain_ok"] += 1
                c["ok"] += r.status == "ok"
        return dict(sorted(out.items(), key=lambda kv: (-kv[1]["types"], kv[0])))

    def missing_union(self) -> dict:
        """op -> number of types that miss it (most common first)."""
        out: dict = {}
        for r in self.results:
            for op in r.missing:
                out[op] = out.get(op, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    def to_dict(self) -> dict:
        return {"summary": self.summary(), "commands": list(self.commands), "missing": self.missing_union(),
                "types": {r.model_type: r.to_dict() for r in self.results}}

    @classmethod
    def from_dict(cls, d: dict) -> "TypeCensus":
        """A report read back from its JSON (`write_type_json`)."""
        summary = d.get("summary") or {}
        return cls([TypeResult.from_dict(t, v) for t, v in (d.get("types") or {}).items()],
                   scenario=summary.get("scenario", "single"), seconds=float(summary.get("seconds") or 0.0),
                   commands=list(d.get("commands") or []))

    def to_rerun(self) -> list[str]:
        """The types a fix may change: every one whose status is not settled (ok, plain failed, not built)."""
        return [r.model_type for r in self.results if r.status not in SETTLED]

    def merged(self, rerun: "TypeCensus") -> "TypeCensus":
        """This report with the types of `rerun` replaced by their new results (order kept, new types last)."""
        if rerun.scenario != self.scenario:
            raise ValueError(f"census: cannot merge a {rerun.scenario!r} rerun into a {self.scenario!r} report")
        new = {r.model_type: r for r in rerun.results}
        results = [new.pop(r.model_type, r) for r in self.results] + list(new.values())
        return TypeCensus(results, self.scenario, self.seconds + rerun.seconds, self.commands + rerun.commands)

    def table(self) -> str:
        width = max([len("type")] + [len(r.model_type) for r in self.results])
        head = f"{'type':<{width}} {'head':<18} {'status':<14} {'ops':>4} {'miss':>4} {'equal':<5} {'time':>6}  why"
        lines = [head, "-" * len(head)]
        for r in self.results:
            eq = "-" if r.equal is None else ("yes" if r.equal else "NO")
            lines.append(f"{r.model_type:<{width}} {r.head:<18} {r.status:<14} {len(r.ops):>4} {len(r.missing):>4} "
                         f"{eq:<5} {r.seconds:>5.1f}s  {r.why[:100]}")
        s = self.summary()
        lines.append("-" * len(head))
        share = "-" if s["ok_share"] is None else f"{100 * s['ok_share']:.1f}%"
        lines.append(f"{s['types']} types, {s['plain_ok']} run plain, {s['ok']} ok ({share} of those), "
                     f"{self.seconds:.0f}s; " + ", ".join(f"{k}: {v}" for k, v in sorted(s["statuses"].items())))
        miss = self.missing_union()
        if miss:
            lines.append("missing ops (types): " + ", ".join(f"{op} ({n})" for op, n in miss.items()))
        return "\n".join(lines)

    def markdown(self, command: str = "") -> str:
        """The report as a markdown page (docs/census*.md)."""
        s = self.summary()
        share = "-" if s["ok_share"] is None else f"{100 * s['ok_share']:.1f}%"
        commands = self.commands + ([command] if command and command not in self.commands else [])
        made_by = " then ".join(f"`{c}`" for c in commands)
        kind, _, world = s["scenario"].partition(" ")
        page = "census" if kind == "single" else f"census-{kind}{world}"
        flags = "" if kind == "single" else (" --plain" if kind == "plain" else f" --{kind} {world}")
        default = f"`hyper-parallel census --model-type all{flags} --jobs 2 --markdown docs/{page}.md`"
        out = ["# Census of transformers model types" + ("" if kind == "single" else f" ({s['scenario']})"), "",
               f"Generated by {made_by or default} (with `--markdown`); do not edit by hand.", "",
               _ABOUT + (_SCENARIO_ABOUT.get(kind, "")), "",
               f"- scenario: {s['scenario']}", f"- types: {s['types']}",
               f"- plain run works: {s['plain_ok']}",
               f"- 0 missing ops and equal results: {s['ok']} ({share} of those; {s['ok_by_conditioning']} of them "
               f"equal within their own fp32-vs-float64 gap, noted in `why`)",
               "- statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(s["statuses"].items())),
               f"- wall time: {self.seconds:.0f}s (CPU {s['cpu_seconds']:.0f}s)", "",
               "## Per head", "", "| head | types | plain run works | ok | not applicable |", "|---|---|---|---|---|"]
        out += [f"| {h} | {c['types']} | {c['plain_ok']} | {c['ok']} | {c['not applicable']} |"
                for h, c in s["heads"].items()]
        out.append("")
        miss = self.missing_union()
        if miss:
            out += ["## Missing ops", "", "| op | types |", "|---|---|"]
            out += [f"| `{op}` | {n} |" for op, n in miss.items()]
            out.append("")
        out += ["## Types", "", "| type | head | fed | status | ops | missing | equal | seconds | why |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in self.results:
            if r.skipped:
                continue
            eq = "-" if r.equal is None else ("yes" if r.equal else "no")
            why = _cell(r.why or "; ".join(filter(None, (r.note, r.conditioning))))
            out.append(f"| {r.model_type} | {r.head} | {' '.join(r.fed)} | {r.status} | {len(r.ops)} | "
                       f"{len(r.missing)} | {eq} | {r.seconds:.1f} | {why} |")
        out.append("")
        out += self._not_counted() + self._skipped() + self._overrides()
        return "\n".join(out)

    def _not_counted(self) -> list:
        """The types whose plain run fails (or that do not build), with the transformers error that stops them."""
        rows = [r for r in self.results if not r.skipped and not r.plain_ok]
        if not rows:
            return []
        out = [f"## Not counted: {len(rows)} types whose tiny model does not build or run plain", "",
               "| type | head | status | the error that stops it |", "|---|---|---|---|"]
        out += [f"| {r.model_type} | {r.head} | {r.status} | {_cell(r.why)} |" for r in rows]
        return out + [""]

    def _skipped(self) -> list:
        groups: dict = {}
        for r in self.results:
            if r.skipped:
                groups.setdefault((r.skipped, r.note), []).append(r.model_type)
        out = []
        for (status, why), types in groups.items():
            out += [f"## Not run ({status}{': ' + why if why else ''}): {len(types)} types", "", ", ".join(types), ""]
        return out

    def _overrides(self) -> list:
        from .tiny_overrides import OVERRIDES
        used = [(r.model_type, OVERRIDES[r.model_type].why) for r in self.results if r.model_type in OVERRIDES]
        if not used:
            return []
        out = ["## Per-type tiny-config overrides (hyper_parallel/tools/tiny_overrides.py)", "",
               "| type | why the generic tiny config needs help |", "|---|---|"]
        return out + [f"| {t} | {_cell(why)} |" for t, why in used] + [""]


def _cell(text: str) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")[:160]


_ABOUT = ("Every model type transformers has a model class for, built tiny from its default config (shrunk "
          "generically, with a few per-type overrides listed at the end) with the first head it has in "
          "`hyper_parallel/tools/heads.py` (every `MODEL_FOR_*_MAPPING_NAMES` head, the base model for a type with "
          "none), fed inputs for its modalities (`fed`: text, image, video, audio, points). Each type runs "
          "generate (heads that generate) or a forward, and one training step (the head's own loss, else a sum of "
          "its outputs' mean squares), plain and with DTensor inputs and parameters; `equal` compares tokens, "
          "every output, the loss and the gradients with the plain run, and the parameters after AdamW with a "
          "plain AdamW step on the run's own gradients (floats within 1e-5 of their magnitude above 1, gradients "
          "within 1e-4: sums taken in another order; a type whose comparison fails that is measured once more "
          "against its own conditioning, the plain run in float64 against float32, and is equal if the DTensor "
          "run differs by at most twice that gap, the fp32 rounding the model already has). A type whose plain run fails is not counted (listed with "
          "its error at the end).")
_SCENARIO_ABOUT = {
    "plain": " This page is the plain run alone (`--plain`): it checks the tiny configs and inputs.",
    "dp": (" With `--dp N` each type runs on N gloo processes with the batch split over them; every run of it (plain, "
           "DTensor, float64) with oneDNN off (torch.backends.mkldnn), as oneDNN picks its fp32 convolution "
           "algorithm by the batch size (a rank's 1 sample rounds otherwise than the plain run's 2), where the "
           "native kernels compute sample by sample."),
    "tp": " With `--tp N` each type runs on N gloo processes, laid out by `shard(model, \"auto\", mesh)` from its "
          "own base_model_tp_plan (attention whose heads do not divide stays replicated); types without a plan "
          "are named at the end, not run.",
    "ep": " With `--ep N` each type runs on N gloo processes through `expert_parallel(model, mesh, \"ep\")` "
          "(experts spread, the batch split); dense types are named at the end as not applicable.",
    "cp": " With `--cp N` each type runs on N gloo processes through `context_parallel(model, mesh, \"cp\")` (ring "
          "attention, the sequence split; prompts left-padded in generate mode, whose prompt forward is split and "
          "whose decoding steps run whole); types without a decoder, and encoder-decoder types (as the "
          "seq2seq-lm head's), are named at the end as not applicable.",
    "pp": " With `--pp N` each type runs one training step through `pipeline(model, mesh, \"pp\")` (1F1B, 2 "
          "micro-batches) on N gloo processes; the loss and every stage's gradients are compared with the plain "
          "step; types without a decoder, and encoder-decoder types (as the seq2seq-lm head's), are named at the "
          "end as not applicable.",
}


# ---- the child processes ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _type_child(model_type: str, modes: tuple, max_new_tokens: int, seed: int, record: bool, conn,
                rank: int = 0, world: int = 1, port: int = 0, scenario: str = "single") -> None:
    """One type in one process (one rank of `world`): sends ("built", head, ...) or ("skip", reason), then one
    RunReport per mode."""
    import torch
    torch.set_num_threads(1)
    from .auto_models import build_model_type, fed_modalities, head_of
    from .census_scenarios import make_scenario
    try:
        if world > 1:
            import torch.distributed as dist
            from datetime import timedelta
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
        plan = make_scenario(scenario, world)
        head, _ = head_of(model_type)
        try:
            template = build_model_type(model_type, seed)
        except Exception:
            if rank == 0:
                conn.send(("build_error", head, traceback.format_exc()))
            return
        if rank == 0:
            conn.send(("built", head, (fed_modalities(template.inputs), template.note)))
        reason = plan.not_applicable(template)
        if reason is not None:
            if rank == 0:
                conn.send(("skip", reason, None))
            return

        def build():  # a copy of the one built model: building is slower than copying
            return copy.deepcopy(template)

        for md in plan.modes(modes):
            r = plan.run(model_type, md, build, max_new_tokens, record)
            if rank == 0:
                conn.send(("run", md, asdict(r)))
    finally:
        if rank == 0:
            use = resource.getrusage(resource.RUSAGE_SELF)
            conn.send(("done", use.ru_utime + use.ru_stime, use.ru_maxrss / 1024))  # ru_maxrss: KiB on Linux
        conn.close()
        if world > 1:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()


@dataclass
class _Job:
    result: TypeResult
    procs: list
    conn: object
    start: float
    cpu: float | None = None  # the slowest rank's CPU seconds, as last read
    progressed: float = 0.0   # when they last grew
    done: bool = False        # rank 0 said it finished (its "done" message came)


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
WALL_FACTOR = 4  # a type is killed after `timeout` CPU seconds, or this many times `timeout` of wall time
STALL = 60.0     # ... or when its CPU time has not moved for this many seconds (a hang burns no CPU)


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (Linux /proc); None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15 of stat)
    except (OSError, IndexError, ValueError):
        return None


def _over_time(job: _Job, timeout: float) -> bool:
    """Whether a running job has used up its time: `timeout` seconds of CPU (its slowest rank's), so that on a
    machine shared with other work a type that is merely waiting for a core is not killed. Wall time decides
    where CPU time cannot be read (`timeout`), for a job that stopped using CPU (a hang: `STALL` seconds without
    progress, once `timeout` has passed) and in any case after WALL_FACTOR times `timeout`."""
    now = time.perf_counter()
    wall = now - job.start
    if wall <= timeout:
        return False
    cpus = [_cpu_seconds(p.pid) for p in job.procs if p.is_alive()]
    if not cpus or any(c is None for c in cpus):
        return True
    cpu = max(cpus)
    if job.cpu is None or cpu > job.cpu:
        job.cpu, job.progressed = cpu, now
    return cpu > timeout or wall > WALL_FACTOR * timeout or now - job.progressed > STALL


def _start(model_type: str, modes: tuple, max_new_tokens: int, seed: int, record: bool, scenario: str,
           world: int) -> _Job:
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    port = _free_port() if world > 1 else 0
    procs = []
    for rank in range(world):
        conn = send if rank == 0 else _NullConn()
        p = ctx.Process(target=_type_child, args=(model_type, modes, max_new_tokens, seed, record, conn, rank,
                                                   world, port, scenario), daemon=True)
        p.start()
        procs.append(p)
    send.close()
    return _Job(TypeResult(model_type), procs, recv, time.perf_counter())


class _NullConn:
    """The pipe end of ranks other than 0: they report nothing."""

    def send(self, item) -> None:
        pass

    def close(self) -> None:
        pass


def _drain(job: _Job) -> bool:
    """Read what the job's rank 0 sent; True once it said it is done (or its pipe closed)."""
    try:
        while job.conn.poll():
            kind, a, b = job.conn.recv()
            if kind == "built":
                job.result.built, job.result.head = True, a
                job.result.fed, job.result.note = b
            elif kind == "build_error":
                job.result.head, job.result.build_error = a, b
            elif kind == "skip":
                job.result.skipped, job.result.note = "not applicable", a
            elif kind == "run":
                job.result.runs.append(RunReport(**b))
            elif kind == "done":
                job.result.cpu_seconds, job.result.rss_mb, job.done = a, b, True
                return True
    except (EOFError, OSError):
        return True
    return False


def _finish_job(job: _Job, timed_out: bool) -> TypeResult:
    for p in job.procs:
        p.join(timeout=5 if not timed_out else 0.1)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    job.result.seconds = time.perf_counter() - job.start
    job.result.timed_out = timed_out
    if job.result.cpu_seconds is None:
        job.result.cpu_seconds = job.cpu
    codes = [p.exitcode for p in job.procs]
    if not timed_out and not job.result.built and not job.result.build_error:
        job.result.build_error = f"the type's process died (exit codes {codes})"
    elif not timed_out and job.result.built and not job.done and not job.result.skipped:
        # killed mid-run (the kernel's OOM killer: exit code -9): the runs that did not report are a failure,
        # never an "ok" made of the modes that finished first
        died = RunReport(job.result.model_type, "died", equal=False,
                         error=f"the type's process died after {len(job.result.runs)} run(s) (exit codes {codes}; "
                               f"-9 is SIGKILL, e.g. the out-of-memory killer)")
        job.result.runs.append(died)
    return job.result


def _head_name(model_type: str) -> str:
    from .heads import head_of
    try:
        return head_of(model_type)[0]
    except KeyError:
        return ""


def _preload() -> None:
    """Import what every type's build imports, once, before the children are forked (they inherit it): a
    model's first build otherwise spends seconds importing transformers' shared modules."""
    import importlib
    for name in ("transformers", "transformers.modeling_utils", "transformers.generation.utils",
                 "transformers.activations", "transformers.models.auto.modeling_auto", "transformers.masking_utils",
                 "transformers.modeling_layers", "transformers.integrations.sdpa_attention"):
        try:
            importlib.import_module(name)
        except ImportError:  # an optional module this transformers version lacks: its users import it later
            pass


def resolve_types(types: Iterable[str]) -> list[str]:
    from .heads import all_model_types
    out: list = []
    for t in types:
        out.extend(all_model_types() if t == "all" else [t])
    return list(dict.fromkeys(out))


def run_type_census(types: Iterable[str], mode: str = "all", *, jobs: int = 1, dp: int = 0, tp: int = 0,
                    ep: int = 0, cp: int = 0, pp: int = 0, timeout: float = 300.0, max_new_tokens: int = 3,
                    seed: int = 0, record: bool = True, progress: Callable[[str], None] | None = None,
                    plain: bool = False) -> TypeCensus:
    """Run the census on transformers model types ("all" for every one with a census head).

    Single-card by default (one process per type, inputs and parameters replicated on the census layout);
    `dp=N`: N gloo processes per type with the batch split; `tp=N`: N gloo processes per type with
    `shard(model, "auto")` (types whose config declares no base_model_tp_plan are listed as "no tp plan");
    `ep`, `cp`, `pp`: N processes per type with expert_parallel, context_parallel or pipeline (see
    census_scenarios; types a parallelism does not apply to are listed as "not applicable", with why).
    `jobs` types run at once; a type that has used `timeout` seconds of CPU without finishing is killed
    ("timeout"; see `_over_time` for the wall-time bounds that catch hangs). `plain`: build each type and run
    it on plain tensors only (a check of the tiny configs and inputs; scenario "plain").
    """
    _preload()
    from .auto_models import has_tp_plan
    from .census_scenarios import not_applicable_before_building
    given = {k: v for k, v in (("dp", dp), ("tp", tp), ("ep", ep), ("cp", cp), ("pp", pp)) if v}
    if len(given) > 1 or (given and plain):
        raise ValueError(f"census: give one scenario, not {' and '.join(given) + (' and plain' if plain else '')}")
    scenario, world = next(iter(given.items())) if given else ("plain" if plain else "single", 1)
    names = resolve_types(types)
    modes = _modes(mode)
    census = TypeCensus(scenario=f"{scenario}" + (f" {world}" if world > 1 else ""))
    order = {t: i for i, t in enumerate(names)}
    pending = list(names)
    running: list = []
    done: list = []
    start = time.perf_counter()

    def report(r: TypeResult) -> None:
        done.append(r)
        if progress is not None:
            progress(f"[{len(done)}/{len(names)}] {r.model_type}: {r.status}, {len(r.ops)} ops, "
                     f"{len(r.missing)} missing, equal={r.equal}, {r.seconds:.1f}s"
                     + (f" ({r.cpu_seconds:.1f}s CPU)" if r.cpu_seconds is not None else "")
                     + (f" ({r.rss_mb:.0f} MiB)" if r.rss_mb is not None else "")
                     + (f" ({r.why[:160]})" if r.why else ""))

    while pending or running:
        while pending and len(running) < max(1, jobs):
            t = pending.pop(0)
            if scenario == "tp":
                try:
                    planned = has_tp_plan(t)
                except Exception:
                    planned = True  # let the child say what fails
                if not planned:
                    report(TypeResult(t, head=_head_name(t), skipped="no tp plan"))
                    continue
            reason = not_applicable_before_building(scenario, t, _head_name(t))
            if reason is not None:  # known from the head or the config: the type is not even built
                report(TypeResult(t, head=_head_name(t), skipped="not applicable", note=reason))
                continue
            running.append(_start(t, modes, max_new_tokens, seed, record, scenario, world))
        time.sleep(0.05)
        for job in list(running):
            finished = _drain(job)
            if not finished and all(not p.is_alive() for p in job.procs):
                finished = _drain(job) or True
            over = not finished and _over_time(job, timeout)
            if finished or over:
                running.remove(job)
                report(_finish_job(job, timed_out=over and not finished))
    census.results = sorted(done, key=lambda r: order[r.model_type])
    census.seconds = time.perf_counter() - start
    return census


def write_type_json(census: TypeCensus, path: str) -> None:
    with open(path, "w") as f:
        json.dump(census.to_dict(), f, indent=2, default=str)


def read_type_json(path: str) -> TypeCensus:
    """A report written by `write_type_json` (`census --model-type ... --json FILE`)."""
    with open(path) as f:
        return TypeCensus.from_dict(json.load(f))


__all__ = ["run_type_census", "TypeCensus", "TypeResult", "resolve_types", "write_type_json", "read_type_json",
           "MODES", "SETTLED"]
