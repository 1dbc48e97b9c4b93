"""Tensor parallel over heads: a group of `tp_size` ranks, each running the block on its
`H / tp_size` heads, and the one sum that joins them.

The sharding is vLLM's: q/k/v and their convs, f_b, g_b, b, A_log and dt_bias split by
heads, o_proj by its input columns (row-parallel), f_a, g_a and o_norm replicated
(`checkpoint.TENSORS`' `head_axis`). A rank is an ordinary layer of the config
`cfg.shard(tp_size)` with its own weights, workspace and states (recurrent
`[H/tp, Dv, Dk]`, conv `[W-1, 3 H D / tp]`), run by the same kernels. Its `final_out` is a
partial sum over its heads; the group's output is the sum of the partials.

The sum (`TpGroup`): each partial, bf16 as o_proj rounds it, is widened and added in fp32
(`tp_accumulate`), and the fp32 total is rounded to bf16 once (`tp_round`). fp32 rather than
bf16 because a bf16 all-reduce rounds after every add in an order NCCL picks (the ring), so
its error and its bits would change with the group size; fp32 keeps one rounding, the one a
single GPU's o_proj does. Two modes share everything but how the partials meet:

- in turn (host backend, one GPU): the process holds every rank, runs them one after the
  other and adds their partials in rank order 0, 1, ...;
- NCCL (`launch`: one process a GPU): a process holds its own rank; it widens its partial,
  then one NCCL all-reduce (sum, fp32) on the layer's stream adds the others', all of it
  capturable into a CUDA graph.

The two agree bit for bit at tp_size 2 (two fp32 adds commute); from 3 ranks on, NCCL's add
order may move the fp32 total by an ulp, which the bf16 rounding hides but for rare ties.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from typing import Any, Callable, Sequence

import numpy as np

from .backend import DeviceOwner, DevicePtr, GpuBackend, overlaps
from .dtypes import BF16, F32
from .errors import KdaError, check_int
from .layer import Glm5NextKdaLayer, check_packed, prefill_windowed, run_pack
from .loader import KdaStack
from .pool import KdaStatePool
from .state import KdaSeqState
from .workspace import Glm5NextKdaWorkspace

LAUNCH_TIMEOUT_S = 3600.0  # how long the launcher waits for a rank's result
GATHER_POLL_S = 0.5  # how often the launcher looks for a rank that died without a result


class NcclComm:
    """This process's member of an NCCL group: rank `rank` of `size`, on the current GPU
    (`cupy.cuda.nccl`). Every rank passes the same `uid` (`nccl.get_unique_id()`, made once
    by the launcher before the ranks start)."""

    def __init__(self, uid: Any, rank: int, size: int):
        from cupy.cuda import nccl
        self._nccl, self.rank, self.size = nccl, rank, size
        self._comm = nccl.NcclCommunicator(size, uid, rank)

    def all_reduce_f32(self, buf: DevicePtr, n: int, stream: int) -> None:
        """buf[n] fp32 = the sum over the ranks of their buf, in place, enqueued on `stream`
        (capturable into a CUDA graph)."""
        nc = self._nccl
        self._comm.allReduce(int(buf), int(buf), n, nc.NCCL_FLOAT32, nc.NCCL_SUM, int(stream))

    def close(self) -> None:
        self._comm.destroy()


class TpGroup(DeviceOwner):
    """The ranks of one layer's tensor parallel group that this process holds, and their sum:
    every rank of `tp_size` (in turn) or one (`comm` given: the others are other processes).
    `ranks` are (layer, workspace) pairs, each of the rank config; states are passed a rank
    each, in the order of `ranks`. After any call every held rank's `final_out` (and `out`
    of `prefill_packed`) holds the group's output, `[rows, hidden]` bf16; with tp_size 1 the
    calls are the layer's own. `max_rows` bounds the rows a call sums (the fp32 sum buffer)."""

    _DEVICE_ATTRS = ("acc",)

    def __init__(self, gpu: GpuBackend, ranks: Sequence[tuple[Glm5NextKdaLayer,
                                                              Glm5NextKdaWorkspace]],
                 tp_size: int, comm: NcclComm | None = None, max_rows: int | None = None):
        self.tp_size = check_int(tp_size, "tp group: tp_size", 1)
        self.ranks = list(ranks)
        held = 1 if comm is not None else tp_size
        if len(self.ranks) != held:
            how = "its own, NCCL joins the others" if comm is not None else "all, in turn"
            raise KdaError(f"tp group: holds {held} rank(s) ({how}), got {len(self.ranks)}")
        if comm is not None and comm.size != tp_size:
            raise KdaError(f"tp group: the NCCL group has {comm.size} ranks, tp_size is {tp_size}")
        self.cfg = self.ranks[0][0].cfg
        if any(layer.cfg != self.cfg for layer, _ in self.ranks):
            raise KdaError("tp group: every rank must run the same (rank) config")
        idx = {layer.layer_idx for layer, _ in self.ranks}
        if len(idx) != 1:
            raise KdaError(f"tp group: every rank must hold the same layer, got layers "
                           f"{[layer.layer_idx for layer, _ in self.ranks]}")
        for n, part in ((0, "layer"), (1, "workspace")):
            if len({id(r[n]) for r in self.ranks}) != len(self.ranks):
                raise KdaError(f"tp group: a rank's {part} is given twice; each rank holds "
                               f"its own")
        self.gpu, self.comm = gpu, comm
        self.kernels = self.ranks[0][0].kernels
        self.max_rows = check_int(max_rows if max_rows is not None else
                                  self.ranks[0][1].max_tokens(), "tp group: max_rows", 1)
        nbytes = self.max_rows * self.cfg.hidden_size * F32.itemsize
        if tp_size > 1:
            gpu.check_free_memory(nbytes, "the tensor parallel sum")
        # [max_rows, hidden] fp32: the sum of the partials (none to sum with one rank)
        self.acc: DevicePtr | None = gpu.alloc(nbytes) if tp_size > 1 else None

    @classmethod
    def of(cls, gpu: GpuBackend, stacks: Sequence[KdaStack], layer_idx: int,
           comm: NcclComm | None = None, max_rows: int | None = None) -> "TpGroup":
        """The group of layer `layer_idx` over `stacks`, one a held rank, in rank order."""
        tp = {s.tp_size for s in stacks}
        if len(tp) != 1:
            raise KdaError(f"tp group: the stacks come from groups of sizes {sorted(tp)}")
        want = [comm.rank] if comm is not None else list(range(stacks[0].tp_size))
        if [s.tp_rank for s in stacks] != want:
            raise KdaError(f"tp group: need the stacks of ranks {want}, in order, got "
                           f"{[s.tp_rank for s in stacks]}")
        paths = {s.checkpoint.path.resolve() for s in stacks}
        if len(paths) != 1:
            raise KdaError(f"tp group: the ranks' stacks come from different checkpoints "
                           f"{sorted(map(str, paths))}; a group's ranks share one")
        return cls(gpu, [(s.layer(layer_idx), s.workspace) for s in stacks], tp.pop(), comm,
                   max_rows)

    def free(self) -> None:
        """Give back the sum buffer (the ranks' layers and workspaces are their stacks')."""
        with self._freeing():
            if self.acc is not None:
                self.gpu.free(self.acc)

    @property
    def final_out(self) -> DevicePtr:
        """The first held rank's final_out: the group's output after a call."""
        return self.ranks[0][1].final_out

    def _check_per_rank(self, what: str, items: Sequence[Any]) -> list:
        """`items` (one a held rank) as a list; no state or pool given for two ranks."""
        if isinstance(items, (str, bytes)) or not hasattr(items, "__len__"):
            raise KdaError(f"tp group {what}: pass a list, one a held rank "
                           f"({len(self.ranks)}), got {items!r}")
        items = list(items)
        if len(items) != len(self.ranks):
            raise KdaError(f"tp group {what}: pass one a held rank ({len(self.ranks)}), got "
                           f"{len(items)}")
        owned = [id(x) for x in items if isinstance(x, (KdaSeqState, KdaStatePool))]
        if len(set(owned)) != len(owned):
            raise KdaError(f"tp group {what}: the same object is given for two ranks; each "
                           f"rank's is its own")
        for i, x in enumerate(items):
            rank = self._rank(i)
            if isinstance(x, (KdaSeqState, KdaStatePool)) and x.tp_rank not in (None, rank):
                raise KdaError(f"tp group {what}: the one given for rank {rank} holds rank "
                               f"{x.tp_rank}'s heads (an earlier call took it as rank "
                               f"{x.tp_rank}'s); pass them in rank order, or set its tp_rank "
                               f"to None once it holds rank {rank}'s state")
        return items

    def _rank(self, i: int) -> int:
        """The rank of the i-th held rank: i in turn, the process's own with NCCL."""
        return self.comm.rank if self.comm is not None else i

    def _check_ranks(self, what: str, rows: int, states: Sequence[Any] | None = None,
                     pools: Sequence[Any] | None = None, windows: bool = False) -> int:
        """Every held rank's call checked before any runs (so a bad argument for one rank
        leaves every rank's state as it was): the rows, and each rank's workspace, state or
        pool against its layer."""
        self._require_live(f"tp group {what}")
        rows = check_int(rows, f"tp group {what}: rows", 1)
        for kind, items, cls in (("state", states, KdaSeqState), ("state pool", pools,
                                                                   KdaStatePool)):
            for i, x in enumerate(items or ()):
                if not isinstance(x, cls):
                    raise KdaError(f"tp group {what}: rank {i}'s {kind} must be a "
                                   f"{cls.__name__}, got {type(x).__name__}")
        for i, (layer, ws) in enumerate(self.ranks):
            layer.check_fits(ws, states[i] if states is not None else None,
                             pools[i] if pools is not None else None)
            if not windows:
                ws.check_tokens(rows, f"tp group {what}")
        return rows

    def _hidden_apart(self, what: str, hidden: DevicePtr, rows: int,
                      out: DevicePtr | None = None) -> None:
        """A KdaError where hidden [rows, hidden] overlaps a buffer a rank writes before the
        next rank reads hidden: `out`, or a rank's final_out but the last's (the group's own
        final_out among them). The ranks held here run in turn, so the next would take the
        sum's first part for its input."""
        DevicePtr.check(hidden, f"tp group {what}: hidden")
        if len(self.ranks) < 2:
            return
        row = self.cfg.hidden_size * BF16.itemsize
        written = [("out", out, rows)] if out is not None else []
        written += [(f"rank {i}'s final_out", ws.final_out, min(rows, ws.max_tokens()))
                    for i, (_, ws) in enumerate(self.ranks[:-1])]
        for name, buf, n in written:
            if overlaps(hidden, rows * row, buf, n * row):
                raise KdaError(f"tp group {what}: hidden {hidden!r} overlaps {name}, which a "
                               "rank writes before the next rank reads hidden (the ranks run "
                               "in turn here); give hidden a buffer of its own")

    def _summed(self, what: str, hidden: DevicePtr, rows: int,
                owned: Sequence[KdaSeqState | KdaStatePool],
                call: Callable[[int, Glm5NextKdaLayer, Glm5NextKdaWorkspace], None],
                stream: int, out: DevicePtr | None = None) -> None:
        """Run each held rank (`call(i, layer, ws)` enqueues rank i's call, whose partial
        [rows, hidden] bf16 lands in its ws.final_out, or in `out`), then make every partial
        the group's sum: fp32 adds in rank order, each right after its rank ran (ranks may
        share `out`), the all-reduce where the other ranks are other processes, one
        rounding. `hidden` and the rows are checked first (`_hidden_apart`, `max_rows`); then
        each of `owned` (the call's states or pools, a rank each, checked by
        `_check_per_rank`) is marked as its rank's (`tp_rank`)."""
        self._require_live("a call")
        self._hidden_apart(what, hidden, rows, out)
        if self.tp_size > 1 and rows > self.max_rows:
            raise KdaError(f"tp group: {rows} rows exceed the sum buffer's {self.max_rows} "
                           "(max_rows)")
        for i, x in enumerate(owned):  # checked: the call runs
            x.tp_rank = self._rank(i)
        if self.tp_size == 1:
            call(0, *self.ranks[0])
            return
        n, kn = rows * self.cfg.hidden_size, self.kernels
        partials: list[DevicePtr] = []
        for i, (layer, ws) in enumerate(self.ranks):
            call(i, layer, ws)
            partials.append(ws.final_out if out is None else out)
            kn.tp_accumulate(stream, partials[-1], self.acc, n, i == 0)
        if self.comm is not None:
            self.comm.all_reduce_f32(self.acc, n, stream)
        for p in dict.fromkeys(partials):  # a buffer the ranks share is rounded into once
            kn.tp_round(stream, self.acc, p, n)

    # -- the layer's calls, over the group ---------------------------------------------------
    def prefill(self, gpu: GpuBackend, hidden: DevicePtr, t: int,
                states: Sequence[KdaSeqState], stream: int) -> None:
        """`Glm5NextKdaLayer.prefill` of every held rank, then the sum."""
        states = self._check_per_rank("prefill: states", states)
        t = self._check_ranks("prefill", t, states)
        self._summed("prefill", hidden, t, states, lambda i, layer, ws: layer.prefill(
            gpu, hidden, t, states[i], ws, stream), stream)

    def prefill_windowed(self, gpu: GpuBackend, hidden: DevicePtr, t: int,
                         states: Sequence[KdaSeqState], out: DevicePtr, stream: int) -> None:
        """`layer.prefill_windowed` of every held rank into out [t, hidden] bf16 (t up to
        `max_rows`), then the sum."""
        states = self._check_per_rank("prefill_windowed: states", states)
        t = self._check_ranks("prefill_windowed", t, states, windows=True)
        self._summed("prefill_windowed", hidden, t, states,
                     lambda i, layer, ws: prefill_windowed(layer, gpu, hidden, t, states[i], ws,
                                                           out, stream), stream, out)

    def decode(self, gpu: GpuBackend, hidden: DevicePtr, states: Sequence[KdaSeqState],
               stream: int) -> None:
        """`Glm5NextKdaLayer.decode` of every held rank, then the sum."""
        states = self._check_per_rank("decode: states", states)
        self._check_ranks("decode", 1, states)
        self._summed("decode", hidden, 1, states, lambda i, layer, ws: layer.decode(
            gpu, hidden, states[i], ws, stream), stream)

    def decode_k(self, gpu: GpuBackend, hidden: DevicePtr, k: int,
                 states: Sequence[KdaSeqState],
                 snapshots: Sequence[Sequence[tuple[DevicePtr, DevicePtr]]] | None,
                 stream: int) -> None:
        """`Glm5NextKdaLayer.decode_k` of every held rank (`snapshots` None, or one list a
        rank of its k-1 snapshot buffers, each of the rank config's state sizes), then the
        sum."""
        states = self._check_per_rank("decode_k: states", states)
        snaps = self._check_per_rank("decode_k: snapshots", snapshots if snapshots is not None
                                     else [()] * len(self.ranks))
        k = self._check_ranks("decode_k", k, states)
        for i, (layer, _) in enumerate(self.ranks):
            layer.check_snapshots(k, snaps[i], states[i], f"tp group decode_k: rank {i}'s")
        self._summed("decode_k", hidden, k, states, lambda i, layer, ws: layer.decode_k(
            gpu, hidden, k, states[i], ws, snaps[i], stream), stream)

    def decode_batch(self, gpu: GpuBackend, hidden: DevicePtr, b: int, slots: DevicePtr,
                     pools: Sequence[KdaStatePool], stream: int) -> None:
        """`Glm5NextKdaLayer.decode_batch` of every held rank, a pool a rank (one slot table
        for all: a sequence has the same slot in every rank's pool), then the sum."""
        pools = self._check_per_rank("decode_batch: pools", pools)
        b = self._check_ranks("decode_batch", b, pools=pools)
        for i, (layer, ws) in enumerate(self.ranks):
            layer.check_batch(gpu, "tp group decode_batch", hidden, b, 1, slots, pools[i], ws)
        self._summed("decode_batch", hidden, b, pools,
                     lambda i, layer, ws: layer.decode_batch(gpu, hidden, b, slots, pools[i], ws,
                                                             stream), stream)

    def verify_batch(self, gpu: GpuBackend, hidden: DevicePtr, b: int, k: int,
                     slots: DevicePtr, pools: Sequence[KdaStatePool],
                     snapshot_slots: DevicePtr | None, stream: int) -> None:
        """`Glm5NextKdaLayer.verify_batch` of every held rank, a pool a rank, then the sum."""
        pools = self._check_per_rank("verify_batch: pools", pools)
        for i, (layer, ws) in enumerate(self.ranks):
            layer.check_batch(gpu, "tp group verify_batch", hidden, b, k, slots, pools[i], ws,
                              snapshot_slots)
        self._summed("verify_batch", hidden, b * k, pools,
                     lambda i, layer, ws: layer.verify_batch(gpu, hidden, b, k, slots, pools[i],
                                                             ws, snapshot_slots, stream), stream)

    def prefill_packed(self, gpu: GpuBackend, hidden: DevicePtr, cu_seqlens: Sequence[int],
                       slots: Sequence[int], has_initial_state: Sequence[bool],
                       pools: Sequence[KdaStatePool], out: DevicePtr, stream: int,
                       checkpoint_every: int = 0,
                       checkpoint_slots: Sequence[Sequence[int]] | None = None) -> None:
        """`layer.prefill_packed` of every held rank into out [T_total, hidden] bf16, a pool
        a rank (one slot numbering for all), then the sum."""
        pools = self._check_per_rank("prefill_packed: pools", pools)
        self._check_ranks("prefill_packed", 1, pools=pools, windows=True)
        packs = []
        for i, (layer, ws) in enumerate(self.ranks):
            try:
                packs.append(check_packed(layer, gpu, hidden, cu_seqlens, slots,
                                          has_initial_state, pools[i], ws, out,
                                          checkpoint_every, checkpoint_slots))
            except KdaError as e:
                raise KdaError(f"tp group rank {i}: {e}") from None
        rows = int(packs[0].bounds[-1])
        self._summed("prefill_packed", hidden, rows, pools, lambda i, layer, ws: run_pack(
            layer, gpu, hidden, packs[i], pools[i], ws, out, stream), stream, out)


