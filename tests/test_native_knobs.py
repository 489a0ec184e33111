"""The KTINJECT_* settings: every one native code reads is registered and documented, and a value a setting
does not take is refused by name before native code could misread it (ktinject/native/knobs.py)."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from ktinject import native
from ktinject.errors import NativeError
from ktinject.native import knobs

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not native.available(), reason="native extension not built")


def _read_in(paths) -> set[str]:
    names = set()
    for p in paths:
        names |= set(re.findall(r'"(KTINJECT_[A-Z0-9_]+)"', p.read_text()))
    return names


def test_every_setting_read_is_registered_and_documented():
    read = _read_in(sorted((ROOT / "native").glob("*.c")) + sorted((ROOT / "ktinject").rglob("*.py")))
    assert read - set(knobs.KNOBS) == set(), "read but not in knobs.KNOBS"
    docs = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    assert [k for k in knobs.KNOBS if k not in docs] == [], "registered but not documented"


@pytest.mark.parametrize("name,value", [("KTINJECT_PACK_ONCE", "off"), ("KTINJECT_AMX_TRIPLE", "true"),
                                        ("KTINJECT_AMX_I4_AHEAD", "9"), ("KTINJECT_TILE_MIN", "four"),
                                        ("KTINJECT_DOWN_SPLIT", "3"), ("KTINJECT_SPIN_US", ""),
                                        ("KTINJECT_PACK_ONCE", " 0")])
def test_bad_values_are_refused_by_name(name, value, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(NativeError, match=re.escape(f"${name}={value!r}: takes")):
        native.Pool(1, pin=False)


def test_a_bad_setting_stops_an_experts_kernel_too(monkeypatch):
    """ktk_moe_new reads the layer's settings: a kernel made on an existing pool is checked as well."""
    from test_native_util import moe_case
    from gguf import GGMLQuantizationType as QT
    (gate, up, down), _ = moe_case(QT.Q8_0, QT.Q8_0)
    pool = native.Pool(1, pin=False)
    monkeypatch.setenv("KTINJECT_AMX_GU_CLAIM", "65")
    monkeypatch.setenv("KTINJECT_PREFETCH", "-1")
    with pytest.raises(NativeError) as e:
        native.MoEKernel(gate, up, down, pool=pool)
    assert "$KTINJECT_AMX_GU_CLAIM='65': takes an integer 0-64" in str(e.value)
    assert "$KTINJECT_PREFETCH='-1': takes an integer 0-3" in str(e.value)


@pytest.mark.parametrize("name,value", [("KTINJECT_PACK_ONCE", "0"), ("KTINJECT_PACK_ONCE", ""),
                                        ("KTINJECT_DOWN_SPLIT", ""), ("KTINJECT_AMX_I4_AHEAD", "8"),
                                        ("KTINJECT_HOSTJOB_SIGNAL", "Bell"), ("KTINJECT_THREADS", "-2")])
def test_values_a_setting_takes_pass(name, value):
    knobs.check_env({name: value})


def test_an_unknown_name_is_a_warning_with_the_closest_setting():
    with pytest.warns(UserWarning, match=r"\$KTINJECT_AMX_TRIPEL .*did you mean \$KTINJECT_AMX_TRIPLE"):
        knobs.check_env({"KTINJECT_AMX_TRIPEL": "0"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # once per name
        knobs.check_env({"KTINJECT_AMX_TRIPEL": "0", "OTHER_TOOL_SETTING": "x"})


def test_doctor_lists_the_settings_and_what_is_wrong_with_them(monkeypatch):
    from ktinject.cli.doctor import _settings
    for k in [k for k in __import__("os").environ if k.startswith("KTINJECT_")]:
        monkeypatch.delenv(k)
    assert _settings() == "none set (every default)"
    monkeypatch.setenv("KTINJECT_PACK_ONCE", "0")
    monkeypatch.setenv("KTINJECT_AMX_I4_AHEAD", "12")
    monkeypatch.setenv("KTINJECT_AMX_TRIPEL", "1")
    row = _settings()
    assert "KTINJECT_PACK_ONCE=0" in row
    assert "KTINJECT_AMX_I4_AHEAD='12': takes an integer 0-8" in row
    assert "KTINJECT_AMX_TRIPEL: not a ktinject setting" in row and "$KTINJECT_AMX_TRIPLE" in row
