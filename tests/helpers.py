"""Helpers shared by the CPU and GPU tests: a bound layer on any backend, error measures."""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np
import pytest

from kdarun import KdaSeqState, open_backend, prefill_windowed, reference
from kdarun.backend import GpuBackend
from kdarun.dtypes import BF16
from kdarun.loader import load_stack
from kdarun.run import compare, random_hidden
from kdarun.state import conv_shape, recurrent_shape

GATES = ("softplus", "bounded")

# End to end, bf16 rounding at ~8 points compounds to <= 7.0e-3 (measured on the host: T 1..200,
# both gates, zero and warm states); the tolerances leave ~1.7x headroom.
E2E_TOL = 1.2e-2
STATE_TOL = 8e-3  # measured <= 4.0e-3
# Stage-local: each stage fed the buffers the previous kernel actually wrote.
BF16_OUT_TOL = 3e-3  # one bf16 rounding of the output: measured <= 1.8e-3
FP32_TOL = 1e-4  # fp32 arithmetic only
# A stage against the float64 reference rounded where kdarun rounds (reference.KDARUN), fed the
# stage's own inputs: what is left is fp32 arithmetic and the rare value it lands on the other
# side of a bf16 rounding (one unrounded point, the SiLU's, measured 2.6e-3).
ROUNDED_TOL = 5e-4


def host_with_sms(sm_count: int) -> GpuBackend:
    """A host backend that reports `sm_count` SMs, so launch plans are those of a GPU that size
    (132: the H200)."""
    host = open_backend("host", announce=False)

    class Sized(type(host)):
        pass
    Sized.sm_count = sm_count
    return Sized()


@contextmanager
def forced_core(core: str):
    """Layers bound inside take the chunked core's walk `core` ("hopper", "portable", or
    "portable:64" / "portable:32" for its blocks of that many state rows), by KDARUN_CORE and
    KDARUN_WALK_ROWS (the documented switches), which are restored after."""
    def put(values: dict[str, str | None]) -> None:  # None: unset
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    name, _, rows = core.partition(":")
    want = {"KDARUN_CORE": name, "KDARUN_WALK_ROWS": rows or None}
    before = {k: os.environ.get(k) for k in want}
    put(want)
    try:
        yield
    finally:
        put(before)


class Env:
    """One bound layer on one backend with helpers to run it and read results."""

    def __init__(self, gpu, path: str, max_tokens: int, layer_idx: int = 1):
        self.gpu = gpu
        self.stack = load_stack(gpu, path, max_tokens, [layer_idx])
        self.cfg = self.stack.cfg
        self.layer = self.stack.layer(layer_idx)
        self.ws = self.stack.workspace
        self.tensors = self.stack.checkpoint.layer_tensors(layer_idx)
        self.row = self.cfg.hidden_size * BF16.itemsize

    def state(self, recurrent=None, conv=None) -> KdaSeqState:
        s = KdaSeqState(self.gpu, self.cfg)
        if recurrent is not None:
            s.upload(recurrent.astype(np.float32), conv.astype(BF16))
        return s

    def warm_state(self, seed: int, tokens: int = 50):
        """A realistic non-zero carried state: the host-free reference after a random
        prefix, rounded to the state dtypes."""
        h = random_hidden(tokens, self.cfg.hidden_size, seed)
        r = self.ref(h)
        return r.recurrent_state.astype(np.float32), r.conv_state.astype(BF16)

    def ref(self, hidden, recurrent=None, conv=None, chunked=False):
        recurrent = np.zeros(recurrent_shape(self.cfg)) if recurrent is None else recurrent
        conv = np.zeros(conv_shape(self.cfg)) if conv is None else conv
        return reference.layer(self.cfg, self.tensors, hidden, recurrent, conv, chunked)

    def core_reference(self, T: int, recurrent):
        """(core, state) of the float64 recurrence from state `recurrent`, fed what the chunked
        core read in the last prefill of T tokens: q, k, v in conv_out, and the gate and beta
        it formed, which that prefill's stage hook had kda_gate_beta write (stage_copies)."""
        rd = lambda n: self.ws.read(n, T)[:T].astype(np.float64)  # noqa: E731
        H, D = self.cfg.num_heads, self.cfg.head_dim
        qkv = rd("conv_out").reshape(T, 3, H, D).transpose(1, 0, 2, 3)
        return reference.core_recurrent(self.cfg, *qkv, rd("gate"), rd("beta"), recurrent)

    def prefill(self, hidden, state, pad_fill=0.0, stage_copies=False):
        """final_out of a prefill on a poisoned workspace; with stage_copies, under a stage
        hook that keeps nothing, so the stage copies no kernel reads (qkv_parts, q/k/v_f32)
        are filled as well."""
        h = self.gpu.upload(hidden)
        self.ws.poison(0)
        if stage_copies:
            self.layer.stage_hook = lambda stage, gpu, stream: None
        try:
            self.layer.prefill_with_pad_fill(self.gpu, h, hidden.shape[0], state, self.ws,
                                             pad_fill, 0)
        finally:
            self.layer.stage_hook = None
        out = self.ws.read("final_out", hidden.shape[0])
        self.gpu.free(h)
        return out

    def decode(self, hidden_row, state):
        h = self.gpu.upload(hidden_row.reshape(1, -1))
        self.ws.poison(0)
        self.layer.decode(self.gpu, h, state, self.ws, 0)
        out = self.ws.read("final_out", 1)
        self.gpu.free(h)
        return out