# -- the states of a group: a rank's share of a state, and the whole from the ranks' ---------
def _check_rank(what: str, full: np.ndarray, ndim: int, groups: int, tp_rank: int,
                tp_size: int) -> tuple[int, int]:
    """(tp_rank, tp_size) checked against a recurrent ([H, Dv, Dk], ndim 3: the heads shared)
    or conv state ([W-1, 3 qkv], ndim 2: each of `groups` = 3 q|k|v's channels shared)."""
    if not isinstance(full, np.ndarray) or full.ndim != ndim:
        raise KdaError(f"{what}: need a NumPy array of {ndim} dimensions, got "
                       f"{getattr(full, 'shape', type(full).__name__)}")
    tp_size = check_int(tp_size, f"{what}: tp_size", 1)
    tp_rank = check_int(tp_rank, f"{what}: tp_rank", 0, tp_size - 1)
    n = full.shape[0 if ndim == 3 else 1]
    split = n // groups
    if n % groups or split % tp_size:
        raise KdaError(f"{what}: {n} {'heads' if ndim == 3 else 'channels (q|k|v)'} do not "
                       f"split into {tp_size} equal ranks")
    return tp_rank, tp_size


def rank_recurrent(full: np.ndarray, tp_rank: int, tp_size: int) -> np.ndarray:
    """Rank `tp_rank`'s heads of a recurrent state [H, Dv, Dk]."""
    tp_rank, tp_size = _check_rank("rank_recurrent", full, 3, 1, tp_rank, tp_size)
    h = full.shape[0] // tp_size
    return np.ascontiguousarray(full[tp_rank * h:(tp_rank + 1) * h])


