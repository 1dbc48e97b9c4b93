"""The one CUDA driver call CuPy does not wrap: cuLaunchKernelEx, through ctypes, for launches
that may overlap the kernel ahead of them on their stream (programmatic dependent launch).

The structures follow cuda.h (CUDA 12 on). Nothing here needs CuPy, so the argument packing
and the structures' layout are tested on any machine; the call itself needs the driver.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from typing import Sequence

import numpy as np

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


@functools.cache
def _arg_struct(dtypes: tuple[np.dtype, ...]) -> struct.Struct:
    return struct.Struct("<" + "".join(_ARG_CODES[d] for d in dtypes))


def pack_args(kernel: str, args: Sequence[np.generic]) -> tuple[ctypes.Array, int]:
    """A launch's arguments in one buffer, an 8-byte slot each (a 4-byte value in its low
    half), then the slots' addresses: (the buffer, which must outlive the launch call, and the
    address of the address array, cuLaunchKernelEx's kernelParams). One buffer keeps eager
    decode's launches cheap: ~8 us of Python for a front end's 29 arguments."""
    try:
        packer = _arg_struct(tuple(a.dtype for a in args))
    except (AttributeError, KeyError):
        raise KdaError(f"{kernel}: kernel arguments must be numpy uint64, int64, int32 or "
                       f"float32 scalars (DevicePtr as uint64)") from None
    n = len(args)
    buf = (ctypes.c_char * (packer.size + 8 * n))()
    base = ctypes.addressof(buf)
    packer.pack_into(buf, 0, *args)
    struct.pack_into(f"<{n}Q", buf, packer.size, *range(base, base + 8 * n, 8))
    return buf, base + packer.size


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    if not hasattr(lib, "cuLaunchKernelEx"):
        raise KdaError("the CUDA driver has no cuLaunchKernelEx (CUDA 12.0 on): overlapped "
                       "launches need a newer driver; set kdarun.kernels.DECODE_OVERLAP = 0")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfigEx), ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def launch_overlapped(kernel: str, function: int, grid: tuple[int, int, int],
                      block: tuple[int, int, int], smem: int, args: Sequence[np.generic],
                      stream: int) -> None:
    """Launch CUfunction `function` with programmatic stream serialisation allowed: it may
    start before the kernel ahead of it on `stream` ends, and orders what it reads after that
    kernel by its own griddepcontrol.wait. A stream capture records the edge."""
    buf, params = pack_args(kernel, args)  # buf holds the arguments through the call
    conf = LaunchConfigEx((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem,
                          int(stream), ctypes.pointer(_OVERLAP), 1)
    lib = _driver()
    err = lib.cuLaunchKernelEx(ctypes.byref(conf), function, params, None)
    if err:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(err, ctypes.byref(name))
        raise KdaError(f"{kernel}: cuLaunchKernelEx failed: "
                       f"{(name.value or b'error %d' % err).decode()}")
