"""Rule files: every kind of mistake gives file, line, key and what is allowed; composition works."""
from __future__ import annotations

import textwrap
import time

import pytest

from ktinject.errors import PlacementError, RuleError, UnknownOperatorError
from ktinject.rules import load_rules, pack_names
from ktinject.rules.yamlsafe import MAX_BYTES


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text).lstrip("\n"))
    return p


def error_of(path) -> RuleError:
    with pytest.raises(RuleError) as info:
        load_rules(path)
    return info.value


GOOD = """
version: 1
defaults: {device: cpu, dtype: bfloat16}
rules:
  - match: {name: 'model\\.layers\\.\\d+\\.mlp\\.experts', class: [DeepseekV2Experts, MixtralExperts]}
    replace: {op: experts, device: cpu}
    recursive: false
  - match: {class: Linear}
    replace: {op: linear, dtype: float32}
"""


def test_good_file_becomes_frozen_rules(tmp_path):
    p = write(tmp_path, GOOD)
    rs = load_rules(p)
    assert rs.default_device == "cpu" and rs.default_dtype == "bfloat16"
    assert [r.line for r in rs] == [4, 7]
    r0, r1 = rs.rules
    assert r0.classes == ("DeepseekV2Experts", "MixtralExperts") and r0.recursive is False
    assert r0.op == "experts" and r0.generate.device == "cpu" and not r0.split
    assert r1.name is None and r1.dtype == "float32" and r1.recursive is True
    with pytest.raises(AttributeError):
        r0.line = 3  # frozen
    assert rs.files == (str(p.resolve()),)


@pytest.mark.parametrize("body, line, key, allowed_has", [
    # unknown op: names the sorted list of ops
    ("  - match: {name: x}\n    replace: {op: expertz}\n", 4, "rules[0].replace.op", "experts"),
    # unknown key inside replace
    ("  - match: {name: x}\n    replace: {op: linear, devcie: cpu}\n", 4, "rules[0].replace.devcie", "device"),
    # unknown key at rule level
    ("  - match: {name: x}\n    replace: {op: linear}\n    recursve: false\n", 5, "rules[0].recursve", "recursive"),
    # unknown key in match
    ("  - match: {nmae: x}\n    replace: {op: linear}\n", 3, "rules[0].match.nmae", "class"),
    # unknown kwarg of an operator
    ("  - match: {name: x}\n    replace:\n      op: linear\n      kwargs: {bits: 4}\n", 6,
     "rules[0].replace.kwargs.bits", None),
    # kwargs for keep
    ("  - match: {name: x}\n    replace:\n      device: cpu\n      kwargs: {a: 1}\n", 6,
     "rules[0].replace.kwargs.a", None),
    # unknown kwarg in a block mapping: the line of the kwarg itself
    ("  - match: {name: x}\n    replace:\n      op: linear\n      kwargs:\n        a: 1\n", 7,
     "rules[0].replace.kwargs.a", None),
    # bad dtype
    ("  - match: {name: x}\n    replace: {op: linear, dtype: fp8}\n", 4, "rules[0].replace.dtype", "bfloat16"),
    # missing replace
    ("  - match: {name: x}\n", 3, "rules[0]", "replace"),
])
def test_rule_mistakes_name_file_line_key(tmp_path, body, line, key, allowed_has):
    p = write(tmp_path, "version: 1\nrules:\n" + body)
    err = error_of(p)
    assert err.file == str(p.resolve()) and err.line == line and err.key == key, str(err)
    assert f"{p.resolve()}:{line}:" in str(err)
    if allowed_has:
        assert allowed_has in err.allowed and err.allowed == sorted(err.allowed)


def test_unknown_op_is_unknown_operator_error_with_sorted_names(tmp_path):
    p = write(tmp_path, "version: 1\nrules:\n  - match: {name: x}\n    replace: {op: nope}\n")
    with pytest.raises(UnknownOperatorError) as info:
        load_rules(p)
    assert {"experts", "keep", "linear"} <= set(info.value.allowed)
    assert "unknown operator 'nope'" in str(info.value)


