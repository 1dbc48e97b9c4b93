"""Serving on the host backend: a state pool, batched decode and batched verify, each sequence
bit-identical to the single-sequence calls whatever shares its batch."""

from __future__ import annotations

import numpy as np
import pytest

from kdarun import KdaError, kernels, open_backend, synthetic
from kdarun.kernels import GEMV_SLAB_TILES, GEMV_TILE, Glm5NextKdaKernels
from kdarun.pool import KdaStatePool

from .helpers import (Env, assert_bad_entries_touch_nothing,
                      assert_bad_slot_of_one_touches_nothing, assert_batch_matches_single,
                      assert_packed_matches_alone, bits, host_with_sms, random_hidden)


@pytest.fixture(scope="module")
def env(host, ckpts):
    return Env(host, ckpts["bounded"], 256)


@pytest.mark.parametrize("B", [1, 3, 8, 64])
def test_decode_batch_bit_identical_to_decode(env, B):
    assert_batch_matches_single(env, B, 1, seed=10 + B)


def test_decode_batch_of_one_is_decode(env):
    """A batch of one sequence and no padding takes decode's own launch at its slot
    (`batch_rows_kernel`): bit-identical to decode, other slots untouched."""
    assert env.layer.kernels.batch_rows_kernel(1, 1).startswith("kda_decode_rows_slot")
    assert_batch_matches_single(env, 1, 1, seed=19, pad=0)


@pytest.mark.parametrize("B, K", [(1, 2), (3, 4), (8, 3)])
def test_verify_batch_bit_identical_to_decode_k(env, B, K):
    assert_batch_matches_single(env, B, K, seed=20 + B, pad=1)


@pytest.mark.parametrize("preset", ["tiny", "kimi-linear-48b", "glm-5.3-flash"])
def test_front_end_batch_plan_covers_every_row(preset):
    """front_end_gemv_batch takes front_end_gemv's shares (a row's sums follow them, so its bits
    are decode's), its blocks of GEMV_SLAB_TILES tiles cover each region's rows exactly, and a
    gate block's rows are all f_b's or all g_b's."""
    cfg = synthetic.preset_config(preset)
    kn = Glm5NextKdaKernels(open_backend("host"), cfg)
    total, args = kn._front_end_batch_plan
    _, single = kn._front_end_plan
    assert [int(a) for a in args[:3]] == [int(a) for a in single[:3]]
    early_blocks, proj_blocks = int(args[3]), int(args[4])
    rows = GEMV_SLAB_TILES * GEMV_TILE
    assert cfg.qkv % rows == 0
    for n, blocks in ((cfg.gate_in_rows, early_blocks), (cfg.conv_dim, proj_blocks - early_blocks),
                      (2 * cfg.qkv, total - proj_blocks - 1)):
        assert (blocks - 1) * rows < n <= blocks * rows


@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("sm_count", [1, 16, 132])
def test_batch_split_runs_in_one_wave(sm_count, cc):
    """kda_decode_batch splits a head over a power of two of blocks, at most
    DECODE_BATCH_MAX_SPLIT, the most that still run in one wave (1 for large batches), as many
    blocks an SM as the build in use holds (use_build: three where it stages rows by bulk
    copies, two where registers hold them)."""
    cfg = synthetic.preset_config("kimi-linear-48b")
    kn = Glm5NextKdaKernels(host_with_sms(sm_count), cfg)
    kn.use_build(cc)
    assert kn.cc == cc
    for bad in (100, 70, 90.0):  # past the device's own (the host stands in for 9.0), too old
        with pytest.raises(KdaError, match=f"use_build: a build for compute capability {bad!r} "
                                           "cannot run on"):
            kn.use_build(bad)
    assert kn.cc == cc
    full = sm_count * kernels.decode_batch_blocks_per_sm(cc)
    for nseq in (1, 2, 3, 8, 64, 256):
        split = kn._batch_split(nseq)
        assert split & (split - 1) == 0 and split <= kernels.DECODE_BATCH_MAX_SPLIT
        assert split == kernels.DECODE_BATCH_MAX_SPLIT or nseq * cfg.num_heads * split * 2 > full
        assert split == 1 or nseq * cfg.num_heads * split <= full
    if sm_count == 132 and cc == 90:  # the H200: kimi-linear-48b's measured case (perf-log v40)
        assert [kn._batch_split(n) for n in (1, 2, 4, 8)] == [8, 4, 2, 1]


