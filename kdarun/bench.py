"""Benchmarks: CUDA events, warm-up, medians, random data, and the ratio to ceilings
measured in the same run (copy bandwidth, bf16 GEMM rate) and to fla where importable.

Decode walks a stack of `DECODE_LAYERS` distinct layers per step, as a real decode does, so
the weights stream from HBM instead of sitting in L2 between calls.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from . import synthetic
from .backend import DevicePtr, GpuBackend
from .checkpoint import canonical, shard_tensors
from .config import Glm5NextKdaConfig
from .dtypes import BF16, F32
from .kernels import Glm5NextKdaKernels, SegmentTable, segment_table
from .layer import Glm5NextKdaLayer, Step, prefill_packed
from .loader import release_bound
from .pool import KdaStatePool
from .run import random_hidden
from .state import KdaSeqState, recurrent_shape
from .tp import NcclComm, TpGroup
from .weights import Glm5NextKdaWeights
from .workspace import Glm5NextKdaWorkspace

DECODE_LAYERS = 4
FLA_CACHE_TOKENS = 16


def time_once(gpu: GpuBackend, fn: Callable[[], None], stream: int) -> float:
    """Device time of one call of `fn`, bracketed by events; the host waits for the end."""
    a, b = gpu.create_event(), gpu.create_event()
    gpu.record_event(a, stream)
    fn()
    gpu.record_event(b, stream)
    return gpu.elapsed_ms(a, b)


def medians_in_turn(timers: list[Callable[[], float]], reps: int, warmup: int) -> list[float]:
    """The median of each timer (a callable that times one call and returns ms), the timers
    called in turn rep by rep: the GPU's clocks and power drift over a run, and taking turns
    lays that drift on every timer alike, where timing one after the other would not
    (docs/perf-log.md, v10)."""
    for _ in range(warmup):
        for timer in timers:
            timer()
    times: list[list[float]] = [[] for _ in timers]
    for _ in range(reps):
        for timer, ts in zip(timers, times):
            ts.append(timer())
    return [statistics.median(ts) for ts in times]


def median_ms(gpu: GpuBackend, fn: Callable[[], None], stream: int, reps: int,
              warmup: int = 5) -> float:
    """Median over `reps` of the device time of `fn`, each bracketed by events."""
    (ms,) = medians_in_turn([lambda: time_once(gpu, fn, stream)], reps, warmup)
    return ms


@dataclass
class Ceilings:
    copy_gbps: float  # device-to-device copy, bytes read + written per second / 1e9
    gemm_tflops: float  # bf16 GEMM through gemm_bf16, 8192^3
    gemm_max_err: float  # of 4 rows of that product against NumPy; a ceiling from a wrong
    #                      product is no ceiling


def measure_ceilings(gpu: GpuBackend, stream: int) -> Ceilings:
    n = 1 << 30
    a, b = gpu.alloc(n), gpu.alloc(n)
    gpu.memset(a, 0x3C, n, stream)
    ms = median_ms(gpu, lambda: gpu.copy_d2d(b, a, n, stream), stream, 30)
    gpu.free(a), gpu.free(b)
    s = 8192
    rng = np.random.default_rng(0)
    x = gpu.upload(rng.standard_normal((s, s), dtype=np.float32).astype(BF16), stream)
    w = gpu.upload(rng.standard_normal((s, s), dtype=np.float32).astype(BF16), stream)
    c = gpu.alloc(s * s * 2)
    gms = median_ms(gpu, lambda: gpu.gemm_bf16(x, s, w, c, s, s, s, s, stream), stream, 20)
    # the ceiling is only as good as the product it timed: check a few rows of it
    rows = gpu.download(c, (4, s), BF16, stream).astype(np.float32)
    xs = gpu.download(x, (4, s), BF16, stream).astype(np.float32)
    ws_ = gpu.download(w, (s, s), BF16, stream).astype(np.float32)
    err = float(np.abs(rows - xs @ ws_.T).max())
    for p in (x, w, c):
        gpu.free(p)
    return Ceilings(2 * n / ms / 1e6, 2 * s ** 3 / gms / 1e9, err)


def bound_layers(gpu: GpuBackend, cfg: Glm5NextKdaConfig, n: int, seed: int, stream: int):
    kernels = Glm5NextKdaKernels(gpu, cfg)
    rng = np.random.default_rng(seed)
    return [Glm5NextKdaLayer(i, cfg, Glm5NextKdaWeights.upload(
        gpu, cfg, canonical(cfg, synthetic.synth_layer_tensors(cfg, rng)), stream), kernels)
        for i in range(n)]


def random_state(gpu, cfg, rng, stream) -> KdaSeqState:
    s = KdaSeqState(gpu, cfg, stream)
    s.upload((rng.standard_normal(recurrent_shape(cfg), dtype=np.float32) * 0.05),
             rng.standard_normal((cfg.conv_kernel - 1, cfg.conv_dim), dtype=np.float32).astype(BF16),
             stream)
    return s


def random_layer(gpu: GpuBackend, cfg: Glm5NextKdaConfig, rows: int, stream: int,
                 pad_rows: int | None = None
                 ) -> tuple[Glm5NextKdaLayer, Glm5NextKdaWorkspace, KdaSeqState, DevicePtr]:
    """One layer on random weights, a workspace for `rows` tokens (and `pad_rows` padded rows),
    a random state and `rows` random hidden rows [rows, hidden] bf16 on the device: the prefill
    benchmark's set-up, which the profiling tools share so that their figures describe the
    same run."""
    (layer,) = bound_layers(gpu, cfg, 1, 5, stream)
    ws = Glm5NextKdaWorkspace(gpu, cfg, rows, pad_rows)
    state = random_state(gpu, cfg, np.random.default_rng(6), stream)
    h = gpu.upload(random_hidden(rows, cfg.hidden_size, 7), stream)
    return layer, ws, state, h


def _release(gpu: GpuBackend, layers: list[Glm5NextKdaLayer],
             states: Sequence[KdaSeqState | KdaStatePool], ws: Glm5NextKdaWorkspace,
             h: DevicePtr) -> None:
    """Give back what a benchmark allocated: the bound layers (`release_bound`), the states
    (or pools) and the input rows."""
    release_bound(gpu, layers, ws)
    for st in states:
        st.free()
    gpu.free(h)


@dataclass
class DecodeResult:
    preset: str
    mode: str  # decode | decode-k
    k: int
    graph: bool
    us: float  # per layer call
    bytes: int  # per layer call: weights once + state read/written per row
    gbps: float
    frac_copy: float  # of the copy bandwidth measured in the same run
    fla_us: float | None = None
    kernels_us: dict | None = None  # each launch of one layer call, timed from graph replays
    batch: int = 1  # sequences a call (batch-decode, batch-verify)
    tp: int = 1  # tensor parallel ranks (bytes: one rank's)
    tp_mode: str | None = None  # in-turn (us: every rank one after the other) or nccl
    rank_us: float | None = None  # in-turn: one rank's layer calls alone, without the sum


def decode_bytes(cfg: Glm5NextKdaConfig, weights: Glm5NextKdaWeights, k: int,
                 batch: int = 1, snapshots: bool = False) -> int:
    """Fewest bytes one layer call must move: every weight once; per sequence its recurrent
    and conv state read and written (and, with snapshots, written after each of its first
    k-1 rows); per row its hidden row in and out."""
    state = math.prod(recurrent_shape(cfg)) * F32.itemsize
    conv = (cfg.conv_kernel - 1) * cfg.conv_dim * BF16.itemsize
    io = 2 * cfg.hidden_size * BF16.itemsize
    per_seq = 2 * (state + conv) + (k - 1) * (state + conv) * snapshots
    return weights.nbytes + batch * (per_seq + k * io)


def bench_decode(gpu: GpuBackend, preset: str, k: int, graph: bool, ceil: Ceilings,
                 stream: int, reps: int = 200, gate: str | None = None) -> DecodeResult:
    cfg = synthetic.preset_config(preset, gate)
    layers = bound_layers(gpu, cfg, DECODE_LAYERS, 1, stream)
    ws = Glm5NextKdaWorkspace(gpu, cfg, max(k, 1))
    rng = np.random.default_rng(2)
    states = [random_state(gpu, cfg, rng, stream) for _ in layers]
    h = gpu.upload(random_hidden(k, cfg.hidden_size, 3), stream)

    def step() -> None:
        for layer, st in zip(layers, states):
            if k == 1:
                layer.decode(gpu, h, st, ws, stream)
            else:
                layer.decode_k(gpu, h, k, st, ws, (), stream)

    step()
    if graph:
        g = gpu.capture(step, stream)
        fn = lambda: g.replay(stream)  # noqa: E731
    else:
        fn = step
    us = median_ms(gpu, fn, stream, reps) * 1e3 / DECODE_LAYERS
    kernels = step_times(gpu, [layer.decode_steps(h, k, st, ws)
                               for layer, st in zip(layers, states)], stream)
    nbytes = decode_bytes(cfg, layers[0].weights, k)
    gbps = nbytes / us / 1e3
    _release(gpu, layers, states, ws, h)
    return DecodeResult(preset, "decode" if k == 1 else "decode-k", k, graph, us, nbytes, gbps,
                        gbps / ceil.copy_gbps, kernels_us=kernels)


def bench_decode_tp(gpu: GpuBackend, preset: str, k: int, graph: bool, ceil: Ceilings,
                    stream: int, tp_size: int, comm: NcclComm | None = None, reps: int = 200,
                    gate: str | None = None) -> DecodeResult:
    """decode (k = 1) or decode_k of a tensor parallel group of `tp_size` ranks over
    DECODE_LAYERS layers of random weights (each layer's whole tensors drawn, then sharded):
    with `comm`, this process's NCCL rank, the all-reduce inside the timed graph; without,
    every rank in turn on this GPU. In turn, `us` is the ranks' calls one after the other
    plus their sum (it checks the path, it is no group latency) and `rank_us` rank 0's layer
    calls alone: what a rank computes on a GPU of its own, before the all-reduce."""
    cfg = synthetic.preset_config(preset, gate)
    rcfg = cfg.shard(tp_size)
    ranks = [comm.rank] if comm is not None else list(range(tp_size))
    kernels = Glm5NextKdaKernels(gpu, rcfg)
    wss = [Glm5NextKdaWorkspace(gpu, rcfg, k) for _ in ranks]
    rng = np.random.default_rng(1)
    groups = []
    for i in range(DECODE_LAYERS):
        full = canonical(cfg, synthetic.synth_layer_tensors(cfg, rng))
        groups.append(TpGroup(gpu, [(Glm5NextKdaLayer(i, rcfg, Glm5NextKdaWeights.upload(
            gpu, rcfg, shard_tensors(cfg, full, r, tp_size), stream), kernels), ws)
            for r, ws in zip(ranks, wss)], tp_size, comm, k))
    states = [[random_state(gpu, rcfg, rng, stream) for _ in ranks] for _ in groups]
    h = gpu.upload(random_hidden(k, cfg.hidden_size, 3), stream)
    gpu.synchronize(0)  # the workspaces' zeroing ran on the legacy stream, which ours skips

    def step() -> None:
        for group, sts in zip(groups, states):
            if k == 1:
                group.decode(gpu, h, sts, stream)
            else:
                group.decode_k(gpu, h, k, sts, None, stream)

    def rank0() -> None:
        for group, sts in zip(groups, states):
            layer, ws = group.ranks[0]
            if k == 1:
                layer.decode(gpu, h, sts[0], ws, stream)
            else:
                layer.decode_k(gpu, h, k, sts[0], ws, (), stream)

    timed = [step] if comm is not None else [step, rank0]
    fns = []
    for fn in timed:
        fn()
        if graph:
            g = gpu.capture(fn, stream)
            fns.append(lambda g=g: g.replay(stream))
        else:
            fns.append(fn)
    us = [ms * 1e3 / DECODE_LAYERS for ms in medians_in_turn(
        [lambda fn=fn: time_once(gpu, fn, stream) for fn in fns], reps, 5)]
    nbytes = decode_bytes(rcfg, groups[0].ranks[0][0].weights, k)
    gbps = nbytes / (us[0] if comm is not None else us[1]) / 1e3
    for group in groups:
        for layer, _ in group.ranks:
            layer.weights.free(gpu)
        group.free()
    for ws in wss:
        ws.free()
    for st in (s for sts in states for s in sts):
        st.free()
    gpu.free(h)
    return DecodeResult(preset, "decode" if k == 1 else "decode-k", k, graph, us[0], nbytes,
                        gbps, gbps / ceil.copy_gbps, tp=tp_size,
                        tp_mode="nccl" if comm is not None else "in-turn",
                        rank_us=None if comm is not None else us[1])


def bench_decode_rank(gpu: GpuBackend, comm: NcclComm, preset: str, k: int, graph: bool,
                      reps: int) -> DecodeResult:
    """One NCCL rank of `kdarun bench --tp N` (`tp.launch`'s work): its own ceilings, then
    `bench_decode_tp` on its rank."""
    stream = gpu.create_stream()
    try:
        ceil = measure_ceilings(gpu, stream)
        return bench_decode_tp(gpu, preset, k, graph, ceil, stream, comm.size, comm, reps)
    finally:
        gpu.destroy_stream(stream)


@dataclass
class BatchRun:
    """Batched decode's (k = 1) or batched verify's benchmark set-up: DECODE_LAYERS bound
    layers, each with a pool of random states in shuffled slots (the sequences', then their
    snapshots'), a workspace, the slot tables and `batch * k` random hidden rows; `step` is
    one call of every layer in turn, what the benchmark captures and replays."""
    gpu: GpuBackend
    cfg: Glm5NextKdaConfig
    batch: int
    k: int
    stream: int
    layers: list[Glm5NextKdaLayer]
    pools: list[KdaStatePool]
    ws: Glm5NextKdaWorkspace
    slots: DevicePtr
    snaps: DevicePtr | None
    h: DevicePtr

    @classmethod
    def make(cls, gpu: GpuBackend, preset: str, batch: int, k: int, stream: int,
             gate: str | None = None) -> "BatchRun":
        cfg = synthetic.preset_config(preset, gate)
        layers = bound_layers(gpu, cfg, DECODE_LAYERS, 1, stream)
        ws = Glm5NextKdaWorkspace(gpu, cfg, batch * k)
        rng = np.random.default_rng(2)
        nslots = batch * k
        pools = [KdaStatePool(gpu, cfg, nslots, stream) for _ in layers]
        for pool in pools:
            gpu.copy_h2d(pool.recurrent, rng.standard_normal(
                (nslots, *recurrent_shape(cfg)), dtype=np.float32) * 0.05, stream)
        slots = gpu.upload(rng.permutation(batch).astype(np.int32), stream)
        snaps = gpu.upload(batch + rng.permutation(batch * (k - 1)).astype(np.int32), stream) \
            if k > 1 else None
        h = gpu.upload(random_hidden(batch * k, cfg.hidden_size, 3), stream)
        return cls(gpu, cfg, batch, k, stream, layers, pools, ws, slots, snaps, h)

    def step(self) -> None:
        for layer, pool in zip(self.layers, self.pools):
            if self.k == 1:
                layer.decode_batch(self.gpu, self.h, self.batch, self.slots, pool, self.ws,
                                   self.stream)
            else:
                layer.verify_batch(self.gpu, self.h, self.batch, self.k, self.slots, pool,
                                   self.ws, self.snaps, self.stream)

    def release(self) -> None:
        _release(self.gpu, self.layers, self.pools, self.ws, self.h)
        for p in (self.slots, self.snaps):
            if p is not None:
                self.gpu.free(p)


def bench_batch(gpu: GpuBackend, preset: str, batch: int, k: int, ceil: Ceilings, stream: int,
                reps: int = 100, gate: str | None = None) -> DecodeResult:
    """Batched decode (k = 1) or batched verify with snapshots of `batch` sequences, graph
    replays over DECODE_LAYERS layers (`BatchRun`)."""
    run = BatchRun.make(gpu, preset, batch, k, stream, gate)
    run.step()
    g = gpu.capture(run.step, stream)
    us = median_ms(gpu, lambda: g.replay(stream), stream, reps) * 1e3 / DECODE_LAYERS
    kernels = step_times(gpu, [layer.batch_steps(run.h, batch, k, run.slots, pool, run.ws,
                                                 run.snaps)
                               for layer, pool in zip(run.layers, run.pools)], stream)
    nbytes = decode_bytes(run.cfg, run.layers[0].weights, k, batch, snapshots=k > 1)
    gbps = nbytes / us / 1e3
    run.release()
    return DecodeResult(preset, "batch-decode" if k == 1 else "batch-verify", k, True, us,
                        nbytes, gbps, gbps / ceil.copy_gbps, kernels_us=kernels, batch=batch)


def step_times(gpu: GpuBackend, per_layer: list[list[Step]], stream: int,
               repeat: int = 5) -> dict[str, float]:
    """Microseconds of each step of one decode call: the step for every layer of the stack in
    turn (`per_layer`: each layer's table of the same call), `repeat` rounds captured in a graph
    and replayed, so host launch latency stays out of the figure and each launch reads its
    layer's weights and state from DRAM, as in a real decode (one layer again and again would
    find them in L2)."""
    out = {}
    for i, step in enumerate(per_layer[0]):
        runs = [steps[i].run for steps in per_layer] * repeat
        graph = gpu.capture(lambda: [run(stream) for run in runs], stream)
        out[step.name] = median_ms(gpu, lambda: graph.replay(stream), stream, 20) * 1e3 / len(runs)
    return out


def step_medians(gpu: GpuBackend, steps: list[Step], stream: int, reps: int,
                 warmup: int) -> dict[str, float]:
    """Median ms of each step of one prefill, the steps run in order with an event between
    each: what a step takes inside the layer (its inputs where the layer leaves them, the
    GPU's clocks as the layer runs it); a rep's steps add up to that rep's layer. Timed alone,
    over and over, a step measures off its share in the layer (docs/perf-log.md, v12)."""
    times: dict[str, list[float]] = {step.name: [] for step in steps}
    for rep in range(warmup + reps):
        events = [gpu.create_event() for _ in range(len(steps) + 1)]
        gpu.record_event(events[0], stream)
        for i, step in enumerate(steps, 1):
            step.run(stream)
            gpu.record_event(events[i], stream)
        if rep >= warmup:
            for i, step in enumerate(steps):
                times[step.name].append(gpu.elapsed_ms(events[i], events[i + 1]))
    return {n: statistics.median(ts) for n, ts in times.items()}


@dataclass
class PrefillResult:
    preset: str
    tokens: int
    ms: float
    core_ms: float
    gemm_ms: float  # the projection GEMMs, in the layer
    tokens_per_s: float
    tflops: float  # projection GEMMs only, over the whole layer time
    fla_ms: float | None = None
    fla_core_ms: float | None = None
    # FlashKDA's forward (its whole core: gates, beta, L2 norms, the chunked recurrence; fp32
    # state in and out) on the same shapes, where it is importable and applies (bounded gate,
    # D = 128); kdarun's like for like is core_ms, whose intra kernel forms the decay and beta
    flashkda_core_ms: float | None = None
    kernels_ms: dict | None = None  # each non-GEMM step of one prefill, timed in the layer
    # Where the layer runs the Hopper walk: the whole intra kernel and both walks timed alone,
    # in turn (each walk on the operands the intra kernel left); the portable core is the
    # intra kernel plus its walk, run one after the other as a layer on another GPU runs them
    intra_ms: float | None = None
    hopper_walk_ms: float | None = None
    portable_walk_ms: float | None = None
    portable_core_ms: float | None = None


def prefill_flops(cfg: Glm5NextKdaConfig, t: int) -> int:
    return 2 * t * (cfg.hidden_size * cfg.proj_rows + 2 * cfg.rank * cfg.qkv
                    + cfg.qkv * cfg.hidden_size)


def bench_prefill(gpu: GpuBackend, preset: str, tokens: list[int], stream: int,
                  gate: str = "bounded", fla: bool = False,
                  flashkda: bool = True) -> Iterator[PrefillResult]:
    """Prefill at each T, one result as each T is done: the layer, and the core, the GEMMs and
    each step inside it. With `fla`, fla's layer and its chunk_kda on the same shapes take turns
    with the layer rep by rep. Where the layer runs the Hopper walk, the portable walk is timed
    beside it; where FlashKDA is importable and applies (and `flashkda`), its forward takes its
    turn too. The device buffers go back when the iteration ends or is closed."""
    cfg = synthetic.preset_config(preset, gate)
    fla_timers = _fla_prefill_timers(cfg) if fla else None
    flashkda_timer = _flashkda_timer(cfg) if flashkda and flashkda_available() else None
    layer, ws, state, h = random_layer(gpu, cfg, max(tokens), stream)
    portable = (Glm5NextKdaKernels(gpu, cfg, core="portable")
                if layer.kernels.core == "hopper" else None)
    try:
        for t in tokens:
            reps = 30 if t <= 4096 else 10
            timers = [lambda: time_once(gpu, lambda: layer.prefill(gpu, h, t, state, ws, stream),
                                        stream)]
            timers += fla_timers(t) if fla_timers else []
            timers += [flashkda_timer(t)] if flashkda_timer else []
            ms, *others = medians_in_turn(timers, reps, 3)
            fla_ms = others[:2] if fla_timers else []
            table = layer.prefill_steps(h, t, state, ws)
            steps = step_medians(gpu, table, stream, reps, 3)
            core = steps["chunk_intra"] + steps["chunk_inter"]
            gemm = sum(steps[step.name] for step in table if step.gemm)
            kernels = {step.name: steps[step.name] for step in table if not step.gemm}
            r = PrefillResult(preset, t, ms, core, gemm, t / ms * 1e3,
                              prefill_flops(cfg, t) / ms / 1e9, *fla_ms, kernels_ms=kernels,
                              flashkda_core_ms=others[-1] if flashkda_timer else None)
            if portable is not None:
                intra, hopper_walk = layer.core_apart(ws, state.recurrent, t)
                portable_walk = layer.core_apart(ws, state.recurrent, t, portable)[1]
                r.intra_ms, r.hopper_walk_ms, r.portable_walk_ms = medians_in_turn(
                    [lambda f=f: time_once(gpu, lambda: f(stream), stream)
                     for f in (intra, hopper_walk, portable_walk)], reps, 3)
                r.portable_core_ms = r.intra_ms + r.portable_walk_ms
            yield r
    finally:
        _release(gpu, [layer], [state], ws, h)


@dataclass
class VarlenResult:
    preset: str
    mix: str  # e.g. "32x128": sequences x tokens each
    tokens: int
    ms: float  # prefill_packed of the mix
    ms_checkpoints: float  # the same with the state checkpointed every CHECKPOINT_EVERY tokens
    one_ms: float  # one prefill of as many tokens in one sequence, in the same run
    fla_ms: float | None = None  # fla's layer over the mix, by cu_seqlens
    steps_ms: dict[str, float] | None = None  # each step of the packed table, in the layer
    host_ms: float | None = None  # the packed call's host time (checks, plan, launches)
    one_host_ms: float | None = None  # the one prefill's


CHECKPOINT_EVERY = 256


def parse_mix(text: str) -> list[tuple[int, int]]:
    """'1x4096,32x128' -> [(1, 4096), (32, 128)]: (sequences, tokens each) a pack."""
    try:
        mix = [tuple(int(v) for v in part.split("x")) for part in text.split(",")]
    except ValueError:
        mix = []
    if not mix or any(len(m) != 2 or min(m) < 1 for m in mix):
        raise ValueError(f"a mix is NxT[,NxT...] with positive N and T, got {text!r}")
    return mix


def bench_varlen(gpu: GpuBackend, preset: str, mix: list[tuple[int, int]], stream: int,
                 gate: str = "bounded", fla: bool = False, reps: int = 10) -> list[VarlenResult]:
    """Packed prefill of each (sequences, tokens each) of `mix`, from zero states, with and
    without checkpoints, beside one prefill of as many tokens (and fla's layer over the same
    pack with cu_seqlens), timed in turn rep by rep. The workspace holds every mix's padded
    chunks, so each pack runs in one window."""
    cfg = synthetic.preset_config(preset, gate)
    total = max(n * t for n, t in mix)
    layer, ws, state, h = random_layer(gpu, cfg, total, stream,
                                       max(n * cfg.t_pad(t) for n, t in mix))
    out = gpu.alloc(total * cfg.hidden_size * BF16.itemsize)
    results = []
    for n, t in mix:
        bounds = [i * t for i in range(n + 1)]
        per = t // CHECKPOINT_EVERY
        pool = KdaStatePool(gpu, cfg, n * (1 + per), stream)
        slots, init = list(range(n)), [False] * n
        ck = [[n + i * per + j for j in range(per)] for i in range(n)]

        host: dict[str, list[float]] = {"packed": [], "one": []}

        def on_host(key: str, fn: Callable[[], None]) -> None:
            """fn(), its host time kept: what a call spends before its last launch is GPU
            time lost where the GPU waits for it (docs/perf-log.md, v51)."""
            t0 = time.perf_counter()
            fn()
            host[key].append((time.perf_counter() - t0) * 1e3)

        def packed(every: int = 0) -> None:
            prefill_packed(layer, gpu, h, bounds, slots, init, pool, ws, out, stream, every,
                           ck if every else None)
        timers = [lambda: time_once(gpu, lambda: on_host("packed", packed), stream),
                  lambda: time_once(gpu, lambda: packed(CHECKPOINT_EVERY), stream),
                  lambda: time_once(gpu, lambda: on_host("one", lambda: layer.prefill(
                      gpu, h, n * t, state, ws, stream)), stream)]
        ms, ms_ck, one = medians_in_turn(timers, reps, 2)
        # fla in turns of its own: a kdarun call right after fla's took ~0.25 ms more
        # (docs/perf-log.md, packed prefill on segments)
        fla_ms = medians_in_turn([_fla_varlen_timer(cfg, n, t)], reps, 2) if fla else []
        # the packed table step by step (the pack is one window of this workspace)
        table, t_pad = segment_table(np.arange(n) * t, np.full(n, t), np.arange(n),
                                     np.zeros(n, bool), 0)
        gpu.copy_h2d(ws.ptr("segments"), table, stream)
        steps = layer.packed_steps(h, n * t, pool, ws, SegmentTable(ws.ptr("segments"), n, t_pad))
        results.append(VarlenResult(preset, f"{n}x{t}", n * t, ms, ms_ck, one,
                                    fla_ms[0] if fla_ms else None,
                                    step_medians(gpu, steps, stream, reps, 3),
                                    statistics.median(host["packed"]),
                                    statistics.median(host["one"])))
        pool.free()
    gpu.free(out)
    _release(gpu, [layer], [state], ws, h)
    return results


# -- fla, measured in the same process where it is importable ----------------------------------
def fla_available() -> bool:
    """Whether fla's layer imports and a GPU is there. fla 0.6 sends chunk_kda to FlashKDA
    wherever flash_kda imports (its backend dispatch, read once at its import), and FlashKDA
    refuses fla's bf16 A_log: here fla means fla's own kernels, so its dispatch is switched off
    before fla is first imported (FlashKDA is timed on its own, `_flashkda_timer`)."""
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    try:
        import fla.layers.kda  # noqa: F401
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def _torch_time_once(fn) -> float:
    """time_once for work torch enqueues on its current stream."""
    import torch
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _fla_layers(cfg: Glm5NextKdaConfig, n: int):
    import torch
    from fla.layers.kda import KimiDeltaAttention
    torch.manual_seed(0)
    return [KimiDeltaAttention(hidden_size=cfg.hidden_size, head_dim=cfg.head_dim,
                               num_heads=cfg.num_heads, conv_size=cfg.conv_kernel,
                               lower_bound=cfg.gate_lower_bound, layer_idx=i,
                               norm_eps=cfg.rms_norm_eps).to("cuda", torch.bfloat16).eval()
            for i in range(n)]


def fla_decode_us(preset: str, graph: bool, reps: int = 200, gate: str | None = None,
                  batch: int = 1) -> float:
    """fla KimiDeltaAttention decode of `batch` sequences (per layer) after a prefill of
    FLA_CACHE_TOKENS tokens each, over the same DECODE_LAYERS-layer walk."""
    import torch
    from fla.models.cache_utils import FLACache
    cfg = synthetic.preset_config(preset, gate)
    layers = _fla_layers(cfg, DECODE_LAYERS)
    cache = FLACache()
    with torch.no_grad():
        prompt = torch.randn(batch, FLA_CACHE_TOKENS, cfg.hidden_size, device="cuda",
                             dtype=torch.bfloat16)
        for layer in layers:
            layer(prompt, past_key_values=cache, use_cache=True)
        x = torch.randn(batch, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)

        def step():
            for layer in layers:
                layer(x, past_key_values=cache, use_cache=True)
        if graph:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            fn = g.replay
        else:
            fn = step
        (ms,) = medians_in_turn([lambda: _torch_time_once(fn)], reps, 5)
        return ms * 1e3 / DECODE_LAYERS


def _fla_prefill_timers(cfg: Glm5NextKdaConfig) -> Callable[[int], list[Callable[[], float]]]:
    """For T tokens: timers of fla's layer forward and of its chunk_kda core alone (bounded or
    softplus gate as cfg says), on fresh random inputs of the same shapes."""
    import torch
    from fla.ops.kda import chunk_kda
    (layer,) = _fla_layers(cfg, 1)
    H, D = cfg.num_heads, cfg.head_dim

    def timers(t: int) -> list[Callable[[], float]]:
        x = torch.randn(1, t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        q, k, v, g = (torch.randn(1, t, H, D, device="cuda", dtype=torch.bfloat16)
                      for _ in range(4))
        beta = torch.randn(1, t, H, device="cuda", dtype=torch.bfloat16)
        s0 = torch.zeros(1, H, D, D, device="cuda", dtype=torch.float32)
        kw = dict(A_log=layer.A_log, dt_bias=layer.dt_bias, initial_state=s0,
                  output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  lower_bound=cfg.gate_lower_bound, safe_gate=cfg.gate_lower_bound is not None,
                  state_v_first=True)

        def run_layer() -> None:
            with torch.no_grad():
                layer(x)

        def run_core() -> None:
            with torch.no_grad():
                chunk_kda(q, k, v, g, beta, **kw)
        return [lambda: _torch_time_once(run_layer), lambda: _torch_time_once(run_core)]
    return timers


def flashkda_available() -> bool:
    try:
        import flash_kda  # noqa: F401
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def _flashkda_timer(cfg: Glm5NextKdaConfig) -> Callable[[int], Callable[[], float]] | None:
    """For T tokens: a timer of FlashKDA's forward on fresh random inputs of cfg's shapes (q and
    k unit rows, as its own benchmark feeds them), fp32 state in and out; None where FlashKDA
    does not apply (it has the bounded gate alone, and D = 128 alone)."""
    if cfg.head_dim != 128 or cfg.gate_lower_bound is None:
        return None
    import flash_kda
    import torch
    H, D = cfg.num_heads, cfg.head_dim
    a_log = torch.rand(H, dtype=torch.float32, device="cuda")
    dt_bias = torch.rand(H, D, dtype=torch.float32, device="cuda")

    def timer(t: int) -> Callable[[], float]:
        q, k = (torch.nn.functional.normalize(torch.randn(1, t, H, D, device="cuda"), dim=-1)
                .to(torch.bfloat16) for _ in range(2))
        v, g = (torch.randn(1, t, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        beta = torch.randn(1, t, H, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(v)
        s0 = torch.zeros(1, H, D, D, device="cuda", dtype=torch.float32)
        s1 = torch.empty_like(s0)

        def run() -> None:
            flash_kda.fwd(q, k, v, g, beta, D ** -0.5, out, a_log, dt_bias,
                          cfg.gate_lower_bound, initial_state=s0, final_state=s1)
        return lambda: _torch_time_once(run)
    return timer


def _fla_varlen_timer(cfg: Glm5NextKdaConfig, n: int, t: int) -> Callable[[], float]:
    """A timer of fla's layer over n sequences of t tokens packed with cu_seqlens."""
    import torch
    (layer,) = _fla_layers(cfg, 1)
    x = torch.randn(1, n * t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, n * t + 1, t, device="cuda", dtype=torch.int32)

    def run() -> None:
        with torch.no_grad():
            layer(x, cu_seqlens=cu)
    return lambda: _torch_time_once(run)


def results_table(rows: list[dict]) -> str:
    """One line a result; per-launch breakdowns (dict values) follow the table, a line each."""
    if not rows:
        return ""
    keys = [k for k in rows[0] if not isinstance(rows[0][k], dict)]
    cells = [[_fmt(r.get(k)) for k in keys] for r in rows]
    w = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.ljust(w[i]) for i, k in enumerate(keys))]
    lines += ["  ".join(c[i].ljust(w[i]) for i in range(len(keys))) for c in cells]
    for i, r in enumerate(rows, 1):
        for name, parts in r.items():
            if isinstance(parts, dict):
                lines.append(f"row {i} {name}: " + ", ".join(f"{k} {_fmt(v)}"
                                                           for k, v in parts.items()))
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)

