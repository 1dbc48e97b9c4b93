"""The host backend's layer against the float64 reference, and the layer's contracts:
decode_k bit-identical to serial decodes, prefill->decode continuity, poisoned pad,
windowed prefill, bad token counts."""

from __future__ import annotations

import numpy as np
import pytest

from kdarun import KdaError, reference
from kdarun.dtypes import BF16
from kdarun.run import random_hidden

from .helpers import (BF16_OUT_TOL, E2E_TOL, FP32_TOL, GATES, ROUNDED_TOL, STATE_TOL, Env,
                      assert_decode_k_matches_serial, assert_poisoned_pad_changes_nothing,
                      assert_windowed_matches_one, bits, rel)

@pytest.fixture(scope="module", params=GATES)
def env(request, host, ckpts):
    return Env(host, ckpts[request.param], 256)


@pytest.mark.parametrize("warm", [False, True], ids=["zero-state", "warm-state"])
@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 200])
def test_prefill_matches_reference(env, T, warm):
    R, C = env.warm_state(seed=T + 1000) if warm else (None, None)
    state = env.state(R, C)
    h = random_hidden(T, env.cfg.hidden_size, seed=T)
    out = env.prefill(h, state)
    ref = env.ref(h, R, C)
    assert rel(out, ref.stages["final_out"]) < E2E_TOL
    Rs, Cs = state.download()
    assert rel(Rs, ref.recurrent_state) < STATE_TOL
    assert rel(Cs, ref.conv_state) < BF16_OUT_TOL  # the last rows of qkv_proj


def test_prefill_stage_local(env):
    """Each stage recomputed in float64 from the buffers the previous kernel wrote."""
    cfg, ws, T = env.cfg, env.ws, 130
    R, C = env.warm_state(seed=3)
    state = env.state(R, C)
    h = random_hidden(T, cfg.hidden_size, seed=4)
    env.prefill(h, state, stage_copies=True)
    rd = lambda name: ws.read(name, T).astype(np.float64)  # noqa: E731
    p = reference.projections(env.tensors, h)
    assert rel(rd("qkv_parts"), np.stack([p["q"], p["k"], p["v"]])) < BF16_OUT_TOL
    gate_in = env.gpu.download(ws.ptr("gate_in"), ws.shape("gate_in", T), BF16)
    f_a = gate_in[:, cfg.gate_in_col("f_a"):][:, :cfg.rank].astype(np.float64)
    assert rel(rd("g_raw"), f_a @ env.tensors["f_b_proj.weight"].astype(np.float64).T) \
        < BF16_OUT_TOL
    gate = reference.gate(cfg, env.tensors, rd("g_raw"))
    assert rel(rd("gate")[:T], gate) < FP32_TOL
    conv, _ = reference.conv(cfg, env.tensors, rd("qkv_proj"), C.astype(np.float64))
    # prefill rounds conv+SiLU to bf16 before the L2 norm, so two bf16 roundings
    assert rel(rd("conv_out"), conv) < 2 * BF16_OUT_TOL
    conv, _ = reference.conv(cfg, env.tensors, rd("qkv_proj"), C.astype(np.float64),
                             reference.KDARUN)
    assert rel(rd("conv_out"), conv) < ROUNDED_TOL
    core, S = env.core_reference(T, R)
    assert rel(rd("core")[:T], core) < FP32_TOL
    assert rel(state.download()[0], S) < FP32_TOL
    onorm = reference.gated_rmsnorm(cfg, env.tensors, rd("core")[:T], rd("out_gate"))
    assert rel(rd("o_norm_out"), onorm) < BF16_OUT_TOL
    assert rel(rd("final_out"), reference.o_proj(env.tensors, rd("o_norm_out"))) < BF16_OUT_TOL


def test_decode_chain(env):
    """40-token prefill then 24 decodes: every output and the final state vs the reference."""
    R, C = env.warm_state(seed=11)
    state = env.state(R, C)
    h = random_hidden(64, env.cfg.hidden_size, seed=12)
    outs = [env.prefill(h[:40], state)] + [env.decode(h[t], state) for t in range(40, 64)]
    ref = env.ref(h, R, C)
    assert rel(np.concatenate(outs), ref.stages["final_out"]) < E2E_TOL
    assert rel(np.concatenate(outs[1:]), ref.stages["final_out"][40:]) < E2E_TOL
    Rs, Cs = state.download()
    assert rel(Rs, ref.recurrent_state) < STATE_TOL
    assert rel(Cs, ref.conv_state) < BF16_OUT_TOL  # the last rows of qkv_proj


