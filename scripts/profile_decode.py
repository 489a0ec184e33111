"""Where one hybrid decode step spends its time, on a synthesized model (default rules: the
DeepSeek-V2 hybrid pack). Run on the lent machine (`bash scripts/device_e2e.sh profile`):

    python scripts/profile_decode.py /tmp/v2lite.gguf --rules deepseek-v2 [--torch-profile]

1. decode tokens/s in three modes: CUDA graph with stream-ordered CPU experts (the default),
   the same without the graph, and the Python-driven path (KTINJECT_STREAM_ORDERED=0);
2. the pool's trace per MoE layer in each mode (KTINJECT_POOL_TRACE): post -> first worker
   running, post -> last worker running, post -> done, and the caller's wait;
3. the same CPU layers alone, back to back with random routing, on the model's memory-mapped
   weights and on copies of them in anonymous memory (memory-type effects);
4. the machine's transparent-huge-page setting.
"""
import argparse
import os
import time

os.environ.setdefault("KTINJECT_POOL_TRACE", "1")     # before the pool exists

import torch  # noqa: E402

import ktinject  # noqa: E402
from ktinject import native  # noqa: E402
from ktinject.generate import generate  # noqa: E402


def trace(pool):
    lib, ffi = native.load()
    out = ffi.new("double[8]")
    if lib.ktk_pool_trace(pool.ptr, out, 8) < 5 or out[0] == 0:
        return "trace off"
    n = out[0]
    return (f"{int(n)} jobs: first worker {out[1] / n:.0f} us, last worker {out[2] / n:.0f} us, phases end "
            f"{out[5] / n:.0f}/{out[6] / n:.0f}/{out[7] / n:.0f} us, done {out[3] / n:.0f} us after post; "
            f"caller waited {out[4] / n:.0f} us")


def thread_cpu():
    """{tid: (name, cpu seconds, last CPU)} of this process's threads (/proc/self/task)."""
    hz = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            raw = open(f"/proc/self/task/{tid}/stat").read()
        except OSError:
            continue
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        f = raw[raw.rindex(")") + 2:].split()
        out[tid] = (name, (int(f[11]) + int(f[12])) / hz, int(f[36]))
    return out


def busy_threads(before, after, seconds):
    rows = []
    for tid, (name, cpu, last) in after.items():
        used = cpu - before.get(tid, (name, 0.0, 0))[1]
        if used > 0.02 * seconds:
            rows.append((used / seconds, name, tid, last))
    rows.sort(reverse=True)
    return ", ".join(f"{name}[{tid}]@cpu{last} {100 * u:.0f}%" for u, name, tid, last in rows[:24])


def kernels(model):
    return [m.kernel for m in model.modules() if getattr(m, "kernel", None) is not None
            and isinstance(m.kernel, native.MoEKernel)]


def layer_loop(ks, tokens=32, k=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, ks[0].hidden) * 0.1
    routes = [torch.randperm(ks[0].n_experts, generator=g)[:k].view(1, k) for _ in range(tokens * len(ks))]
    w = torch.full((1, k), 1.0 / k)
    for kern in ks:                       # warm
        kern.forward(x, routes[0], w)
    t0 = time.perf_counter()
    i = 0
    for _ in range(tokens):
        for kern in ks:
            kern.forward(x, routes[i], w)
            i += 1
    return (time.perf_counter() - t0) / (tokens * len(ks)) * 1e3


def anon_copy(kern):
    from ktinject.native.moe import ExpertMatrix, MoEKernel
    mats = []
    for m in (kern.gate, kern.up, kern.down):
        data = torch.empty_like(m.data)
        data.copy_(m.data)
        mats.append(ExpertMatrix(m.ggml_type, data, m.n_experts, m.rows, m.cols, m.name, m.stride, m.offset))
    return MoEKernel(*mats, pool=kern.pool)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rules", default="deepseek-v2")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--modes", default="graph,eager,python", help="of graph, eager, python")
    ap.add_argument("--no-layers", action="store_true", help="skip the CPU-layers-alone loops")
    args = ap.parse_args()
    for f in ("enabled", "defrag"):
        try:
            print(f"THP {f}:", open(f"/sys/kernel/mm/transparent_hugepage/{f}").read().strip())
        except OSError:
            pass
    model, tok = ktinject.optimize_and_load(args.model, args.rules)
    from ktinject.bench_model import warm_experts
    print(f"warm experts {warm_experts(model):.1f} s")
    ks = kernels(model)
    pool = ks[0].pool
    print(f"{len(ks)} CPU MoE layers, {pool.threads} threads, isa {native.isa()}")
    prompt = list(range(3, 131))
    modes = {"graph": ("graph + stream-ordered", {}, "auto"), "eager": ("eager + stream-ordered", {}, "off"),
             "python": ("eager, Python-driven", {"KTINJECT_STREAM_ORDERED": "0"}, "auto")}
    for label, env, graph in (modes[m] for m in args.modes.split(",")):
        os.environ.update(env)
        try:
            generate(model, tok, prompt, max_new_tokens=8, cuda_graph=graph)
            trace(pool)
            t0, before = time.perf_counter(), thread_cpu()
            r = generate(model, tok, prompt, max_new_tokens=args.steps, cuda_graph=graph)
            print(f"{label} threads over {time.perf_counter() - t0:.2f} s:",
                  busy_threads(before, thread_cpu(), time.perf_counter() - t0))
            print(f"{label}: decode {r.decode_tokens_per_s:.1f} tok/s ({1e3 / r.decode_tokens_per_s:.2f} ms/token, "
                  f"{r.decode_mode}); per layer: {trace(pool)}")
        finally:
            for key in env:
                os.environ.pop(key, None)
    if args.no_layers:
        return
    ms = layer_loop(ks)
    print(f"CPU layers alone, mmap weights: {ms:.3f} ms per layer; {trace(pool)}")
    anon = [anon_copy(k) for k in ks]
    ms = layer_loop(anon)
    print(f"CPU layers alone, anonymous copies: {ms:.3f} ms per layer; {trace(pool)}")
    del anon
    if args.torch_profile:
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            generate(model, tok, prompt, max_new_tokens=16)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=48))


if __name__ == "__main__":
    main()