def test_graph_replay_with_new_slot_table_equals_eager(env):
    """A captured batched decode replays with a new slot table and new rows, as eager would."""
    gpu, cfg = env.gpu, env.cfg
    pool = KdaStatePool(gpu, cfg, 6)
    for s in range(6):
        pool.upload(s, *env.warm_state(seed=30 + s))
    before = [pool.download(s) for s in range(6)]
    table = gpu.upload(np.array([0, 1, 2], np.int32))
    h = gpu.upload(random_hidden(3, cfg.hidden_size, 31))
    graph = gpu.capture(lambda: env.layer.decode_batch(gpu, h, 3, table, pool, env.ws, 1), 1)
    gpu.copy_h2d(table, np.array([5, -1, 3], np.int32), 0)
    h2 = random_hidden(3, cfg.hidden_size, 32)
    gpu.copy_h2d(h, h2, 0)
    graph.replay(1)
    replayed = env.ws.read("final_out", 3)
    after = [pool.download(s) for s in (5, 3)]
    for s, st in zip((5, 3), before[5:6] + before[3:4]):
        pool.upload(s, *st)
    eager_table = gpu.upload(np.array([5, -1, 3], np.int32))
    env.layer.decode_batch(gpu, h, 3, eager_table, pool, env.ws, 0)
    assert np.array_equal(bits(replayed[[0, 2]]), bits(env.ws.read("final_out", 3)[[0, 2]]))
    for s, a in zip((5, 3), after):
        for x, y in zip(a, pool.download(s)):
            assert np.array_equal(bits(x), bits(y))
    for s in (0, 1, 2, 4):  # named by no row of the replay
        for x, y in zip(before[s], pool.download(s)):
            assert np.array_equal(bits(x), bits(y)), s


def test_pool_slots_and_errors(env):
    gpu, cfg = env.gpu, env.cfg
    pool = KdaStatePool(gpu, cfg, 3)
    R, C = env.warm_state(seed=40)
    pool.upload(1, R, C)
    pool.copy(1, 2)
    for a, b in zip(pool.download(2), (R, C)):
        assert np.array_equal(bits(a), bits(b))
    pool.zero([1])
    assert not pool.download(1)[0].any()
    with pytest.raises(KdaError, match=r"a slot must be an integer in \[0, 3\), got 3$"):
        pool.download(3)
    with pytest.raises(KdaError, match="freed with its pool"):
        pool.state(0).free()
    with pytest.raises(KdaError, match="slots must be a positive integer"):
        KdaStatePool(gpu, cfg, 0)
    h = gpu.upload(random_hidden(2, cfg.hidden_size, 41))
    with pytest.raises(KdaError, match="slots must be a device pointer"):
        env.layer.decode_batch(gpu, h, 2, None, pool, env.ws, 0)
    with pytest.raises(KdaError, match="the batch must be a positive integer, got True"):
        env.layer.decode_batch(gpu, h, True, gpu.upload(np.zeros(2, np.int32)), pool, env.ws, 0)
    with pytest.raises(KdaError, match="exceed the workspace"):
        env.layer.decode_batch(gpu, h, 1000, gpu.upload(np.zeros(1000, np.int32)), pool,
                               env.ws, 0)


