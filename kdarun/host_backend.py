"""HostBackend: the GpuBackend contract on the CPU with NumPy.

Memory is real host memory addressed by its numeric address, so pointer arithmetic,
aliasing and out-of-bounds mistakes behave as on a device. Work runs at enqueue time,
so every stream is trivially ordered. Kernels are the NumPy twins in `host_kernels`.

The "device" memory is capped at `HOST_MEMORY_FRACTION` of the machine's physical memory,
so a workspace or a set of weights too large is refused with both figures before it is
allocated, and the rest stays for what runs beside it on the host (the inputs, the float64
reference, the system).
"""

from __future__ import annotations

import bisect
import os
import sys
import time
from typing import Any, Sequence

import numpy as np

from .backend import DevicePtr, GpuBackend, LaunchConfig
from .dtypes import BF16, F32
from .errors import KdaError, check_int, format_bytes

_ALIGN = 256  # cudaMalloc's alignment, so views of any dtype are aligned as on a device
HOST_MEMORY_FRACTION = 0.5  # of physical memory: what the host backend may allocate


def host_memory_cap() -> int:
    """`HOST_MEMORY_FRACTION` of the physical memory (os.sysconf); where the platform does not
    say, no cap (allocations then fail only when the system refuses them)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                   * HOST_MEMORY_FRACTION)
    except (AttributeError, ValueError, OSError):
        return sys.maxsize


class HostBackend(GpuBackend):
    name = "host"

    def __init__(self) -> None:
        self._bases: list[int] = []  # sorted allocation addresses
        self._bufs: dict[int, np.ndarray] = {}  # address -> uint8 buffer
        self._owners: dict[int, np.ndarray] = {}
        self._allocated = 0  # bytes in live allocations
        self._cap = host_memory_cap()
        self._next_stream = 1

    @property
    def device_name(self) -> str:
        return "CPU (NumPy)"

    # -- memory --------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> DevicePtr:
        nbytes = check_int(nbytes, "alloc: nbytes", 1)
        self.check_free_memory(nbytes, "alloc")
        try:
            owner = np.empty(nbytes + _ALIGN, dtype=np.uint8)
        except MemoryError:
            raise KdaError(f"alloc: the host cannot allocate {format_bytes(nbytes)} "
                           f"({format_bytes(self.free_memory())} free under the cap)") from None
        start = (-owner.ctypes.data) % _ALIGN
        buf = owner[start:start + nbytes]
        addr = buf.ctypes.data
        bisect.insort(self._bases, addr)
        self._bufs[addr] = buf
        self._owners[addr] = owner
        self._allocated += nbytes
        return DevicePtr(addr)

    def free(self, ptr: DevicePtr) -> None:
        addr = int(ptr)
        if addr not in self._bufs:
            raise KdaError(f"free: {ptr!r} is not the start of a live allocation")
        self._bases.remove(addr)
        self._allocated -= self._bufs[addr].nbytes
        del self._bufs[addr], self._owners[addr]
        self._uploads().pop(addr, None)

    def free_memory(self) -> int:
        """The cap (`HOST_MEMORY_FRACTION` of physical memory) less the live allocations."""
        return max(0, self._cap - self._allocated)

    def rows(self, ptr: DevicePtr, m: int, ld: int, n: int, dtype) -> np.ndarray:
        """A writable [m, n] view of rows `ld` elements apart starting at `ptr`."""
        flat = self.view(ptr, (int(m) - 1) * int(ld) + int(n), dtype)
        return np.lib.stride_tricks.as_strided(flat, (int(m), int(n)),
                                               (int(ld) * flat.itemsize, flat.itemsize))

    def bytes_at(self, ptr: DevicePtr, nbytes: int) -> np.ndarray:
        """The `nbytes` bytes at `ptr` as a writable uint8 view; bounds-checked."""
        addr = int(ptr)
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0:
            raise KdaError(f"{ptr!r} is not inside any allocation")
        base = self._bases[i]
        buf = self._bufs[base]
        off = addr - base
        if off + nbytes > buf.nbytes or nbytes < 0:
            raise KdaError(f"access of {nbytes} bytes at {ptr!r} runs past its allocation "
                           f"(base 0x{base:x}, size {buf.nbytes}, offset {off})")
        return buf[off:off + nbytes]

    def check_region(self, ptr: DevicePtr, nbytes: int, what: str) -> None:
        try:
            self.bytes_at(ptr, nbytes)
        except KdaError as e:
            raise KdaError(f"{what}: {e}") from None

    def view(self, ptr: DevicePtr, shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
        """A writable NumPy view of `shape` elements of `dtype` at `ptr`."""
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        return self.bytes_at(ptr, n * dt.itemsize).view(dt).reshape(shape)

    def memset(self, ptr: DevicePtr, byte: int, nbytes: int, stream: int) -> None:
        self.bytes_at(ptr, nbytes)[:] = check_int(byte, "memset: byte", 0, 255)

    def copy_h2d(self, dst: DevicePtr, src: np.ndarray, stream: int) -> None:
        src = np.ascontiguousarray(src)
        self.bytes_at(dst, src.nbytes)[:] = src.reshape(-1).view(np.uint8)
        self._retag(dst, src.dtype)

    def copy_d2h(self, dst: np.ndarray, src: DevicePtr, stream: int) -> None:
        if not dst.flags.c_contiguous:
            raise KdaError("copy_d2h: destination must be C-contiguous")
        dst.reshape(-1).view(np.uint8)[:] = self.bytes_at(src, dst.nbytes)

    def copy_d2d(self, dst: DevicePtr, src: DevicePtr, nbytes: int, stream: int) -> None:
        self.bytes_at(dst, nbytes)[:] = self.bytes_at(src, nbytes)

    # -- streams and events ----------------------------------------------------------------
    def create_stream(self) -> int:
        self._next_stream += 1
        return self._next_stream

    def destroy_stream(self, stream: int) -> None:
        pass

    def synchronize(self, stream: int) -> None:
        pass

    def create_event(self) -> list[float]:
        return [0.0]

    def record_event(self, event: list[float], stream: int) -> None:
        event[0] = time.perf_counter()

    def stream_wait_event(self, stream: int, event: list[float]) -> None:
        pass  # host work runs as it is enqueued: every stream is already in order

    def elapsed_ms(self, start: list[float], end: list[float]) -> float:
        return (end[0] - start[0]) * 1e3

    def capture(self, fn, stream: int) -> "_HostGraph":
        return _HostGraph(fn)

    # -- kernels ---------------------------------------------------------------------------
    def load_module(self, family: str, defines: Sequence[str] = ()) -> dict:
        from .host_kernels import HOST_KERNELS
        if family not in HOST_KERNELS:
            raise KdaError(f"no host implementation of kernel family {family!r}")
        return HOST_KERNELS[family]

    def launch(self, module: dict, kernel: str, cfg: LaunchConfig, args: Sequence[Any],
               stream: int) -> None:
        # int32 arguments (a CUDA int's 4 bytes) arrive as Python ints: a twin's byte offsets
        # (slot x state bytes) would otherwise wrap in int32 past 2 GiB of pool, where the
        # kernels compute in 64 bits
        module[kernel](self, *(int(a) if isinstance(a, np.integer) else a for a in args))

    def gemm_bf16(self, a: DevicePtr, lda: int, w: DevicePtr, c: DevicePtr, ldc: int,
                  m: int, n: int, k: int, stream: int) -> None:
        # a row at a time, each from a fresh contiguous copy: a BLAS matrix product may sum a
        # row in an order that depends on the rows beside it (OpenBLAS 0.3.31's does), and a
        # row's bits must not depend on its batch (packed prefill against each prefill)
        av, cv = self.rows(a, m, lda, k, BF16), self.rows(c, m, ldc, n, BF16)
        wv = self.view(w, (n, k), BF16).astype(F32)
        for r in range(int(m)):
            cv[r] = (wv @ np.array(av[r], dtype=F32)).astype(BF16)


class _HostGraph:
    """Replaying re-runs the recorded calls: on the host, work runs at enqueue time."""

    def __init__(self, fn):
        self._fn = fn

    def replay(self, stream: int) -> None:
        self._fn()
