"""CUDA chunked prefill, on each walk of the chunked core (the Hopper and the portable one):
outputs, every stage and the final state against the host backend and the float64 reference;
poisoned pad; continuity with decode; windows; extreme gates; the two walks against each
other."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kdarun import synthetic
from kdarun.dtypes import BF16
from kdarun.kernels import SMEM_PER_BLOCK, WALK_ROWS
from kdarun.run import random_hidden
from kdarun.stages import STAGE_TOL

from ..helpers import (BF16_OUT_TOL, E2E_TOL, FP32_TOL, STATE_TOL, Env,
                       assert_poisoned_pad_changes_nothing, assert_windowed_matches_one, bits,
                       forced_core, rel)

STAGES = ("qkv_parts", "qkv_proj", "conv_out", "g_raw", "out_gate", "gate", "beta", "q_f32",
          "k_f32", "v_f32", "core", "o_norm_out", "final_out")
VALID_ROWS = ("gate", "beta", "core")  # q/k/v_f32's padded rows are compared too


@pytest.mark.parametrize("warm", [False, True], ids=["zero-state", "warm-state"])
@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 1000, 4096])
def test_prefill_vs_reference_and_host(core_pair, T, warm):
    cu, ho = core_pair
    R, C = ho.warm_state(seed=500 + T) if warm else (None, None)
    h = random_hidden(T, cu.cfg.hidden_size, seed=T)
    s_cu, s_ho = cu.state(R, C), ho.state(R, C)
    # with the stage copies no kernel reads (qkv_parts, q/k/v_f32: prefill_stage_copies)
    out = cu.prefill(h, s_cu, stage_copies=True)
    ho.prefill(h, s_ho, stage_copies=True)
    for name in STAGES:
        a, b = cu.ws.read(name, T), ho.ws.read(name, T)
        if name in VALID_ROWS:
            a, b = a[:T], b[:T]
        # the per-buffer table `kdarun stages --against` uses for two backends' stages
        assert rel(a, b) < STAGE_TOL[name], name
    ref = cu.ref(h, R, C)
    assert rel(out, ref.stages["final_out"]) < E2E_TOL
    Rs, Cs = s_cu.download()
    assert rel(Rs, ref.recurrent_state) < STATE_TOL
    assert rel(Rs, s_ho.download()[0]) < STAGE_TOL["state.recurrent"]  # measured <= 5.1e-3
    assert np.array_equal(bits(Cs), bits(s_ho.download()[1])) or rel(Cs, ref.conv_state) < BF16_OUT_TOL


def test_chunk_core_stage_local(core_pair):
    """The CUDA chunk core against the float64 recurrence fed the buffers it read."""
    cu, ho = core_pair
    cfg, T = cu.cfg, 1000
    R, C = ho.warm_state(seed=600)
    st = cu.state(R, C)
    cu.prefill(random_hidden(T, cfg.hidden_size, seed=601), st, stage_copies=True)  # gate, beta
    core, S = cu.core_reference(T, R)
    assert rel(cu.ws.read("core", T)[:T].astype(np.float64), core) < FP32_TOL
    assert rel(st.download()[0], S) < FP32_TOL


@pytest.mark.parametrize("fill", [np.nan, 1e30])
@pytest.mark.parametrize("T", [1, 65, 1000])
def test_poisoned_pad_bit_identical(core_pair, T, fill):
    assert_poisoned_pad_changes_nothing(core_pair[0], T, fill, seed=700)


@pytest.mark.parametrize("T", [64, 1000])
def test_prefill_then_decode_equals_longer_prefill(core_pair, T):
    cu, _ = core_pair
    R, C = cu.warm_state(seed=800)
    h = random_hidden(T + 1, cu.cfg.hidden_size, seed=801)
    a, b = cu.state(R, C), cu.state(R, C)
    cu.prefill(h[:T], a)
    last_a = cu.decode(h[T], a)
    last_b = cu.prefill(h, b)[T:]
    # decode normalises q/k before rounding them, prefill after: each path is within E2E_TOL
    # of float64 and they differ by rounding noise (measured <= 6.8e-3, D = 128)
    assert rel(last_a, last_b) < E2E_TOL
    assert rel(a.download()[0], b.download()[0]) < BF16_OUT_TOL


def test_prefill_on_a_created_stream_equals_default_stream(core_pair):
    """Every launch and library call must follow the caller's stream: a prefill enqueued on a
    non-blocking stream, read back through that stream, equals the default-stream run."""
    cu, _ = core_pair
    gpu = cu.gpu
    R, C = cu.warm_state(seed=1100)
    h = random_hidden(1000, cu.cfg.hidden_size, seed=1101)
    a = cu.state(R, C)
    ref_out = cu.prefill(h, a)
    stream = gpu.create_stream()
    b = cu.state(R, C)
    hp = gpu.upload(h, stream)
    cu.ws.poison(stream)
    cu.layer.prefill(gpu, hp, 1000, b, cu.ws, stream)
    out = gpu.download(cu.ws.final_out, h.shape, BF16, stream)
    assert np.array_equal(bits(out), bits(ref_out))
    for x, y in zip(a.download(), b.download(stream)):
        assert np.array_equal(bits(x), bits(y))
    gpu.destroy_stream(stream)


def test_windowed_prefill_equals_one_prefill(cuda, gpu_ckpts, core):
    with forced_core(core):
        small, large = Env(cuda, gpu_ckpts["bounded"], 256), Env(cuda, gpu_ckpts["bounded"], 2048)
    assert_windowed_matches_one(small, large, 1500, 900, BF16_OUT_TOL, BF16_OUT_TOL)


def _extreme_ckpt(tmp_path, gate, lower_bound, a_log):
    cfg = synthetic.preset_config("tiny", gate, layers=4, lower_bound=lower_bound)
    path = synthetic.write_checkpoint(tmp_path, cfg, seed=13)
    if a_log is not None:
        f = path / "model.safetensors"
        t = load_file(str(f))
        for k in t:
            if k.endswith("A_log"):
                t[k] = np.full_like(t[k], a_log)
        save_file(t, str(f))
    return str(path)


@pytest.mark.parametrize("gate, lower_bound, a_log", [
    ("bounded", -5.0, None), ("bounded", -0.01, None), ("bounded", -5.0, np.log(1e3)),
    ("softplus", -5.0, np.log(1e3)), ("softplus", -5.0, np.log(1e-3)),
])
def test_extreme_gates_long_sequence(cuda, tmp_path, core, gate, lower_bound, a_log):
    with forced_core(core):
        env = Env(cuda, _extreme_ckpt(tmp_path, gate, lower_bound, a_log), 4096)
    h = random_hidden(4096, env.cfg.hidden_size, seed=1000)
    st = env.state()
    out = env.prefill(h, st, stage_copies=True)  # gate for the check below
    g = env.ws.read("gate", 4096)
    assert np.all(np.isfinite(g)) and np.all(g <= 0)
    ref = env.ref(h)
    assert rel(out, ref.stages["final_out"]) < E2E_TOL
    assert rel(st.download()[0], ref.recurrent_state) < STATE_TOL


@pytest.mark.parametrize("T", [65, 1000, 4096])
def test_portable_walk_agrees_with_the_hopper_walk(cuda, gpu_ckpts, T):
    """Both walks (the portable one in blocks of both sizes) from one warm state on the same
    layer: core and state within the chunked core's fp32 tolerance of each other (they differ
    in summation order alone)."""
    if not cuda.has_wgmma:
        pytest.skip(f"{cuda.device_name} has no warpgroup MMAs: the Hopper walk cannot run")
    for name in ("softplus", "d128"):
        envs = {}
        for core in ("hopper", "portable", "portable:64"):
            with forced_core(core):
                envs[core] = Env(cuda, gpu_ckpts[name], 4096)
        assert envs["portable"].layer.kernels.walk_rows == WALK_ROWS // 2  # few heads: spread
        R, C = envs["hopper"].warm_state(seed=1200)
        h = random_hidden(T, envs["hopper"].cfg.hidden_size, seed=1201)
        got = {}
        for core, env in envs.items():
            st = env.state(R, C)
            env.prefill(h, st)
            got[core] = env.ws.read("core", T)[:T], st.download()[0]
        for core in ("portable", "portable:64"):
            assert rel(got[core][0], got["hopper"][0]) < FP32_TOL, (name, core)
            assert rel(got[core][1], got["hopper"][1]) < FP32_TOL, (name, core)
        for i in (0, 1):  # a thread's arithmetic does not depend on its block's size
            assert np.array_equal(bits(got["portable"][i]), bits(got["portable:64"][i])), name


@pytest.mark.parametrize("walk", ["portable", "portable:64"])
@pytest.mark.parametrize("name", ["softplus", "d128"])
def test_the_smallest_shared_memory_build_agrees(cuda, gpu_ckpts, name, walk):
    """The chunk kernels as built for the GPUs whose block may take the least shared memory
    (99 KB: the intra kernel staging 32 dimensions at a time, the portable walk's shortest
    ring) and for sm_80 (163 KB), run here: within the chunked core's tolerance of this GPU's
    own build and of the float64 recurrence fed the same buffers."""
    with forced_core(walk):
        env = Env(cuda, gpu_ckpts[name], 4096)
    cfg, T = env.cfg, 1000
    D = cfg.head_dim
    R, C = env.warm_state(seed=1300)
    h = random_hidden(T, cfg.hidden_size, seed=1301)
    runs = []
    # and sm_80's: a ring of 4 slots in blocks of 32 rows, 3 in blocks of 64
    for cc in (cuda.compute_capability, 80, min(SMEM_PER_BLOCK, key=SMEM_PER_BLOCK.get)):
        kn = env.layer.kernels
        kn.use_build(cc)
        assert max(cuda.shared_bytes(kn.modules[fam], kernel) for fam, kernel in (
            ("chunk", f"kda_chunk_intra_d{D}"), ("chunk_portable", kn.chunk_inter_name))
        ) <= SMEM_PER_BLOCK[cc]
        st = env.state(R, C)
        env.prefill(h, st, stage_copies=True)  # gate and beta for core_reference
        runs.append((env.ws.read("core", T)[:T].copy(), st.download()[0]))
    (core_own, S_own), (core_80, S_80), (core_small, S_small) = runs
    for c, S in ((core_80, S_80), (core_small, S_small)):
        assert rel(c, core_own) < FP32_TOL
        assert rel(S, S_own) < FP32_TOL
    core, S = env.core_reference(T, R)
    assert rel(core_small, core) < FP32_TOL
    assert rel(S_small, S) < FP32_TOL
