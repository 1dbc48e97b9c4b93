"""Glm5NextKdaLayer: one bound KDA block and its forward paths.

Each forward path is an ordered table of `Step`s: a launch (or a copy), the kernel it runs and
the buffers it writes. The layer runs the table; the stage recorder sees each written buffer
after its step, and the benchmark times the same table step by step. Every method enqueues on
the given stream and never synchronises the host, so decode can be captured into a CUDA graph;
the result lands in `ws.final_out` and the state is updated in place. With `stage_hook` None
(the default) nothing but the launches runs.
"""

from __future__ import annotations

import functools
import inspect
import re
import reprlib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np

from .backend import DevicePtr, GpuBackend, overlaps
from .config import BUFFER_FIELDS, CHUNK, MAX_DECODE_ROWS, STATE_FIELDS, Glm5NextKdaConfig
from .dtypes import BF16, F32
from .errors import KdaError, check_flags, check_int, check_ints, is_host_sequence
from .kernels import Glm5NextKdaKernels, SegmentTable, segment_table
from .pool import KdaStatePool
from .state import CONV_LAYOUT, RECURRENT_LAYOUT, KdaSeqState, conv_shape, recurrent_shape
from .weights import Glm5NextKdaWeights
from .workspace import SPEC, Glm5NextKdaWorkspace


class Step(NamedTuple):
    """One step of a forward path (a named tuple: decode builds its table every call).
    `writes` names what it leaves, in order: workspace buffers (`core`), one row of a
    per-token buffer (`core[2]`), the carried state (`state.recurrent`, `state.conv`) and the
    state after row r of a multi-row walk (`state.recurrent[r]`). `run(stream)` enqueues it.
    `gemm` marks the projection GEMMs, which the benchmark sums."""
    name: str
    kernel: str
    writes: tuple[str, ...]
    run: Callable[[int], None]
    gemm: bool = False


@dataclass(frozen=True)
class SeqRows:
    """Where each sequence of a batched call sits in the row buffers: sequence `ids[i]` (its
    index in the caller's batch) has rows `rows[i]` = (start, stop) in the token buffers and
    `padded[i]` in those numbered by chunks (`BufferSpec.padded`: a packed prefill starts
    each sequence at its own chunk)."""
    ids: tuple[int, ...]
    rows: tuple[tuple[int, int], ...]
    padded: tuple[tuple[int, int], ...]

    @staticmethod
    @functools.cache  # built once a shape: batched decode asks every call
    def uniform(b: int, k: int) -> "SeqRows":
        """b sequences of k rows each, one after the other in every buffer (batched decode)."""
        r = tuple((i * k, (i + 1) * k) for i in range(b))
        return SeqRows(tuple(range(b)), r, r)


@dataclass(frozen=True)
class Stage:
    """One buffer as a step left it: `shape` rows at `ptr`, of which the first `valid_rows`
    (along axis `row_axis`) belong to the run; the rest is padding. In a batched call
    sequence `seq_ids[i]` has rows `seq_rows[i]` = (start, stop) along `row_axis`."""
    name: str
    kernel: str
    ptr: DevicePtr
    shape: tuple[int, ...]
    dtype: np.dtype
    valid_rows: int
    row_axis: int = 0
    layout: str = ""  # the axes, row-major, e.g. "[T_pad, H, D]"
    seq_rows: tuple[tuple[int, int], ...] = ()
    seq_ids: tuple[int, ...] = ()  # the sequences seq_rows belong to


StageHook = Callable[[Stage, GpuBackend, int], None]
_WRITE = re.compile(r"(state\.)?(\w+)(?:\[(\d+)\])?")


def _check_state(state: object, what: str) -> None:
    if not isinstance(state, KdaSeqState):
        raise KdaError(f"{what}: the state must be a KdaSeqState, got {type(state).__name__}")


def _check_rows(gpu: GpuBackend, ptr: DevicePtr, what: str) -> None:
    """`ptr` (hidden or out rows, bf16) a device pointer, and not an upload of elements of
    another size (`GpuBackend.check_itemsize`)."""
    DevicePtr.check(ptr, what)
    gpu.check_itemsize(ptr, BF16, what)


def _callable_with(fn: object, n: int) -> bool:
    """Whether fn can be called with n positional arguments (a callable whose signature
    Python cannot read is taken as able)."""
    if not callable(fn):
        return False
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError:
        return False
    except ValueError:
        pass
    return True


def _check_out_apart(out: DevicePtr, hidden: DevicePtr, nbytes: int,
                     ws: Glm5NextKdaWorkspace, states: Sequence[tuple[DevicePtr, int]],
                     whose: str, what: str) -> None:
    """A windowed call's `out` (nbytes, as hidden's) is `hidden` itself (in place) or lies
    apart from it: a window's rows copied to an out that starts inside hidden would overwrite
    rows a later window reads. And it lies outside what the windows write: the workspace
    (final_out among its buffers, over the rows copied there) and the states' regions
    `states` (`whose`: the state's own buffers, the state pool's slots)."""
    if out != hidden and overlaps(out, nbytes, hidden, nbytes):
        raise KdaError(f"{what}: out {out!r} overlaps hidden {hidden!r} ({nbytes} bytes each) "
                       f"without being it: a window's output would overwrite input rows a "
                       f"later window reads; pass hidden itself (in place) or a buffer apart")
    if name := ws.overlapping(out, nbytes):
        raise KdaError(f"{what}: out {out!r} overlaps the workspace's {name}, which every "
                       f"window writes: an earlier window's rows copied there would be "
                       f"overwritten; pass a buffer of its own")
    if any(overlaps(out, nbytes, buf, n) for buf, n in states):
        raise KdaError(f"{what}: out {out!r} overlaps {whose}")


@functools.cache
def _rows_writes(row: int, n: int, nsnap: int) -> tuple[str, ...]:
    """What decode's walk over rows [row, row+n) writes: each row's outputs, and the states
    after the first nsnap rows and after the last (cached: decode asks every call)."""
    writes: list[str] = []
    for r in range(row, row + n):
        writes += [f"conv_out[{r}]", f"core[{r}]", f"o_norm_out[{r}]"]
        if r - row < nsnap or r == row + n - 1:
            writes += [f"state.recurrent[{r}]", f"state.conv[{r}]"]
    return tuple(writes)


