"""KdaSeqState: the state one sequence carries between calls.

The recurrent state is `[H, D_v, D_k]` fp32 (K contiguous, the layout vLLM and fla use,
so states interchange with serving engines); the conv state is the last `W-1` rows of
`qkv_proj`, `[W-1, conv_dim]` bf16, oldest first.
"""

from __future__ import annotations

import math

import numpy as np

from .backend import DeviceOwner, GpuBackend
from .config import Glm5NextKdaConfig, check_config
from .dtypes import BF16, F32
from .errors import KdaError


RECURRENT_LAYOUT = "[H, Dv, Dk]"
CONV_LAYOUT = "[W-1, conv_dim] q|k|v, oldest row first"
# Stage comparisons' tolerances of the two states (as workspace.BufferSpec.tol): measured
# <= 4.0e-3 and <= 1.8e-3; CUDA vs host at D = 128, recurrent 5.1e-3
RECURRENT_TOL = 1e-2
CONV_TOL = 5e-3


def recurrent_shape(cfg: Glm5NextKdaConfig) -> tuple[int, int, int]:
    return (cfg.num_heads, cfg.head_dim, cfg.head_dim)


def conv_shape(cfg: Glm5NextKdaConfig) -> tuple[int, int]:
    return (cfg.conv_kernel - 1, cfg.conv_dim)


class KdaSeqState(DeviceOwner):
    """Device buffers for one sequence's recurrent and conv state, zeroed on creation. After
    `free()` the state refuses every use."""

    _DEVICE_ATTRS = ("recurrent", "conv")

    def __init__(self, gpu: GpuBackend, cfg: Glm5NextKdaConfig, stream: int = 0):
        self.cfg = check_config(cfg, "KdaSeqState")
        self._gpu = gpu
        # the tensor parallel rank whose heads it holds: set by the first TpGroup call that
        # takes it, which refuses it for another rank after; None until then (or to reuse it)
        self.tp_rank: int | None = None
        self.recurrent = gpu.alloc(self.recurrent_nbytes)
        self.conv = gpu.alloc(self.conv_nbytes)
        gpu.memset(self.recurrent, 0, self.recurrent_nbytes, stream)
        gpu.memset(self.conv, 0, self.conv_nbytes, stream)

    @property
    def recurrent_nbytes(self) -> int:
        return math.prod(recurrent_shape(self.cfg)) * F32.itemsize

    @property
    def conv_nbytes(self) -> int:
        return math.prod(conv_shape(self.cfg)) * BF16.itemsize

    def upload(self, recurrent: np.ndarray, conv: np.ndarray, stream: int = 0) -> None:
        """Set both states from host arrays of exactly the state shapes and dtypes."""
        for what, arr, shape, dtype in (("recurrent", recurrent, recurrent_shape(self.cfg), F32),
                                        ("conv", conv, conv_shape(self.cfg), BF16)):
            if not isinstance(arr, np.ndarray):
                raise KdaError(f"state.upload: {what} must be a NumPy array {list(shape)} "
                               f"{dtype}, got {type(arr).__name__}")
            if arr.shape != shape or arr.dtype != dtype:
                raise KdaError(f"state.upload: {what} must be {list(shape)} {dtype}, "
                               f"got {list(arr.shape)} {arr.dtype}")
        self._gpu.copy_h2d(self.recurrent, recurrent, stream)
        self._gpu.copy_h2d(self.conv, conv, stream)

    def download(self, stream: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(recurrent [H, Dv, Dk] fp32, conv [W-1, conv_dim] bf16); synchronises."""
        return (self._gpu.download(self.recurrent, recurrent_shape(self.cfg), F32, stream),
                self._gpu.download(self.conv, conv_shape(self.cfg), BF16, stream))

    def free(self) -> None:
        """Give back both states' memory; the state refuses every use from then on."""
        with self._freeing():
            self._gpu.free(self.recurrent)
            self._gpu.free(self.conv)
