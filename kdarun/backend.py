"""The GpuBackend contract every other module talks to (`backends.open_backend` picks one).

A backend owns device memory (addressed by `DevicePtr`, a byte address), streams (plain
`int` handles, a raw `cudaStream_t` on CUDA), events, copies, and kernel launch. Kernels
are addressed by family (the stem of a `kernels_cu/*.cu` file) and name; the host
backend runs a NumPy implementation of the same kernel with the same arguments.
"""

from __future__ import annotations

import abc
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from .errors import KdaError, check_int, format_bytes


MIN_CC = 80  # the oldest compute capability kdarun builds for: bf16 mma.sync, cp.async


class DevicePtr(int):
    """A device address in bytes. Offsets add whole bytes; `DevicePtr(0)` is the null pointer.
    An address is a non-negative integer: a negative one (an offset past the start) or a
    fractional offset is refused."""

    def __new__(cls, address: int = 0) -> "DevicePtr":
        if type(address) is not int or address < 0:  # the fast path: a plain int address
            address = check_int(address, "DevicePtr: a device address", 0)
        return super().__new__(cls, address)

    def __add__(self, nbytes: int) -> "DevicePtr":
        if type(nbytes) is not int:
            nbytes = check_int(nbytes, f"DevicePtr offset from {self!r}: the byte count")
        return DevicePtr(int(self) + nbytes)

    def offset(self, nbytes: int) -> "DevicePtr":
        return self + nbytes

    @property
    def is_null(self) -> bool:
        return int(self) == 0

    def __repr__(self) -> str:
        return f"DevicePtr(0x{int(self):x})"

    @staticmethod
    def check(ptr: object, what: str) -> None:
        """A KdaError naming `what` unless `ptr` is a non-null DevicePtr."""
        if not isinstance(ptr, DevicePtr) or ptr.is_null:
            raise KdaError(f"{what} must be a device pointer (DevicePtr), got {ptr!r}")


def overlaps(a: DevicePtr, n: int, b: DevicePtr, m: int) -> bool:
    """Whether the n bytes at a and the m bytes at b share a byte."""
    return a < b + m and b < a + n


