"""Glm5NextKdaKernels: the loaded kernel families and typed launch wrappers.

Each wrapper checks its sizes against the config, picks the launch shape and enqueues
one kernel through `GpuBackend.launch`, so the layer code is the same on every backend
(the host backend runs the NumPy twin of each kernel with the same arguments).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import numpy as np

from .backend import MIN_CC, DevicePtr, GpuBackend, LaunchConfig, TensorMap, tma_addressable
from .config import (CHUNK, L2_NORM_EPS, MAX_CONV_KERNEL, MAX_DECODE_ROWS, SEG_FIELDS,
                     Glm5NextKdaConfig)
from .dtypes import BF16, F32, I32
from .errors import KdaError

FAMILIES = ("gemv", "gemv_wg", "conv", "gate", "recurrent", "chunk", "chunk_portable", "norm",
            "reduce")

# The GPUs kdarun builds for, by compute capability (10 major + minor), with the most shared
# memory one block may take (dynamic, opted in): the chunk kernels size their staging to it.
# Another capability from 8.0 on builds with the smallest of these limits.
SMEM_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024,
                  90: 227 * 1024, 100: 227 * 1024, 103: 227 * 1024, 120: 99 * 1024,
                  121: 99 * 1024}
SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120")  # CI builds each

# The chunked core's two walks (`core_path`): "hopper" (kda_chunk_inter, warpgroup MMAs and bulk
# copies: sm_90a only) and "portable" (kda_chunk_inter_portable, mma.sync and cp.async: every
# supported GPU). KDARUN_CORE or the kernels' `core` argument forces one; "auto" takes the
# Hopper walk where it runs.
CORES = ("auto", "hopper", "portable")

# The launch geometry: the wrappers below size their grids by these, and every build of
# kernels_cu/ receives them as -DNAME=value (`compile_defines`), so each is written here alone.
THREADS = 256  # the element-wise kernels', the prefill conv's and kda_chunk_intra's block
GEMV_TILE = 16  # output rows a GEMV warp's tile: the MMA's M
GEMV_WARPS = 8  # warps a GEMV block, each a tile or a share of one tile's K
GEMV_STAGE_K = 128  # k a GEMV stage: each of its rows' 256 bytes
GEMV_STAGES = 3  # stages a GEMV warp keeps in flight where they fit (gemv_stages)
GEMV_BLOCKS_PER_SM = 2  # GEMV blocks an SM holds (their __launch_bounds__)
GEMV_COLUMNS = 8  # token rows a GEMV column group: the MMA's N
DECODE_GEMV_GROUPS = 2  # column groups decode's GEMV launches serve: 1, or 2 (the _x2 entries,
# batches of 9-16 rows: up to 12% faster than the batch kernels on the H200, perf-log v51)
FRONT_END_X2_ROWS = 16  # rows up to which the front end takes its _x2 entry (the slabs past it;
# glm-5.3-flash's B = 16 is 4.5% faster there, B <= 14 and kimi-linear-48b slower: perf-log v54)
DENSE_X2_ROWS = 16  # rows up to which o_proj takes its _x2 entry (the batch GEMV past it)
GEMV_BATCH_GROUPS = 8  # column groups of the batch GEMVs: rows one block serves, over 8
BATCH_SLAB_ROWS = GEMV_BATCH_GROUPS * GEMV_COLUMNS  # token rows a batch GEMV block serves
GEMV_BATCH_BLOCKS_PER_SM = 2  # batch GEMV blocks an SM holds: sm_90 / 100 (one elsewhere)
GEMV_SLAB_W_BYTES = 64 * 1024  # the batch GEMVs' ring of weight stages, a block
GEMV_SLAB_X_STAGES = 3  # the batch GEMVs' ring of x stages (from L2: fewer suffice)
GEMV_SLAB_TILES = 4  # tiles a block of front_end_gemv_batch, a warp each
GEMV_SLAB_TILES_DENSE = 2  # tiles a block of dense_gemv_bf16_batch (o_proj has few)
WG_TILE = 64  # weight rows and token rows a gemv_wg.cu block: the m64n64 MMA's, the TMA box's
WG_THREADS = 128  # gemv_wg.cu's block: one warpgroup
WG_SLOTS = 3  # stages (32 KB each) in gemv_wg.cu's ring, a block
WG_BLOCKS_PER_SM = 2  # gemv_wg.cu's blocks an SM (their __launch_bounds__)
WG_FROM_ROWS = 65  # token rows from which the front end takes gemv_wg.cu: on the H200 its front
# end ran 50 us in B = 64's chain against the slabs' 39 (perf-log v46), at B = 256 27 us faster
DENSE_WG_FROM_ROWS = 9  # token rows from which o_proj's batch GEMV takes gemv_wg.cu (split in K)
DENSE_SPLIT_ROWS = 128  # token rows up to which dense_gemv_wg splits a tile's K over blocks: on
# the H200 at B = 16 / 64 / 128 o_proj took 14.5 / 14.5 / 21.3 us against 21.9 / 22.2 / 22.8
# (kimi-linear-48b), at B = 256 30.6 against 26.6 (perf-log v48)
DENSE_SPLIT_SHARES = 2  # K shares a block of that split: fewer, longer blocks than one (v48)
DECODE_SPLIT = 4  # blocks a head in kda_decode_rows (half as many past one wave: decode_split)
DECODE_BATCH_MAX_SPLIT = 8  # most blocks a (sequence, head) in kda_decode_batch (a power of two)
CONV_TOKENS = 16  # consecutive tokens one prefill conv thread walks
WALK_ROWS = 64  # state rows (v) one kda_chunk_inter block carries: a warpgroup MMA's m
WALK_THREADS = 160  # kda_chunk_inter's block: one warpgroup and the copies' warp
# kda_chunk_core (the walk beside the last intra blocks, where the walk's blocks leave half the
# SMs or more idle): the share of the chunks, in percent, the intra kernel runs alone first. The
# walk must not overtake the intra blocks beside it, which run on the SMs it leaves at one block
# an SM: at kimi-linear-48b on an H200 (walk 0.66 ms, intra 1.23 at T = 16384, perf-log v56; 68
# SMs left at 1/1.44 of two blocks' rate, v11) the share that just keeps ahead is ~80%.
CORE_ALONE_PCT = 80
PORTABLE_WALK_STAGES = 5  # most slots of the portable walk's operand ring (a chunk has 4 pieces)
NORM_BLOCKS_PER_SM = 2048 // THREADS  # gated_rmsnorm's resident blocks an SM: one wave
DECODE_OVERLAP = 1  # decode's launches overlap the one before (LaunchConfig.overlap); 0: off
# token rows up to which the batch kernels' launches overlap too (0: never): on the H200 batched
# decode of kimi-linear-48b took 46.1 / 72.3 / 97.4 us at B = 8 / 16 / 32 overlapped against
# 50.6 / 77.2 / 99.0 (perf-log v58); at B = 64 level (140.7 against 141.3 us, v59; 5% slower
# in v36)
BATCH_OVERLAP_ROWS = 32
BATCH_WG = 1  # the batch GEMVs on gemv_wg.cu where sm_90a's build runs (Glm5NextKdaKernels.wg)
i32, i64, f32 = np.int32, np.int64, np.float32
NULL = np.uint64(0)  # an optional pointer argument left out (a DevicePtr may not be null)


def smem_per_block(cc: int) -> int:
    """The most shared memory one block may take on compute capability `cc` (SMEM_PER_BLOCK;
    the smallest listed for one not listed)."""
    return SMEM_PER_BLOCK.get(cc, min(SMEM_PER_BLOCK.values()))


def arch_cc(arch: str) -> int:
    """The compute capability an architecture name builds for: "sm_90a" -> 90."""
    return int(arch[3:].rstrip("a"))


def front_sync_words(rows: int) -> int:
    """front_end_gemv's int32 sync words for up to `rows` token rows: a pair a slab of
    BATCH_SLAB_ROWS (early tiles done, gate blocks done)."""
    return 2 * _blocks(max(rows, 1), BATCH_SLAB_ROWS)


def dense_split_tiles(rows: int, n: int) -> int:
    """dense_gemv_wg's (slab, tile) pairs whose K it may split over blocks, for up to `rows`
    token rows of n outputs: the slabs of up to DENSE_SPLIT_ROWS rows times the 64-row weight
    tiles; 1 up to GEMV_COLUMNS rows, which take decode's launch at any DECODE_GEMV_GROUPS (a
    buffer is never empty)."""
    if rows <= GEMV_COLUMNS:
        return 1
    return _blocks(min(rows, DENSE_SPLIT_ROWS), WG_TILE) * _blocks(n, WG_TILE)


def gemv_stages(cc: int) -> int:
    """Stages a decode GEMV warp keeps in flight on compute capability `cc`: GEMV_STAGES where
    GEMV_BLOCKS_PER_SM blocks' rings and share sums (gemv_part: a float4 a lane) fit the shared
    memory (a block's limit standing for the SM's, 1 KB less), else two: three on sm_90 and
    sm_100, two on sm_80 (where three would leave one block an SM) and the 99 KB GPUs."""
    stage = GEMV_WARPS * GEMV_TILE * GEMV_STAGE_K * BF16.itemsize
    block = GEMV_STAGES * stage + GEMV_WARPS * 32 * 16
    return GEMV_STAGES if GEMV_BLOCKS_PER_SM * block <= smem_per_block(cc) else 2


def decode_batch_bulk(cc: int) -> bool:
    """Whether kda_decode_batch stages its state rows in shared memory by bulk copies (the TMA
    engine, sm_90 on) rather than loading them into registers: where an SM's shared memory
    holds three blocks with a head's 64 KB of rows (D = 128), as on sm_90 and sm_100; the 99 KB
    GPUs would hold one where registers hold two."""
    return cc >= 90 and smem_per_block(cc) >= 3 * 64 * 1024


def decode_batch_blocks_per_sm(cc: int) -> int:
    """kda_decode_batch blocks an SM holds (its __launch_bounds__): three with bulk copies (a
    block's registers no longer hold its rows), else two."""
    return 3 if decode_batch_bulk(cc) else 2


def decode_batch_smem(cc: int, head_dim: int, rows: int, nrows: int) -> int:
    """kda_decode_batch's dynamic shared memory for a block of `rows` state rows and nrows
    tokens: its rows (bulk builds), then seven [nrows, D] words a token (recurrent.cu's
    decode_batch_smem, which exports the largest)."""
    return 4 * ((rows * head_dim if decode_batch_bulk(cc) else 0) + 7 * nrows * head_dim)


def portable_walk_split(cc: int) -> int:
    """Warps that share each 16 state rows (the MMA's m) of kda_chunk_inter_portable, each
    carrying D / split of the state's columns: two where a block's shared memory holds the
    operand ring beside the exchange of their partial products (163 KB and more), else one.
    A pair gives each scheduler two warps of half the products a chunk each, for a swap
    through shared memory (docs/perf-log.md, v25: the walk 3-5% faster)."""
    return 2 if smem_per_block(cc) >= 160 * 1024 else 1


def portable_walk_threads(cc: int, rows: int = WALK_ROWS) -> int:
    """kda_chunk_inter_portable's block of `rows` state rows (WALK_ROWS, or half: `walk_rows`)
    on compute capability `cc`: portable_walk_split warps per 16 of them."""
    return 32 * (rows // 16) * portable_walk_split(cc)


def compile_defines(cc: int = 90) -> tuple[str, ...]:
    """The -D flags every build of kernels_cu/ for compute capability `cc` takes: the geometry
    above, the block's shared-memory limit there, and the facts of config.py the kernels share
    (chunk length, widest conv, most decode rows, L2 epsilon)."""
    values = {"CHUNK": CHUNK, "MAX_DECODE_ROWS": MAX_DECODE_ROWS,
              "MAX_CONV_KERNEL": MAX_CONV_KERNEL, "L2_NORM_EPS": f"{L2_NORM_EPS!r}f",
              "THREADS": THREADS, "GEMV_TILE": GEMV_TILE, "GEMV_WARPS": GEMV_WARPS,
              "GEMV_STAGE_K": GEMV_STAGE_K, "GEMV_STAGES": gemv_stages(cc),
              "GEMV_BLOCKS_PER_SM": GEMV_BLOCKS_PER_SM, "GEMV_BATCH_GROUPS": GEMV_BATCH_GROUPS,
              "GEMV_BATCH_BLOCKS_PER_SM": GEMV_BATCH_BLOCKS_PER_SM,
              "GEMV_SLAB_W_BYTES": GEMV_SLAB_W_BYTES, "GEMV_SLAB_X_STAGES": GEMV_SLAB_X_STAGES,
              "GEMV_SLAB_TILES": GEMV_SLAB_TILES,
              "GEMV_SLAB_TILES_DENSE": GEMV_SLAB_TILES_DENSE, "WG_TILE": WG_TILE,
              "WG_THREADS": WG_THREADS, "WG_SLOTS": WG_SLOTS,
              "WG_BLOCKS_PER_SM": WG_BLOCKS_PER_SM, "DECODE_SPLIT": DECODE_SPLIT,
              "DECODE_BATCH_BLOCKS_PER_SM": decode_batch_blocks_per_sm(cc),
              "DECODE_BATCH_BULK": int(decode_batch_bulk(cc)),
              "CONV_TOKENS": CONV_TOKENS, "WALK_ROWS": WALK_ROWS, "WALK_THREADS": WALK_THREADS,
              "PORTABLE_WALK_SPLIT": portable_walk_split(cc),
              "PORTABLE_WALK_STAGES": PORTABLE_WALK_STAGES,
              "PORTABLE_WALK_THREADS": portable_walk_threads(cc), "SEG_FIELDS": SEG_FIELDS,
              "SMEM_PER_BLOCK": smem_per_block(cc)}
    return tuple(f"-D{name}={value}" for name, value in values.items())


def core_path(gpu: GpuBackend, core: str | None = None) -> str:
    """The walk the chunked core takes on `gpu`: `core`, else $KDARUN_CORE, else "auto"
    ("hopper" where the device has warpgroup MMAs, "portable" elsewhere). Forcing "hopper"
    where it cannot run is refused."""
    want = core if core is not None else os.environ.get("KDARUN_CORE", "auto")
    source = "core" if core is not None else "KDARUN_CORE"
    if want not in CORES:
        raise KdaError(f"{source}: expected one of {', '.join(CORES)}, got {want!r}")
    if want == "auto":
        return "hopper" if gpu.has_wgmma else "portable"
    if want == "hopper" and not gpu.has_wgmma:
        raise KdaError(f"{source}=hopper: the Hopper walk runs on warpgroup MMAs, which "
                       f"{gpu.device_name} lacks (needs compute capability 9.0); use 'portable' "
                       f"or 'auto'")
    return want


def core_split_allowed() -> bool:
    """$KDARUN_CORE_SPLIT: "1" (the default) lets the walk run beside the intra kernel's last
    chunks where `Glm5NextKdaKernels.core_split` finds room, "0" keeps them apart; anything else
    is refused."""
    want = os.environ.get("KDARUN_CORE_SPLIT", "1")
    if want not in ("0", "1"):
        raise KdaError(f"KDARUN_CORE_SPLIT: expected 0 or 1, got {want!r}")
    return want == "1"


def walk_rows(gpu: GpuBackend, cfg: Glm5NextKdaConfig, core: str) -> int:
    """State rows a block of the `core` walk carries on `gpu`. The Hopper walk has one size,
    WALK_ROWS (a warpgroup MMA's m). The portable walk takes $KDARUN_WALK_ROWS where set, else
    half of WALK_ROWS where the heads' blocks of half fit the SMs in one wave (kimi-linear-48b's
    32 heads: 128 blocks on an H200's 132 SMs, where blocks of WALK_ROWS would be 64), else
    WALK_ROWS. It is bound by each SM's issue slots, so the same warps spread over more SMs go
    faster. A KDARUN_WALK_ROWS that is not a size of the portable walk is refused."""
    half = WALK_ROWS // 2
    want = os.environ.get("KDARUN_WALK_ROWS")
    if want is not None and want not in (str(WALK_ROWS), str(half)):
        raise KdaError(f"KDARUN_WALK_ROWS: the portable walk takes blocks of {WALK_ROWS} or "
                       f"{half} state rows, got {want!r}")
    if core != "portable":
        return WALK_ROWS
    if want is not None:
        return int(want)
    return half if cfg.num_heads * cfg.head_dim // half <= gpu.sm_count else WALK_ROWS


def _blocks(n: int, per: int = THREADS) -> int:
    return max(1, -(-n // per))


@functools.cache
def _gemv_shares(rows: int, k: int, sm_count: int, reserved: int = 0, at_least: int = 1) -> int:
    """Warps that share one GEMV tile's K: the largest power of two up to GEMV_WARPS that
    leaves each warp a stage and keeps the launch's warps, with `reserved` others of the
    same launch, within what the SMs hold at once (a second partial wave of blocks streams
    at part speed), but no fewer than `at_least` where the stages allow. It depends on the
    shape alone, so every row count sums in the same order; cached, as decode asks for it
    every call."""
    tiles, steps = _blocks(rows, GEMV_TILE), _blocks(k, GEMV_STAGE_K)
    cap = GEMV_WARPS
    while cap > steps:
        cap //= 2
    ks, resident = min(at_least, cap), GEMV_BLOCKS_PER_SM * GEMV_WARPS * sm_count - reserved
    while 2 * ks <= cap and tiles * 2 * ks <= resident:
        ks *= 2
    return ks


def _overlap(rows: int | None = None) -> bool:
    """Whether a launch of decode's kernels (its GEMVs and stateful walks, which call
    prior_grid_sync) may overlap the launch before it: DECODE_OVERLAP for decode's own
    launches (its GEMV entries, `_decode_gemv`, and kda_decode_rows; rows None), and for the
    batch kernels (the slab GEMVs, gemv_wg.cu's, kda_decode_batch) over `rows` token rows
    where those are at most BATCH_OVERLAP_ROWS; read at each launch, so tools/sweep.py can
    switch them."""
    return bool(DECODE_OVERLAP) if rows is None else 0 < rows <= BATCH_OVERLAP_ROWS


def _cfg1d(n: int) -> LaunchConfig:
    return LaunchConfig((_blocks(n), 1, 1), (THREADS, 1, 1))


class SegmentTable(NamedTuple):
    """A segment table on the device (`segment_table`'s array): `count` segments over
    `t_pad` padded rows."""
    ptr: DevicePtr
    count: int
    t_pad: int


def segment_table(row0: np.ndarray, rows: np.ndarray, slot: np.ndarray, init: np.ndarray,
                  every: int, checkpoints: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """The int32 table kernels_cu/segments.cuh reads, and the padded rows it spans, for
    segments given as arrays of one entry each: `rows` tokens at packed row `row0`, the state in
    pool slot `slot`, read first where `init`. Segment i takes the next ceil(rows / CHUNK)
    chunks. With every > 0 (chunks), each segment's state after every `every` whole chunks goes
    to the next of `checkpoints` (the segments' slots one after another, -1 skipped). Rows
    {chunk0, chunks, row0, rows, slot, init, every, ckpt}, then the checkpoints. NumPy over
    the segments: a pack of many short sequences is planned in microseconds."""
    rows = np.asarray(rows, np.int64)
    n = len(rows)
    per = rows // (every * CHUNK) if every else None  # checkpoints a segment
    wanted = int(per.sum()) if every else 0
    ck = () if checkpoints is None else checkpoints
    if len(ck) != wanted:
        raise KdaError(f"segment_table: {wanted} checkpoint slots wanted, got {len(ck)}")
    out = np.empty(n * SEG_FIELDS + wanted, np.int32)  # one array, filled by column
    if not n:
        return out, 0
    table = out[:n * SEG_FIELDS].reshape(n, SEG_FIELDS)
    chunks = (rows + (CHUNK - 1)) // CHUNK
    table[:, 1], table[:, 3] = chunks, rows
    table[0, 0] = 0
    np.cumsum(chunks[:-1], out=table[1:, 0])
    table[:, 2], table[:, 4], table[:, 5] = row0, slot, init
    if every:
        table[:, 6] = np.where(per > 0, every, 0)
        table[0, 7] = n * SEG_FIELDS
        np.cumsum(per[:-1], out=table[1:, 7])
        table[1:, 7] += n * SEG_FIELDS
        out[n * SEG_FIELDS:] = ck
    else:
        table[:, 6], table[:, 7] = 0, n * SEG_FIELDS
    return out, int(chunks.sum()) * CHUNK


class Glm5NextKdaKernels:
    """Every kernel a KDA block launches, bound to one backend and config."""

    def __init__(self, gpu: GpuBackend, cfg: Glm5NextKdaConfig, core: str | None = None):
        """Builds every family for `gpu`; `core` picks the chunked core's walk (`core_path`)."""
        self.gpu = gpu
        self.cfg = cfg
        self.core = core_path(gpu, core)
        self.walk_rows = walk_rows(gpu, cfg, self.core)  # state rows a block of the walk
        self.use_build(gpu.compute_capability)

    def use_build(self, cc: int) -> None:
        """Loads every family as built for compute capability `cc` (its compile_defines: the
        block's shared-memory limit, how the batch decode moves its state), compiled for this
        GPU's own architecture, and sizes the launches for it. Construction takes the device's
        own; the GPU tests run the builds of other GPUs here with it. A build for a higher
        capability than the device's may use instructions it lacks, and is refused; the
        launches are sized for `cc` only once every family has loaded."""
        own = self.gpu.compute_capability
        if not isinstance(cc, int) or isinstance(cc, bool) or not MIN_CC <= cc <= own:
            raise KdaError(f"use_build: a build for compute capability {cc!r} cannot run on "
                           f"{self.gpu.device_name} (capability {own}); need an integer in "
                           f"[{MIN_CC}, {own}]")
        defines = compile_defines(cc)
        modules = {fam: self.gpu.load_module(fam, defines) for fam in FAMILIES}
        self.cc, self.modules = cc, modules
        self._maps: dict[tuple[int, int, int, int], TensorMap] = {}

    def _launch(self, family: str, name: str, cfg: LaunchConfig, args: tuple, stream: int) -> None:
        for a in args:
            if isinstance(a, DevicePtr) and a.is_null:
                raise KdaError(f"{name}: null device pointer argument")
        self.gpu.launch(self.modules[family], name, cfg, args, stream)

    def _gate_form(self) -> tuple[np.float32, np.int32]:
        """The gate kernels' (lower_bound, bounded) arguments: the softplus form passes
        (0, 0)."""
        lb = self.cfg.gate_lower_bound
        return f32(0.0 if lb is None else lb), i32(lb is not None)

    # -- projections ---------------------------------------------------------------------
    @staticmethod
    def _gemv_check(name: str, k: int, m: int, ldx: int) -> None:
        if m < 1:
            raise KdaError(f"{name}: rows must be positive, got {m}")
        if k % 8 or ldx % 8 or ldx < k:
            raise KdaError(f"{name}: need k and ldx multiples of 8 with ldx >= k; "
                           f"got k={k} ldx={ldx}")

    @staticmethod
    def _gemv_blocks(rows: int, ks: int) -> int:
        """Decode's GEMV blocks over `rows` output rows: GEMV_WARPS / ks tiles a block."""
        return _blocks(_blocks(rows, GEMV_TILE), GEMV_WARPS // ks)

    @staticmethod
    def _decode_gemv(name: str, m: int, x2_rows: int) -> str | None:
        """The entry of decode's GEMV `name` (dense_gemv_bf16, front_end_gemv) that serves m
        token rows on decode's launch plan, or None past DECODE_GEMV_GROUPS column groups: up
        to GEMV_COLUMNS rows the entry itself, up to twice that (and x2_rows) its _x2 form
        (two groups)."""
        if DECODE_GEMV_GROUPS not in (1, 2):
            raise KdaError(f"DECODE_GEMV_GROUPS: expected 1 or 2, got {DECODE_GEMV_GROUPS}")
        groups = _blocks(m, GEMV_COLUMNS)
        if groups > DECODE_GEMV_GROUPS or m > max(x2_rows, GEMV_COLUMNS):
            return None
        return name if groups == 1 else f"{name}_x2"

    @staticmethod
    def _gemv_launch(blocks: int) -> LaunchConfig:
        """Decode's GEMV launch (dense_gemv_bf16, front_end_gemv): blocks of GEMV_WARPS warps,
        overlapping the launch before (DECODE_OVERLAP)."""
        return LaunchConfig((blocks, 1, 1), (32 * GEMV_WARPS, 1, 1), overlap=_overlap())

    @staticmethod
    def _slab_blocks(rows: int, tiles: int) -> int:
        """A batch GEMV's blocks a slab over `rows` output rows: one per `tiles` tiles (the K
        shares are walked by each warp in turn)."""
        return _blocks(_blocks(rows, GEMV_TILE), tiles)

    @staticmethod
    def _slab_cfg(blocks: int, m: int) -> LaunchConfig:
        """A batch GEMV's launch over m token rows: `blocks` a slab (grid y) for each slab of
        BATCH_SLAB_ROWS token rows (grid x: a weight block's slabs neighbours in launch
        order)."""
        return LaunchConfig((_blocks(m, BATCH_SLAB_ROWS), blocks, 1), (32 * GEMV_WARPS, 1, 1),
                            overlap=_overlap(rows=m))

    @property
    def wg(self) -> bool:
        """Whether the batch GEMVs run on TMA copies and warpgroup MMAs (gemv_wg.cu): in
        sm_90a's build (BATCH_WG, read at each launch, so tools/sweep.py can switch it); every
        other build streams them through the slab kernels of gemv.cu."""
        return bool(BATCH_WG) and self.cc == 90 and self.gpu.has_wgmma

    def _wg_takes(self, m: int, from_rows: int, *mats: tuple[DevicePtr, int]) -> bool:
        """Whether a batch GEMV over m token rows runs on gemv_wg.cu: from `from_rows` rows,
        where tensor maps can address each matrix (ptr, row stride): a caller's hidden rows at
        an odd offset take the slab kernels instead."""
        return self.wg and m >= from_rows and all(tma_addressable(*p) for p in mats)

    def _tensor_map(self, kernel: str, ptr: DevicePtr, rows: int, cols: int,
                    ld: int) -> TensorMap:
        """The tensor map of bf16 [rows, cols] at ptr for gemv_wg.cu, made once: a map depends
        on nothing else, so the same key is the same map (a batch of decode re-encodes only
        for a new batch size or buffer)."""
        key = (int(ptr), rows, cols, ld)
        if key not in self._maps:
            if len(self._maps) >= 4096:  # eager calls over ever new buffers: start again
                self._maps.clear()
            self._maps[key] = self.gpu.tensor_map(kernel,
                                                  TensorMap(ptr, rows, cols, ld, WG_TILE))
        return self._maps[key]

    def dense_gemv_bf16_batchm(self, stream: int, w: DevicePtr, x: DevicePtr, y: DevicePtr,
                               n: int, k: int, m: int, part: DevicePtr, count: DevicePtr) -> None:
        """y[m, n] = bf16(W[n, k] @ x[m, k]) for m dense rows; each row's K order and
        reduction tree is the same for any m, so m rows are bit-identical to m single calls.
        Up to DECODE_GEMV_GROUPS column groups of GEMV_COLUMNS rows take decode's launch
        (`_decode_gemv`); past them from DENSE_WG_FROM_ROWS on sm_90a one
        launch of dense_gemv_wg, a block a WG_TILE-row weight tile and WG_TILE token rows (grid
        x: a tile's slabs at once), up to DENSE_SPLIT_ROWS rows its K shares split over grid z,
        DENSE_SPLIT_SHARES a block, through part [dense_split_tiles(m, n) * GEMV_WARPS,
        WG_TILE * WG_TILE] fp32 and count [dense_split_tiles(m, n)] int32 (zero on entry, left
        zero); otherwise one launch of the slabs of GEMV_BATCH_GROUPS column groups side by
        side (grid x), a weight block's slabs at once."""
        self._gemv_check("dense_gemv_bf16", k, m, k)
        ks = _gemv_shares(n, k, self.gpu.sm_count)
        if name := self._decode_gemv("dense_gemv_bf16", m, DENSE_X2_ROWS):
            cfg = self._gemv_launch(self._gemv_blocks(n, ks))
        elif self._wg_takes(m, DENSE_WG_FROM_ROWS, (w, k), (x, k)):
            per = min(DENSE_SPLIT_SHARES, ks)  # both powers of two: per divides ks
            if per < 1 or per & (per - 1):
                raise KdaError(f"DENSE_SPLIT_SHARES: expected a power of two, got {per}")
            split = ks // per if m <= DENSE_SPLIT_ROWS else 1
            cfg = LaunchConfig((_blocks(m, WG_TILE), _blocks(n, WG_TILE), split),
                               (WG_THREADS, 1, 1), overlap=_overlap(rows=m))
            self._launch("gemv_wg", "dense_gemv_wg", cfg, (
                self._tensor_map("dense_gemv_wg", w, n, k, k),
                self._tensor_map("dense_gemv_wg", x, m, k, k), y, i32(n), i32(k), i32(m),
                i32(n), i32(ks), part, count), stream)
            return
        else:
            name = "dense_gemv_bf16_batch"
            cfg = self._slab_cfg(self._slab_blocks(n, GEMV_SLAB_TILES_DENSE), m)
        self._launch("gemv", name, cfg, (w, x, y, i32(n), i32(k), i32(m), i32(k), i32(n),
                                         i32(ks)), stream)

    @functools.cached_property
    def _front_end_plan(self) -> tuple[int, tuple]:
        """front_end_gemv's blocks and its share and block arguments: they depend on the
        config alone, so they are worked out once (decode asks every call)."""
        c, sm = self.cfg, self.gpu.sm_count
        qkv_rows = c.conv_dim  # q|k|v come first in the packed projection
        early_rows = c.gate_in_rows  # f_a|g_a|b: few tiles, so every share they can use
        ks_early = _gemv_shares(early_rows, c.hidden_size, sm)
        early_blocks = self._gemv_blocks(early_rows, ks_early)
        ks_gate = _gemv_shares(2 * c.qkv, c.rank, sm)
        gate_blocks = self._gemv_blocks(2 * c.qkv, ks_gate) + 1  # + beta's
        # q|k|v: within one wave with the rest where that leaves 2 shares, else 2 anyway: a
        # second wave of gates cost less than single-share q|k|v tiles (docs/perf-log.md, v6)
        ks = _gemv_shares(qkv_rows, c.hidden_size, sm, (early_blocks + gate_blocks) * GEMV_WARPS,
                          at_least=2)
        proj_blocks = early_blocks + self._gemv_blocks(qkv_rows, ks)
        return proj_blocks + gate_blocks, (i32(ks), i32(ks_early), i32(ks_gate),
                                           i32(early_blocks), i32(proj_blocks))

    @functools.cached_property
    def _front_end_batch_plan(self) -> tuple[int, tuple]:
        """front_end_gemv_batch's blocks a slab and arguments: front_end_gemv's shares (a row's
        sums follow them, so its bits are decode's) and the blocks of GEMV_SLAB_TILES tiles of
        each region: f_a|g_a|b, q|k|v, f_b|g_b and beta's."""
        c = self.cfg
        _, (ks, ks_early, ks_gate, _, _) = self._front_end_plan
        early_blocks = self._slab_blocks(c.gate_in_rows, GEMV_SLAB_TILES)
        proj_blocks = early_blocks + self._slab_blocks(c.conv_dim, GEMV_SLAB_TILES)
        gate_blocks = self._slab_blocks(2 * c.qkv, GEMV_SLAB_TILES) + 1
        return proj_blocks + gate_blocks, (ks, ks_early, ks_gate, i32(early_blocks),
                                           i32(proj_blocks))

    @functools.cached_property
    def _front_end_wg_plan(self) -> tuple[int, tuple]:
        """front_end_wg's blocks a slab and arguments: front_end_gemv's shares (a row's sums
        follow them, so its bits are decode's) and a block a WG_TILE-row tile of each region:
        f_a|g_a|b, q|k|v, f_b|g_b (qkv % WG_TILE == 0: a tile is all f or all g), then beta's."""
        c = self.cfg
        _, (ks, ks_early, ks_gate, _, _) = self._front_end_plan
        early_blocks = _blocks(c.gate_in_rows, WG_TILE)
        proj_blocks = early_blocks + c.conv_dim // WG_TILE
        gate_blocks = 2 * c.qkv // WG_TILE + 1
        return proj_blocks + gate_blocks, (ks, ks_early, ks_gate, i32(early_blocks),
                                           i32(proj_blocks))

    def front_end_gemv(self, stream: int, w_in: DevicePtr, hidden: DevicePtr, gate_in: DevicePtr,
                       qkv_parts: DevicePtr, qkv_proj: DevicePtr, f_b: DevicePtr, g_b: DevicePtr,
                       a_log: DevicePtr, dt_bias: DevicePtr, g_raw: DevicePtr,
                       out_gate: DevicePtr, gate: DevicePtr, beta: DevicePtr, sync: DevicePtr,
                       m: int) -> None:
        """Decode's front end over m rows of hidden [m, hidden] bf16 in one launch (decode's
        own up to DECODE_GEMV_GROUPS column groups, `_decode_gemv`; past them the slabs
        of BATCH_SLAB_ROWS rows side by side: from WG_FROM_ROWS on
        sm_90a front_end_wg's WG_TILE-row tiles, otherwise the slab kernel's): the packed
        projection, q|k|v to qkv_proj [m, conv_dim] and qkv_parts [3, m, qkv] and f_a|g_a|b to
        gate_in [m, gate_in_width], then from f_a|g_a|b g_raw and the forget gate [m, qkv],
        out_gate [m, qkv] and beta [m, H]. sync [front_sync_words(m)] int32 orders the gates
        after the rows they read; zero on entry, left zero."""
        c = self.cfg
        self._gemv_check("front_end_gemv", c.hidden_size, m, c.hidden_size)
        gate_args = (i32(c.num_heads), i32(c.head_dim), i32(c.rank), *self._gate_form())
        if name := self._decode_gemv("front_end_gemv", m, FRONT_END_X2_ROWS):
            blocks, shares = self._front_end_plan
            cfg = self._gemv_launch(blocks)
        else:
            k, r, ldg = c.hidden_size, c.rank, c.gate_in_width
            g_a = gate_in + BF16.itemsize * r  # gate_in's columns from r
            if self._wg_takes(m, WG_FROM_ROWS, (w_in, k), (hidden, k), (f_b, r), (g_b, r),
                              (gate_in, ldg), (g_a, ldg)):
                blocks, shares = self._front_end_wg_plan
                cfg = LaunchConfig((_blocks(m, WG_TILE), blocks, 1), (WG_THREADS, 1, 1),
                                   overlap=_overlap(rows=m))
                name = "front_end_wg"
                maps = (self._tensor_map(name, w_in, c.proj_rows, k, k),
                        self._tensor_map(name, hidden, m, k, k),
                        self._tensor_map(name, f_b, c.qkv, r, r),
                        self._tensor_map(name, g_b, c.qkv, r, r),
                        self._tensor_map(name, gate_in, m, r, ldg),  # f_a
                        self._tensor_map(name, g_a, m, r, ldg))
                self._launch("gemv_wg", name, cfg,
                             (*maps, gate_in, qkv_parts, qkv_proj, a_log, dt_bias, g_raw,
                              out_gate, gate, beta, sync, i32(c.proj_rows), i32(k), i32(m),
                              i32(m), i32(ldg), *gate_args, *shares), stream)
                return
            blocks, shares = self._front_end_batch_plan
            name, cfg = "front_end_gemv_batch", self._slab_cfg(blocks, m)
        self._launch("gemv", name, cfg,
                     (w_in, hidden, gate_in, qkv_parts, qkv_proj, f_b, g_b, a_log, dt_bias, g_raw,
                      out_gate, gate, beta, sync, i32(c.proj_rows), i32(c.hidden_size), i32(m),
                      i32(m), i32(c.gate_in_width), *gate_args, *shares), stream)

    def gemm_bf16(self, stream: int, a: DevicePtr, lda: int, w: DevicePtr, c: DevicePtr,
                  ldc: int, m: int, n: int, k: int) -> None:
        """c[m, n] = bf16(a[m, k] @ w[n, k]^T), for prefill."""
        if min(m, n, k) < 1 or lda < k or ldc < n:
            raise KdaError(f"gemm_bf16: bad sizes m={m} n={n} k={k} lda={lda} ldc={ldc}")
        self.gpu.gemm_bf16(a, lda, w, c, ldc, m, n, k, stream)

    # -- element-wise ----------------------------------------------------------------------
    @staticmethod
    def _segments(t: int, segs: SegmentTable | None) -> tuple:
        """A launch's (table, count, t_pad): a plain prefill's null table is one segment."""
        return (NULL, 1, -(-t // CHUNK) * CHUNK) if segs is None else segs

    def kda_gate_beta(self, stream: int, g_raw: DevicePtr, b_raw: DevicePtr, ldb: int,
                      a_log: DevicePtr, dt_bias: DevicePtr, gate: DevicePtr, beta: DevicePtr,
                      t: int, segs: SegmentTable | None = None, pad_fill: float = 0.0) -> None:
        """g_raw [t, qkv] bf16 -> gate [t_pad, H, D] fp32; b_raw (row stride ldb) ->
        beta [t_pad, H]; padded rows (past each segment's tokens) written as pad_fill."""
        c = self.cfg
        table, n, t_pad = self._segments(t, segs)
        self._launch("gate", "kda_gate_beta", _cfg1d(t_pad * c.qkv // 8),
                     (g_raw, b_raw, i32(ldb), a_log, dt_bias, gate, beta, table, i32(n), i32(t),
                      i32(t_pad), i32(c.num_heads), i32(c.head_dim), *self._gate_form(),
                      f32(pad_fill)), stream)

    # -- conv ------------------------------------------------------------------------------
    @property
    def prefill_conv_name(self) -> str:
        """The prefill conv kernel for this config's width: conv.cu has one with W = 4 as a
        literal, and one for any width."""
        return "prefill_conv_qkv_w4" if self.cfg.conv_kernel == 4 else "prefill_conv_qkv"

    def prefill_conv_qkv(self, stream: int, qkv_proj: DevicePtr, conv_state: DevicePtr,
                         conv_w: DevicePtr, conv_out: DevicePtr, t: int,
                         segs: SegmentTable | None = None) -> None:
        """Prefill over t tokens of qkv_proj [t, conv_dim] (the projection's q|k|v): conv_out
        (conv + SiLU to bf16, then q/k L2 normalised to bf16 again); then the conv state
        [W-1, conv_dim] rolls to the last W-1 input rows.
        With `segs`, each segment convolves its own rows from its slot of conv_state [slots,
        W-1, conv_dim] (or zeros), writes its state back there and its checkpoints' to their
        slots."""
        c = self.cfg
        table, n, t_pad = self._segments(t, segs)
        threads = _blocks(t_pad, CONV_TOKENS) * c.conv_dim // 8
        self._launch("conv", self.prefill_conv_name, _cfg1d(threads),
                     (qkv_proj, conv_state, conv_w, conv_out, table, i32(n), i32(t), i32(t_pad),
                      i32(c.num_heads), i32(c.head_dim), i32(c.conv_kernel)),
                     stream)
        self._launch("conv", "conv_roll_state",
                     LaunchConfig((_blocks(c.conv_dim), n, 1), (THREADS, 1, 1)),
                     (qkv_proj, conv_state, table, i32(n), i32(t), i32(c.conv_dim),
                      i32(c.conv_kernel)),
                     stream)

    def prefill_stage_copies(self, stream: int, qkv_proj: DevicePtr, conv_out: DevicePtr,
                             qkv_parts: DevicePtr, q: DevicePtr, k: DevicePtr, v: DevicePtr,
                             t: int, pad_fill: float, segs: SegmentTable | None = None) -> None:
        """The stages' copies no kernel reads: qkv_proj [t, conv_dim] by part into qkv_parts
        [3, t, qkv], and conv_out's q, k, v [t, conv_dim] bf16 widened to q, k, v [t_pad, qkv]
        fp32 in padded rows, pad_fill past each segment's tokens."""
        c = self.cfg
        table, n, t_pad = self._segments(t, segs)
        self._launch("conv", "prefill_stage_copies", _cfg1d(t_pad * c.conv_dim // 8),
                     (qkv_proj, conv_out, qkv_parts, q, k, v, table, i32(n), i32(t), i32(t_pad),
                      i32(c.qkv), f32(pad_fill)), stream)

    # -- core ------------------------------------------------------------------------------
    def kda_decode_rows(self, stream: int, x: DevicePtr, conv_state: DevicePtr,
                        conv_w: DevicePtr, conv_out: DevicePtr, gate: DevicePtr, beta: DevicePtr,
                        state: DevicePtr, core: DevicePtr, out_gate: DevicePtr,
                        o_norm_w: DevicePtr, o_norm_out: DevicePtr, snap_rec: DevicePtr,
                        snap_conv: DevicePtr, sync: DevicePtr, nrows: int, nsnap: int,
                        overlap: bool) -> None:
        """nrows decode tokens of one sequence in order, `decode_split` blocks per head, one
        launch: for each, conv over the carried conv state + SiLU + L2 of q/k, the delta-rule
        step on state [H, Dv, Dk] fp32 and the gated RMSNorm. Both states are updated in place;
        the states after the first nsnap rows go to snap_rec [nsnap, H, Dv, Dk] / snap_conv
        [nsnap, W-1, conv_dim]. sync [H] int32 counts the blocks of a head done with all
        rows; it must be zero on entry and is left zero. Row pointers (x, conv_out, gate, beta,
        core, out_gate, o_norm_out) advance a row a token. `overlap`: the launch may overlap
        the kernel before it (DECODE_OVERLAP permitting), which it reads its states ahead of:
        only where that kernel writes neither state (decode's front end), never after another
        walk."""
        c = self.cfg
        self._rows_check("kda_decode_rows", nrows, nsnap)
        self._launch("recurrent", f"kda_decode_rows_d{c.head_dim}", self._rows_launch(overlap),
                     (x, conv_state, conv_w, conv_out, gate, beta, state, core, out_gate,
                      o_norm_w, o_norm_out, snap_rec, snap_conv, sync, i32(nrows), i32(nsnap),
                      i32(c.num_heads), i32(c.conv_kernel), f32(c.scale), f32(c.rms_norm_eps)),
                     stream)

    def kda_decode_batch(self, stream: int, x: DevicePtr, conv_pool: DevicePtr,
                         conv_w: DevicePtr, conv_out: DevicePtr, gate: DevicePtr,
                         beta: DevicePtr, rec_pool: DevicePtr, core: DevicePtr,
                         out_gate: DevicePtr, o_norm_w: DevicePtr, o_norm_out: DevicePtr,
                         slots: DevicePtr, snap_slots: DevicePtr | None, nslots: int,
                         fault: DevicePtr, sync: DevicePtr, nseq: int, nrows: int) -> None:
        """kda_decode_rows for nseq sequences of nrows rows each, one launch, the row buffers
        holding them one after the other: sequence b's states are slot slots[b] (int32 [nseq]
        on the device) of the pools rec_pool [nslots, H, Dv, Dk] fp32 and conv_pool [nslots,
        W-1, conv_dim] bf16; -1 is a padding row whose blocks touch nothing. With snap_slots
        (int32 [nseq, nrows-1]) the state after each row but the last goes to that pool slot
        (-1: skipped). An entry outside [-1, nslots) acts as -1 and is recorded in fault
        (the pool's fault words, `KdaStatePool.check_faults`). sync [nseq, H] int32, zero on
        entry, left zero. Each row takes
        kda_decode_rows' arithmetic, so a sequence's bits do not depend on its batch; a small
        batch splits each head's state rows over more blocks (`_batch_split`). One sequence of
        one row takes decode's own launch at its slot (`batch_rows_kernel`)."""
        c = self.cfg
        nsnap = nrows - 1 if snap_slots is not None else 0
        self._rows_check("kda_decode_batch", nrows, nsnap)
        if nseq < 1:
            raise KdaError(f"kda_decode_batch: need at least one sequence, got {nseq}")
        if self._batch_of_one(nseq, nrows):
            self._launch("recurrent", self.batch_rows_kernel(nseq, nrows),
                         self._rows_launch(overlap=True),  # after the front end (batch_steps)
                         (x, conv_pool, conv_w, conv_out, gate, beta, rec_pool, core, out_gate,
                          o_norm_w, o_norm_out, slots, i32(nslots), fault, sync,
                          i32(c.num_heads), i32(c.conv_kernel), f32(c.scale),
                          f32(c.rms_norm_eps)), stream)
            return
        split = self._batch_split(nseq)
        smem = decode_batch_smem(self.cc, c.head_dim, c.head_dim // split, nrows)
        cfg = LaunchConfig((c.num_heads, split, nseq), (2 * c.head_dim, 1, 1), smem,
                           overlap=_overlap(rows=nseq * nrows))
        self._launch("recurrent", f"kda_decode_batch_d{c.head_dim}", cfg,
                     (x, conv_pool, conv_w, conv_out, gate, beta, rec_pool, core, out_gate,
                      o_norm_w, o_norm_out, slots, NULL if snap_slots is None else snap_slots,
                      i32(nslots), fault, sync, i32(nseq), i32(nrows), i32(nsnap),
                      i32(c.num_heads), i32(c.conv_kernel), f32(c.scale), f32(c.rms_norm_eps)),
                     stream)

    def _rows_launch(self, overlap: bool) -> LaunchConfig:
        """kda_decode_rows' launch (and its slot entry's): `decode_split` blocks a head of 4 D
        threads, overlapping the launch before where `overlap` and DECODE_OVERLAP allow."""
        c = self.cfg
        return LaunchConfig((c.num_heads, self.decode_split, 1), (4 * c.head_dim, 1, 1),
                            overlap=overlap and _overlap())

    @property
    def decode_split(self) -> int:
        """Blocks a head of kda_decode_rows: DECODE_SPLIT where H x DECODE_SPLIT blocks run in
        one wave, half as many where they would not (a block of 4 D threads holds most of an
        SM's registers: one an SM). A second wave of short blocks costs more than one wave of
        blocks walking twice the rows (perf-log v40: glm-5.3-flash's 64 heads, 8.3 -> 5.0 us)."""
        fits = self.cfg.num_heads * DECODE_SPLIT <= self.gpu.sm_count
        return DECODE_SPLIT if fits else DECODE_SPLIT // 2

    def batch_rows_kernel(self, nseq: int, nrows: int) -> str:
        """The entry kda_decode_batch launches: decode's own (`kda_decode_rows_slot`) for one
        sequence of one row, where the batch kernel's split blocks each convolve the head again
        and cost more than decode's; kda_decode_batch otherwise."""
        d = self.cfg.head_dim
        return (f"kda_decode_rows_slot_d{d}" if self._batch_of_one(nseq, nrows)
                else f"kda_decode_batch_d{d}")

    @staticmethod
    def _batch_of_one(nseq: int, nrows: int) -> bool:
        return nseq == 1 and nrows == 1

    def _batch_split(self, nseq: int) -> int:
        """Blocks a (sequence, head) of kda_decode_batch: doubled, up to DECODE_BATCH_MAX_SPLIT,
        while the launch still runs in one wave, so a small batch's state streams through more
        SMs (a state row's update does not depend on the block that owns it) and no block waits
        for a second wave (perf-log v40: kimi-linear-48b B = 8 at split 2, 1.3 waves, against
        split 1, 20.8 -> 15.7 us). Past one wave a block keeps a whole (sequence, head): split 2
        there, for a fuller last wave, took the recurrence 12-15% longer (v59: kimi-linear-48b
        B = 32 / 64 / 128, glm-5.3-flash B = 64), its blocks each with half the rows in flight."""
        split = 1
        blocks = self.gpu.sm_count * decode_batch_blocks_per_sm(self.cc)
        while split < DECODE_BATCH_MAX_SPLIT and nseq * self.cfg.num_heads * split * 2 <= blocks:
            split *= 2
        return split

    @staticmethod
    def _rows_check(name: str, nrows: int, nsnap: int) -> None:
        if not 1 <= nrows <= MAX_DECODE_ROWS or not 0 <= nsnap < nrows:
            raise KdaError(f"{name}: need 1 <= nrows <= {MAX_DECODE_ROWS} and 0 <= nsnap < "
                           f"nrows, got nrows={nrows} nsnap={nsnap}")

    def kda_chunk_intra(self, stream: int, conv_out: DevicePtr, g_raw: DevicePtr,
                        b_raw: DevicePtr, ldb: int, a_log: DevicePtr, dt_bias: DevicePtr,
                        qg: DevicePtr, kd: DevicePtr, gl: DevicePtr, w: DevicePtr, u: DevicePtr,
                        aqk: DevicePtr, t: int, segs: SegmentTable | None = None,
                        chunks: int | None = None) -> None:
        """Every chunk's WY factors, in parallel: the chunked core's first half, from q, k, v
        in conv_out [t, conv_dim] bf16, g_raw [t, qkv] and b_raw (row stride ldb) bf16 (packed
        rows: each segment's tokens, or t tokens), whose decay and beta it forms as
        kda_gate_beta does (a_log [H], dt_bias [qkv] fp32). It writes the walk's operands qg,
        kd, gl, w, u, aqk (the workspace's chunk_* buffers, in layouts private to chunk.cu) of
        the first `chunks` chunks (default all); rows past a segment's tokens are never read."""
        c = self.cfg
        table, n, t_pad = self._segments(t, segs)
        chunks = t_pad // CHUNK if chunks is None else chunks
        self._launch("chunk", f"kda_chunk_intra_d{c.head_dim}",
                     LaunchConfig((chunks, c.num_heads, 1), (THREADS, 1, 1)),
                     (conv_out, g_raw, b_raw, i32(ldb), a_log, dt_bias, *self._gate_form(), qg,
                      kd, gl, w, u, aqk, table, i32(n), i32(t), i32(t_pad), i32(c.num_heads),
                      f32(c.scale), i32(chunks)), stream)

    def core_split(self, t: int, segs: SegmentTable | None = None) -> int | None:
        """The chunk from which kda_chunk_core runs the rest of the intra kernel beside the
        walk, for a core over t rows (`segs`: a packed one's table); None where the walk runs
        after the whole intra kernel. The fused launch takes the Hopper walk's blocks, one an
        SM, first: only where they leave at least half the device's SMs to the intra blocks
        (the walk spins on chunks those blocks have yet to write, so they must get SMs: a
        process held to fewer SMs than the device has, as under MPS with a thread percentage
        below half, must set KDARUN_CORE_SPLIT=0), and for one segment (one block a (head,
        slice) walks its chunks in order). KDARUN_CORE_SPLIT=0 turns it off, 1 (the default)
        allows it."""
        c = self.cfg
        _, n, t_pad = self._segments(t, segs)
        walkers = c.num_heads * (c.head_dim // WALK_ROWS)
        chunks = t_pad // CHUNK
        if (self.core != "hopper" or not core_split_allowed() or n != 1 or chunks < 2
                or 2 * walkers > self.gpu.sm_count):
            return None
        return min(chunks - 1, max(1, round(CORE_ALONE_PCT * chunks / 100)))

    def kda_chunk_core(self, stream: int, conv_out: DevicePtr, g_raw: DevicePtr,
                       b_raw: DevicePtr, ldb: int, a_log: DevicePtr, dt_bias: DevicePtr,
                       qg: DevicePtr, kd: DevicePtr, gl: DevicePtr, w: DevicePtr, u: DevicePtr,
                       aqk: DevicePtr, state: DevicePtr, core: DevicePtr, ready: DevicePtr,
                       c_first: int, t: int, segs: SegmentTable | None = None) -> None:
        """The rest of kda_chunk_intra (chunks from c_first, after a launch of `chunks=c_first`)
        and the whole walk in one launch, where `core_split` gave c_first: the Hopper walk's
        blocks first, then the intra blocks on the SMs they leave, each flagging its (chunk,
        head) in ready [t_pad / C, H] int32 (zeroed here first; the walk leaves it zero), on
        which the walk waits. Its outputs are the two launches': core and the state, as
        kda_chunk_inter writes them."""
        c = self.cfg
        table, n, t_pad = self._segments(t, segs)
        chunks = t_pad // CHUNK
        if (split := self.core_split(t, segs)) != c_first:
            raise KdaError(f"kda_chunk_core: c_first {c_first} is not core_split's {split} "
                           f"for {t} rows")
        self.gpu.memset(ready, 0, chunks * c.num_heads * I32.itemsize, stream)
        walkers = c.num_heads * (c.head_dim // WALK_ROWS)
        self._launch("chunk", f"kda_chunk_core_d{c.head_dim}",
                     LaunchConfig((walkers + (chunks - c_first) * c.num_heads, 1, 1),
                                  (THREADS, 1, 1)),
                     (conv_out, g_raw, b_raw, i32(ldb), a_log, dt_bias, *self._gate_form(), qg,
                      kd, gl, w, u, aqk, state, core, ready, i32(c_first), table, i32(n),
                      i32(t), i32(t_pad), i32(c.num_heads), f32(c.scale)), stream)

    @property
    def chunk_inter_name(self) -> str:
        """The walk kernel `core` and `walk_rows` picked: kda_chunk_inter_d{D} (chunk.cu, the
        Hopper walk), kda_chunk_inter_portable_d{D} or, in blocks of half the rows,
        kda_chunk_inter_portable_r32_d{D} (chunk_portable.cu)."""
        if self.core != "portable":
            return f"kda_chunk_inter_d{self.cfg.head_dim}"
        half = "" if self.walk_rows == WALK_ROWS else f"_r{self.walk_rows}"
        return f"kda_chunk_inter_portable{half}_d{self.cfg.head_dim}"

    def kda_chunk_inter(self, stream: int, qg: DevicePtr, kd: DevicePtr, gl: DevicePtr,
                        w: DevicePtr, u: DevicePtr, aqk: DevicePtr, state: DevicePtr,
                        core: DevicePtr, t: int, segs: SegmentTable | None = None) -> None:
        """The walk: the sequential pass over the chunks from kda_chunk_intra's operands,
        carrying state [H, Dv, Dk] fp32 (read, then written back) and writing core
        [t, H, D] rows < t. A block carries `walk_rows` rows of a head's state: one warpgroup
        on warpgroup MMAs (the Hopper walk), or portable_walk_split warps per 16 rows on
        mma.sync (the portable walk), as `self.core` says. With `segs` each segment walks its
        chunks from state [slots, H, Dv, Dk] at its slot (zero without initial state), writes
        the state back there and to its checkpoints' slots, and its core rows at its packed
        rows."""
        c = self.cfg
        D, H = c.head_dim, c.num_heads
        table, n, _ = self._segments(t, segs)
        # segments share a block's walk in turn: as many blocks as one wave holds (a block an
        # SM), each a stream of chunks, where more would wait for a second wave
        rows = self.walk_rows
        z = self._walk_depth(n)
        family, threads = (("chunk_portable", portable_walk_threads(self.cc, rows))
                           if self.core == "portable"
                           else ("chunk", WALK_THREADS))
        self._launch(family, self.chunk_inter_name,
                     LaunchConfig((H, D // rows, z), (threads, 1, 1)),
                     (qg, kd, gl, w, u, aqk, state, core, table, i32(n), i32(t), i32(H)), stream)

    def _walk_depth(self, nseg: int) -> int:
        """The walk's blocks a (head, slice) for nseg segments, each taking a share of them:
        as many as one wave holds (a block an SM), where more would wait for a second wave."""
        blocks = self.cfg.num_heads * self.cfg.head_dim // self.walk_rows  # a segment's
        return min(nseg, max(1, self.gpu.sm_count // blocks))

    # -- output ----------------------------------------------------------------------------
    def gated_rmsnorm(self, stream: int, core: DevicePtr, out_gate: DevicePtr, w: DevicePtr,
                      out: DevicePtr, t: int) -> None:
        """core [t, H, D] fp32 -> out [t, qkv] bf16 = RMSNorm_D(core) * w * sigmoid(out_gate)."""
        c = self.cfg
        vectors = _blocks(t * c.num_heads, THREADS // 32)  # blocks of a warp a vector
        cfg = LaunchConfig((min(self.gpu.sm_count * NORM_BLOCKS_PER_SM, vectors), 1, 1),
                           (THREADS, 1, 1))  # at most one wave, grid-stride
        self._launch("norm", "gated_rmsnorm", cfg,
                     (core, out_gate, w, out, i32(t), i32(c.num_heads), i32(c.head_dim),
                      f32(c.rms_norm_eps)), stream)

    # -- tensor parallel ---------------------------------------------------------------------
    def tp_accumulate(self, stream: int, x: DevicePtr, acc: DevicePtr, n: int,
                      first: bool) -> None:
        """acc[n] fp32 = x[n] bf16 widened (first) or acc + x: one rank's partial final_out
        added to the group's fp32 sum."""
        self._tp_check("tp_accumulate", n)
        self._launch("reduce", "tp_accumulate", _cfg1d(n // 8), (x, acc, i64(n), i32(first)),
                     stream)

    def tp_round(self, stream: int, acc: DevicePtr, y: DevicePtr, n: int) -> None:
        """y[n] bf16 = acc[n] fp32 rounded to nearest even: the group's sum, rounded once."""
        self._tp_check("tp_round", n)
        self._launch("reduce", "tp_round", _cfg1d(n // 8), (acc, y, i64(n)), stream)

    @staticmethod
    def _tp_check(name: str, n: int) -> None:
        if n < 8 or n % 8:
            raise KdaError(f"{name}: need a positive multiple of 8 elements, got {n}")