def rel(out, ref) -> float:
    e = compare(out, ref)
    assert e.nonfinite == 0, f"{e.nonfinite} non-finite values"
    return e.rel


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def assert_poisoned_pad_changes_nothing(env: Env, T: int, fill: float, seed: int) -> None:
    """A prefill of T tokens on a workspace poisoned with NaN (conv_out's, g_raw's and
    gate_in's rows past T too, which the chunk kernels' loads never reach unselected), under a
    stage hook with the padded rows of the stage buffers written as `fill` (NaN, +-1e30), gives
    the bits of a plain prefill: output, core and both states. Those rows do hold the fill, and
    the plain run's output is finite."""
    R, C = env.warm_state(seed=seed)
    h = random_hidden(T, env.cfg.hidden_size, seed=seed + 1)
    plain_state, poison_state = env.state(R, C), env.state(R, C)
    plain_out = env.prefill(h, plain_state)
    assert np.isfinite(plain_out.astype(np.float32)).all()
    plain_core = env.ws.read("core", T)[:T]
    poison_out = env.prefill(h, poison_state, pad_fill=fill, stage_copies=True)
    for name in ("gate", "beta", "q_f32", "k_f32", "v_f32"):
        tail = env.ws.read(name, T)[T:]
        assert tail.size == 0 or np.array_equal(tail, np.full_like(tail, fill), equal_nan=True)
    assert np.array_equal(bits(poison_out), bits(plain_out))
    assert np.array_equal(bits(env.ws.read("core", T)[:T]), bits(plain_core))
    for a, b in zip(poison_state.download(), plain_state.download()):
        assert np.array_equal(bits(a), bits(b))


def assert_decode_k_matches_serial(env: Env, K: int, seed: int) -> None:
    """decode_k over K rows is bit-identical to K serial decodes: outputs, every snapshot and
    the final states."""
    gpu = env.gpu
    R, C = env.warm_state(seed=seed)
    h = random_hidden(K, env.cfg.hidden_size, seed=seed + 1)
    serial = env.state(R, C)
    outs, snaps = [], []
    for t in range(K):
        outs.append(env.decode(h[t], serial))
        snaps.append(serial.download())
    batch = env.state(R, C)
    dst = [env.state() for _ in range(K - 1)]
    hp = gpu.upload(h)
    env.ws.poison(0)
    env.layer.decode_k(gpu, hp, K, batch, env.ws, [(s.recurrent, s.conv) for s in dst], 0)
    assert np.array_equal(bits(env.ws.read("final_out", K)), bits(np.concatenate(outs)))
    for t, s in enumerate(dst):
        for a, b in zip(s.download(), snaps[t]):
            assert np.array_equal(bits(a), bits(b)), f"snapshot after row {t}"
    for a, b in zip(batch.download(), snaps[-1]):
        assert np.array_equal(bits(a), bits(b))
    gpu.free(hp)