@pytest.mark.parametrize("slots, snaps, pattern, call", [
    ([2, 2], None, r"pool slot 2 is named twice \(slot entry 0 and slot entry 1\)",
     "decode_batch: pool slot 2 is named twice"),
    ([0, 6], None, r"slot 6 at entry 1 is neither -1 \(skip\) nor a slot in \[0, 6\)",
     r"decode_batch: slot 6 at entry 1 is neither -1"),
    ([0, -5], None, r"slot -5 at entry 1 is neither -1", "decode_batch: slot -5 at entry 1"),
    ([0, 1], [[1], [3]], r"pool slot 1 is named twice \(slot entry 1 and snapshot slot entry 0\)",
     "verify_batch: pool slot 1 is named twice"),
    ([0, 1], [[3], [3]], r"pool slot 3 is named twice \(snapshot slot entry 0 and snapshot",
     "verify_batch: pool slot 3 is named twice"),
])
def test_bad_slot_tables_are_refused_before_any_state_moves(env, slots, snaps, pattern, call):
    """pool.check_tables names a bad device slot table's first problem, and on the host
    backend batched decode and verify run the same check before any slot's state changes
    (on CUDA nothing checks them before the call: README)."""
    gpu, cfg = env.gpu, env.cfg
    pool = KdaStatePool(gpu, cfg, 6)
    for s in range(6):
        pool.upload(s, *env.warm_state(seed=60 + s))
    before = [pool.download(s) for s in range(6)]
    k = 1 if snaps is None else 2
    table = gpu.upload(np.array(slots, np.int32))
    snap_table = None if snaps is None else gpu.upload(np.array(snaps, np.int32))
    with pytest.raises(KdaError, match="state pool check_tables: " + pattern):
        pool.check_tables(table, len(slots), snap_table, k)
    h = gpu.upload(random_hidden(len(slots) * k, cfg.hidden_size, 61))
    with pytest.raises(KdaError, match=call):
        if snaps is None:
            env.layer.decode_batch(gpu, h, len(slots), table, pool, env.ws, 0)
        else:
            env.layer.verify_batch(gpu, h, len(slots), k, table, pool, env.ws, snap_table, 0)
    for s in range(6):
        for x, y in zip(before[s], pool.download(s)):
            assert np.array_equal(bits(x), bits(y)), s


@pytest.mark.parametrize("K", [1, 3], ids=["decode_batch", "verify_batch"])
def test_bad_table_entries_that_reach_the_kernels_touch_nothing(env, K):
    """The kernels' own guard, as the CUDA path meets it (the host calls check first)."""
    assert_bad_entries_touch_nothing(env, K, checked_by_call=True)


def test_bad_slot_of_a_batch_of_one_that_reaches_its_kernel_touches_nothing(env):
    assert_bad_slot_of_one_touches_nothing(env, checked_by_call=True)


def test_check_faults_and_download_raise_once_then_clear(env):
    gpu, cfg = env.gpu, env.cfg
    pool = KdaStatePool(gpu, cfg, 2)
    pool.check_faults()  # nothing recorded
    gpu.copy_h2d(pool.faults, np.array([1, 1, 3, -9], np.int32), 0)  # as a kernel records one
    with pytest.raises(KdaError, match=r"state pool download: a batched call met snapshot slot "
                                       r"-9 at entry 3 of its table"):
        pool.download(0)
    pool.download(0)
    pool.free()
    with pytest.raises(KdaError, match="freed"):
        pool.check_faults()


