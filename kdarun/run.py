"""Single-layer runs: prefill, then decode steps, then one decode_k, timed and checked
against the float64 reference. The CLI's `layer-run` is a thin shell over this."""

from __future__ import annotations

import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from . import reference, synthetic
from .backend import GpuBackend
from .checkpoint import Checkpoint
from .config import MAX_DECODE_ROWS
from .dtypes import BF16
from .errors import KdaError, check_int
from .files import PendingFile
from .loader import KdaStack, load_stack
from .state import KdaSeqState, conv_shape, recurrent_shape
from .tp import NcclComm, TpGroup, join_conv, join_recurrent, launch

OUTPUT_SUFFIXES = (".npy", ".safetensors")
SAFETENSORS_INPUT_DTYPES = ("BF16", "F16", "F32", "F64")  # an input's, as its header names them
_NPY_MAGIC = b"\x93NUMPY"


@dataclass
class RunPlan:
    """Token counts of one run: `prefill` tokens, then `decode_steps` single decodes, then
    one `decode_k` of `k` tokens (0 skips a phase)."""
    prefill: int
    decode_steps: int = 0
    k: int = 0

    @property
    def total(self) -> int:
        return self.prefill + self.decode_steps + self.k

    def check(self) -> None:
        check_int(self.prefill, "run: prefill tokens", 0)
        check_int(self.decode_steps, "run: decode steps", 0)
        check_int(self.k, "run: decode_k's k", 0, MAX_DECODE_ROWS)
        if self.total < 1:
            raise KdaError(f"run: token counts must be >= 0 with at least one token, got "
                           f"prefill={self.prefill} decode_steps={self.decode_steps} k={self.k}")


@dataclass
class RunResult:
    final_out: np.ndarray  # [N, hidden] bf16, every token's block output in order
    recurrent_state: np.ndarray  # [H, Dv, Dk] fp32 after the run
    conv_state: np.ndarray  # [W-1, conv_dim] bf16 after the run
    wall_ms: dict[str, float] = field(default_factory=dict)  # phase -> milliseconds


def random_hidden(n: int, hidden: int, seed: int) -> np.ndarray:
    """[n, hidden] bf16 N(0, 1): the scale of an RMS-normalised residual stream."""
    return np.random.default_rng(seed).standard_normal((n, hidden), dtype=np.float32).astype(BF16)


def read_hidden(path: str | Path, hidden: int) -> np.ndarray:
    """Read hidden states [N, hidden] from .npy or .safetensors (tensor `hidden`, or the
    only tensor), as bf16; a file that is not one, a wrong shape or dtype, and rows holding
    NaN/Inf (as bf16) are refused, naming them."""
    path = Path(path)
    if path.suffix == ".npy":
        with open(path, "rb") as f:
            if f.read(len(_NPY_MAGIC)) != _NPY_MAGIC:  # else np.load tries it as a pickle
                raise KdaError(f"{path}: not a .npy file (no .npy header; one array saved by "
                               "numpy.save is expected)")
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise KdaError(f"{path}: not a readable .npy file ({e})") from None
    elif path.suffix == ".safetensors":
        arr = _read_safetensors_input(path)
    else:
        raise KdaError(f"{path}: input must be .npy or .safetensors")
    if arr.ndim != 2 or arr.shape[1] != hidden:
        raise KdaError(f"{path}: hidden states must be [N, {hidden}], got {list(arr.shape)}")
    if arr.dtype != BF16 and not (arr.dtype.kind == "f" and arr.dtype.itemsize <= 8):
        npy_bf16 = " (a bf16 array saved by numpy.save reads back so: .npy cannot name bf16; " \
            "save float32, or bf16 in .safetensors)" if arr.dtype == np.dtype("V2") else ""
        raise KdaError(f"{path}: hidden states must be bf16, float16, float32 or float64 (either "
                       f"byte order), got {arr.dtype}{npy_bf16}")
    with np.errstate(over="ignore"):  # values beyond bf16's range become Inf: refused below
        arr = arr.astype(BF16)
    rows = np.flatnonzero(~np.isfinite(arr.astype(np.float32)).all(axis=1))
    if rows.size:
        raise KdaError(f"{path}: {rows.size} row(s) hold NaN/Inf (as bf16), the first "
                       f"{rows[:5].tolist()}; expected finite hidden states")
    return arr


