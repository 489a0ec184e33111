"""Triton kernels of `mla_attention`'s fused decode step (one query token per sequence).

The torch form of an absorbed MLA decode step is ~30 small kernels per layer (rope as complex
or cos/sin arithmetic with dtype copies, the cache scatter, a position mask built and inverted,
two bmm's, a scale, a masked fill, a softmax, the W_UV einsum and a layout copy), and at batch 1
in a CUDA graph each costs a launch, not work. Here it is two kernels after the W_UK bmm:

* `mla_decode_split`, grid (batch, head blocks, key splits): flash-decoding over the latent
  cache. A program takes a block of heads (all heads share the keys: the cache holds one latent
  and one rope key per token) and one split of CH key positions, and keeps an online softmax:
  scores = scale * (q_lat . latent + rope(q_pe) . k_pe), tensor-core dots against the cached
  tile. The query token's own entry is not read from the cache: the program whose split holds
  the position ropes the new key, scores it from registers and (head block 0 only) writes it
  to the cache, so no program ever reads a slot another one writes.
* `mla_decode_combine`, grid (batch, heads, value blocks): merges the splits' partial softmax
  states and applies W_UV [H, dv, R] to the merged latent, writing `[B, H * dv]` rows ready for
  `o_proj` (no layout copy).

Roundings follow the torch path where they are visible: the roped q_pe, the new cache entry and
the merged latent are rounded to the activation dtype as the torch code rounds them; scores and
the softmax are fp32 (torch rounds scores to the activation dtype once; the kernel does not).

Rope forms (`ROPE`): 0 = complex `freqs_cis` on interleaved pairs (V2), 1 = cos/sin on
interleaved pairs with de-interleaved output (V3 `rope_interleave`), 2 = rotate-half cos/sin.
Every output element j is `x[i1(j)] * A(j) + x[i2(j)] * B(j)`, the layout `apply_rope` writes.
"""
from __future__ import annotations

import functools

import torch

from .pdl import note_release_of, triton_gdc_launch_dependents, triton_release

