"""CUDA decode and decode_k: every stage against the host backend and the float64
reference, decode chains, bit-identical decode_k and graph replay."""

from __future__ import annotations

import numpy as np
import pytest

from kdarun import kernels, reference
from kdarun.kernels import Glm5NextKdaKernels
from kdarun.run import random_hidden

from ..helpers import (BF16_OUT_TOL, E2E_TOL, FP32_TOL, ROUNDED_TOL, STATE_TOL,
                       assert_decode_k_matches_serial, bits, rel)

BUFFERS_1ROW = ("qkv_parts", "qkv_proj", "conv_out", "g_raw", "out_gate", "o_norm_out",
                "final_out")
PADDED = ("gate", "beta", "core")


def _decode_both(pair, seed):
    cu, ho = pair
    R, C = ho.warm_state(seed=seed)
    h = random_hidden(1, cu.cfg.hidden_size, seed=seed + 1)
    states = []
    for env in (cu, ho):
        st = env.state(R, C)
        env.decode(h[0], st)
        states.append(st)
    return R, C, h, states


def test_decode_stages_match_host_and_reference(pair):
    cu, ho = pair
    R, C, h, (s_cu, s_ho) = _decode_both(pair, 100)
    ref = ho.ref(h, R, C)
    for name in BUFFERS_1ROW + PADDED:
        a, b = cu.ws.read(name, 1), ho.ws.read(name, 1)
        if name in PADDED:
            a, b = a[:1], b[:1]
        assert rel(a, b) < BF16_OUT_TOL, name
    assert rel(cu.ws.read("final_out", 1), ref.stages["final_out"]) < E2E_TOL
    for a, b in zip(s_cu.download(), s_ho.download()):
        assert rel(a, b) < BF16_OUT_TOL
    # stage-local: the CUDA recurrent step against float64 fed its own inputs
    cfg = cu.cfg
    row = cu.ws.read("conv_out", 1).astype(np.float64)
    q, k, v = (row[:, i * cfg.qkv:(i + 1) * cfg.qkv].reshape(1, cfg.num_heads, cfg.head_dim)
               for i in range(3))
    core, S = reference.core_recurrent(cfg, q, k, v, cu.ws.read("gate", 1)[:1],
                                       cu.ws.read("beta", 1)[:1], R)
    assert rel(cu.ws.read("core", 1)[:1], core) < FP32_TOL
    assert rel(s_cu.download()[0], S) < FP32_TOL
    gate = reference.gate(cfg, cu.tensors, cu.ws.read("g_raw", 1))
    assert rel(cu.ws.read("gate", 1)[:1], gate) < FP32_TOL
    conv, _ = reference.conv(cfg, cu.tensors, cu.ws.read("qkv_proj", 1).astype(np.float64),
                             C.astype(np.float64), reference.KDARUN)
    assert rel(row, conv) < ROUNDED_TOL  # prefill's rounding points: SiLU's, then the L2's


def test_decode_norm_bit_identical_to_prefill_norm(pair):
    """Decode's fused gated RMSNorm and prefill's gated_rmsnorm share one formula: fed the
    core and out_gate rows a decode wrote, the prefill kernel writes decode's bits."""
    cu, ho = pair
    R, C = ho.warm_state(seed=150)
    cu.decode(random_hidden(1, cu.cfg.hidden_size, seed=151)[0], cu.state(R, C))
    ws = cu.ws
    want = ws.read("o_norm_out", 1)
    cu.gpu.memset(ws.o_norm_out, 0xFF, ws.nbytes("o_norm_out", 1), 0)  # NaN
    cu.layer.kernels.gated_rmsnorm(0, ws.core, ws.out_gate, cu.layer.weights.o_norm,
                                   ws.o_norm_out, 1)
    assert np.array_equal(bits(ws.read("o_norm_out", 1)), bits(want))


def test_decode_chain_64_steps(pair):
    """Host-prefilled state, then 64 CUDA decodes: outputs and final state vs float64."""
    cu, ho = pair
    h = random_hidden(164, cu.cfg.hidden_size, seed=200)
    hs = ho.state()
    ho.prefill(h[:100], hs)
    R, C = hs.download()
    st = cu.state(R, C)
    outs = np.concatenate([cu.decode(h[t], st) for t in range(100, 164)])
    ref = cu.ref(h)
    assert rel(outs, ref.stages["final_out"][100:]) < E2E_TOL
    Rs, Cs = st.download()
    assert rel(Rs, ref.recurrent_state) < STATE_TOL
    assert rel(Cs, ref.conv_state) < BF16_OUT_TOL