class Glm5NextKdaLayer:
    """One KDA block: `layer_idx` is the 0-based index in the checkpoint's stack."""

    def __init__(self, layer_idx: int, cfg: Glm5NextKdaConfig, weights: Glm5NextKdaWeights,
                 kernels: Glm5NextKdaKernels):
        if kernels.cfg != cfg:
            raise KdaError(f"layer {layer_idx}: kernels were bound for a different config")
        if not isinstance(weights, Glm5NextKdaWeights):
            raise KdaError(f"layer {layer_idx}: the weights must be a Glm5NextKdaWeights, got "
                           f"{type(weights).__name__}")
        diff = cfg.mismatch(weights.cfg, BUFFER_FIELDS)  # the fields device_layout reads
        if diff:
            raise KdaError(f"layer {layer_idx}: the weights were uploaded for a config of "
                           f"{diff} as this layer's")
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.weights = weights
        self.kernels = kernels
        self.stage_hook = None

    @property
    def stage_hook(self) -> StageHook | None:
        """Called as hook(stage, gpu, stream) with each public buffer a step writes, right
        after the step (`kdarun.stages`); None: no hook."""
        return self._stage_hook

    @stage_hook.setter
    def stage_hook(self, hook: StageHook | None) -> None:
        if hook is not None and not _callable_with(hook, 3):
            raise KdaError(f"layer {self.layer_idx}: stage_hook must be callable as "
                           f"hook(stage, gpu, stream), or None; got {hook!r}")
        self._stage_hook = hook

    # -- running a table -----------------------------------------------------------------
    def run_steps(self, gpu: GpuBackend, steps: Sequence[Step], t: int,
                  state: KdaSeqState | None, ws: Glm5NextKdaWorkspace, stream: int,
                  seqs: SeqRows | None = None) -> None:
        """Enqueue `steps` in order for a call of t rows (`state` None where no step touches
        it; `seqs` where each sequence's rows are in a batched call); the stage hook, if any,
        sees each public buffer a step writes right after it. The workspace and the state
        are checked to fit this layer before any step runs."""
        self.check_fits(ws, state)
        for step in steps:
            step.run(stream)
            if self.stage_hook is not None:
                for name in step.writes:
                    stage = self._stage(name, step.kernel, t, state, ws, seqs)
                    if stage is not None:
                        self._call_hook(stage, gpu, stream, step.name)

    def _call_hook(self, stage: Stage, gpu: GpuBackend, stream: int, step: str) -> None:
        """The stage hook on one stage; what it raises comes back as a KdaError saying that
        the call stopped after step `step`, so its states hold a part of it."""
        try:
            self.stage_hook(stage, gpu, stream)
        except Exception as e:
            raise KdaError(f"layer {self.layer_idx}: the stage hook raised at stage "
                           f"{stage.name} ({type(e).__name__}: {e}); the call stopped after "
                           f"its {step} step, so the states it took hold a part of the call "
                           f"(the steps before): restore them before using them again") from e

    def check_fits(self, ws: Glm5NextKdaWorkspace, state: KdaSeqState | None = None,
                   pool: KdaStatePool | None = None, needs_pool: bool = False) -> None:
        """A KdaError unless `ws` (a Glm5NextKdaWorkspace), `state` (a KdaSeqState) and `pool`
        (a KdaStatePool; required where `needs_pool`), where given, were made for a config of
        this layer's shapes (`config.BUFFER_FIELDS`, `STATE_FIELDS`): another's would be read
        and written past its ends."""
        for name, obj, cls, fields in (("workspace", ws, Glm5NextKdaWorkspace, BUFFER_FIELDS),
                                       ("state", state, KdaSeqState, STATE_FIELDS),
                                       ("state pool", pool, KdaStatePool, STATE_FIELDS)):
            if obj is None and name != "workspace" and not (name == "state pool" and needs_pool):
                continue
            if not isinstance(obj, cls):
                raise KdaError(f"layer {self.layer_idx}: the {name} must be a {cls.__name__}, "
                               f"got {type(obj).__name__}")
            diff = None if obj.cfg is self.cfg else self.cfg.mismatch(obj.cfg, fields)
            if diff:
                raise KdaError(f"layer {self.layer_idx}: the {name} was made for a config of "
                               f"{diff} as this layer's")

    def check_snapshots(self, k: int, snapshots: Sequence[tuple[DevicePtr, DevicePtr]],
                        state: KdaSeqState, what: str) -> list[tuple[DevicePtr, DevicePtr]]:
        """decode_k's snapshot targets as a list, checked before anything runs: none or k-1
        pairs (recurrent, conv) of device pointers, none of them inside the state's own
        buffers (the state would be overwritten by an earlier row's). `state` is a
        KdaSeqState (the caller checked)."""
        if isinstance(snapshots, (str, bytes)) or not hasattr(snapshots, "__len__"):
            raise KdaError(f"{what} snapshots must be a list of (recurrent, conv) device "
                           f"pointer pairs, got {snapshots!r}")
        snapshots = list(snapshots)
        if len(snapshots) not in (0, k - 1):
            raise KdaError(f"{what} pass k-1 = {k - 1} snapshots or none, got {len(snapshots)}")
        own = [(state.recurrent, state.recurrent_nbytes), (state.conv, state.conv_nbytes)]
        taken: list[tuple[DevicePtr, int, int]] = []  # the snapshots' regions so far, and whose
        for i, pair in enumerate(snapshots):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
                    isinstance(p, DevicePtr) and not p.is_null for p in pair)):
                raise KdaError(f"{what} snapshot {i} must be a (recurrent, conv) pair of device "
                               f"pointers, got {pair!r}")
            for p, n in zip(pair, (state.recurrent_nbytes, state.conv_nbytes)):
                self.kernels.gpu.check_region(p, n, f"{what} snapshot {i}")
                if any(overlaps(p, n, a, m) for a, m in own):
                    raise KdaError(f"{what} snapshot {i} ({p!r}) lies in the state's own "
                                   f"buffers, which the last row writes")
                for a, m, j in taken:
                    if overlaps(p, n, a, m):
                        whose = "its own recurrent target" if j == i else f"snapshot {j}'s"
                        raise KdaError(f"{what} snapshot {i} ({p!r}, {n} bytes) overlaps "
                                       f"{whose} ({a!r}, {m} bytes): one state would "
                                       f"overwrite another")
                taken.append((p, n, i))
        return snapshots

    def _stage(self, name: str, kernel: str, t: int, state: KdaSeqState | None,
               ws: Glm5NextKdaWorkspace, seqs: SeqRows | None = None) -> Stage | None:
        """The buffer a `Step.writes` name denotes in a call of t rows; None for private
        scratch, which stage dumps do not show, and for a state with no `state` (a batched
        call's states are in its pool, which its caller reads)."""
        is_state, base, row = _WRITE.fullmatch(name).groups()
        cfg = self.cfg
        if is_state and state is None:
            return None
        if is_state:
            shape, dtype, layout, valid = ((recurrent_shape(cfg), F32, RECURRENT_LAYOUT,
                                            cfg.num_heads) if base == "recurrent" else
                                           (conv_shape(cfg), BF16, CONV_LAYOUT,
                                            cfg.conv_kernel - 1))
            ptr = state.recurrent if base == "recurrent" else state.conv
            if row is not None and int(row) < t - 1:  # a row before the walk's last: a snapshot
                snap = "snap_rec" if base == "recurrent" else "snap_conv"
                ptr = ws.ptr(snap) + int(row) * int(np.prod(shape)) * dtype.itemsize
            return Stage(name, kernel, ptr, shape, dtype, valid, 0, layout)
        spec = SPEC[base]
        if not spec.public:
            return None
        shape, ptr = ws.shape(base, t), ws.ptr(base)
        if seqs is not None and spec.padded:  # a packed call's chunks may pad each sequence
            shape = spec.shape(cfg, t, max(stop for _, stop in seqs.padded))
        if row is not None:  # one row of a per-token buffer
            r = int(row)
            ptr += r * int(np.prod(shape[1:])) * spec.dtype.itemsize
            return Stage(name, kernel, ptr, (1,) + shape[1:], spec.dtype, 1, 0, spec.layout)
        axis = 1 if base == "qkv_parts" else 0
        groups = () if seqs is None else seqs.padded if spec.padded else seqs.rows
        return Stage(name, kernel, ptr, shape, spec.dtype, min(t, shape[axis]), axis,
                     spec.layout, groups, () if seqs is None else seqs.ids)

    # -- decode ----------------------------------------------------------------------------
    def _front_end_step(self, hidden: DevicePtr, t: int, ws: Glm5NextKdaWorkspace) -> Step:
        w = self.weights
        return Step("front_end", "front_end_gemv",
                    ("gate_in", "qkv_parts", "qkv_proj", "g_raw", "out_gate", "gate", "beta"),
                    lambda s: self.kernels.front_end_gemv(
                        s, w.w_in, hidden, ws.ptr("gate_in"), ws.qkv_parts, ws.qkv_proj, w.f_b,
                        w.g_b, w.a_log, w.dt_bias, ws.g_raw, ws.out_gate, ws.gate, ws.beta,
                        ws.ptr("front_sync"), t))

    def _rows_step(self, row: int, n: int, state: KdaSeqState, ws: Glm5NextKdaWorkspace,
                   nsnap: int, after_front_end: bool) -> Step:
        """Rows [row, row+n) of the front end's rows walked token by token in one launch; the
        states after the first nsnap rows land in the workspace's snapshot scratch. Right
        after the front end the launch may overlap it (it reads the states early); after
        anything else (`stateful_row`: maybe another walk of the same state) it may not."""
        c = self.cfg
        cd, hd, f = c.conv_dim * BF16.itemsize, c.qkv * BF16.itemsize, c.qkv * F32.itemsize
        return Step("decode_rows", f"kda_decode_rows_d{c.head_dim}", _rows_writes(row, n, nsnap),
                    lambda s: self.kernels.kda_decode_rows(
                        s, ws.qkv_proj + row * cd, state.conv, self.weights.conv_w,
                        ws.conv_out + row * cd, ws.gate + row * f,
                        ws.beta + row * c.num_heads * F32.itemsize, state.recurrent,
                        ws.core + row * f, ws.out_gate + row * hd, self.weights.o_norm,
                        ws.o_norm_out + row * hd, ws.ptr("snap_rec"), ws.ptr("snap_conv"),
                        ws.ptr("decode_sync"), n, nsnap, after_front_end))

    def _o_proj_step(self, t: int, ws: Glm5NextKdaWorkspace) -> Step:
        c = self.cfg
        return Step("o_proj", "dense_gemv_bf16", ("final_out",),
                    lambda s: self.kernels.dense_gemv_bf16_batchm(
                        s, self.weights.o_proj, ws.o_norm_out, ws.final_out, c.hidden_size,
                        c.qkv, t, ws.ptr("dense_part"), ws.ptr("dense_sync")))

    def decode_steps(self, hidden: DevicePtr, k: int, state: KdaSeqState,
                     ws: Glm5NextKdaWorkspace,
                     snapshots: Sequence[tuple[DevicePtr, DevicePtr]] = ()) -> list[Step]:
        """decode (k = 1) or decode_k's steps over hidden [k, hidden] bf16: the front end, the
        stateful walk over the k rows, the snapshots' copies (when given), o_proj."""
        nsnap = k - 1 if snapshots or self.stage_hook is not None else 0
        steps = [self._front_end_step(hidden, k, ws),
                 self._rows_step(0, k, state, ws, nsnap, after_front_end=True)]
        if snapshots:
            steps.append(Step("snapshots", "copy_d2d", (),
                              lambda s: self._copy_snapshots(state, ws, snapshots, s)))
        return steps + [self._o_proj_step(k, ws)]

    def _copy_snapshots(self, state: KdaSeqState, ws: Glm5NextKdaWorkspace,
                        snapshots: Sequence[tuple[DevicePtr, DevicePtr]], stream: int) -> None:
        gpu, rec, conv = self.kernels.gpu, state.recurrent_nbytes, state.conv_nbytes
        for i, (h_dst, conv_dst) in enumerate(snapshots):
            gpu.copy_d2d(h_dst, ws.ptr("snap_rec") + i * rec, rec, stream)
            gpu.copy_d2d(conv_dst, ws.ptr("snap_conv") + i * conv, conv, stream)

    def front_end(self, gpu: GpuBackend, hidden: DevicePtr, t: int, ws: Glm5NextKdaWorkspace,
                  stream: int) -> None:
        """The weight-heavy, stateless half of decode over t rows of hidden [t, hidden] bf16,
        one launch: the packed q|k|v|f_a|g_a|b GEMV (writing qkv_parts and qkv_proj too), the
        low-rank gates with the forget gate, and beta."""
        t = check_int(t, "front_end: t", 1)
        _check_rows(gpu, hidden, "front_end: hidden")
        self.check_fits(ws)
        ws.check_tokens(t, "front_end")
        self.run_steps(gpu, [self._front_end_step(hidden, t, ws)], t, None, ws, stream)

    def stateful_row(self, gpu: GpuBackend, row: int, state: KdaSeqState,
                     ws: Glm5NextKdaWorkspace, stream: int) -> None:
        """Token `row` of the front end's rows, one launch: conv (+SiLU+L2) rolling the conv
        state, the recurrent step updating the state in place, and the gated RMSNorm."""
        row = check_int(row, "stateful_row: row", 0)
        _check_state(state, "stateful_row")
        self.check_fits(ws, state)
        ws.check_tokens(row + 1, "stateful_row: row + 1")
        self.run_steps(gpu, [self._rows_step(row, 1, state, ws, 0, after_front_end=False)],
                       row + 1, state, ws, stream)

    def back_end(self, gpu: GpuBackend, t: int, ws: Glm5NextKdaWorkspace, stream: int) -> None:
        """o_proj over the t rows the stateful walk normalised: ws.o_norm_out ->
        ws.final_out [t, hidden] bf16."""
        t = check_int(t, "back_end: t", 1)
        self.check_fits(ws)
        ws.check_tokens(t, "back_end")
        self.run_steps(gpu, [self._o_proj_step(t, ws)], t, None, ws, stream)

    def decode(self, gpu: GpuBackend, hidden: DevicePtr, state: KdaSeqState,
               ws: Glm5NextKdaWorkspace, stream: int) -> None:
        """Single-token decode, carrying both states: front end, stateful row, back end. The
        row's conv fuses SiLU and L2, so q/k reach the recurrent step already normalised."""
        _check_rows(gpu, hidden, "decode: hidden")
        _check_state(state, "decode")
        self.run_steps(gpu, self.decode_steps(hidden, 1, state, ws), 1, state, ws, stream)

    def decode_k(self, gpu: GpuBackend, hidden: DevicePtr, k: int, state: KdaSeqState,
                 ws: Glm5NextKdaWorkspace, snapshots: Sequence[tuple[DevicePtr, DevicePtr]],
                 stream: int) -> None:
        """K tokens of one sequence (speculative verify): projections batched once over the
        K rows, the recurrence walked one row at a time exactly as `decode` does, so the
        result is bit-identical to K serial decodes. The K-row walk is one launch that keeps
        the state on chip between rows. `snapshots[t] = (h_dst, conv_dst)` receives the state
        after row t; pass k-1 of them or none."""
        k = check_int(k, "decode_k: k", 1, MAX_DECODE_ROWS)
        _check_rows(gpu, hidden, "decode_k: hidden")
        _check_state(state, "decode_k")
        ws.check_tokens(k, "decode_k")
        snapshots = self.check_snapshots(k, snapshots, state, "decode_k:")
        self.run_steps(gpu, self.decode_steps(hidden, k, state, ws, snapshots), k, state, ws,
                       stream)

    # -- many sequences a call (serving) -------------------------------------------------------
    def batch_steps(self, hidden: DevicePtr, b: int, k: int, slots: DevicePtr,
                    pool: KdaStatePool, ws: Glm5NextKdaWorkspace,
                    snapshot_slots: DevicePtr | None = None) -> list[Step]:
        """b sequences of k rows each over hidden [b*k, hidden] bf16 (sequence-major), their
        states in `pool` at the device slot table slots [b] int32 (-1: a padding row): the
        front end over all rows (every weight read once a slab of up to 64 rows), every
        sequence's stateful walk in one launch, o_proj over all rows. With snapshot_slots
        [b, k-1] int32 the state after row r of sequence i goes to pool slot
        snapshot_slots[i, r] (-1: skipped)."""
        c, w, rows = self.cfg, self.weights, b * k
        return [self._front_end_step(hidden, rows, ws),
                Step("decode_rows", self.kernels.batch_rows_kernel(b, k),
                     ("conv_out", "core", "o_norm_out"),
                     lambda s: self.kernels.kda_decode_batch(
                         s, ws.qkv_proj, pool.conv, w.conv_w, ws.conv_out, ws.gate, ws.beta,
                         pool.recurrent, ws.core, ws.out_gate, w.o_norm, ws.o_norm_out, slots,
                         snapshot_slots, pool.slots, pool.faults, ws.ptr("decode_sync"), b, k)),
                self._o_proj_step(rows, ws)]

    def check_batch(self, gpu: GpuBackend, what: str, hidden: DevicePtr, b: int, k: int,
                    slots: DevicePtr, pool: KdaStatePool, ws: Glm5NextKdaWorkspace,
                    snapshot_slots: DevicePtr | None = None) -> None:
        """A batched call's arguments, before anything runs: the counts, the workspace and
        pool against this layer, the pointers (and their extents where the backend knows
        them: `GpuBackend.check_region`), and, on a backend where reading them costs nothing
        (`GpuBackend.reads_tables_free`: the host), the tables themselves
        (`KdaStatePool.check_tables`); the CUDA kernels keep an entry outside the pool from it
        and record it (`KdaStatePool.check_faults`)."""
        b = check_int(b, f"{what}: the batch", 1)
        k = check_int(k, f"{what}: k", 1, MAX_DECODE_ROWS)
        self.check_fits(ws, pool=pool, needs_pool=True)
        ws.check_tokens(b * k, what)
        _check_rows(gpu, hidden, f"{what}: hidden")
        gpu.check_region(hidden, b * k * self.cfg.hidden_size * BF16.itemsize, f"{what}: hidden")
        if gpu.reads_tables_free:  # the pointers, then the entries
            pool.check_tables(slots, b, snapshot_slots, k, what=what)
        else:
            pool.check_table_pointers(slots, b, snapshot_slots, k, what)

    def decode_batch(self, gpu: GpuBackend, hidden: DevicePtr, b: int, slots: DevicePtr,
                     pool: KdaStatePool, ws: Glm5NextKdaWorkspace, stream: int) -> None:
        """One token for each of b sequences: hidden [b, hidden] bf16 -> ws.final_out [b,
        hidden], sequence i's states read from and written back to pool slot slots[i]. Each
        sequence's outputs and states are bit-identical to `decode` on the same state."""
        self.check_batch(gpu, "decode_batch", hidden, b, 1, slots, pool, ws)
        self.run_steps(gpu, self.batch_steps(hidden, b, 1, slots, pool, ws), b, None, ws, stream,
                       SeqRows.uniform(b, 1))

    def verify_batch(self, gpu: GpuBackend, hidden: DevicePtr, b: int, k: int, slots: DevicePtr,
                     pool: KdaStatePool, ws: Glm5NextKdaWorkspace,
                     snapshot_slots: DevicePtr | None, stream: int) -> None:
        """k draft tokens for each of b sequences (speculative verify): hidden [b*k, hidden]
        bf16, sequence-major -> ws.final_out [b*k, hidden]. Each sequence is bit-identical to
        `decode_k` on the same state; snapshot_slots [b, k-1] int32 (or None) receive the
        state after each row but the last (-1: skipped)."""
        self.check_batch(gpu, "verify_batch", hidden, b, k, slots, pool, ws, snapshot_slots)
        self.run_steps(gpu, self.batch_steps(hidden, b, k, slots, pool, ws, snapshot_slots),
                       b * k, None, ws, stream, SeqRows.uniform(b, k))

    # -- prefill ---------------------------------------------------------------------------
    def prefill_steps(self, hidden: DevicePtr, t: int, state: KdaSeqState,
                      ws: Glm5NextKdaWorkspace, pad_fill: float = 0.0) -> list[Step]:
        """One prefill over t tokens of hidden [t, hidden] bf16, step by step. q|k|v go
        straight into qkv_proj, where the conv reads them: a second GEMM for the few hundred
        gate_in columns re-reads hidden, but the conv copies no q|k|v."""
        return self._prefill_steps(hidden, t, state.conv, state.recurrent, ws, pad_fill, None)

    def packed_steps(self, hidden: DevicePtr, t: int, pool: KdaStatePool,
                     ws: Glm5NextKdaWorkspace, segs: SegmentTable) -> list[Step]:
        """prefill's steps over t packed rows of hidden [t, hidden] bf16 holding the segments
        of the device table `segs` (kernels.segment_table), their states in `pool`: the GEMMs,
        the norm and o_proj run over the t packed rows; the conv and the chunk kernels over
        the segments' chunks, each reading only its segment's tokens."""
        return self._prefill_steps(hidden, t, pool.conv, pool.recurrent, ws, 0.0, segs)

    def _conv(self, stream: int, ws: Glm5NextKdaWorkspace, conv_state: DevicePtr, t: int,
              pad_fill: float, segs: SegmentTable | None) -> None:
        """The conv step: conv_out (which the chunk kernels read) and, only when a stage hook
        will read them, the stages' copies no kernel reads, qkv_parts and q/k/v_f32 (padded
        rows pad_fill; prefill_stage_copies, which the step's kernel label names since only a
        stage report shows it)."""
        kn = self.kernels
        kn.prefill_conv_qkv(stream, ws.qkv_proj, conv_state, self.weights.conv_w, ws.conv_out,
                            t, segs)
        if self.stage_hook is not None:
            kn.prefill_stage_copies(stream, ws.qkv_proj, ws.conv_out, ws.qkv_parts, ws.q_f32,
                                    ws.k_f32, ws.v_f32, t, pad_fill, segs)

    def _intra(self, stream: int, ws: Glm5NextKdaWorkspace, b_raw: DevicePtr,
               chunk: tuple[DevicePtr, ...], t: int, pad_fill: float,
               segs: SegmentTable | None, split: int | None) -> None:
        """The chunk_intra step: the chunk's operands (of the chunks before `split`, where
        `core_split` gave one), from conv_out, g_raw and b_raw, and, only when a stage hook
        will read them, the decay and beta it formed on the way, from kda_gate_beta (the same
        formula: gate.cuh) into gate and beta, padded rows pad_fill. No kernel reads those
        two, so without a hook nothing would."""
        c, w, kn = self.cfg, self.weights, self.kernels
        if self.stage_hook is not None:
            kn.kda_gate_beta(stream, ws.g_raw, b_raw, c.gate_in_width, w.a_log, w.dt_bias,
                             ws.gate, ws.beta, t, segs, pad_fill)
        kn.kda_chunk_intra(stream, ws.conv_out, ws.g_raw, b_raw, c.gate_in_width, w.a_log,
                           w.dt_bias, *chunk, t, segs, split)

    def _walk(self, stream: int, ws: Glm5NextKdaWorkspace, b_raw: DevicePtr,
              chunk: tuple[DevicePtr, ...], rec_state: DevicePtr, t: int,
              segs: SegmentTable | None, split: int | None) -> None:
        """The chunk_inter step: the walk, or, where `core_split` gave `split`, the walk with
        the intra blocks of the chunks from there beside it (kda_chunk_core; the chunk_intra
        step ran the rest)."""
        c, w, kn = self.cfg, self.weights, self.kernels
        if split is None:
            kn.kda_chunk_inter(stream, *chunk, rec_state, ws.core, t, segs)
        else:
            kn.kda_chunk_core(stream, ws.conv_out, ws.g_raw, b_raw, c.gate_in_width, w.a_log,
                              w.dt_bias, *chunk, rec_state, ws.core, ws.ptr("chunk_ready"),
                              split, t, segs)

    def core_apart(self, ws: Glm5NextKdaWorkspace, rec_state: DevicePtr, t: int,
                   kernels: Glm5NextKdaKernels | None = None
                   ) -> tuple[Callable[[int], None], Callable[[int], None]]:
        """The chunked core of a prefill of t rows as two launches one after the other, each a
        function of a stream, for timing them apart: the whole intra kernel (on the inputs the
        last prefill left in `ws`) and the walk from rec_state, on `kernels` (default the
        layer's; another core's walk reads the same operands)."""
        kn = kernels or self.kernels
        b_raw, chunk = self._core_operands(ws)
        return (lambda s: self._intra(s, ws, b_raw, chunk, t, 0.0, None, None),
                lambda s: kn.kda_chunk_inter(s, *chunk, rec_state, ws.core, t))

    def _core_operands(self, ws: Glm5NextKdaWorkspace) -> tuple[DevicePtr, tuple[DevicePtr, ...]]:
        """What the chunk steps read besides conv_out and g_raw, and hand each other: gate_in's
        b columns and the chunk_* buffers, qg, kd, gl, w, u, aqk."""
        return (self._gate_in_part(ws, "b"),
                tuple(ws.ptr(f"chunk_{n}") for n in ("qg", "kd", "gl", "w", "u", "aqk")))

    def _gate_in_part(self, ws: Glm5NextKdaWorkspace, part: str) -> DevicePtr:
        """gate_in's first column of `part` (f_a, g_a or b; bf16, row stride gate_in_width)."""
        return ws.ptr("gate_in") + self.cfg.gate_in_col(part) * BF16.itemsize

    def _prefill_steps(self, hidden: DevicePtr, t: int, conv_state: DevicePtr,
                       rec_state: DevicePtr, ws: Glm5NextKdaWorkspace, pad_fill: float,
                       segs: SegmentTable | None) -> list[Step]:
        c, w, kn = self.cfg, self.weights, self.kernels
        # a plain prefill's states are the caller's; a packed one's, the pool's slots
        state_writes = (("state.conv",), ("state.recurrent",)) if segs is None else ((), ())
        gate_in = ws.ptr("gate_in")
        f_a, g_a = (self._gate_in_part(ws, p) for p in ("f_a", "g_a"))
        w_gate_in = w.w_in + c.conv_dim * c.hidden_size * BF16.itemsize  # w_in's f_a|g_a|b rows
        b_raw, chunk = self._core_operands(ws)
        split = kn.core_split(t, segs)  # one decision for both chunk steps
        return [
            Step("qkv_gemm", "gemm_bf16", ("qkv_proj",),
                 lambda s: kn.gemm_bf16(s, hidden, c.hidden_size, w.w_in, ws.qkv_proj,
                                        c.conv_dim, t, c.conv_dim, c.hidden_size), gemm=True),
            Step("gate_in_gemm", "gemm_bf16", ("gate_in",),
                 lambda s: kn.gemm_bf16(s, hidden, c.hidden_size, w_gate_in, gate_in,
                                        c.gate_in_width, t, c.gate_in_rows, c.hidden_size),
                 gemm=True),
            Step("f_b_gemm", "gemm_bf16", ("g_raw",),
                 lambda s: kn.gemm_bf16(s, f_a, c.gate_in_width, w.f_b, ws.g_raw, c.qkv, t,
                                        c.qkv, c.rank), gemm=True),
            Step("g_b_gemm", "gemm_bf16", ("out_gate",),
                 lambda s: kn.gemm_bf16(s, g_a, c.gate_in_width, w.g_b, ws.out_gate, c.qkv, t,
                                        c.qkv, c.rank), gemm=True),
            Step("conv", f"{kn.prefill_conv_name}, conv_roll_state, prefill_stage_copies",
                 ("qkv_parts", "conv_out", "q_f32", "k_f32", "v_f32", *state_writes[0]),
                 lambda s: self._conv(s, ws, conv_state, t, pad_fill, segs)),
            Step("chunk_intra", f"kda_chunk_intra_d{c.head_dim}, kda_gate_beta",
                 ("gate", "beta", *(f"chunk_{n}" for n in ("qg", "kd", "gl", "w", "u", "aqk"))),
                 lambda s: self._intra(s, ws, b_raw, chunk, t, pad_fill, segs, split)),
            Step("chunk_inter", kn.chunk_inter_name if split is None
                 else f"kda_chunk_core_d{c.head_dim}", ("core", *state_writes[1]),
                 lambda s: self._walk(s, ws, b_raw, chunk, rec_state, t, segs, split)),
            Step("rmsnorm", "gated_rmsnorm", ("o_norm_out",),
                 lambda s: kn.gated_rmsnorm(s, ws.core, ws.out_gate, w.o_norm, ws.o_norm_out,
                                            t)),
            Step("o_proj_gemm", "gemm_bf16", ("final_out",),
                 lambda s: kn.gemm_bf16(s, ws.o_norm_out, c.qkv, w.o_proj, ws.final_out,
                                        c.hidden_size, t, c.hidden_size, c.qkv), gemm=True),
        ]

    def prefill(self, gpu: GpuBackend, hidden: DevicePtr, t: int, state: KdaSeqState,
                ws: Glm5NextKdaWorkspace, stream: int) -> None:
        """Chunked prefill over t tokens of hidden [t, hidden] bf16 from the carried state."""
        self.prefill_with_pad_fill(gpu, hidden, t, state, ws, 0.0, stream)

    def prefill_with_pad_fill(self, gpu: GpuBackend, hidden: DevicePtr, t: int,
                              state: KdaSeqState, ws: Glm5NextKdaWorkspace, pad_fill: float,
                              stream: int) -> None:
        """`prefill` with the padded rows of the stage buffers a stage hook has filled (gate,
        beta, q/k/v_f32) written as `pad_fill`. No kernel reads them, so any fill (NaN, 1e30)
        must leave outputs and state unchanged."""
        _check_rows(gpu, hidden, "prefill: hidden")
        _check_state(state, "prefill")
        ws.check_tokens(t, "prefill", " or prefill in windows (kdarun.layer.prefill_windowed)")
        self.run_steps(gpu, self.prefill_steps(hidden, t, state, ws, pad_fill), t, state, ws,
                       stream)


