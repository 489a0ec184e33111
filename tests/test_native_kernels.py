"""Native kernels against the torch reference on `gguf.quants.dequantize`d weights, for every
quant type and every ISA path this CPU can run (scalar and avx2 here; avx512 and amx on the
lent Xeon via native/device_check.sh).

Tolerances (relative L2 error, ||y - ref|| / ||ref||):
* dequantization: exact (max abs diff <= 1e-6 of the row's scale);
* f32 activations (scalar path, BF16 weights, the grouped f32 GEMM path): 1e-4;
* int8 activations quantized on the fly (Q8_0 / Q8_K blocks, AVX2/AVX-512 decode): 3e-2 for a
  single GEMV and 4e-2 for the whole FFN (two quantized activations in a row; measured 1-2%).
  FFN errors are per token against the size of the summed expert terms (see `ref_moe`), since
  two experts' outputs may cancel.
Weights are Gaussian values through the real quantizers (gguf-py, ktinject.weights.kquant).
* AMX grouped path (BF16 tiles: weights and activations rounded to bf16): 2e-2.
"""
from __future__ import annotations

import functools
import time

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ktinject import native
from ktinject.errors import NativeError

from test_native_util import QUANTS, dequant, moe_case, rand_rows, ref_moe, rel_err

pytestmark = pytest.mark.skipif(not native.available(), reason="native extension not built")
ISAS = native.usable_isas() if native.available() else []


def _gemv_tol(isa: str, qt: QT) -> float:
    return 1e-4 if isa == "scalar" or qt == QT.BF16 else 3e-2


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", QUANTS, ids=lambda q: q.name)
def test_dequant_row_exact(isa, qt):
    rows = rand_rows(qt, 3, 512, seed=11)
    ref = dequant(qt, rows, 512)
    for r in range(3):
        got = native.dequant_row(int(qt), rows[r].contiguous(), 512, isa)
        assert torch.allclose(got, ref[r], rtol=0, atol=1e-6 * float(ref[r].abs().max())), (isa, qt.name, r)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", QUANTS, ids=lambda q: q.name)
def test_gemv(isa, qt):
    n = 1024
    w = rand_rows(qt, 24, n, seed=5)
    x = torch.randn(n)
    ref = dequant(qt, w, n).double() @ x.double()
    y = native.gemv(int(qt), w, n, x, isa)
    assert rel_err(y, ref.float()) < _gemv_tol(isa, qt), (isa, qt.name)


def _float_rows(qt: QT, rows: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """F32 / F16 / BF16 rows as GGML stores them (uint8 [rows, row_bytes]) and their values."""
    dt = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}[qt]
    v = (torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dt)
    return v.view(torch.uint8).reshape(rows, -1).contiguous(), v.float()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", [QT.BF16, QT.F16, QT.F32], ids=lambda q: q.name)
@pytest.mark.parametrize("n", [8, 24, 37, 1000, 2048])
def test_float_rows_gemv(isa, qt, n):
    """Float rows (the four-row BF16 / F16 kernel: 16-value steps, an 8-value step, a scalar tail)
    against float64, over more than one 64-row chunk of the spread row order (ktk_dotn_spread:
    passes of four rows 16 apart, the rest in one call); any row range gives the whole call's
    values bit for bit."""
    w, v = _float_rows(qt, 150, n, seed=n)
    x = torch.randn(n)
    full = native.gemv(int(qt), w, n, x, isa)
    assert rel_err(full, (v.double() @ x.double()).float()) < 1e-5, (isa, qt.name, n)
    for start, count in ((0, 64), (3, 70), (63, 2), (100, 50), (149, 1), (0, 150)):
        part = native.gemv(int(qt), w[start:start + count].contiguous(), n, x, isa)
        assert torch.equal(part, full[start:start + count]), (isa, qt.name, n, start, count)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q5_K, QT.Q8_0, QT.Q6_K], ids=lambda q: q.name)
def test_gemv_spread_chunks(isa, qt):
    """Quantized rows over several 64-row chunks of the spread order (four-row passes 16 apart,
    two-row passes for Q5_K) and a remainder: any row range gives the whole call's values."""
    n = 256
    w = rand_rows(qt, 200, n, seed=3)
    x = torch.randn(n)
    full = native.gemv(int(qt), w, n, x, isa)
    assert rel_err(full, (dequant(qt, w, n).double() @ x.double()).float()) < _gemv_tol(isa, qt), (isa, qt.name)
    for start, count in ((0, 64), (5, 130), (64, 64), (190, 10), (1, 199)):
        part = native.gemv(int(qt), w[start:start + count].contiguous(), n, x, isa)
        assert torch.equal(part, full[start:start + count]), (isa, qt.name, start, count)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", QUANTS, ids=lambda q: q.name)
