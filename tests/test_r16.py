"""R16 layouts (native/r16.c): 16 GGUF rows interleaved block by block for the VNNI decode kernels.

* repacking keeps every value: R16 rows dequantize to exactly `gguf.quants.dequantize`'s floats;
* the R16 dots (scalar on every CPU, AVX-512 VNNI where usable) against the float reference at the
  tolerance of the int8-activation dots (3e-2; measured ~1%), and the scalar and SIMD versions
  against each other (same integer sums, same float order: 1e-5);
* `MoEKernel` with R16 copies against the reference at decode (row dots, which read the copies)
  and at prefill (grouped path, which reads the GGUF rows: bit for bit the same as without);
* bad input: types without the layout, rows not in groups of 16, wrong row sizes, gate / up
  layouts that disagree, and R16 flags the C side must refuse.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ktinject import native
from ktinject.errors import NativeError
from ktinject.native import moe as nmoe

from test_native_util import dequant, moe_case, rand_rows, ref_moe, rel_err

pytestmark = pytest.mark.skipif(not native.available(), reason="native extension not built")
ISAS = native.usable_isas() if native.available() else []
R16 = [QT.Q4_K, QT.Q5_K, QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q6_K, QT.IQ4_XS, QT.Q2_K, QT.Q3_K]
N = {QT.Q4_K: 512, QT.Q5_K: 512, QT.Q4_0: 96, QT.Q5_0: 96, QT.Q8_0: 128, QT.Q6_K: 512, QT.IQ4_XS: 512, QT.Q2_K: 512,
     QT.Q3_K: 512}


def _vendor() -> str:
    from pathlib import Path
    return next((line.split(":")[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("vendor_id")), "")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(77)


@pytest.mark.parametrize("qt", R16, ids=lambda q: q.name)
def test_repack_keeps_every_value(qt):
    n, E, rows = N[qt], 3, 32
    w = rand_rows(qt, E * rows, n, seed=3)
    r = native.repack_r16(native.ExpertMatrix(int(qt), w, E, rows, n, "w"))
    assert r.layout == "r16" and r.data.shape == (E * rows, native.r16_row_bytes(int(qt), n))
    assert torch.equal(native.r16_dequant(int(qt), r.data, n), dequant(qt, w, n))


def test_repack_resolves_stride_and_offset():
    """A fused [E, 2I, H] gate_up tensor: the up half (offset I, stride 2I) becomes its own matrix."""
    E, I, H = 3, 32, 256
    gu = rand_rows(QT.Q4_K, E * 2 * I, H, seed=4)
    up = native.repack_r16(native.ExpertMatrix(int(QT.Q4_K), gu, E, I, H, "up", stride=2 * I, offset=I),
                           native.default_pool(2))
    want = dequant(QT.Q4_K, gu, H).reshape(E, 2 * I, H)[:, I:].reshape(E * I, H)
    assert torch.equal(native.r16_dequant(int(QT.Q4_K), up.data, H), want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", R16, ids=lambda q: q.name)
@pytest.mark.parametrize("T", [1, 3])
def test_r16_gemv(isa, qt, T):
    n = 2 * N[qt]
    w = rand_rows(qt, 48, n, seed=5)
    r = native.repack_r16(native.ExpertMatrix(int(qt), w, 1, 48, n))
    x = torch.randn(T, n)
    ref = x.double() @ dequant(qt, w, n).double().T
    y = native.r16_gemv(int(qt), r.data, n, x, isa)
    assert y.shape == (T, 48) and rel_err(y, ref.float()) < 3e-2, (isa, qt.name)
    if isa != "scalar":   # the SIMD kernel and the scalar loop: same integer sums, same float order
        assert torch.allclose(y, native.r16_gemv(int(qt), r.data, n, x, "scalar"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt,dqt", [(QT.Q4_K, QT.Q5_0), (QT.Q8_0, QT.Q8_0), (QT.Q4_K, QT.Q6_K), (QT.Q6_K, QT.Q5_K),
                                    (QT.Q5_K, QT.Q4_0), (QT.IQ4_XS, QT.IQ4_XS), (QT.Q4_0, QT.BF16), (QT.Q2_K, QT.Q3_K)],
                         ids=["q4_k+q5_0", "q8_0", "q4_k+q6_k", "q6_k+q5_k", "q5_k+q4_0", "iq4_xs", "q4_0+bf16", "q2_k+q3_k"])
@pytest.mark.parametrize("T,tile_min", [(1, 4), (6, 100000), (64, 4)], ids=["decode", "rowdot-T6", "grouped-T64"])
def test_moe_kernel_repacked(isa, qt, dqt, T, tile_min, monkeypatch):
    monkeypatch.setenv("KTINJECT_TILE_MIN", str(tile_min))
    (gate, up, down), (G, U, D) = moe_case(qt, dqt, E=6)
    kern = native.MoEKernel(gate, up, down, threads=2, isa=isa, repack=True)
    # BF16 has no R16 layout: its down stays in its rows beside repacked gate / up
    assert kern.repacked == (("gate", "up", "down") if dqt != QT.BF16 else ("gate", "up"))
    plain = native.MoEKernel(gate, up, down, threads=2, isa=isa, repack=False)
    assert plain.repacked == ()
    x = torch.randn(T, 256)
    ids, w = torch.rand(T, 6).topk(2, dim=1).indices.contiguous(), torch.rand(T, 2)
    out, ref = kern(x, ids, w), ref_moe(x, ids, w, G, U, D)
    tol = 2e-2 if isa == "amx" and tile_min == 4 and T > 1 else 4e-2
    assert rel_err(out, ref) < tol, (isa, qt.name, T)
    if tile_min == 4 and T > 1:   # the grouped (prefill) path reads the GGUF rows either way
        assert torch.equal(out, plain(x, ids, w))


def test_auto_repack_follows_the_isa_the_types_and_the_env(monkeypatch):
    """auto: AVX-512 / AMX only, and only the types measured faster from memory (Q5_0, Q8_0, Q4_0; on AMD,
    whose R16 kernels prefetch into L2, every type with the layout)."""
    monkeypatch.delenv("KTINJECT_REPACK", raising=False)
    amd = _vendor() in ("AuthenticAMD", "HygonGenuine")
    assert nmoe.auto_types() == ((12, 13, 2, 6, 8, 14, 23, 10, 11) if amd else (6, 8, 2))
    (gate, up, down), _ = moe_case(QT.Q4_K, QT.Q5_0, E=2)
    (g8, u8, d8), _ = moe_case(QT.Q8_0, QT.Q8_0, E=2)
    assert native.MoEKernel(gate, up, down, threads=1, isa="scalar").repacked == ()
    if "avx512" in ISAS:
        assert native.MoEKernel(gate, up, down, threads=1, isa="avx512").repacked == \
            (("gate", "up", "down") if amd else ("down",))
        assert native.MoEKernel(g8, u8, d8, threads=1, isa="avx512").repacked == ("gate", "up", "down")
        assert native.MoEKernel(gate, up, down, threads=1, isa="avx512", repack=True).repacked == ("gate", "up", "down")
        monkeypatch.setenv("KTINJECT_REPACK", "0")
        assert native.MoEKernel(g8, u8, d8, threads=1, isa="avx512").repacked == ()


def test_auto_repack_short_of_ram_keeps_the_base_types(monkeypatch, caplog):
    """Where RAM has no room for every copy `auto` would make (AMD's Q4_K gate/up beside a Q5_0 down),
    the Q5_0 / Q8_0 copies still come first, and the warning says what was left out; with no room
    for those either, none. (Any ISA: the auto policy is forced here, the dots then run the scalar loop.)"""
    monkeypatch.delenv("KTINJECT_REPACK", raising=False)
    monkeypatch.setattr(nmoe, "repack_mode", lambda isa, repack: "auto")
    monkeypatch.setattr(nmoe, "auto_types", lambda: nmoe.AUTO_TYPES_AMD)
    (gate, up, down), _ = moe_case(QT.Q4_K, QT.Q5_0, E=2)
    down_bytes = 2 * down.n_experts * down.rows * native.r16_row_bytes(int(QT.Q5_0), down.cols)
    nmoe._warned.clear()
    monkeypatch.setattr(nmoe, "_ram_allows", lambda nbytes: nbytes <= down_bytes)
    with caplog.at_level("WARNING"):
        k = native.MoEKernel(gate, up, down, threads=1, isa="scalar")
    assert k.repacked == ("down",)
    assert "routed experts only down repacked (slower decode)" in caplog.text
    nmoe._warned.clear()
    monkeypatch.setattr(nmoe, "_ram_allows", lambda nbytes: False)
    assert native.MoEKernel(gate, up, down, threads=1, isa="scalar").repacked == ()
    monkeypatch.setattr(nmoe, "_ram_allows", lambda nbytes: True)
    assert native.MoEKernel(gate, up, down, threads=1, isa="scalar").repacked == ("gate", "up", "down")


def test_bad_input_names_the_problem():
    w0 = rand_rows(QT.BF16, 16, 256, seed=1)
    with pytest.raises(NativeError, match="no R16 layout"):
        native.repack_r16(native.ExpertMatrix(int(QT.BF16), w0, 1, 16, 256, "down"))
    w = rand_rows(QT.Q4_K, 24, 256, seed=1)
    with pytest.raises(NativeError, match="not a multiple of 16"):
        native.repack_r16(native.ExpertMatrix(int(QT.Q4_K), w, 1, 24, 256, "gate"))
    with pytest.raises(NativeError, match="expected .* R16 rows"):
        native.r16_dequant(int(QT.Q4_K), w, 256)                      # GGUF rows are not R16 rows
    with pytest.raises(NativeError, match="bytes, expected"):
        native.ExpertMatrix(int(QT.Q4_K), w, 1, 16, 256, "gate", layout="r16").validate()
    with pytest.raises(NativeError, match="layout must be"):
        native.ExpertMatrix(int(QT.Q4_K), w, 1, 16, 256, "gate", layout="r4").validate()
    with pytest.raises(NativeError, match="T <= 4"):
        r = native.repack_r16(native.ExpertMatrix(int(QT.Q4_K), w[:16].contiguous(), 1, 16, 256))
        native.r16_gemv(int(QT.Q4_K), r.data, 256, torch.randn(5, 256))
    (gate, up, down), _ = moe_case(QT.Q4_K, QT.Q5_0, E=2)
    rg = native.repack_r16(gate)
    with pytest.raises(NativeError, match="takes GGUF rows"):
        native.MoEKernel(rg, up, down, threads=1, repack=False)


def test_c_side_refuses_bad_r16_descriptors():
    """The flags are checked in C too: gate without up, a type without the layout, GGUF row sizes."""
    lib, ffi = native.load()
    (gate, up, down), _ = moe_case(QT.Q4_K, QT.BF16, E=2)
    rg, ru = native.repack_r16(gate), native.repack_r16(up)
    (_, up8, _), _ = moe_case(QT.Q8_0, QT.Q8_0, E=2, seed=5)       # a valid Q8_0 up and its R16 copy
    ru8 = native.repack_r16(up8)
    keep = []

    def desc(g16=rg, u16=ru, d16=None, up_m=up):
        dsc = ffi.new("ktk_moe_desc *")
        dsc.gate_type, dsc.up_type, dsc.down_type = gate.ggml_type, up_m.ggml_type, down.ggml_type
        dsc.n_experts, dsc.hidden, dsc.inter = 2, 256, 512
        dsc.gate, dsc.up, dsc.down = (ffi.cast("uint8_t *", m.data.data_ptr()) for m in (gate, up_m, down))
        dsc.gate_rb, dsc.up_rb, dsc.down_rb = gate.data.shape[1], up_m.data.shape[1], down.data.shape[1]
        for name, m in (("gate_r16", g16), ("up_r16", u16), ("down_r16", d16)):
            setattr(dsc, name, ffi.cast("uint8_t *", m.data.data_ptr()) if m is not None else ffi.NULL)
        keep.append(dsc)
        return dsc

    err = ffi.new("int *")
    for good in (desc(), desc(g16=None, u16=None, up_m=up8)):        # the Q8_0 up alone is valid GGUF rows
        ok = lib.ktk_moe_new(good, err)
        assert ok != ffi.NULL and err[0] == 0
        lib.ktk_moe_free(ok)
    # gate without up; a BF16 down (no R16 layout) with an R16 copy; gate (Q4_K) and up (Q8_0) both
    # repacked but of two types
    for bad in (desc(u16=None), desc(d16=rg), desc(u16=ru8, up_m=up8)):
        assert lib.ktk_moe_new(bad, err) == ffi.NULL and err[0] == lib.KTK_EINVAL
    assert lib.ktk_r16_repack(ffi.NULL, int(QT.Q4_K), ffi.cast("uint8_t *", gate.data.data_ptr()), 144, 144 * 512,
                              2, 8, 256, ffi.cast("uint8_t *", rg.data.data_ptr())) == lib.KTK_EINVAL   # 8 rows


def test_repack_on_a_path_without_the_kernels_warns(caplog):
    (gate, up, down), _ = moe_case(QT.Q8_0, QT.Q8_0, E=2)
    nmoe._warned.clear()                         # said once per process: earlier tests may have said it
    with caplog.at_level("WARNING", logger="ktinject.native.moe"):
        assert native.MoEKernel(gate, up, down, threads=1, isa="scalar", repack=True).repacked == ("gate", "up", "down")
    assert "portable scalar loop" in caplog.text


def test_repack_on_names_what_stays_in_gguf_rows(caplog):
    (gate, up, down), _ = moe_case(QT.Q4_K, QT.BF16, E=2)
    nmoe._warned.clear()
    with caplog.at_level("WARNING", logger="ktinject.native.moe"):
        assert native.MoEKernel(gate, up, down, threads=1, repack=True).repacked == ("gate", "up")
    assert "down (down) stays in GGUF rows: GGML type 30 has no R16 layout" in caplog.text


def test_repack_mode(monkeypatch):
    scalar, avx512 = native.ISAS.index("scalar"), native.ISAS.index("avx512")
    monkeypatch.delenv("KTINJECT_REPACK", raising=False)
    assert [nmoe.repack_mode(scalar, r) for r in (None, True, False)] == ["off", "on", "off"]
    assert [nmoe.repack_mode(avx512, r) for r in (None, True, False)] == ["auto", "on", "off"]
    monkeypatch.setenv("KTINJECT_REPACK", "0")
    assert nmoe.repack_mode(avx512, True) == "off"
    monkeypatch.setenv("KTINJECT_REPACK", "1")
    assert [nmoe.repack_mode(scalar, r) for r in (None, False)] == ["on", "off"]


_STREAM_CHILD = """
import json, torch
from gguf import GGMLQuantizationType as QT
from ktinject import native
from test_native_util import rand_rows
out = {"stream": native.r16_stream(), "y": {}}
for qt, n in ((QT.Q4_K, 1024), (QT.Q5_K, 1024), (QT.IQ4_XS, 1024), (QT.Q4_0, 256), (QT.Q5_0, 256), (QT.Q8_0, 256), (QT.Q6_K, 1024),
               (QT.Q2_K, 1024), (QT.Q3_K, 1024)):
    w = rand_rows(qt, 32, n, seed=9)
    r = native.repack_r16(native.ExpertMatrix(int(qt), w, 1, 32, n))
    torch.manual_seed(1)
    out["y"][qt.name] = native.r16_gemv(int(qt), r.data, n, torch.randn(2, n), "avx512").tolist()
print(json.dumps(out))
"""


@pytest.mark.skipif("avx512" not in ISAS, reason="the R16 SIMD kernels need the AVX-512 path")
def test_r16_stream_defaults_and_overrides():
    """How the R16 kernels read memory: defaults by vendor (AMD: into L2, 4 KiB ahead but none for
    Q8_0, one segment; others: into L1, 1 KiB, two segments), $KTINJECT_R16_PF / _PF_L2 / _SPLIT
    override them (out-of-range values fall back to the defaults), and every setting gives the same
    dots (segment sums added in another order: 1e-5). Each setting is read once per process, hence
    the subprocesses."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    vendor = _vendor()
    amd = vendor in ("AuthenticAMD", "HygonGenuine")
    default = ("prefetch into L2: Q4_K, Q5_K, Q4_0, Q5_0, Q6_K, IQ4_XS, Q2_K, Q3_K 4096 B ahead; Q8_0 none; 1 segment a pair (the AMD defaults)"
               if amd else "prefetch into L1: Q4_K, Q5_K, Q4_0, Q5_0, Q6_K, IQ4_XS, Q2_K, Q3_K, Q8_0 1024 B ahead; 2 segments a pair (the "
               + ("Intel" if vendor == "GenuineIntel" else "default") + " defaults)")
    here = Path(__file__).parent
    runs = {}
    for cfg in ({}, {"KTINJECT_R16_PF": "512", "KTINJECT_R16_SPLIT": "4", "KTINJECT_R16_PF_L2": "1"},
                {"KTINJECT_R16_PF": "0", "KTINJECT_R16_SPLIT": "2"}, {"KTINJECT_R16_SPLIT": "9"},
                {"KTINJECT_R16_PF": "+-5"}):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KTINJECT_R16_")}
        env.update(cfg, PYTHONPATH=os.pathsep.join([str(here), str(here.parent), env.get("PYTHONPATH", "")]))
        res = subprocess.run([sys.executable, "-c", _STREAM_CHILD], env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        runs[tuple(cfg.items())] = json.loads(res.stdout.strip().splitlines()[-1])
    streams = [r["stream"] for r in runs.values()]
    assert streams[0] == default
    assert streams[1] == ("prefetch into L2: Q4_K, Q5_K, Q4_0, Q5_0, Q6_K, IQ4_XS, Q2_K, Q3_K, Q8_0 512 B ahead; 4 segments a pair "
                          "(set by $KTINJECT_R16_PF and $KTINJECT_R16_PF_L2 and $KTINJECT_R16_SPLIT)")
    assert streams[2] == ("prefetch into " + ("L2" if amd else "L1") + ": Q4_K, Q5_K, Q4_0, Q5_0, Q6_K, IQ4_XS, Q2_K, Q3_K, Q8_0 none; 2 segments "
                          "a pair (set by $KTINJECT_R16_PF and $KTINJECT_R16_SPLIT)")
    assert streams[3] == default.split(" (")[0] + " (set by $KTINJECT_R16_SPLIT='9' ignored: not 1-4)"
    assert streams[4] == default.split(" (")[0] + " (set by $KTINJECT_R16_PF='+-5' ignored: not 0-65536)"
    base = runs[()]["y"]
    for r in runs.values():
        for name, y in r["y"].items():
            assert torch.allclose(torch.tensor(y), torch.tensor(base[name]), rtol=1e-5, atol=1e-5), name


def test_cpu_experts_repack_option():
    """The operator's `repack` option: auto / on / off (YAML's bare on / off arrive as booleans),
    the GGUF rows kept for the grouped path, and `extra_repr` naming the repacked matrices."""
    from ktinject.operators import registry
    from ktinject.operators.base import BuildContext
    from ktinject.testing import first_moe_block
    from ktinject.weights.tensor import FusedTensor, GGMLTensor

    Op = registry.get("cpu_experts")
    assert Op.Options(repack=True).repack == "on" and Op.Options(repack=False).repack == "off"
    with pytest.raises(ValueError, match="repack 'sometimes' is not one of auto, on, off"):
        Op.Options(repack="sometimes")
    model, block = first_moe_block("deepseek_v2")
    E, H, I = block.experts.gate_up_proj.shape[0], model.config.hidden_size, model.config.moe_intermediate_size
    g, u, d = rand_rows(QT.Q4_K, E * I, H, 1), rand_rows(QT.Q4_K, E * I, H, 2), rand_rows(QT.Q5_0, E * H, I, 3)
    gu = FusedTensor((GGMLTensor(int(QT.Q4_K), (E, I, H), g, "blk.1.ffn_gate_exps.weight", "m.gguf"),
                      GGMLTensor(int(QT.Q4_K), (E, I, H), u, "blk.1.ffn_up_exps.weight", "m.gguf")), dim=1)
    down = GGMLTensor(int(QT.Q5_0), (E, H, I), d, "blk.1.ffn_down_exps.weight", "m.gguf")
    cpu = torch.device("cpu")
    x = torch.randn(1, H)
    ids, w = torch.tensor([[0, 1]]), torch.tensor([[0.6, 0.4]])
    outs = {}
    for mode, want in (("off", ()), ("on", ("gate", "up", "down"))):
        ctx = BuildContext("model.layers.1.mlp.experts", cpu, cpu, cpu, None, model.config,
                           Op.Options(threads=2, isa="scalar", repack=mode))
        op = Op.build(block.experts, ctx)
        op.load_weights("p.", {"p.gate_up_proj": gu, "p.down_proj": down})
        assert op.kernel.repacked == want and op.kernel.gate.data.data_ptr() == g.data_ptr()   # GGUF rows kept
        assert ("r16=gate+up+down" in op.extra_repr()) == bool(want)
        outs[mode] = op(x, ids, w)
    # the scalar row dots on GGUF rows use f32 activations, the R16 loop Q8 ones: ~1% apart
    assert rel_err(outs["on"], outs["off"]) < 3e-2