def prefill_windowed(layer: Glm5NextKdaLayer, gpu: GpuBackend, hidden: DevicePtr, t: int,
                     state: KdaSeqState, ws: Glm5NextKdaWorkspace, out: DevicePtr,
                     stream: int) -> None:
    """Prefill a sequence longer than the workspace in windows of `ws.max_tokens()` tokens,
    carrying the state; every window's final_out is copied to out [t, hidden] bf16. `hidden`
    and `out` must hold t rows (the host backend checks it; on a GPU a pointer's size is not
    known)."""
    t = check_int(t, "prefill_windowed: the token count", 1)
    _check_rows(gpu, hidden, "prefill_windowed: hidden")
    _check_rows(gpu, out, "prefill_windowed: out")
    _check_state(state, "prefill_windowed")
    layer.check_fits(ws, state)
    row = layer.cfg.hidden_size * BF16.itemsize
    gpu.check_region(hidden, t * row, "prefill_windowed: hidden")
    gpu.check_region(out, t * row, "prefill_windowed: out")
    _check_out_apart(out, hidden, t * row, ws, ((state.recurrent, state.recurrent_nbytes),
                                                 (state.conv, state.conv_nbytes)),
                     "the state's own buffers", "prefill_windowed")
    for start in range(0, t, ws.max_tokens()):
        n = min(ws.max_tokens(), t - start)
        layer.prefill(gpu, hidden + start * row, n, state, ws, stream)
        gpu.copy_d2d(out + start * row, ws.final_out, n * row, stream)


