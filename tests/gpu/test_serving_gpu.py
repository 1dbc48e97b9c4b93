"""Serving on CUDA: batched decode and batched verify bit-identical, sequence by sequence, to
the single-sequence calls; slot table entries outside the pool recorded, never followed; graph
replays with new slot tables; the same calls on PyTorch's
tensors and stream, inside its graph capture too; packed prefill, on each walk of the chunked
core."""

from __future__ import annotations

import numpy as np
import pytest

from kdarun import DevicePtr, KdaError, kernels
from kdarun.dtypes import BF16
from kdarun.kernels import SMEM_PER_BLOCK, decode_batch_bulk
from kdarun.pool import KdaStatePool
from kdarun.run import random_hidden

from ..helpers import (Env, assert_bad_entries_touch_nothing,
                       assert_bad_slot_of_one_touches_nothing, assert_batch_matches_single,
                       assert_packed_matches_alone, bits, forced_core)


@pytest.mark.parametrize("B", [1, 3, 8, 64, 100])
def test_decode_batch_bit_identical_to_decode(pair, B):
    cu, _ = pair
    assert_batch_matches_single(cu, B, 1, seed=100 + B)


@pytest.mark.parametrize("B", [8, 14])
def test_decode_gemvs_in_two_groups_keep_decodes_bits(pair, monkeypatch, B):
    """With DECODE_GEMV_GROUPS = 2 (the default) a batch of 9-16 rows (B sequences and two
    padding rows) takes decode's _x2 GEMV entries (checked by the launches it makes):
    bit-identical to decode."""
    cu, _ = pair
    monkeypatch.setattr(kernels, "DECODE_GEMV_GROUPS", 2)
    kn, launched = cu.layer.kernels, []
    launch = kn._launch
    monkeypatch.setattr(kn, "_launch", lambda family, name, *rest: (launched.append(name),
                                                                     launch(family, name, *rest)))
    assert_batch_matches_single(cu, B, 1, seed=150 + B)
    assert {"front_end_gemv_x2", "dense_gemv_bf16_x2"} <= set(launched)


@pytest.mark.parametrize("front_rows, dense_rows", [(8, 16), (16, 8)])
def test_mixed_gemv_plans_keep_decodes_bits(pair, monkeypatch, front_rows, dense_rows):
    """14 sequences and two padding rows with one GEMV on its _x2 entry and the other on the
    batch kernels (FRONT_END_X2_ROWS, DENSE_X2_ROWS; checked by the launches it makes):
    bit-identical to decode."""
    cu, _ = pair
    monkeypatch.setattr(kernels, "DECODE_GEMV_GROUPS", 2)
    monkeypatch.setattr(kernels, "FRONT_END_X2_ROWS", front_rows)
    monkeypatch.setattr(kernels, "DENSE_X2_ROWS", dense_rows)
    kn, launched = cu.layer.kernels, []
    launch = kn._launch
    monkeypatch.setattr(kn, "_launch", lambda family, name, *rest: (launched.append(name),
                                                                     launch(family, name, *rest)))
    assert_batch_matches_single(cu, 14, 1, seed=170 + front_rows)
    assert ("front_end_gemv_x2" in launched) == (front_rows == 16)
    assert ("dense_gemv_bf16_x2" in launched) == (dense_rows == 16)


def test_decode_batch_of_one_is_decode(pair, monkeypatch):
    """A batch of one sequence takes decode's own launch at its slot (checked by the launches
    it makes): bit-identical to decode, other slots untouched; a batch of one padding row (-1)
    touches no slot."""
    cu, _ = pair
    kn, launched = cu.layer.kernels, []
    launch = kn._launch
    monkeypatch.setattr(kn, "_launch", lambda family, name, *rest: (launched.append(name),
                                                                     launch(family, name, *rest)))
    slot_kernel = f"kda_decode_rows_slot_d{cu.cfg.head_dim}"
    assert_batch_matches_single(cu, 1, 1, seed=199, pad=0)
    assert slot_kernel in launched
    launched.clear()
    assert_batch_matches_single(cu, 0, 1, seed=198, pad=1)
    assert slot_kernel in launched