class DeviceOwner:
    """An object that owns device memory and gives it back with `free()`. Once freed, reading
    any of its attributes named in `_DEVICE_ATTRS` and freeing it again raise KdaError: its
    addresses may by then belong to another object, which using them would silently corrupt."""

    _DEVICE_ATTRS: tuple[str, ...] = ()

    @property
    def freed(self) -> bool:
        return self.__dict__.get("_freed", False)

    @contextmanager
    def _freeing(self) -> Iterator[None]:
        """Wrap the body of `free()`: refuses a second free, and once the body has given the
        memory back, forgets the device attributes."""
        if self.freed:
            raise KdaError(f"{type(self).__name__}.free(): already freed; a second free would "
                           "give back memory that may belong to another object now")
        yield
        self.__dict__["_freed"] = True
        for name in self._DEVICE_ATTRS:
            self.__dict__.pop(name, None)

    def _require_live(self, what: str) -> None:
        if self.freed:
            raise KdaError(f"{type(self).__name__}.{what}: the {type(self).__name__} was freed "
                           "and cannot be used any more")

    def __getattr__(self, name: str) -> Any:  # only reached where normal lookup failed
        if name in type(self)._DEVICE_ATTRS and self.freed:
            raise KdaError(f"{type(self).__name__} was freed: its {name} cannot be used any "
                           "more (that memory may belong to another object now)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class Graph(Protocol):
    def replay(self, stream: int) -> None: ...


@dataclass(frozen=True)
class LaunchConfig:
    """A launch's grid and block, and its dynamic shared memory where it depends on the
    launch: otherwise (None) the kernel source exports it as `<kernel>_smem` (for a kernel
    sized per launch, the most any launch takes), and the CUDA backend launches with that.
    `overlap`: the launch may start while the one before it on the stream still runs
    (programmatic dependent launch, where the device has it): only for a kernel that calls
    `prior_grid_sync` (kernels_cu/common.cuh) as that function's comment requires."""
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int | None = None
    overlap: bool = False


def kernels_dir() -> Path:
    """Where the `.cu` sources live: the repository's `kernels_cu/` in a checkout,
    `kdarun/kernels_cu/` in an installed package."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "kernels_cu", here / "kernels_cu"):
        if cand.is_dir():
            return cand
    raise KdaError(f"kernel sources not found next to {here} (looked for kernels_cu/)")


@dataclass(frozen=True)
class TensorMap:
    """The bf16 matrix [rows, cols] at `ptr` (row stride `ld` elements) as the kernels of
    gemv_wg.cu take it, by value, copied in boxes of `box` x `box`: on CUDA `encoded` holds
    the CUtensorMap the driver made of it (`driver.encode_tensor_map`); the host backend's
    twins read the matrix through `ptr`."""
    ptr: DevicePtr
    rows: int
    cols: int
    ld: int
    box: int
    encoded: bytes = b""


def tma_addressable(ptr: DevicePtr, ld: int) -> bool:
    """Whether a tensor map can address bf16 rows at ptr, ld elements apart (cuda.h: a 16-byte
    aligned base, row strides a multiple of 16 bytes)."""
    return int(ptr) % 16 == 0 and ld % 8 == 0


def check_tensor_map(kernel: str, m: TensorMap) -> None:
    """What a tensor map's matrix must satisfy (its shape, `tma_addressable`), as a KdaError
    naming `kernel`."""
    if m.rows < 1 or m.cols < 1 or m.ld < m.cols:
        raise KdaError(f"{kernel}: a tensor map needs rows, cols >= 1 and ld >= cols; got "
                       f"rows={m.rows} cols={m.cols} ld={m.ld}")
    if not tma_addressable(m.ptr, m.ld):
        raise KdaError(f"{kernel}: a tensor map needs a 16-byte aligned base and a row stride "
                       f"of a multiple of 8 bf16; got base {int(m.ptr):#x}, ld={m.ld}")


class GpuBackend(abc.ABC):
    """Memory, streams, events, copies and kernel launch on one device."""

    name: str

    # -- memory --------------------------------------------------------------------------
    @abc.abstractmethod
    def alloc(self, nbytes: int) -> DevicePtr: ...

    @abc.abstractmethod
    def free_memory(self) -> int:
        """Bytes this backend can still allocate."""

    def check_free_memory(self, nbytes: int, what: str) -> None:
        """Refuse `what`, which needs `nbytes` of device memory, before any of it is allocated
        when the device has less free."""
        free = self.free_memory()
        if nbytes > free:
            raise KdaError(f"{what} needs {format_bytes(nbytes)} of device memory, but "
                           f"{self.device_name} has {format_bytes(free)} free")

    @abc.abstractmethod
    def free(self, ptr: DevicePtr) -> None: ...

    @abc.abstractmethod
    def memset(self, ptr: DevicePtr, byte: int, nbytes: int, stream: int) -> None: ...

    @abc.abstractmethod
    def copy_h2d(self, dst: DevicePtr, src: np.ndarray, stream: int) -> None: ...

    @abc.abstractmethod
    def copy_d2h(self, dst: np.ndarray, src: DevicePtr, stream: int) -> None:
        """Copy `dst.nbytes` bytes into the host array `dst`; complete once the stream is
        synchronised."""

    @abc.abstractmethod
    def copy_d2d(self, dst: DevicePtr, src: DevicePtr, nbytes: int, stream: int) -> None: ...

    # -- streams and events ----------------------------------------------------------------
    @abc.abstractmethod
    def create_stream(self) -> int: ...

    @abc.abstractmethod
    def destroy_stream(self, stream: int) -> None: ...

    @abc.abstractmethod
    def synchronize(self, stream: int) -> None: ...

    @abc.abstractmethod
    def create_event(self) -> Any: ...

    @abc.abstractmethod
    def record_event(self, event: Any, stream: int) -> None: ...

    @abc.abstractmethod
    def stream_wait_event(self, stream: int, event: Any) -> None:
        """Work enqueued on `stream` from now on waits for the work `event` recorded."""

    @abc.abstractmethod
    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two recorded events (synchronises on `end`)."""

    # -- kernels ---------------------------------------------------------------------------
    @abc.abstractmethod
    def load_module(self, family: str, defines: Sequence[str]) -> Any:
        """Load the kernels of `kernels_cu/<family>.cu` built with `defines` ("-DNAME=value":
        `kernels.compile_defines()`, plus any a tool adds); the host backend loads their NumPy
        twins, which take the same arguments and need no build."""

    @abc.abstractmethod
    def launch(self, module: Any, kernel: str, cfg: LaunchConfig, args: Sequence[Any],
               stream: int) -> None:
        """Enqueue `kernel(*args)` on `stream`. Pointers are `DevicePtr`, `int` parameters
        `np.int32`, `float` parameters `np.float32`."""

    def tensor_map(self, kernel: str, m: TensorMap) -> TensorMap:
        """`m` as `kernel` takes it: checked, and on CUDA encoded (the host's twins read the
        matrix itself)."""
        check_tensor_map(kernel, m)
        return m

    @abc.abstractmethod
    def gemm_bf16(self, a: DevicePtr, lda: int, w: DevicePtr, c: DevicePtr, ldc: int,
                  m: int, n: int, k: int, stream: int) -> None:
        """`c[m, n] = bf16(a[m, k] @ w[n, k]^T)`, bf16 operands, fp32 accumulation;
        `lda`/`ldc` are row strides in elements, `w` is dense `[n, k]`."""

    @abc.abstractmethod
    def capture(self, fn: Callable[[], None], stream: int) -> "Graph":
        """Record the work `fn` enqueues on `stream` (a created stream, not the legacy
        default) as a graph to `replay` later; nothing runs during capture on CUDA. Every
        buffer must exist beforehand and every kernel must have been launched once."""

    # -- helpers shared by both backends ------------------------------------------------------
    @property
    def device_name(self) -> str:
        return self.name

    @property
    def sm_count(self) -> int:
        """Streaming multiprocessors: how many blocks of a one-block-per-SM kernel run at once."""
        return 1

    @property
    def compute_capability(self) -> int:
        """10 major + minor of the device the kernels are built for; the host twins stand in
        for the sm_90a build."""
        return 90

    @property
    def has_wgmma(self) -> bool:
        """Whether the Hopper walk's warpgroup MMAs run here (the host twin needs none)."""
        return True

    def check_region(self, ptr: DevicePtr, nbytes: int, what: str) -> None:
        """A KdaError naming `what` unless nbytes at ptr lie in one live allocation, where the
        backend can tell (the host); a GPU pointer's extent is not known, and nothing is
        checked there."""

    @property
    def reads_tables_free(self) -> bool:
        """Whether reading a device table back costs nothing here (the host), so every
        batched call may check its slot tables; on a GPU it would copy and wait, which a
        captured graph cannot."""
        return True

    def upload(self, array: np.ndarray, stream: int = 0) -> DevicePtr:
        """Allocate and copy a host array; returns its device address. The array's dtype is
        remembered at that address until it is freed (`check_itemsize`)."""
        array = np.ascontiguousarray(array)
        ptr = self.alloc(max(array.nbytes, 1))
        self.copy_h2d(ptr, array, stream)
        self._uploads()[int(ptr)] = array.dtype
        return ptr

    def _uploads(self) -> dict[int, np.dtype]:
        """The dtype `upload` (or a later `copy_h2d` to the same address) put at each live
        address it returned."""
        return self.__dict__.setdefault("_uploaded_dtypes", {})

    def _retag(self, ptr: DevicePtr, dtype: np.dtype) -> None:
        """`copy_h2d` wrote an array of `dtype` at ptr: an upload's address now holds that."""
        if int(ptr) in self._uploads():
            self._uploads()[int(ptr)] = dtype

    def check_itemsize(self, ptr: DevicePtr, dtype: Any, what: str) -> None:
        """A KdaError naming `what` where ptr is the address `upload` returned for an array
        whose elements are not the size of `dtype`'s, which the kernels read there, or are
        floats of another type: an int64 slot table read as int32 names a slot in every
        other entry, float32 or float16 rows read as bf16 are other numbers. A same-size
        view of the bits (bf16 as uint16) passes, and so does any other pointer (an offset
        into an allocation, memory of another library's), which is not known."""
        got = self._uploads().get(int(ptr))  # decode's every call: one lookup, no more
        if got is None or got == dtype:
            return
        want = np.dtype(dtype)
        if got.itemsize != want.itemsize or "f" in (got.kind, want.kind):
            raise KdaError(f"{what}: the kernels read {want.name} ({want.itemsize}-byte) "
                           f"elements there, but {ptr!r} was uploaded from a {got.name} array "
                           f"({got.itemsize}-byte elements); convert it with "
                           f".astype({want.name}) before the upload")

    def download(self, ptr: DevicePtr, shape: tuple[int, ...], dtype: Any,
                 stream: int = 0) -> np.ndarray:
        """Copy `shape` elements of `dtype` at `ptr` to a new host array (synchronises)."""
        dims = shape if isinstance(shape, (tuple, list)) else (shape,)
        out = np.empty(tuple(check_int(n, "download: a dimension of the shape", 0)
                             for n in dims), dtype=dtype)
        self.copy_d2h(out, ptr, stream)
        self.synchronize(stream)
        return out