def assert_windowed_matches_one(small: Env, big: Env, T: int, seed: int, out_tol: float,
                                state_tol: float) -> None:
    """prefill_windowed through `small`'s workspace equals one prefill through `big`'s."""
    gpu = big.gpu
    R, C = big.warm_state(seed=seed)
    h = random_hidden(T, big.cfg.hidden_size, seed=seed + 1)
    one_state = big.state(R, C)
    one = big.prefill(h, one_state)
    win_state = small.state(R, C)
    hp, out = gpu.upload(h), gpu.alloc(h.nbytes)
    prefill_windowed(small.layer, gpu, hp, T, win_state, small.ws, out, 0)
    assert rel(gpu.download(out, h.shape, BF16), one) < out_tol
    assert rel(win_state.download()[0], one_state.download()[0]) < state_tol
    gpu.free(hp), gpu.free(out)


def batch_states(env: Env, n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """n distinct warm states (recurrent fp32, conv bf16): a warm state scaled per sequence."""
    R, C = env.warm_state(seed=seed)
    rng = np.random.default_rng(seed)
    return [((R * rng.uniform(0.5, 1.5)).astype(np.float32),
             (C.astype(np.float32) * rng.uniform(0.5, 1.5)).astype(BF16)) for _ in range(n)]


def assert_batch_matches_single(env: Env, B: int, K: int, seed: int, pad: int = 2) -> None:
    """decode_batch (K = 1) or verify_batch over B sequences in shuffled pool slots with `pad`
    padding rows among them equals, bit for bit, decode / decode_k of each sequence alone on
    the same state: outputs, final states and snapshots; slots no row names keep their bytes."""
    from kdarun.pool import KdaStatePool
    gpu, cfg = env.gpu, env.cfg
    rng = np.random.default_rng(seed)
    rows = B + pad
    nseq_slots = B + 3  # 3 spare slots no row names
    nsnap = rows * (K - 1)  # snapshot slots after the sequences'
    pool = KdaStatePool(gpu, cfg, nseq_slots + nsnap)
    order = rng.permutation(rows)  # sequence i sits at row order[i]; the rest are padding
    slot_of = rng.permutation(nseq_slots)[:B]
    table = np.full(rows, -1, np.int32)
    table[order[:B]] = slot_of
    snap_table = (nseq_slots + rng.permutation(nsnap)).astype(np.int32).reshape(rows, K - 1)
    snap_table[order[B:]] = -1  # padding rows snapshot nothing
    if K > 2:
        snap_table[order[0], 0] = -1  # a skipped snapshot of a real sequence
    states = batch_states(env, B, seed)
    untouched = [s for s in range(pool.slots) if s not in set(slot_of) | set(snap_table.ravel())]
    poison = (np.full((cfg.num_heads, cfg.head_dim, cfg.head_dim), np.nan, np.float32),
              np.full((cfg.conv_kernel - 1, cfg.conv_dim), 7.0, np.float32).astype(BF16))
    for s in untouched:
        pool.upload(s, *poison)
    for i, s in enumerate(slot_of):
        pool.upload(int(s), *states[i])
    h = random_hidden(rows * K, cfg.hidden_size, seed + 1)
    d_table, d_snap, d_h = gpu.upload(table), gpu.upload(snap_table), gpu.upload(h)
    env.ws.poison(0)
    if K == 1:
        env.layer.decode_batch(gpu, d_h, rows, d_table, pool, env.ws, 0)
    else:
        env.layer.verify_batch(gpu, d_h, rows, K, d_table, pool, env.ws, d_snap, 0)
    out = env.ws.read("final_out", rows * K)
    for i in range(B):
        r = int(order[i])
        single = env.state(*states[i])
        dst = [env.state() for _ in range(K - 1)]
        hp = gpu.upload(np.ascontiguousarray(h[r * K:(r + 1) * K]))
        env.ws.poison(0)
        if K == 1:
            env.layer.decode(gpu, hp, single, env.ws, 0)
        else:
            env.layer.decode_k(gpu, hp, K, single, env.ws, [(d.recurrent, d.conv) for d in dst], 0)
        assert np.array_equal(bits(out[r * K:(r + 1) * K]), bits(env.ws.read("final_out", K))), \
            f"sequence {i}: output"
        for a, b in zip(pool.download(int(slot_of[i])), single.download()):
            assert np.array_equal(bits(a), bits(b)), f"sequence {i}: state"
        for t, d in enumerate(dst):
            if snap_table[r, t] >= 0:
                for a, b in zip(pool.download(int(snap_table[r, t])), d.download()):
                    assert np.array_equal(bits(a), bits(b)), f"sequence {i}: snapshot {t}"
        gpu.free(hp)
        for st in (single, *dst):
            st.free()
    for s in untouched:
        rec, conv = pool.download(s)
        assert np.isnan(rec).all() and np.array_equal(bits(conv), bits(poison[1])), f"slot {s}"
    for p in (d_table, d_snap, d_h):
        gpu.free(p)
    pool.free()


def _run_past_the_check(env: Env, h, rows: int, K: int, table, pool, snaps,
                        checked_by_call: bool) -> None:
    """decode_batch (K = 1) or verify_batch of `rows` rows; where the call checks its tables
    first (`checked_by_call`: the host backend) it must refuse them, and its steps then run
    without the check, as the CUDA path runs them."""
    from kdarun import KdaError
    from kdarun.layer import SeqRows
    gpu, layer = env.gpu, env.layer

    def call():
        if K == 1:
            layer.decode_batch(gpu, h, rows, table, pool, env.ws, 0)
        else:
            layer.verify_batch(gpu, h, rows, K, table, pool, env.ws, snaps, 0)
    if not checked_by_call:
        return call()
    with pytest.raises(KdaError, match="neither -1"):
        call()
    layer.run_steps(gpu, layer.batch_steps(h, rows, K, table, pool, env.ws, snaps), rows * K,
                    None, env.ws, 0, SeqRows.uniform(rows, K))


def assert_bad_entries_touch_nothing(env: Env, K: int, checked_by_call: bool) -> None:
    """A slot table entry outside [-1, slots) that reaches the batch kernels acts as -1 and is
    recorded: decode_batch (K = 1) of three rows, the middle one's slot bad: that row touches
    no state; verify_batch (K = 3) of two rows whose snapshot slot entry 3 (row 1, after its
    second token) is bad: that snapshot is not stored, the row runs. Every slot no good entry
    names keeps its bytes, the good rows equal their sequences' decode / decode_k bit for bit
    (snapshots too), and pool.check_faults names the bad entry, once."""
    from kdarun import KdaError
    from kdarun.pool import KdaStatePool
    gpu, cfg = env.gpu, env.cfg
    pool = KdaStatePool(gpu, cfg, 4)
    states = batch_states(env, 2, seed=70 + K)
    for s in range(4):
        pool.upload(s, *(states[s] if s < 2 else env.warm_state(seed=72 + s)))
    before = [pool.download(s) for s in range(4)]
    table = [0, 9, 1] if K == 1 else [0, 1]
    snaps = None if K == 1 else [[2, -1], [-1, 7]]
    rows = len(table)
    h = random_hidden(rows * K, cfg.hidden_size, 74)
    d_table, d_h = gpu.upload(np.array(table, np.int32)), gpu.upload(h)
    d_snap = None if snaps is None else gpu.upload(np.array(snaps, np.int32))
    env.ws.poison(0)
    _run_past_the_check(env, d_h, rows, K, d_table, pool, d_snap, checked_by_call)
    out = env.ws.read("final_out", rows * K)
    kind, entry, value, lost = (("slot", 1, 9, "that row read and wrote no state") if K == 1
                                else ("snapshot slot", 3, 7, "that snapshot was not stored"))
    with pytest.raises(KdaError, match=f"met {kind} {value} at entry {entry} of its table, "
                       r"neither -1 \(skip\) nor a slot in \[0, 4\); " + lost):
        pool.check_faults()
    pool.check_faults()  # cleared
    good = {0: 0, 2: 1} if K == 1 else {0: 0, 1: 1}  # row -> sequence (= its slot)
    for r, i in good.items():
        single, dst = env.state(*states[i]), [env.state() for _ in range(K - 1)]
        hp = gpu.upload(np.ascontiguousarray(h[r * K:(r + 1) * K]))
        if K == 1:
            env.layer.decode(gpu, hp, single, env.ws, 0)
        else:
            env.layer.decode_k(gpu, hp, K, single, env.ws, [(d.recurrent, d.conv) for d in dst], 0)
        assert np.array_equal(bits(out[r * K:(r + 1) * K]), bits(env.ws.read("final_out", K)))
        for a, b in zip(pool.download(i), single.download()):
            assert np.array_equal(bits(a), bits(b)), f"row {r}: state"
        if K > 1 and r == 0:  # row 0's snapshot after its first token went to slot 2
            for a, b in zip(pool.download(2), dst[0].download()):
                assert np.array_equal(bits(a), bits(b)), "row 0: snapshot"
        gpu.free(hp)
        for st in (single, *dst):
            st.free()
    for s in ((2, 3) if K == 1 else (3,)):  # named by no good entry
        for x, y in zip(before[s], pool.download(s)):
            assert np.array_equal(bits(x), bits(y)), f"slot {s}"
    for p in (d_table, d_h) + (() if d_snap is None else (d_snap,)):
        gpu.free(p)
    pool.free()


def assert_bad_slot_of_one_touches_nothing(env: Env, checked_by_call: bool) -> None:
    """A batch of one sequence and one row takes decode's own launch at its slot
    (`batch_rows_kernel`); a slot outside the pool there touches no state either, and
    pool.check_faults names it."""
    from kdarun import KdaError
    from kdarun.pool import KdaStatePool
    gpu, cfg = env.gpu, env.cfg
    assert env.layer.kernels.batch_rows_kernel(1, 1).startswith("kda_decode_rows_slot")
    pool = KdaStatePool(gpu, cfg, 2)
    for s in range(2):
        pool.upload(s, *env.warm_state(seed=80 + s))
    before = [pool.download(s) for s in range(2)]
    table = gpu.upload(np.array([2], np.int32))
    h = gpu.upload(random_hidden(1, cfg.hidden_size, 82))
    _run_past_the_check(env, h, 1, 1, table, pool, None, checked_by_call)
    with pytest.raises(KdaError, match=r"met slot 2 at entry 0 of its table"):
        pool.check_faults()
    for s in range(2):
        for x, y in zip(before[s], pool.download(s)):
            assert np.array_equal(bits(x), bits(y)), f"slot {s}"
    gpu.free(table)
    gpu.free(h)
    pool.free()


GEMM_INPUTS = ("qkv_proj", "gate_in", "g_raw", "out_gate")  # the GEMMs' outputs the core reads


def assert_packed_matches_alone(env: Env, lengths: list[int], initial: list[bool], seed: int,
                                checkpoint_every: int = 0, gemm_exact: bool = True,
                                out_tol: float = 0.0, state_tol: float = 0.0
                                ) -> dict[str, float]:
    """prefill_packed of sequences of `lengths` (each with or without its initial state) in
    shuffled pool slots, against each sequence alone:
    - given the packed call's GEMM outputs (the pack in one window), each sequence's o_norm_out
      rows, final state and checkpoints equal bit for bit the rest of `prefill` on it alone
      (or on its prefix): nothing after the GEMMs depends on the pack;
    - with its own GEMMs (`prefill` of it, of its prefix for a checkpoint), outputs and states
      equal bit for bit where `gemm_exact` (the host's GEMMs round a row alike for any row
      count), else within out_tol / state_tol (cuBLAS may pick another algorithm for another
      row count); returns the largest differences;
    - every sequence within E2E_TOL (output) and STATE_TOL (state) of the float64 reference;
    - slots no sequence names (a skipped checkpoint's among them) keep their bytes, and a
      zero-state sequence's slot, poisoned, is never read."""
    from kdarun import KdaStatePool, prefill_packed
    gpu, cfg, ws, layer = env.gpu, env.cfg, env.ws, env.layer
    rng = np.random.default_rng(seed)
    n, every = len(lengths), checkpoint_every
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(bounds[-1])
    one_window = total <= ws.max_tokens() and sum(cfg.t_pad(t) for t in lengths) <= ws.t_pad()
    h = random_hidden(total, cfg.hidden_size, seed)
    states = batch_states(env, n, seed)
    nck = [t // every if every else 0 for t in lengths]
    pool = KdaStatePool(gpu, cfg, n + sum(nck) + 2)  # two spare slots no sequence names
    order = [int(x) for x in rng.permutation(pool.slots)]
    slots, rest = order[:n], order[n:]
    ck = [[rest.pop() for _ in range(k)] for k in nck]
    skipped = []
    for c in ck:
        if len(c) > 1:  # one skipped checkpoint
            skipped.append(c[-1])
            c[-1] = -1
            break
    poison = (np.full(recurrent_shape(cfg), np.nan, np.float32),
              np.full(conv_shape(cfg), 7.0, np.float32).astype(BF16))
    untouched = rest + skipped
    for s in untouched + [s for s, init in zip(slots, initial) if not init]:
        pool.upload(s, *poison)
    for i, s in enumerate(slots):
        if initial[i]:
            pool.upload(s, *states[i])
    d_h, out = gpu.upload(h), gpu.alloc(h.nbytes)
    gpu.memset(out, 0xFF, h.nbytes, 0)
    ws.poison(0)
    prefill_packed(layer, gpu, d_h, bounds, slots, initial, pool, ws, out, 0, every,
                   ck if every else None)
    got = gpu.download(out, h.shape, h.dtype)
    gemms = {name: ws.read(name, total) for name in GEMM_INPUTS} if one_window else {}
    normed = ws.read("o_norm_out", total) if one_window else None
    diff = {"final_out": 0.0, "state": 0.0}

    def start(i: int) -> KdaSeqState:
        return env.state(*states[i]) if initial[i] else env.state()

    def given_gemms(a: int, m: int, state: KdaSeqState) -> np.ndarray:
        """The rest of prefill over m rows from packed row a, fed the packed GEMM outputs."""
        ws.poison(0)
        for name, rows in gemms.items():
            gpu.copy_h2d(ws.ptr(name), np.ascontiguousarray(rows[a:a + m]), 0)
        steps = [st for st in layer.prefill_steps(d_h, m, state, ws) if not st.gemm]
        layer.run_steps(gpu, steps, m, state, ws, 0)
        return ws.read("o_norm_out", m)

    def prefill(x: np.ndarray, state: KdaSeqState) -> np.ndarray:
        """`prefill` of x alone, in windows (prefill_windowed) past the workspace."""
        if x.shape[0] <= ws.max_tokens():
            return env.prefill(x, state)
        hp, o = gpu.upload(x), gpu.alloc(x.nbytes)
        prefill_windowed(layer, gpu, hp, x.shape[0], state, ws, o, 0)
        y = gpu.download(o, x.shape, x.dtype)
        gpu.free(hp), gpu.free(o)
        return y

    def same(x, y, tol, what, key):
        if gemm_exact:
            assert np.array_equal(bits(x), bits(y)), what
        else:
            e = rel(x, y)
            diff[key] = max(diff[key], e)
            assert e < tol, (what, e)

    for i in range(n):
        a, b = int(bounds[i]), int(bounds[i + 1])
        ref = env.ref(h[a:b], *(states[i] if initial[i] else (None, None)))
        assert rel(got[a:b], ref.stages["final_out"]) < E2E_TOL, f"sequence {i}: reference"
        final = pool.download(slots[i])
        assert rel(final[0], ref.recurrent_state) < STATE_TOL, f"sequence {i}: reference state"
        if one_window:
            alone = start(i)
            assert np.array_equal(bits(normed[a:b]), bits(given_gemms(a, b - a, alone))), \
                f"sequence {i}: o_norm_out given the GEMMs"
            for x, y in zip(final, alone.download()):
                assert np.array_equal(bits(x), bits(y)), f"sequence {i}: state given the GEMMs"
            alone.free()
            for j, slot in enumerate(ck[i]):
                if slot >= 0:
                    prefix = start(i)
                    given_gemms(a, (j + 1) * every, prefix)
                    for x, y in zip(pool.download(slot), prefix.download()):
                        assert np.array_equal(bits(x), bits(y)), \
                            f"sequence {i}: checkpoint {j} given the GEMMs"
                    prefix.free()
        alone = start(i)
        same(got[a:b], prefill(h[a:b], alone), out_tol, f"sequence {i}: output",
             "final_out")
        for x, y in zip(final, alone.download()):
            same(x, y, state_tol, f"sequence {i}: state", "state")
        alone.free()
        for j, slot in enumerate(ck[i]):
            if slot >= 0:
                prefix = start(i)
                prefill(h[a:a + (j + 1) * every], prefix)
                for x, y in zip(pool.download(slot), prefix.download()):
                    same(x, y, state_tol, f"sequence {i}: checkpoint {j}", "state")
                prefix.free()
    for s in untouched:
        rec, conv = pool.download(s)
        assert np.isnan(rec).all() and np.array_equal(bits(conv), bits(poison[1])), f"slot {s}"
    gpu.free(d_h), gpu.free(out)
    pool.free()
    return diff
