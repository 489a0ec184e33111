"""`ktinject chat MODEL --rules R`: interactive multi-turn chat with streaming output.

The conversation goes through the tokenizer's chat template each turn. Commands: `/reset`
(forget the conversation), `/exit` (or end of input).
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

from ..errors import ModelError
from ._common import add_model_arguments, add_sampling_arguments, load_for_cli, sampling_options

NAME = "chat"
HELP = "interactive multi-turn chat with a model (chat template from its tokenizer, streaming)"


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--system", help="a system message to start the conversation with")
    p.add_argument("--max-new-tokens", "-n", type=int, default=256, help="tokens per reply (default 256)")
    add_sampling_arguments(p)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the conversation with the assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError("the tokenizer has no chat template; use `ktinject run` for plain completion")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return [int(i) for i in ids]


def chat_loop(model, tokenizer, read: Callable[[], Optional[str]], write: Callable[[str], None],
              system: Optional[str] = None, on_result: Optional[Callable] = None, **gen_options) -> list[dict]:
    """Run turns until `read` returns None or /exit; returns the conversation. `on_result` gets each
    turn's GenerationResult. Each turn's prompt is the whole conversation; the engine keeps the
    earlier turns' keys and values, so only what follows the longest shared prefix is prefilled
    (docs/gpu.md, "Generation engine")."""
    from ..generate import generate
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    while True:
        line = read()
        if line is None or line.strip() in ("/exit", "/quit"):
            return messages
        if line.strip() == "/reset":
            messages = list(base)
            write("[conversation cleared]\n")
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        result = generate(model, tokenizer, prompt_ids(tokenizer, messages), on_text=write, **gen_options)
        write("\n")
        if on_result:
            on_result(result)
        messages.append({"role": "assistant", "content": result.text})


def run(args) -> int:
    from . import console
    if args.max_new_tokens < 1:
        raise ModelError("--max-new-tokens must be at least 1")
    opts = sampling_options(args)
    path, model, tokenizer = load_for_cli(args, console)
    console.print("[dim]chat: /reset clears the conversation, /exit or Ctrl-D quits[/]")

    def read() -> Optional[str]:
        try:
            return console.input("[bold green]you>[/] ")
        except EOFError:
            return None

    def write(piece: str) -> None:
        console.print(piece, end="", markup=False, highlight=False, soft_wrap=True)

    def stats(r) -> None:
        console.print(f"[dim]({r.prompt_tokens} prompt tokens, {r.cached_prompt_tokens} kept from earlier turns; "
                      f"prefill {r.prefill_tokens_per_s:.0f} tok/s, decode {r.decode_tokens_per_s:.1f} tok/s)[/]")

    chat_loop(model, tokenizer, read, write, system=args.system, on_result=stats, max_new_tokens=args.max_new_tokens,
              **opts)
    return 0
