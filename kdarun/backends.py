"""`open_backend`: picks and builds a GpuBackend. It sits above both implementations, so the
contract in `backend.py` knows neither of them."""

from __future__ import annotations

import sys

from .backend import GpuBackend
from .errors import KdaError
from .host_backend import HostBackend


def open_backend(kind: str = "auto", *, announce: bool = True) -> GpuBackend:
    """`"cuda"`, `"host"`, or `"auto"` (CUDA when `cupy.cuda.is_available()`, else host)."""
    if kind not in ("auto", "cuda", "host"):
        raise KdaError(f"backend: expected 'auto', 'cuda' or 'host', got {kind!r}")
    if kind == "auto":
        kind = "cuda" if cuda_available() else "host"
        if announce:
            print(f"kdarun: backend auto -> {kind}", file=sys.stderr)
    if kind == "cuda":
        if not cuda_available():
            raise KdaError("backend 'cuda': no usable CUDA device (CuPy missing or "
                           "cupy.cuda.is_available() is False)")
        from .cuda_backend import CupyBackend
        return CupyBackend()
    return HostBackend()


def cuda_available() -> bool:
    try:
        import cupy
    except Exception:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False
