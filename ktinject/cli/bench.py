"""`ktinject bench experts ...`: native routed-experts layer throughput against the machine's
measured memory read bandwidth. `ktinject bench MODEL --rules R`: end-to-end prefill and decode
against the decode roofline (see ktinject/bench_model.py). The first positional argument selects
the target: `experts`, or a model path.

The weight set spans several GiB (layers are cycled) so that decode numbers measure memory,
not the last-level cache; the denominator is a native streaming-read probe run in the same
process with the same thread count (all threads, widest loads, best of three passes), once
beside each of `--rounds` slices of the time budget, since a shared host's bandwidth moves from
one minute to the next. `--caller native` (the default) hands the layers to the pool from C, as
the hybrid decode's doorbell thread does; `--caller python` calls `MoEKernel` from Python.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

from ..errors import KtInjectError, NativeError

NAME = "bench"
HELP = "benchmark the native CPU experts (`bench experts`) or a whole model (`bench MODEL --rules R`)"
log = logging.getLogger(__name__)

GIB = 1 << 30
TARGETS = {}


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise KtInjectError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p) -> None:
    p.add_argument("target", help="'experts' (routed-experts layer) or a model path (GGUF file or directory)")
    m = p.add_argument_group("model")
    m.add_argument("--rules", "-r", nargs="+", metavar="R", help="rule files or pack names (default: family pack)")
    m.add_argument("--prompt-lengths", default="512,2048,8192", help="prefill prompt lengths (comma-separated)")
    m.add_argument("--decode-tokens", type=int, default=64, help="tokens to decode (default 64)")
    m.add_argument("--chunk-size", type=int, default=None,
                   help="tokens per prefill chunk (default: 512, or what the model's operators ask for)")
    m.add_argument("--no-warm", action="store_true", help="do not fault in memory-mapped expert weights first")
    m.add_argument("--repeat", type=int, default=3, help="decode runs; the median is reported, with each run (default 3)")
    m.add_argument("--config-dir", default=None, help="HF config directory overriding the model's own")
    g = p.add_argument_group("experts")
    g.add_argument("--hidden", type=int, default=2048, help="hidden size H (default: DeepSeek-V2-Lite 2048)")
    g.add_argument("--inter", type=int, default=1408, help="expert intermediate size I (default 1408)")
    g.add_argument("--experts", type=int, default=64, help="routed experts per layer E (default 64)")
    g.add_argument("--topk", type=int, default=6, help="experts per token k (default 6)")
    g.add_argument("--quant", default="q4_k", help="weight type(s), comma-separated: q4_0,q8_0,q4_k,q5_k,q6_k,iq4_xs,bf16")
    g.add_argument("--batch", default="1", help="tokens per call, comma-separated (e.g. 1,512)")
    g.add_argument("--threads", default="0", help="worker threads, comma-separated (0 = all CPUs)")
    g.add_argument("--isa", default=None, help="force an ISA path: scalar, avx2, avx512, amx")
    g.add_argument("--gib", type=float, default=4.0, help="size of the cycled weight set in GiB (default 4)")
    g.add_argument("--probe-gib", type=float, default=4.0, help="bandwidth probe buffer in GiB (default 4; "
                   "also the model bench's)")
    g.add_argument("--seconds", type=float, default=1.0, help="time budget per configuration (default 1 s)")
    g.add_argument("--caller", choices=("native", "python"), default="native",
                   help="who hands the layers to the pool: 'native' (default) posts each layer from C as soon as "
                        "the one before is done, as the hybrid decode's doorbell thread does; 'python' calls "
                        "MoEKernel from Python each time, as the CPU-only path does")
    g.add_argument("--rounds", type=int, default=5,
                   help="the time budget is split into this many rounds, each measured beside its own pass of "
                        "the bandwidth probe (default 5)")
    g.add_argument("--int8", action="store_true",
                   help="give every layer I8 copies (weights requantized to 8 bits per row and group of values) "
                        "for the AMX-INT8 prefill path (cpu_experts option int8_prefill); decode still reads GGUF rows")
    g.add_argument("--int8-group", type=int, nargs="+", default=None, metavar="G",
                   help="with --int8: the copies' group sizes, one for gate/up and down alike or two (gate/up, "
                        "down); multiples of 64 that divide the rows, at most 1024 (default: I8 256 for V2-Lite's "
                        "gate/up, 704 for its down; I4 1024 and 704; cpu_experts option int8_group)")
    g.add_argument("--int8-bits", type=int, choices=(8, 4), default=8,
                   help="with --int8: 8 (I8 copies, the default) or 4 (I4 copies: 4 bits a weight, an integer "
                        "sub-scale per 64 values under a scale per row and group, half the bytes, coarser; "
                        "cpu_experts option int8_bits)")
    g.add_argument("--json", action="store_true", help="print one JSON object per configuration")
    g.add_argument("--trace", action="store_true", help="also report where a layer's time goes: microseconds "
                   "per pool phase (quantize tokens, gate+up, quantize h, down) and until the last worker starts, "
                   "and the layer's time, GB/s and fraction inside the pool's job (job_ms, job_gbps, job_fraction): "
                   "the rest of a call is the caller's side")


def run(args) -> int:
    fn = TARGETS.get(args.target)
    if fn is None:
        from pathlib import Path
        if not Path(args.target).exists():
            raise KtInjectError(f"bench target {args.target!r} is not a benchmark nor an existing model path "
                                f"(allowed: {', '.join(TARGETS)}, or a model path)")
        fn = bench_model
    return fn(args)


def bench_model(args) -> int:
    from ..bench_model import run_bench
    from . import console, err_console
    from ._common import pick_rules
    rules = pick_rules(args.rules, args.target, err_console, args.config_dir)
    res = run_bench(args.target, rules, prompt_lengths=_ints(args.prompt_lengths),
                    decode_tokens=args.decode_tokens, warm=not args.no_warm, repeat=args.repeat,
                    probe_gib=args.probe_gib, chunk_size=args.chunk_size,
                    progress=lambda msg: err_console.print(f"[dim]{msg}[/]"))
    if args.json:
        sys.stdout.write(json.dumps(res.to_dict()) + "\n")
        return 0
    from rich.table import Table
    t = Table(title=f"{args.target} with {res.rules}")
    t.add_column("measure")
    t.add_column("value", justify="right")
    for n, tps in res.prefill.items():
        t.add_row(f"prefill {n} tokens (chunks of {res.prefill_chunk})", f"{tps:.0f} tok/s")
    runs = ", ".join(f"{v:.1f}" for v in res.decode_runs)
    t.add_row(f"decode ({res.decode_mode}), steady, median of {len(res.decode_runs)}",
              f"{res.decode_tokens_per_s:.1f} tok/s ({runs})")
    t.add_row("decode, first steps included (eager step, capture)", f"{res.decode_tokens_per_s_incl_warmup:.1f} tok/s")
    t.add_row("CPU expert bytes / token", f"{res.cpu_expert_bytes_per_token / 1e6:.1f} MB")
    t.add_row("CPU other bytes / token", f"{res.cpu_dense_bytes_per_token / 1e6:.1f} MB")
    t.add_row(f"CPU read bandwidth ({res.threads} threads)", f"{res.cpu_bandwidth_gbps:.1f} GB/s"
              + (f" (beside each run: {', '.join(f'{v:.1f}' for v in res.cpu_bandwidth_runs)})"
                 if len(res.cpu_bandwidth_runs) > 1 else ""))
    t.add_row("GPU bytes / token", f"{res.gpu_bytes_per_token / 1e6:.1f} MB")
    t.add_row("GPU copy bandwidth", f"{res.gpu_bandwidth_gbps:.0f} GB/s")
    t.add_row("decode roofline", f"{res.roofline_tokens_per_s:.1f} tok/s")
    t.add_row("fraction of roofline", f"{res.fraction:.2f}")
    console.print(t)
    console.print(f"[dim]{'; '.join(res.notes)}[/]")
    return 0


def _make_layers(qt, dqt, E: int, H: int, I: int, gib: float):
    """Enough layers of random valid blocks to span `gib` GiB (copies, so each is distinct memory)."""
    from ..native import ExpertMatrix
    from ..native.synth import random_rows
    gate = random_rows(qt, E * I, H, seed=1)
    up = random_rows(qt, E * I, H, seed=2)
    down = random_rows(dqt, E * H, I, seed=3)
    layer_bytes = gate.numel() + up.numel() + down.numel()
    n = max(1, int(gib * GIB // layer_bytes))
    layers = []
    for i in range(n):
        g, u, d = (gate, up, down) if i == 0 else (gate.clone(), up.clone(), down.clone())
        layers.append((ExpertMatrix(int(qt), g, E, I, H, "gate"), ExpertMatrix(int(qt), u, E, I, H, "up"),
                       ExpertMatrix(int(dqt), d, E, H, I, "down")))
    return layers, layer_bytes


def down_type(qt, inter: int):
    """The down projection's type: llama.cpp stores rows that are not a multiple of 256 (V2-Lite's
    1408) in a fallback type; we follow it where we can: q4_k -> q5_0, q2_k and q3_k -> q4_0 (as
    `ktinject synth` writes them), q5_k and q6_k -> q8_0."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
    if inter % GGML_QUANT_SIZES[qt][0] == 0:
        return qt
    return {QT.Q4_K: QT.Q5_0, QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_0, QT.Q5_K: QT.Q8_0, QT.Q6_K: QT.Q8_0}.get(qt, QT.Q8_0)