def test_gemv_row_subsets(isa, qt):
    """The multi-row dots (passes of several rows sharing the activation loads, a short last pass):
    any start and row count give the values of the whole-matrix call bit for bit, which match the
    reference."""
    n = 512
    w = rand_rows(qt, 13, n, seed=7)
    x = torch.randn(n)
    full = native.gemv(int(qt), w, n, x, isa)
    assert rel_err(full, (dequant(qt, w, n).double() @ x.double()).float()) < _gemv_tol(isa, qt), (isa, qt.name)
    for start, count in ((0, 1), (1, 2), (2, 3), (3, 5), (4, 9), (12, 1)):
        part = native.gemv(int(qt), w[start:start + count].contiguous(), n, x, isa)
        assert torch.equal(part, full[start:start + count]), (isa, qt.name, start, count)


@pytest.mark.parametrize("isa", ISAS)
def test_iq4_xs_random_bytes(isa):
    """IQ4_XS on random bytes (every 6-bit scale, negative ones included, every grid index; the
    quantizer of the other tests leaves most scales near the top): dequantization bit-exact with
    gguf-py, row dots within the usual tolerance."""
    from ktinject.native.synth import random_rows
    n = 2048
    w = random_rows(QT.IQ4_XS, 16, n, seed=13)
    blocks = w.reshape(-1, 136)
    ls = ((blocks[:, 4:8].repeat_interleave(2, 1) >> torch.tensor([0, 4] * 4, dtype=torch.uint8)) & 15).int() | (
        ((blocks[:, 2:4].view(torch.int16).int() & 0xFFFF) >> (2 * torch.arange(8))) & 3) << 4
    assert len(torch.unique(ls)) == 64                            # the test sees every scale
    ref = dequant(QT.IQ4_XS, w, n)
    for r in range(16):
        got = native.dequant_row(int(QT.IQ4_XS), w[r].contiguous(), n, isa)
        assert torch.equal(got, ref[r]), (isa, r)
    x = torch.randn(n)
    y = native.gemv(int(QT.IQ4_XS), w, n, x, isa)
    assert rel_err(y, (ref.double() @ x.double()).float()) < _gemv_tol(isa, QT.IQ4_XS), isa


@functools.lru_cache(maxsize=None)
def _routing(T, E, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=gen).topk(k, dim=1).indices.contiguous()
    return ids, torch.rand(T, k, generator=gen)


# the types each ISA's grouped path multiplies in 8-bit integers (the kernel tables' u8_types)
VNNI_TYPES = {"avx512": (QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS),
              "avx2": (QT.Q4_0, QT.Q5_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)}


def _moe_tol(isa: str, qt: QT, grouped: bool) -> float:
    if isa == "scalar" or (qt == QT.BF16 and not grouped):
        return 1e-4
    if grouped:
        if qt in VNNI_TYPES.get(isa, ()):   # tokens quantized to 8 bits, as on the row-dot path
            return 4e-2
        if isa == "avx512" and qt == QT.BF16 and native.avx512_bf16_grouped():
            return 2e-2                      # tokens rounded to bf16 for AVX512-BF16 dots, as on AMX
        return 2e-2 if isa == "amx" else 1e-4
    return 4e-2


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("T,grouped", [(1, False), (80, True), (72, False)], ids=["decode", "batch80-grouped",
                                                                                 "batch72-rowdot"])
def test_moe_kernel(isa, qt, T, grouped, monkeypatch):
    monkeypatch.setenv("KTINJECT_TILE_MIN", "4" if grouped else "100000")
    (gate, up, down), (G, U, D) = moe_case(qt, qt)
    kern = native.MoEKernel(gate, up, down, threads=2, isa=isa)
    x = torch.randn(T, 256)
    ids, w = _routing(T, 8, 2, seed=T)
    out = kern(x, ids, w)
    assert out.shape == (T, 256) and torch.isfinite(out).all()
    assert rel_err(out, ref_moe(x, ids, w, G, U, D)) < _moe_tol(isa, qt, grouped), (isa, qt.name, T)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("acc", ["1", "0"], ids=["down-acc", "down-direct"])
