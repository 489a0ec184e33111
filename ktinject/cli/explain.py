"""`ktinject explain MODEL --rules R`: the plan as a table, bytes per device, rules that matched nothing."""
from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ._common import add_model_arguments, human_bytes, model_path, pick_rules

NAME = "explain"
HELP = "show where each module goes (plan), bytes per device, and rules that matched nothing"


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--all", action="store_true", help="list every module, also those that inherit their device")
    p.add_argument("--check-devices", action="store_true", help="fail (or use fallbacks) for absent devices")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args) -> int:
    from . import console
    from ..rules.plan import DTYPES, plan
    from ..weights import load_config
    path = model_path(args.model)
    quiet = console if not args.json else _Null()
    rules = pick_rules(args.rules, path, quiet, args.config_dir)
    config = load_config(path, args.config_dir)
    source = _gguf_source(path, config)
    try:
        p = plan(config, rules, dtype=DTYPES.get(args.dtype or ""), check_devices=args.check_devices,
                 stored=source.stored if source is not None else None)
    finally:
        if source is not None:
            source.close()
    if args.json:
        console.out(p.to_json(indent=1), highlight=False)
        return 0
    subtree = _subtree_bytes(p)
    table = Table(title=escape(f"plan for {path}"), show_edge=False, pad_edge=False)
    for col, kw in (("module", {"overflow": "fold"}), ("class", {"overflow": "fold"}), ("rule", {"overflow": "fold"}),
                    ("op", {}), ("device", {}), ("dtype", {}), ("bytes", {"justify": "right", "no_wrap": True})):
        table.add_column(col, **kw)
    for e in p.entries:
        if not (args.all or e.rule):
            continue
        op = e.op if e.prefill_op == e.op else f"{e.prefill_op} / {e.op}"
        dev = e.device if e.prefill_device == e.device else f"{e.prefill_device} / {e.device}"
        if e.fallback:
            dev += f" [yellow](fallback: {e.fallback})[/]"
        rule = escape(e.rule.rsplit('/', 1)[-1]) if e.rule else "[dim]inherited[/]"
        table.add_row(e.name or "(root)", e.cls, rule, op, dev, e.dtype, human_bytes(subtree[e.name]))
    console.print(table)
    totals = Table(title="bytes per device", show_edge=False, pad_edge=False)
    totals.add_column("device")
    totals.add_column("bytes", justify="right")
    for dev, n in sorted(p.totals.items()):
        totals.add_row(dev, human_bytes(n))
    console.print(totals)
    crossings = p.boundaries
    if crossings:
        console.print(f"device boundaries along the layers ({len(crossings)}; hidden states, positions and "
                      "masks cross each once per forward):")
        for b in crossings:
            console.print(f"  {b}", highlight=False)
    if p.overridden_rules:
        console.print("[dim]rules overridden by earlier rules (every module they match was taken first):[/]")
        for r in p.overridden_rules:
            console.print(f"  [dim]{escape(str(r))}[/]", highlight=False)
    if p.unmatched_rules:
        console.print("[yellow]rules that matched nothing:[/]")
        for r in p.unmatched_rules:
            console.print(f"  {escape(str(r))}", highlight=False)
    else:
        console.print("[green]every rule matched at least one module[/]")
    return 0


def _gguf_source(path, config):
    """A GGUF model's source (its header: the bytes the operators that keep the file's blocks will map);
    None for other formats, where the plan counts those operators' upper bounds."""
    from ..weights import detect_format, open_source
    return open_source(path, config) if detect_format(path).name == "gguf" else None


def _subtree_bytes(p) -> dict[str, int]:
    """Bytes of each entry's subtree (its own plus its planned descendants')."""
    out = {e.name: 0 for e in p.entries}
    for e in p.entries:
        n = sum(e.bytes.values())
        parts = e.name.split(".") if e.name else []
        for i in range(len(parts) + 1):
            key = ".".join(parts[:i])
            if key in out:
                out[key] += n
    return out


class _Null:
    def print(self, *a, **k):
        pass
