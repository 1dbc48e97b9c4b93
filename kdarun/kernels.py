"""Glm5NextKdaKernels: the loaded kernel families and typed launch wrappers.

Each wrapper checks its sizes against the config, picks the launch shape and enqueues
one kernel through `GpuBackend.launch`, so the layer code is the same on every backend
(the host backend runs the NumPy twin of each kernel with the same arguments).
"""

from __future__ import annotations

import numpy as np

from .backend import DevicePtr, GpuBackend, KdaError, LaunchConfig
from .config import CHUNK, Glm5NextKdaConfig

FAMILIES = ("gemv", "pack", "conv", "gate", "recurrent", "chunk", "norm")
MAX_GEMV_ROWS = 8  # rows one dense_gemv_bf16 launch serves (decode_k's K at most)
GEMV_WARPS = 8  # output rows per GEMV block: one warp each
THREADS = 256
CHUNK_VS = 32  # state columns one kda_chunk_inter block carries (VS in chunk.cu)
i32, f32 = np.int32, np.float32


def _blocks(n: int, per: int = THREADS) -> int:
    return max(1, -(-n // per))


def _cfg1d(n: int) -> LaunchConfig:
    return LaunchConfig((_blocks(n), 1, 1), (THREADS, 1, 1))


class Glm5NextKdaKernels:
    """Every kernel a KDA block launches, bound to one backend and config."""

    def __init__(self, gpu: GpuBackend, cfg: Glm5NextKdaConfig):
        self.gpu = gpu
        self.cfg = cfg
        self.modules = {fam: gpu.load_module(fam) for fam in FAMILIES}

    def _launch(self, family: str, name: str, cfg: LaunchConfig, args: tuple, stream: int) -> None:
        for a in args:
            if isinstance(a, DevicePtr) and a.is_null:
                raise KdaError(f"{name}: null device pointer argument")
        self.gpu.launch(self.modules[family], name, cfg, args, stream)

    # -- projections ---------------------------------------------------------------------
    def dense_gemv_bf16(self, stream: int, w: DevicePtr, x: DevicePtr, y: DevicePtr, n: int,
                        k: int, m: int = 1, ldx: int | None = None, ldy: int | None = None) -> None:
        """y[m, n] = bf16(W[n, k] @ x[m, k]) for m rows; each row's K order and reduction
        tree is the same for any m, so a batched call is bit-identical to single calls."""
        ldx = k if ldx is None else ldx
        ldy = n if ldy is None else ldy
        if not 1 <= m <= MAX_GEMV_ROWS:
            raise KdaError(f"dense_gemv_bf16: rows must be in [1, {MAX_GEMV_ROWS}], got {m}")
        if k % 8 or ldx % 8 or ldx < k or ldy < n:
            raise KdaError(f"dense_gemv_bf16: need k, ldx multiples of 8, ldx >= k, ldy >= n; "
                           f"got k={k} ldx={ldx} n={n} ldy={ldy}")
        cfg = LaunchConfig((_blocks(n, GEMV_WARPS), 1, 1), (32 * GEMV_WARPS, 1, 1))
        self._launch("gemv", "dense_gemv_bf16", cfg,
                     (w, x, y, i32(n), i32(k), i32(m), i32(ldx), i32(ldy)), stream)

    def dense_gemv_bf16_batchm(self, stream: int, w: DevicePtr, x: DevicePtr, y: DevicePtr,
                               n: int, k: int, m: int, ldx: int | None = None,
                               ldy: int | None = None) -> None:
        """K-row verify form of `dense_gemv_bf16` (the same kernel, so the same bits)."""
        self.dense_gemv_bf16(stream, w, x, y, n, k, m, ldx, ldy)

    def gemm_bf16(self, stream: int, a: DevicePtr, lda: int, w: DevicePtr, c: DevicePtr,
                  ldc: int, m: int, n: int, k: int) -> None:
        """c[m, n] = bf16(a[m, k] @ w[n, k]^T), for prefill."""
        if min(m, n, k) < 1 or lda < k or ldc < n:
            raise KdaError(f"gemm_bf16: bad sizes m={m} n={n} k={k} lda={lda} ldc={ldc}")
        self.gpu.gemm_bf16(a, lda, w, c, ldc, m, n, k, stream)

    # -- element-wise ----------------------------------------------------------------------
    def pack_qkv(self, stream: int, proj: DevicePtr, qkv_parts: DevicePtr, qkv_proj: DevicePtr,
                 t: int) -> None:
        """proj [t, proj_width] -> qkv_parts [3, t, qkv] and qkv_proj [t, conv_dim]."""
        c = self.cfg
        self._launch("pack", "pack_qkv", _cfg1d(t * c.conv_dim // 8),
                     (proj, qkv_parts, qkv_proj, i32(t), i32(c.qkv), i32(c.proj_width)), stream)

    def widen_f32(self, stream: int, conv_out: DevicePtr, q: DevicePtr, k: DevicePtr,
                  v: DevicePtr, t: int, t_pad: int, pad_fill: float) -> None:
        """conv_out [t, conv_dim] bf16 -> q/k/v [t_pad, qkv] fp32, rows >= t set to pad_fill."""
        c = self.cfg
        self._launch("pack", "widen_f32", _cfg1d(t_pad * c.conv_dim),
                     (conv_out, q, k, v, i32(t), i32(t_pad), i32(c.qkv), f32(pad_fill)), stream)

    def kda_gate_beta(self, stream: int, g_raw: DevicePtr, b_raw: DevicePtr, ldb: int,
                      a_log: DevicePtr, dt_bias: DevicePtr, gate: DevicePtr, beta: DevicePtr,
                      t: int, t_pad: int) -> None:
        """g_raw [t, qkv] bf16 -> gate [t_pad, H, D] fp32; b_raw (row stride ldb) ->
        beta [t_pad, H]; rows >= t written as 0."""
        c = self.cfg
        bounded = c.gate_lower_bound is not None
        self._launch("gate", "kda_gate_beta", _cfg1d(t_pad * c.qkv),
                     (g_raw, b_raw, i32(ldb), a_log, dt_bias, gate, beta, i32(t), i32(t_pad),
                      i32(c.num_heads), i32(c.head_dim),
                      f32(c.gate_lower_bound if bounded else 0.0), i32(bounded)), stream)

    # -- conv ------------------------------------------------------------------------------
    def conv_decode(self, stream: int, x_row: DevicePtr, conv_state: DevicePtr, conv_w: DevicePtr,
                    out_row: DevicePtr) -> None:
        """One token: conv over the carried state + SiLU + L2 of q/k heads, fused, rolling
        the conv state [W-1, conv_dim] in place."""
        c = self.cfg
        cfg = LaunchConfig((3 * c.num_heads, 1, 1), (c.head_dim, 1, 1))
        self._launch("conv", "conv_decode", cfg,
                     (x_row, conv_state, conv_w, out_row, i32(c.conv_dim), i32(c.qkv),
                      i32(c.conv_kernel), i32(c.head_dim)), stream)

    def conv_prefill(self, stream: int, x: DevicePtr, conv_state: DevicePtr, conv_w: DevicePtr,
                     out: DevicePtr, t: int) -> None:
        """t tokens: conv + SiLU -> out [t, conv_dim] bf16, then the state rolls to the
        last W-1 rows of (state ++ x)."""
        c = self.cfg
        args = (x, conv_state, conv_w, out, i32(t), i32(c.conv_dim), i32(c.conv_kernel))
        self._launch("conv", "conv_prefill", _cfg1d(t * c.conv_dim), args, stream)
        self._launch("conv", "conv_roll_state", _cfg1d(c.conv_dim),
                     (x, conv_state, i32(t), i32(c.conv_dim), i32(c.conv_kernel)), stream)

    def l2_norm_bf16(self, stream: int, x: DevicePtr, t: int) -> None:
        """In place on the q|k heads of x [t, conv_dim] bf16: x / sqrt(sum x^2 + 1e-6)."""
        c = self.cfg
        nvec = t * 2 * c.num_heads
        cfg = LaunchConfig((_blocks(nvec, THREADS // 32), 1, 1), (THREADS, 1, 1))
        self._launch("conv", "l2_norm_bf16", cfg,
                     (x, i32(t), i32(c.conv_dim), i32(2 * c.num_heads), i32(c.head_dim)), stream)

    # -- core ------------------------------------------------------------------------------
    def kda_recurrent(self, stream: int, conv_out_row: DevicePtr, gate_row: DevicePtr,
                      beta_row: DevicePtr, state: DevicePtr, core_row: DevicePtr) -> None:
        """One token of the delta rule on state [H, Dv, Dk] fp32, in place; q/k arrive
        L2-normalised from the conv and are not normalised again."""
        c = self.cfg
        rows = c.num_heads * c.head_dim  # one warp per state row (h, v)
        cfg = LaunchConfig((_blocks(rows, THREADS // 32), 1, 1), (THREADS, 1, 1))
        self._launch("recurrent", f"kda_recurrent_d{c.head_dim}", cfg,
                     (conv_out_row, gate_row, beta_row, state, core_row, i32(c.num_heads),
                      f32(c.scale)), stream)

    def kda_chunk(self, stream: int, q: DevicePtr, k: DevicePtr, v: DevicePtr, gate: DevicePtr,
                  beta: DevicePtr, g_cum: DevicePtr, w: DevicePtr, u: DevicePtr, aqk: DevicePtr,
                  state: DevicePtr, core: DevicePtr, t: int, t_pad: int) -> None:
        """The chunked (WY) core over t tokens: `kda_chunk_intra` builds each chunk's
        g_cum, w, u and aqk in parallel; `kda_chunk_inter` walks the chunks carrying
        state [H, Dv, Dk] and writes core [t_pad, H, D]. Rows >= t are never read."""
        c = self.cfg
        D, n_chunks = c.head_dim, t_pad // CHUNK
        common = (i32(t), i32(t_pad), i32(c.num_heads), f32(c.scale))
        intra_smem = 4 * (3 * CHUNK * (D + 1) + CHUNK * (CHUNK + 1) + CHUNK)
        self._launch("chunk", f"kda_chunk_intra_d{D}",
                     LaunchConfig((n_chunks, c.num_heads, 1), (THREADS, 1, 1), intra_smem),
                     (q, k, v, gate, beta, g_cum, w, u, aqk) + common, stream)
        inter_smem = 4 * (3 * CHUNK * D + CHUNK * CHUNK + CHUNK * CHUNK_VS + D * CHUNK_VS + D)
        self._launch("chunk", f"kda_chunk_inter_d{D}",
                     LaunchConfig((c.num_heads, D // CHUNK_VS, 1), (THREADS, 1, 1), inter_smem),
                     (q, k, g_cum, w, u, aqk, state, core) + common, stream)

    # -- output ----------------------------------------------------------------------------
    def gated_rmsnorm(self, stream: int, core: DevicePtr, out_gate: DevicePtr, w: DevicePtr,
                      out: DevicePtr, t: int) -> None:
        """core [t, H, D] fp32 -> out [t, qkv] bf16 = RMSNorm_D(core) * w * sigmoid(out_gate)."""
        c = self.cfg
        cfg = LaunchConfig((_blocks(t * c.num_heads, THREADS // 32), 1, 1), (THREADS, 1, 1))
        self._launch("norm", "gated_rmsnorm", cfg,
                     (core, out_gate, w, out, i32(t), i32(c.num_heads), i32(c.head_dim),
                      f32(c.rms_norm_eps)), stream)