def test_moe_grouped_and_row_dot_experts_in_one_layer(isa, acc, monkeypatch):
    """Some experts with many tokens (grouped path), some with one to three (row dots), in one call: both
    add into the same output rows in the down phase, the grouped ones through its compact block first
    (KTINJECT_DOWN_ACC=1, the default) or straight into the output (0)."""
    monkeypatch.setenv("KTINJECT_TILE_MIN", "4")
    monkeypatch.setenv("KTINJECT_DOWN_ACC", acc)
    (gate, up, down), (G, U, D) = moe_case(QT.Q4_K, QT.Q4_K)
    kern = native.MoEKernel(gate, up, down, threads=2, isa=isa)
    T = 40
    x = torch.randn(T, 256)
    t = torch.arange(T)
    ids = torch.stack([t % 4, 4 + t % 3], dim=1)   # experts 0-6: 10-14 tokens each (grouped)
    ids[T - 2:, 1] = 7                              # expert 7: two tokens (row dots)
    counts = torch.bincount(ids.flatten(), minlength=8)
    assert (counts < 4).any() and (counts >= 4).any(), counts
    w = torch.rand(T, 2, generator=torch.Generator().manual_seed(5))
    out = kern(x, ids.contiguous(), w)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref_moe(x, ids, w, G, U, D)) < _moe_tol(isa, QT.Q4_K, True), (isa, counts.tolist())


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "scalar"])   # (scalar: every expert takes row dots)
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.BF16], ids=lambda q: q.name)
def test_moe_down_halves_split_or_not_agree(isa, qt, monkeypatch):
    """A layer whose experts are all grouped sums the down phase as two halves of its experts: in one item
    per 32 output rows ($KTINJECT_DOWN_SPLIT=1), or in two items whose second finisher adds them (2; and by
    default where the thread count does not divide the chunks: 6 threads over H / 32 = 8 here). Bit for
    bit the same result either way, oversubscribed, job after job, and right against the reference; with
    every token on one expert too (one half empty). The split halves' blocks live in h where it has room
    (2 H <= k I), else in a buffer of their own: both shapes. Items of several chunks ($KTINJECT_DOWN_CHUNKS=n: each
    expert's GEMMs for all n back to back, in the items that fill whole rounds, single chunks after them) give the
    same bits too, split or not: all pairs (2 threads over 8 chunks), pairs then singles (3 threads over 8: three
    pairs, two singles; split, 3 over 8 and 5 over 16), fours, threes and one item of eight, an odd count of
    chunks (9)."""
    monkeypatch.setenv("KTINJECT_TILE_MIN", "4")
    for H, I in ((256, 512), (512, 256)) + (((288, 512),) if qt == QT.BF16 else ()):   # (288: 9 chunks, an odd count)
        _down_halves_case(isa, qt, H, I, monkeypatch)


def _down_halves_case(isa, qt, H, I, monkeypatch):
    (gate, up, down), (G, U, D) = moe_case(qt, qt, H=H, I=I, seed=8)
    kerns = {}
    for split, threads, pairs in (("1", 2, "1"), ("2", 2, "1"), ("", 6 * H // 256, "1"), ("2", 5, "1"),
                                  ("1", 2, "2"), ("1", 3, "2"), ("2", 3, "2"), ("", 5, "2"),   # (6 threads over 8 chunks,
                                  ("1", 2, "4"), ("2", 3, "4"), ("", 2, "3"), ("1", 1, "8")):  # 12 over 16)
        monkeypatch.setenv("KTINJECT_DOWN_SPLIT", split)
        monkeypatch.setenv("KTINJECT_DOWN_CHUNKS", pairs)
        kerns[split, threads, pairs] = native.MoEKernel(gate, up, down, isa=isa, pool=native.Pool(threads, pin=False))
    for T, k in ((64, 2), (96, 3), (24, 1)):
        x = torch.randn(T, H)
        ids, w = _routing(T, 8, k, seed=T)
        if k == 1:
            ids = torch.zeros_like(ids)                 # one expert: half 1 (or half 0) has none
        counts = torch.bincount(ids.flatten(), minlength=8)
        assert (counts[counts > 0] >= 4).all(), counts    # no row-dot expert: the halves path
        want = kerns["1", 2, "1"](x, ids, w)
        for key, kern in kerns.items():
            for _ in range(2):
                assert torch.equal(kern(x, ids, w), want), (isa, qt.name, H, I, T, key)
        assert rel_err(want, ref_moe(x, ids, w, G, U, D)) < _moe_tol(isa, qt, True), (isa, qt.name, H, I, T)


@pytest.mark.parametrize("isa", [i for i in ("avx2", "avx512") if i in ISAS])
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.BF16], ids=lambda q: q.name)
def test_moe_packed_f32_path_matches_unpacked(isa, qt, monkeypatch):
    """The AVX2 / AVX-512 grouped path with tokens packed per expert (pack_f32 / gemm_packed, the
    default) against the unpacked GEMM ($KTINJECT_PACKED_F32=0): expert sizes from 1 token to
    past 3 panels (tile_min 1), so each micro-kernel width and the zero padding of the last panel run.
    (On AVX-512, Q4_K's default grouped path is the 8-bit one: test_moe_vnni_grouped_path.)"""
    monkeypatch.setenv("KTINJECT_TILE_MIN", "1")
    monkeypatch.setenv("KTINJECT_VNNI_GROUPED", "0")
    monkeypatch.setenv("KTINJECT_AVX512_BF16_GROUPED", "0")   # BF16 in f32 panels too (its dots: test_moe_avx512_bf16_dots)
    (gate, up, down), (G, U, D) = moe_case(qt, qt)
    for T in (3, 13, 47, 101):
        x = torch.randn(T, 256)
        ids, w = _routing(T, 8, 2, seed=T)
        monkeypatch.setenv("KTINJECT_PACKED_F32", "1")
        packed = native.MoEKernel(gate, up, down, threads=2, isa=isa)(x, ids, w)
        monkeypatch.setenv("KTINJECT_PACKED_F32", "0")
        plain = native.MoEKernel(gate, up, down, threads=2, isa=isa)(x, ids, w)
        assert rel_err(packed, plain) < 1e-5, (isa, qt.name, T)
        assert rel_err(packed, ref_moe(x, ids, w, G, U, D)) < _moe_tol(isa, qt, True), (isa, qt.name, T)