def _read_safetensors_input(path: Path) -> np.ndarray:
    """The tensor named `hidden` (or the only tensor) of a safetensors file, read alone once
    its dtype, from the header, is one the input may have."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="numpy") as f:
            names = sorted(f.keys())
            name = "hidden" if "hidden" in names else names[0] if len(names) == 1 else None
            if name is None:
                shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5
                                                else "")
                raise KdaError(f"{path}: expected a tensor named 'hidden' or a single tensor, "
                               f"found {len(names)}{': ' if names else ''}{shown}")
            dtype = f.get_slice(name).get_dtype()
            if dtype not in SAFETENSORS_INPUT_DTYPES:
                raise KdaError(f"{path}: hidden states must be one of "
                               f"{', '.join(SAFETENSORS_INPUT_DTYPES)}, got {name!r} as {dtype}")
            return f.get_tensor(name)
    except KdaError:
        raise
    except Exception as e:  # safetensors raises its own error type for corrupt files
        raise KdaError(f"{path}: not a readable safetensors file ({e})") from None


def claim_output(path: str | Path, force: bool, protected: dict[Path, str]) -> PendingFile:
    """Claim a run's output file before the run (see `files.PendingFile`): `.npy` or
    `.safetensors`, never one of `protected` (its inputs, its checkpoint's files)."""
    if Path(path).suffix not in OUTPUT_SUFFIXES:
        raise KdaError(f"output {path}: must end in {' or '.join(OUTPUT_SUFFIXES)}")
    return PendingFile(path, force=force, protected=protected)


def write_output(out: PendingFile, result: RunResult) -> Path:
    """Write `result` to the claimed `out`: .safetensors keeps bf16 (`final_out`, plus both
    states); .npy holds final_out as fp32."""
    from safetensors.numpy import save_file

    def write(tmp: Path) -> None:
        if out.path.suffix == ".npy":
            with open(tmp, "wb") as f:
                np.save(f, result.final_out.astype(np.float32))
        else:
            save_file({"final_out": result.final_out, "recurrent_state": result.recurrent_state,
                       "conv_state": result.conv_state}, str(tmp))
    return out.commit(write)


DEMO = {"preset": "tiny", "gate": "softplus", "layers": 4, "seed": 0}


@contextmanager
def open_run_checkpoint(run: dict[str, Any]) -> Iterator[str]:
    """The checkpoint directory a run description names: its path, or the built-in demo
    regenerated (seeded, so bit-identical) in a temporary directory."""
    ck = run["checkpoint"]
    if "demo" in ck:
        d = ck["demo"]
        with tempfile.TemporaryDirectory(prefix="kdarun-demo-") as tmp:
            cfg = synthetic.preset_config(d["preset"], d["gate"], d["layers"])
            yield str(synthetic.write_checkpoint(tmp, cfg, seed=d["seed"]))
    else:
        if not Path(ck["path"]).is_dir():
            now = "is now a file" if Path(ck["path"]).exists() else "is not there any more"
            raise KdaError(f"checkpoint {ck['path']} of this run {now}")
        yield ck["path"]


def run_layer(gpu: GpuBackend, stack: KdaStack, layer_idx: int, hidden: np.ndarray,
              plan: RunPlan, stream: int = 0, recorder=None) -> RunResult:
    """Run `plan` through one layer from a zero state; hidden [>= plan.total, hidden] bf16.
    A `recorder` (stages.StageRecorder) sees every stage, keyed by call."""
    group = TpGroup.of(gpu, [stack], layer_idx, max_rows=1)
    try:
        return run_group(gpu, group, hidden, plan, stream, recorder)
    finally:
        group.free()


def run_group(gpu: GpuBackend, group: TpGroup, hidden: np.ndarray, plan: RunPlan,
              stream: int = 0, recorder=None) -> RunResult:
    """Run `plan` through the ranks of a tensor parallel group this process holds (one
    layer: a group of one) from zero states; hidden [>= plan.total, hidden] bf16. The
    result's states join the held ranks' (`tp.join_recurrent`, `tp.join_conv`). A
    `recorder` (stages.StageRecorder, a group of one only) sees every stage, keyed by call."""
    plan.check()
    ws0, cfg = group.ranks[0][1], group.cfg
    if recorder is not None and group.tp_size > 1:
        raise KdaError("run: stage dumps show one layer's buffers; a tensor parallel rank's "
                       "are partial (run with tp_size 1 to dump stages)")
    if hidden.shape[0] < plan.total:
        raise KdaError(f"run: {plan.total} tokens planned but only {hidden.shape[0]} hidden rows")
    hidden = np.ascontiguousarray(hidden[:plan.total].astype(BF16))
    h_dev = gpu.upload(hidden, stream)
    row = cfg.hidden_size * BF16.itemsize
    states = [KdaSeqState(gpu, cfg, stream) for _ in group.ranks]
    outs: list[np.ndarray] = []
    wall: dict[str, float] = {}
    layers = [layer for layer, _ in group.ranks]
    layers[0].stage_hook = recorder
    try:
        def timed(phase: str, fn, n_out: int, call: str) -> None:
            if recorder is not None:
                recorder.begin(call)
            for _, ws in group.ranks:
                ws.poison(stream)
            gpu.synchronize(stream)
            t0 = time.perf_counter()
            fn()
            gpu.synchronize(stream)
            wall[phase] = wall.get(phase, 0.0) + (time.perf_counter() - t0) * 1e3
            outs.append(ws0.read("final_out", n_out, stream))

        pos = 0
        if plan.prefill:
            timed("prefill", lambda: group.prefill(gpu, h_dev, plan.prefill, states, stream),
                  plan.prefill, "prefill")
            pos = plan.prefill
        for i in range(plan.decode_steps):
            p = pos
            timed("decode", lambda: group.decode(gpu, h_dev + p * row, states, stream), 1,
                  f"decode.{i}")
            pos += 1
        if plan.k:
            p = pos
            timed("decode_k", lambda: group.decode_k(gpu, h_dev + p * row, plan.k, states, None,
                                                     stream), plan.k, "decode_k")
        got = [st.download(stream) for st in states]
    finally:
        layers[0].stage_hook = None
        for st in states:
            st.free()
        gpu.free(h_dev)
    return RunResult(np.concatenate(outs), join_recurrent([r for r, _ in got]),
                     join_conv([c for _, c in got]), wall)


TP_MODES = ("in-turn", "nccl")


def run_tp(gpu: GpuBackend | None, ckpt_path: str | Path, layer_idx: int, hidden: np.ndarray,
           plan: RunPlan, tp_size: int, mode: str = "in-turn") -> RunResult:
    """Run `plan` through layer `layer_idx` of the checkpoint split over `tp_size` ranks by
    heads (`kdarun.tp`), from zero states: `in-turn`, every rank on `gpu` one after the
    other; `nccl`, one process a GPU (`gpu` unused: each rank opens its own), their results
    gathered. Either way final_out is the group's output and the states the ranks' joined,
    so the result compares with a single-GPU run's. Wall times are the slowest rank's."""
    plan.check()
    if mode not in TP_MODES:
        raise KdaError(f"run: tensor parallel mode must be one of {TP_MODES}, got {mode!r}")
    if mode == "nccl":
        ranks = launch(tp_size, run_tp_rank, str(ckpt_path), layer_idx, hidden, plan)
        for r, res in enumerate(ranks[1:], 1):
            if res.final_out.tobytes() != ranks[0].final_out.tobytes():
                raise KdaError(f"run: tp rank {r}'s final_out differs from rank 0's after the "
                               "all-reduce, which gives every rank the same sum")
        wall = {p: max(res.wall_ms[p] for res in ranks) for p in ranks[0].wall_ms}
        return RunResult(ranks[0].final_out, join_recurrent([r.recurrent_state for r in ranks]),
                         join_conv([r.conv_state for r in ranks]), wall)
    stacks: list[KdaStack] = []
    try:
        for r in range(tp_size):
            stacks.append(load_stack(gpu, ckpt_path, max(plan.prefill, plan.k, 1), [layer_idx],
                                     0, r, tp_size))
        group = TpGroup.of(gpu, stacks, layer_idx, max_rows=max(plan.prefill, plan.k, 1))
        try:
            return run_group(gpu, group, hidden, plan)
        finally:
            group.free()
    finally:
        for s in stacks:
            s.free(gpu)


def run_tp_rank(gpu: GpuBackend, comm: NcclComm, ckpt_path: str, layer_idx: int,
                hidden: np.ndarray, plan: RunPlan) -> RunResult:
    """One NCCL rank of `run_tp`: its share of the layer, its states, the group's output."""
    rows = max(plan.prefill, plan.k, 1)
    stack = load_stack(gpu, ckpt_path, rows, [layer_idx], 0, comm.rank, comm.size)
    gpu.synchronize(0)  # the uploads and zeroing ran on the legacy stream, which ours skips
    stream = gpu.create_stream()
    try:
        group = TpGroup.of(gpu, [stack], layer_idx, comm, rows)
        try:
            return run_group(gpu, group, hidden, plan, stream)
        finally:
            group.free()
    finally:
        gpu.destroy_stream(stream)
        stack.free(gpu)


@dataclass
class ErrorReport:
    rel: float
    max_abs: float
    nonfinite: int

    def ok(self, tol: float) -> bool:
        return self.nonfinite == 0 and self.rel < tol


def compare(out: np.ndarray, ref: np.ndarray) -> ErrorReport:
    """rel = ||out - ref|| / ||ref|| and max |out - ref|; NaN/Inf never pass, counted in both
    (`ref` is another dump's stage under `stages --against`)."""
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if o.shape != r.shape:
        raise KdaError(f"compare: shape {list(o.shape)} vs reference {list(r.shape)}")
    bad = int(np.count_nonzero(~np.isfinite(o)) + np.count_nonzero(~np.isfinite(r)))
    if bad:
        return ErrorReport(float("nan"), float("nan"), bad)
    d = o - r
    denom = np.linalg.norm(r)
    rel = float(np.linalg.norm(d) / denom) if denom > 0 else float(np.linalg.norm(d))
    return ErrorReport(rel, float(np.abs(d).max(initial=0.0)), 0)


def reference_run(stack: KdaStack, layer_idx: int, hidden: np.ndarray,
                  tensors: dict[str, np.ndarray] | None = None,
                  rounding: reference.Rounding = reference.EXACT) -> reference.ReferenceRun:
    """The float64 reference of the whole layer (also for a tensor parallel rank's stack)
    over the same tokens from a zero state, on the layer's `tensors` (default: read whole
    from the stack's checkpoint), rounded where `rounding` says."""
    return reference_of(stack.checkpoint, layer_idx, hidden, tensors, rounding)


def reference_of(ckpt: Checkpoint, layer_idx: int, hidden: np.ndarray,
                 tensors: dict[str, np.ndarray] | None = None,
                 rounding: reference.Rounding = reference.EXACT) -> reference.ReferenceRun:
    """The float64 reference of layer `layer_idx` of `ckpt` over `hidden` from a zero state,
    on `tensors` (default: the layer's, read whole), rounded where `rounding` says."""
    cfg = ckpt.config
    if tensors is None:
        tensors = ckpt.layer_tensors(layer_idx)
    return reference.layer(cfg, tensors, hidden, np.zeros(recurrent_shape(cfg)),
                           np.zeros(conv_shape(cfg)), rounding=rounding)
