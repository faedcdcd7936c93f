"""`hyper-parallel` command line: `hyper-parallel census --model NAME ...` (see API.md §4)."""
from __future__ import annotations

import argparse
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hyper-parallel", description="hyper_parallel tools")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("census", help="list the ops a model hits through DTensor, with and without rules")
    c.add_argument("--model", action="append", default=[],
                   help="built-in model name (repeatable), or 'all'; see --list")
    c.add_argument("--model-path", action="append", default=[],
                   help="a local Hugging Face checkpoint folder (never downloaded), fed every modality its config "
                        "declares; repeatable")
    c.add_argument("--model-type", action="append", default=[], metavar="TYPE",
                   help="any transformers model_type (repeatable, or comma-separated), or 'all': a tiny random model "
                        "of that type built from its default config, each type in its own process")
    c.add_argument("--types-from", metavar="FILE.json",
                   help="--model-type: also the types whose plain run worked in an earlier report (its --json)")
    c.add_argument("--rerun", metavar="FILE.json",
                   help="re-run the types of an earlier --model-type report (its --json) whose status a fix may "
                        "change (not ok / plain failed / not built / no tp plan), in its scenario, and write the "
                        "merged report with --json / --markdown (FILE itself is only read)")
    c.add_argument("--rerun-plain", action="store_true",
                   help="with --rerun: also the types whose tiny model did not build or run plain (after a fix of "
                        "the tiny configs or inputs)")
    c.add_argument("--jobs", type=int, default=1, metavar="N", help="--model-type: types run at once (default 1)")
    c.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="--model-type: CPU seconds a type may use before it is killed (default 300; a type that stops "
                        "using CPU for a minute, or runs 4x this long on the wall clock, is killed too)")
    c.add_argument("--tp", type=int, default=0, metavar="N",
                   help="--model-type: N gloo processes per type, the model laid out by shard(model, 'auto') "
                        "(types whose config has no base_model_tp_plan are listed as such)")
    for flag, what in (("ep", "expert_parallel(model, mesh, 'ep'): experts spread, batch split (dense types: not "
                               "applicable)"),
                       ("cp", "context_parallel(model, mesh, 'cp'): sequence split, generate and training compared "
                              "(types without a decoder: not applicable)"),
                       ("pp", "pipeline(model, mesh, 'pp'): one 1F1B training step over the stages (types without "
                              "a decoder: not applicable)")):
        c.add_argument(f"--{flag}", type=int, default=0, metavar="N", help=f"--model-type: N gloo processes per "
                                                                            f"type, {what}")
    c.add_argument("--plain", action="store_true",
                   help="--model-type: build each type and run it on plain tensors only (checks the tiny configs)")
    c.add_argument("--markdown", metavar="FILE", help="--model-type: also write the report as markdown "
                                                       "(docs/census.md is generated this way)")
    c.add_argument("--mode", choices=("generate", "train", "all"), default="all",
                   help="generate: model.generate on DTensor inputs; train: forward+backward+AdamW step with "
                        "DTensor parameters; all: both (default)")
    c.add_argument("--max-new-tokens", type=int, default=4)
    c.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    c.add_argument("--list", action="store_true", help="name the built-in models and exit")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--strict", action="store_true", help="exit 2 when any op is missing")
    c.add_argument("--ops", action="store_true", help="also list every op per model with its calls and rule")
    c.add_argument("--dp", type=int, default=0, metavar="N",
                   help="instead of the single-process census, split the batch over N local gloo processes "
                        "(inputs laid out ('dp', 'None', ...)) and compare with the plain single-process run")
    from ..checkpoint.inspect import add_parser as add_checkpoint_parser  # `checkpoint inspect PATH`
    add_checkpoint_parser(sub)
    _add_plan_parser(sub)
    return p


