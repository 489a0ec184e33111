"""`ktinject run [MODEL] --rules R --prompt TEXT`: load, stream a completion, report tokens/s."""
from __future__ import annotations

import time

from ._common import add_model_arguments, add_sampling_arguments, load_for_cli, sampling_options

# Model output goes to a terminal: control characters (escape sequences!) are shown as U+FFFD.
_UNPRINTABLE = {c: "\ufffd" for c in [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)] if c not in (0x09, 0x0A)}

NAME = "run"
HELP = "load a model with rules and stream a completion (no MODEL: the built-in default model)"


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--prompt", "-p", default="Once upon a time", help="the prompt text")
    p.add_argument("--max-new-tokens", "-n", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--stop", action="append", default=[], help="stop when this text appears (repeatable)")
    add_sampling_arguments(p)


def run(args) -> int:
    from . import console
    from ..errors import ModelError
    from ..generate import generate
    if args.max_new_tokens < 1:
        raise ModelError("--max-new-tokens must be at least 1")
    opts = sampling_options(args)
    t0 = time.perf_counter()
    path, model, tokenizer = load_for_cli(args, console)
    console.print(f"[dim]loaded {path} in {time.perf_counter() - t0:.1f} s[/]", highlight=False)
    console.print(args.prompt, end="", markup=False, highlight=False, style="bold")
    try:
        result = generate(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, stop=args.stop, **opts,
                          on_text=lambda piece: console.print(piece.translate(_UNPRINTABLE), end="", markup=False,
                                                              highlight=False, soft_wrap=True))
    finally:
        console.print()                   # end the streamed line (before an error's message too)
    console.print(f"[dim]prefill:[/] {result.prompt_tokens} tokens, {result.prefill_tokens_per_s:.1f} tok/s   "
                  f"[dim]decode:[/] {len(result.token_ids)} tokens, {result.decode_tokens_per_s:.1f} tok/s   "
                  f"[dim]stop:[/] {result.stop_reason}", highlight=False)
    return 0
