"""One registry of operators: YAML `op` names -> Operator classes.

Built-in operators register with the `@register("name")` decorator when their module is
imported; operators from other installed packages arrive through the entry-point group
`ktinject.operators` (the package's module is imported, and registers itself). A rule file
never names an import path: only registry keys.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import typing
from importlib.metadata import entry_points
from typing import Any, Mapping, Optional

from ..errors import RuleError, UnknownOperatorError
from .base import Operator

log = logging.getLogger(__name__)

# Name used for "leave the original module in place, only place it on a device".
KEEP = "keep"

_REGISTRY: dict[str, type[Operator]] = {}
_LOADED = False

# Modules of built-in operators. Each must import on any machine (no CUDA, no compiler):
# optional back-ends (Triton, the native library) are imported lazily inside the operator.
BUILTIN_MODULES = (
    "ktinject.operators.linear",
    "ktinject.operators.experts",
    "ktinject.operators.cpu_experts",
    "ktinject.operators.cpu_embedding",
    "ktinject.operators.cpu_linear",
    "ktinject.operators.moe",
    "ktinject.operators.linear_int4",
    "ktinject.operators.linear_fp8",
    "ktinject.operators.mla_attention",
    "ktinject.operators.gpu_experts",
    "ktinject.operators.streamed_experts",
    "ktinject.operators.norm",
)


def register(name: str):
    """Class decorator: register an Operator subclass under `name`."""

    def wrap(cls: type[Operator]) -> type[Operator]:
        if not (isinstance(cls, type) and issubclass(cls, Operator)):
            raise TypeError(f"@register({name!r}) must decorate an Operator subclass, got {cls!r}")
        if name == KEEP or name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"operator name {name!r} is already registered")
        if not (dataclasses.is_dataclass(cls.Options) and cls.Options.__dataclass_params__.frozen):
            raise TypeError(f"{cls.__name__}.Options must be a frozen dataclass")
        cls.op_name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def _ensure_loaded() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for mod in BUILTIN_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:      # a real import error inside an existing module
                raise
            log.debug("built-in operator module %s is not present", mod)
    for ep in entry_points(group="ktinject.operators"):
        try:
            ep.load()
        except Exception as exc:  # a broken plugin must not break every load
            log.warning("operator plugin %s (%s) failed to load: %s", ep.name, ep.value, exc)


def names() -> list[str]:
    """Sorted list of every valid `op` value, `keep` included."""
    _ensure_loaded()
    return sorted([KEEP, *_REGISTRY])


def get(name: str, *, file: Optional[str] = None, line: Optional[int] = None,
        key: str = "op") -> Optional[type[Operator]]:
    """The operator class for `name`; None for `keep`. Unknown names raise with the valid list."""
    _ensure_loaded()
    if name == KEEP:
        return None
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownOperatorError(f"unknown operator {name!r}", file=file, line=line, key=key,
                                   allowed=names()) from None


def _check_type(value: Any, annotation: Any) -> bool:
    """Loose structural check of a YAML value against a dataclass field annotation."""
    if isinstance(annotation, str):  # postponed annotations: resolve the common spellings
        annotation = {"int": int, "float": float, "str": str, "bool": bool}.get(annotation, Any)
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or str(origin) == "types.UnionType":
        return any(_check_type(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, dict)
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def make_options(op: Optional[type[Operator]], kwargs: Mapping[str, Any], *, file: Optional[str] = None,
                 line: Optional[int] = None, op_name: str = KEEP) -> Any:
    """Validate a rule's kwargs against the operator's Options dataclass and build it."""
    if op is None:
        if kwargs:
            raise RuleError(f"operator '{op_name}' takes no kwargs", file=file, line=line,
                            key=f"kwargs.{next(iter(kwargs))}", allowed=[])
        return None
    fields = {f.name: f for f in dataclasses.fields(op.Options)}
    hints = typing.get_type_hints(op.Options) if fields else {}
    for key, value in kwargs.items():
        if key not in fields:
            raise RuleError(f"unknown kwarg for operator '{op.op_name}'", file=file, line=line,
                            key=f"kwargs.{key}", allowed=list(fields))
        if not _check_type(value, hints.get(key, Any)):
            raise RuleError(f"value {value!r} has the wrong type for operator '{op.op_name}', "
                            f"expected {hints.get(key)}", file=file, line=line, key=f"kwargs.{key}")
    try:
        return op.Options(**kwargs)
    except (ValueError, TypeError) as exc:
        raise RuleError(f"invalid kwargs for operator '{op.op_name}': {exc}", file=file, line=line,
                        key="kwargs") from None