def test_decode_stage_local(env):
    """The recurrent step recomputed in float64 from the conv_out/gate/beta it read."""
    cfg, ws = env.cfg, env.ws
    R, C = env.warm_state(seed=21)
    state = env.state(R, C)
    env.decode(random_hidden(1, cfg.hidden_size, seed=22)[0], state)
    H, D, qkv = cfg.num_heads, cfg.head_dim, cfg.qkv
    row = ws.read("conv_out", 1).astype(np.float64)
    q, k, v = (row[:, i * qkv:(i + 1) * qkv].reshape(1, H, D) for i in range(3))
    assert np.allclose(np.linalg.norm(q, axis=-1), 1, atol=1e-2)  # L2 fused into the conv
    conv, _ = reference.conv(cfg, env.tensors, ws.read("qkv_proj", 1).astype(np.float64),
                             C.astype(np.float64), reference.KDARUN)
    assert rel(row, conv) < ROUNDED_TOL  # prefill's rounding points: SiLU's, then the L2's
    g, b = ws.read("gate", 1)[:1], ws.read("beta", 1)[:1]
    core, S = reference.core_recurrent(cfg, q, k, v, g, b, R)
    assert rel(ws.read("core", 1)[:1], core) < FP32_TOL
    assert rel(state.download()[0], S) < FP32_TOL


@pytest.mark.parametrize("K", [1, 2, 4, 8])
def test_decode_k_bit_identical_to_serial(env, K):
    assert_decode_k_matches_serial(env, K, seed=30 + 10 * K)


@pytest.mark.parametrize("T", [63, 64, 100])
def test_prefill_then_decode_equals_longer_prefill(env, T):
    R, C = env.warm_state(seed=50)
    h = random_hidden(T + 1, env.cfg.hidden_size, seed=51)
    a = env.state(R, C)
    env.prefill(h[:T], a)
    last_a = env.decode(h[T], a)
    b = env.state(R, C)
    last_b = env.prefill(h, b)[T:]
    # decode normalises q/k before rounding them, prefill after: each path is within E2E_TOL
    # of float64 and they differ by rounding noise (measured <= 6.8e-3 on the H200, D = 128)
    assert rel(last_a, last_b) < E2E_TOL
    assert rel(a.download()[0], b.download()[0]) < BF16_OUT_TOL
    # GEMV vs GEMM summation order may flip a bf16 rounding of the newest conv-state row
    assert rel(a.download()[1], b.download()[1]) < BF16_OUT_TOL


@pytest.mark.parametrize("fill", [np.nan, 1e30, -1e30])
@pytest.mark.parametrize("T", [1, 65, 100])
def test_poisoned_pad_changes_nothing(env, T, fill):
    assert_poisoned_pad_changes_nothing(env, T, fill, seed=60)


def test_windowed_prefill_equals_one_prefill(host, ckpts):
    # same math; GEMM blocking may differ with the row count
    assert_windowed_matches_one(Env(host, ckpts["bounded"], 64), Env(host, ckpts["bounded"], 256),
                                150, 70, FP32_TOL * 10, FP32_TOL)


def test_bad_token_counts(env):
    state = env.state()
    h = env.gpu.upload(random_hidden(8, env.cfg.hidden_size, seed=80))
    with pytest.raises(KdaError, match="300 tokens exceed the workspace's max_tokens 256"):
        env.layer.prefill(env.gpu, h, 300, state, env.ws, 0)
    with pytest.raises(KdaError, match="positive integer"):
        env.layer.prefill(env.gpu, h, 0, state, env.ws, 0)
    with pytest.raises(KdaError, match=r"k must be an integer in \[1, 8\], got 9"):
        env.layer.decode_k(env.gpu, h, 9, state, env.ws, [], 0)
    with pytest.raises(KdaError, match="pass k-1 = 3 snapshots or none, got 1"):
        env.layer.decode_k(env.gpu, h, 4, state, env.ws, [(state.recurrent, state.conv)], 0)


def test_stack_free_releases_everything(ckpts):
    from kdarun import open_backend
    from kdarun.loader import load_stack
    gpu = open_backend("host")  # its own backend: the allocations checked are this stack's
    stack = load_stack(gpu, ckpts["softplus"], 16, [1])
    w_in = stack.layer(1).weights.w_in
    stack.free(gpu)
    with pytest.raises(KdaError, match="not the start of a live allocation"):
        gpu.free(w_in)


@pytest.mark.parametrize("stage_copies", [False, True])
def test_stage_copies_only_for_a_stage_hook(env, stage_copies):
    """No prefill kernel reads qkv_parts, q/k/v_f32, gate or beta (the chunk kernels read
    conv_out, g_raw and b), so a prefill writes them only under a stage hook: without one the
    poisoned workspace keeps its NaN there; with one every row is written. Nothing else
    changes."""
    T = 70
    h, (R, C) = random_hidden(T, env.cfg.hidden_size, seed=62), env.warm_state(63)
    out = env.prefill(h, env.state(R, C), stage_copies=stage_copies)
    for name in ("qkv_parts", "q_f32", "k_f32", "v_f32", "gate", "beta"):
        x = env.ws.read(name, T).astype(np.float32)
        assert np.isnan(x).all() if not stage_copies else not np.isnan(x).any(), name
    assert not np.isnan(env.ws.read("conv_out", T).astype(np.float32)).any()
    assert np.array_equal(bits(out), bits(env.prefill(h, env.state(R, C),
                                                      stage_copies=not stage_copies)))
