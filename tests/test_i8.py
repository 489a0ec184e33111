"""I8 copies (native/i8.c) for the AMX-INT8 prefill path: the requantized values against GGML's
dequantization, the layer with copies against the torch reference on a CPU with AMX-INT8, and the
option's refusals elsewhere. The tile loop itself also runs on emulated tiles in
tests/test_amx_emulated.py (native/amx_emulate_check.c), on any x86 CPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ktinject import native
from ktinject.errors import NativeError
from ktinject.native import moe as nmoe

from test_native_util import dequant, moe_case, rand_rows, ref_moe, rel_err

pytestmark = pytest.mark.skipif(not native.available(), reason="native extension not built")


def _int8_usable() -> bool:
    lib, _ = native.load()
    return bool(lib.ktk_amx_int8_usable())


AMX_INT8 = native.available() and _int8_usable()


@pytest.mark.parametrize("qt,n", [(QT.Q4_K, 512), (QT.Q5_0, 1408), (QT.Q8_0, 192), (QT.BF16, 256), (QT.Q6_K, 256)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_copy_is_within_half_a_step_of_ggml(qt, n):
    E, rows = 3, 64
    w = rand_rows(qt, E * rows, n, seed=11)
    cp = native.repack_i8(native.ExpertMatrix(int(qt), w, E, rows, n, "w"), native.default_pool(2))
    es = native.i8_expert_bytes(rows, n)
    assert cp.shape == (E * es,) and es == (rows * n + rows * (n // nmoe_group(n)) * 4 + 63) // 64 * 64
    ref = dequant(qt, w, n).reshape(E, rows, n)
    G = nmoe_group(n)
    for e in range(E):
        got = native.i8_dequant(cp[e * es:(e + 1) * es], rows, n)
        step = ref[e].abs().reshape(rows, n // G, G).amax(-1) / 127      # each group's scale
        err = (got - ref[e]).abs().reshape(rows, n // G, G)
        assert (err <= step[..., None] * 0.5 * (1 + 1e-5) + 1e-30).all(), (qt.name, e)
        assert rel_err(got, ref[e]) < 1e-2


@pytest.mark.parametrize("qt,n,group", [(QT.Q4_K, 512, 0), (QT.Q5_0, 1408, 0), (QT.Q8_0, 192, 64), (QT.BF16, 256, 0),
                                         (QT.Q6_K, 2048, 512)], ids=lambda v: getattr(v, "name", str(v)))
def test_i4_copy_is_within_half_its_step_of_ggml(qt, n, group):
    """I4 copies (int8_bits 4), read from their layout here (native/i8.c): nibbles q + 8, an f32 scale S per
    row and group, a sub-scale k - 1 per 64 values. S is the group's largest need / 16 (need: the step that
    holds a sub-group unclipped, max(max / 7, -min / 8)); each value is the nearest of S k [-8, 7] to GGML's
    (within half a step but past the clipped ends); each sub-group's k no worse in squared error than the
    unclipped one, ceil(need / S); i8_dequant gives S * (k q)."""
    E, rows = 2, 64
    w = rand_rows(qt, E * rows, n, seed=12)
    cp = native.repack_i8(native.ExpertMatrix(int(qt), w, E, rows, n, "w"), group=group, bits=4)
    G = group or nmoe.i8_group(n, 4)
    assert G == (group or {512: 512, 1408: 704, 256: 256}[n])
    NG, KS = n // G, n // 64
    es = native.i8_expert_bytes(rows, n, group, bits=4)
    assert cp.shape == (E * es,) and es == (rows * n // 2 + rows * NG * 4 + rows * KS + 63) // 64 * 64
    ref = dequant(qt, w, n).reshape(E, rows, n).double()
    for e in range(E):
        b = cp[e * es:(e + 1) * es]
        nib = b[:rows * n // 2].reshape(rows // 32, KS, 16, 64).long()          # [block][ks][i][j]
        u = torch.stack([nib & 15, nib >> 4], 2).reshape(rows // 32, KS, 32, 64)  # rows i, 16 + i
        u = u.permute(0, 2, 1, 3).reshape(rows, n)
        S = b[rows * n // 2:rows * n // 2 + rows * NG * 4].view(torch.float32).reshape(rows, NG).double()
        kc = b[rows * n // 2 + rows * NG * 4:rows * n // 2 + rows * NG * 4 + rows * KS].reshape(rows // 32, KS, 32)
        k = (kc.permute(0, 2, 1).reshape(rows, KS).long() + 1)
        assert (kc < 16).all()
        q = u - 8
        step = S.repeat_interleave(G // 64, 1) * k                               # [rows, KS]
        got = native.i8_dequant(b, rows, n, group, bits=4).double()
        assert torch.equal(got.float(), (S.float().repeat_interleave(G, 1) * (k.repeat_interleave(64, 1) * q).float()))
        r = ref[e]
        sub = r.reshape(rows, KS, 64)
        need = torch.maximum(sub.amax(-1).clamp(min=0) / 7, (-sub.amin(-1)).clamp(min=0) / 8)   # [rows, KS]
        top = need.reshape(rows, NG, G // 64).amax(-1)
        assert torch.allclose(S * 16, top, rtol=1e-6, atol=0)
        st = step.repeat_interleave(64, 1)
        nearest = (r / st).round().clamp(-8, 7)
        assert torch.equal(q.double(), nearest)
        inside = (r <= 7.5 * st) & (r >= -8.5 * st)
        assert ((got - r).abs()[inside] <= st[inside] * 0.5 * (1 + 1e-6)).all(), (qt.name, e)
        k0 = (need / S.repeat_interleave(G // 64, 1)).ceil().clamp(1, 16)
        st0 = (S.repeat_interleave(G // 64, 1) * k0).repeat_interleave(64, 1)
        sse = ((q * st - r) ** 2).reshape(rows, KS, 64).sum(-1)
        sse0 = (((r / st0).round().clamp(-8, 7) * st0 - r) ** 2).reshape(rows, KS, 64).sum(-1)
        assert (sse <= sse0 * (1 + 1e-12)).all()
        assert rel_err(got.float(), r.float()) < 0.12


def test_int8_bits_refusals():
    w = native.ExpertMatrix(int(QT.Q8_0), rand_rows(QT.Q8_0, 32, 256), 1, 32, 256, "w")
    for bad in (3, 16, True, "4"):
        with pytest.raises(NativeError, match="int8_bits must be 8 .* or 4"):
            native.repack_i8(w, bits=bad)
    (gate, up, down), _ = moe_case(QT.Q4_K, QT.Q8_0, E=2, H=256, I=512)
    with pytest.raises(NativeError, match="int8_bits must be 8 .* or 4 .*, got 2"):
        native.MoEKernel(gate, up, down, threads=1, int8_bits=2)


def nmoe_group(n: int) -> int:
    lib, _ = native.load()
    return int(lib.ktk_i8_group(n))


def test_group_and_shape_rules():
    # a multiple of 64 dividing n: the smallest >= 256 up to 1024, else the largest below 256
    ns = (2048, 1408, 192, 7168, 768, 320, 2944, 32, 100)
    assert [nmoe_group(n) for n in ns] == [256, 704, 192, 256, 256, 320, 128, -1, -1]
    assert native.i8_expert_bytes(48, 256) == -1 and native.i8_expert_bytes(64, 96) == -1
    w = rand_rows(QT.Q8_0, 48, 256)
    with pytest.raises(NativeError, match="no I8 copy for 48 rows of 256 values"):
        native.repack_i8(native.ExpertMatrix(int(QT.Q8_0), w, 1, 48, 256, "w"))
    with pytest.raises(NativeError, match=r"w: 64 rows, expected at least 128 for 2 experts of 64 rows"):
        native.repack_i8(native.ExpertMatrix(int(QT.Q8_0), rand_rows(QT.Q8_0, 64, 256), 2, 64, 256, "w"))
    r16 = native.repack_r16(native.ExpertMatrix(int(QT.Q8_0), rand_rows(QT.Q8_0, 64, 256), 1, 64, 256, "w"))
    with pytest.raises(NativeError, match="I8 copies are made from GGUF rows, not 'r16' ones"):
        native.repack_i8(r16)
    with pytest.raises(NativeError, match="i8_dequant: expected a contiguous uint8 tensor"):
        native.i8_dequant(torch.zeros(10, dtype=torch.uint8), 64, 256)


@pytest.mark.parametrize("group", [64, 128, 704])
def test_copy_with_a_chosen_group(group):
    """A group size other than the default: the layout's bytes, every value within half a step of its
    own group's scale, and the reader taking the same group."""
    E, rows, n = 2, 32, 1408
    w = rand_rows(QT.Q5_0, E * rows, n, seed=5)
    cp = native.repack_i8(native.ExpertMatrix(int(QT.Q5_0), w, E, rows, n, "down"), group=group)
    es = native.i8_expert_bytes(rows, n, group)
    assert cp.numel() == E * es and es == (rows * n + rows * (n // group) * 4 + 63) // 64 * 64
    ref = dequant(QT.Q5_0, w, n).reshape(E, rows, n)
    for e in range(E):
        got = native.i8_dequant(cp[e * es:(e + 1) * es], rows, n, group)
        step = ref[e].abs().reshape(rows, n // group, group).amax(-1) / 127
        err = (got - ref[e]).abs().reshape(rows, n // group, group)
        assert (err <= step[..., None] * 0.5 * (1 + 1e-5) + 1e-30).all(), (group, e)


def test_group_refusals_name_the_sizes_that_fit():
    assert nmoe.i8_groups_for(1408) == [64, 128, 704] and nmoe.i8_groups_for(2048) == [64, 128, 256, 512, 1024]
    lib, _ = native.load()
    assert nmoe.I8_GMAX == lib.KTK_I8_GMAX
    w = native.ExpertMatrix(int(QT.Q8_0), rand_rows(QT.Q8_0, 32, 1408), 1, 32, 1408, "blk.0.ffn_down_exps")
    with pytest.raises(NativeError, match=r"blk.0.ffn_down_exps: int8 group size 256 does not fit rows of 1408 "
                                          r"values: .* \(here: 64, 128, 704; 0: the default, 704\)"):
        native.repack_i8(w, group=256)
    with pytest.raises(NativeError, match="int8 group size must be an integer, got '128'"):
        native.repack_i8(w, group="128")
    with pytest.raises(NativeError, match="i8_dequant: int8 group size 96 does not fit"):
        native.i8_dequant(torch.zeros(10, dtype=torch.uint8), 32, 1408, 96)
    (gate, up, down), _ = moe_case(QT.Q4_K, QT.Q8_0, E=2, H=256, I=512)
    with pytest.raises(NativeError, match=r"int8_group for down \(.*\): int8 group size 1024 does not fit rows of 512"):
        native.MoEKernel(gate, up, down, threads=1, int8_group=(256, 1024))
    with pytest.raises(NativeError, match="int8_group: expected one group size or a pair"):
        native.MoEKernel(gate, up, down, threads=1, int8_group=[64, 64, 64])


def test_copy_follows_stride_and_offset():
    """The up half of a fused [E, 2I, H] gate_up tensor (offset I, stride 2I)."""
    E, I, H = 2, 64, 256
    gu = rand_rows(QT.Q4_K, E * 2 * I, H, seed=4)
    cp = native.repack_i8(native.ExpertMatrix(int(QT.Q4_K), gu, E, I, H, "up", stride=2 * I, offset=I))
    es = native.i8_expert_bytes(I, H)
    want = dequant(QT.Q4_K, gu, H).reshape(E, 2 * I, H)[:, I:]
    for e in range(E):
        assert rel_err(native.i8_dequant(cp[e * es:(e + 1) * es], I, H), want[e]) < 1e-2


def test_int8_mode(monkeypatch):
    monkeypatch.delenv("KTINJECT_AMX_INT8", raising=False)
    assert [nmoe.int8_mode(v) for v in (None, True, False)] == [False, True, False]
    monkeypatch.setenv("KTINJECT_AMX_INT8", "1")
    assert [nmoe.int8_mode(v) for v in (None, False)] == [True, False]
    monkeypatch.setenv("KTINJECT_AMX_INT8", "0")
    assert nmoe.int8_mode(True) is False


@pytest.mark.skipif(AMX_INT8, reason="this CPU has AMX-INT8: the copies are made")
def test_int8_prefill_elsewhere_says_why_and_makes_no_copies(caplog):
    (gate, up, down), _ = moe_case(QT.Q4_K, QT.Q8_0, E=2)
    nmoe._warned.clear()
    with caplog.at_level("WARNING", logger="ktinject.native.moe"):
        kern = native.MoEKernel(gate, up, down, threads=1, int8_prefill=True)
    assert kern.int8_copies == () and "int8 prefill: off: " in caplog.text


@pytest.mark.skipif(not AMX_INT8, reason="needs AMX-INT8 (Sapphire Rapids or later) with tile permission")
@pytest.mark.parametrize("qt,dqt", [(QT.Q4_K, QT.Q5_0), (QT.Q8_0, QT.Q8_0), (QT.BF16, QT.BF16)], ids=["q4_k+q5_0", "q8_0", "bf16"])
@pytest.mark.parametrize("T", [1, 40, 100])
def test_moe_kernel_int8_on_amx(qt, dqt, T, monkeypatch):
    """Grouped experts on 8-bit tiles against the torch reference on GGML's values (tolerance: int8
    weights per row and group, int8 tokens per token and group); decode (T = 1) reads GGUF rows, the
    same bits as without copies."""
    monkeypatch.setenv("KTINJECT_TILE_MIN", "4")
    (gate, up, down), (G, U, D) = moe_case(qt, dqt, E=6, H=256, I=512)
    kern = native.MoEKernel(gate, up, down, threads=3, isa="amx", int8_prefill=True)
    plain = native.MoEKernel(gate, up, down, threads=3, isa="amx")
    assert kern.int8_copies == ("gate", "up", "down") and plain.int8_copies == ()
    x = torch.randn(T, 256)
    ids, w = torch.rand(T, 6).topk(2, dim=1).indices.contiguous(), torch.rand(T, 2)
    out, ref = kern(x, ids, w), ref_moe(x, ids, w, G, U, D)
    assert rel_err(out, ref) < 4e-2, (qt.name, T)   # measured 0.021-0.029 at T = 40, 100 (H = 256, I = 512)
    if T == 1:
        assert torch.equal(out, plain(x, ids, w))
    small = native.MoEKernel(gate, up, down, threads=3, isa="amx", int8_prefill=True, int8_group=(64, 128))
    assert kern.int8_groups == (256, 256) and small.int8_groups == (64, 128)
    assert rel_err(small(x, ids, w), ref) < 4e-2, (qt.name, T)


@pytest.mark.skipif(not AMX_INT8, reason="needs AMX-INT8 (Sapphire Rapids or later) with tile permission")
@pytest.mark.parametrize("qt,dqt", [(QT.Q4_K, QT.Q5_0), (QT.Q8_0, QT.Q8_0), (QT.BF16, QT.BF16)], ids=["q4_k+q5_0", "q8_0", "bf16"])
@pytest.mark.parametrize("T", [1, 40, 100])
def test_moe_kernel_int4_on_amx(qt, dqt, T, monkeypatch):
    """I4 copies on the same 8-bit tiles: against the torch reference on GGML's values the layer's
    error is the 4-bit steps' (0.08-0.17 on these random blocks in the emulated check), and exactly
    the layer computed in float from the copies' own values (i8_dequant) within the tokens' 8 bits;
    decode (T = 1) reads GGUF rows, the same bits as without copies."""
    monkeypatch.setenv("KTINJECT_TILE_MIN", "4")
    E, H, I = 6, 256, 512
    (gate, up, down), (G, U, D) = moe_case(qt, dqt, E=E, H=H, I=I)
    kern = native.MoEKernel(gate, up, down, threads=3, isa="amx", int8_prefill=True, int8_bits=4)
    plain = native.MoEKernel(gate, up, down, threads=3, isa="amx")
    assert kern.int8_copies == ("gate", "up", "down") and kern.int8_bits == 4
    x = torch.randn(T, H)
    ids, w = torch.rand(T, E).topk(2, dim=1).indices.contiguous(), torch.rand(T, 2)
    out = kern(x, ids, w)
    if T == 1:
        assert torch.equal(out, plain(x, ids, w))
        return
    assert rel_err(out, ref_moe(x, ids, w, G, U, D)) < 0.3, (qt.name, T)
    def values(name, rows, cols):
        es = native.i8_expert_bytes(rows, cols, bits=4)
        return torch.stack([native.i8_dequant(kern.i8[name][e * es:(e + 1) * es], rows, cols, bits=4) for e in range(E)])
    own = ref_moe(x, ids, w, values("gate", I, H), values("up", I, H), values("down", H, I))
    assert rel_err(out, own) < 4e-2, (qt.name, T)   # the tokens' 8 bits, as the I8 path against GGML's values


def test_cpu_experts_int8_prefill_option():
    from ktinject.operators import registry
    Op = registry.get("cpu_experts")
    assert Op.Options().int8_prefill is False and Op.Options(int8_prefill=True).int8_prefill is True
    with pytest.raises(ValueError, match="int8_prefill must be true or false, got 'yes'"):
        Op.Options(int8_prefill="yes")
    assert Op.Options().int8_group == 0 and Op.Options(int8_group=[256, 704]).int8_group == (256, 704)
    for bad in (100, "256", [256], [256, 704, 64], True, -64):
        with pytest.raises(ValueError, match="int8_group must be 0 .* a multiple of 64, or a pair"):
            Op.Options(int8_group=bad)
    from ktinject.errors import RuleError
    from ktinject.operators.registry import make_options
    assert make_options(Op, {"int8_prefill": True, "int8_group": [256, 704]}).int8_group == (256, 704)
    assert Op.Options().int8_bits == 8 and make_options(Op, {"int8_prefill": True, "int8_bits": 4}).int8_bits == 4
    for bad in (3, "4", True):
        with pytest.raises(ValueError, match="int8_bits must be 8 .* or 4"):
            Op.Options(int8_bits=bad)
    with pytest.raises(RuleError, match="int8_group must be") as exc:
        make_options(Op, {"int8_group": 100}, file="rules.yaml", line=3)
    assert "rules.yaml" in str(exc.value) and "3" in str(exc.value)


def test_bench_int8_group_flag():
    import argparse
    from ktinject.cli.bench import _int8_group_flag
    from ktinject.errors import KtInjectError
    ns = argparse.Namespace
    assert _int8_group_flag(ns(int8=True, int8_group=None), 2048, 1408) == (0, 0)
    assert _int8_group_flag(ns(int8=True, int8_group=[128]), 2048, 1408) == (128, 128)
    assert _int8_group_flag(ns(int8=True, int8_group=[512, 704]), 2048, 1408) == (512, 704)
    with pytest.raises(KtInjectError, match="add --int8"):
        _int8_group_flag(ns(int8=False, int8_group=[128]), 2048, 1408)
    with pytest.raises(KtInjectError, match=r"--int8-group for down \(--inter 1408\): int8 group size 512 does not fit"):
        _int8_group_flag(ns(int8=True, int8_group=[512]), 2048, 1408)
    with pytest.raises(KtInjectError, match="--int8-bits sets the width of the copies of --int8; add --int8"):
        _int8_group_flag(ns(int8=False, int8_group=None, int8_bits=4), 2048, 1408)
    assert _int8_group_flag(ns(int8=True, int8_group=None, int8_bits=4), 2048, 1408) == (0, 0)


def test_bench_counts_the_bytes_each_path_reads():
    from ktinject.cli.bench import _route_bytes
    ids = torch.tensor([[0, 1]] * 5 + [[2, 3]])           # experts 0, 1: 5 tokens (grouped); 2, 3: 1 token
    assert _route_bytes(ids, 8, 100, 100) == 400
    assert _route_bytes(ids, 8, 100, 180) == 2 * 100 + 2 * 180     # I8 copies on the grouped path
    assert _route_bytes(ids, 8, 103, 100) == 2 * 103 + 2 * 100     # R16 copies on the row dots


@pytest.mark.skipif(not AMX_INT8, reason="needs AMX-INT8 (Sapphire Rapids or later) with tile permission")
def test_nan_token_gives_nan_rows_on_amx(monkeypatch):
    """A NaN in one token's values makes that token's output NaN and no other (the AVX-512 packing
    checks each group for NaN: max alone drops them)."""
    monkeypatch.setenv("KTINJECT_TILE_MIN", "4")
    (gate, up, down), _ = moe_case(QT.Q8_0, QT.Q8_0, E=2, H=256, I=512)
    kern = native.MoEKernel(gate, up, down, threads=2, isa="amx", int8_prefill=True)
    x = torch.randn(20, 256)
    x[3, 5] = float("nan")
    ids, w = torch.tensor([[0, 1]] * 20), torch.full((20, 2), 0.5)
    out = kern(x, ids, w)
    assert out[3].isnan().all() and not out[torch.arange(20) != 3].isnan().any()


def _tile_order_outputs(isa: str = "amx") -> list:
    """Layers on the tile path (I8 copies, I4 copies, bf16 tiles) over 6 experts, top-2, on 100, 150 and 230
    tokens: experts of about 3, 4 and 5 token tiles, so that every pass order of the tile GEMMs runs; and top-1
    with I = 64, where h is too small to hold the once-quantized tokens (their own buffer instead)."""
    outs = []
    for I, k in ((512, 2), (64, 1)):
        for bits in (8, 4, 0):
            (gate, up, down), _ = moe_case(QT.Q4_K, QT.Q5_0, E=6, H=256, I=I)
            kw = {"int8_prefill": True, "int8_bits": bits} if bits else {}
            kern = native.MoEKernel(gate, up, down, threads=3, isa=isa, **kw)
            for T in (100, 150, 230):
                gen = torch.Generator().manual_seed(T)
                x = torch.randn(T, 256, generator=gen)
                ids = torch.rand(T, 6, generator=gen).topk(k, dim=1).indices.contiguous()
                outs.append(kern(x, ids, torch.rand(T, k, generator=gen)))
    return outs


def _tile_orders_agree(env: str, tmp_path: Path, isa: str) -> None:
    want = _tile_order_outputs(isa)
    out = tmp_path / "orders.pt"
    code = (f"import sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_i8; "
            f"torch.save(test_i8._tile_order_outputs({isa!r}), {str(out)!r})")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "KTINJECT_TILE_MIN": "4", **dict(kv.split("=") for kv in env.split(","))})
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(out)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), (env, i)


@pytest.mark.skipif(not AMX_INT8, reason="needs AMX-INT8 (Sapphire Rapids or later) with tile permission")
@pytest.mark.parametrize("env", ["KTINJECT_AMX_TRIPLE=0", "KTINJECT_AMX_GROUP_MAJOR=1",
                                 "KTINJECT_AMX_TRIPLE=0,KTINJECT_AMX_GROUP_MAJOR=1", "KTINJECT_PACK_ONCE=0",
                                 "KTINJECT_PACK_NT=0"])
def test_tile_pass_orders_agree_on_amx(env, tmp_path, monkeypatch):
    """The tile GEMMs' pass orders (three token tiles in one pass or a pair and a lone one; passes over all of K
    or group by group) sum the same products in the same order, and the tokens quantized once or in each
    expert's packing are the same bytes, and so are the packs written through the caches or past them
    (KTINJECT_PACK_NT): the same bits as the defaults', on real tiles. Those settings are read
    once per process (or per layer), so each runs in a subprocess."""
    monkeypatch.setenv("KTINJECT_TILE_MIN", "4")
    _tile_orders_agree(env, tmp_path, "amx")
