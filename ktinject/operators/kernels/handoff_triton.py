"""Zero-copy hand-over of a decode step's routed experts between the GPU and the CPU.

A stream-ordered CPU MoE job (ktinject/native/hostfn.py, doorbell signalling) used to cost per
layer: a float32 conversion of the hidden states, three device-to-host copies (x, ids, w), the
doorbell write; on the way back the wait, the clearing write, a host-to-device copy, a conversion
to the activation dtype and the sum with the shared experts: ten stream operations, four of them
copy-engine transfers whose latency dominates at a few kilobytes. Here two kernels and the wait
do it, reading and writing the
page-locked buffers straight over the bus (the GPU addresses pinned host memory directly):

* `handoff`: one program writes x (float32), ids (int64) and w (float32) into the pinned buffers,
  makes them visible to the CPU (a system-scope fence in every thread, then a barrier), and only
  then rings the doorbell (`go = 1`). One launch instead of five operations.
* `combine`: after the stream's wait for `done`, reads the CPU's float32 output from pinned memory
  (volatile loads: never a stale cached line), adds the shared experts' output if given, writes
  the result in the activation dtype, and clears `done` for the next replay. One launch instead of
  four operations (the wait stays).

Both are CUDA-graph capturable once compiled (the first eager call compiles them). Triton's
interpreter runs them on CPU tensors for the arithmetic (it has no inline assembly: the fence is
left out there; tests/test_hostjob.py).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ...errors import NativeError
from . import tl_dtype
from .router_triton import FLOAT_DTYPES, precise_math

MAX_TOKENS = 16          # one program writes every token: decode's handful, not prefill's thousands
BLOCK = 1024


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def handoff(h_ptr, ids_ptr, w_ptr, x_out, ids_out, w_out, go_ptr, T, H, K,
                stride_h, stride_ids, stride_w,
                BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, FENCE: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        koffs = tl.arange(0, BLOCK_K)
        kok = koffs < K
        for t in range(T):                            # T <= MAX_TOKENS: int32 offsets suffice
            for start in range(0, H, BLOCK):
                ok = start + offs < H
                v = tl.load(h_ptr + t * stride_h + start + offs, mask=ok, other=0.0).to(tl.float32)
                tl.store(x_out + t * H + start + offs, v, mask=ok)
            i = tl.load(ids_ptr + t * stride_ids + koffs, mask=kok, other=0).to(tl.int64)
            tl.store(ids_out + t * K + koffs, i, mask=kok)
            w = tl.load(w_ptr + t * stride_w + koffs, mask=kok, other=0.0).to(tl.float32)
            tl.store(w_out + t * K + koffs, w, mask=kok)
        if FENCE:
            # every thread's stores reach the system before any thread goes on: then the doorbell
            tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b32 $0, $1;", "=r,r", [koffs], dtype=tl.int32,
                                      is_pure=False, pack=1)
        tl.debug_barrier()
        tl.store(go_ptr, 1)

    @triton.jit
    def combine(out_ptr, add_ptr, res_ptr, done_ptr, H, stride_add, stride_res,
                HAS_ADD: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < H
        v = tl.load(out_ptr + row * H + offs, mask=ok, other=0.0, volatile=True)
        r = v.to(DTYPE)                               # what `out.to(dtype)` rounds to
        if HAS_ADD:
            r = (r.to(tl.float32) + tl.load(add_ptr + row * stride_add + offs, mask=ok, other=0.0).to(tl.float32)).to(DTYPE)
        tl.store(res_ptr + row * stride_res + offs, r, mask=ok)
        if tl.program_id(0) == 0 and tl.program_id(1) == 0:
            tl.store(done_ptr, 0)

    return handoff, combine


def handoff(h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, x_out: torch.Tensor, ids_out: torch.Tensor,
            w_out: torch.Tensor, go: torch.Tensor) -> None:
    """Write h [T, H] (as float32), ids [T, k] (as int64) and w [T, k] (as float32) into the pinned
    buffers x_out, ids_out, w_out (contiguous, exactly those shapes), then set go[0] = 1."""
    import triton
    T, H = h.shape
    K = ids.shape[1]
    if not (0 < T <= MAX_TOKENS and h.dtype in FLOAT_DTYPES and w.dtype in FLOAT_DTYPES
            and ids.shape == w.shape == (T, K) and h.stride(1) == 1 and ids.stride(1) == 1 and w.stride(1) == 1):
        raise NativeError(f"handoff: cannot hand over hidden states {list(h.shape)} {h.dtype}, ids {list(ids.shape)}, "
                          f"weights {list(w.shape)} {w.dtype} (at most {MAX_TOKENS} tokens, last dims contiguous)")
    if x_out.shape != (T, H) or ids_out.shape != (T, K) or w_out.shape != (T, K):
        raise NativeError(f"handoff: pinned buffers {list(x_out.shape)}, {list(ids_out.shape)}, {list(w_out.shape)} "
                          f"do not fit [{T}, {H}], [{T}, {K}]")
    kern, _ = _kernels()
    kern[(1,)](h, ids, w, x_out, ids_out, w_out, go, T, H, K, h.stride(0), ids.stride(0), w.stride(0),
               BLOCK=min(BLOCK, triton.next_power_of_2(H)), BLOCK_K=triton.next_power_of_2(K),
               FENCE=precise_math(), num_warps=4)


def combine(out: torch.Tensor, done: torch.Tensor, dtype: torch.dtype, device: torch.device,
            add: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`out.to(dtype) (+ add)` as a new tensor on `device`, reading out [T, H] float32 from pinned
    memory; then done[0] = 0."""
    import triton
    T, H = out.shape
    if dtype not in FLOAT_DTYPES:
        raise NativeError(f"combine: results in bf16/f16/f32 only, not {dtype}")
    if add is not None and (add.shape != (T, H) or add.dtype != dtype or add.stride(1) != 1 or add.device != device):
        raise NativeError(f"combine: the added tensor is {list(add.shape)} {add.dtype} on {add.device}, "
                          f"expected [{T}, {H}] {dtype} on {device}")
    res = torch.empty((T, H), dtype=dtype, device=device)
    _, kern = _kernels()
    block = min(BLOCK, triton.next_power_of_2(H))
    kern[(T, triton.cdiv(H, block))](out, add if add is not None else res, res, done, H,
                                     add.stride(0) if add is not None else 0, res.stride(0),
                                     HAS_ADD=add is not None, BLOCK=block, DTYPE=tl_dtype(dtype), num_warps=4)
    return res
