"""`kiln` command line: each subcommand lives in the module that owns the feature.

A command module exposes `register(subparsers)`, which adds its parser and sets
`func=callable(args) -> int` on it. Errors a user can fix raise `CliError` (or ValueError
from config validation) and print one line, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kiln.kernels.isa import check_environment

# subcommand -> module that registers it (a command is listed once its module exists: every
# one here is imported by `kiln --help`, which tests/unit/test_cli_help.py runs); only the
# command a user names is imported, so `kiln serve ...` does not pay for the others
COMMAND_MODULES = {
    "models": "kiln.models.cli",
    "generate": "kiln.engine.cli",
    "serve": "kiln.serve.cli",
    "worker": "kiln.cluster.cli",
    "bench": "kiln.bench.cli",
    "quantize": "kiln.quant.cli",
    "train-speculator": "kiln.speculative.training.cli",
}


class CliError(Exception):
    """A problem the user can fix; printed as one line."""


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="kiln: an LLM inference server")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and not argv[0].startswith("-") else None
    for name, module_name in COMMAND_MODULES.items():
        if wanted is not None and name != wanted:
            sub.add_parser(name, help=f"(see kiln {name} --help)")
            continue
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        check_environment()  # the kernels' environment variables, before anything starts
        return int(args.func(args) or 0)
    except (CliError, ValueError, FileNotFoundError) as exc:
        print(f"kiln {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
