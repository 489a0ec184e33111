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

With KTINJECT_HOSTJOB_SKIP=1 the stream-ordered jobs return zeros at once: the decode step is
then its GPU work and host-node round trips alone (the time the CPU experts add is the rest).
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
    t = native.pool_trace(pool)
    if t is None:
        return "trace off"
    late = ", ".join(f"worker {w}: {c}" for w, c in sorted(t["late_by"].items(), key=lambda kv: -kv[1])[:6])
    return (f"{t['jobs']} jobs: first worker {t['first_worker_start']:.0f} us, last worker {t['last_worker_start']:.0f} us "
            f"(at most {t['last_worker_max']:.0f}; {t['late_jobs']} jobs' last worker >= 20 us late{': ' + late if late else ''}), "
            f"phases end {t['quantize_x']:.0f}/{t['quantize_x'] + t['gate_up']:.0f}/"
            f"{t['quantize_x'] + t['gate_up'] + t['quantize_h']:.0f} us, done {t['done']:.0f} us after post; "
            f"caller waited {t['wait']:.0f} us")


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


def cpu_counters():
    """(per-CPU steal jiffies, per-CPU interrupt counts) from /proc/stat and /proc/interrupts."""
    steal, irqs = {}, {}
    try:
        for line in open("/proc/stat"):
            if line.startswith("cpu") and line[3:4].isdigit():
                f = line.split()
                steal[int(f[0][3:])] = int(f[8])
        lines = open("/proc/interrupts").read().splitlines()
        cpus = [int(c[3:]) for c in lines[0].split()]
        for line in lines[1:]:
            f = line.split()[1:1 + len(cpus)]
            for c, v in zip(cpus, f):
                if v.isdigit():
                    irqs[c] = irqs.get(c, 0) + int(v)
    except (OSError, ValueError, IndexError):
        pass
    return steal, irqs


def counters_delta(before, after, seconds):
    """Steal time and interrupts per second on each CPU over the window (the hypotheses for a
    worker starting late: the hypervisor running something else on its vCPU, interrupts)."""
    (s0, i0), (s1, i1) = before, after
    hz = os.sysconf("SC_CLK_TCK")
    steal = {c: (s1[c] - s0.get(c, 0)) / hz / seconds for c in s1}
    irq = {c: (i1[c] - i0.get(c, 0)) / seconds for c in i1}
    return (f"steal {100 * sum(steal.values()) / max(len(steal), 1):.1f}% avg, max "
            f"{100 * max(steal.values(), default=0):.1f}%; interrupts/s per CPU: "
            + " ".join(f"{c}:{irq[c]:.0f}" for c in sorted(irq)))


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


