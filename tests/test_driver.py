"""The driver launch's structures and argument packing, against cuda.h's layout, and the
tensor maps' checks (the calls themselves need a GPU: tests/gpu)."""

from __future__ import annotations

import ctypes
import struct

import numpy as np
import pytest

from kdarun import KdaError, driver
from kdarun.backend import DevicePtr, TensorMap, check_tensor_map


def test_structures_have_cuda_h_layout():
    """CUlaunchAttribute: a 4-byte id, padding to 8, a 64-byte value union (72 bytes);
    CUlaunchConfig: six dims and the shared memory (28 bytes), the stream at 32, the
    attributes at 40, their count at 48 (56 bytes)."""
    assert ctypes.sizeof(driver.LaunchAttr) == 72 and driver.LaunchAttr.value.offset == 8
    cfg = driver.LaunchConfigEx
    assert [getattr(cfg, f).offset for f in ("grid", "block", "shared_mem", "stream", "attrs",
                                             "num_attrs")] == [0, 12, 24, 32, 40, 48]
    assert ctypes.sizeof(cfg) == 56


def test_arguments_pack_into_8_byte_slots_with_their_addresses():
    args = (np.uint64(0x1234_5678_9ABC), np.int32(-7), np.float32(1.5), np.int64(-2),
            np.int32(2**31 - 1))
    buf, params = driver.pack_args("k", args)
    raw, n = bytes(buf), len(args)
    slots = [raw[8 * i: 8 * i + 8] for i in range(n)]
    assert struct.unpack("<Q", slots[0])[0] == 0x1234_5678_9ABC
    assert struct.unpack("<i", slots[1][:4])[0] == -7
    assert struct.unpack("<f", slots[2][:4])[0] == 1.5
    assert struct.unpack("<q", slots[3])[0] == -2
    assert struct.unpack("<i", slots[4][:4])[0] == 2**31 - 1
    base = ctypes.addressof(buf)
    assert params == base + 8 * n  # the address array follows the slots
    assert list(struct.unpack(f"<{n}Q", raw[8 * n:])) == [base + 8 * i for i in range(n)]


def test_tensor_maps_pack_by_value_64_byte_aligned():
    """A tensor map argument: its 128 bytes after the address array, 64-byte aligned, its
    kernelParams entry pointing at them; the scalars keep their slots."""
    maps = [TensorMap(DevicePtr(0x1000), 64, 64, 64, 64, bytes(range(i, i + 128)))
            for i in (0, 100)]
    args = (maps[0], np.int32(7), maps[1], np.uint64(0xABC))
    buf, params = driver.pack_args("k", args)
    where = struct.unpack("<4Q", ctypes.string_at(params, 32))
    assert where[0] % 64 == 0 and where[2] == where[0] + 128
    assert ctypes.string_at(where[0], 128) == maps[0].encoded
    assert ctypes.string_at(where[2], 128) == maps[1].encoded
    assert struct.unpack("<i", ctypes.string_at(where[1], 4))[0] == 7
    assert struct.unpack("<Q", ctypes.string_at(where[3], 8))[0] == 0xABC
    base = ctypes.addressof(buf)
    assert base <= where[0] and where[2] + 128 <= base + len(buf)  # inside the one buffer


def test_tensor_maps_are_checked_and_must_be_encoded_to_launch():
    with pytest.raises(KdaError, match=r"^k: a tensor map argument must be encoded"):
        driver.pack_args("k", (TensorMap(DevicePtr(0x1000), 64, 64, 64, 64),))
    check_tensor_map("k", TensorMap(DevicePtr(0x1010), 1, 8, 8, 64))
    with pytest.raises(KdaError, match=r"^k: a tensor map needs a 16-byte aligned base and a "
                                       r"row stride of a multiple of 8 bf16; got base 0x1008, "
                                       r"ld=64"):
        check_tensor_map("k", TensorMap(DevicePtr(0x1008), 64, 64, 64, 64))
    with pytest.raises(KdaError, match=r"got base 0x1000, ld=68"):
        check_tensor_map("k", TensorMap(DevicePtr(0x1000), 64, 64, 68, 64))
    with pytest.raises(KdaError, match=r"^k: a tensor map needs rows, cols >= 1 and ld >= cols; "
                                       r"got rows=0 cols=64 ld=64"):
        check_tensor_map("k", TensorMap(DevicePtr(0x1000), 0, 64, 64, 64))
    with pytest.raises(KdaError, match=r"got rows=4 cols=72 ld=64"):
        check_tensor_map("k", TensorMap(DevicePtr(0x1000), 4, 72, 64, 64))


@pytest.mark.parametrize("bad", [3, 1.0, np.float64(1.0), np.int16(1)])
def test_arguments_of_other_types_are_refused(bad):
    with pytest.raises(KdaError, match=r"^kern: kernel arguments must be numpy uint64, int64, "
                                       r"int32 or float32 scalars \(DevicePtr as uint64\) "
                                       r"or tensor maps"):
        driver.pack_args("kern", (np.int32(1), bad))


@pytest.mark.parametrize("overlap", [True, False])
def test_the_launch_hands_the_driver_what_cuda_h_says(monkeypatch, overlap):
    """launch_ex's call as the driver reads it (CI has no driver; a C-callable stand-in
    with cuLaunchKernelEx's signature reads the config and the kernelParams array the way the
    driver does): dims, shared memory, stream, the one attribute, each argument's value."""
    seen: dict = {}
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(driver.LaunchConfigEx),
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)

    def read(conf, function, params, extra):
        c, ptrs = conf.contents, ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        seen.update(grid=tuple(c.grid), block=tuple(c.block), smem=c.shared_mem,
                    stream=c.stream, attrs=[(c.attrs[i].id, c.attrs[i].value[0])
                                            for i in range(c.num_attrs)],
                    function=function, extra=extra)
        seen["args"] = (ctypes.cast(ptrs[0], ctypes.POINTER(ctypes.c_uint64))[0],
                        ctypes.cast(ptrs[1], ctypes.POINTER(ctypes.c_int32))[0],
                        ctypes.cast(ptrs[2], ctypes.POINTER(ctypes.c_float))[0])
        return 0

    fn = proto(read)
    monkeypatch.setattr(driver, "_driver", lambda: type("Lib", (), {
        "cuLaunchKernelEx": staticmethod(lambda *a: fn(*a))}))
    driver.launch_ex("k", 0xDEAD0, (3, 2, 1), (256, 1, 1), 4096,
                     (np.uint64(0x7F00_0000_1000), np.int32(-5), np.float32(0.25)), 0x55AA,
                     overlap)
    assert seen == {"grid": (3, 2, 1), "block": (256, 1, 1), "smem": 4096, "stream": 0x55AA,
                    "attrs": [(6, 1)] if overlap else [], "function": 0xDEAD0, "extra": None,
                    "args": (0x7F00_0000_1000, -5, 0.25)}