@pytest.mark.parametrize("isa,qt", [(i, q) for i in ("avx2", "avx512") if i in ISAS for q in VNNI_TYPES[i]],
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_moe_vnni_grouped_path(isa, qt, monkeypatch):
    """The AVX2 / AVX-512 grouped path in 8-bit integers (pack_q8 / rows_u8 / gemm_q8, the default
    for these types) against the reference, the f32 grouped path ($KTINJECT_VNNI_GROUPED=0) and the
    row dots (which quantize the tokens the same way): expert sizes from 1 token to past 3 panels,
    Q4_K gate/up with a Q5_0 down as llama.cpp writes V2-Lite, and a BF16 down (f32 grouped) beside it."""
    for down_qt in (qt, QT.Q5_0 if qt == QT.Q4_K else QT.BF16):
        (gate, up, down), (G, U, D) = moe_case(qt, down_qt)
        for T in (3, 13, 47, 101):
            x = torch.randn(T, 256)
            ids, w = _routing(T, 8, 2, seed=T)
            ref = ref_moe(x, ids, w, G, U, D)
            runs = {}
            for name, tile_min, vnni in (("vnni", "1", "1"), ("f32", "1", "0"), ("dots", "100000", "1")):
                monkeypatch.setenv("KTINJECT_TILE_MIN", tile_min)
                monkeypatch.setenv("KTINJECT_VNNI_GROUPED", vnni)
                runs[name] = native.MoEKernel(gate, up, down, threads=2, isa=isa)(x, ids, w)
            e = {k: rel_err(v, ref) for k, v in runs.items()}
            assert e["f32"] < 1e-4 and e["vnni"] < 4e-2, (isa, qt.name, down_qt.name, T, e)
            assert e["vnni"] < 1.5 * e["dots"] + 2e-3, (isa, qt.name, down_qt.name, T, e)


# the quantized-value bytes of a block (start, end) and the byte that gives every value its largest
# unsigned form on the 8-bit path (Q8_0: q = 127, U = 255; IQ4_XS: grid index 15, U = 241)
MAX_U_BYTES = {QT.Q4_0: (2, 18, 0xFF), QT.Q5_0: (2, 22, 0xFF), QT.Q8_0: (2, 34, 0x7F), QT.Q4_K: (16, 144, 0xFF),
               QT.Q5_K: (16, 176, 0xFF), QT.Q6_K: (0, 192, 0xFF), QT.IQ4_XS: (8, 136, 0xFF),
               QT.Q2_K: (16, 80, 0xFF), QT.Q3_K: (0, 96, 0xFF)}


@pytest.mark.parametrize("isa,qt", [(i, q) for i in ("avx2", "avx512") if i in ISAS for q in VNNI_TYPES[i]],
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_moe_vnni_grouped_path_at_its_integer_bounds(isa, qt, monkeypatch):
    """The 8-bit grouped path where its integer sums are largest: every weight byte at its type's
    largest value and every token constant (+1 or -1, so each activation quantizes to exactly
    +-127). AVX2 adds maddubs's i16 pair sums over 8 / 4 / 2 steps (4-, 5-, 6-bit) before widening;
    one step too many would wrap past 32767 here. Against the f32 grouped path, which sees the same
    exact activations (the down projection is BF16, on f32 panels in both runs)."""
    E, H, I = 8, 256, 512
    lo, hi, byte = MAX_U_BYTES[qt]
    bsz = gguf.GGML_QUANT_SIZES[qt][1]
    rows = []
    for seed in (1, 2):
        r = rand_rows(qt, E * I, H, seed).clone()
        r.view(-1, bsz)[:, lo:hi] = byte
        rows.append(r)
    d = rand_rows(QT.BF16, E * H, I, 3)
    mats = (native.ExpertMatrix(int(qt), rows[0], E, I, H, "gate"), native.ExpertMatrix(int(qt), rows[1], E, I, H, "up"),
            native.ExpertMatrix(int(QT.BF16), d, E, H, I, "down"))
    T = 13
    x = torch.ones(T, H)
    x[1::2] = -1
    ids, w = _routing(T, E, 2, seed=5)
    monkeypatch.setenv("KTINJECT_TILE_MIN", "1")
    runs = {}
    for vnni in ("1", "0"):
        monkeypatch.setenv("KTINJECT_VNNI_GROUPED", vnni)
        runs[vnni] = native.MoEKernel(*mats, threads=2, isa=isa)(x, ids, w)
    assert torch.isfinite(runs["0"]).all()
    assert rel_err(runs["1"], runs["0"]) < 1e-4, (isa, qt.name, rel_err(runs["1"], runs["0"]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", [QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.IQ4_XS, QT.BF16], ids=lambda q: q.name)
def test_moe_decode_one_row_kernels(isa, qt, monkeypatch):
    """$KTINJECT_MULTIROW=0 (the one-row kernels on the decode path, kept for A/B runs) agrees with
    the multi-row default and with the reference."""
    monkeypatch.setenv("KTINJECT_TILE_MIN", "100000")
    (gate, up, down), (G, U, D) = moe_case(qt, qt)
    x = torch.randn(5, 256)
    ids, w = _routing(5, 8, 2, seed=9)
    multi = native.MoEKernel(gate, up, down, threads=2, isa=isa)(x, ids, w)
    monkeypatch.setenv("KTINJECT_MULTIROW", "0")
    one = native.MoEKernel(gate, up, down, threads=2, isa=isa)(x, ids, w)
    ref = ref_moe(x, ids, w, G, U, D)
    tol = _moe_tol(isa, qt, False)
    assert rel_err(one, ref) < tol and rel_err(multi, ref) < tol, (isa, qt.name)
    if isa == "scalar":   # same one-row dots underneath
        assert torch.allclose(one, multi, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("isa", ISAS)
def test_moe_mixed_types_and_fused_rows(isa):
    """V2-Lite style: Q4_K gate/up in one fused [E, 2I, H] tensor (strided views), Q5_0 down."""
    E, H, I = 4, 256, 512
    gu = rand_rows(QT.Q4_K, E * 2 * I, H, seed=21)                 # [E*2I, rb]: expert e = gate rows, up rows
    d = rand_rows(QT.Q5_0, E * H, I, seed=22)
    gate = native.ExpertMatrix(int(QT.Q4_K), gu, E, I, H, "gate", stride=2 * I, offset=0)
    up = native.ExpertMatrix(int(QT.Q4_K), gu, E, I, H, "up", stride=2 * I, offset=I)
    down = native.ExpertMatrix(int(QT.Q5_0), d, E, H, I, "down")
    dense_gu = dequant(QT.Q4_K, gu, H).reshape(E, 2 * I, H)
    G, U, D = dense_gu[:, :I], dense_gu[:, I:], dequant(QT.Q5_0, d, I).reshape(E, H, I)
    kern = native.MoEKernel(gate, up, down, threads=2, isa=isa)
    for T in (1, 64):
        x = torch.randn(T, H)
        ids, w = _routing(T, E, 2, seed=T)
        tol = 1e-4 if isa == "scalar" else (2e-2 if isa == "amx" and T > 1 else 4e-2)
        assert rel_err(kern(x, ids, w), ref_moe(x, ids, w, G, U, D)) < tol


@pytest.mark.skipif("amx" not in ISAS, reason="needs AMX tiles (the lent Xeon)")
@pytest.mark.parametrize("qt,dqt", [(QT.BF16, QT.BF16), (QT.Q4_K, QT.Q5_0)])
def test_amx_h_packed_by_the_epilogue_bit_for_bit(qt, dqt, monkeypatch):
    """On AMX tiles with a bf16 down, the gate/up epilogue packs h for the down GEMM itself (ktk_amx_c_to_pack):
    the same bits as h written in f32 rows and packed in the third phase (KTINJECT_AMX_FUSE_H=0), a layer with a
    row-dot expert (fewer tokens than a tile takes) beside the grouped ones, and within the layer's tolerance of
    the reference."""
    (gate, up, down), (G, U, D) = moe_case(qt, dqt, E=8, H=256, I=512, seed=7)
    T = 70
    x = torch.randn(T, 256)
    ids, w = _routing(T, 8, 2, seed=11)
    ids[:, 1] = torch.where(ids[:, 1] == 7, 6, ids[:, 1])
    ids[:, 0] = torch.where(ids[:, 0] == 7, 5, ids[:, 0])
    ids[0, 1] = 7                                              # expert 7: one token, the row-dot path
    fused = native.MoEKernel(gate, up, down, threads=3, isa="amx")(x, ids, w)
    monkeypatch.setenv("KTINJECT_AMX_FUSE_H", "0")
    rows = native.MoEKernel(gate, up, down, threads=3, isa="amx")(x, ids, w)
    assert torch.equal(fused, rows)
    assert rel_err(fused, ref_moe(x, ids, w, G, U, D)) < 2e-2


@pytest.mark.parametrize("threads", [1, 3, 5])
def test_thread_counts_agree(threads):
    """Results do not depend on the thread count, even oversubscribed (fixed summation order)."""
    (gate, up, down), _ = moe_case(QT.Q8_0, QT.Q8_0, seed=3)
    x = torch.randn(33, 256)
    ids, w = _routing(33, 8, 2, seed=1)
    base = native.MoEKernel(gate, up, down, threads=2)(x, ids, w)
    got = native.MoEKernel(gate, up, down, threads=threads)(x, ids, w)
    assert torch.equal(base, got)


@pytest.mark.parametrize("claim", ["3", "64"])
def test_claims_of_several_items_agree(claim, monkeypatch):
    """$KTINJECT_POOL_CLAIM (items taken per claim, read at pool creation; an A/B knob of the prefill
    layer) changes which worker runs an item, not the result: bit for bit the one-item claims', at
    decode and batch, on an oversubscribed pool, job after job."""
    (gate, up, down), _ = moe_case(QT.Q8_0, QT.Q8_0, seed=3)
    base = native.MoEKernel(gate, up, down, threads=2)
    monkeypatch.setenv("KTINJECT_POOL_CLAIM", claim)
    got = native.MoEKernel(gate, up, down, pool=native.Pool(8, pin=False))
    for T in (1, 33, 2, 80):
        x = torch.randn(T, 256)
        ids, w = _routing(T, 8, 2, seed=T)
        assert torch.equal(base(x, ids, w), got(x, ids, w)), (claim, T)


@pytest.mark.parametrize("bad", ["0", "65", "4x", "-2"])
def test_bad_claim_count_is_refused(bad, monkeypatch):
    monkeypatch.setenv("KTINJECT_POOL_CLAIM", bad)
    with pytest.raises(native.NativeError, match=f"KTINJECT_POOL_CLAIM='{bad}'.*1-64"):
        native.Pool(2)


def test_submit_sync_matches_forward():
    (gate, up, down), _ = moe_case(QT.Q4_0, QT.Q4_0, seed=4)
    kern = native.MoEKernel(gate, up, down, threads=2)
    x = torch.randn(5, 256)
    ids, w = _routing(5, 8, 2)
    want = kern(x, ids, w)
    kern.submit(x, ids, w)
    with pytest.raises(NativeError, match="twice"):
        kern.submit(x, ids, w)
    assert torch.equal(kern.sync(), want)
    with pytest.raises(NativeError, match="without a submit"):
        kern.sync()


def test_layers_share_one_pool():
    pool = native.Pool(2)
    (g1, u1, d1), dense1 = moe_case(QT.Q8_0, QT.Q8_0, seed=7)
    (g2, u2, d2), dense2 = moe_case(QT.BF16, QT.BF16, seed=8)
    k1 = native.MoEKernel(g1, u1, d1, pool=pool)
    k2 = native.MoEKernel(g2, u2, d2, pool=pool)
    x = torch.randn(3, 256)
    ids, w = _routing(3, 8, 2)
    for _ in range(3):
        y1, y2 = k1(x, ids, w), k2(x, ids, w)
    assert rel_err(y2, ref_moe(x, ids, w, *dense2)) < 1e-4
    assert rel_err(y1, ref_moe(x, ids, w, *dense1)) < 4e-2


def test_oversubscribed_pool_loses_and_repeats_no_item(monkeypatch):
    """Eight unpinned workers on this machine's few cores, jobs back to back and with gaps: workers
    are late for jobs, miss whole jobs and arrive after a job is done (phases end on completed
    items, claims carry the job's generation); every result must still equal the reference
    exactly, run after run. The pool's trace counts the jobs and names late workers by index."""
    monkeypatch.setenv("KTINJECT_POOL_TRACE", "1")
    pool = native.Pool(8, pin=False)
    (g, u, d), _ = moe_case(QT.Q8_0, QT.Q8_0, E=16, H=512, I=256, seed=11)
    kern = native.MoEKernel(g, u, d, pool=pool)
    single = native.MoEKernel(g, u, d, pool=native.Pool(1))
    gen = torch.Generator().manual_seed(5)
    cases = []
    for T in (1, 1, 3, 1, 7):
        x = torch.randn(T, 512, generator=gen)
        ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(T)])
        cases.append((x, ids, torch.rand(T, 4, generator=gen), None))
    cases = [(x, ids, w, single(x, ids, w)) for x, ids, w, _ in cases]
    native.pool_trace(pool)                                  # reset
    for r in range(60):
        x, ids, w, want = cases[r % len(cases)]
        assert torch.equal(kern(x, ids, w), want), f"run {r}"
        if r % 3 == 0:
            time.sleep(0.0003)                               # workers spin, yield, some go to sleep
    tr = native.pool_trace(pool)
    assert tr["jobs"] == 60 and tr["last_worker_max"] >= tr["last_worker_start"] >= tr["first_worker_start"] >= 0
    assert set(tr["late_by"]) <= set(range(8)) and sum(tr["late_by"].values()) == tr["late_jobs"] <= 60
    assert native.pool_trace(pool) is None                   # read and reset: nothing since


def test_empty_batch():
    (gate, up, down), _ = moe_case(QT.Q8_0, QT.Q8_0)
    kern = native.MoEKernel(gate, up, down, threads=2)
    out = kern(torch.zeros(0, 256), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2))
    assert out.shape == (0, 256)


def test_describe_and_isa_selection(monkeypatch):
    d = native.describe()
    assert d["available"] and "scalar" in d["compiled"] and "amx" in d["compiled"]
    assert d["isa"] in d["usable"] and d["threads"] >= 1
    monkeypatch.setenv("KTINJECT_ISA", "scalar")
    assert native.isa() == "scalar"
    monkeypatch.setenv("KTINJECT_ISA", "sse9")
    with pytest.raises(NativeError, match="not an ISA path"):
        native.isa()
    missing = [i for i in native.ISAS if i not in native.usable_isas()]
    if missing:
        monkeypatch.setenv("KTINJECT_ISA", missing[0])
        with pytest.raises(NativeError, match="not usable"):
            native.isa()


def test_bandwidth_probe_runs():
    gbps = native.probe_read_gbps(native.Pool(2), 64 << 20, reps=2)
    assert 0.1 < gbps < 10000


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q8_0, QT.Q6_K, QT.BF16], ids=lambda q: q.name)
def test_moe_nan_token_stays_nan(isa, qt, monkeypatch):
    """A token holding a NaN gives NaN in its own output row and leaves the others finite, on the row
    dots, the 8-bit grouped path and the f32 grouped path alike (the activation quantizers store such
    a block with d = NaN; a float-to-int conversion had turned it into huge finite values)."""
    (gate, up, down), _ = moe_case(qt, qt)
    x = torch.randn(40, 256)
    x[3, 17] = float("nan")
    ids, w = _routing(40, 8, 2, seed=3)
    for tile_min, vnni in (("100000", "1"), ("4", "1"), ("4", "0")):
        monkeypatch.setenv("KTINJECT_TILE_MIN", tile_min)
        monkeypatch.setenv("KTINJECT_VNNI_GROUPED", vnni)
        out = native.MoEKernel(gate, up, down, threads=2, isa=isa)(x, ids, w)
        assert torch.isnan(out[3]).any(), (isa, qt.name, tile_min, vnni)
        keep = torch.ones(40, dtype=torch.bool)
        keep[3] = False
        assert torch.isfinite(out[keep]).all(), (isa, qt.name, tile_min, vnni)


