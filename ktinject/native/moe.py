"""`MoEKernel`: one routed-experts layer computed natively on GGUF blocks.

Weights stay where they are (usually a memory-mapped GGUF file): the kernel keeps references
to the uint8 row tensors and hands their addresses to C. `submit` posts the work to the pool
and returns; `sync` waits and returns the result; `forward` does both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import NativeError
from . import Pool, _need, _ptr, check, default_pool, isa_index, load, row_bytes  # noqa: F401


@dataclass(frozen=True)
class ExpertMatrix:
    """Stacked expert weights as GGML rows, logical [E, rows, cols].

    `data` is uint8 [N, row_bytes]; expert e's rows are `data[e*stride + offset : ... + rows]`
    (stride defaults to `rows`: plain stacking; a fused gate_up [E, 2I, H] tensor gives the
    gate with offset 0 and the up projection with offset I, stride 2I, zero copy).
    """
    ggml_type: int
    data: torch.Tensor
    n_experts: int
    rows: int
    cols: int
    name: str = ""
    stride: int = 0          # rows from one expert to the next (0: `rows`)
    offset: int = 0          # first row of expert 0

    @property
    def expert_stride(self) -> int:
        return self.stride or self.rows

    def validate(self) -> None:
        what = self.name or "expert matrix"
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise NativeError(f"{what}: data must be a uint8 [E*rows, row_bytes] tensor")
        if self.data.device.type != "cpu" or not self.data.is_contiguous():
            raise NativeError(f"{what}: data must be a contiguous CPU tensor")
        need = (self.n_experts - 1) * self.expert_stride + self.offset + self.rows
        if self.offset < 0 or self.expert_stride < self.rows or self.data.shape[0] < need:
            raise NativeError(f"{what}: {self.data.shape[0]} rows, expected at least {need} for {self.n_experts} "
                              f"experts of {self.rows} rows (stride {self.expert_stride}, offset {self.offset})")
        rb = row_bytes(self.ggml_type, self.cols)
        if self.data.shape[1] != rb:
            raise NativeError(f"{what}: rows of {self.data.shape[1]} bytes, expected {rb} for {self.cols} values "
                              f"of GGML type {self.ggml_type}")


class MoEKernel:
    """out[t] = sum_j w[t,j] * down_e(SiLU(gate_e x_t) * up_e x_t), e = ids[t,j].

    gate, up: [E, I, H]; down: [E, H, I] (ExpertMatrix each). `threads` 0 = one per CPU.
    """

    def __init__(self, gate: ExpertMatrix, up: ExpertMatrix, down: ExpertMatrix, threads: int = 0,
                 pool: Optional[Pool] = None, isa: Optional[str] = None):
        lib, ffi = load()
        for m in (gate, up, down):
            m.validate()
        E, I, H = gate.n_experts, gate.rows, gate.cols
        if (up.n_experts, up.rows, up.cols) != (E, I, H) or (down.n_experts, down.rows, down.cols) != (E, H, I):
            raise NativeError(f"expert shapes disagree: gate {[E, I, H]}, up {[up.n_experts, up.rows, up.cols]}, "
                              f"down {[down.n_experts, down.rows, down.cols]} (expected [E, H, I])")
        if H % 32 or I % 32:
            raise NativeError(f"hidden ({H}) and intermediate ({I}) sizes must be multiples of 32")
        self.n_experts, self.hidden, self.inter = E, H, I
        self.gate, self.up, self.down = gate, up, down
        self.isa = isa_index(isa)
        self.pool = pool or default_pool(threads)
        desc = ffi.new("ktk_moe_desc *")
        desc.gate_type, desc.up_type, desc.down_type = gate.ggml_type, up.ggml_type, down.ggml_type
        desc.n_experts, desc.hidden, desc.inter = E, H, I
        desc.gate = ffi.cast("uint8_t *", gate.data.data_ptr() + gate.offset * gate.data.shape[1])
        desc.up = ffi.cast("uint8_t *", up.data.data_ptr() + up.offset * up.data.shape[1])
        desc.down = ffi.cast("uint8_t *", down.data.data_ptr() + down.offset * down.data.shape[1])
        desc.gate_rb, desc.up_rb, desc.down_rb = gate.data.shape[1], up.data.shape[1], down.data.shape[1]
        desc.gate_es = gate.expert_stride * gate.data.shape[1]
        desc.up_es = up.expert_stride * up.data.shape[1]
        desc.down_es = down.expert_stride * down.data.shape[1]
        err = ffi.new("int *")
        ptr = lib.ktk_moe_new(desc, err)
        if ptr == ffi.NULL:
            check(err[0] or -3, "MoE layer")
        self._ptr = ffi.gc(ptr, lib.ktk_moe_free)
        self._inflight = None

    @property
    def weight_bytes_per_expert(self) -> int:
        return (self.gate.data.shape[1] * self.inter + self.up.data.shape[1] * self.inter
                + self.down.data.shape[1] * self.hidden)

    def _check(self, x, ids, w):
        _need(x, "hidden_states", torch.float32, 2)
        _need(ids, "top_k_index", torch.int64, 2)
        _need(w, "top_k_weights", torch.float32, 2)
        T = x.shape[0]
        if x.shape[1] != self.hidden:
            raise NativeError(f"hidden_states: expected [T, {self.hidden}], got {list(x.shape)}")
        if ids.shape[0] != T or w.shape != ids.shape:
            raise NativeError(f"top_k_index {list(ids.shape)} and top_k_weights {list(w.shape)} must both be "
                              f"[T={T}, k]")

    def submit(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
        """Start the layer on the pool and return at once. x: [T, H] f32, ids: [T, k] i64, w: [T, k] f32."""
        if self._inflight is not None:
            raise NativeError("submit() called twice without sync()")
        self._check(x, ids, w)
        lib, ffi = load()
        out = torch.empty_like(x)
        T, k = ids.shape
        rc = lib.ktk_moe_submit(self._ptr, self.pool.ptr, self.isa, T, max(k, 1), _ptr(ffi, x, "float *"),
                                _ptr(ffi, ids, "int64_t *"), _ptr(ffi, w, "float *"), _ptr(ffi, out, "float *"))
        if rc == lib.KTK_ERANGE:   # the C side checks every id; the message names the first bad one
            bad = ids[(ids < 0) | (ids >= self.n_experts)][0]
            raise NativeError(f"top_k_index: expert id {int(bad)} out of range [0, {self.n_experts})")
        check(rc, "MoE submit")
        self._inflight = (x, ids, w, out)      # inputs stay alive until sync()

    def sync(self) -> torch.Tensor:
        if self._inflight is None:
            raise NativeError("sync() without a submit()")
        lib, _ = load()
        rc = lib.ktk_moe_sync(self._ptr, self.pool.ptr)
        out = self._inflight[3]
        self._inflight = None
        check(rc, "MoE sync")
        return out

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        self.submit(x, ids, w)
        return self.sync()

    __call__ = forward