def rank_conv(full: np.ndarray, tp_rank: int, tp_size: int) -> np.ndarray:
    """Rank `tp_rank`'s channels of a conv state [W-1, 3 qkv] (q|k|v): its heads' slice of
    each of q, k and v, [W-1, 3 qkv / tp_size]."""
    tp_rank, tp_size = _check_rank("rank_conv", full, 2, 3, tp_rank, tp_size)
    w1, cd = full.shape
    q = cd // 3 // tp_size
    parts = full.reshape(w1, 3, tp_size, q)[:, :, tp_rank]
    return np.ascontiguousarray(parts.reshape(w1, 3 * q))


def _check_parts(what: str, parts: Sequence[np.ndarray], ndim: int) -> list[np.ndarray]:
    parts = list(parts)
    if not parts or any(not isinstance(p, np.ndarray) or p.ndim != ndim
                        or p.shape != parts[0].shape for p in parts):
        raise KdaError(f"{what}: need one [{'H/tp, Dv, Dk' if ndim == 3 else 'W-1, 3 qkv/tp'}] "
                       f"array a rank, all of one shape, got "
                       f"{[getattr(p, 'shape', type(p).__name__) for p in parts]}")
    return parts


def join_recurrent(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The recurrent state [H, Dv, Dk] from the ranks' [H/tp, Dv, Dk], in rank order."""
    return np.concatenate(_check_parts("join_recurrent", parts, 3), axis=0)


def join_conv(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The conv state [W-1, 3 qkv] (q|k|v) from the ranks' [W-1, 3 qkv/tp], in rank order."""
    parts = _check_parts("join_conv", parts, 2)
    w1, cd = parts[0].shape
    if cd % 3:
        raise KdaError(f"join_conv: a rank's conv state has {cd} channels, not 3 equal q|k|v")
    split = [p.reshape(w1, 3, cd // 3) for p in parts]
    return np.concatenate(split, axis=2).reshape(w1, len(parts) * cd)


# -- one process a GPU -------------------------------------------------------------------------
def visible_gpus() -> int:
    """CUDA devices this process sees (0 without CuPy or a driver)."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def launch(tp_size: int, work: Callable[..., Any], *args: Any) -> list[Any]:
    """Run `work(gpu, comm, *args)` in `tp_size` processes, rank r on GPU r with its
    `NcclComm`, and return their results in rank order. The NCCL unique id is made here,
    before any rank starts, and handed to each. `work` and `args` must pickle (processes are
    spawned: a forked CUDA context is unusable). When a rank fails, the others (which would
    wait in NCCL for it) are ended and its error is raised."""
    tp_size = check_int(tp_size, "tp launch: tp_size", 1)
    have = visible_gpus()
    if have < tp_size:
        raise KdaError(f"--tp {tp_size} over NCCL needs {tp_size} GPUs, one a rank, but "
                       f"{have} {'is' if have == 1 else 'are'} visible; run the ranks in "
                       "turn on one device instead (--tp-mode in-turn)")
    from cupy.cuda import nccl
    uid = nccl.get_unique_id()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, tp_size, uid, work, args, results),
                         name=f"kdarun-tp-rank{r}") for r in range(tp_size)]
    for p in procs:
        p.start()
    return gather(procs, results, LAUNCH_TIMEOUT_S)


def gather(procs: Sequence[Any], results: Any, timeout_s: float) -> list[Any]:
    """The ranks' results from `results` ((rank, ok, value) a rank), in rank order, while
    `procs` (rank r is procs[r]) run. A failed rank's error is raised; so is a rank that
    exited without a result (killed: a crash, the OOM killer), once a whole poll after its exit
    brought nothing (a result may trail its sender's exit), rather than after `timeout_s`,
    since its peers wait in NCCL for it; the others are then ended."""
    size, got, gone = len(procs), {}, set()  # gone: exited without a result, a poll ago
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < size:
            try:
                rank, ok, value = results.get(timeout=GATHER_POLL_S)
            except queue.Empty:
                dead = {r for r, p in enumerate(procs) if r not in got and p.exitcode is not None}
                if dead & gone:
                    r = min(dead & gone)
                    raise KdaError(f"tp rank {r} of {size} exited with code {procs[r].exitcode} "
                                   "without a result (killed, or crashed)") from None
                gone = dead
                if time.monotonic() > deadline:
                    raise KdaError(f"tp launch: no result from ranks "
                                   f"{sorted(set(range(size)) - set(got))} within "
                                   f"{timeout_s:g} s") from None
                continue
            if not ok:
                raise KdaError(f"tp rank {rank} of {size} failed: {value}")
            got[rank] = value
    finally:
        for p in procs:
            if len(got) < size and p.is_alive():
                p.terminate()
            p.join()
    return [got[r] for r in range(size)]


def _rank_main(rank: int, size: int, uid: Any, work: Callable[..., Any], args: tuple,
               results: Any) -> None:
    """One rank's process: its GPU, its NCCL member, its work; the result (or the error's
    one line) goes back through `results`."""
    try:
        from .cuda_backend import CupyBackend
        gpu = CupyBackend(rank)
        comm = NcclComm(uid, rank, size)
        try:
            value = work(gpu, comm, *args)
        finally:
            comm.close()
        results.put((rank, True, value))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher
        results.put((rank, False, f"{type(e).__name__}: {' '.join(str(e).split())}"))
