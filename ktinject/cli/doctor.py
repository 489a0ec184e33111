"""`ktinject doctor`: what this machine offers (Python, torch, transformers, CUDA, CPU ISA, native library)."""
from __future__ import annotations

import platform
from pathlib import Path

from rich.table import Table

NAME = "doctor"
HELP = "report Python, torch, transformers, CUDA, CPU ISA flags and the native library"

ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")


def add_arguments(p) -> None:
    pass


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ("unknown", {}) elsewhere."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return platform.processor() or "unknown", set()
    name, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name == "unknown":
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return name, flags


def run(args) -> int:
    from . import console
    import torch
    rows = [("python", platform.python_version()), ("torch", torch.__version__)]
    try:
        import transformers
        rows.append(("transformers", transformers.__version__))
    except ImportError as exc:
        rows.append(("transformers", f"[red]missing[/] ({exc})"))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            rows.append((f"cuda:{i}", f"{prop.name}, {prop.total_memory / 2**30:.0f} GiB, "
                                      f"sm_{prop.major}{prop.minor}, CUDA {torch.version.cuda}"))
    else:
        rows.append(("cuda", "not available (CPU layouts only: the packs' '-cpu' overlays)"))
    name, flags = cpu_flags()
    import os
    rows.append(("cpu", f"{name}, {os.cpu_count()} logical CPUs"))
    rows.append(("cpu ISA", " ".join(f"[green]{f}[/]" if f in flags else f"[dim]-{f}[/]" for f in ISA_FLAGS)))
    rows.append(("native library", _native()))
    rows.append(("KTINJECT_ settings", _settings()))
    rows.append(("decode hand-over", _handover()))
    rows.append(("int4 decode GEMV", _int4_gemv()))
    from ..operators import registry
    rows.append(("operators", ", ".join(registry.names())))
    from ..rules import pack_names
    rows.append(("rule packs", ", ".join(pack_names())))
    table = Table(show_header=False, show_edge=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    return 0


def _settings() -> str:
    """The KTINJECT_* variables set here: each green where its setting takes the value, red with what it takes
    where not (a pool or an experts kernel would refuse to start), yellow where the name is no setting."""
    from ..native.knobs import survey
    parts = []
    for name, value, why, known in survey():
        if not why:
            parts.append(f"[green]{name}={value}[/]")
        elif known:
            parts.append(f"[red]{name}={value!r}: takes {why}[/]")
        else:
            parts.append(f"[yellow]{name}: {why}[/]")
    return "; ".join(parts) if parts else "none set (every default)"


def _native() -> str:
    try:
        from .. import native
    except Exception as exc:  # noqa: BLE001 - a broken optional part is reported, not raised
        return f"[red]cannot import[/] ({exc})"
    describe = getattr(native, "describe", None)
    if describe is None:
        return "not part of this install"
    try:
        info = describe()
    except Exception as exc:  # noqa: BLE001
        return f"[red]error[/] ({exc})"
    if not info.get("available"):
        return f"[yellow]not built[/]: {info.get('reason')}"
    return ", ".join(f"{k}={v}" for k, v in info.items() if k != "available")


def _handover() -> str:
    """How a GPU decode step hands its MoE layers to the CPU here (docs/native.md, stream-ordered
    jobs): doorbells or host functions, with or without the zero-copy kernels, and why not."""
    import torch
    if not torch.cuda.is_available():
        return "no CUDA (CPU layouts: nothing to hand over)"
    try:
        from ..native import hostfn
        if not hostfn.available():
            return "[yellow]from Python[/] (no CUDA driver library or no native library: decode runs without a CUDA graph)"
        dev = torch.device("cuda", 0)
        mode = hostfn.signal_mode(dev)
        if mode == "hostfn":
            why = hostfn.bells_usable(dev)
            return "host functions" + (f" (doorbells unusable: {why})" if why else " (KTINJECT_HOSTJOB_SIGNAL=hostfn)")
        why = hostfn.zerocopy_usable(dev)
        if hostfn.zerocopy_max_tokens() == 0:
            return "doorbells, copies (KTINJECT_HOSTJOB_ZEROCOPY=0)"
        return "doorbells, zero-copy kernels" if why is None else f"doorbells, copies (zero-copy unusable: {why})"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"[red]{exc}[/]"


def _int4_gemv() -> str:
    """Which kernel `linear_int4` runs for one row on the GPU here (docs/gpu.md): the NVRTC-compiled CUDA
    GEMV where the tuned tables pick it and it compiles, else the Triton kernels."""
    import torch
    if not torch.cuda.is_available():
        return "no CUDA (linear_int4 runs its torch path)"
    try:
        from ..operators.kernels import int4_cuda
        why = int4_cuda.unavailable_reason(torch.device("cuda", 0))
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"[red]{exc}[/]"
    if why is not None:
        return f"[yellow]Triton only[/] (CUDA GEMV unusable: {why})"
    try:
        pdl = int4_cuda.pdl_mode(0)
    except ValueError as exc:                 # a KTINJECT_INT4_PDL it does not take: said here, raised at the call
        return f"CUDA (NVRTC) + Triton; [red]{exc}[/]"
    why = int4_cuda.pdl_unavailable_reason(0)
    return f"CUDA (NVRTC) + Triton; programmatic dependent launch {pdl}" + (f" ({why})" if why else "")
