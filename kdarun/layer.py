"""Glm5NextKdaLayer: one bound KDA block and its forward paths.

Every method enqueues on the given stream and never synchronises the host, so decode
can be captured into a CUDA graph; the result lands in `ws.final_out` and the state is
updated in place. An optional `stage_hook` sees each buffer right after the kernel that
wrote it (for stage dumps); when it is None nothing extra runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .backend import DevicePtr, GpuBackend
from .errors import KdaError
from .config import MAX_DECODE_ROWS, Glm5NextKdaConfig
from .kernels import Glm5NextKdaKernels
from .state import CONV_LAYOUT, RECURRENT_LAYOUT, KdaSeqState, conv_shape, recurrent_shape
from .weights import Glm5NextKdaWeights
from .dtypes import BF16, F32
from .workspace import SPEC, Glm5NextKdaWorkspace


@dataclass(frozen=True)
class Stage:
    """One buffer as a kernel left it: `shape` rows at `ptr`, of which the first
    `valid_rows` (along axis `row_axis`) belong to the run; the rest is padding."""
    name: str
    kernel: str
    ptr: DevicePtr
    shape: tuple[int, ...]
    dtype: np.dtype
    valid_rows: int
    row_axis: int = 0
    layout: str = ""  # the axes, row-major, e.g. "[T_pad, H, D]"


StageHook = Callable[[Stage, GpuBackend, int], None]


class Glm5NextKdaLayer:
    """One KDA block: `layer_idx` is the 0-based index in the checkpoint's stack."""

    def __init__(self, layer_idx: int, cfg: Glm5NextKdaConfig, weights: Glm5NextKdaWeights,
                 kernels: Glm5NextKdaKernels):
        if kernels.cfg != cfg:
            raise KdaError(f"layer {layer_idx}: kernels were bound for a different config")
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.weights = weights
        self.kernels = kernels
        self.stage_hook: StageHook | None = None

    # -- stage reporting -----------------------------------------------------------------
    def _ws_stage(self, gpu, stream, ws: Glm5NextKdaWorkspace, name: str, kernel: str, t: int,
                  row: int | None = None) -> None:
        if self.stage_hook is None:
            return
        spec = SPEC[name]
        shape = ws.shape(name, t)
        ptr = ws.ptr(name)
        if row is not None:  # one row of a per-token buffer (the stateful decode walk)
            row_elems = int(np.prod(shape[1:]))
            ptr, shape, name = ptr + row * row_elems * spec.dtype.itemsize, (1,) + shape[1:], \
                f"{name}[{row}]"
        axis = 1 if spec.name == "qkv_parts" else 0
        self.stage_hook(Stage(name, kernel, ptr, shape, spec.dtype, min(t, shape[axis]), axis,
                              spec.layout), gpu, stream)

    def _state_stage(self, gpu, stream, state: KdaSeqState, kernel: str, suffix: str = "",
                     which: tuple[str, ...] = ("recurrent", "conv")) -> None:
        if self.stage_hook is None:
            return
        cfg = self.cfg
        if "recurrent" in which:
            self.stage_hook(Stage(f"state.recurrent{suffix}", kernel, state.recurrent,
                                  recurrent_shape(cfg), F32, cfg.num_heads, 0, RECURRENT_LAYOUT),
                            gpu, stream)
        if "conv" in which:
            self.stage_hook(Stage(f"state.conv{suffix}", kernel, state.conv, conv_shape(cfg),
                                  BF16, cfg.conv_kernel - 1, 0, CONV_LAYOUT), gpu, stream)

    # -- decode pieces ---------------------------------------------------------------------
    def front_end(self, gpu: GpuBackend, hidden: DevicePtr, t: int, ws: Glm5NextKdaWorkspace,
                  stream: int) -> None:
        """The weight-heavy, stateless half of decode over t rows of hidden [t, hidden] bf16,
        one launch: the packed q|k|v|f_a|g_a|b GEMV (writing qkv_parts and qkv_proj too), the
        low-rank gates with the forget gate, and beta."""
        w = self.weights
        self.kernels.front_end_gemv(stream, w.w_in, hidden, ws.ptr("gate_in"), ws.qkv_parts,
                                    ws.qkv_proj, w.f_b, w.g_b, w.a_log, w.dt_bias, ws.g_raw,
                                    ws.out_gate, ws.gate, ws.beta, ws.ptr("front_sync"), t)
        for name in ("qkv_parts", "qkv_proj", "g_raw", "out_gate", "gate", "beta"):
            self._ws_stage(gpu, stream, ws, name, "front_end_gemv", t)

    def stateful_row(self, gpu: GpuBackend, row: int, state: KdaSeqState,
                     ws: Glm5NextKdaWorkspace, stream: int) -> None:
        """Token `row` of the front end's rows, one launch: conv (+SiLU+L2) rolling the conv
        state, the recurrent step updating the state in place, and the gated RMSNorm."""
        self._stateful_rows(gpu, row, 1, state, ws, 0, stream)

    def _stateful_rows(self, gpu: GpuBackend, row: int, n: int, state: KdaSeqState,
                       ws: Glm5NextKdaWorkspace, nsnap: int, stream: int) -> None:
        """Rows [row, row+n) walked token by token in one launch (the same per-token code as
        `stateful_row`); the states after the first nsnap rows land in the workspace's
        snapshot scratch."""
        c = self.cfg
        cd, hd = c.conv_dim * BF16.itemsize, c.qkv * BF16.itemsize
        f = c.qkv * F32.itemsize
        self.kernels.kda_decode_rows(
            stream, ws.qkv_proj + row * cd, state.conv, self.weights.conv_w, ws.conv_out + row * cd,
            ws.gate + row * f, ws.beta + row * c.num_heads * F32.itemsize, state.recurrent,
            ws.core + row * f, ws.out_gate + row * hd, self.weights.o_norm,
            ws.o_norm_out + row * hd, ws.ptr("snap_rec"), ws.ptr("snap_conv"),
            ws.ptr("decode_sync"), n, nsnap)
        if self.stage_hook is None:
            return
        for r in range(row, row + n):
            for name in ("conv_out", "core", "o_norm_out"):
                self._ws_stage(gpu, stream, ws, name, "kda_decode_rows", r + 1, r)
            if r - row < nsnap:
                self._snapshot_stage(gpu, stream, ws, r - row, f"[{r}]")
        self._state_stage(gpu, stream, state, "kda_decode_rows", f"[{row + n - 1}]")

    def _snapshot_stage(self, gpu, stream, ws: Glm5NextKdaWorkspace, i: int, suffix: str) -> None:
        cfg = self.cfg
        rec, conv = recurrent_shape(cfg), conv_shape(cfg)
        self.stage_hook(Stage(f"state.recurrent{suffix}", "kda_decode_rows",
                              ws.ptr("snap_rec") + i * int(np.prod(rec)) * F32.itemsize, rec, F32,
                              cfg.num_heads, 0, RECURRENT_LAYOUT), gpu, stream)
        self.stage_hook(Stage(f"state.conv{suffix}", "kda_decode_rows",
                              ws.ptr("snap_conv") + i * int(np.prod(conv)) * BF16.itemsize, conv,
                              BF16, cfg.conv_kernel - 1, 0, CONV_LAYOUT), gpu, stream)

    def back_end(self, gpu: GpuBackend, t: int, ws: Glm5NextKdaWorkspace, stream: int) -> None:
        """o_proj over the t rows the stateful walk normalised: ws.o_norm_out ->
        ws.final_out [t, hidden] bf16."""
        c = self.cfg
        self.kernels.dense_gemv_bf16_batchm(stream, self.weights.o_proj, ws.o_norm_out,
                                            ws.final_out, c.hidden_size, c.qkv, t)
        self._ws_stage(gpu, stream, ws, "final_out", "dense_gemv_bf16", t)

    # -- prefill pieces --------------------------------------------------------------------
    def prefill_steps(self, hidden: DevicePtr, t: int, state: KdaSeqState,
                      ws: Glm5NextKdaWorkspace, pad_fill: float = 0.0
                      ) -> dict[str, Callable[[int], None]]:
        """The launches of one prefill over t tokens, in order and by name, each a callable
        that enqueues them on the stream it is given: `prefill_with_pad_fill` runs them in this
        order, and the benchmark too, with an event between each. GEMM steps' names end in `_gemm`;
        chunk_intra then chunk_inter are the chunked core."""
        c, w, kn = self.cfg, self.weights, self.kernels
        gate_in = ws.ptr("gate_in")
        f_a, g_a, b_raw = (gate_in + c.gate_in_col(p) * BF16.itemsize
                           for p in ("f_a", "g_a", "b"))
        w_gate_in = w.w_in + c.conv_dim * c.hidden_size * BF16.itemsize  # w_in's f_a|g_a|b rows
        # q|k|v straight into qkv_proj, where the conv reads them: a second GEMM for the few
        # hundred gate_in columns re-reads hidden, but the conv no longer copies q|k|v a token
        return {
            "qkv_gemm": lambda s: kn.gemm_bf16(s, hidden, c.hidden_size, w.w_in, ws.qkv_proj,
                                               c.conv_dim, t, c.conv_dim, c.hidden_size),
            "gate_in_gemm": lambda s: kn.gemm_bf16(s, hidden, c.hidden_size, w_gate_in, gate_in,
                                                   c.gate_in_width, t, c.gate_in_rows,
                                                   c.hidden_size),
            "f_b_gemm": lambda s: kn.gemm_bf16(s, f_a, c.gate_in_width, w.f_b, ws.g_raw, c.qkv,
                                               t, c.qkv, c.rank),
            "g_b_gemm": lambda s: kn.gemm_bf16(s, g_a, c.gate_in_width, w.g_b, ws.out_gate,
                                               c.qkv, t, c.qkv, c.rank),
            "gate_beta": lambda s: kn.kda_gate_beta(s, ws.g_raw, b_raw, c.gate_in_width,
                                                    w.a_log, w.dt_bias, ws.gate, ws.beta, t,
                                                    c.t_pad(t)),
            "conv": lambda s: kn.prefill_conv_qkv(s, ws.qkv_proj, state.conv, w.conv_w,
                                                  ws.qkv_parts, ws.conv_out, ws.q_f32, ws.k_f32,
                                                  ws.v_f32, t, pad_fill),
            "chunk_intra": lambda s: kn.kda_chunk_intra(s, ws, t),
            "chunk_inter": lambda s: kn.kda_chunk_inter(s, ws, state.recurrent, t),
            "rmsnorm": lambda s: kn.gated_rmsnorm(s, ws.core, ws.out_gate, w.o_norm,
                                                  ws.o_norm_out, t),
            "o_proj_gemm": lambda s: kn.gemm_bf16(s, ws.o_norm_out, c.qkv, w.o_proj,
                                                  ws.final_out, c.hidden_size, t, c.hidden_size,
                                                  c.qkv),
        }

    # -- public forward paths --------------------------------------------------------------
    def decode(self, gpu: GpuBackend, hidden: DevicePtr, state: KdaSeqState,
               ws: Glm5NextKdaWorkspace, stream: int) -> None:
        """Single-token decode, carrying both states. The conv fuses SiLU and L2, so q/k
        reach kda_recurrent already normalised (exactly the contract that kernel takes)."""
        self.front_end(gpu, hidden, 1, ws, stream)
        self.stateful_row(gpu, 0, state, ws, stream)
        self.back_end(gpu, 1, ws, stream)

    def decode_k(self, gpu: GpuBackend, hidden: DevicePtr, k: int, state: KdaSeqState,
                 ws: Glm5NextKdaWorkspace, snapshots: Sequence[tuple[DevicePtr, DevicePtr]],
                 stream: int) -> None:
        """K tokens of one sequence (speculative verify): projections batched once over the
        K rows, the recurrence walked one row at a time exactly as `decode` does, so the
        result is bit-identical to K serial decodes. The K-row walk is one launch that keeps
        the state on chip between rows. `snapshots[t] = (h_dst, conv_dst)` receives the state
        after row t; pass k-1 of them or none."""
        if not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_DECODE_ROWS:
            raise KdaError(f"decode_k: k must be in [1, {MAX_DECODE_ROWS}], got {k!r}")
        ws.check_tokens(k, "decode_k")
        if len(snapshots) not in (0, k - 1):
            raise KdaError(f"decode_k: pass k-1 = {k - 1} snapshots or none, got {len(snapshots)}")
        self.front_end(gpu, hidden, k, ws, stream)
        nsnap = k - 1 if snapshots or self.stage_hook is not None else 0
        self._stateful_rows(gpu, 0, k, state, ws, nsnap, stream)
        rec_bytes, conv_bytes = state.recurrent_nbytes, state.conv_nbytes
        for i, (h_dst, conv_dst) in enumerate(snapshots):
            gpu.copy_d2d(h_dst, ws.ptr("snap_rec") + i * rec_bytes, rec_bytes, stream)
            gpu.copy_d2d(conv_dst, ws.ptr("snap_conv") + i * conv_bytes, conv_bytes, stream)
        self.back_end(gpu, k, ws, stream)

    def prefill(self, gpu: GpuBackend, hidden: DevicePtr, t: int, state: KdaSeqState,
                ws: Glm5NextKdaWorkspace, stream: int) -> None:
        """Chunked prefill over t tokens of hidden [t, hidden] bf16 from the carried state."""
        self.prefill_with_pad_fill(gpu, hidden, t, state, ws, 0.0, stream)

    def prefill_with_pad_fill(self, gpu: GpuBackend, hidden: DevicePtr, t: int,
                              state: KdaSeqState, ws: Glm5NextKdaWorkspace, pad_fill: float,
                              stream: int) -> None:
        """`prefill` with the padded q/k/v tails primed to `pad_fill`. The chunk kernels
        guard past t, so any fill (NaN, 1e30) must leave outputs and state unchanged."""
        ws.check_tokens(t, "prefill")
        steps, kn = self.prefill_steps(hidden, t, state, ws, pad_fill), self.kernels
        steps["qkv_gemm"](stream)
        self._ws_stage(gpu, stream, ws, "qkv_proj", "gemm_bf16", t)
        steps["gate_in_gemm"](stream)
        steps["f_b_gemm"](stream)
        steps["g_b_gemm"](stream)
        self._ws_stage(gpu, stream, ws, "g_raw", "gemm_bf16", t)
        self._ws_stage(gpu, stream, ws, "out_gate", "gemm_bf16", t)
        steps["gate_beta"](stream)
        self._ws_stage(gpu, stream, ws, "gate", "kda_gate_beta", t)
        self._ws_stage(gpu, stream, ws, "beta", "kda_gate_beta", t)
        steps["conv"](stream)
        for name in ("qkv_parts", "conv_out", "q_f32", "k_f32", "v_f32"):
            self._ws_stage(gpu, stream, ws, name, kn.prefill_conv_name, t)
        self._state_stage(gpu, stream, state, "conv_roll_state", which=("conv",))
        steps["chunk_intra"](stream)
        steps["chunk_inter"](stream)
        self._ws_stage(gpu, stream, ws, "core", "kda_chunk_inter", t)
        self._state_stage(gpu, stream, state, "kda_chunk_inter", which=("recurrent",))
        steps["rmsnorm"](stream)
        self._ws_stage(gpu, stream, ws, "o_norm_out", "gated_rmsnorm", t)
        steps["o_proj_gemm"](stream)
        self._ws_stage(gpu, stream, ws, "final_out", "gemm_bf16", t)


def prefill_windowed(layer: Glm5NextKdaLayer, gpu: GpuBackend, hidden: DevicePtr, t: int,
                     state: KdaSeqState, ws: Glm5NextKdaWorkspace, out: DevicePtr,
                     stream: int) -> None:
    """Prefill a sequence longer than the workspace in windows of `ws.max_tokens()` tokens,
    carrying the state; every window's final_out is copied to out [t, hidden] bf16."""
    if t < 1:
        raise KdaError(f"prefill_windowed: token count must be positive, got {t}")
    row = layer.cfg.hidden_size * BF16.itemsize
    for start in range(0, t, ws.max_tokens()):
        n = min(ws.max_tokens(), t - start)
        layer.prefill(gpu, hidden + start * row, n, state, ws, stream)
        gpu.copy_d2d(out + start * row, ws.final_out, n * row, stream)
