"""Matching modules against rules: regex `fullmatch` on the dotted name, class names along the MRO.

Regexes come from untrusted files, so they are compiled through `compile_pattern`, which
limits their length and refuses the shapes that backtrack exponentially (a repeat of
something that itself repeats without bound, e.g. `(a+)+`, `(.*)*`, `(x|x?)+`) and
back-references. Module names are short, so every accepted pattern matches in linear-ish time.
"""
from __future__ import annotations

import re
from typing import Optional

try:                                  # Python >= 3.11
    import re._parser as _sre_parse   # type: ignore[import-not-found]
    from re._constants import MAXREPEAT  # type: ignore[import-not-found]
except ImportError:                   # Python 3.10
    import sre_parse as _sre_parse    # type: ignore[no-redef]
    from sre_constants import MAXREPEAT  # type: ignore[no-redef]

from torch import nn

from ..errors import RuleError

MAX_PATTERN = 512
_REPEATS = {"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"}


def compile_pattern(pattern: str, *, file: Optional[str] = None, line: Optional[int] = None,
                    key: str = "match.name") -> re.Pattern:
    if len(pattern) > MAX_PATTERN:
        raise RuleError(f"regular expression longer than {MAX_PATTERN} characters", file=file, line=line, key=key)
    try:
        parsed = _sre_parse.parse(pattern)
    except (re.error, OverflowError) as exc:      # OverflowError: a repeat count like a{99999999999}
        raise RuleError(f"invalid regular expression {pattern!r}: {exc}", file=file, line=line, key=key) from None
    problem = _hazard(parsed.data if hasattr(parsed, "data") else list(parsed), inside_repeat=False)
    if problem:
        raise RuleError(f"regular expression {pattern!r} rejected: {problem} (it could backtrack for a very "
                        "long time)", file=file, line=line, key=key)
    return re.compile(pattern)


def _can_repeat(items) -> bool:
    """True when the sub-pattern contains an unbounded or alternative-bearing part."""
    for op, av in items:
        name = str(op)
        if name in _REPEATS:
            lo, hi, body = av
            if hi == MAXREPEAT or hi > 1 or _can_repeat(body):
                return True
        elif name == "SUBPATTERN":
            if _can_repeat(av[-1]):
                return True
        elif name == "BRANCH":
            return True
    return False


def _hazard(items, inside_repeat: bool) -> Optional[str]:
    for op, av in items:
        name = str(op)
        if name in ("GROUPREF", "GROUPREF_EXISTS"):
            return "back-references are not allowed"
        if name in ("ASSERT", "ASSERT_NOT"):
            return "look-around assertions are not allowed"
        if name in _REPEATS:
            lo, hi, body = av
            unbounded = hi == MAXREPEAT or hi > 16
            if (inside_repeat and unbounded) or (unbounded and _can_repeat(body)):
                return "nested quantifiers"
            problem = _hazard(body, inside_repeat or unbounded)
            if problem:
                return problem
        elif name == "SUBPATTERN":
            problem = _hazard(av[-1], inside_repeat)
            if problem:
                return problem
        elif name == "BRANCH":
            for alt in av[1]:
                problem = _hazard(alt, inside_repeat)
                if problem:
                    return problem
    return None


def class_names(module: nn.Module) -> list[str]:
    """Plain and qualified names of every class along the module's MRO (nothing is imported)."""
    out = []
    for klass in type(module).__mro__:
        out.append(klass.__name__)
        out.append(f"{klass.__module__}.{klass.__qualname__}")
    return out


def matches(rule, name: str, module_classes: list[str]) -> bool:
    """Does `rule` (a `Rule`) match the module called `name` whose MRO names are `module_classes`?"""
    if rule.pattern is not None and rule.pattern.fullmatch(name) is None:
        return False
    if rule.classes and not any(c in module_classes for c in rule.classes):
        return False
    return True