def test_workspaces_states_and_pools_of_other_shapes_are_refused(env):
    """A workspace, state or pool made for another layer shape is refused before any state
    moves, naming the field; one of the same shapes from a config that differs elsewhere (the
    stack's layer count) is taken."""
    import dataclasses

    from kdarun import Glm5NextKdaWorkspace, KdaSeqState
    gpu, cfg, layer = env.gpu, env.cfg, env.layer
    other = dataclasses.replace(cfg, num_heads=cfg.num_heads * 2)
    h = gpu.upload(random_hidden(1, cfg.hidden_size, 63))
    state = env.state(*env.warm_state(seed=64))
    before = state.download()
    ws2 = Glm5NextKdaWorkspace(gpu, other, 16)
    with pytest.raises(KdaError, match=rf"layer \d+: the workspace was made for a config of "
                                       rf"num_heads {2 * cfg.num_heads}, not {cfg.num_heads}"):
        layer.decode(gpu, h, state, ws2, 0)
    wrong = KdaSeqState(gpu, other)
    with pytest.raises(KdaError, match="the state was made for a config of num_heads"):
        layer.decode(gpu, h, wrong, env.ws, 0)
    with pytest.raises(KdaError, match="the state pool must be a KdaStatePool, got KdaSeqState"):
        layer.decode_batch(gpu, h, 1, gpu.upload(np.zeros(1, np.int32)), state, env.ws, 0)
    with pytest.raises(KdaError, match="the state pool was made for a config of num_heads"):
        layer.decode_batch(gpu, h, 1, gpu.upload(np.zeros(1, np.int32)),
                           KdaStatePool(gpu, other, 1), env.ws, 0)
    for x, y in zip(before, state.download()):
        assert np.array_equal(bits(x), bits(y))
    deeper = dataclasses.replace(cfg, num_hidden_layers=cfg.num_hidden_layers + 1,
                                 kda_layers=tuple(cfg.kda_layers) + (cfg.num_hidden_layers,))
    layer.decode_batch(gpu, h, 1, gpu.upload(np.zeros(1, np.int32)), KdaStatePool(gpu, deeper, 1),
                       env.ws, 0)


def test_pool_zero_checks_every_slot_first(env):
    gpu, cfg = env.gpu, env.cfg
    pool = KdaStatePool(gpu, cfg, 3)
    pool.upload(1, *env.warm_state(seed=62))
    with pytest.raises(KdaError, match=r"state pool zero: a slot must be an integer in \[0, 3\), got 99"):
        pool.zero([1, 99])
    assert pool.download(1)[0].any()  # slot 1 kept its state
    with pytest.raises(KdaError, match="state pool zero: pass the slots as a list or 1-D array "
                                       "of integers, got 3"):
        pool.zero(3)
    with pytest.raises(KdaError, match="slots as a list or 1-D array of integers, got {1: 2}"):
        pool.zero({1: 2})


@pytest.fixture(scope="module")
def wide(host, ckpts):
    """A workspace that holds the packs below in one window."""
    return Env(host, ckpts["bounded"], 1024)


@pytest.mark.parametrize("initial", [False, True], ids=["zero-state", "initial-state"])
def test_prefill_packed_equals_each_prefill(wide, initial):
    assert_packed_matches_alone(wide, [1, 63, 64, 65, 700],
                                [initial, not initial, initial, True, initial], seed=60)


def test_prefill_packed_checkpoints_equal_prefix_prefills(wide):
    assert_packed_matches_alone(wide, [200, 64, 129, 1], [True, False, True, False], seed=70,
                                checkpoint_every=64)


def test_prefill_packed_in_windows(env):
    """A pack past the workspace (256 tokens) runs in windows, a sequence longer than one in
    pieces through its slot: the same bits as each sequence alone."""
    assert_packed_matches_alone(env, [1, 63, 300, 65, 200], [False, True, True, False, True],
                                seed=75)
    assert_packed_matches_alone(env, [300, 64, 129], [True, False, True], seed=76,
                                checkpoint_every=128)


def test_prefill_packed_takes_numpy_arrays(env):
    """cu_seqlens, slots and has_initial_state as NumPy arrays (any integer width; flags as
    bools or as an object array of them) or tuples give the bits the same lists give."""
    from kdarun import prefill_packed
    gpu, cfg = env.gpu, env.cfg
    pool = KdaStatePool(gpu, cfg, 4)
    row = cfg.hidden_size * 2
    h = gpu.upload(random_hidden(100, cfg.hidden_size, 81))
    calls = [([0, 30, 100], [2, 0], [False, False]),
             (np.array([0, 30, 100], np.int32), np.array([3, 1]), np.zeros(2, bool)),
             ((0, 30, 100), np.array([1, 2], np.uint16), np.array([False, False], object))]
    outs = [gpu.alloc(100 * row) for _ in calls]
    for (cu, slots, init), out in zip(calls, outs):
        prefill_packed(env.layer, gpu, h, cu, slots, init, pool, env.ws, out, 0)
    first, *rest = (gpu.download(o, (100 * row,), np.uint8, 0) for o in outs)
    for other in rest:
        assert np.array_equal(first, other)


