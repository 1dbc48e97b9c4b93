"""The float64 oracle's two core forms agree, and its stages obey their definitions."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kdarun import reference, synthetic

from .helpers import GATES


def _random_core_inputs(cfg, T, rng, decay_scale=1.0):
    H, D = cfg.num_heads, cfg.head_dim
    q, k = (rng.standard_normal((T, H, D)) for _ in range(2))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    v = rng.standard_normal((T, H, D))
    g = -decay_scale * rng.exponential(0.1, (T, H, D))
    b = rng.uniform(0, 1, (T, H))
    S0 = rng.standard_normal((H, D, D)) * 0.1
    return q, k, v, g, b, S0


@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("decay_scale", [0.0, 1.0, 50.0])
def test_chunked_equals_recurrent(T, decay_scale):
    cfg = synthetic.preset_config("tiny", layers=4)
    args = _random_core_inputs(cfg, T, np.random.default_rng(T), decay_scale)
    o1, s1 = reference.core_recurrent(cfg, *args)
    o2, s2 = reference.core_chunked(cfg, *args)
    assert np.all(np.isfinite(o2)) and np.all(np.isfinite(s2))
    assert np.abs(o1 - o2).max() < 1e-10 * max(1, np.abs(o1).max())
    assert np.abs(s1 - s2).max() < 1e-10 * max(1, np.abs(s1).max())


@pytest.mark.parametrize("gate", GATES)
def test_gate_forms(gate):
    cfg = synthetic.preset_config("tiny", gate, layers=4, lower_bound=-2.0)
    t = synthetic.synth_layer_tensors(cfg, np.random.default_rng(0))
    g_raw = np.random.default_rng(1).standard_normal((5, cfg.qkv)) * 3
    g = reference.gate(cfg, t, g_raw)
    assert np.all(g <= 0)
    if gate == "bounded":
        assert np.all(g >= -2.0)
    a = np.exp(np.float64(t["A_log"].reshape(-1)[0]))
    x = g_raw[0, 0] + np.float64(t["dt_bias"][0])
    want = -a * np.log1p(np.exp(x)) if gate == "softplus" else -2.0 / (1 + np.exp(-a * x))
    assert g[0, 0, 0] == pytest.approx(want, rel=1e-12)


def test_conv_is_causal_with_carried_state():
    """Splitting a sequence and carrying the conv state gives the same conv output."""
    cfg = synthetic.preset_config("tiny", layers=4)
    t = synthetic.synth_layer_tensors(cfg, np.random.default_rng(0))
    x = np.random.default_rng(2).standard_normal((10, cfg.conv_dim))
    s0 = np.random.default_rng(3).standard_normal((cfg.conv_kernel - 1, cfg.conv_dim))
    whole, s_whole = reference.conv(cfg, t, x, s0)
    a, s_mid = reference.conv(cfg, t, x[:4], s0)
    b, s_end = reference.conv(cfg, t, x[4:], s_mid)
    assert np.allclose(np.concatenate([a, b]), whole, rtol=0, atol=1e-13)
    assert np.array_equal(s_end, s_whole)
    qn = np.linalg.norm(whole[:, :cfg.head_dim], axis=-1)
    assert np.allclose(qn, 1, atol=1e-5)


@pytest.mark.parametrize("rounding", [reference.EXACT, reference.KDARUN,
                                      reference.Rounding(buffers=True, beta=True)])
def test_rounding_points(rounding):
    """Each stage is bf16-representable exactly where `rounding` rounds it, and the stages
    after a rounding point are computed from the rounded value."""
    cfg = synthetic.preset_config("tiny", layers=4)
    t = synthetic.synth_layer_tensors(cfg, np.random.default_rng(0))
    h = np.random.default_rng(1).standard_normal((6, cfg.hidden_size)).astype(ml_dtypes.bfloat16)
    R = np.zeros((cfg.num_heads, cfg.head_dim, cfg.head_dim))
    r = reference.layer(cfg, t, h, R, np.zeros((cfg.conv_kernel - 1, cfg.conv_dim)),
                        rounding=rounding)
    s = r.stages

    def is_bf16(x):
        return np.array_equal(np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float64), x)

    for name in ("qkv_proj", "g_raw", "out_gate", "o_norm_out", "final_out"):
        assert is_bf16(s[name]) == rounding.buffers, name
    assert is_bf16(s["conv_out"][:, 2 * cfg.qkv:]) == rounding.buffers  # v: the SiLU's point
    assert is_bf16(s["conv_out"][:, :2 * cfg.qkv]) == rounding.qk
    assert is_bf16(s["beta"]) == rounding.beta
    assert np.array_equal(s["gate"], reference.gate(cfg, t, s["g_raw"]))
    q, k, v = (s["conv_out"][:, i * cfg.qkv:(i + 1) * cfg.qkv].reshape(6, cfg.num_heads, -1)
               for i in range(3))
    core, _ = reference.core_recurrent(cfg, q, k, v, s["gate"], s["beta"], R)
    assert np.array_equal(s["core"], core)