@pytest.mark.parametrize("text, line, key", [
    ("version: 2\nrules: []\n", 1, "version"),
    ("rules: []\n", 1, None),
    ("version: 1\nrulez: []\n", 2, "rulez"),
    ("version: 1\ndefaults: {device: gpu}\n", 2, "defaults.device"),
    ("version: 1\nrules:\n  - match: {}\n    replace: {op: linear}\n", 3, "rules[0].match"),
    ("version: 1\nrules:\n  - match: {name: x}\n    replace: {op: linear, device: tpu}\n", 4,
     "rules[0].replace.device"),
    ("version: 1\nrules:\n  - match: {name: x}\n    replace: {op: linear}\n    recursive: maybe\n", 5,
     "rules[0].recursive"),
    ("version: 1\nrules: {a: 1}\n", 2, "rules"),
    ("version: 1\nremap: {cuda: gpu}\n", 2, "remap.cuda"),
])
def test_schema_errors_point_at_the_key(tmp_path, text, line, key):
    p = write(tmp_path, text)
    err = error_of(p)
    assert err.line == line and err.key == key, str(err)


def test_duplicate_keys_and_bad_yaml(tmp_path):
    err = error_of(write(tmp_path, "version: 1\nversion: 1\n"))
    assert err.line == 2 and err.key == "version" and "duplicate" in str(err)
    err = error_of(write(tmp_path, "version: 1\nrules: [\n", name="b.yaml"))
    assert "not valid YAML" in str(err) and err.line is not None
    err = error_of(write(tmp_path, "- 1\n- 2\n", name="c.yaml"))
    assert "mapping" in str(err)


def test_op_device_must_be_supported_by_the_operator(tmp_path, monkeypatch):
    from ktinject.operators import registry
    cls = registry.get("linear")
    monkeypatch.setattr(cls, "device_types", ("cuda",))
    p = write(tmp_path, "version: 1\nrules:\n  - match: {name: x}\n    replace: {op: linear, device: cpu}\n")
    with pytest.raises(PlacementError) as info:
        load_rules(p)
    assert f"{p.resolve()}:4: key 'rules[0].replace.device'" in str(info.value)
    assert "allowed: cuda" in str(info.value)
    ok = write(tmp_path, "version: 1\nrules:\n  - match: {name: x}\n    replace: {op: linear, device: cpu, "
                         "fallback_device: cuda}\n", name="ok.yaml")
    assert load_rules(ok).rules[0].fallback_device == "cuda"


# ------------------------------------------------------------------ composition

def test_include_order_defaults_and_remap(tmp_path):
    write(tmp_path, """
        version: 1
        defaults: {device: cuda, dtype: bfloat16}
        rules:
          - match: {name: a}
            replace: {op: linear, device: cuda:1}
          - match: {name: b}
            replace: {op: keep, prefill_device: cuda, generate_device: cpu}
        """, name="base.yaml")
    over = write(tmp_path, """
        version: 1
        include: [base.yaml]
        defaults: {dtype: float32}
        remap: {cuda: cpu}
        rules:
          - match: {name: c}
            replace: {op: linear}
        """, name="over.yaml")
    rs = load_rules(over)
    assert [r.name for r in rs] == ["c", "a", "b"]          # own rules first
    assert rs.default_device == "cpu" and rs.default_dtype == "float32"
    assert rs.rules[1].generate.device == "cpu"              # cuda:1 remapped through 'cuda'
    assert rs.rules[2].prefill.device == "cpu" and not rs.rules[2].split
    assert rs.rules[1].file.endswith("base.yaml") and rs.rules[1].line == 4
    assert len(rs.files) == 2


def test_list_of_files_earlier_wins(tmp_path):
    a = write(tmp_path, "version: 1\ndefaults: {device: cpu}\nrules:\n  - match: {name: a}\n    replace: {op: linear}\n",
              name="a.yaml")
    b = write(tmp_path, "version: 1\ndefaults: {device: cuda}\nrules:\n  - match: {name: b}\n    replace: {op: keep}\n",
              name="b.yaml")
    rs = load_rules([a, b])
    assert [r.name for r in rs] == ["a", "b"] and rs.default_device == "cpu"


def test_include_cycle_names_the_chain(tmp_path):
    write(tmp_path, "version: 1\ninclude: [b.yaml]\n", name="a.yaml")
    write(tmp_path, "version: 1\ninclude: [c.yaml]\n", name="b.yaml")
    write(tmp_path, "version: 1\ninclude: [a.yaml]\n", name="c.yaml")
    err = error_of(tmp_path / "a.yaml")
    assert "a.yaml -> b.yaml -> c.yaml -> a.yaml" in str(err) and err.key == "include" and err.line == 2
    write(tmp_path, "version: 1\ninclude: [self.yaml]\n", name="self.yaml")
    assert "cycle" in str(error_of(tmp_path / "self.yaml"))


