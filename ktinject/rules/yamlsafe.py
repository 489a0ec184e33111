"""Read an untrusted YAML file into plain Python values that remember their line numbers.

Budgets are checked on the event stream before any node tree is built, so neither a huge
file, a deep nesting nor a "billion laughs" alias bomb can exhaust memory or the stack:

* the file is at most `MAX_BYTES`;
* nesting depth (also with aliases expanded) is at most `MAX_DEPTH`, aliases at most `MAX_ALIASES`;
* the expanded tree (aliases counted at every use) has at most `MAX_NODES` nodes.

Only the YAML core tags are accepted (`!!python/...` or any custom tag is an error), and
scalars are built by PyYAML's `SafeConstructor`: nothing is ever imported or called.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import RuleError

MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_ALIASES = 64
MAX_NODES = 100_000

_CORE = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_CORE + t for t in ("str", "int", "float", "bool", "null")}
_ALLOWED = ["!!bool", "!!float", "!!int", "!!map", "!!null", "!!seq", "!!str"]


def _tag_error(tag: str, file: str, line: int) -> RuleError:
    shown = tag.replace(_CORE, "!!")
    return RuleError(f"YAML tag {shown!r} is not allowed (rule files hold plain data; nothing is ever "
                     "constructed or imported)", file=file, line=line, allowed=_ALLOWED)


class LDict(dict):
    """A mapping from YAML that remembers its own line and each key's line (1-based)."""
    line: int = 0
    key_lines: dict


class LList(list):
    """A sequence from YAML that remembers its own line and each item's line (1-based)."""
    line: int = 0
    item_lines: list


def read_yaml(path: Path) -> Any:
    """Parse `path` (untrusted) into LDict / LList / scalars. Raises RuleError naming the file/line."""
    file = str(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise RuleError(f"cannot read rule file: {exc.strerror or exc}", file=file) from None
    if size > MAX_BYTES:
        raise RuleError(f"rule file is {size} bytes, more than the limit of {MAX_BYTES}", file=file)
    try:
        text = path.read_bytes()[:MAX_BYTES + 1].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RuleError(f"rule file is not UTF-8 text ({exc.reason} at byte {exc.start})", file=file) from None
    _check_events(text, file)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, file) from None
    if node is None:
        raise RuleError("rule file is empty", file=file, line=1)
    budget = [MAX_NODES]
    return _convert(node, file, budget, yaml.SafeLoader(""))


def _yaml_error(exc: yaml.YAMLError, file: str) -> RuleError:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    return RuleError(f"not valid YAML: {problem}", file=file, line=mark.line + 1 if mark else None)


def _check_events(text: str, file: str) -> None:
    depth = aliases = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            line = event.start_mark.line + 1
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    raise RuleError(f"nesting deeper than {MAX_DEPTH} levels", file=file, line=line)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
            elif isinstance(event, yaml.AliasEvent):
                aliases += 1
                if aliases > MAX_ALIASES:
                    raise RuleError(f"more than {MAX_ALIASES} aliases", file=file, line=line)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, file) from None


def _convert(node: yaml.Node, file: str, budget: list, loader: yaml.SafeLoader, depth: int = 0) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        raise RuleError(f"rule file expands to more than {MAX_NODES} values (alias bomb?)", file=file,
                        line=node.start_mark.line + 1)
    line = node.start_mark.line + 1
    if depth > MAX_DEPTH:          # only through aliases: _check_events bounds the written nesting
        raise RuleError(f"nesting deeper than {MAX_DEPTH} levels once aliases are expanded (an anchor used "
                        "inside itself?)", file=file, line=line)
    if isinstance(node, yaml.MappingNode):
        if node.tag != _CORE + "map":
            raise _tag_error(node.tag, file, line)
        out = LDict()
        out.line, out.key_lines = line, {}
        for knode, vnode in node.value:
            if knode.tag == _CORE + "merge":
                raise RuleError("YAML merge keys ('<<') are not allowed", file=file, line=knode.start_mark.line + 1)
            key = _convert(knode, file, budget, loader, depth + 1)
            if not isinstance(key, (str, int, float, bool)) or key is None:
                raise RuleError("mapping keys must be plain scalars", file=file, line=knode.start_mark.line + 1)
            if key in out:
                raise RuleError("duplicate key", file=file, line=knode.start_mark.line + 1, key=str(key))
            out[key] = _convert(vnode, file, budget, loader, depth + 1)
            out.key_lines[key] = knode.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        if node.tag != _CORE + "seq":
            raise _tag_error(node.tag, file, line)
        out = LList()
        out.line, out.item_lines = line, []
        for item in node.value:
            out.append(_convert(item, file, budget, loader, depth + 1))
            out.item_lines.append(item.start_mark.line + 1)
        return out
    if node.tag not in _SCALAR_TAGS:
        raise _tag_error(node.tag, file, line)
    try:
        value = loader.construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, file) from None
    except ValueError:               # an integer of more digits than Python converts (4300)
        raise RuleError(f"number {node.value[:16]}... is too long ({len(node.value)} characters)", file=file,
                        line=line) from None
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RuleError(f"string {value!r} holds a lone surrogate escape (not text)", file=file,
                            line=line) from None
    return value
