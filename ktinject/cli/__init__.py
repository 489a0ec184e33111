"""`ktinject` command line. Each subcommand is one module in this package that defines

    NAME = "explain"                   # the subcommand
    HELP = "one line for --help"
    def add_arguments(parser): ...     # argparse
    def run(args) -> int: ...          # exit code

Modules are discovered by listing the package, so adding a command never edits this file.
Every `KtInjectError` reaches the user as one clear message and exit code 2; `--debug`
shows the traceback.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

from rich.console import Console
from rich.markup import escape

from ..errors import KtInjectError

console = Console(stderr=False)
err_console = Console(stderr=True)


def _commands():
    mods = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(mod, "NAME") and hasattr(mod, "run"):
            mods.append(mod)
    return sorted(mods, key=lambda m: m.NAME)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ktinject", description="Hybrid CPU/GPU inference of MoE models "
                                     "through YAML injection rules.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _commands():
        p = sub.add_parser(mod.NAME, help=getattr(mod, "HELP", ""), description=getattr(mod, "HELP", ""))
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 1
    try:
        return int(args._run(args) or 0)
    except KtInjectError as exc:
        if args.debug:
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, markup=True, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
