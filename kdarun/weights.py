"""Glm5NextKdaWeights: one layer's tensors on the device, packed for few launches.

The six projections that read the hidden state (q, k, v, f_a, g_a, b) are packed into
one `[proj_rows, hidden]` matrix so decode reads the hidden row once in one GEMV;
the conv taps are stored `[W, conv_dim]` fp32 so a warp reads one tap of 32 channels
contiguously. The small per-channel parameters are widened to fp32 exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from .backend import DeviceOwner, DevicePtr, GpuBackend
from .config import Glm5NextKdaConfig, check_config
from .dtypes import BF16, F32
from .errors import KdaError

PACKED_INPUT = ("q_proj.weight", "k_proj.weight", "v_proj.weight",
                "f_a_proj.weight", "g_a_proj.weight", "b_proj.weight")


def device_layout(cfg: Glm5NextKdaConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each device tensor of a layer: its shape and dtype."""
    return {"w_in": ((cfg.proj_rows, cfg.hidden_size), BF16), "f_b": ((cfg.qkv, cfg.rank), BF16),
            "g_b": ((cfg.qkv, cfg.rank), BF16), "conv_w": ((cfg.conv_kernel, cfg.conv_dim), F32),
            "a_log": ((cfg.num_heads,), F32), "dt_bias": ((cfg.qkv,), F32),
            "o_norm": ((cfg.head_dim,), F32), "o_proj": ((cfg.hidden_size, cfg.qkv), BF16)}


def weights_nbytes(cfg: Glm5NextKdaConfig) -> int:
    """Device bytes of one layer's weights."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in device_layout(cfg).values())


@dataclass(repr=False)
class Glm5NextKdaWeights(DeviceOwner):
    """One layer's device tensors; after `free` they refuse every use."""
    w_in: DevicePtr  # [proj_rows, hidden] bf16: q|k|v|f_a|g_a|b
    f_b: DevicePtr  # [qkv, R] bf16
    g_b: DevicePtr  # [qkv, R] bf16
    conv_w: DevicePtr  # [W, conv_dim] fp32: q|k|v channels
    a_log: DevicePtr  # [H] fp32
    dt_bias: DevicePtr  # [qkv] fp32
    o_norm: DevicePtr  # [D] fp32
    o_proj: DevicePtr  # [hidden, qkv] bf16
    nbytes: int  # total device bytes (what one decode reads)
    cfg: Glm5NextKdaConfig  # the config whose shapes (device_layout) these are

    @classmethod
    def upload(cls, gpu: GpuBackend, cfg: Glm5NextKdaConfig, tensors: dict[str, np.ndarray],
               stream: int = 0) -> "Glm5NextKdaWeights":
        """`tensors` as `Checkpoint.layer_tensors` returns them (validated shapes)."""
        check_config(cfg, "weights")
        try:
            host = {
                "w_in": np.concatenate([tensors[n].astype(BF16) for n in PACKED_INPUT]),
                "f_b": tensors["f_b_proj.weight"].astype(BF16),
                "g_b": tensors["g_b_proj.weight"].astype(BF16),
                "conv_w": np.concatenate([tensors[f"{p}_conv1d.weight"].reshape(cfg.qkv, -1)
                                          for p in "qkv"]).T.astype(F32),
                "a_log": tensors["A_log"].reshape(-1).astype(F32),
                "dt_bias": tensors["dt_bias"].astype(F32),
                "o_norm": tensors["o_norm.weight"].astype(F32),
                "o_proj": tensors["o_proj.weight"].astype(BF16),
            }
        except KeyError as e:
            raise KdaError(f"weights: tensor {e} is missing from the tensors given (expected "
                           "them as Checkpoint.layer_tensors returns them)") from None
        except ValueError as e:  # tensors that do not stack: shapes of another config
            raise KdaError(f"weights: the tensors given do not fit this config ({e})") from None
        for name, (shape, _) in device_layout(cfg).items():
            if host[name].shape != shape:
                raise KdaError(f"weights: {name} is {list(host[name].shape)} from the tensors "
                               f"given, expected {list(shape)} for this config")
        gpu.check_free_memory(weights_nbytes(cfg), "a layer's weights")
        ptrs = {k: gpu.upload(v, stream) for k, v in host.items()}
        return cls(**ptrs, nbytes=sum(v.nbytes for v in host.values()), cfg=cfg)

    def free(self, gpu: GpuBackend) -> None:
        """Give back every device tensor; the weights refuse every use from then on."""
        with self._freeing():
            for name in self._DEVICE_ATTRS:
                gpu.free(getattr(self, name))


Glm5NextKdaWeights._DEVICE_ATTRS = tuple(f.name for f in fields(Glm5NextKdaWeights)
                                         if f.type == "DevicePtr")