def test_describe_names_the_grouped_path(monkeypatch):
    """`ktinject doctor` (describe) says how the grouped (prefill) experts multiply on each path:
    the 8-bit types are exactly those VNNI_TYPES lists for the ISA, and
    $KTINJECT_VNNI_GROUPED=0 turns them off."""
    monkeypatch.delenv("KTINJECT_VNNI_GROUPED", raising=False)
    monkeypatch.setenv("KTINJECT_AVX512_BF16_GROUPED", "0")
    assert native.grouped_path("scalar") == "f32" and native.grouped_path("amx").startswith("AMX-BF16 tiles")
    for isa in ("avx2", "avx512"):
        if isa not in ISAS:
            continue
        want = ", ".join(q.name for q in sorted(VNNI_TYPES[isa], key=int))
        assert native.grouped_path(isa) == f"8-bit integers ({want}), f32 for other types"
        monkeypatch.setenv("KTINJECT_VNNI_GROUPED", "0")
        assert native.grouped_path(isa) == "f32"
        monkeypatch.delenv("KTINJECT_VNNI_GROUPED")
        monkeypatch.setenv("KTINJECT_PACKED_F32", "0")   # unpacked tokens: the 8-bit path is off too
        assert native.grouped_path(isa) == "f32"
        monkeypatch.delenv("KTINJECT_PACKED_F32")
    monkeypatch.setenv("KTINJECT_AVX512_BF16_GROUPED", "1")   # BF16 layers' dots, where the CPU has AVX512-BF16
    if "avx512" in ISAS:
        lib, _ = native.load()
        dots = "; bf16 dot products (AVX512-BF16) where gate, up and down are all BF16" if lib.ktk_avx512bf16_usable() else ""
        assert native.grouped_path("avx512").endswith(f"f32 for other types{dots}")
    monkeypatch.setenv("KTINJECT_ISA", "scalar")
    assert native.describe()["grouped"] == "f32"


