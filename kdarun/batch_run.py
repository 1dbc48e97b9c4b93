"""A serving run of one layer: N sequences of random lengths through one packed prefill, a few
batched decode steps and one batched verify, each sequence checked against the float64
reference rounded where kdarun's buffers are bf16 (`reference.KDARUN`). `kdarun layer-run
--batch N` is a thin shell over this."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import reference
from .backend import GpuBackend
from .dtypes import BF16
from .errors import KdaError
from .layer import prefill_packed
from .loader import KdaStack
from .pool import KdaStatePool
from .run import compare, random_hidden
from .stages import StageRecorder
from .state import CONV_LAYOUT, RECURRENT_LAYOUT, conv_shape, recurrent_shape

BATCH_TOL = 1e-2  # end to end against reference.KDARUN, as a single-sequence run


@dataclass
class SequenceCheck:
    """One sequence of a serving run: its slot, its prefill length, the error of all its
    output rows and of its final recurrent state against the float64 reference."""
    sequence: int
    slot: int
    prefill: int
    out_rel: float
    state_rel: float
    nonfinite: int

    @property
    def ok(self) -> bool:
        return self.nonfinite == 0 and self.out_rel < BATCH_TOL and self.state_rel < BATCH_TOL


def batch_plan(n: int, max_prompt: int, seed: int) -> tuple[list[int], list[int]]:
    """Prompt lengths in [1, max_prompt] (the first ones 1, 63, 64, 65 where they fit) and
    distinct slots in [0, 2n) for n sequences."""
    rng = np.random.default_rng(seed)
    fixed = [t for t in (1, 63, 64, 65) if t <= max_prompt][:n]
    lengths = fixed + [int(x) for x in rng.integers(1, max_prompt + 1, n - len(fixed))]
    return lengths, [int(s) for s in rng.permutation(2 * n)[:n]]


@dataclass
class BatchRun:
    """What a serving run did: each sequence's check, prompt length and slot, and its input,
    every sequence's rows (prompt, decode rows, verify rows) one sequence after the other."""
    checks: list[SequenceCheck]
    lengths: list[int]
    slots: list[int]
    hidden: np.ndarray  # [sum(lengths) + n * (decode_steps + k), hidden] bf16


def run_batch(gpu: GpuBackend, stack: KdaStack, layer_idx: int, n: int, seed: int,
              max_prompt: int, decode_steps: int = 2, k: int = 3, stream: int = 0,
              recorder: StageRecorder | None = None) -> BatchRun:
    """n sequences of random prompt lengths up to max_prompt, from zero states, through
    `prefill_packed`, `decode_steps` calls of `decode_batch` and one `verify_batch` of k rows
    each; every sequence against the float64 reference over the same rows. With `recorder`
    every stage of every call is recorded, keyed by sequence (see `stages`), and each
    sequence's states after each call from its pool slot."""
    layer, ws, cfg = stack.layer(layer_idx), stack.workspace, stack.cfg
    need = max(n * k, n, max_prompt)
    if n < 1 or k < 1 or max_prompt < 1 or need > ws.max_tokens():
        raise KdaError(f"batch run: {n} sequences, prompts up to {max_prompt} tokens and {k} "
                       f"verify rows each need a workspace of {need} tokens and positive "
                       f"counts; the workspace has {ws.max_tokens()}")
    lengths, slots = batch_plan(n, max_prompt, seed)
    rows = [random_hidden(t + decode_steps + k, cfg.hidden_size, seed + 1 + i)
            for i, t in enumerate(lengths)]  # each sequence's rows, in the order it sees them
    pool = KdaStatePool(gpu, cfg, 2 * n, stream)
    table = gpu.upload(np.array(slots, np.int32), stream)
    outs: list[list[np.ndarray]] = [[] for _ in range(n)]

    def begin(call: str) -> None:
        if recorder is not None:
            recorder.begin(call)

    def states(call: str) -> None:  # each sequence's states after the call, from its slot
        for i, slot in enumerate(slots if recorder is not None else ()):
            rec, conv = pool.download(slot, stream)
            recorder.record(f"seq{i}.{call}/state.recurrent", "pool", rec, 0, RECURRENT_LAYOUT)
            recorder.record(f"seq{i}.{call}/state.conv", "pool", conv, 0, CONV_LAYOUT)

    try:
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        packed = gpu.upload(np.concatenate([r[:t] for r, t in zip(rows, lengths)]), stream)
        out = gpu.alloc(int(bounds[-1]) * cfg.hidden_size * BF16.itemsize)
        begin("prefill")
        layer.stage_hook = recorder
        prefill_packed(layer, gpu, packed, bounds, slots, [False] * n, pool, ws, out, stream)
        states("prefill")
        got = gpu.download(out, (int(bounds[-1]), cfg.hidden_size), BF16, stream)
        gpu.free(packed), gpu.free(out)
        for i in range(n):
            outs[i].append(got[bounds[i]:bounds[i + 1]])
        for step in range(decode_steps):
            h = gpu.upload(np.stack([r[t + step] for r, t in zip(rows, lengths)]), stream)
            begin(f"decode.{step}")
            layer.decode_batch(gpu, h, n, table, pool, ws, stream)
            states(f"decode.{step}")
            got = ws.read("final_out", n, stream)
            gpu.free(h)
            for i in range(n):
                outs[i].append(got[i:i + 1])
        start = [t + decode_steps for t in lengths]
        h = gpu.upload(np.concatenate([r[s:s + k] for r, s in zip(rows, start)]), stream)
        begin("verify")
        layer.verify_batch(gpu, h, n, k, table, pool, ws, None, stream)
        states("verify")
        got = ws.read("final_out", n * k, stream)
        gpu.free(h)
        tensors = stack.checkpoint.layer_tensors(layer_idx)
        checks = []
        for i in range(n):
            outs[i].append(got[i * k:(i + 1) * k])
            ref = reference.layer(cfg, tensors, rows[i], np.zeros(recurrent_shape(cfg)),
                                  np.zeros(conv_shape(cfg)), rounding=reference.KDARUN)
            o = compare(np.concatenate(outs[i]), ref.stages["final_out"])
            s = compare(pool.download(slots[i], stream)[0], ref.recurrent_state)
            checks.append(SequenceCheck(i, slots[i], lengths[i], o.rel, s.rel,
                                        o.nonfinite + s.nonfinite))
    finally:
        layer.stage_hook = None
        gpu.free(table)
        pool.free()
    return BatchRun(checks, lengths, slots, np.concatenate(rows))
