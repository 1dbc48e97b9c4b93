"""HostBackend memory model and open_backend."""

from __future__ import annotations

import numpy as np
import pytest

from kdarun import DevicePtr, KdaError, open_backend
from kdarun.backends import cuda_available


def test_device_ptr_arithmetic():
    p = DevicePtr(0x1000)
    assert isinstance(p + 16, DevicePtr) and int(p + 16) == 0x1010
    assert p.offset(4) == 0x1004 and not p.is_null and DevicePtr(0).is_null


def test_host_memory_roundtrip_and_bounds(host):
    a = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    p = host.upload(a)
    assert int(p) % 256 == 0
    assert np.array_equal(host.download(p, (100,), np.float32), a)
    q = host.alloc(400)
    host.copy_d2d(q, p + 40, 360, 0)
    assert np.array_equal(host.download(q, (90,), np.float32), a[10:])
    host.memset(q, 0xFF, 400, 0)
    assert np.all(np.isnan(host.download(q, (100,), np.float32)))
    with pytest.raises(KdaError, match="runs past its allocation"):
        host.download(p + 8, (100,), np.float32)
    host.free(p)
    with pytest.raises(KdaError, match="not the start of a live allocation"):
        host.free(p)


def test_open_backend():
    assert open_backend("host").name == "host"
    with pytest.raises(KdaError, match="expected 'auto', 'cuda' or 'host'"):
        open_backend("tpu")
    if not cuda_available():
        assert open_backend("auto", announce=False).name == "host"
        with pytest.raises(KdaError, match="no usable CUDA device"):
            open_backend("cuda")


def test_host_launch_passes_int32_arguments_as_python_ints(host):
    """The kernels' int arguments travel as np.int32 (4 bytes, for CUDA); the host twins get
    Python ints, so a slot's byte offset (slot x state bytes) does not wrap past 2 GiB, as it
    would in int32 arithmetic (a glm-5.3-flash pool from slot 512 on)."""
    from kdarun.backend import LaunchConfig
    from kdarun.host_kernels import _state_bytes
    seen = []
    module = {"k": lambda gpu, *args: seen.extend(args)}
    host.launch(module, "k", LaunchConfig((1, 1, 1), (1, 1, 1)),
                (np.int32(64), np.int32(4), np.float32(0.5)), 0)
    H, W, scale = seen
    assert type(H) is int and type(W) is int and type(scale) is np.float32
    rec, _ = _state_bytes(H, 128, W)
    assert 1024 * rec == 1024 * 64 * 128 * 128 * 4  # 4 GiB: past int32