def host_node_loop(ks, tokens=32, k=6, graph=True):
    """The CPU layers driven only by stream-ordered host nodes, no model GPU work in between: the
    bisection between "the host-node mechanism slows the layer" and "the model's GPU work does".
    Returns ms per layer."""
    from ktinject.native.hostfn import HostJob
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(1, ks[0].hidden, generator=g) * 0.1).to(dev)
    w = torch.full((1, k), 1.0 / k, device=dev)
    jobs = [HostJob(kern, 1, k, dev) for kern in ks]
    ids = [torch.randperm(ks[0].n_experts, generator=g)[:k].view(1, k).to(dev) for _ in ks]

    def step():
        for job, i in zip(jobs, ids):
            job.submit(x, i, w)
            job.sync()
    step()
    torch.cuda.synchronize()
    if graph:
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            step()
        run = cg.replay
    else:
        run = step
    run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(tokens):
        run()
    done = torch.cuda.Event(blocking=True)      # a sleeping wait, as the generation engine's
    done.record()
    done.synchronize()
    return (time.perf_counter() - t0) / (tokens * len(ks)) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rules", default="deepseek-v2")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--modes", default="graph,eager,python", help="of graph, eager, python")
    ap.add_argument("--no-layers", action="store_true", help="skip the CPU-layers-alone loops")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens (<= 16: decode-sized jobs only)")
    ap.add_argument("--bisect", action="store_true",
                    help="also run the layers through host-function nodes only (graph and eager), no model")
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
    # a short prompt: its prefill jobs are stream-ordered decode-sized jobs too, so the pool trace's
    # averages are the decode layers' (a long prompt's few large jobs would dominate them)
    prompt = list(range(3, 3 + args.prompt))
    modes = {"graph": ("graph + stream-ordered", {}, "auto"), "eager": ("eager + stream-ordered", {}, "off"),
             "python": ("eager, Python-driven", {"KTINJECT_STREAM_ORDERED": "0"}, "auto")}
    for label, env, graph in (modes[m] for m in args.modes.split(",")):
        os.environ.update(env)
        try:
            generate(model, tok, prompt, max_new_tokens=8, cuda_graph=graph)
            trace(pool)
            t0, before, counters = time.perf_counter(), thread_cpu(), cpu_counters()
            r = generate(model, tok, prompt, max_new_tokens=args.steps, cuda_graph=graph)
            dt = time.perf_counter() - t0
            print(f"{label} threads over {dt:.2f} s:", busy_threads(before, thread_cpu(), dt))
            print(f"{label} machine: {counters_delta(counters, cpu_counters(), dt)}")
            from ktinject.native.hostfn import handover_of
            print(f"{label}: jobs hand over by {handover_of(model) or 'python'}, "
                  f"{native.load()[0].ktk_bell_rings()} bell rings")
            print(f"{label}: decode {r.decode_tokens_per_s:.1f} tok/s ({1e3 / r.decode_tokens_per_s:.2f} ms/token, "
                  f"{r.decode_mode}); per layer: {trace(pool)}")
        finally:
            for key in env:
                os.environ.pop(key, None)
    if args.bisect:
        trace(pool)
        for graph in (True, False):
            ms = host_node_loop(ks, graph=graph)
            print(f"CPU layers through host nodes only ({'graph' if graph else 'eager'}): {ms:.3f} ms per layer; "
                  f"{trace(pool)}")
    if args.torch_profile:
        torch_profile(model, tok, prompt)
    if args.no_layers:
        return
    ms = layer_loop(ks)
    print(f"CPU layers alone, mmap weights: {ms:.3f} ms per layer; {trace(pool)}")
    anon = [anon_copy(k) for k in ks]
    ms = layer_loop(anon)
    print(f"CPU layers alone, anonymous copies: {ms:.3f} ms per layer; {trace(pool)}")
    del anon


def torch_profile(model, tok, prompt, tokens=16):
    """GPU kernels of the decode step, graph and eager: kernel time per token against the step's
    wall time (launch- or dependency-bound when the kernels sum to much less), and the kernels
    that take it, with their launches per token."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for graph in ("auto", "off"):
        generate(model, tok, prompt, max_new_tokens=4, cuda_graph=graph)
        with torch.profiler.profile(activities=acts) as prof:
            r = generate(model, tok, prompt, max_new_tokens=tokens + 1, cuda_graph=graph)
        rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
                or getattr(e, "self_device_time_total", 0) > 0]
        dev = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
        total = sum(dev(e) for e in rows)
        n = tokens + 1 + len(prompt) // max(len(prompt), 1)      # decode steps + the prefill step
        print(f"torch profile ({r.decode_mode}): {r.decode_tokens_per_s:.1f} tok/s, {1e3 / r.decode_tokens_per_s:.2f} "
              f"ms/token wall; GPU kernels {total / 1e3 / n:.2f} ms per step, {sum(e.count for e in rows) / n:.0f} "
              f"kernels per step")
        for e in sorted(rows, key=dev, reverse=True)[:25]:
            print(f"  {dev(e) / 1e3 / n:7.3f} ms/step {e.count / n:6.1f}x  {e.key[:110]}")
        print("  by launches per step:")
        for e in sorted(rows, key=lambda e: e.count, reverse=True)[:40]:
            print(f"  {e.count / n:6.1f}x {dev(e) / 1e3 / n:7.3f} ms/step  {e.key[:110]}")


if __name__ == "__main__":
    main()