@pytest.mark.parametrize("K", [1, 3], ids=["decode_batch", "verify_batch"])
def test_bad_table_entries_touch_nothing_outside_the_pool(pair, K):
    """Nothing checks the tables before a CUDA call: an entry outside the pool acts as -1 and
    check_faults names it (decode_batch of three rows takes the batch kernel)."""
    assert_bad_entries_touch_nothing(pair[0], K, checked_by_call=False)


def test_bad_slot_of_a_batch_of_one_touches_nothing(pair):
    assert_bad_slot_of_one_touches_nothing(pair[0], checked_by_call=False)


@pytest.mark.parametrize("B, K", [(3, 4), (20, 8), (64, 4)])
def test_verify_batch_bit_identical_to_decode_k(pair, B, K):
    cu, _ = pair
    assert_batch_matches_single(cu, B, K, seed=200 + B, pad=3)


@pytest.mark.parametrize("B, K", [(1, 1), (3, 1), (64, 1), (20, 4)])
def test_register_build_of_the_batch_is_bit_identical(pair, B, K):
    """kda_decode_batch as built where a block holds its state rows in registers (sm_80 to
    sm_89, sm_120; this GPU's build stages them by bulk copies) runs here, bit-identical to
    decode and decode_k built the same way."""
    cu, _ = pair
    kn = cu.layer.kernels
    cc = min(c for c in SMEM_PER_BLOCK if not decode_batch_bulk(c))
    kn.use_build(cc)
    try:
        assert_batch_matches_single(cu, B, K, seed=400 + B + K, pad=2 if K == 1 else 3)
    finally:
        kn.use_build(cu.gpu.compute_capability)


def test_graph_replay_with_new_slot_tables_equals_eager(pair):
    cu, _ = pair
    gpu, cfg = cu.gpu, cu.cfg
    stream = gpu.create_stream()
    pool = KdaStatePool(gpu, cfg, 80, stream)
    for s in range(80):
        pool.upload(s, *cu.warm_state(seed=300 + s % 7), stream)
    start = [pool.download(s, stream) for s in range(80)]
    table = gpu.upload(np.arange(64, dtype=np.int32), stream)
    h = gpu.upload(random_hidden(64, cfg.hidden_size, 301), stream)
    cu.layer.decode_batch(gpu, h, 64, table, pool, cu.ws, stream)  # every kernel loaded
    graph = gpu.capture(lambda: cu.layer.decode_batch(gpu, h, 64, table, pool, cu.ws, stream),
                        stream)
    rng = np.random.default_rng(302)
    for _ in range(3):
        for s in range(80):
            pool.upload(s, *start[s], stream)
        new = rng.permutation(80)[:64].astype(np.int32)
        new[rng.integers(0, 64, 5)] = -1
        rows = random_hidden(64, cfg.hidden_size, int(rng.integers(1000)))
        gpu.copy_h2d(table, new, stream)
        gpu.copy_h2d(h, rows, stream)
        graph.replay(stream)
        replayed = gpu.download(cu.ws.final_out, (64, cfg.hidden_size), rows.dtype, stream)
        states = [pool.download(s, stream) for s in range(80)]
        for s in range(80):
            pool.upload(s, *start[s], stream)
        cu.layer.decode_batch(gpu, h, 64, table, pool, cu.ws, stream)
        eager = gpu.download(cu.ws.final_out, (64, cfg.hidden_size), rows.dtype, stream)
        live = new >= 0
        assert np.array_equal(bits(replayed[live]), bits(eager[live]))
        for s in range(80):
            for a, b in zip(states[s], pool.download(s, stream)):
                assert np.array_equal(bits(a), bits(b)), s
    gpu.destroy_stream(stream)


