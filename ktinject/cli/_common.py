"""Helpers shared by the model commands (not a subcommand: the name starts with '_')."""
from __future__ import annotations

from typing import Optional


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def model_path(arg: Optional[str]):
    """MODEL argument, or the built-in default model when omitted."""
    if arg:
        return arg
    from ..default_model import default_model_path
    return default_model_path()


def pick_rules(rules: Optional[list], path, console, config_dir=None):
    """The rules given, or the model family's pack (hybrid with CUDA, else the CPU overlay)."""
    if rules:
        return rules
    import torch

    from ..rules.families import default_pack
    from ..weights import load_config
    cuda = torch.cuda.is_available()
    pack = default_pack(load_config(path, config_dir), cuda)
    console.print(f"[dim]rules:[/] shipped pack [bold]{pack}[/] ({'CUDA found' if cuda else 'no CUDA: CPU layout'})")
    return [pack]


def add_model_arguments(p) -> None:
    """MODEL, --rules, --dtype and --config-dir: shared by the commands that load a model."""
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="model directory or GGUF file (default: the built-in DeepSeek-V2-style model)")
    p.add_argument("--rules", "-r", nargs="+", metavar="R", help="rule files or pack names (default: family pack)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="override defaults.dtype")
    p.add_argument("--config-dir", help="a Hugging Face directory whose config.json and tokenizer override the "
                                        "model's own (for GGUF files)")


def add_sampling_arguments(p) -> None:
    """Sampling and prefill options of `generate`: shared by `run` and `chat`."""
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off, default)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens whose probabilities sum to p (1 = off, default)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 makes tokens already in the text less likely (1 = off, default)")
    g.add_argument("--seed", type=int, default=None, help="seed of the sampling (default: torch's default generator)")
    g.add_argument("--chunk-size", type=int, default=None,
                   help="prefill chunk size (tokens; default 512, or what the model's operators ask for)")


def sampling_options(args) -> dict:
    """`generate` keyword arguments from add_sampling_arguments' flags, checked before anything loads
    (an out-of-range value is one message naming the flag, not an error after the model is loaded)."""
    from ..errors import ModelError
    checks = (("--temperature", args.temperature, args.temperature >= 0, ">= 0"),
              ("--top-k", args.top_k, args.top_k >= 0, ">= 0"),
              ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
              ("--repetition-penalty", args.repetition_penalty, args.repetition_penalty > 0, "> 0"),
              ("--chunk-size", args.chunk_size, args.chunk_size is None or args.chunk_size >= 1, ">= 1"))
    for flag, value, ok, want in checks:
        if not ok:
            raise ModelError(f"{flag} must be {want}, got {value}")
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
            "repetition_penalty": args.repetition_penalty, "seed": args.seed, "chunk_size": args.chunk_size}


def load_for_cli(args, console):
    """Load `args.model` (or the default model) with `args.rules` (or the family pack), requiring a
    tokenizer: the shared start of `run`, `chat` and `profile`. Returns (path, model, tokenizer)."""
    from ..errors import ModelError
    from ..load import optimize_and_load
    path = model_path(args.model)
    rules = pick_rules(args.rules, path, console, args.config_dir)
    opts = {"config_dir": args.config_dir} if args.config_dir else {}
    model, tokenizer = optimize_and_load(path, rules, dtype=args.dtype, **opts)
    if tokenizer is None:
        raise ModelError(f"{path} has no tokenizer; pass --config-dir with a Hugging Face tokenizer")
    return path, model, tokenizer


def add_writer_arguments(p) -> None:
    """Options shared by the GGUF writers (`convert`, `synth`)."""
    p.add_argument("--split-max-size", type=int, default=0, metavar="BYTES", help="split at about BYTES per file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads (default: torch's choice; 1 is faster on a busy machine)")


def apply_threads(args) -> None:
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