def test_missing_include_and_unknown_pack(tmp_path):
    err = error_of(write(tmp_path, "version: 1\ninclude: [nothere.yaml]\n"))
    assert err.line == 2 and "not found" in str(err)
    err = error_of(write(tmp_path, "version: 1\ninclude: [no-such-pack]\n", name="x.yaml"))
    assert "deepseek-v2" in err.allowed
    with pytest.raises(RuleError):
        load_rules("no-such-pack")


def test_every_shipped_pack_validates():
    names = pack_names()
    for fam in ("deepseek-v2", "deepseek-v3", "qwen2-moe", "qwen3-moe", "mixtral"):
        assert fam in names and f"{fam}-cpu" in names
    for name in names:
        rs = load_rules(name)
        assert len(rs) > 0
        if name.endswith("-cpu"):
            devices = {c.device for r in rs for c in (r.prefill, r.generate)} | {rs.default_device}
            assert devices <= {"cpu", None}, name


# ------------------------------------------------------------------ hostile files

def test_python_tags_construct_nothing(tmp_path):
    marker = tmp_path / "pwned"
    for i, tag in enumerate(["!!python/object/apply:os.system", "!!python/name:os.system",
                             "!!python/object/new:os.system", "!custom"]):
        p = write(tmp_path, f"""
            version: 1
            rules:
              - match: {tag} ["touch {marker}"]
                replace: {{op: linear}}
            """, name=f"t{i}.yaml")
        err = error_of(p)
        assert "not allowed" in str(err) and err.line == 3
    assert not marker.exists()


def test_import_paths_as_op_names_are_refused(tmp_path):
    for i, op in enumerate(["os.system", "ktinject.operators.linear.TorchLinear", "__import__", "Linear"]):
        p = write(tmp_path, f"version: 1\nrules:\n  - match: {{name: x}}\n    replace: {{op: '{op}'}}\n",
                  name=f"o{i}.yaml")
        err = error_of(p)
        assert err.key == "rules[0].replace.op" and err.line == 4


def test_huge_file_is_refused_before_parsing(tmp_path):
    p = tmp_path / "huge.yaml"
    p.write_text("version: 1\n# " + "x" * MAX_BYTES + "\n")
    t = time.perf_counter()
    err = error_of(p)
    assert "limit" in str(err) and time.perf_counter() - t < 1


def test_billion_laughs_is_refused(tmp_path):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    p = tmp_path / "lol.yaml"
    p.write_text("\n".join(lines) + "\n")
    t = time.perf_counter()
    err = error_of(p)
    assert ("alias" in str(err)) and time.perf_counter() - t < 2


def test_deep_nesting_is_refused(tmp_path):
    p = tmp_path / "deep.yaml"
    p.write_text("version: 1\nrules: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nesting" in str(error_of(p))


def test_catastrophic_regex_is_refused_quickly(tmp_path):
    for i, rx in enumerate([r"(a+)+$", r"(.*)*x", r"(a|aa)+b", r"(\d+\.)+x", r"(a*)*", r"(x+x+)+y", r"(a)\1",
                            "a" * 600]):
        p = write(tmp_path, f"version: 1\nrules:\n  - match: {{name: '{rx}'}}\n    replace: {{op: linear}}\n",
                  name=f"re{i}.yaml")
        t = time.perf_counter()
        err = error_of(p)
        assert err.key == "rules[0].match.name" and err.line == 3 and time.perf_counter() - t < 1, rx


def test_invalid_regex(tmp_path):
    p = write(tmp_path, "version: 1\nrules:\n  - match: {name: 'model.(layers'}\n    replace: {op: linear}\n")
    err = error_of(p)
    assert "invalid regular expression" in str(err) and err.line == 3


def test_not_utf8(tmp_path):
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"version: 1\n\xff\xfe\n")
    assert "UTF-8" in str(error_of(p))


def test_self_referencing_anchor_huge_number_and_lone_surrogate(tmp_path):
    """Values PyYAML builds but Python cannot use: a RuleError naming the line, not a RecursionError,
    a ValueError or a UnicodeEncodeError later when the rule is printed."""
    p = write(tmp_path, "version: 1\nrules: &a [*a]\n", name="self.yaml")
    err = error_of(p)
    assert "nesting deeper" in str(err) and err.line == 2
    chain = ["version: 1", "x0: &a0 [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]"]
    chain += [f"x{i}: &a{i} [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[*a{i - 1}]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]" for i in range(1, 40)]
    p = tmp_path / "chain.yaml"
    p.write_text("\n".join(chain) + "\n")
    assert "nesting deeper" in str(error_of(p))
    p = write(tmp_path, "version: 1\nrules:\n  - match: {name: x}\n    replace: {op: cpu_experts, kwargs: {threads: "
              + "9" * 5000 + "}}\n", name="big.yaml")
    err = error_of(p)
    assert "too long (5000 characters)" in str(err) and err.line == 4
    p = write(tmp_path, 'version: 1\nrules:\n  - match: {name: "\\ud800"}\n    replace: {op: keep}\n', name="sur.yaml")
    err = error_of(p)
    assert "surrogate" in str(err) and err.line == 3


