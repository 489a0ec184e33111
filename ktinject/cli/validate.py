"""`ktinject validate RULES...`: check rule files (schema, operators, kwargs, regexes) without a model."""
from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..errors import KtInjectError

NAME = "validate"
HELP = "check rule files (paths or shipped pack names) and list their rules"


def add_arguments(p) -> None:
    p.add_argument("rules", nargs="+", metavar="RULES", help="rule files or shipped pack names")
    p.add_argument("-q", "--quiet", action="store_true", help="only report errors")


def run(args) -> int:
    from . import console, err_console
    from ..rules import load_rules
    failed = 0
    for ref in args.rules:
        try:
            rs = load_rules(ref)
        except KtInjectError as exc:
            failed += 1
            err_console.print(f"[bold red]invalid:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            continue
        console.print(f"[green]ok[/] {escape(str(ref))}: {len(rs)} rule(s) from {len(rs.files)} file(s); "
                      f"defaults: device={rs.default_device or 'cpu'} dtype={rs.default_dtype or 'model'}",
                      highlight=False)
        if args.quiet:
            continue
        table = Table(show_edge=False, pad_edge=False)
        for col in ("rule", "match", "op", "device", "recursive"):
            table.add_column(col)
        for r in rs:
            match = " ".join(filter(None, [f"name={r.name}" if r.name else "", f"class={'|'.join(r.classes)}"
                                           if r.classes else ""]))
            op = r.op if not r.split or r.prefill.op == r.generate.op else f"{r.prefill.op} / {r.generate.op}"
            dev = r.generate.device or "inherit"
            if r.prefill.device != r.generate.device:
                dev = f"{r.prefill.device or 'inherit'} / {dev}"
            table.add_row(escape(f"{_short(r.file)}:{r.line}"), escape(match), op, dev, "yes" if r.recursive else "no")
        console.print(table)
    return 2 if failed else 0


def _short(path: str) -> str:
    return path.rsplit("/", 1)[-1]
