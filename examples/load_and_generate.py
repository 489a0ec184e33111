"""Load a MoE model through a rule pack and stream a completion.

    python examples/load_and_generate.py                       # the built-in default model
    python examples/load_and_generate.py path/to/model --rules qwen3-moe --prompt "Hello"
"""
from __future__ import annotations

import argparse
import sys

import torch

import ktinject
from ktinject.default_model import default_model_path
from ktinject.rules.families import default_pack
from ktinject.weights import load_config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="model directory or GGUF file (default: built-in model)")
    ap.add_argument("--rules", nargs="+", help="rule files or pack names (default: the family's pack)")
    ap.add_argument("--prompt", default="The quick brown fox")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()

    path = args.model or default_model_path()
    rules = args.rules or default_pack(load_config(path), cuda=torch.cuda.is_available())

    # 1. the plan is pure data: look before loading
    plan = ktinject.plan(load_config(path), rules)
    for device, nbytes in sorted(plan.totals.items()):
        sys.stderr.write(f"{device}: {nbytes / 2**20:.1f} MiB\n")

    # 2. load: skeleton on meta, apply the rules, stream the weights to their devices
    model, tokenizer = ktinject.optimize_and_load(path, rules)

    # 3. generate, streaming the text
    result = ktinject.generate(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                               on_text=lambda piece: sys.stdout.write(piece) or sys.stdout.flush())
    sys.stdout.write("\n")
    sys.stderr.write(f"prefill {result.prefill_tokens_per_s:.1f} tok/s, decode {result.decode_tokens_per_s:.1f} tok/s\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ktinject.KtInjectError as exc:
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(2)
