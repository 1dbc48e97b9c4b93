"""The launch plans: GEMV share counts the kernels can take, a front end whose block counts
cover every tile of each of its three regions exactly (the CUDA kernel maps blocks to tiles by
these counts; a tile no block covers would leave its outputs unwritten), the walk's slices, and
the batch GEMVs' slabs in one launch. The kernels' shared memory is checked against their
sources in test_kernel_layouts.py."""

from __future__ import annotations

import numpy as np
import pytest

from kdarun import kernels, open_backend, synthetic, workspace
from kdarun import DevicePtr, KdaError
from kdarun.kernels import GEMV_STAGE_K, GEMV_TILE, GEMV_WARPS, Glm5NextKdaKernels

from .helpers import Env, assert_batch_matches_single, bits, host_with_sms, random_hidden


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("sm_count", [1, 16, 132])
@pytest.mark.parametrize("rows,k", [(16, 64), (1000, 1000), (2304, 4096), (12576, 2304),
                                    (8192, 128), (24896, 6144)])
def test_gemv_shares_are_launchable(rows, k, sm_count):
    for reserved, at_least in ((0, 1), (10_000, 1), (0, 2), (10_000, 2)):
        ks = kernels._gemv_shares(rows, k, sm_count, reserved, at_least)
        assert ks & (ks - 1) == 0 and GEMV_WARPS % ks == 0  # whole tiles a block
        assert ks <= ceil_div(k, GEMV_STAGE_K) or ks == 1  # every share has a stage
        resident = kernels.GEMV_BLOCKS_PER_SM * GEMV_WARPS * sm_count - reserved
        floor = min(at_least, ceil_div(k, GEMV_STAGE_K))
        assert ceil_div(rows, GEMV_TILE) * ks <= max(resident, 0) or ks <= floor


