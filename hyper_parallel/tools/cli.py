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
                   help="a local Hugging Face checkpoint folder (never downloaded); repeatable")
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
    return p


def census_main(args: argparse.Namespace) -> int:
    from .models import MODELS
    if args.list:
        for name, entry in MODELS.items():
            print(f"{name:<20} {entry.description}")
        return 0
    if not args.model and not args.model_path:
        print("hyper-parallel census: give --model NAME (or 'all'), --model-path DIR, or --list", file=sys.stderr)
        return 2
    unknown = [m for m in args.model if m != "all" and m not in MODELS]
    if unknown:
        print(f"unknown model(s) {', '.join(unknown)}; built-in: {', '.join(MODELS)}", file=sys.stderr)
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hyper-parallel` script."""
    args = _parser().parse_args(argv)
    if args.command == "census":
        return census_main(args)
    if args.command == "checkpoint":
        return args.handler(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
