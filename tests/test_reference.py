"""The float64 oracle's two core forms agree, and its stages obey their definitions."""

from __future__ import annotations

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