def _chained_equal_apart(gpu, stream, steps, reset, call, result, monkeypatch,
                         overlap: dict[str, int]) -> list[str]:
    """`steps` calls (`call(i)`, after `reset()`) launched without overlap, each waited for,
    then with the overlap settings `overlap` ({name: value} of kdarun.kernels) chained with
    nothing between them, eagerly and as one captured graph: `result()` the same bits every
    time. Returns the kernels launched with overlap (eager, then the capture's)."""
    from kdarun import cuda_backend
    launched = []
    real = cuda_backend.launch_ex  # its last argument: whether the launch overlaps
    monkeypatch.setattr(cuda_backend, "launch_ex", lambda kernel, *rest: (
        rest[-1] and launched.append(kernel), real(kernel, *rest)))
    monkeypatch.setattr(kernels, "DECODE_OVERLAP", 0)
    monkeypatch.setattr(kernels, "BATCH_OVERLAP_ROWS", 0)
    reset()
    for i in range(steps):
        call(i)
        gpu.synchronize(stream)
    want = result()
    for name, value in overlap.items():
        monkeypatch.setattr(kernels, name, value)
    reset()
    for i in range(steps):
        call(i)
    eager = result()
    graph = gpu.capture(lambda: [call(i) for i in range(steps)], stream)
    reset()
    graph.replay(stream)
    replayed = result()
    for got in (eager, replayed):
        for x, y in zip(want, got):
            assert np.array_equal(bits(x), bits(y))
    return launched


@pytest.mark.parametrize("b", [0, -3, 1, 64], ids=["decode", "decode_k", "batch_of_one",
                                                   "batch_of_64"])
def test_overlapped_launches_chained_equal_launches_one_at_a_time(pair, b, monkeypatch):
    """Decode's launches overlap the one before (programmatic dependent launch), and a walk
    reads its states before it waits for the front end: eight calls chained with nothing
    between them (each call's first launch overlapping the last one's end), eagerly and as
    one captured graph, end in the same states, snapshots and last outputs, bit for bit, as
    the calls launched without overlap and each waited for (DECODE_OVERLAP on and every batch
    kernel overlapped, whatever its rows, then neither). b = 0: `decode` on a KdaSeqState;
    b = -3: `decode_k` of 3 rows with snapshots (copies between the walk and o_proj); b > 0:
    `decode_batch`."""
    cu, _ = pair
    gpu, cfg, steps = cu.gpu, cu.cfg, 8
    stream = gpu.create_stream()
    rows, row = abs(b) or 1, cfg.hidden_size * 2
    pool = KdaStatePool(gpu, cfg, 80, stream)
    st = cu.state()
    snaps = [cu.state() for _ in range(-b - 1)]
    start = [cu.warm_state(seed=600 + s % 5) for s in range(80)]
    rng = np.random.default_rng(601)
    table_np = rng.permutation(80)[:rows].astype(np.int32)
    if b > 1:
        table_np[rng.integers(0, rows, 4)] = -1
    table = gpu.upload(table_np, stream)
    h = gpu.upload(random_hidden(steps * rows, cfg.hidden_size, 602), stream)

    def reset():
        for s in range(80):
            pool.upload(s, *start[s], stream)
        for s in [st, *snaps]:
            s.upload(*start[0], stream)
        cu.ws.poison(stream)

    def call(i):
        if b > 0:
            cu.layer.decode_batch(gpu, h + i * rows * row, b, table, pool, cu.ws, stream)
        elif b < 0:
            cu.layer.decode_k(gpu, h + i * rows * row, rows, st, cu.ws,
                              [(s.recurrent, s.conv) for s in snaps], stream)
        else:
            cu.layer.decode(gpu, h + i * row, st, cu.ws, stream)

    def result():
        gpu.synchronize(stream)
        out = gpu.download(cu.ws.final_out, (rows, cfg.hidden_size), BF16, stream)
        live = table_np >= 0 if b > 0 else np.ones(rows, bool)
        states = ([pool.download(s, stream) for s in range(80)] if b > 0 else
                  [s.download() for s in [st, *snaps]])
        return [out[live]] + [a for slot in states for a in slot]

    overlapped = _chained_equal_apart(  # every batch kernel overlapped, past the default's rows
        gpu, stream, steps, reset, call, result, monkeypatch,
        {"DECODE_OVERLAP": 1, "BATCH_OVERLAP_ROWS": 1 << 30})
    # the path under test ran: every launch of the overlapped calls (3 a call) went through
    # cuLaunchKernelEx where the GPU has it; none of the calls launched one at a time
    assert len(overlapped) == (2 * 3 * steps if gpu.compute_capability >= 90 else 0)
    gpu.destroy_stream(stream)