ROPE_COMPLEX, ROPE_INTERLEAVED, ROPE_HALF = 0, 1, 2


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl
    gdc_launch_dependents = triton_gdc_launch_dependents()   # (a no-op where Triton has none: RELEASE is never set)

    @triton.jit
    def _rope(rope_a, rope_b, j, r, ROPE: tl.constexpr):
        # the gather indices and coefficients of output elements j: out[j] = x[i1] * a + x[i2] * b
        half = r // 2
        if ROPE == 0:       # freqs_cis as (cos, sin) pairs: rope_a points at view_as_real(freqs)
            p = j // 2
            c = tl.load(rope_a + 2 * p, mask=j < r, other=0.0).to(tl.float32)
            s = tl.load(rope_a + 2 * p + 1, mask=j < r, other=0.0).to(tl.float32)
            i1 = j
            i2 = j ^ 1
            a = c
            b = tl.where((j % 2) == 1, s, -s)
        elif ROPE == 1:
            lo = j < half
            i = tl.where(lo, j, j - half)
            i1 = tl.where(lo, 2 * i, 2 * i + 1)
            i2 = tl.where(lo, 2 * i + 1, 2 * i)
            a = tl.load(rope_a + i, mask=j < r, other=0.0).to(tl.float32)
            s = tl.load(rope_b + i, mask=j < r, other=0.0).to(tl.float32)
            b = tl.where(lo, -s, s)
        else:
            lo = j < half
            i1 = j
            i2 = tl.where(lo, j + half, j - half)
            a = tl.load(rope_a + j, mask=j < r, other=0.0).to(tl.float32)
            s = tl.load(rope_b + j, mask=j < r, other=0.0).to(tl.float32)
            b = tl.where(lo, -s, s)
        return i1, i2, a, b

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:            # fp32 caches: no tf32 rounding of the operands
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    # the kernels find their jit helpers among the module's globals (closures are not looked up)
    globals().update(_rope=_rope, _dot=_dot)

    @triton.jit
    def mla_decode_split(qlat_ptr, q_ptr, lat_ptr, kpe_ptr, rope_a_ptr, rope_b_ptr, pos_ptr, cache_ptr,
                         m_ptr, l_ptr, o_ptr,
                         H, R, r, L, NS, CH, scale,
                         s_qlat_h, s_qlat_b, s_q_b, s_q_h, s_lat_b, s_kpe_b, s_rope_b, s_pos_b, s_c_b, s_c_l,
                         ROPE: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr, BRP: tl.constexpr,
                         BL: tl.constexpr, IEEE: tl.constexpr):
        # qlat: [H, B, R] q_nope @ W_UK   q: [B, H, *] (q_pe = the r values at q_ptr)   lat: [B, R]
        # normalized latent   kpe: [B, r] unroped rope key   cache: [B, L, R + r]   pos: [B]
        # partials: m, l: [B, H, NS]   o: [B, H, NS, R] (fp32)
        b = tl.program_id(0)
        hb = tl.program_id(1)
        sp = tl.program_id(2)
        pos = tl.load(pos_ptr + b * s_pos_b)
        start = sp * CH
        if start <= pos:                              # splits past the position have nothing to do
            dt = cache_ptr.dtype.element_ty
            heads = hb * BH + tl.arange(0, BH)
            hmask = heads < H
            rr = tl.arange(0, BR)
            rmask = rr < R
            jj = tl.arange(0, BRP)
            jmask = jj < r
            ql = tl.load(qlat_ptr + heads[:, None] * s_qlat_h + b * s_qlat_b + rr[None, :],
                         mask=hmask[:, None] & rmask[None, :], other=0.0).to(dt)             # [BH, BR]
            i1, i2, ra, rb = _rope(rope_a_ptr + b * s_rope_b, rope_b_ptr + b * s_rope_b, jj, r, ROPE)
            qrow = q_ptr + b * s_q_b + heads[:, None] * s_q_h
            qm = hmask[:, None] & jmask[None, :]
            qpe = tl.load(qrow + i1[None, :], mask=qm, other=0.0).to(tl.float32) * ra[None, :] \
                + tl.load(qrow + i2[None, :], mask=qm, other=0.0).to(tl.float32) * rb[None, :]
            qpe = qpe.to(q_ptr.dtype.element_ty).to(dt)                                      # [BH, BRP]

            m_i = tl.full((BH,), float("-inf"), tl.float32)
            l_i = tl.zeros((BH,), tl.float32)
            acc = tl.zeros((BH, BR), tl.float32)
            end = tl.minimum(tl.minimum(start + CH, pos), L)   # cached keys of this split: [start, end)
            row = cache_ptr + b * s_c_b
            for k0 in range(start, end, BL):
                keys = k0 + tl.arange(0, BL)
                kmask = keys < end
                c = tl.load(row + keys[:, None] * s_c_l + rr[None, :], mask=kmask[:, None] & rmask[None, :],
                            other=0.0)                                                        # [BL, BR]
                kp = tl.load(row + keys[:, None] * s_c_l + R + jj[None, :], mask=kmask[:, None] & jmask[None, :],
                             other=0.0)                                                       # [BL, BRP]
                s = _dot(ql, tl.trans(c), IEEE) + _dot(qpe, tl.trans(kp), IEEE)                      # [BH, BL]
                s = tl.where(kmask[None, :], s * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + _dot(p.to(dt), c, IEEE)
                m_i = m_new
            if (pos < start + CH) & (pos < L):            # this split holds the query token's own entry
                lat = tl.load(lat_ptr + b * s_lat_b + rr, mask=rmask, other=0.0).to(dt)      # [BR]
                k1, k2, ka, kb = _rope(rope_a_ptr + b * s_rope_b, rope_b_ptr + b * s_rope_b, jj, r, ROPE)
                krow = kpe_ptr + b * s_kpe_b
                kpe = tl.load(krow + k1, mask=jmask, other=0.0).to(tl.float32) * ka \
                    + tl.load(krow + k2, mask=jmask, other=0.0).to(tl.float32) * kb
                kpe = kpe.to(kpe_ptr.dtype.element_ty).to(dt)                               # [BRP]
                if hb == 0:
                    tl.store(row + pos * s_c_l + rr, lat, mask=rmask)
                    tl.store(row + pos * s_c_l + R + jj, kpe, mask=jmask)
                latf = lat.to(tl.float32)
                s1 = (tl.sum(ql.to(tl.float32) * latf[None, :], axis=1)
                      + tl.sum(qpe.to(tl.float32) * kpe.to(tl.float32)[None, :], axis=1)) * scale   # [BH]
                m_new = tl.maximum(m_i, s1)
                alpha = tl.exp(m_i - m_new)
                p1 = tl.exp(s1 - m_new)
                l_i = l_i * alpha + p1
                acc = acc * alpha[:, None] + p1.to(dt).to(tl.float32)[:, None] * latf[None, :]
                m_i = m_new
            part = (b * H + heads) * NS + sp                                                  # [BH]
            tl.store(m_ptr + part, m_i, mask=hmask)
            tl.store(l_ptr + part, l_i, mask=hmask)
            tl.store(o_ptr + part[:, None] * R + rr[None, :], acc, mask=hmask[:, None] & rmask[None, :])

    @triton.jit
    def mla_decode_combine(m_ptr, l_ptr, o_ptr, pos_ptr, wuv_ptr, out_ptr,
                           H, R, DV, L, NS, CH, s_pos_b, s_out_b,
                           BR: tl.constexpr, BV: tl.constexpr, BS: tl.constexpr, RELEASE: tl.constexpr):
        # merges the splits of (b, h), applies W_UV [H, DV, R]; out: [B, H * DV]
        if RELEASE:                                  # o_proj's GEMV may launch now and load its weights (pdl.py)
            gdc_launch_dependents()
        b = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        pos = tl.load(pos_ptr + b * s_pos_b)
        nvalid = tl.where((pos >= 0) & (pos < L), pos // CH + 1, 0)    # else no split: 0 / 0, NaN rows
        base = (b * H + h) * NS
        ss = tl.arange(0, BS)
        smask = ss < nvalid
        ms = tl.load(m_ptr + base + ss, mask=smask, other=float("-inf"))
        mx = tl.max(ms, axis=0)
        ls = tl.load(l_ptr + base + ss, mask=smask, other=0.0)
        denom = tl.sum(tl.where(smask, tl.exp(ms - mx) * ls, 0.0), axis=0)
        rr = tl.arange(0, BR)
        rmask = rr < R
        acc = tl.zeros((BR,), tl.float32)
        for s in range(0, nvalid):
            w = tl.exp(tl.load(m_ptr + base + s) - mx)
            acc += w * tl.load(o_ptr + (base + s) * R + rr, mask=rmask, other=0.0)
        dt = out_ptr.dtype.element_ty
        olat = (acc / denom).to(dt).to(tl.float32)                                        # [BR]
        vv = vb * BV + tl.arange(0, BV)
        vmask = vv < DV
        w = tl.load(wuv_ptr + (h * DV + vv[:, None]) * R + rr[None, :], mask=vmask[:, None] & rmask[None, :],
                    other=0.0).to(tl.float32)                                             # [BV, BR]
        o = tl.sum(w * olat[None, :], axis=1)
        tl.store(out_ptr + b * s_out_b + h * DV + vv, o.to(dt), mask=vmask)

    return mla_decode_split, mla_decode_combine


def split_size(cache_len: int, block: int = 32, max_splits: int = 128) -> int:
    """Key positions per split: a power of two >= `block`, so at most `max_splits` splits cover
    the cache (a decode step on a long cache spreads over that many programs per head block)."""
    ch = block
    while ch * max_splits < cache_len:
        ch *= 2
    return ch


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
               rope_mode: int, rope_a: torch.Tensor, rope_b: torch.Tensor, pos: torch.Tensor,
               cache: torch.Tensor, scale: float, w_uv: torch.Tensor) -> torch.Tensor:
    """One absorbed decode step for B sequences; writes each token's cache entry at `pos`.

    q_lat: [H, B, R] (q_nope @ W_UK, any strides with unit stride along R)
    q_pe: [B, H, r] unroped (unit stride along r)   latent: [B, R] normalized   k_pe: [B, r] unroped
    rope_a / rope_b: per sequence, [B, 2 * (r/2)] float view of freqs_cis (mode 0, rope_b unused)
    or cos / sin [B, r] (modes 1, 2); stride 0 along B broadcasts one row
    pos: [B] int64   cache: [B', L, R + r] (B' >= B)   w_uv: [H, dv, R] contiguous
    returns [B, H * dv] in the cache's dtype. The positions stay on the device (no host sync): a
    sequence whose position is outside [0, L) writes nothing and gets a row of NaN, where the
    torch path's scatter would stop with a device-side assert.
    """
    import triton
    split, combine = _kernels()
    H, B, R = q_lat.shape
    r = q_pe.shape[-1]
    dv = w_uv.shape[1]
    L = cache.shape[1]
    for name, t in (("q_lat", q_lat), ("q_pe", q_pe), ("latent", latent), ("k_pe", k_pe), ("cache", cache),
                    ("rope_a", rope_a), ("rope_b", rope_b)):
        if t.stride(-1) != 1:
            raise ValueError(f"mla_decode: {name} needs unit stride along its last dimension")
    if not w_uv.is_contiguous() or cache.shape[-1] != R + r or w_uv.shape != (H, dv, R):
        raise ValueError(f"mla_decode: shapes disagree (cache {list(cache.shape)}, w_uv {list(w_uv.shape)}, "
                         f"H={H} R={R} r={r})")
    bl = 32
    ch = split_size(L, bl)
    ns = triton.cdiv(L, ch)
    bh = 16
    dev = q_lat.device
    m = torch.empty(B, H, ns, device=dev, dtype=torch.float32)
    l_ = torch.empty(B, H, ns, device=dev, dtype=torch.float32)
    o = torch.empty(B, H, ns, R, device=dev, dtype=torch.float32)
    br = triton.next_power_of_2(max(R, 16))
    brp = triton.next_power_of_2(max(r, 16))
    s_rope = rope_a.stride(0) if rope_a.shape[0] > 1 else 0
    split[(B, triton.cdiv(H, bh), ns)](
        q_lat, q_pe, latent, k_pe, rope_a, rope_b, pos, cache, m, l_, o,
        H, R, r, L, ns, ch, float(scale),
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), latent.stride(0), k_pe.stride(0),
        s_rope, pos.stride(0), cache.stride(0), cache.stride(1),
        ROPE=rope_mode, BH=bh, BR=br, BRP=brp, BL=bl, IEEE=cache.dtype == torch.float32, num_warps=8 if br >= 256 else 4)
    out = torch.empty(B, H * dv, device=dev, dtype=cache.dtype)
    bv = min(32, triton.next_power_of_2(dv))
    release = triton_release(dev)
    k = combine[(B, H, triton.cdiv(dv, bv))](
        m, l_, o, pos, w_uv, out, H, R, dv, L, ns, ch, pos.stride(0), out.stride(0),
        BR=br, BV=bv, BS=triton.next_power_of_2(ns), RELEASE=release, num_warps=4)
    if release:
        note_release_of(k)
    return out
