"""The `KTINJECT_*` environment settings, checked before native code reads them.

Native code reads its settings with getenv and takes what it finds: a switch read as `s[0] == '0'` takes
`false` or `off` for on, and a count out of range falls back to its default without a word. So the Python
side checks every `KTINJECT_*` variable in the environment when a pool or an experts kernel is made
(`check_env`): a value a setting does not take is a NativeError that names the variable and what it
takes, and a name that is no setting (a typo, say) is a warning naming the closest setting, once per
name. The settings and what they do: docs/native.md ("Environment variables").
"""
from __future__ import annotations

import difflib
import os
import re
import warnings
from typing import Mapping, Optional

from ..errors import NativeError

# name: ("switch",) 0 or 1 | ("int", lo, hi) | ("choice", value, ...) | ("any",); "" counts as unset for a
# switch or a choice (native code reads an empty value as the default), not for a number
KNOBS: dict[str, tuple] = {
    "KTINJECT_ISA": ("choice", "scalar", "avx2", "avx512", "amx"),
    "KTINJECT_THREADS": ("int", -4096, 4096),
    "KTINJECT_HOME": ("any",),
    "KTINJECT_TILE_MIN": ("int", 1, 1 << 30),
    "KTINJECT_PREFETCH": ("int", 0, 3),
    "KTINJECT_MULTIROW": ("switch",),
    "KTINJECT_VNNI_GROUPED": ("switch",),
    "KTINJECT_PACKED_F32": ("switch",),
    "KTINJECT_AMX_PREFETCH_NEXT": ("switch",),
    "KTINJECT_AMX_BF16_IN_PLACE": ("switch",),
    "KTINJECT_SPIN_US": ("int", 0, 10_000_000),
    "KTINJECT_SPIN_PAUSE": ("switch",),
    "KTINJECT_STREAM_ORDERED": ("switch",),
    "KTINJECT_POOL_CLAIM": ("int", 1, 64),
    "KTINJECT_POOL_TRACE": ("switch",),
    "KTINJECT_AMX_GU_CLAIM": ("int", 0, 64),
    "KTINJECT_AMX_INT8": ("switch",),
    "KTINJECT_AMX_BF16_TILES": ("choice", "0", "1", "down"),
    "KTINJECT_AVX512_BF16_GROUPED": ("switch",),
    "KTINJECT_AMX_I8_PREFETCH": ("int", 0, 32),
    "KTINJECT_AMX_I8_OVERLAP": ("switch",),
    "KTINJECT_AMX_I4_AHEAD": ("int", 0, 8),
    "KTINJECT_AMX_TRIPLE": ("switch",),
    "KTINJECT_AMX_GROUP_MAJOR": ("switch",),
    "KTINJECT_AMX_PF_L2": ("switch",),
    "KTINJECT_AMX_ROWS_PF": ("int", 0, 32),
    "KTINJECT_DOWN_ACC": ("switch",),
    "KTINJECT_DOWN_SPLIT": ("choice", "1", "2"),
    "KTINJECT_DOWN_CHUNKS": ("int", 1, 8),
    "KTINJECT_PACK_PREFETCH": ("switch",),
    "KTINJECT_PACK_ONCE": ("switch",),
    "KTINJECT_PACK_NT": ("switch",),
    "KTINJECT_AMX_FUSE_H": ("switch",),
    "KTINJECT_LINEAR_GROUPED_MIN": ("int", 0, 1 << 30),
    "KTINJECT_PROBE_PATTERN": ("choice", "0", "1", "2"),
    "KTINJECT_REPACK": ("choice", "0", "1", "auto"),
    "KTINJECT_R16_PF": ("int", 0, 65536),
    "KTINJECT_R16_PF_L2": ("switch",),
    "KTINJECT_R16_SPLIT": ("int", 1, 4),
    "KTINJECT_R16_HUGE": ("switch",),
    "KTINJECT_HOSTJOB_SIGNAL": ("choice", "auto", "bell", "hostfn"),
    "KTINJECT_HOSTJOB_ZEROCOPY": ("switch",),
    "KTINJECT_HOSTJOB_SKIP": ("choice", "0", "1", "2"),
    "KTINJECT_KQUANT": ("choice", "native", "torch"),
    "KTINJECT_INT4_CUDA": ("switch",),
    "KTINJECT_INT4_PDL": ("choice", "off", "sum", "auto", "all", "0"),
}

_INT = re.compile(r"[+-]?[0-9]+")
_warned: set[str] = set()


def problem(name: str, value: str) -> Optional[str]:
    """What is wrong with `value` for the setting `name` (None: nothing, or no such setting)."""
    spec = KNOBS.get(name)
    if spec is None:
        return None
    kind, v = spec[0], value   # as given: native code reads " 0" as on (its first character is no '0')
    if kind == "any":
        return None
    if kind == "switch":
        return None if v in ("", "0", "1") else "a switch: 0 (off) or 1 (on)"
    if kind == "choice":
        return None if v.lower() in ("",) + spec[1:] else "one of " + ", ".join(spec[1:])
    lo, hi = spec[1], spec[2]
    if not _INT.fullmatch(v) or not lo <= int(v) <= hi:
        return f"an integer {lo}-{hi}"
    return None


def survey(environ: Optional[Mapping[str, str]] = None) -> list[tuple[str, str, Optional[str], bool]]:
    """(name, value, what is wrong or None, known) for every `KTINJECT_*` variable of the environment; for a name
    that is no setting, what is wrong says so, with the closest setting."""
    environ = os.environ if environ is None else environ
    out = []
    for name in sorted(k for k in environ if k.startswith("KTINJECT_")):
        if name in KNOBS:
            out.append((name, environ[name], problem(name, environ[name]), True))
        else:
            close = difflib.get_close_matches(name, KNOBS, n=1)
            out.append((name, environ[name], "not a ktinject setting, so nothing reads it"
                        + (f" (did you mean ${close[0]}?)" if close else ""), False))
    return out


def check_env(environ: Optional[Mapping[str, str]] = None) -> None:
    """Every `KTINJECT_*` variable of the environment: a NativeError for values their settings do not take
    (all of them in one message), a warning (once) for names that are no setting."""
    bad = []
    for name, value, why, known in survey(environ):
        if why and not known:
            if name not in _warned:
                _warned.add(name)
                warnings.warn(f"${name} is {why}", stacklevel=3)
        elif why:
            bad.append(f"${name}={value!r}: takes {why}")
    if bad:
        raise NativeError("; ".join(bad) + " (docs/native.md, Environment variables)")