MAX_BATCH = 1 << 16


def _check_experts_flags(args, quants, batches, threads_list) -> None:
    """Every flag of `bench experts` checked before anything is allocated: one message naming the flag."""
    import math

    from gguf import GGML_QUANT_SIZES

    from .. import native
    from ..sysmem import memory_total_available
    from ._common import human_bytes
    E, H, I, k = args.experts, args.hidden, args.inter, args.topk
    checks = (("--hidden", H, H >= 1, ">= 1"), ("--inter", I, I >= 1, ">= 1"), ("--experts", E, E >= 1, ">= 1"),
              ("--topk", k, 1 <= k <= max(E, 1), f"in 1..{E} (--experts)"),
              ("--batch", args.batch, bool(batches) and all(1 <= b <= MAX_BATCH for b in batches),
               f"integers in 1..{MAX_BATCH}"),
              ("--threads", args.threads, bool(threads_list), "one or more integers"),
              ("--gib", args.gib, math.isfinite(args.gib) and args.gib > 0, "> 0"),
              ("--probe-gib", args.probe_gib, math.isfinite(args.probe_gib) and args.probe_gib > 0, "> 0"),
              ("--seconds", args.seconds, math.isfinite(args.seconds) and args.seconds >= 0, ">= 0"),
              ("--rounds", args.rounds, 1 <= args.rounds <= 1000, "in 1..1000"))
    for flag, value, ok, want in checks:
        if not ok:
            raise KtInjectError(f"{flag} must be {want}, got {value!r}")
    if args.isa is not None and args.isa not in native.ISAS:
        raise KtInjectError(f"--isa {args.isa!r} is not an ISA path (allowed: {', '.join(native.ISAS)})")
    _, avail = memory_total_available()
    for qt in quants:
        dqt = down_type(qt, I)
        (bs, ts), (dbs, dts) = GGML_QUANT_SIZES[qt], GGML_QUANT_SIZES[dqt]
        for flag, n, t, b in (("--hidden", H, qt, bs), ("--inter", I, dqt, dbs)):
            if n % b:
                raise KtInjectError(f"{flag} {n} is not a multiple of the {t.name.lower()} block ({b} values)")
        layer = 2 * E * I * (H // bs * ts) + E * H * (I // dbs * dts)
        if avail and layer > avail:
            raise KtInjectError(f"one layer of --experts {E} x --hidden {H} x --inter {I} in {qt.name.lower()} "
                                f"is {human_bytes(layer)}, more than the {human_bytes(avail)} of memory available")


def _int8_group_flag(args, H: int, I: int) -> tuple[int, int]:
    """--int8-group as (gate/up, down) group sizes (0: the default), checked against the shape."""
    from ..native import moe
    if args.int8_group is not None and not args.int8:
        raise KtInjectError("--int8-group sizes the I8 copies of --int8; add --int8")
    if getattr(args, "int8_bits", 8) != 8 and not args.int8:
        raise KtInjectError("--int8-bits sets the width of the copies of --int8; add --int8")
    g = args.int8_group or [0]
    if len(g) > 2:
        raise KtInjectError(f"--int8-group takes one or two sizes (gate/up, down), got {len(g)}")
    g_gu, g_dn = (g[0], g[0]) if len(g) == 1 else (g[0], g[1])
    try:
        bits = getattr(args, "int8_bits", 8)
        moe.check_i8_group(g_gu, H, f"--int8-group for gate/up (--hidden {H})", bits)
        moe.check_i8_group(g_dn, I, f"--int8-group for down (--inter {I})", bits)
    except NativeError as exc:
        raise KtInjectError(str(exc)) from None
    return g_gu, g_dn


def bench_experts(args) -> int:
    import torch
    from .. import native
    from ..native import MoEKernel, Pool, Probe, probe_amx_gemm
    from ..native.synth import parse_quant
    from ..testing import random_routing
    if not native.available():
        raise NativeError(native.missing_reason() or "native kernels unavailable")
    try:
        quants = [parse_quant(q) for q in args.quant.split(",")]
    except ValueError as exc:
        raise KtInjectError(str(exc)) from None
    batches, threads_list = _ints(args.batch), _ints(args.threads)
    E, H, I, k = args.experts, args.hidden, args.inter, args.topk
    _check_experts_flags(args, quants, batches, threads_list)
    groups = _int8_group_flag(args, H, I)
    isa_name = native.ISAS[native.isa_index(args.isa)]
    if args.trace:
        os.environ["KTINJECT_POOL_TRACE"] = "1"          # read when a pool is created
    rows = []
    for qt in quants:
        dqt = down_type(qt, I)
        layers, layer_bytes = _make_layers(qt, dqt, E, H, I, args.gib)
        expert_bytes = layer_bytes // E
        for nth in threads_list:
            pool = Pool(nth)
            probe = Probe(pool, int(args.probe_gib * GIB))
            kernels = [MoEKernel(g, u, d, pool=pool, isa=args.isa, int8_prefill=True if args.int8 else None,
                                 int8_group=groups, int8_bits=args.int8_bits) for g, u, d in layers]
            int8 = bool(kernels[0].int8_copies)
            i8_bytes = (2 * native.i8_expert_bytes(I, H, groups[0], args.int8_bits)
                        + native.i8_expert_bytes(H, I, groups[1], args.int8_bits))
            dot_bytes = sum(m.rows * (native.r16_row_bytes(m.ggml_type, m.cols) if name in kernels[0].repacked
                                      else m.data.shape[1]) for name, m in zip(("gate", "up", "down"), layers[0]))
            if args.int8 and not int8:
                raise KtInjectError("--int8: no I8 copies were made (the log says why); they need the amx path "
                                    "on a CPU with AMX-INT8")
            for T in batches:
                x = torch.randn(T, H)
                routes = [random_routing(T, E, k, seed) for seed in range(4)]
                route_bytes = [_route_bytes(ids, E, dot_bytes, i8_bytes if int8 else expert_bytes) for ids, _ in routes]
                for i, kern in enumerate(kernels):          # warm up every layer once
                    kern(x, *routes[i % 4])
                tiles_before = probe_amx_gemm(pool) if isa_name == "amx" else None
                rounds, traces = [], []
                for _ in range(args.rounds):
                    bw = probe.gbps(reps=3, isa_name=args.isa)
                    if args.trace:
                        native.pool_trace(pool)             # drop the probe's (and tile probe's) jobs
                    rounds.append((bw, *_timed_calls(args, kernels, x, routes, route_bytes)))
                    if args.trace:
                        traces.append(native.pool_trace(pool) or {})
                el = sum(r[1] for r in rounds)
                n_calls = sum(r[2] for r in rounds)
                bytes_read = sum(r[3] for r in rounds)
                bw = sum(r[0] * r[1] for r in rounds) / el    # each probe pass weighted by the time it stood beside
                ms = 1e3 * el / n_calls
                gbps = bytes_read / el / 1e9
                flops = 2.0 * 3 * H * I * T * k
                row = {"quant": qt.name.lower(), "down_quant": dqt.name.lower(), "batch": T, "threads": pool.threads, "isa": isa_name,
                       "caller": args.caller, "int8_prefill": int8,
                       "repacked": list(kernels[0].repacked),   # R16 copies (decode reads them), how they are read
                       "r16_stream": native.r16_stream() if kernels[0].repacked else None,
                       "int8_group": list(kernels[0].int8_groups) if int8 else None,
                       "int8_bits": kernels[0].int8_bits,
                       "bf16_tiles": list(kernels[0].bf16_tile_copies),   # BF16 tile copies the prefill tiles read
                       "ms_per_layer": round(ms, 4), "tokens_per_s": round(T / (ms / 1e3), 1),
                       "gbps": round(gbps, 2), "bandwidth_gbps": round(bw, 2), "fraction": round(gbps / bw, 3),
                       "rounds": [{"bandwidth_gbps": round(b, 2), "gbps": round(nb / t / 1e9, 2),
                                   "fraction": round(nb / t / 1e9 / b, 3)} for b, t, _, nb in rounds],
                       "tflops": round(flops / (ms / 1e3) / 1e12, 3), "layers": len(layers),
                       "weight_set_gib": round(len(layers) * layer_bytes / GIB, 2),
                       "shape": {"hidden": H, "inter": I, "experts": E, "topk": k}}
                if args.trace:
                    tr = row["trace_us"] = _merge_traces(traces)
                    if tr.get("done"):                      # the layer inside the pool's job: post to done
                        job_gbps = bytes_read / n_calls / (tr["done"] * 1e-6) / 1e9
                        row.update(job_ms=round(tr["done"] / 1e3, 4), job_gbps=round(job_gbps, 2),
                                   job_fraction=round(job_gbps / bw, 3))
                if tiles_before is not None:               # the tile unit's speed around the run (it can move 3x)
                    row["amx_probe_us"] = _tile_probe(tiles_before, probe_amx_gemm(pool))
                rows.append(row)
                if args.json:
                    sys.stdout.write(json.dumps(row) + "\n")     # machine-readable: one object per line
                    sys.stdout.flush()
            del kernels, probe, pool
    if not args.json:
        _table(rows)
    return 0


MAX_CALLS = 100000      # per round


def _route_bytes(ids, E: int, dot_bytes: int, grouped_bytes: int) -> int:
    """Weight bytes one layer call reads: per routed expert, what its path reads: the row dots
    (fewer than 4 tokens, $KTINJECT_TILE_MIN) `dot_bytes` (GGUF rows, or R16 copies where made), the
    grouped path `grouped_bytes` (GGUF rows, or I8 copies)."""
    import torch
    counts = torch.bincount(ids.flatten(), minlength=E)
    used = int((counts > 0).sum())
    try:
        tile_min = max(1, int(os.environ.get("KTINJECT_TILE_MIN", "4")))
    except ValueError:
        tile_min = 4
    grouped = int((counts >= tile_min).sum())
    return (used - grouped) * dot_bytes + grouped * grouped_bytes


def _timed_calls(args, kernels, x, routes, route_bytes) -> tuple[float, int, int]:
    """One round: layers called for `--seconds / --rounds` (and at least once each), cycling the
    kernels and the routings from the first of each. Returns (seconds, calls, bytes read)."""
    budget = args.seconds / args.rounds
    n = len(kernels)

    def nbytes(calls: int) -> int:
        q, r = divmod(calls, len(routes))
        return q * sum(route_bytes) + sum(route_bytes[:r])

    if args.caller == "native":                     # chains of native calls, longer until the budget is spent
        from ..native import run_chain
        el = total = read = 0
        calls = n
        while True:
            dt, _ = run_chain(kernels, x, routes, calls)
            el, total, read = el + dt, total + calls, read + nbytes(calls)
            if el >= budget or total >= MAX_CALLS:
                return el, total, read
            calls = max(n, min(MAX_CALLS - total, int(calls * (budget - el) / max(dt, 1e-9)) + 1))
    calls, t0 = 0, time.perf_counter()
    while True:
        ids, w = routes[calls % len(routes)]
        kernels[calls % n](x, ids, w)
        calls += 1
        el = time.perf_counter() - t0
        if el >= budget and calls >= n or calls >= MAX_CALLS:
            return el, calls, nbytes(calls)


def _merge_traces(traces: list[dict]) -> dict:
    """The rounds' pool traces as one: per-job times weighted by each round's job count, counts
    summed, the worst lateness kept."""
    traces = [t for t in traces if t.get("jobs")]
    if not traces:
        return {}
    jobs = sum(t["jobs"] for t in traces)
    out = {"jobs": jobs}
    for key in traces[0]:
        if key in ("jobs", "late_jobs", "late_by", "last_worker_max"):
            continue
        out[key] = round(sum(t[key] * t["jobs"] for t in traces) / jobs, 1)
    out["last_worker_max"] = max(t["last_worker_max"] for t in traces)
    out["late_jobs"] = sum(t["late_jobs"] for t in traces)
    late_by: dict = {}
    for t in traces:
        for w, c in t["late_by"].items():
            late_by[w] = late_by.get(w, 0) + c
    out["late_by"] = late_by
    return out


def _tile_probe(before: list[float], after: list[float]) -> dict:
    """The workers' tile GEMM times before and after a measurement: medians, and the extremes.
    Hot, this GEMM runs 3.4-3.7 us on the lent Xeon's tile unit at full speed (4.2-4.6 us before its three
    token tiles took one pass, twenty-eighth session) and 11-15 us when the host slows it
    (docs/benchmarks.md, fourteenth session)."""
    med = lambda v: sorted(v)[len(v) // 2]   # noqa: E731
    return {"before": round(med(before), 2), "after": round(med(after), 2),
            "min": round(min(before + after), 2), "max": round(max(before + after), 2)}


def _table(rows) -> None:
    from rich.table import Table
    from . import console
    t = Table(title="routed-experts layer (native)")
    for col in ("quant", "batch", "threads", "isa", "caller", "ms/layer", "tok/s", "GB/s", "probe GB/s", "fraction",
                "TFLOPS"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["quant"], str(r["batch"]), str(r["threads"]), r["isa"], r.get("caller", ""), f"{r['ms_per_layer']:.3f}",
                  f"{r['tokens_per_s']:.0f}", f"{r['gbps']:.1f}", f"{r['bandwidth_gbps']:.1f}",
                  f"{r['fraction']:.2f}", f"{r['tflops']:.2f}")
    console.print(t)
    for r in rows:
        if len(r.get("rounds", ())) > 1:
            fr = [x["fraction"] for x in r["rounds"]]
            bw = [x["bandwidth_gbps"] for x in r["rounds"]]
            console.print(f"{r['quant']} batch {r['batch']}, {r['threads']} threads: {len(fr)} rounds, each beside its "
                          f"own probe pass: probe {min(bw):.1f}-{max(bw):.1f} GB/s, fraction {min(fr):.2f}-{max(fr):.2f}")
        if "job_ms" in r:
            console.print(f"{r['quant']} batch {r['batch']}, {r['threads']} threads: inside the pool's job (post to done) "
                          f"{r['job_ms']:.3f} ms, {r['job_gbps']:.1f} GB/s, fraction {r['job_fraction']:.2f}; the rest "
                          f"of a call, {1e3 * (r['ms_per_layer'] - r['job_ms']):.0f} us, is the caller's side")
        if "amx_probe_us" in r:
            p = r["amx_probe_us"]
            console.print(f"{r['quant']} batch {r['batch']}, {r['threads']} threads: AMX tile probe (32x48x2048 GEMM a "
                          f"worker, median us) {p['before']} before, {p['after']} after, range {p['min']}-{p['max']}")


TARGETS["experts"] = bench_experts
