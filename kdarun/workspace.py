"""Glm5NextKdaWorkspace: the forward path's scratch, sized once for `max_tokens`.

`BUFFERS` is the single table of every buffer's shape (as a function of the config,
the run's token count `t` and its padded count `t_pad`), dtype and, for the public ones, the
tolerance stage comparisons hold it to. The 13 public fields are those of the seed API's
workspace (the original API documents the Python API mirrors); the private ones hold the
packed projection's gate inputs, the chunked core's operands and decode's scratch. One
workspace is shared by every layer of a stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .backend import DeviceOwner, DevicePtr, GpuBackend, overlaps
from .config import CHUNK, MAX_DECODE_ROWS, SEG_FIELDS, Glm5NextKdaConfig, check_config
from .dtypes import BF16, F32, I32, U32
from .errors import KdaError, check_int
from .kernels import GEMV_WARPS, WG_TILE, dense_split_tiles, front_sync_words


Shape = Callable[[Glm5NextKdaConfig, int, int], tuple[int, ...]]


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: Shape  # (cfg, t, t_pad) -> shape of the rows a run of t tokens uses
    dtype: np.dtype
    public: bool
    layout: str  # the axes, row-major
    doc: str
    tol: float | None = None  # public buffers: the stages' tolerance (stages.STAGE_TOL)
    poison: bool = True  # False: kernels rely on its contents (kept zero between calls)
    padded: bool = False  # rows numbered by chunks: a packed prefill's segments' padded rows

    def __post_init__(self) -> None:
        if self.public != (self.tol is not None):
            raise ValueError(f"buffer {self.name}: a public buffer needs a stage tolerance, a "
                             "private one has none")


def _rows(n: Callable[[Glm5NextKdaConfig], int]) -> Shape:
    return lambda c, t, tp: (t, n(c))


def _heads(c: Glm5NextKdaConfig, t: int, tp: int) -> tuple[int, ...]:
    return (tp, c.num_heads, c.head_dim)


def _chunk_blocks(block: Callable[[Glm5NextKdaConfig], tuple[int, ...]]) -> Shape:
    return lambda c, t, tp: (tp // CHUNK, c.num_heads, *block(c))


# A public buffer's `tol` bounds rel = ||a - b|| / ||b|| in stage comparisons, against the
# float64 reference fed the same input (errors accumulate along the chain) or between two
# backends' runs (a flipped bf16 rounding propagates down the chain): about twice the worst
# measured on the host backend and the H200 (tiny preset and a D = 128 stack, both gates,
# T <= 4096), given beside each; CUDA vs host at D = 128: prefill core 6.1e-3.
BUFFERS: tuple[BufferSpec, ...] = (
    BufferSpec("qkv_parts", lambda c, t, tp: (3, t, c.qkv), BF16, True, "[3, T, qkv]",
               "q, k and v projection outputs, before the pack", 5e-3),  # one bf16 rounding: measured <= 1.8e-3
    BufferSpec("qkv_proj", _rows(lambda c: c.conv_dim), BF16, True, "[T, conv_dim] q|k|v",
               "q|k|v per token, before the conv", 5e-3),  # measured <= 1.8e-3
    BufferSpec("conv_out", _rows(lambda c: c.conv_dim), BF16, True, "[T, conv_dim] q|k|v",
               "after conv + SiLU, q|k L2-normalised", 8e-3),  # two roundings: <= 3.5e-3
    BufferSpec("q_f32", lambda c, t, tp: (tp, c.qkv), F32, True, "[T_pad, H*D]",
               "q widened (written only for a stage hook), tail = pad_fill", 8e-3,
               padded=True),  # <= 3.5e-3
    BufferSpec("k_f32", lambda c, t, tp: (tp, c.qkv), F32, True, "[T_pad, H*D]",
               "k widened (written only for a stage hook), tail = pad_fill", 8e-3,
               padded=True),  # <= 3.5e-3
    BufferSpec("v_f32", lambda c, t, tp: (tp, c.qkv), F32, True, "[T_pad, H*D]",
               "v widened (written only for a stage hook), tail = pad_fill", 8e-3,
               padded=True),  # <= 3.5e-3
    BufferSpec("gate", _heads, F32, True, "[T_pad, H, D]",
               "log-decay, <= 0 (prefill writes it only for a stage hook), tail = pad_fill",
               4e-3, padded=True),  # an fp32 map of bf16 inputs: <= 1.3e-3
    BufferSpec("beta", lambda c, t, tp: (tp, c.num_heads), F32, True, "[T_pad, H]",
               "sigmoid(b_proj(h)) (prefill writes it only for a stage hook), tail = pad_fill",
               2e-3, padded=True),  # <= 4.7e-4
    BufferSpec("core", _heads, F32, True, "[T_pad, H, D]", "KDA core output, before o_norm", 1.5e-2),  # the end of the chain: <= 7.0e-3
    BufferSpec("g_raw", _rows(lambda c: c.qkv), BF16, True, "[T, H*D]",
               "f_b(f_a(h)), the gate input", 6e-3),  # f_a, then g_raw rounded: <= 3.5e-3
    BufferSpec("out_gate", _rows(lambda c: c.qkv), BF16, True, "[T, H*D]", "g_b(g_a(h))", 6e-3),  # <= 3.5e-3
    BufferSpec("o_norm_out", _rows(lambda c: c.qkv), BF16, True, "[T, H*D]",
               "after the sigmoid-gated RMSNorm", 1.5e-2),  # <= 7.0e-3
    BufferSpec("final_out", _rows(lambda c: c.hidden_size), BF16, True, "[T, hidden]",
               "the block output", 1.5e-2),  # <= 7.0e-3
    # private scratch
    BufferSpec("gate_in", _rows(lambda c: c.gate_in_width), BF16, False,
               "[T, gate_in_width] f_a|g_a|b",
               "the projection's outputs after q|k|v (which go to qkv_proj)"),
    # the chunked core's operands, a block for each (chunk, head). On CUDA each block is the
    # walk's shared-memory image (layouts private to chunk.cu: bf16 hi and lo planes of each
    # value, K-major core matrices; w's MN-major; u in swizzled column slices); the host twins
    # keep the same values as fp32 [rows, cols] blocks.
    BufferSpec("chunk_qg", _chunk_blocks(lambda c: (CHUNK, c.head_dim)), U32, False,
               "[T_pad/C, H, C, D] split words, pairs along D, walk image",
               "q * scale * exp(G), G the in-chunk cumulative log-decay"),
    BufferSpec("chunk_kd", _chunk_blocks(lambda c: (c.head_dim, CHUNK)), U32, False,
               "[T_pad/C, H, D, C] split words, pairs along C, walk image",
               "(k * exp(G_last - G))^T"),
    BufferSpec("chunk_gl", _chunk_blocks(lambda c: (c.head_dim,)), F32, False,
               "[T_pad/C, H, D]", "exp(G_last) per chunk"),
    BufferSpec("chunk_w", _chunk_blocks(lambda c: (CHUNK, c.head_dim)), U32, False,
               "[T_pad/C, H, C, D] bf16 hi, lo halves, token pairs in a word, walk image",
               "WY: (I + bA)^-1 b (K * Gamma)"),
    BufferSpec("chunk_u", _chunk_blocks(lambda c: (CHUNK, c.head_dim)), F32, False,
               "[T_pad/C, H, D/64, C, 64]: the walk's column slices, swizzled (u_word)",
               "WY: (I + bA)^-1 b V"),
    BufferSpec("chunk_aqk", _chunk_blocks(lambda c: (CHUNK, CHUNK)), U32, False,
               "[T_pad/C, H, C, C] split words, pairs along the last axis, walk image",
               "in-chunk decayed q.k products, causal"),
    BufferSpec("chunk_ready", _chunk_blocks(lambda c: ()), I32, False, "[T_pad/C, H] int32",
               "kda_chunk_core: a (chunk, head)'s intra block done, the count of walk blocks "
               "yet to read it; zeroed before the launch"),
    BufferSpec("segments", lambda c, t, tp: (tp // CHUNK * (SEG_FIELDS + 1),), I32, False,
               "[segments, SEG_FIELDS] int32, then checkpoint slots",
               "packed prefill: a window's segment table (kernels_cu/segments.cuh); a segment "
               "and a checkpoint take at least a chunk each"),
    BufferSpec("front_sync", lambda c, t, tp: (front_sync_words(t),), I32, False,
               "[2 a slab of 64 rows] int32", "decode front end: tiles of f_a|g_a|b done, gate "
               "blocks done, a pair a slab; zero between calls (each slab's last gate block "
               "resets its pair)", poison=False),
    BufferSpec("dense_part", lambda c, t, tp: (dense_split_tiles(t, c.hidden_size) * GEMV_WARPS,
                                               WG_TILE * WG_TILE), F32, False,
               "[slabs * tiles, K shares, WG_TILE * WG_TILE] fp32, each tile in dense_gemv_wg's "
               "thread order", "batched o_proj (kernels.dense_gemv_bf16_batchm): each K "
               "share's sums of a tile, which the tile's last block adds in share order"),
    BufferSpec("dense_sync", lambda c, t, tp: (dense_split_tiles(t, c.hidden_size),), I32, False,
               "[slabs * tiles] int32", "batched o_proj: a tile's blocks done with their shares; "
               "zero between calls (the last block resets it)", poison=False),
    BufferSpec("decode_sync", lambda c, t, tp: (t, c.num_heads), I32, False,
               "[sequences, H] int32", "decode: blocks of a (sequence, head) done with the "
               "recurrent step; zero between calls (the last block resets it)", poison=False),
    BufferSpec("snap_rec", lambda c, t, tp: (MAX_DECODE_ROWS - 1, c.num_heads, c.head_dim,
                                             c.head_dim), F32, False, "[K-1, H, Dv, Dk]",
               "decode_k: recurrent state after each row but the last"),
    BufferSpec("snap_conv", lambda c, t, tp: (MAX_DECODE_ROWS - 1, c.conv_kernel - 1, c.conv_dim),
               BF16, False, "[K-1, W-1, conv_dim]",
               "decode_k: conv state after each row but the last"),
)
SPEC = {b.name: b for b in BUFFERS}


def buffer_nbytes(cfg: Glm5NextKdaConfig, name: str, t: int, t_pad: int | None = None) -> int:
    """Bytes of buffer `name` for a run of `t` tokens over `t_pad` padded rows (default: t's)."""
    t_pad = cfg.t_pad(t) if t_pad is None else t_pad
    return math.prod(int(d) for d in SPEC[name].shape(cfg, t, t_pad)) * \
        SPEC[name].dtype.itemsize


def workspace_nbytes(cfg: Glm5NextKdaConfig, max_tokens: int, pad_rows: int | None = None) -> int:
    """Device bytes of a workspace for `max_tokens` tokens (and `pad_rows` padded rows):
    every buffer of `BUFFERS`."""
    return sum(buffer_nbytes(cfg, b.name, max_tokens, pad_rows) for b in BUFFERS)


class Glm5NextKdaWorkspace(DeviceOwner):
    """Device scratch for runs of up to `max_tokens` tokens. The chunk buffers hold `pad_rows`
    padded rows, by default max_tokens padded to a chunk; a packed prefill, whose sequences
    each pad to a chunk, runs at once up to max_tokens tokens in up to pad_rows / CHUNK chunks.

    Attributes named as in `BUFFERS` are `DevicePtr`s; `shape(name, t)` gives the shape
    a run of `t` tokens uses (row-major at the start of the buffer). After `free()` the
    workspace refuses every use.
    """

    _DEVICE_ATTRS = (*(b.name for b in BUFFERS), "_ptrs")

    qkv_parts: DevicePtr
    qkv_proj: DevicePtr
    conv_out: DevicePtr
    q_f32: DevicePtr
    k_f32: DevicePtr
    v_f32: DevicePtr
    gate: DevicePtr
    beta: DevicePtr
    core: DevicePtr
    g_raw: DevicePtr
    out_gate: DevicePtr
    o_norm_out: DevicePtr
    final_out: DevicePtr

    def __init__(self, gpu: GpuBackend, cfg: Glm5NextKdaConfig, max_tokens: int,
                 pad_rows: int | None = None):
        self.cfg = check_config(cfg, "workspace")
        self._max_tokens = max_tokens = check_int(max_tokens, "workspace: max_tokens", 1)
        self._t_pad = cfg.t_pad(max_tokens)
        if pad_rows is not None:
            self._t_pad = check_int(pad_rows, "workspace: pad_rows", self._t_pad)
            if pad_rows % CHUNK:
                raise KdaError(f"workspace: pad_rows must be a multiple of {CHUNK}, got "
                               f"{pad_rows}")
        self._gpu = gpu
        gpu.check_free_memory(workspace_nbytes(cfg, max_tokens, self._t_pad),
                              f"a workspace of {max_tokens} tokens")
        self._ptrs: dict[str, DevicePtr] = {}
        for spec in BUFFERS:
            ptr = gpu.alloc(self._capacity(spec.name))
            if not spec.poison:
                gpu.memset(ptr, 0, self._capacity(spec.name), 0)
            self._ptrs[spec.name] = ptr
            setattr(self, spec.name, ptr)

    def max_tokens(self) -> int:
        return self._max_tokens

    def t_pad(self) -> int:
        """The chunk buffers' padded row count: `pad_rows`, or a `max_tokens` run's."""
        return self._t_pad

    def _capacity(self, name: str) -> int:
        """Bytes of buffer `name` as allocated."""
        return buffer_nbytes(self.cfg, name, self._max_tokens, self._t_pad)

    def shape(self, name: str, t: int) -> tuple[int, ...]:
        """Buffer `name`'s shape for a run of t tokens (t may exceed max_tokens: a larger
        workspace's)."""
        t = check_int(t, f"workspace.shape({name!r}): t", 1)
        return SPEC[self._known(name)].shape(self.cfg, t, self.cfg.t_pad(t))

    def nbytes(self, name: str, t: int) -> int:
        """Buffer `name`'s bytes for a run of t tokens (t may exceed max_tokens)."""
        t = check_int(t, f"workspace.nbytes({name!r}): t", 1)
        return buffer_nbytes(self.cfg, self._known(name), t)

    def ptr(self, name: str) -> DevicePtr:
        self._require_live(f"ptr({name!r})")
        return self._ptrs[self._known(name)]

    @staticmethod
    def _known(name: str) -> str:
        if not isinstance(name, str) or name not in SPEC:
            raise KdaError(f"workspace: no buffer {name!r}; the buffers are {sorted(SPEC)}")
        return name

    def overlapping(self, ptr: DevicePtr, nbytes: int) -> str | None:
        """The name of a buffer of this workspace that [ptr, ptr + nbytes) overlaps, or
        None."""
        for name, buf in self._ptrs.items():
            if overlaps(ptr, nbytes, buf, self._capacity(name)):
                return name
        return None

    def check_tokens(self, t: int, what: str, hint: str = "") -> None:
        """A KdaError unless t is a token count in [1, max_tokens]; `hint` says what else the
        caller may do past max_tokens."""
        check_int(t, f"{what}: token count", 1)
        if t > self._max_tokens:
            raise KdaError(f"{what}: {t} tokens exceed the workspace's max_tokens "
                           f"{self._max_tokens}; allocate a larger workspace{hint}")

    def poison(self, stream: int) -> None:
        """Fill every buffer with 0xFF bytes (NaN in bf16 and fp32) so unwritten
        elements show; the few whose contents kernels rely on are left alone."""
        for spec in BUFFERS:
            if not spec.poison:
                continue
            self._gpu.memset(self.ptr(spec.name), 0xFF, self._capacity(spec.name), stream)

    def read(self, name: str, t: int, stream: int = 0) -> np.ndarray:
        """Download the rows buffer `name` holds for a run of `t` tokens (synchronises)."""
        self.check_tokens(t, f"workspace.read({name!r})")
        return self._gpu.download(self.ptr(name), self.shape(name, t), SPEC[name].dtype, stream)

    def free(self) -> None:
        """Give back every buffer; the workspace refuses every use from then on."""
        with self._freeing():
            for ptr in self._ptrs.values():
                self._gpu.free(ptr)
