"""Rule files -> a frozen `RuleSet`.

Each file is read with the safe YAML reader (`yamlsafe`), checked against the shipped JSON
schema (`schema.json`), then every rule becomes a frozen `Rule`: its regex compiled through
the guard in `match.py`, its op looked up in the registry, its kwargs validated against the
operator's Options dataclass.  Every error names the file, the line, the key and what is allowed.

Composition (see docs/rules.md): a file's own rules come first, then the rules of each
included file in order; its `defaults` override the included files' defaults; its `remap`
rewrites the devices of everything it composed (own rules and included ones).
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import jsonschema

from ..errors import PlacementError, RuleError
from ..operators import registry
from .match import compile_pattern
from .model import PhaseChoice, Rule, RuleSet, freeze, remap_device
from .yamlsafe import LDict, LList, read_yaml

PathLike = Union[str, Path]
MAX_INCLUDE_DEPTH = 16


# ---------------------------------------------------------------- shipped packs

def packs_dir() -> Path:
    return Path(str(resources.files("ktinject") / "packs"))


def pack_names() -> list[str]:
    return sorted(p.stem for p in packs_dir().glob("*.yaml"))


def resolve(ref: str, base: Optional[Path] = None, *, file: Optional[str] = None,
            line: Optional[int] = None, key: Optional[str] = "include") -> Path:
    """A path (has a '/' or ends in .yaml/.yml, relative to `base`) or the name of a shipped pack."""
    def is_file(p: Path) -> bool:
        try:
            if p.is_dir():
                raise RuleError(f"{ref!r} is a directory, not a rule file", file=file, line=line, key=key)
            return p.is_file()
        except OSError as exc:                      # e.g. a name too long for the file system
            raise RuleError(f"rule file {ref!r} cannot be read: {exc.strerror or exc}", file=file, line=line,
                            key=key) from None

    looks_like_path = "/" in ref or "\\" in ref or ref.endswith((".yaml", ".yml"))
    if looks_like_path:
        try:
            p = Path(ref).expanduser()
        except RuntimeError as exc:                 # '~user/...' of an unknown user
            raise RuleError(f"rule file {ref!r}: {exc}", file=file, line=line, key=key) from None
        if not p.is_absolute() and base is not None:
            p = base / p
        if not is_file(p):
            raise RuleError(f"rule file {ref!r} not found", file=file, line=line, key=key)
        return p.resolve()
    pack = packs_dir() / f"{ref}.yaml"
    if is_file(pack):
        return pack.resolve()
    local = (base or Path.cwd()) / ref
    if is_file(local):
        return local.resolve()
    raise RuleError(f"{ref!r} is neither a rule file nor a shipped pack", file=file, line=line, key=key,
                    allowed=pack_names())


def load_rules(paths_or_pack_names: Union[PathLike, Iterable[PathLike], RuleSet]) -> RuleSet:
    """Read rule files (paths or shipped pack names; earlier ones win) into one `RuleSet`."""
    if isinstance(paths_or_pack_names, RuleSet):
        return paths_or_pack_names
    refs = [paths_or_pack_names] if isinstance(paths_or_pack_names, (str, Path)) else list(paths_or_pack_names)
    if not refs:
        raise RuleError("no rule files given")
    parts = [_load_file(resolve(str(r), key=None), ()) for r in refs]
    return _compose(RuleSet(), parts)


# ---------------------------------------------------------------- one file

@lru_cache(maxsize=1)
def _schema() -> dict:
    return json.loads((Path(__file__).with_name("schema.json")).read_text())


def _load_file(path: Path, chain: tuple[Path, ...]) -> RuleSet:
    file = str(path)
    data = read_yaml(path)
    if not isinstance(data, LDict):
        raise RuleError("a rule file must be a mapping with 'version: 1' and 'rules:'", file=file, line=1)
    _validate_schema(data, file)

    includes: list[RuleSet] = []
    inc = data.get("include", LList())
    for i, ref in enumerate(inc):
        line = inc.item_lines[i]
        target = resolve(ref, path.parent, file=file, line=line)
        if target in chain or target == path:
            names = " -> ".join(p.name for p in (*chain, path, target))
            raise RuleError(f"include cycle: {names}", file=file, line=line, key="include")
        if len(chain) >= MAX_INCLUDE_DEPTH:
            raise RuleError(f"includes nested deeper than {MAX_INCLUDE_DEPTH}", file=file, line=line, key="include")
        includes.append(_load_file(target, (*chain, path)))

    defaults = data.get("defaults", LDict())
    own_rules = tuple(_rule(r, file, data["rules"].item_lines[i], f"rules[{i}]")
                      for i, r in enumerate(data.get("rules", LList())))
    own = RuleSet(own_rules, defaults.get("device"), defaults.get("dtype"), (file,))
    out = _compose(own, includes)
    remap = data.get("remap")
    if remap:
        out = RuleSet(tuple(r.remapped(remap) for r in out.rules), remap_device(out.default_device, remap),
                      out.default_dtype, out.files)
    return out


def _compose(own: RuleSet, includes: list[RuleSet]) -> RuleSet:
    rules, files = list(own.rules), list(own.files)
    device, dtype = own.default_device, own.default_dtype
    for inc in includes:
        rules.extend(inc.rules)
        files.extend(f for f in inc.files if f not in files)
        device = device or inc.default_device
        dtype = dtype or inc.default_dtype
    return RuleSet(tuple(rules), device, dtype, tuple(files))


# ---------------------------------------------------------------- schema errors -> file:line:key

def _pattern_to_the_end(validator, pattern: str, instance: Any, schema: dict):
    """JSON Schema's `pattern` keyword with ECMA-262's `$`: the end of the string. Python's `$` also
    matches before a final newline, so `device: "cuda:0\\n"` passed `^(cpu|cuda(:[0-9]{1,3})?)$`."""
    if not validator.is_type(instance, "string"):
        return
    rx = pattern[:-1] + r"\Z" if pattern.endswith("$") and not pattern.endswith(r"\$") else pattern
    if not re.search(rx, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"pattern": _pattern_to_the_end})


def _validate_schema(data: LDict, file: str) -> None:
    validator = _Validator(_schema())
    errors = list(validator.iter_errors(data))
    if not errors:
        return
    # report the first problem in file order (the deepest one on that line)
    err = min(errors, key=lambda e: (_locate(data, list(e.absolute_path))[1], -len(e.absolute_path)))
    raise _schema_error(err, data, file)


def _locate(data: Any, path: list) -> tuple[Any, int, Optional[str]]:
    """Walk `path` into the located tree: (node, line, dotted key)."""
    node, line, keys = data, getattr(data, "line", 1), []
    for step in path:
        if isinstance(node, LDict):
            line = node.key_lines.get(step, line)
            keys.append(str(step))
        elif isinstance(node, LList):
            line = node.item_lines[step] if step < len(node.item_lines) else line
            keys.append(f"[{step}]")
        node = node[step]
    dotted = ".".join(keys).replace(".[", "[") or None
    return node, line, dotted


def _schema_error(err: jsonschema.ValidationError, data: LDict, file: str) -> RuleError:
    path = list(err.absolute_path)
    node, line, key = _locate(data, path)
    schema, kind = err.schema, err.validator
    if kind == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        extra = sorted(str(k) for k in node if k not in allowed)
        bad = extra[0] if extra else "?"
        line = node.key_lines.get(bad, line) if isinstance(node, LDict) else line
        return RuleError("unknown key", file=file, line=line, key=_join(key, bad), allowed=allowed)
    if kind == "required":
        missing = [k for k in err.validator_value if k not in node]
        return RuleError(f"missing required key '{missing[0] if missing else '?'}'", file=file, line=line,
                         key=key, allowed=sorted(schema.get("properties", {})))
    if kind in ("enum", "const"):
        allowed = err.validator_value if kind == "enum" else [err.validator_value]
        return RuleError(f"invalid value {err.instance!r}", file=file, line=line, key=key,
                         allowed=[str(a) for a in allowed])
    if kind == "pattern":
        what = _PATTERN_HINTS.get(schema.get("pattern"), f"a string matching {schema.get('pattern')!r}")
        return RuleError(f"invalid value {err.instance!r}: expected {what}", file=file, line=line, key=key)
    if kind == "propertyNames":
        return RuleError(f"invalid key: {err.message}", file=file, line=line, key=key)
    if kind == "minProperties":
        return RuleError("must not be empty", file=file, line=line, key=key,
                         allowed=sorted(schema.get("properties", {})) or None)
    if kind == "type":
        return RuleError(f"expected {_type_words(err.validator_value)}, got {type(err.instance).__name__}",
                         file=file, line=line, key=key)
    limit = err.validator_value
    if kind in ("maxItems", "minItems", "maxProperties"):
        what = "keys" if kind == "maxProperties" else "items"
        return RuleError(f"{len(err.instance)} {what}, {'at most' if kind.startswith('max') else 'at least'} {limit} "
                         f"allowed", file=file, line=line, key=key)
    if kind == "minLength" and limit == 1:
        return RuleError("must not be empty", file=file, line=line, key=key)
    if kind in ("maxLength", "minLength"):
        return RuleError(f"a string of {len(err.instance)} characters, {'at most' if kind == 'maxLength' else 'at least'}"
                         f" {limit} allowed", file=file, line=line, key=key)
    if kind in ("oneOf", "anyOf"):
        inner = [e for e in err.context if e.validator != "type" or e.relative_path]
        if inner:                          # the value has one alternative's type: what is wrong inside it
            return _schema_error(jsonschema.exceptions.best_match(inner), data, file)
        types = []
        for sub in limit:
            if "$ref" in sub:
                sub = _schema()["$defs"].get(sub["$ref"].rsplit("/", 1)[-1], sub)
            t = sub.get("type")
            types += t if isinstance(t, list) else [t] if t else []
        return RuleError(f"invalid value {_short(err.instance)}: expected {_type_words(list(dict.fromkeys(types)))}",
                         file=file, line=line, key=key)
    return RuleError(err.message, file=file, line=line, key=key)


def _short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."


_PATTERN_HINTS = {
    "^(cpu|cuda(:[0-9]{1,3})?)$": "a device: cpu, cuda or cuda:N",
    "^[a-z][a-z0-9_]{0,63}$": "an operator name (lower case letters, digits, '_'; never an import path)",
    "^[A-Za-z_][A-Za-z0-9_.]{0,255}$": "a class name or qualified class name",
}


def _type_words(t) -> str:
    words = {"object": "a mapping", "array": "a list", "string": "a string", "boolean": "true or false",
             "integer": "an integer", "number": "a number"}
    if isinstance(t, list):
        return " or ".join(words.get(x, x) for x in t)
    return words.get(t, t)


def _join(prefix: Optional[str], key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


# ---------------------------------------------------------------- one rule

def _rule(raw: LDict, file: str, line: int, where: str) -> Rule:
    match, rep = raw["match"], raw["replace"]

    def at(mapping: LDict, key: str) -> int:
        return mapping.key_lines.get(key, line)

    pattern = None
    if "name" in match:
        pattern = compile_pattern(match["name"], file=file, line=at(match, "name"), key=f"{where}.match.name")
    classes = match.get("class", ())
    classes = (classes,) if isinstance(classes, str) else tuple(classes)

    choices = {}
    for phase in ("prefill", "generate"):
        op_key = f"{phase}_op" if f"{phase}_op" in rep else "op"
        op_name = rep.get(op_key, registry.KEEP)
        op_line = at(rep, op_key)
        op_cls = registry.get(op_name, file=file, line=op_line, key=f"{where}.replace.{op_key}")
        kw_key = f"{phase}_kwargs" if f"{phase}_kwargs" in rep else "kwargs"
        kwargs = dict(rep.get(kw_key, {}))
        options = _options(op_cls, op_name, rep.get(kw_key, LDict()), file, at(rep, kw_key), f"{where}.replace.",
                           kw_key)
        device = rep.get(f"{phase}_device", rep.get("device"))
        choices[phase] = PhaseChoice(op_name, options, device, freeze(kwargs))
        if op_cls is not None and device is not None and device.split(":")[0] not in op_cls.device_types:
            dev_key = f"{phase}_device" if f"{phase}_device" in rep else "device"
            fb = rep.get("fallback_device")
            if fb is None or fb.split(":")[0] not in op_cls.device_types:
                raise PlacementError(f"{file}:{at(rep, dev_key)}: key '{where}.replace.{dev_key}': operator "
                                     f"'{op_name}' cannot run on {device} (allowed: "
                                     f"{', '.join(sorted(op_cls.device_types))}; or add a fallback_device)")
    return Rule(file=file, line=line, name=match.get("name"), classes=classes, prefill=choices["prefill"],
                generate=choices["generate"], dtype=rep.get("dtype"), fallback_device=rep.get("fallback_device"),
                recursive=bool(raw.get("recursive", True)), pattern=pattern)


def _options(op_cls, op_name: str, kwargs: LDict, file: str, line: int, prefix: str, kw_key: str) -> Any:
    try:
        return registry.make_options(op_cls, dict(kwargs), file=file, line=line, op_name=op_name)
    except RuleError as exc:
        key = exc.key or "kwargs"
        if key.startswith("kwargs"):
            name = key[len("kwargs."):]
            line = getattr(kwargs, "key_lines", {}).get(name, line)     # the offending kwarg's own line
            key = kw_key + key[len("kwargs"):]
        raise RuleError(_bare(exc), file=file, line=line, key=prefix + key, allowed=exc.allowed) from None


def _bare(exc: RuleError) -> str:
    """The message of a RuleError without its file/line/key prefix and allowed suffix."""
    text = str(exc)
    if exc.key:
        text = text.split(f"key '{exc.key}': ", 1)[-1]
    if exc.allowed is not None:
        text = text.rsplit(" (allowed: ", 1)[0]
    return text