def _host_rows(value: object, what: str) -> list:
    """`value` (a host sequence of host sequences, or a 2-D array; None for none) as a list of
    its rows, else a KdaError naming `what`."""
    if value is None:
        return []
    if isinstance(value, np.ndarray) and value.ndim == 2:
        return list(value)
    if not is_host_sequence(value) or not all(is_host_sequence(r) for r in value):
        raise KdaError(f"{what} must be a host sequence (list, tuple or 2-D array) of host "
                       f"sequences of slots, one a sequence, got {reprlib.repr(value)}")
    return list(value)


def prefill_packed(layer: Glm5NextKdaLayer, gpu: GpuBackend, hidden: DevicePtr,
                   cu_seqlens: Sequence[int], slots: Sequence[int],
                   has_initial_state: Sequence[bool], pool: KdaStatePool,
                   ws: Glm5NextKdaWorkspace, out: DevicePtr, stream: int,
                   checkpoint_every: int = 0,
                   checkpoint_slots: Sequence[Sequence[int]] | None = None) -> None:
    """Prefill N sequences packed one after the other in hidden [T_total, hidden] bf16:
    sequence i is rows cu_seqlens[i] .. cu_seqlens[i+1] (host ints, N+1 of them, from 0),
    its state pool slot slots[i], which it starts from when has_initial_state[i] and from zero
    otherwise, and where its final state goes. Every sequence's final_out rows go to out
    [T_total, hidden] bf16 at its own rows. With checkpoint_every = n (a multiple of CHUNK, at
    most the workspace's max_tokens) the state after each n tokens of sequence i goes to pool
    slot checkpoint_slots[i][j] (after (j+1) n tokens; -1 skips one), one slot for each whole
    n tokens of it. Slots no sequence names keep their bytes.

    The sequences run together: each is a segment of its own chunks (kernels_cu/segments.cuh),
    so the GEMMs, the norm and o_proj run once over the packed rows and one walk carries every
    segment's state. A pack larger than the workspace runs in windows of up to max_tokens
    rows (and its padded chunks), a sequence longer than a piece (max_tokens rounded down to a
    multiple of checkpoint_every, or of CHUNK) in pieces carrying its state through its slot.
    Each sequence's rows and states are those of `prefill` on it alone, bit for bit, given the
    same GEMM outputs (a GEMM over more rows may round a row differently)."""
    run_pack(layer, gpu, hidden, check_packed(
        layer, gpu, hidden, cu_seqlens, slots, has_initial_state, pool, ws, out, checkpoint_every,
        checkpoint_slots), pool, ws, out, stream)


