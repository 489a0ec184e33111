"""`ktinject profile MODEL --prompts FILE --out profile.json`: count routed-expert use on sample
prompts, for `gpu_experts` with `strategy: frequency` (or to order the other strategies)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from ..errors import ModelError
from ._common import add_model_arguments, load_for_cli

NAME = "profile"
HELP = "record how often each routed expert is chosen on sample prompts (for gpu_experts)"


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--prompts", metavar="FILE", help="a text file, one prompt per line")
    p.add_argument("--prompt", "-p", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--max-new-tokens", "-n", type=int, default=16, help="tokens generated per prompt (default 16)")
    p.add_argument("--out", "-o", default="expert-profile.json", help="output JSON (default expert-profile.json)")


def _num_experts(module, config) -> int:
    for obj, attr in ((module, "num_experts"), (config, "n_routed_experts"), (config, "num_experts"),
                      (config, "num_local_experts")):
        v = getattr(obj, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    raise ModelError(f"cannot tell the number of experts of {type(module).__name__}")


def experts_modules(model) -> dict[str, torch.nn.Module]:
    """Routed-expert modules: transformers `*Experts` classes or operators replacing them."""
    found = {}
    for name, mod in model.named_modules():
        names = {k.__name__ for k in type(mod).__mro__} | set(getattr(type(mod), "replaces", ()) or ())
        if any(n.endswith("Experts") for n in names) and name.endswith("experts"):
            found[name] = mod
    return found


@torch.inference_mode()
def record_profile(model, tokenizer, prompts: Iterable[str], max_new_tokens: int = 16) -> dict:
    """Run the prompts (eager decode, so hooks see every step) and count top-k choices per layer."""
    from ..generate import generate
    mods = experts_modules(model)
    if not mods:
        raise ModelError("the model has no routed-expert modules to profile")
    counts = {name: torch.zeros(_num_experts(m, model.config), dtype=torch.long) for name, m in mods.items()}

    def hook_for(name):
        def hook(module, args, kwargs):
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            counts[name] += torch.bincount(idx.reshape(-1).cpu(), minlength=counts[name].numel())[:counts[name].numel()]
        return hook

    handles = [m.register_forward_pre_hook(hook_for(n), with_kwargs=True) for n, m in mods.items()]
    n_prompts, tokens = 0, 0
    try:
        for prompt in prompts:
            # every prompt token routed (a prefix kept from the previous prompt would skip some)
            r = generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens, cuda_graph="off",
                         reuse_prefix=False)
            n_prompts += 1
            tokens += r.prompt_tokens + len(r.token_ids)
    finally:
        for h in handles:
            h.remove()
    return {"version": 1, "prompts": n_prompts, "tokens": tokens,
            "counts": {n: c.tolist() for n, c in counts.items()}}


def run(args) -> int:
    from rich.table import Table

    from . import console
    prompts = list(args.prompt)
    if args.prompts:
        try:
            prompts += [ln.strip() for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
        except OSError as exc:
            raise ModelError(f"{args.prompts}: cannot read prompts ({exc.strerror})") from None
    if not prompts:
        raise ModelError("no prompts: pass --prompts FILE or --prompt TEXT")
    path, model, tokenizer = load_for_cli(args, console)
    prof = record_profile(model, tokenizer, prompts, args.max_new_tokens)
    prof["model"] = str(path)
    Path(args.out).write_text(json.dumps(prof, indent=1))
    table = Table(title=f"expert use over {prof['tokens']} tokens ({prof['prompts']} prompts)")
    table.add_column("experts module")
    table.add_column("hottest experts (share)")
    for name, c in prof["counts"].items():
        total = max(sum(c), 1)
        top = sorted(range(len(c)), key=lambda e: -c[e])[:5]
        table.add_row(name, ", ".join(f"{e} ({c[e] / total:.0%})" for e in top))
    console.print(table)
    console.print(f"wrote {args.out}", highlight=False)
    return 0
