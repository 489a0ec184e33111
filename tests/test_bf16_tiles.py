"""BF16 tile copies (native/amx.c, ktk_bt_repack) for the AMX-BF16 prefill path: the copy's layout
against the GGUF rows, its refusals, the option's refusals off the AMX path, and on a CPU with AMX the
layer with copies against the layer without, bit for bit. The tile loop on copies also runs on
emulated tiles in tests/test_amx_emulated.py (native/amx_emulate_check.c), on any x86 CPU."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ktinject import native
from ktinject.errors import NativeError
from ktinject.native import moe as nmoe

from test_native_util import moe_case, rand_rows

pytestmark = pytest.mark.skipif(not native.available(), reason="native extension not built")

AMX = native.available() and "amx" in native.usable_isas()


def _tiles(rows: torch.Tensor, E: int, R: int, n: int) -> torch.Tensor:
    """The layout ktk.h states, from bf16 rows [E * R, n]: per expert, per block of 32 rows, k-step ks's
    32 values of row r at (ks * 32 + r) * 32."""
    v = rows.view(torch.int16).reshape(E, R // 32, 32, n // 32, 32)      # [e][block][r][ks][i]
    return v.permute(0, 1, 3, 2, 4).contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("E,R,n", [(3, 64, 256), (2, 32, 1408), (1, 96, 32)])
def test_copy_is_the_rows_in_tile_order(E, R, n):
    w = rand_rows(QT.BF16, E * R, n, seed=21)
    m = native.ExpertMatrix(int(QT.BF16), w, E, R, n, "w")
    for pool in (None, native.default_pool(2)):
        cp = nmoe.repack_bt(m, pool)
        assert cp.shape == (E * nmoe.bt_expert_bytes(R, n),) and nmoe.bt_expert_bytes(R, n) == R * n * 2
        assert torch.equal(cp, _tiles(w, E, R, n))


def test_copy_follows_stride_and_offset():
    """The up half of a fused [E, 2I, H] gate_up tensor (offset I, stride 2I)."""
    E, I, H = 2, 64, 256
    gu = rand_rows(QT.BF16, E * 2 * I, H, seed=4)
    cp = nmoe.repack_bt(native.ExpertMatrix(int(QT.BF16), gu, E, I, H, "up", stride=2 * I, offset=I))
    up = gu.reshape(E, 2 * I, -1)[:, I:].reshape(E * I, -1)
    assert torch.equal(cp, _tiles(up, E, I, H))


def test_copy_refusals():
    q = rand_rows(QT.Q8_0, 64, 256)
    with pytest.raises(NativeError, match=r"gate: BF16 tile copies are made from BF16 rows, not GGML type 8"):
        nmoe.repack_bt(native.ExpertMatrix(int(QT.Q8_0), q, 1, 64, 256, "gate"))
    w = rand_rows(QT.BF16, 48, 256)
    with pytest.raises(NativeError, match=r"down: no BF16 tile copy for 48 rows of 256 values \(both must be multiples of 32\)"):
        nmoe.repack_bt(native.ExpertMatrix(int(QT.BF16), w, 1, 48, 256, "down"))
    assert nmoe.bt_expert_bytes(64, 48) == -1 and nmoe.bt_expert_bytes(0, 64) == -1


def test_bf16_tiles_mode(monkeypatch):
    all3, down = ("gate", "up", "down"), ("down",)
    monkeypatch.delenv("KTINJECT_AMX_BF16_TILES", raising=False)
    assert [nmoe.bf16_tiles_mode(v) for v in (None, True, "all", "down", False)] == [(), all3, all3, down, ()]
    monkeypatch.setenv("KTINJECT_AMX_BF16_TILES", "1")
    assert [nmoe.bf16_tiles_mode(v) for v in (None, "down", False)] == [all3, down, ()]
    monkeypatch.setenv("KTINJECT_AMX_BF16_TILES", "down")
    assert [nmoe.bf16_tiles_mode(v) for v in (None, True)] == [down, all3]
    monkeypatch.setenv("KTINJECT_AMX_BF16_TILES", "0")
    assert nmoe.bf16_tiles_mode(True) == ()
    monkeypatch.delenv("KTINJECT_AMX_BF16_TILES")
    with pytest.raises(NativeError, match=r"bf16_tiles: 'up' is not one of True, False, None, 'all', 'down'"):
        nmoe.bf16_tiles_mode("up")


def _refused(caplog, mats, isa: str) -> tuple:
    """A kernel asked for tile copies where it makes none: its copies and the log's words."""
    nmoe._warned.clear()
    with caplog.at_level("WARNING", logger="ktinject.native.moe"):
        kern = native.MoEKernel(*mats, threads=1, isa=isa, bf16_tiles=True)
    return kern.bf16_tile_copies, caplog.text


def test_off_the_amx_path_it_says_why_and_makes_no_copies(caplog):
    copies, log = _refused(caplog, moe_case(QT.BF16, QT.BF16, E=2)[0], "scalar")
    assert copies == () and "bf16 tiles: off: the scalar path is in use" in log


@pytest.mark.skipif(not AMX, reason="needs AMX (Sapphire Rapids or later) with tile permission")
def test_no_bf16_matrix_says_so(caplog):
    copies, log = _refused(caplog, moe_case(QT.Q4_K, QT.Q8_0, E=2)[0], "amx")
    assert copies == () and "no BF16 expert matrix here" in log


@pytest.mark.skipif(not AMX, reason="needs AMX (Sapphire Rapids or later) with tile permission")
@pytest.mark.parametrize("dqt", [QT.BF16, QT.Q8_0], ids=["bf16", "q8_0-down"])
@pytest.mark.parametrize("T", [1, 40, 100])
def test_moe_kernel_bf16_tiles_on_amx(dqt, T, monkeypatch):
    """The same values in the same tiles: the layer with copies gives the bits of the layer reading the GGUF
    rows in place, prefill (grouped) and decode (T = 1, which reads the rows) alike; a Q8_0 down keeps its rows."""
    monkeypatch.setenv("KTINJECT_TILE_MIN", "4")
    (gate, up, down), _ = moe_case(QT.BF16, dqt, E=6, H=256, I=512)
    kern = native.MoEKernel(gate, up, down, threads=3, isa="amx", bf16_tiles=True)
    plain = native.MoEKernel(gate, up, down, threads=3, isa="amx")
    assert kern.bf16_tile_copies == (("gate", "up", "down") if dqt == QT.BF16 else ("gate", "up"))
    assert plain.bf16_tile_copies == ()
    if dqt == QT.BF16:   # the down's copy alone (gate and up read in place): the same bits too
        only = native.MoEKernel(gate, up, down, threads=3, isa="amx", bf16_tiles="down")
        assert only.bf16_tile_copies == ("down",)
    else:
        only = plain
    x = torch.randn(T, 256)
    ids, w = torch.rand(T, 6).topk(2, dim=1).indices.contiguous(), torch.rand(T, 2)
    assert torch.equal(kern(x, ids, w), plain(x, ids, w)) and torch.equal(only(x, ids, w), plain(x, ids, w))