def test_overlapped_and_apart_batches_chained_equal_calls_one_at_a_time(pair, monkeypatch):
    """Batched decode calls of 64 rows (launched apart: past BATCH_OVERLAP_ROWS) and of 8
    rows (overlapped) in turn, on slots the calls share, chained with nothing between them,
    eagerly and as one captured graph, end in the same pool and last outputs, bit for bit, as
    the same calls launched without overlap and each waited for: a walk that reads its states
    before its wait sees the last call's writes whichever form that call took."""
    cu, _ = pair
    gpu, cfg, steps = cu.gpu, cu.cfg, 8
    sizes = [64 if i % 2 == 0 else 8 for i in range(steps)]
    assert sizes[1] <= kernels.BATCH_OVERLAP_ROWS < sizes[0]  # the default mixes both forms
    defaults = {"DECODE_OVERLAP": kernels.DECODE_OVERLAP,
                "BATCH_OVERLAP_ROWS": kernels.BATCH_OVERLAP_ROWS}
    stream = gpu.create_stream()
    pool = KdaStatePool(gpu, cfg, 80, stream)
    start = [cu.warm_state(seed=610 + s % 5) for s in range(80)]
    rng = np.random.default_rng(611)
    tables = [gpu.upload(rng.permutation(80)[:n].astype(np.int32), stream) for n in sizes]
    first = np.cumsum([0, *sizes])  # each call's first hidden row
    row = cfg.hidden_size * 2
    h = gpu.upload(random_hidden(int(first[-1]), cfg.hidden_size, 612), stream)

    def reset():
        for s in range(80):
            pool.upload(s, *start[s], stream)
        cu.ws.poison(stream)

    def call(i):
        cu.layer.decode_batch(gpu, h + int(first[i]) * row, sizes[i], tables[i], pool, cu.ws,
                              stream)

    def result():
        gpu.synchronize(stream)
        out = gpu.download(cu.ws.final_out, (sizes[-1], cfg.hidden_size), BF16, stream)
        return [out] + [a for s in range(80) for a in pool.download(s, stream)]

    overlapped = _chained_equal_apart(gpu, stream, steps, reset, call, result, monkeypatch,
                                      defaults)
    # the 8-row calls overlapped their three launches (decode's GEMVs and the batch walk), the
    # 64-row calls none, eagerly and in the capture, where the GPU has cuLaunchKernelEx
    assert len(overlapped) == (2 * 3 * (steps // 2) if gpu.compute_capability >= 90 else 0)
    gpu.destroy_stream(stream)


def test_torch_tensors_and_stream_give_the_same_bits(cuda, gpu_ckpts):
    """An engine's call: batched decode on torch tensors' data_ptr()s on torch's current
    stream, eagerly and inside torch.cuda.graph capture, equals the native call bit for bit."""
    torch = pytest.importorskip("torch")
    from ..helpers import Env
    env = Env(cuda, gpu_ckpts["bounded"], 64)
    gpu, cfg = env.gpu, env.cfg
    B = 16
    h = random_hidden(B, cfg.hidden_size, 400)
    table = np.random.default_rng(401).permutation(B).astype(np.int32)
    start = [env.warm_state(seed=402 + s) for s in range(B)]
    pool = KdaStatePool(gpu, cfg, B)

    def reset():
        for s in range(B):
            pool.upload(s, *start[s])
        gpu.synchronize(0)

    reset()
    native = gpu.upload(h), gpu.upload(table)
    env.layer.decode_batch(gpu, native[0], B, native[1], pool, env.ws, 0)
    want = env.ws.read("final_out", B)
    want_states = [pool.download(s) for s in range(B)]

    h_t = torch.from_numpy(h.view(np.int16)).cuda().view(torch.bfloat16)
    t_t = torch.from_numpy(table).cuda()

    def call():
        env.layer.decode_batch(gpu, DevicePtr(h_t.data_ptr()), B, DevicePtr(t_t.data_ptr()),
                               pool, env.ws, torch.cuda.current_stream().cuda_stream)

    for capture in (False, True):
        reset()
        if capture:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call()
            reset()
            g.replay()
        else:
            call()
        torch.cuda.synchronize()
        assert np.array_equal(bits(env.ws.read("final_out", B)), bits(want)), capture
        for s in range(B):
            for a, b in zip(pool.download(s), want_states[s]):
                assert np.array_equal(bits(a), bits(b)), (capture, s)


# cuBLAS may round a row of a GEMM over the pack's rows otherwise than over one sequence's;
# given the same GEMM outputs the rest is exact (assert_packed_matches_alone checks both).
# Measured on the H200: the tiny presets bit-identical, the D = 128 stack (hidden 1000) up to
# 2.9e-3 (final_out) and 1.2e-3 (state, 60 sequences); about twice and 1.6x that:
PACK_OUT_TOL, PACK_STATE_TOL = 6e-3, 2e-3


@pytest.mark.parametrize("initial", [False, True], ids=["zero-state", "initial-state"])
def test_prefill_packed_equals_each_prefill(core_pair, initial):
    cu, _ = core_pair
    diff = assert_packed_matches_alone(cu, [1, 63, 64, 65, 1000],
                                       [initial, not initial, initial, True, initial], seed=500,
                                       gemm_exact=False, out_tol=PACK_OUT_TOL,
                                       state_tol=PACK_STATE_TOL)
    print(f"packed vs alone, rel: {diff}")


def test_prefill_packed_checkpoints_equal_prefix_prefills(core_pair):
    cu, _ = core_pair
    diff = assert_packed_matches_alone(cu, [1000, 256, 300, 1], [True, False, True, False],
                                       seed=510, checkpoint_every=256, gemm_exact=False,
                                       out_tol=PACK_OUT_TOL, state_tol=PACK_STATE_TOL)
    print(f"packed with checkpoints vs alone, rel: {diff}")


def test_prefill_packed_many_sequences_share_walk_blocks(core_pair):
    """More sequences than the walk has blocks a head slice (one wave): a block walks several
    segments in turn, its copies running ahead across their ends."""
    cu, _ = core_pair
    rng = np.random.default_rng(530)
    lengths = [int(x) for x in rng.integers(1, 65, 60)]
    diff = assert_packed_matches_alone(cu, lengths, [bool(x) for x in rng.integers(0, 2, 60)],
                                       seed=530, checkpoint_every=64, gemm_exact=False,
                                       out_tol=PACK_OUT_TOL, state_tol=PACK_STATE_TOL)
    print(f"60 packed sequences vs alone, rel: {diff}")


def test_prefill_packed_in_windows(cuda, gpu_ckpts, core):
    """A pack past the workspace runs in windows, a long sequence in pieces through its slot."""
    with forced_core(core):
        env = Env(cuda, gpu_ckpts["d128"], 256)
    diff = assert_packed_matches_alone(env, [1, 63, 300, 65, 200], [False, True, True, False,
                                                                    True], seed=520,
                                       gemm_exact=False, out_tol=PACK_OUT_TOL,
                                       state_tol=PACK_STATE_TOL)
    print(f"packed in windows vs alone, rel: {diff}")