def test_prefill_packed_refuses_bad_packs(env):
    from kdarun import prefill_packed
    gpu, cfg = env.gpu, env.cfg
    pool = KdaStatePool(gpu, cfg, 4)
    h, out = gpu.upload(random_hidden(10, cfg.hidden_size, 80)), gpu.alloc(10 * cfg.hidden_size * 2)
    call = lambda cu, slots, init, **kw: prefill_packed(  # noqa: E731
        env.layer, gpu, h, cu, slots, init, pool, env.ws, out, 0, **kw)
    with pytest.raises(KdaError, match="start at 0 and rise"):
        call([0, 4, 4, 10], [0, 1, 2], [False] * 3)
    with pytest.raises(KdaError, match=r"cu_seqlens\[1\] must be a non-negative integer, got 4.9"):
        call([0, 4.9, 10], [0, 1], [False] * 2)
    with pytest.raises(KdaError, match=r"cu_seqlens\[1\] must be a non-negative integer, got True"):
        call([0, True, 10], [0, 1], [False] * 2)
    with pytest.raises(KdaError, match="has_initial_state must hold True or False, got 'False'"):
        call([0, 4, 10], [0, 1], ["False", "False"])
    with pytest.raises(KdaError, match="has_initial_state must hold True or False, got 0"):
        call([0, 4, 10], [0, 1], [0, 1])
    with pytest.raises(KdaError, match="has_initial_state must hold True or False, got \\[1\\]"):
        call([0, 4, 10], [0, 1], [True, [1]])
    with pytest.raises(KdaError, match="cu_seqlens must be a host sequence of integers"):
        call({0, 4, 10}, [0, 1], [False, False])
    with pytest.raises(KdaError, match=r"slots: a slot must be an integer in \[0, 4\), got True"):
        call([0, 4, 10], [0, True], [False, False])
    with pytest.raises(KdaError, match="checkpoint_slots given without checkpoint_every"):
        call([0, 4, 10], [0, 1], [False] * 2, checkpoint_slots=[[2], [3]])
    with pytest.raises(KdaError, match="slots must be a host sequence"):
        call([0, 4, 10], gpu.upload(np.array([0, 1], np.int32)), [False] * 2)
    with pytest.raises(KdaError, match="slots must be a host sequence"):  # unordered
        call([0, 4, 10], {0, 1}, [False] * 2)
    with pytest.raises(KdaError, match="has_initial_state must be a host sequence of True"):
        call([0, 4, 10], [0, 1], gpu.upload(np.array([0, 1], np.int32)))
    with pytest.raises(KdaError, match=r"out must be a device pointer \(DevicePtr\), got None"):
        prefill_packed(env.layer, gpu, h, [0, 4, 10], [0, 1], [False] * 2, pool, env.ws, None, 0)
    with pytest.raises(KdaError, match="N\\+1 cu_seqlens"):
        call([0, 10], [0, 1], [False, False])
    with pytest.raises(KdaError, match="a slot of its own"):
        call([0, 4, 10], [1, 1], [False, False])
    with pytest.raises(KdaError, match="multiple of 64"):
        call([0, 4, 10], [0, 1], [False, False], checkpoint_every=100, checkpoint_slots=[[], []])
    with pytest.raises(KdaError, match=r"slots: a slot must be an integer in \[0, 4\), got 4 in"):
        call([0, 4, 10], [0, 4], [False, False])
    with pytest.raises(KdaError, match=r"slots: a slot must be an integer in \[0, 4\), got -1 in"):
        call([0, 4, 10], [-1, 2], [False, False])
    with pytest.raises(KdaError, match=r"checkpoint_slots: a slot must be an integer in \[-1, 4\) \(-1 skips one\), got 7"):
        call([0, 64, 128], [0, 1], [False, False], checkpoint_every=64,
             checkpoint_slots=[[7], [2]])
    with pytest.raises(KdaError, match=r"a slot of its own, apart from the sequences' slots.*\[1\]"):
        call([0, 64, 128], [0, 1], [False, False], checkpoint_every=64,
             checkpoint_slots=[[1], [2]])
    with pytest.raises(KdaError, match="a slot of its own, apart from"):
        call([0, 64, 128], [0, 1], [False, False], checkpoint_every=64,
             checkpoint_slots=[[2], [2]])


