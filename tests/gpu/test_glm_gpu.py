"""The seeds' own model shape, glm-5.3-flash (hidden 4096, H 64, D 128, bounded gate), from a
checkpoint in its own layout (nested text_config, model.language_model prefix, sharded):
prefill, decode and decode_k against the float64 reference; decode_k bit-identical to serial
decodes; the poisoned pad; batched decode bit-identical to decode."""

from __future__ import annotations

import numpy as np
import pytest

from kdarun import synthetic
from kdarun.run import random_hidden

from ..helpers import (E2E_TOL, STATE_TOL, Env, assert_batch_matches_single,
                       assert_decode_k_matches_serial, bits, rel)


@pytest.fixture(scope="module")
def glm(cuda, tmp_path_factory):
    cfg = synthetic.preset_config("glm-5.3-flash", layers=2)
    assert cfg.layout == "glm5_next" and cfg.gate_form == "bounded"
    path = synthetic.write_checkpoint(tmp_path_factory.mktemp("glm"), cfg, seed=21, shards=2)
    return Env(cuda, str(path), 1024, layer_idx=1)


@pytest.mark.parametrize("T", [1, 65, 1000])
def test_prefill_then_decode_against_reference(glm, T):
    R, C = glm.warm_state(seed=T, tokens=20)
    h = random_hidden(T + 2, glm.cfg.hidden_size, seed=T + 1)
    st = glm.state(R, C)
    out = np.concatenate([glm.prefill(h[:T], st)] + [glm.decode(h[t], st) for t in (T, T + 1)])
    ref = glm.ref(h, R, C)
    assert rel(out, ref.stages["final_out"]) < E2E_TOL
    assert rel(st.download()[0], ref.recurrent_state) < STATE_TOL


def test_decode_k_bit_identical_to_serial(glm):
    assert_decode_k_matches_serial(glm, 4, seed=31)


@pytest.mark.parametrize("fill", [np.nan, 1e30])
def test_poisoned_pad_bit_identical(glm, fill):
    R, C = glm.warm_state(seed=41, tokens=20)
    h = random_hidden(100, glm.cfg.hidden_size, seed=42)
    a, b = glm.state(R, C), glm.state(R, C)
    assert np.array_equal(bits(glm.prefill(h, a, 0.0)), bits(glm.prefill(h, b, fill)))
    for x, y in zip(a.download(), b.download()):
        assert np.array_equal(bits(x), bits(y))


def test_decode_batch_bit_identical_to_decode(glm):
    assert_batch_matches_single(glm, 70, 1, seed=51)