def _add_plan_parser(sub) -> None:
    """`plan`: what each rank of a run holds and sends, on this CPU (API §13; hyper_parallel/tools/plan.py)."""
    c = sub.add_parser("plan", help="predict each rank's memory and collectives for a model and a mesh, without "
                                    "its hardware (fake process group, meta device)")
    c.add_argument("--model-type", metavar="TYPE", help="a transformers model_type: its default config")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key (repeatable; text_config.KEY for a sub-config), set before the model is built")
    c.add_argument("--config", metavar="FILE", help="a config.json")
    c.add_argument("--model-path", metavar="DIR", help="a local checkpoint folder: its config only, no weights read")
    c.add_argument("--world", type=int, required=True, help="number of ranks")
    c.add_argument("--mesh", help="axis=size, outer -> inner, e.g. pp=8,dp=4,ep=8,tp=4 (the sizes multiply to "
                                  "--world); not with --search")
    c.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    c.add_argument("--micro-batch", type=int, default=1, help="rows per micro-batch per data share (default 1)")
    c.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
    c.add_argument("--optimizer-level", choices=("level1", "level2", "level3"), default="level1",
                   help="hsdp over 'dp' (default level1)")
    c.add_argument("--schedule", default="1f1b", help="pipeline schedule (pp; default 1f1b)")
    c.add_argument("--microbatches", type=int, help="pipeline micro-batches per step (pp; default 2 x pp)")
    c.add_argument("--cp-method", help="context-parallel method (cp; default ring)")
    c.add_argument("--recompute", choices=("none", "full"), default="none")
    c.add_argument("--json", metavar="FILE", help="write the record as JSON")
    c.add_argument("--verify", action="store_true",
                   help="also run the mesh for real on this machine (world gloo processes, tiny sizes only) and "
                        "print predicted vs measured")
    c.add_argument("--search", action="store_true", help="rank every mesh of --world that fits --memory")
    c.add_argument("--memory", help="--search: memory per rank, e.g. 80GiB (default: the device's)")
    c.add_argument("--device", default="h100", help="--search: a device preset of hyper_parallel/tools/plan_cost.py")
    c.add_argument("--calibrate", action="store_true", help="--search: measure this machine instead of a preset")
    c.add_argument("--top", type=int, default=10, help="--search: candidates listed (default 10)")
    c.add_argument("--max", action="append", default=[], metavar="AXIS=SIZE",
                   help="--search: the largest size of an axis (repeatable; default tp=8 and cp=seq/512)")