def test_prefill_packed_refusals_name_the_argument_and_touch_nothing(env):
    """What a pack's checks catch beyond its counts: 0-d and 2-D arrays and unhashable slots,
    checkpoint slots in any form but a host sequence of host sequences (or a 2-D array), a
    missing pool, checkpoints on a workspace shorter than a chunk, and hidden or out shorter
    than cu_seqlens or out inside the pool. Each is refused naming the argument, before any
    slot changes: a pack longer than the workspace would otherwise have run its first
    window."""
    from kdarun import Glm5NextKdaWorkspace, prefill_packed
    gpu, cfg = env.gpu, env.cfg
    pool = KdaStatePool(gpu, cfg, 64)
    for s in range(4):
        pool.upload(s, *env.warm_state(seed=90 + s))
    before = [pool.download(s) for s in range(4)]
    row = cfg.hidden_size * 2
    h, out = gpu.upload(random_hidden(400, cfg.hidden_size, 91)), gpu.alloc(400 * row)
    call = lambda cu, slots, init, **kw: prefill_packed(  # noqa: E731
        env.layer, gpu, kw.pop("h", h), cu, slots, init, kw.pop("pool", pool),
        kw.pop("ws", env.ws), kw.pop("out", out), 0, **kw)
    two = dict(cu=[0, 10, 310], init=[True, True])  # 310 rows: two windows of 256
    cases = [
        (dict(slots=np.array(0), **two), "slots must be a host sequence"),
        (dict(slots=np.array([[0], [1]]), **two), "slots must be a host sequence"),
        (dict(slots=[[0], [1]], **two), r"slots: a slot must be an integer in \[0, 64\), got \[0\]"),
        (dict(slots=[0, 1], cu=np.array(310), init=[True]), "cu_seqlens must be a host sequence"),
        (dict(slots=[0], cu=[0, 310], init=np.array(True)), "has_initial_state must be a host seq"),
        (dict(slots=[0, 1], checkpoint_every=64, checkpoint_slots=(c for c in ([], [2, 3, 4, 5])),
              **two), "checkpoint_slots must be a host sequence .* of host sequences"),
        (dict(slots=[0, 1], checkpoint_every=64, checkpoint_slots=[2, 3], **two),
         "checkpoint_slots must be a host sequence"),
        (dict(slots=[0, 1], checkpoint_every=64, checkpoint_slots={0: [], 1: [2, 3, 4, 5]},
              **two), "checkpoint_slots must be a host sequence"),
        (dict(slots=[0, 1], pool=None, **two), "the state pool must be a KdaStatePool, got None"),
        (dict(slots=[0, 1], h=gpu.upload(random_hidden(300, cfg.hidden_size, 92)), **two),
         "prefill_packed: hidden: access of"),
        (dict(slots=[0, 1], out=gpu.alloc(300 * row), **two), "prefill_packed: out: access of"),
        (dict(slots=[0, 1], out=pool.recurrent_at(40), cu=[0, 4, 10], init=[True, True]),
         "prefill_packed: out .* overlaps the state pool's slots"),
        (dict(slots=[0], cu=[0, 10], init=[True], ws=Glm5NextKdaWorkspace(gpu, cfg, 16),
              checkpoint_every=64, checkpoint_slots=[[]]),
         "checkpoints need a workspace of at least 64 tokens; this one's max_tokens is 16"),
    ]
    for kw, pattern in cases:
        with pytest.raises(KdaError, match=pattern):
            call(**kw)
    for s in range(4):
        for x, y in zip(before[s], pool.download(s)):
            assert np.array_equal(bits(x), bits(y)), s
    # a 2-D array of checkpoint slots is a table of them: the same states as the lists
    pool2 = KdaStatePool(gpu, cfg, 8)
    for p, ck in ((pool, [[2], [3]]), (pool2, np.array([[2], [3]]))):
        prefill_packed(env.layer, gpu, h, [0, 64, 128], [0, 1], [False, False], p, env.ws, out,
                       0, checkpoint_every=64, checkpoint_slots=ck)
    for s in range(4):
        for x, y in zip(pool.download(s), pool2.download(s)):
            assert np.array_equal(bits(x), bits(y)), s


