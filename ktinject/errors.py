"""One small exception hierarchy. Every user-facing failure is a `KtInjectError`.

Each error carries enough context to be acted on without a traceback: the file, the
line, the key or tensor, and what would have been allowed.  The CLI prints `str(err)`
and exits non-zero; library callers can catch the specific subclass.
"""
from __future__ import annotations

from typing import Iterable, Optional


class KtInjectError(Exception):
    """Base class of every error ktinject raises on purpose."""


def _where(file: Optional[str], line: Optional[int]) -> str:
    if file and line:
        return f"{file}:{line}: "
    if file:
        return f"{file}: "
    return ""


class RuleError(KtInjectError):
    """A rule file is malformed: names the file, the line, the key and what is allowed."""

    def __init__(self, message: str, *, file: Optional[str] = None, line: Optional[int] = None,
                 key: Optional[str] = None, allowed: Optional[Iterable[str]] = None):
        self.file, self.line, self.key = file, line, key
        self.allowed = sorted(allowed) if allowed is not None else None
        text = _where(file, line)
        if key:
            text += f"key '{key}': "
        text += message
        if self.allowed is not None:
            text += f" (allowed: {', '.join(self.allowed) if self.allowed else 'none'})"
        super().__init__(text)


class UnknownOperatorError(RuleError):
    """An `op` names nothing in the operator registry."""


class WeightError(KtInjectError):
    """A weight file is unreadable, truncated, inconsistent or of an unsupported kind."""

    def __init__(self, message: str, *, file: Optional[str] = None, tensor: Optional[str] = None):
        self.file, self.tensor = file, tensor
        text = _where(file, None)
        if tensor:
            text += f"tensor '{tensor}': "
        super().__init__(text + message)


class UnsupportedQuantError(WeightError):
    """A GGML type that ktinject cannot handle (names the tensor and the type)."""


class LoadError(KtInjectError):
    """Strict loading failed: tensors missing, left over, or of the wrong shape."""

    def __init__(self, message: str, *, missing: Iterable[str] = (), unexpected: Iterable[str] = (),
                 mismatched: Iterable[str] = ()):
        self.missing, self.unexpected, self.mismatched = sorted(missing), sorted(unexpected), sorted(mismatched)
        parts = [message]
        for label, names in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("shape mismatch", self.mismatched)):
            if names:
                shown = names[:20]
                more = f" ... and {len(names) - 20} more" if len(names) > 20 else ""
                parts.append(f"{label} ({len(names)}): " + ", ".join(shown) + more)
        super().__init__("\n  ".join(parts))


class PlacementError(KtInjectError):
    """An operator cannot run where the plan placed it (and the rule asked for no fallback)."""


class NativeError(KtInjectError):
    """The native CPU library is missing, failed to build, or was called with bad arguments."""


class ModelError(KtInjectError):
    """The model architecture or configuration is not supported or is inconsistent."""


class GenerationError(KtInjectError):
    """A generation's arguments cannot be carried out (its caches do not fit, say)."""