def plan_main(args: argparse.Namespace) -> int:
    """`hyper-parallel plan`: one clear line on stderr and exit 2 for a request that cannot be planned."""
    import json
    from . import plan as P
    source = dict(model_type=args.model_type, config_file=args.config, model_path=args.model_path)
    common = dict(seq=args.seq, micro_batch=args.micro_batch, dtype=args.dtype, optimizer_level=args.optimizer_level,
                  schedule=args.schedule, cp_method=args.cp_method)
    try:
        if args.search:
            results = P.search_main(args.world, source=source, overrides=args.set, memory=args.memory,
                                    device=args.device, calibrate=args.calibrate,
                                    limits=P.parse_mesh(",".join(args.max)) if args.max else None, **common)
            print(P.format_search(results, args.top))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=2, default=str)
                print(f"wrote {args.json}")
            return 0
        if not args.mesh:
            raise ValueError("give --mesh axis=size,... (or --search to rank the meshes)")
        record = P.plan(world=args.world, mesh=args.mesh, overrides=args.set, microbatches=args.microbatches,
                        recompute=args.recompute, **source, **common)
    except (ValueError, RuntimeError) as e:
        print(f"hyper-parallel plan: {e}", file=sys.stderr)
        return 2
    print(P.format_record(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {args.json}")
    if args.verify:
        config = P.load_config(**source, overrides=args.set)
        options = P.step_options(mesh=record["mesh"], microbatches=args.microbatches, recompute=args.recompute,
                                 **common)
        rows = P.comparison(record, P.verify(record, config, options))
        print(f"\n{'predicted vs measured (one real step on gloo ranks of this machine)':<44}")
        for name, pred, got, ok in rows:
            print(f"  {name:<40} {pred:>14,} {got:>14,}  {'ok' if ok else 'DIFFERS'}")
        return 0 if all(ok for *_, ok in rows) else 1
    return 0


def census_main(args: argparse.Namespace) -> int:
    from .models import MODELS
    if args.list:
        for name, entry in MODELS.items():
            print(f"{name:<20} {entry.description}")
        return 0
    if args.rerun or args.types_from:
        args.model_type = args.model_type or []
    if not args.model and not args.model_path and not (args.model_type or args.rerun or args.types_from):
        print("hyper-parallel census: give --model NAME (or 'all'), --model-type TYPE (or 'all'), --model-path DIR, "
              "or --list", file=sys.stderr)
        return 2
    if args.model_type or args.rerun or args.types_from:
        if args.model or args.model_path:
            print("hyper-parallel census: --model-type runs on its own (not with --model / --model-path)",
                  file=sys.stderr)
            return 2
        return _type_census(args)
    import os
    absent = [p for p in args.model_path if not os.path.isfile(os.path.join(p, "config.json"))]
    if absent:
        print(f"hyper-parallel census: --model-path {', '.join(absent)}: no such local checkpoint (a folder with "
              f"a config.json; nothing is downloaded)", file=sys.stderr)
        return 2
    unknown = [m for m in args.model if m != "all" and m not in MODELS]
    if unknown:
        print(f"unknown model(s) {', '.join(unknown)}; built-in: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    if args.tp or args.ep or args.cp or args.pp or args.plain:
        print("hyper-parallel census: --tp / --ep / --cp / --pp / --plain run with --model-type", file=sys.stderr)
        return 2
    from .census import run_census, write_json
    start = time.perf_counter()
    show = lambda line: print(line, flush=True)  # noqa: E731
    if args.dp:
        if args.model_path:
            print("--dp runs the built-in models only", file=sys.stderr)
            return 2
        from .census import run_split_census
        report = run_split_census(args.model, args.mode, world=args.dp, max_new_tokens=args.max_new_tokens,
                                  seed=args.seed, progress=show)
    else:
        report = run_census(args.model, args.mode, max_new_tokens=args.max_new_tokens, model_paths=args.model_path,
                            seed=args.seed, progress=show)
    print()
    if args.ops:
        print(report.op_listing())
        print()
    print(report.table())
    print(f"\ncensus took {time.perf_counter() - start:.1f}s")
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if any(r.error or r.equal is False for r in report.runs):
        return 1
    if args.strict and report.union_missing():
        return 2
    return 0


def _command(args: argparse.Namespace) -> str:
    """The census command line that reproduces a type census (written into its markdown report)."""
    parts = ["hyper-parallel census"] + [f"--model-type {t}" for t in args.model_type]
    parts += [f"--{k} {v}" for k, v in (("types-from", args.types_from), ("rerun", args.rerun)) if v]
    parts += [f"--{k} {getattr(args, k)}" for k in SCENARIO_FLAGS + ("jobs",) if getattr(args, k)]
    parts += ["--plain"] if args.plain else []
    parts += ["--rerun-plain"] if args.rerun_plain else []
    if args.mode != "all":
        parts.append(f"--mode {args.mode}")
    return " ".join(parts)


def _type_census(args: argparse.Namespace) -> int:
    """`census --model-type ...`: each type built tiny in its own process (see tools/census_types.py)."""
    from .auto_models import all_model_types
    from .census_types import read_type_json, run_type_census, write_type_json
    args.model_type = [t for given in args.model_type for t in given.split(",") if t]  # "a,b" or repeated
    base = None
    command = _command(args)  # before the types of --rerun / --types-from join args.model_type
    try:
        if args.rerun:
            base = read_type_json(args.rerun)
            if not _scenario_from(args, base.scenario):
                return 2
            again = base.to_rerun() + ([r.model_type for r in base.results if r.status in ("plain failed", "not built")]
                                       if args.rerun_plain else [])
            args.model_type = again + [t for t in args.model_type if t not in again]
        if args.types_from:
            earlier = read_type_json(args.types_from)
            args.model_type = list(dict.fromkeys(args.model_type + [r.model_type for r in earlier.counted()]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"hyper-parallel census: cannot read the report {args.rerun or args.types_from}: {e} (give the "
              f"--json file of an earlier --model-type census)", file=sys.stderr)
        return 2
    known = set(all_model_types())
    unknown = [t for t in args.model_type if t != "all" and t not in known]
    if unknown:
        print(f"hyper-parallel census: model type(s) {', '.join(unknown)} have no model class in this "
              f"transformers; `--model-type all` runs the {len(known)} that do", file=sys.stderr)
        return 2
    try:
        report = run_type_census(args.model_type, args.mode, jobs=args.jobs, timeout=args.timeout,
                                 max_new_tokens=args.max_new_tokens, seed=args.seed, plain=args.plain,
                                 progress=lambda line: print(line, flush=True),
                                 **{k: getattr(args, k) for k in SCENARIO_FLAGS})
    except ValueError as e:
        print(f"hyper-parallel census: {e}", file=sys.stderr)
        return 2
    report.commands = [command]
    if base is not None:
        report = base.merged(report)
    print()
    print(report.table())
    if args.json:
        write_type_json(report, args.json)
        print(f"wrote {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report.markdown())
        print(f"wrote {args.markdown}")
    counted = report.counted()
    if any(r.status != "ok" for r in counted):
        return 1
    if args.strict and report.missing_union():
        return 2
    return 0


def _scenario_from(args: argparse.Namespace, scenario: str) -> bool:
    """--rerun: take the report's scenario ("dp 2", "tp 2", "single"); False (after saying why) on a mismatch."""
    kind, _, world = scenario.partition(" ")
    wanted = {k: getattr(args, k) for k in SCENARIO_FLAGS}
    if kind in wanted and not any(wanted.values()):
        setattr(args, kind, int(world))
    if kind == "plain" and not any(wanted.values()):
        args.plain = True
    given = next((k for k in SCENARIO_FLAGS if getattr(args, k)), "plain" if args.plain else "single")
    if (given, str(getattr(args, given, "") or "")) != (kind, world):
        print(f"hyper-parallel census: --rerun {args.rerun} is a {scenario!r} report; rerun it in that scenario "
              f"(drop --dp / --tp / --ep / --cp / --pp / --plain, or give the same)", file=sys.stderr)
        return False
    return True


SCENARIO_FLAGS = ("dp", "tp", "ep", "cp", "pp")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hyper-parallel` script."""
    args = _parser().parse_args(argv)
    if args.command == "census":
        return census_main(args)
    if args.command == "checkpoint":
        return args.handler(args)
    if args.command == "plan":
        return plan_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