def test_regex_repeat_count_too_large(tmp_path):
    p = write(tmp_path, "version: 1\nrules:\n  - match: {name: 'a{99999999999}'}\n    replace: {op: linear}\n")
    err = error_of(p)
    assert "invalid regular expression" in str(err) and "too large" in str(err) and err.line == 3


def test_rule_paths_that_are_directories_or_unreadable(tmp_path):
    """A directory is named as one; a command-line path is not reported as key 'include'; a name too
    long for the file system or a '~user' of no user is a RuleError, not an OSError or RuntimeError."""
    (tmp_path / "d.yaml").mkdir()
    for ref in (str(tmp_path), str(tmp_path / "d.yaml")):
        err = error_of(ref)
        assert str(err) == f"{ref!r} is a directory, not a rule file" and err.key is None
    err = error_of(str(tmp_path / "nothere.yaml"))
    assert "not found" in str(err) and "include" not in str(err)
    err = error_of(write(tmp_path, "version: 1\ninclude: [d.yaml]\n"))
    assert "is a directory" in str(err) and err.key == "include" and err.line == 2
    for i, ref in enumerate(["a" * 1000 + ".yaml", "b" * 1000, "~no-such-user-here/x.yaml"]):
        err = error_of(write(tmp_path, f"version: 1\ninclude: ['{ref}']\n", name=f"i{i}.yaml"))
        assert err.key == "include" and err.line == 2 and ref[:20] in str(err)


def test_patterns_end_at_the_end_of_the_string(tmp_path):
    """The schema's `$` is ECMA-262's (the end of the string), not Python's (also before a final newline):
    a device, op, class or kwarg name with a trailing newline is refused, naming its line and key."""
    cases = [('rules:\n  - match: {name: x}\n    replace: {op: linear, device: "cuda:0\\n"}\n', 3, "rules[0].replace.device"),
             ('rules:\n  - match: {name: x}\n    replace: {op: "linear\\n"}\n', 3, "rules[0].replace.op"),
             ('rules:\n  - match: {name: x, class: "Linear\\n"}\n    replace: {op: linear}\n', 2, "rules[0].match.class"),
             ('rules:\n  - match: {name: x}\n    replace: {op: linear, kwargs: {"bits\\n": 4}}\n', 3,
              "rules[0].replace.kwargs")]
    for body, line, key in cases:
        err = error_of(write(tmp_path, "version: 1\n" + body))
        assert err.line == line + 1 and err.key == key, (body, err)
    assert load_rules(write(tmp_path, 'version: 1\nrules:\n  - match: {name: x}\n'
                                      '    replace: {op: linear, device: "cuda:0"}\n')).rules


def test_schema_limits_and_alternatives_are_plain_messages(tmp_path):
    """Size limits say the size and the limit (not the whole list back); a value of neither alternative
    says what was expected; a list of the right type names its bad item."""
    rule = "version: 1\nrules:\n  - match: {{name: {name}{cls}}}\n    replace: {{op: linear{kw}}}\n"
    cases = [(rule.format(name="x", cls=", class: 5", kw=""), "rules[0].match.class",
              "invalid value 5: expected a string or a list"),
             (rule.format(name="x", cls=", class: [1]", kw=""), "rules[0].match.class[0]", "expected a string, got int"),
             (rule.format(name="x", cls=", class: []", kw=""), "rules[0].match.class", "0 items, at least 1 allowed"),
             (rule.format(name="''", cls="", kw=""), "rules[0].match.name", "must not be empty"),
             (rule.format(name="a" * 600, cls="", kw=""), "rules[0].match.name",
              "a string of 600 characters, at most 512 allowed"),
             (rule.format(name="x", cls="", kw=", kwargs: {" + ", ".join(f"k{i}: 1" for i in range(70)) + "}"),
              "rules[0].replace.kwargs", "70 keys, at most 64 allowed"),
             ("version: 1\ninclude: [" + ", ".join(["a"] * 40) + "]\n", "include", "40 items, at most 32 allowed")]
    for text, key, message in cases:
        err = error_of(write(tmp_path, text))
        assert err.key == key and message in str(err) and len(str(err)) < 400, (text[:80], str(err))