@pytest.mark.parametrize("preset", ["tiny", "kimi-linear-48b", "glm-5.3-flash"])
def test_front_end_plan_covers_every_tile(preset):
    cfg = synthetic.preset_config(preset)
    kn = Glm5NextKdaKernels(open_backend("host"), cfg)
    blocks, args = kn._front_end_plan
    ks, ks_early, ks_gate, early_blocks, proj_blocks = (int(a) for a in args)
    regions = (  # (tiles, shares, blocks): f_a|g_a|b, then q|k|v, then f_b|g_b (+ beta's block)
        (ceil_div(cfg.gate_in_rows, GEMV_TILE), ks_early, early_blocks),
        (3 * cfg.qkv // GEMV_TILE, ks, proj_blocks - early_blocks),
        (2 * cfg.qkv // GEMV_TILE, ks_gate, blocks - proj_blocks - 1),
    )
    for tiles, shares, blocks in regions:
        per_block = GEMV_WARPS // shares
        assert (blocks - 1) * per_block < tiles <= blocks * per_block


def test_walk_covers_every_state_row():
    """The walk's blocks take whole WALK_ROWS slices of a head's state at both head dims."""
    for d in (64, 128):
        assert d % kernels.WALK_ROWS == 0, d


def test_the_portable_walk_spreads_its_warps_where_sms_would_idle(monkeypatch):
    """The portable walk takes blocks of half the rows where blocks of WALK_ROWS would leave SMs
    idle on this GPU (kimi-linear-48b's 32 heads on 132 SMs: 128 blocks, not 64), and blocks of
    WALK_ROWS where they fill it (glm-5.3-flash's 64 heads); the Hopper walk always WALK_ROWS.
    KDARUN_WALK_ROWS forces a size of the portable walk (the Hopper walk has one), and any other
    value is refused."""
    host = open_backend("host", announce=False)
    gpu, half = host_with_sms(132), kernels.WALK_ROWS // 2
    monkeypatch.delenv("KDARUN_WALK_ROWS", raising=False)
    kimi, glm = (synthetic.preset_config(p) for p in ("kimi-linear-48b", "glm-5.3-flash"))
    for cfg, rows in ((kimi, half), (glm, kernels.WALK_ROWS)):
        kn = Glm5NextKdaKernels(gpu, cfg, core="portable")
        assert kn.walk_rows == rows, cfg.num_heads
        suffix = "_r32" if rows == half else ""
        assert kn.chunk_inter_name == f"kda_chunk_inter_portable{suffix}_d{cfg.head_dim}"
        assert Glm5NextKdaKernels(gpu, cfg, core="hopper").walk_rows == kernels.WALK_ROWS
    assert Glm5NextKdaKernels(host, kimi, core="portable").walk_rows == kernels.WALK_ROWS
    monkeypatch.setenv("KDARUN_WALK_ROWS", str(kernels.WALK_ROWS))
    assert Glm5NextKdaKernels(gpu, kimi, core="portable").walk_rows == kernels.WALK_ROWS
    monkeypatch.setenv("KDARUN_WALK_ROWS", str(half))
    assert Glm5NextKdaKernels(host, glm, core="portable").walk_rows == half
    assert Glm5NextKdaKernels(gpu, glm, core="hopper").walk_rows == kernels.WALK_ROWS  # one size
    monkeypatch.setenv("KDARUN_WALK_ROWS", "48")
    for core in ("portable", "hopper"):
        with pytest.raises(KdaError, match=r"KDARUN_WALK_ROWS: the portable walk takes blocks of "
                                           r"64 or 32 state rows, got '48'"):
            Glm5NextKdaKernels(gpu, glm, core=core)


def test_the_core_path_is_chosen_by_capability_and_forced_by_name(monkeypatch):
    """auto takes the Hopper walk where warpgroup MMAs exist and the portable one elsewhere;
    KDARUN_CORE or the core argument forces either, the argument first; forcing the Hopper walk
    where it cannot run, and an unknown name, are refused."""
    host = open_backend("host", announce=False)

    class NoWgmma(type(host)):
        has_wgmma = False

    cfg = synthetic.preset_config("tiny")
    monkeypatch.delenv("KDARUN_CORE", raising=False)
    monkeypatch.delenv("KDARUN_WALK_ROWS", raising=False)
    assert Glm5NextKdaKernels(host, cfg).core == "hopper"
    kn = Glm5NextKdaKernels(NoWgmma(), cfg)
    assert kn.core == "portable" and kn.chunk_inter_name == "kda_chunk_inter_portable_d64"
    monkeypatch.setenv("KDARUN_CORE", "portable")
    assert Glm5NextKdaKernels(host, cfg).chunk_inter_name == "kda_chunk_inter_portable_d64"
    assert Glm5NextKdaKernels(host, cfg, core="hopper").chunk_inter_name == "kda_chunk_inter_d64"
    monkeypatch.setenv("KDARUN_CORE", "hopper")
    with pytest.raises(KdaError, match=r"KDARUN_CORE=hopper: the Hopper walk runs on warpgroup "
                                       r"MMAs, which .* lacks \(needs compute capability 9\.0\)"):
        Glm5NextKdaKernels(NoWgmma(), cfg)
    monkeypatch.setenv("KDARUN_CORE", "wgmma")
    with pytest.raises(KdaError, match=r"KDARUN_CORE: expected one of auto, hopper, portable, "
                                       r"got 'wgmma'"):
        Glm5NextKdaKernels(host, cfg)
    with pytest.raises(KdaError, match=r"^core: expected one of"):
        Glm5NextKdaKernels(host, cfg, core="fast")


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("cc", [90, 80])
@pytest.mark.parametrize("m", [1, 8, 9, 16, 17, 32, 33, 64, 65, 256, 257])
def test_batch_gemvs_run_their_slabs_in_one_launch(m, cc, groups, monkeypatch):
    """o_proj and the front end over m token rows: decode's launch up to DECODE_GEMV_GROUPS
    column groups (its _x2 entries past one), else one launch of every 64-row slab side by
    side (grid x, so that a weight block's slabs are neighbours in launch order), each slab's
    blocks (grid y) those of a single slab's plan;
    on sm_90a from DENSE_WG_FROM_ROWS rows (o_proj) and WG_FROM_ROWS (the front end) the
    launches are gemv_wg.cu's, a block a 64-row tile of weights and of tokens, the matrices by
    tensor maps, o_proj's K shares split over grid z up to DENSE_SPLIT_ROWS rows. The front
    end's sync words hold a pair a slab; o_proj's split scratch a count a (slab, tile) and a
    64 x 64 fp32 tile for each of up to GEMV_WARPS shares. Decode's launches overlap the
    launch before them (DECODE_OVERLAP); the batch forms where m <= BATCH_OVERLAP_ROWS."""
    monkeypatch.setattr(kernels, "DECODE_GEMV_GROUPS", groups)
    cfg = synthetic.preset_config("kimi-linear-48b")
    kn = Glm5NextKdaKernels(host_with_sms(132), cfg)
    kn.use_build(cc)
    launched = []
    monkeypatch.setattr(kn, "_launch", lambda family, name, cfg_, args, stream:
                        launched.append((name, cfg_.grid, args, cfg_.overlap)))
    p = [DevicePtr(16 * (i + 1)) for i in range(14)]
    part, count = DevicePtr(4096), DevicePtr(8192)
    kn.dense_gemv_bf16_batchm(0, p[0], p[1], p[2], cfg.hidden_size, cfg.qkv, m, part, count)
    kn.front_end_gemv(0, *p, m)
    slabs = ceil_div(m, kernels.BATCH_SLAB_ROWS)
    (dense, dense_grid, dense_args, dense_ov), (front, front_grid, front_args, front_ov) = launched
    decode = m <= kernels.GEMV_COLUMNS * kernels.DECODE_GEMV_GROUPS
    assert dense_ov == front_ov == (bool(kernels.DECODE_OVERLAP) if decode else
                                    m <= kernels.BATCH_OVERLAP_ROWS)
    wg = m >= kernels.WG_FROM_ROWS and cc == 90
    dense_wg = m >= kernels.DENSE_WG_FROM_ROWS and cc == 90 and not decode
    if wg:  # six matrices by tensor maps, then the slab kernel's arguments less w_in, x, f_b, g_b
        mats = [(f.ptr, f.rows, f.cols, f.ld) for f in front_args[:6]]
        k, r, ldg = cfg.hidden_size, cfg.rank, cfg.gate_in_width
        assert mats == [(p[0], cfg.proj_rows, k, k), (p[1], m, k, k), (p[5], cfg.qkv, r, r),
                        (p[6], cfg.qkv, r, r), (p[2], m, r, ldg), (p[2] + 2 * r, m, r, ldg)]
        assert tuple(front_args[6:16]) == (*p[2:5], *p[7:14])
        assert int(front_args[18]) == int(front_args[19]) == m
    else:
        assert int(front_args[16]) == int(front_args[17]) == m
        assert tuple(front_args[:14]) == tuple(p)
    if dense_wg:  # the matrices by tensor maps, every row in the one launch
        wmap, xmap = dense_args[:2]
        assert (wmap.ptr, wmap.rows, wmap.cols, wmap.ld) == (p[0], cfg.hidden_size, cfg.qkv,
                                                            cfg.qkv)
        assert (xmap.ptr, xmap.rows, xmap.cols, xmap.ld) == (p[1], m, cfg.qkv, cfg.qkv)
        assert dense_args[2] == p[2] and int(dense_args[5]) == m
        assert tuple(dense_args[-2:]) == (part, count)
    else:  # every row in the one launch, from the given pointers
        assert tuple(dense_args[:3]) == tuple(p[:3]) and int(dense_args[5]) == m
    if decode:
        suffix = "" if m <= kernels.GEMV_COLUMNS else "_x2"
        assert (dense, front) == ("dense_gemv_bf16" + suffix, "front_end_gemv" + suffix)
        assert dense_grid[1] == front_grid[1] == 1  # decode's launches: blocks in grid x
        assert front_grid[0] == kn._front_end_plan[0]  # decode's plan, shares and all
        assert tuple(front_args[-5:]) == kn._front_end_plan[1]
    else:
        if wg:  # a slab a WG_TILE of token rows, as the sync pairs count them
            assert kernels.WG_TILE == kernels.BATCH_SLAB_ROWS
            assert front == "front_end_wg"
            tiles = [ceil_div(n, kernels.WG_TILE) for n in (cfg.gate_in_rows, cfg.conv_dim,
                                                             2 * cfg.qkv)]
            assert front_grid == (slabs, sum(tiles) + 1, 1) == (
                slabs, kn._front_end_wg_plan[0], 1)
        else:
            assert front == "front_end_gemv_batch"
            assert front_grid == (slabs, kn._front_end_batch_plan[0], 1)
        if dense_wg:  # kimi's o_proj: 8 shares, DENSE_SPLIT_SHARES a block up to the limit
            ks = int(dense_args[7])
            assert ks == 8 and dense == "dense_gemv_wg"
            split = ks // kernels.DENSE_SPLIT_SHARES if m <= kernels.DENSE_SPLIT_ROWS else 1
            tiles = ceil_div(cfg.hidden_size, kernels.WG_TILE)
            assert dense_grid == (slabs, tiles, split)
            assert kernels.dense_split_tiles(m, cfg.hidden_size) == tiles * min(
                slabs, kernels.DENSE_SPLIT_ROWS // kernels.WG_TILE)
        else:
            assert dense == "dense_gemv_bf16_batch"
            tiles = ceil_div(cfg.hidden_size, GEMV_TILE)
            assert dense_grid == (slabs, ceil_div(tiles, kernels.GEMV_SLAB_TILES_DENSE), 1)
    assert kernels.front_sync_words(m) == 2 * slabs
    assert workspace.buffer_nbytes(cfg, "front_sync", m) == 4 * 2 * slabs  # a pair a slab
    pairs = kernels.dense_split_tiles(m, cfg.hidden_size)  # o_proj's split: one a (slab, tile)
    assert workspace.buffer_nbytes(cfg, "dense_sync", m) == 4 * pairs
    assert workspace.buffer_nbytes(cfg, "dense_part", m) == 4 * pairs * GEMV_WARPS * 64 * 64


@pytest.mark.parametrize("front_rows, dense_rows", [(12, 16), (16, 12), (8, 8)])
def test_each_gemv_takes_its_x2_entry_up_to_its_own_rows(front_rows, dense_rows, monkeypatch):
    """The front end takes its _x2 entry up to FRONT_END_X2_ROWS rows and o_proj up to
    DENSE_X2_ROWS (within two column groups), the batch kernels past them; one column group
    takes decode's own entry whatever they say."""
    monkeypatch.setattr(kernels, "DECODE_GEMV_GROUPS", 2)
    monkeypatch.setattr(kernels, "FRONT_END_X2_ROWS", front_rows)
    monkeypatch.setattr(kernels, "DENSE_X2_ROWS", dense_rows)
    cfg = synthetic.preset_config("kimi-linear-48b")
    kn = Glm5NextKdaKernels(host_with_sms(132), cfg)
    kn.use_build(90)
    for m in range(1, 18):
        launched = []
        monkeypatch.setattr(kn, "_launch", lambda family, name, cfg_, args, stream:
                            launched.append(name))
        p = [DevicePtr(16 * (i + 1)) for i in range(14)]
        kn.dense_gemv_bf16_batchm(0, p[0], p[1], p[2], cfg.hidden_size, cfg.qkv, m,
                                  DevicePtr(4096), DevicePtr(8192))
        kn.front_end_gemv(0, *p, m)
        want = [entry if m <= 8 else f"{entry}_x2" if m <= rows else batch
                for entry, rows, batch in (("dense_gemv_bf16", dense_rows, "dense_gemv_wg"),
                                           ("front_end_gemv", front_rows,
                                            "front_end_gemv_batch"))]
        assert launched == want, m


def test_batch_gemvs_take_the_slabs_where_the_tensor_copies_cannot_read(monkeypatch):
    """A matrix whose base is not 16-byte aligned (a caller's hidden rows at an odd offset)
    cannot be read by gemv_wg.cu's tensor copies: that call takes the slab kernels (whose rows
    are decode's bits too); the aligned calls around it take gemv_wg.cu's."""
    cfg = synthetic.preset_config("kimi-linear-48b")
    kn = Glm5NextKdaKernels(open_backend("host"), cfg)
    launched = []
    monkeypatch.setattr(kn, "_launch", lambda family, name, cfg_, args, stream:
                        launched.append(name))
    p = [DevicePtr(4096 * (i + 1)) for i in range(14)]
    for x in (p[1], p[1] + 2, p[1] + 16):
        kn.dense_gemv_bf16_batchm(0, p[0], x, p[2], cfg.hidden_size, cfg.qkv, 128, *p[3:5])
        kn.front_end_gemv(0, p[0], x, *p[2:], 128)
    assert launched == ["dense_gemv_wg", "front_end_wg", "dense_gemv_bf16_batch",
                        "front_end_gemv_batch", "dense_gemv_wg", "front_end_wg"]


@pytest.mark.parametrize("sm_count", [108, 132])
def test_decode_walk_runs_in_one_wave(sm_count):
    """kda_decode_rows (and its slot entry) takes DECODE_SPLIT blocks a head where H x
    DECODE_SPLIT blocks fit the SMs once, else half as many: on the H200 (132 SMs)
    kimi-linear-48b's 32 heads x 4 = 128 blocks, glm-5.3-flash's 64 heads x 2; both splits are
    built into the one kernel (recurrent.cu's decode_rows_split)."""
    for preset in ("kimi-linear-48b", "glm-5.3-flash"):
        cfg = synthetic.preset_config(preset)
        kn = Glm5NextKdaKernels(host_with_sms(sm_count), cfg)
        split = kn.decode_split
        assert split in (kernels.DECODE_SPLIT, kernels.DECODE_SPLIT // 2)
        fits = cfg.num_heads * kernels.DECODE_SPLIT <= sm_count
        assert split == (kernels.DECODE_SPLIT if fits else kernels.DECODE_SPLIT // 2), preset
        grid = kn._rows_launch(overlap=False).grid
        assert grid == (cfg.num_heads, split, 1)
        if sm_count == 132:  # the measured case (perf-log v40)
            assert split == {"kimi-linear-48b": 4, "glm-5.3-flash": 2}[preset]


@pytest.mark.parametrize("single, batch_rows", [(1, 0), (0, 32), (0, 0), (1, 15), (0, 30)])
def test_overlapping_launches_are_decodes_and_switched(host, ckpts, monkeypatch, single,
                                                       batch_rows):
    """Decode's GEMVs and stateful walks, whose kernels call prior_grid_sync, are launched to
    overlap the launch before them: decode's own (its GEMV entries up to DECODE_GEMV_GROUPS
    column groups, kda_decode_rows) by DECODE_OVERLAP, the batch kernels (the batch GEMVs,
    kda_decode_batch) where their token rows are at most BATCH_OVERLAP_ROWS; every other
    kernel (prefill's), and a walk that may follow another walk (`stateful_row`), waits for
    the one before."""
    monkeypatch.setattr(kernels, "DECODE_OVERLAP", single)
    monkeypatch.setattr(kernels, "BATCH_OVERLAP_ROWS", batch_rows)
    monkeypatch.setattr(kernels, "DECODE_GEMV_GROUPS", 2)  # 9 rows take the _x2 entries
    env = Env(host, ckpts["bounded"], 256)
    launched: list[tuple[str, bool]] = []
    launch = host.launch
    monkeypatch.setattr(host, "launch", lambda module, kernel, cfg, *rest: (
        launched.append((kernel, cfg.overlap)), launch(module, kernel, cfg, *rest)))
    st = env.state(*env.warm_state(seed=5))
    env.prefill(random_hidden(70, env.cfg.hidden_size, 6), st)
    assert launched and not any(o for _, o in launched)  # prefill's
    d = env.cfg.head_dim
    own = {"front_end_gemv", "dense_gemv_bf16", "front_end_gemv_x2", "dense_gemv_bf16_x2",
           f"kda_decode_rows_d{d}", f"kda_decode_rows_slot_d{d}"}
    batched = {"front_end_gemv_batch", "dense_gemv_wg", f"kda_decode_batch_d{d}"}
    seen: set[str] = set()
    # decode_batch of 5 rows (2 padding) and decode; verify_batch of 15 rows and decode_k;
    # 30 rows, the batch GEMVs; a batch of one, decode's launch (15 and 30: at the bound)
    for nseq, k, seed, pad in [(3, 1, 7, 2), (3, 3, 8, 2), (3, 6, 11, 2), (1, 1, 9, 0)]:
        launched.clear()
        assert_batch_matches_single(env, nseq, k, seed=seed, pad=pad)
        rows = (nseq + pad) * k
        for name, o in launched:
            want = bool(single) and name in own or name in batched and rows <= batch_rows
            assert o == want, (name, rows)
        seen |= {name for name, _ in launched}
    assert seen >= own | batched
    launched.clear()  # the seed API's pieces: a walk after a walk of the same state never
    h = host.upload(random_hidden(2, env.cfg.hidden_size, 10))  # overlaps it
    env.layer.front_end(host, h, 2, env.ws, 0)
    env.layer.stateful_row(host, 0, st, env.ws, 0)
    env.layer.stateful_row(host, 1, st, env.ws, 0)
    env.layer.back_end(host, 2, env.ws, 0)
    assert launched == [("front_end_gemv", bool(single)), (f"kda_decode_rows_d{d}", False),
                        (f"kda_decode_rows_d{d}", False), ("dense_gemv_bf16", bool(single))]


@pytest.mark.parametrize("groups, m, want", [(1, 8, "dense_gemv_bf16"), (1, 9, "dense_gemv_wg"),
                                             (2, 9, "dense_gemv_bf16_x2"),
                                             (2, 16, "dense_gemv_bf16_x2"),
                                             (2, 17, "dense_gemv_wg")])
def test_decode_gemv_groups_set_where_decodes_launch_ends(monkeypatch, groups, m, want):
    """DECODE_GEMV_GROUPS column groups of GEMV_COLUMNS rows take decode's GEMV launch (two:
    its _x2 entries from 9 rows); any other value is refused by name."""
    monkeypatch.setattr(kernels, "DECODE_GEMV_GROUPS", groups)
    cfg = synthetic.preset_config("kimi-linear-48b")
    kn = Glm5NextKdaKernels(host_with_sms(132), cfg)
    kn.use_build(90)
    launched = []
    monkeypatch.setattr(kn, "_launch", lambda family, name, *rest: launched.append(name))
    p = [DevicePtr(4096 * (i + 1)) for i in range(5)]
    kn.dense_gemv_bf16_batchm(0, p[0], p[1], p[2], cfg.hidden_size, cfg.qkv, m, p[3], p[4])
    assert launched == [want]
    monkeypatch.setattr(kernels, "DECODE_GEMV_GROUPS", 4)
    with pytest.raises(KdaError, match=r"^DECODE_GEMV_GROUPS: expected 1 or 2, got 4$"):
        kn.dense_gemv_bf16_batchm(0, p[0], p[1], p[2], cfg.hidden_size, cfg.qkv, m, p[3], p[4])


def test_core_split_switch(ckpts, monkeypatch):
    """KDARUN_CORE_SPLIT=0 keeps the walk after the whole intra kernel (a process held to part
    of the GPU, where the walk's blocks could take every SM it has); a value other than 0 or 1
    is refused."""
    kn = Glm5NextKdaKernels(host_with_sms(132), synthetic.preset_config("tiny", layers=4))
    assert kn.core_split(300) == 4
    monkeypatch.setenv("KDARUN_CORE_SPLIT", "0")
    assert kn.core_split(300) is None
    monkeypatch.setenv("KDARUN_CORE_SPLIT", "yes")
    with pytest.raises(KdaError, match="KDARUN_CORE_SPLIT: expected 0 or 1, got 'yes'"):
        kn.core_split(300)


def test_core_split_where_the_walk_leaves_half_the_sms(ckpts):
    """On an H200's 132 SMs the tiny layer's 4 walk blocks leave the intra kernel's last
    chunks to run beside the walk (kda_chunk_core): the prefill's steps name it, and the
    prefill (5 chunks, 4 alone first) gives the bits of the walk after the whole intra kernel
    (the host twins on one SM, which never split). A pack of several segments (the walk's
    blocks each take a share of them), one chunk, or too few SMs keep the walk apart."""
    split = Env(host_with_sms(132), ckpts["bounded"], 300)
    whole = Env(open_backend("host", announce=False), ckpts["bounded"], 300)
    kn = split.layer.kernels
    assert kn.core_split(300) == 4 and kn.core_split(64) is None
    assert kn.core_split(300, (None, 1, 320)) == 4 and kn.core_split(300, (None, 3, 384)) is None
    assert whole.layer.kernels.core_split(300) is None
    assert Glm5NextKdaKernels(host_with_sms(7), split.cfg).core_split(300) is None
    steps = {s.name: s.kernel for s in split.layer.prefill_steps(0, 300, split.state(),
                                                                 split.ws)}
    assert steps["chunk_inter"] == f"kda_chunk_core_d{split.cfg.head_dim}"
    R, C = whole.warm_state(seed=5)
    h = random_hidden(300, split.cfg.hidden_size, seed=6)
    runs = []
    for env in (split, whole):
        st = env.state(R, C)
        runs.append((env.prefill(h, st), env.ws.read("core", 300)[:300], *st.download()))
    for a, b in zip(*runs):
        assert np.array_equal(bits(a), bits(b))
    split.stack.free(split.gpu), whole.stack.free(whole.gpu)