def _ref_moe_bf16_tokens(x, ids, w, gate, up, down):
    """ref_moe with the rounding of the bf16 product paths: tokens and h rounded to bf16 before each
    projection, everything else in float64."""
    bf = lambda t: t.to(torch.bfloat16).double()   # noqa: E731
    out = torch.zeros(x.shape[0], gate.shape[2], dtype=torch.float64)
    xb = bf(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = gate[e].double() @ xb[t], up[e].double() @ xb[t]
            h = bf((g * torch.sigmoid(g) * u).float())
            out[t] += float(w[t, j]) * (down[e].double() @ h)
    return out.float()


def _avx512bf16() -> bool:
    return "avx512" in ISAS and bool(native.load()[0].ktk_avx512bf16_usable())


def test_avx512_bf16_dots_default_by_vendor(monkeypatch):
    """The AVX-512 path's BF16 layers take the AVX512-BF16 dots by default on AMD CPUs only (faster than the f32
    panels on Zen 4, slower on the lent Intel Xeon: docs/native.md); $KTINJECT_AVX512_BF16_GROUPED=1 / 0 decides
    anywhere the CPU has AVX512-BF16, and nothing turns them on where it has not."""
    lib, _ = native.load()
    monkeypatch.delenv("KTINJECT_AVX512_BF16_GROUPED", raising=False)
    assert native.avx512_bf16_grouped() == (_avx512bf16() and lib.ktk_cpu_vendor() == lib.KTK_VENDOR_AMD)
    monkeypatch.setenv("KTINJECT_AVX512_BF16_GROUPED", "1")
    assert native.avx512_bf16_grouped() == _avx512bf16()
    monkeypatch.setenv("KTINJECT_AVX512_BF16_GROUPED", "0")
    assert not native.avx512_bf16_grouped()


@pytest.mark.skipif(not _avx512bf16(), reason="needs the AVX-512 path on a CPU with AVX512-BF16")
@pytest.mark.parametrize("counts", [(1, 17, 48, 100), (64, 80, 2, 33)], ids=["tiles-1-2-3-7", "tiles-4-5-1-3"])
def test_moe_avx512_bf16_dots(counts, monkeypatch):
    """The AVX-512 path's BF16 layer on AVX512-BF16 dot products (native/amx.c ktk_dp_gemm): experts of 1 to 7
    token tiles, so each of the kernel's 1-, 2- and 3-tile blocks runs, against float64 on the tokens and h
    rounded to bf16 (what the dots multiply) tightly, against the plain reference within the bf16 tolerance,
    and $KTINJECT_AVX512_BF16_GROUPED=0 back on the f32 panels."""
    monkeypatch.setenv("KTINJECT_TILE_MIN", "1")
    monkeypatch.setenv("KTINJECT_AVX512_BF16_GROUPED", "1")   # (the default on AMD only)
    (gate, up, down), (G, U, D) = moe_case(QT.BF16, QT.BF16, E=4, H=256, I=512)
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(counts)])[torch.randperm(sum(counts))][:, None].contiguous()
    T = ids.shape[0]
    x, w = torch.randn(T, 256), torch.rand(T, 1)
    out = native.MoEKernel(gate, up, down, threads=2, isa="avx512")(x, ids, w)
    assert rel_err(out, _ref_moe_bf16_tokens(x, ids, w, G, U, D)) < 2e-4   # measured 1.3e-5 (f32 sums of exact products)
    assert rel_err(out, ref_moe(x, ids, w, G, U, D)) < 2e-2
    monkeypatch.setenv("KTINJECT_AVX512_BF16_GROUPED", "0")
    f32 = native.MoEKernel(gate, up, down, threads=2, isa="avx512")(x, ids, w)
    assert rel_err(f32, ref_moe(x, ids, w, G, U, D)) < 1e-4 and not torch.equal(out, f32)
