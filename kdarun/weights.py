"""Glm5NextKdaWeights: one layer's tensors on the device, packed for few launches.

The six projections that read the hidden state (q, k, v, f_a, g_a, b) are packed into
one `[proj_rows, hidden]` matrix so decode reads the hidden row once in one GEMV;
the conv taps are stored `[W, conv_dim]` fp32 so a warp reads one tap of 32 channels
contiguously. The small per-channel parameters are widened to fp32 exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backend import DevicePtr, GpuBackend
from .config import Glm5NextKdaConfig
from .dtypes import BF16, F32

PACKED_INPUT = ("q_proj.weight", "k_proj.weight", "v_proj.weight",
                "f_a_proj.weight", "g_a_proj.weight", "b_proj.weight")


@dataclass
class Glm5NextKdaWeights:
    w_in: DevicePtr  # [proj_rows, hidden] bf16: q|k|v|f_a|g_a|b
    f_b: DevicePtr  # [qkv, R] bf16
    g_b: DevicePtr  # [qkv, R] bf16
    conv_w: DevicePtr  # [W, conv_dim] fp32: q|k|v channels
    a_log: DevicePtr  # [H] fp32
    dt_bias: DevicePtr  # [qkv] fp32
    o_norm: DevicePtr  # [D] fp32
    o_proj: DevicePtr  # [hidden, qkv] bf16
    nbytes: int  # total device bytes (what one decode reads)

    @classmethod
    def upload(cls, gpu: GpuBackend, cfg: Glm5NextKdaConfig, tensors: dict[str, np.ndarray],
               stream: int = 0) -> "Glm5NextKdaWeights":
        """`tensors` as `Checkpoint.layer_tensors` returns them (validated shapes)."""
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
        assert host["w_in"].shape == (cfg.proj_rows, cfg.hidden_size)
        ptrs = {k: gpu.upload(v, stream) for k, v in host.items()}
        return cls(**ptrs, nbytes=sum(v.nbytes for v in host.values()))

    def free(self, gpu: GpuBackend) -> None:
        for name in ("w_in", "f_b", "g_b", "conv_w", "a_log", "dt_bias", "o_norm", "o_proj"):
            gpu.free(getattr(self, name))
