"""Where one hybrid decode step spends its time: torch profiler over a few decode steps of a
synthesized model (default: DeepSeek-V2-Lite shape, first 6 layers), top ops by CPU and CUDA time.

    python scripts/profile_decode.py /tmp/v2l6.gguf --rules deepseek-v2
"""
import argparse
import time

import torch

import ktinject
from ktinject.generate import generate

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--rules", default="deepseek-v2")
ap.add_argument("--steps", type=int, default=16)
args = ap.parse_args()
model, tok = ktinject.optimize_and_load(args.model, args.rules)
prompt = list(range(3, 131))
generate(model, tok, prompt, max_new_tokens=8)
t0 = time.perf_counter()
r = generate(model, tok, prompt, max_new_tokens=args.steps)
print(f"decode {r.decode_tokens_per_s:.1f} tok/s ({r.decode_mode}), {time.perf_counter() - t0:.2f} s")
waits = []
for m in model.modules():
    if hasattr(m, "sync") and hasattr(m, "kernel"):
        orig = m.sync

        def timed(orig=orig):
            t = time.perf_counter()
            out = orig()
            waits.append(time.perf_counter() - t)
            return out
        m.sync = timed
acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
with torch.profiler.profile(activities=acts) as prof:
    r = generate(model, tok, prompt, max_new_tokens=args.steps)
n_moe = sum(1 for m in model.modules() if hasattr(m, "kernel") and hasattr(m, "sync"))
print(f"per token: {1e3 / r.decode_tokens_per_s:.2f} ms; waiting in cpu_experts.sync: "
      f"{1e3 * sum(waits) / (len(waits) / max(n_moe, 1)):.2f} ms over {n_moe} MoE layers")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=48))
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=48))
