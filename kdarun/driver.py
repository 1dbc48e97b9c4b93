"""The CUDA driver calls CuPy does not wrap, through ctypes: cuLaunchKernelEx, for launches
that may overlap the kernel ahead of them on their stream (programmatic dependent launch) or
that take a tensor map by value, and cuTensorMapEncodeTiled, which makes those maps.

The structures follow cuda.h (CUDA 12 on). Nothing here needs CuPy, so the argument packing
and the structures' layout are tested on any machine; the calls themselves need the driver.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import struct
from typing import Sequence

import numpy as np

from .backend import TensorMap, check_tensor_map
from .errors import KdaError

OVERLAP_MIN_CC = 90  # griddepcontrol (programmatic dependent launch): Hopper on
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfigEx(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttr)), ("num_attrs", ctypes.c_uint)]


_OVERLAP = LaunchAttr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
_OVERLAP.value[0] = 1  # programmaticStreamSerializationAllowed
_ARG_CODES = {np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.int32): "i4x",
              np.dtype(np.float32): "f4x"}  # each kernel argument in an 8-byte slot
TENSOR_MAP_BYTES = 128  # a CUtensorMap, 64-byte aligned
_BF16, _SWIZZLE_128B, _L2_PROMOTE_128B = 9, 3, 2  # cuda.h's CUtensorMap* enums


def encode_tensor_map(kernel: str, m: TensorMap) -> TensorMap:
    """`m` with its CUtensorMap, which gemv_wg.cu's copies read: boxes of m.box k x m.box rows,
    128-byte swizzle, L2 promotion of 128 bytes, zero fill past the ends."""
    check_tensor_map(kernel, m)
    raw = (ctypes.c_char * (TENSOR_MAP_BYTES + 64))()
    at = (ctypes.addressof(raw) + 63) & ~63
    dims = (ctypes.c_uint64 * 2)(m.cols, m.rows)
    strides = (ctypes.c_uint64 * 1)(2 * m.ld)
    box = (ctypes.c_uint32 * 2)(m.box, m.box)
    steps = (ctypes.c_uint32 * 2)(1, 1)
    lib = _driver()
    _check(lib, kernel, "cuTensorMapEncodeTiled", lib.cuTensorMapEncodeTiled(
        at, _BF16, 2, int(m.ptr), dims, strides, box, steps, 0, _SWIZZLE_128B, _L2_PROMOTE_128B,
        0))
    return dataclasses.replace(m, encoded=ctypes.string_at(at, TENSOR_MAP_BYTES))


@functools.cache
def _arg_struct(dtypes: tuple[np.dtype | None, ...]) -> struct.Struct:
    return struct.Struct("<" + "".join("8x" if d is None else _ARG_CODES[d] for d in dtypes))


def pack_args(kernel: str, args: Sequence[np.generic | TensorMap]) -> tuple[ctypes.Array, int]:
    """A launch's arguments in one buffer, an 8-byte slot each (a 4-byte value in its low
    half), then the slots' addresses, then each tensor map's 128 bytes (64-byte aligned; its
    slot stays unused): (the buffer, which must outlive the launch call, and the address of
    the address array, cuLaunchKernelEx's kernelParams). One buffer keeps eager decode's
    launches cheap: ~8 us of Python for a front end's 29 arguments."""
    maps = [i for i, a in enumerate(args) if isinstance(a, TensorMap)]
    if any(len(args[i].encoded) != TENSOR_MAP_BYTES for i in maps):
        raise KdaError(f"{kernel}: a tensor map argument must be encoded "
                       f"(driver.encode_tensor_map)")
    try:
        packer = _arg_struct(tuple(None if i in maps else a.dtype for i, a in enumerate(args)))
    except (AttributeError, KeyError):
        raise KdaError(f"{kernel}: kernel arguments must be numpy uint64, int64, int32 or "
                       f"float32 scalars (DevicePtr as uint64) or tensor maps") from None
    n = len(args)
    tail = packer.size + 8 * n
    buf = (ctypes.c_char * (tail + (64 + TENSOR_MAP_BYTES * len(maps) if maps else 0)))()
    base = ctypes.addressof(buf)
    packer.pack_into(buf, 0, *(a for i, a in enumerate(args) if i not in maps))
    where = list(range(base, base + 8 * n, 8))
    at = (base + tail + 63) & ~63
    for j, i in enumerate(maps):
        where[i] = at + TENSOR_MAP_BYTES * j
        ctypes.memmove(where[i], args[i].encoded, TENSOR_MAP_BYTES)
    struct.pack_into(f"<{n}Q", buf, packer.size, *where)
    return buf, base + packer.size


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    if not hasattr(lib, "cuLaunchKernelEx"):
        raise KdaError("the CUDA driver has no cuLaunchKernelEx (CUDA 12.0 on): overlapped "
                       "launches and tensor maps need a newer driver; set "
                       "kdarun.kernels.DECODE_OVERLAP = 0 and kdarun.kernels.BATCH_WG = 0")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfigEx), ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p]
    lib.cuTensorMapEncodeTiled.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check(lib: ctypes.CDLL, kernel: str, call: str, err: int) -> None:
    if err:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(err, ctypes.byref(name))
        raise KdaError(f"{kernel}: {call} failed: {(name.value or b'error %d' % err).decode()}")


def launch_ex(kernel: str, function: int, grid: tuple[int, int, int],
              block: tuple[int, int, int], smem: int, args: Sequence[np.generic | TensorMap],
              stream: int, overlap: bool) -> None:
    """Launch CUfunction `function` through cuLaunchKernelEx. With `overlap`, programmatic
    stream serialisation is allowed: it may start before the kernel ahead of it on `stream`
    ends, and orders what it reads after that kernel by its own griddepcontrol.wait (a stream
    capture records the edge). Tensor maps go by value."""
    buf, params = pack_args(kernel, args)  # buf holds the arguments through the call
    conf = LaunchConfigEx((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem,
                          int(stream), ctypes.pointer(_OVERLAP) if overlap else None,
                          int(overlap))
    lib = _driver()
    _check(lib, kernel, "cuLaunchKernelEx", lib.cuLaunchKernelEx(ctypes.byref(conf), function,
                                                                 params, None))