class Pack(NamedTuple):
    """A packed prefill's arguments as `check_packed` found them: cu_seqlens [N+1] int64, the
    flags [N] bool, the lengths [N], the slots [N] int64, the checkpoint spacing (0: none) and
    the checkpoint slots in sequence order [*] int64."""
    bounds: np.ndarray
    init: np.ndarray
    length: np.ndarray
    slots: np.ndarray
    checkpoint_every: int
    checkpoints: np.ndarray | None


def check_packed(layer: Glm5NextKdaLayer, gpu: GpuBackend, hidden: DevicePtr,
                 cu_seqlens: Sequence[int], slots: Sequence[int],
                 has_initial_state: Sequence[bool], pool: KdaStatePool,
                 ws: Glm5NextKdaWorkspace, out: DevicePtr, checkpoint_every: int = 0,
                 checkpoint_slots: Sequence[Sequence[int]] | None = None) -> Pack:
    """`prefill_packed`'s arguments checked, before anything runs (a tensor parallel group
    checks every rank's so): a KdaError names the first that is wrong."""
    _check_rows(gpu, hidden, "prefill_packed: hidden")
    _check_rows(gpu, out, "prefill_packed: out")
    if not is_host_sequence(slots):  # cu_seqlens' and the flags' checks say so themselves
        raise KdaError(f"prefill_packed: slots must be a host sequence (list, tuple or array), "
                       f"got {slots!r}")
    n_seq = len(slots)
    bounds = check_ints(cu_seqlens, "prefill_packed: cu_seqlens", 0)  # [N+1] int64
    init = check_flags(has_initial_state, "prefill_packed: has_initial_state")  # [N] bool
    checkpoint_every = check_int(checkpoint_every, "prefill_packed: checkpoint_every", 0)
    if checkpoint_slots is not None and not checkpoint_every:
        raise KdaError("prefill_packed: checkpoint_slots given without checkpoint_every; pass "
                       "both, or neither")
    if len(bounds) != n_seq + 1 or len(has_initial_state) != n_seq or n_seq < 1:
        raise KdaError(f"prefill_packed: need N >= 1 slots, N has_initial_state flags and N+1 "
                       f"cu_seqlens; got {n_seq}, {len(has_initial_state)}, {len(bounds)}")
    length = np.diff(bounds)  # [N] tokens a sequence
    if bounds[0] != 0 or length.min() < 1:
        raise KdaError(f"prefill_packed: cu_seqlens must start at 0 and rise by at least 1 a "
                       f"sequence, got {bounds.tolist()}")
    layer.check_fits(ws, pool=pool, needs_pool=True)
    pool.check_slots(slots, "prefill_packed: slots")
    if len(set(slots)) != n_seq:
        raise KdaError(f"prefill_packed: every sequence needs a slot of its own, got {list(slots)}")
    if checkpoint_every:
        if ws.max_tokens() < CHUNK:
            raise KdaError(f"prefill_packed: checkpoints need a workspace of at least {CHUNK} "
                           f"tokens; this one's max_tokens is {ws.max_tokens()}")
        if checkpoint_every % CHUNK or not 0 < checkpoint_every <= ws.max_tokens():
            raise KdaError(f"prefill_packed: checkpoint_every must be a multiple of {CHUNK} in "
                           f"[{CHUNK}, {ws.max_tokens()}] (the workspace's max_tokens), got "
                           f"{checkpoint_every}")
        want = (length // checkpoint_every).tolist()
        ck_rows = _host_rows(checkpoint_slots, "prefill_packed: checkpoint_slots")
        got = [len(c) for c in ck_rows]
        if got != want:
            raise KdaError(f"prefill_packed: checkpoints every {checkpoint_every} tokens need "
                           f"{want} slots a sequence, got {got}")
        flat = [c for cs in ck_rows for c in cs]
        pool.check_slots(flat, "prefill_packed: checkpoint_slots", skip=True)
        named = [c for c in flat if c >= 0]
        taken = set(named) & set(slots)
        if len(set(named)) != len(named) or taken:
            raise KdaError(f"prefill_packed: each checkpoint needs a slot of its own, apart from "
                           f"the sequences' slots (the walks of a pack run at once); "
                           f"{sorted(taken) or 'a checkpoint slot'} named twice in "
                           f"checkpoint_slots {[list(c) for c in ck_rows]} and "
                           f"slots {list(slots)}")
    rows = int(bounds[-1]) * layer.cfg.hidden_size * BF16.itemsize  # bytes of hidden and of out
    gpu.check_region(hidden, rows, "prefill_packed: hidden")
    gpu.check_region(out, rows, "prefill_packed: out")
    _check_out_apart(out, hidden, rows, ws, ((pool.recurrent, pool.slots * pool.recurrent_nbytes),
                                             (pool.conv, pool.slots * pool.conv_nbytes)),
                     "the state pool's slots", "prefill_packed")
    return Pack(bounds, init, length, np.asarray(slots, np.int64), checkpoint_every,
                np.asarray(flat, np.int64) if checkpoint_every else None)


def run_pack(layer: Glm5NextKdaLayer, gpu: GpuBackend, hidden: DevicePtr, pack: Pack,
             pool: KdaStatePool, ws: Glm5NextKdaWorkspace, out: DevicePtr,
             stream: int) -> None:
    """A checked pack (`check_packed`), in windows of pieces."""
    bounds, init, length, slots, checkpoint_every, ck = pack
    n_seq = len(length)
    # Pieces: each sequence cut at multiples of `piece` tokens (a multiple of the checkpoint
    # spacing, or of CHUNK), so a piece's chunks and checkpoints are those of the whole
    # sequence; a piece after the first starts from the state its predecessor left in the slot.
    step = checkpoint_every or min(CHUNK, ws.max_tokens())
    piece = ws.max_tokens() // step * step
    every = checkpoint_every // CHUNK
    # A piece a sequence, unless one is longer than a piece (the plan is host time in which the
    # GPU waits, so the usual pack skips the cutting: docs/perf-log.md, v51-v52)
    seq, p_rows, p_row0 = np.arange(n_seq), length, bounds[:-1]
    p_slot, p_init, later = slots, init, np.zeros(0, np.int64)
    if length.max() > piece:
        count = -(-length // piece)
        seq = np.repeat(seq, count)
        p0 = (np.arange(len(seq)) - np.repeat(np.cumsum(count) - count, count)) * piece
        p_rows = np.minimum(piece, length[seq] - p0)
        p_row0 = p_row0[seq] + p0
        p_slot, p_init = p_slot[seq], init[seq] | (p0 > 0)
        later = np.flatnonzero(p0 > 0)
    ck_at = np.concatenate([[0], np.cumsum(p_rows // checkpoint_every)]) if ck is not None \
        else None
    # Windows: runs of pieces within max_tokens rows and the workspace's padded rows, a
    # sequence's next piece always in the next window
    cum_rows = np.concatenate([[0], np.cumsum(p_rows)])
    cum_pad = np.concatenate([[0], np.cumsum(-(-p_rows // CHUNK) * CHUNK)])
    k, n_pieces = 0, len(seq)
    while k < n_pieces:
        end = int(min(np.searchsorted(cum_rows, cum_rows[k] + ws.max_tokens(), "right") - 1,
                      np.searchsorted(cum_pad, cum_pad[k] + ws.t_pad(), "right") - 1,
                      *later[np.searchsorted(later, k, "right"):][:1], n_pieces))
        w = slice(k, end)
        table, t_pad = segment_table(p_row0[w] - p_row0[k], p_rows[w], p_slot[w], p_init[w],
                                     every, ck[ck_at[k]:ck_at[end]] if ck is not None else None)
        seqs = None
        if layer.stage_hook is not None:  # each piece's rows, for the stage dumps
            r0, pad0 = p_row0[w] - p_row0[k], cum_pad[w] - cum_pad[k]
            seqs = SeqRows(tuple(int(i) for i in seq[w]),
                           tuple((int(a), int(a + n)) for a, n in zip(r0, p_rows[w])),
                           tuple((int(a), int(a + n)) for a, n in zip(pad0, p_rows[w])))
        _run_packed(layer, gpu, hidden, int(p_row0[k]), int(cum_rows[end] - cum_rows[k]),
                    table, end - k, t_pad, pool, ws, out, stream, seqs)
        k = end


def _run_packed(layer: Glm5NextKdaLayer, gpu: GpuBackend, hidden: DevicePtr, start: int,
                rows: int, table: np.ndarray, nseg: int, t_pad: int, pool: KdaStatePool,
                ws: Glm5NextKdaWorkspace, out: DevicePtr, stream: int,
                seqs: SeqRows | None) -> None:
    """One window of a packed prefill: packed rows [start, start + rows) of hidden holding the
    nseg segments of `table` (kernels.segment_table, rows from start) over t_pad padded rows;
    their final_out rows go to out's. `seqs`: where the stage hook finds each sequence."""
    gpu.copy_h2d(ws.ptr("segments"), table, stream)
    segs = SegmentTable(ws.ptr("segments"), nseg, t_pad)
    row = layer.cfg.hidden_size * BF16.itemsize
    layer.run_steps(gpu, layer.packed_steps(hidden + start * row, rows, pool, ws, segs), rows,
                    None, ws, stream, seqs)
    gpu.copy_d2d(out + start * row, ws.final_out, rows * row, stream)
