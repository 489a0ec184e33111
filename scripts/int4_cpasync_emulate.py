"""Schedule check of ktk_int4_diag's cp.async weight ring (compile flag CPA): replays one warp's issue/wait/read
order and checks that every read of a ring slot finds the batch the kernel wants there, with the copies landing
as late as `cp.async.wait_group CPA - 2` allows or as early as they are issued. Also checks that each copy
instruction's 32 lanes cover contiguous bytes of whole row runs and that the ring's reads are free of bank
conflicts. Development aid (the CUDA code itself runs only on a GPU): python scripts/int4_cpasync_emulate.py"""
from __future__ import annotations

import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def replay(n_tiles: int, nt0: int, nt_step: int, nb: int, stages: int, early: bool) -> None:
    slots = [None] * stages            # what each slot holds: (tile, batch)
    pending = []                       # committed groups not yet landed: [(slot, (tile, batch)) or None]

    def issue(t_index: int):
        tile, b = nt0 + (t_index // nb) * nt_step, t_index % nb
        group = (t_index % stages, (tile, b)) if tile < n_tiles else None
        if early and group:
            slots[group[0]] = group[1]
        pending.append(group)

    def wait(keep: int):
        while len(pending) > keep:
            g = pending.pop(0)
            if g:
                slots[g[0]] = g[1]

    for s in range(stages - 1):        # prologue: global stage s (the kernel's (s / NB, s % NB))
        issue(s)
    k = 0
    while nt0 + k * nt_step < n_tiles:
        tile = nt0 + k * nt_step
        for b in range(nb):
            t = k * nb + b
            wait(stages - 2)
            issue(t + stages - 1)      # the slot read at t - 1: free after the warp barrier
            assert slots[b % stages] == (tile, b), (n_tiles, nt0, nt_step, nb, stages, early, t, slots)
        k += 1


def copy_pattern(v: int) -> None:
    from ktinject.operators.kernels.int4_cuda import ring_pitch
    rp = ring_pitch(v)
    for i in range(v):                 # instruction i: lane l copies quad q = 32 i + l of the 8 x 4v batch
        quads = [(q // (4 * v), q % (4 * v)) for q in range(32 * i, 32 * i + 32)]
        rows = {r for r, _ in quads}
        for r in rows:                 # per row one contiguous run
            cols = sorted(c for rr, c in quads if rr == r)
            assert cols == list(range(cols[0], cols[0] + len(cols))), (v, i, r)
    for phase in range(4):             # a warp's 16-byte reads go 8 lanes at a time: lane (g, c) reads g*RP + c
        units = [(lane >> 2) * rp + (lane & 3) for lane in range(8 * phase, 8 * phase + 8)]
        assert len({u % 8 for u in units}) == 8, (v, phase, units)


def main() -> int:
    cases = 0
    for n_tiles, warps_total, nb, stages in itertools.product((1, 5, 13, 64), (1, 3, 8), (1, 2, 4, 8, 16), (2, 3, 4)):
        if nb % stages:
            continue                   # (diag_stages never picks such a depth)
        for nt0 in range(warps_total):
            for early in (False, True):
                replay(n_tiles, nt0, warps_total, nb, stages, early)
                cases += 1
    for v in (1, 2, 3, 4, 8, 16):
        copy_pattern(v)
    print(f"ok: {cases} schedules, copy and read patterns for V = 1, 2, 3, 4, 8, 16")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