def test_batched_calls_name_a_short_buffer(env):
    """hidden, slots and snapshot_slots shorter than b (and k) say which argument of which call,
    before any slot changes (the host backend knows a pointer's extent; a GPU's does not)."""
    gpu, cfg = env.gpu, env.cfg
    pool = KdaStatePool(gpu, cfg, 6)
    h4 = gpu.upload(random_hidden(4, cfg.hidden_size, 95))
    two = gpu.upload(np.array([0, 1], np.int32))
    with pytest.raises(KdaError, match="decode_batch: slots: access of 16 bytes"):
        env.layer.decode_batch(gpu, h4, 4, two, pool, env.ws, 0)
    with pytest.raises(KdaError, match="decode_batch: hidden: access of"):
        env.layer.decode_batch(gpu, gpu.upload(random_hidden(1, cfg.hidden_size, 96)), 2, two,
                               pool, env.ws, 0)
    with pytest.raises(KdaError, match="verify_batch: snapshot_slots: access of 8 bytes"):
        env.layer.verify_batch(gpu, h4, 2, 2, two, pool, env.ws,
                               gpu.upload(np.array([3], np.int32)), 0)
    with pytest.raises(KdaError, match="the state pool must be a KdaStatePool, got NoneType"):
        env.layer.decode_batch(gpu, h4, 2, two, None, env.ws, 0)
    with pytest.raises(KdaError, match=r"state pool copy: src: a slot must be an integer in \[0, 6\), got 9"):
        pool.copy(9, 1)
    with pytest.raises(KdaError, match=r"state pool copy: dst: a slot must be"):
        pool.copy(1, 9)
    with pytest.raises(KdaError, match=r"state pool upload: slot: a slot must be"):
        pool.upload(6, *env.warm_state(seed=97))
    assert not any(pool.download(s)[0].any() for s in range(6))


def test_workspace_sizes_refuse_unknown_buffers_and_bad_counts(env):
    """ws.nbytes and ws.shape (README's sizing calls) take a buffer's name and a token count,
    which may exceed max_tokens (sizing a larger workspace), and refuse anything else."""
    ws = env.ws
    assert ws.nbytes("final_out", 1000) == 1000 * env.cfg.hidden_size * 2
    assert ws.shape("final_out", 3) == (3, env.cfg.hidden_size)
    with pytest.raises(KdaError, match="workspace: no buffer 'nope'; the buffers are"):
        ws.nbytes("nope", 1)
    with pytest.raises(KdaError, match="workspace: no buffer 'nope'"):
        ws.shape("nope", 1)
    for t in (0, -3, 2.5, True):
        with pytest.raises(KdaError, match=r"workspace.nbytes\('final_out'\): t must be a positive"):
            ws.nbytes("final_out", t)
        with pytest.raises(KdaError, match=r"workspace.shape\('gate'\): t must be a positive"):
            ws.shape("gate", t)