@pytest.mark.parametrize("K", [1, 4])
def test_decode_split_does_not_change_bits(pair, monkeypatch, K):
    """kda_decode_rows at DECODE_SPLIT blocks a head and at half as many (the form a GPU with
    fewer SMs than H x DECODE_SPLIT takes): the same outputs and states, bit for bit, and the
    launch takes the split asked for."""
    cu, _ = pair
    R, C = cu.warm_state(seed=170 + K)
    h = cu.gpu.upload(random_hidden(K, cu.cfg.hidden_size, seed=171 + K))
    grids, launch = [], cu.gpu.launch
    monkeypatch.setattr(cu.gpu, "launch", lambda module, kernel, cfg, *rest: (
        grids.append(cfg.grid) if kernel.startswith("kda_decode_rows") else None,
        launch(module, kernel, cfg, *rest)))
    got = []
    for split in (kernels.DECODE_SPLIT, kernels.DECODE_SPLIT // 2):
        monkeypatch.setattr(Glm5NextKdaKernels, "decode_split", property(lambda self: split))
        st = cu.state(R, C)
        cu.ws.poison(0)
        cu.layer.decode_k(cu.gpu, h, K, st, cu.ws, [], 0)
        got.append([cu.ws.read("final_out", K)] + list(st.download()))
    assert [g[1] for g in grids] == [kernels.DECODE_SPLIT, kernels.DECODE_SPLIT // 2]
    for a, b in zip(*got):
        assert np.array_equal(bits(a), bits(b))
    cu.gpu.free(h)


@pytest.mark.parametrize("K", [1, 2, 4, 8])
def test_decode_k_bit_identical_to_serial(pair, K):
    assert_decode_k_matches_serial(pair[0], K, seed=300 + 10 * K)


def test_seed_pieces_chained_equal_decode_k(pair):
    """front_end over 4 rows, stateful_row 0..3 and back_end, enqueued with nothing between
    them (a walk right after a walk of the same state: launched without overlap), give
    decode_k's outputs and states bit for bit."""
    cu, _ = pair
    gpu, K = cu.gpu, 4
    stream = gpu.create_stream()
    R, C = cu.warm_state(seed=410)
    h = gpu.upload(random_hidden(K, cu.cfg.hidden_size, seed=411))
    st = cu.state(R, C)
    cu.layer.decode_k(gpu, h, K, st, cu.ws, [], stream)
    gpu.synchronize(stream)
    want = [cu.ws.read("final_out", K)] + list(st.download())
    st.upload(R.astype(np.float32), C, stream)
    cu.ws.poison(stream)
    cu.layer.front_end(gpu, h, K, cu.ws, stream)
    for row in range(K):
        cu.layer.stateful_row(gpu, row, st, cu.ws, stream)
    cu.layer.back_end(gpu, K, cu.ws, stream)
    gpu.synchronize(stream)
    got = [cu.ws.read("final_out", K)] + list(st.download())
    for a, b in zip(want, got):
        assert np.array_equal(bits(a), bits(b))
    gpu.destroy_stream(stream)


@pytest.mark.parametrize("K", [1, 4])
def test_graph_replay_bit_identical_to_eager(pair, K):
    cu, _ = pair
    gpu = cu.gpu
    stream = gpu.create_stream()
    R, C = cu.warm_state(seed=400)
    h = gpu.upload(random_hidden(K, cu.cfg.hidden_size, seed=401))
    st = cu.state(R, C)
    dst = [cu.state() for _ in range(K - 1)]
    snaps = [(s.recurrent, s.conv) for s in dst]
    run = lambda: cu.layer.decode_k(gpu, h, K, st, cu.ws, snaps, stream)  # noqa: E731
    run()  # eager, also the warm-up capture needs
    gpu.synchronize(stream)
    eager = [cu.ws.read("final_out", K)] + list(st.download()) + [a for s in dst for a in s.download()]
    st.upload(R.astype(np.float32), C)
    graph = gpu.capture(run, stream)
    cu.ws.poison(stream)
    graph.replay(stream)
    gpu.synchronize(stream)
    replay = [cu.ws.read("final_out", K)] + list(st.download()) + [a for s in dst for a in s.download()]
    for a, b in zip(eager, replay):
        assert np.array_equal(bits(a), bits(b))
    gpu.destroy_stream(stream)
