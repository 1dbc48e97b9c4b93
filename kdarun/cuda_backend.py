"""CupyBackend: the GpuBackend contract over CuPy raw pointers and RawModule kernels.

Memory comes from CuPy's device allocator (plain cudaMalloc underneath) and is addressed by
raw pointer; streams are raw `cudaStream_t` handles; kernels are the `kernels_cu/*.cu`
sources compiled by NVRTC for this device. Prefill GEMMs go to cuBLAS on the caller's stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import cupy as cp
import numpy as np

from .backend import MIN_CC, DevicePtr, GpuBackend, LaunchConfig, TensorMap, kernels_dir
from .driver import OVERLAP_MIN_CC, encode_tensor_map, launch_ex
from .errors import KdaError, check_int, format_bytes

_H2D, _D2H, _D2D = 1, 2, 3
_CUDA_R_16BF, _CUBLAS_COMPUTE_32F, _GEMM_DEFAULT_TENSOR_OP = 14, 68, 99
_OP_N, _OP_T = 0, 1


@dataclass(frozen=True)
class _ForeignStream:
    """A raw cudaStream_t handle as the CUDA stream protocol presents one."""
    handle: int

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


class CupyBackend(GpuBackend):
    name = "cuda"

    def __init__(self, device: int = 0):
        self._device = cp.cuda.Device(device)
        self._device.use()
        props = cp.cuda.runtime.getDeviceProperties(device)
        self._name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        self._sm_count = int(props["multiProcessorCount"])
        self._cc = 10 * int(props["major"]) + int(props["minor"])
        if self._cc < MIN_CC:
            raise KdaError(f"{self._name} has compute capability {props['major']}.{props['minor']}"
                           f"; kdarun's kernels need {MIN_CC // 10}.{MIN_CC % 10} or later (Ampere on: bf16 mma.sync, "
                           f"cp.async)")
        self._mem: dict[int, Any] = {}
        self._streams: dict[int, Any] = {0: cp.cuda.Stream.null}
        self._functions: dict[tuple[str, str], tuple[Any, int, int]] = {}
        self._alpha = np.ones(1, np.float32)
        self._beta = np.zeros(1, np.float32)

    @property
    def device_name(self) -> str:
        return self._name

    @property
    def sm_count(self) -> int:
        return self._sm_count

    @property
    def compute_capability(self) -> int:
        return self._cc

    @property
    def reads_tables_free(self) -> bool:
        return False

    @property
    def has_wgmma(self) -> bool:
        return self._cc == 90

    @property
    def arch(self) -> str:
        """The architecture the kernels are built for: the device's own, sm_90a on 9.0 (whose
        warpgroup MMAs the Hopper walk runs on)."""
        return "sm_90a" if self.has_wgmma else f"sm_{self._cc}"

    def stream_obj(self, stream: int):
        """The CuPy stream object of a raw handle (for graph capture and `with` blocks): a
        handle kdarun did not create (an engine's, torch's) is wrapped through the CUDA
        stream protocol where CuPy has it (14 on; ExternalStream is deprecated there)."""
        s = self._streams.get(int(stream))
        if s is None:
            from_external = getattr(cp.cuda.Stream, "from_external", None)
            s = (from_external(_ForeignStream(int(stream))) if from_external is not None
                 else cp.cuda.ExternalStream(int(stream)))
            self._streams[int(stream)] = s
        return s

    # -- memory --------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> DevicePtr:
        nbytes = check_int(nbytes, "alloc: nbytes", 1)
        try:
            mem = cp.cuda.alloc(nbytes)
        except cp.cuda.memory.OutOfMemoryError:
            raise KdaError(f"alloc: {self._name} cannot allocate {format_bytes(nbytes)} "
                           f"({format_bytes(self.free_memory())} free)") from None
        self._mem[mem.ptr] = mem
        return DevicePtr(mem.ptr)

    def free_memory(self) -> int:
        """The device's free bytes (cudaMemGetInfo) and those CuPy's memory pool, which
        `alloc` draws from, holds unused."""
        free, _total = cp.cuda.runtime.memGetInfo()
        return int(free) + cp.get_default_memory_pool().free_bytes()

    def free(self, ptr: DevicePtr) -> None:
        if self._mem.pop(int(ptr), None) is None:
            raise KdaError(f"free: {ptr!r} is not the start of a live allocation")
        self._uploads().pop(int(ptr), None)

    def memset(self, ptr: DevicePtr, byte: int, nbytes: int, stream: int) -> None:
        cp.cuda.runtime.memsetAsync(int(ptr), check_int(byte, "memset: byte", 0, 255), nbytes,
                                    int(stream))

    def copy_h2d(self, dst: DevicePtr, src: np.ndarray, stream: int) -> None:
        src = np.ascontiguousarray(src)
        cp.cuda.runtime.memcpyAsync(int(dst), src.ctypes.data, src.nbytes, _H2D, int(stream))
        self._retag(dst, src.dtype)

    def copy_d2h(self, dst: np.ndarray, src: DevicePtr, stream: int) -> None:
        if not dst.flags.c_contiguous:
            raise KdaError("copy_d2h: destination must be C-contiguous")
        cp.cuda.runtime.memcpyAsync(dst.ctypes.data, int(src), dst.nbytes, _D2H, int(stream))

    def copy_d2d(self, dst: DevicePtr, src: DevicePtr, nbytes: int, stream: int) -> None:
        cp.cuda.runtime.memcpyAsync(int(dst), int(src), nbytes, _D2D, int(stream))

    # -- streams and events ----------------------------------------------------------------
    def create_stream(self) -> int:
        s = cp.cuda.Stream(non_blocking=True)
        self._streams[s.ptr] = s
        return s.ptr

    def destroy_stream(self, stream: int) -> None:
        if stream:
            self._streams.pop(int(stream), None)

    def synchronize(self, stream: int) -> None:
        cp.cuda.runtime.streamSynchronize(int(stream))

    def create_event(self) -> Any:
        return cp.cuda.Event()

    def record_event(self, event: Any, stream: int) -> None:
        event.record(self.stream_obj(stream))

    def stream_wait_event(self, stream: int, event: Any) -> None:
        self.stream_obj(stream).wait_event(event)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end)

    def capture(self, fn, stream: int) -> "_CudaGraph":
        if not stream:
            raise KdaError("capture: use a stream from create_stream(), not the legacy "
                           "default stream 0")
        s = self.stream_obj(stream)
        s.begin_capture()
        try:
            fn()
        finally:
            graph = s.end_capture()
        return _CudaGraph(self, graph)

    # -- kernels ---------------------------------------------------------------------------
    def load_module(self, family: str, defines: Sequence[str]) -> Any:
        """Compile `kernels_cu/<family>.cu` with `defines` for this device's architecture
        (`arch`: NVRTC keeps this first -arch over the one CuPy appends)."""
        src = kernels_dir() / f"{family}.cu"
        if not src.exists():
            raise KdaError(f"kernel family {family!r}: {src} not found")
        raw = cp.RawModule(code=src.read_text(),
                           options=(f"-arch={self.arch}", "-std=c++17", f"-I{kernels_dir()}", *defines))
        raw.compile()
        return _Module(" ".join((family, *defines)), raw)

    def module_global(self, module: "_Module", name: str) -> DevicePtr:
        """The device address of a `__device__` or `__constant__` variable of a loaded module
        (such as chunk.cu's phase counters in its marked build)."""
        return DevicePtr(module.raw.get_global(name).ptr)

    def shared_bytes(self, module: "_Module", kernel: str) -> int:
        """A kernel's dynamic shared memory: the `<kernel>_smem` int its source exports, 0
        where it exports none (it takes none)."""
        try:
            at = self.module_global(module, f"{kernel}_smem")
        except cp.cuda.driver.CUDADriverError:
            return 0
        word = np.zeros(1, np.int32)
        cp.cuda.runtime.memcpy(word.ctypes.data, int(at), word.nbytes, _D2H)
        return int(word[0])

    def _function(self, module: "_Module", kernel: str) -> tuple[Any, int, int]:
        """A kernel's function, its dynamic shared memory (allowed on the function once, here,
        when it is first launched) and its CUfunction handle (for overlapped launches)."""
        key = (module.family, kernel)
        if key not in self._functions:
            fn, smem = module.raw.get_function(kernel), self.shared_bytes(module, kernel)
            if smem > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = smem
            self._functions[key] = (fn, smem, fn.kernel.ptr)
        return self._functions[key]

    def launch(self, module: "_Module", kernel: str, cfg: LaunchConfig, args: Sequence[Any],
               stream: int) -> None:
        fn, smem, handle = self._function(module, kernel)
        if cfg.smem is not None:
            if cfg.smem > smem:
                raise KdaError(f"{kernel}: a launch asks for {cfg.smem} bytes of shared memory, "
                               f"past the {smem} its source exports as {kernel}_smem")
            smem = cfg.smem
        cargs = tuple(np.uint64(int(a)) if isinstance(a, DevicePtr) else a for a in args)
        overlap = cfg.overlap and self._cc >= OVERLAP_MIN_CC
        if overlap or any(isinstance(a, TensorMap) for a in args):
            launch_ex(kernel, handle, cfg.grid, cfg.block, smem, cargs, stream, overlap)
            return
        with self.stream_obj(stream):
            fn(cfg.grid, cfg.block, cargs, shared_mem=smem)

    def tensor_map(self, kernel: str, m: TensorMap) -> TensorMap:
        return encode_tensor_map(kernel, m)

    def gemm_bf16(self, a: DevicePtr, lda: int, w: DevicePtr, c: DevicePtr, ldc: int,
                  m: int, n: int, k: int, stream: int) -> None:
        # Row-major c[m, n] = a[m, k] w[n, k]^T is column-major c^T = op_T(w) a^T. CuPy's
        # wrappers point the handle at CuPy's current stream on every call, so the caller's
        # stream must be made current, not set on the handle.
        from cupy.cuda import cublas
        with self.stream_obj(stream):
            cublas.gemmEx(self._device.cublas_handle, _OP_T, _OP_N, n, m, k, self._alpha.ctypes.data, int(w),
                          _CUDA_R_16BF, k, int(a), _CUDA_R_16BF, lda, self._beta.ctypes.data,
                          int(c), _CUDA_R_16BF, ldc, _CUBLAS_COMPUTE_32F, _GEMM_DEFAULT_TENSOR_OP)


class _Module:
    def __init__(self, family: str, raw: Any):
        self.family = family
        self.raw = raw


class _CudaGraph:
    def __init__(self, backend: CupyBackend, graph: Any):
        self._backend = backend
        self._graph = graph

    def replay(self, stream: int) -> None:
        self._graph.launch(self._backend.stream_obj(stream))
