"""Config and checkpoint reading: the good paths and every kind of bad input, each a
KdaError naming the field or tensor with expected vs actual."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kdarun import Checkpoint, Glm5NextKdaConfig, KdaError, synthetic
from kdarun.checkpoint import LAYER_PREFIXES, tensor_name

KIMI = LAYER_PREFIXES["kimi_linear"]

MINIMAL = {
    "hidden_size": 256, "num_hidden_layers": 4, "rms_norm_eps": 1e-5,
    "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 64,
                           "num_heads": 4, "short_conv_kernel_size": 4},
}


def test_minimal_config_and_1_based_layers():
    cfg = Glm5NextKdaConfig.from_hf(MINIMAL)
    assert cfg.kda_layers == (0, 1, 2) and cfg.full_attn_layers == (3,)
    assert cfg.layout == "kimi_linear"
    assert cfg.gate_form == "softplus" and cfg.qkv == 256 and cfg.conv_dim == 768
    bounded = json.loads(json.dumps(MINIMAL))
    bounded["linear_attn_config"]["gate_lower_bound"] = -5.0
    assert Glm5NextKdaConfig.from_hf(bounded).gate_form == "bounded"
    assert Glm5NextKdaConfig.from_hf(cfg.to_hf()) == cfg


def test_real_kimi_config_extra_fields_are_ignored():
    full = json.loads(json.dumps(MINIMAL))
    full.update({"vocab_size": 163840, "num_experts": 256, "model_type": "kimi_linear",
                 "architectures": ["KimiLinearForCausalLM"]})
    full["linear_attn_config"]["something_else"] = 1
    assert Glm5NextKdaConfig.from_hf(full).hidden_size == 256


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("hidden_size"), "missing field hidden_size"),
    (lambda c: c["linear_attn_config"].pop("num_heads"), "missing field linear_attn_config.num_heads"),
    (lambda c: c.update(hidden_size=250), "hidden_size must be a multiple of 8 .* got 250"),
    (lambda c: c["linear_attn_config"].update(head_dim=96), r"head_dim must be one of \(64, 128\), got 96"),
    (lambda c: c["linear_attn_config"].update(gate_lower_bound=-7.0), r"gate_lower_bound must be a number in \[-5, 0\) or absent/None, got -7.0"),
    (lambda c: c["linear_attn_config"].update(kda_layers=[0, 1]), r"kda_layers are 1-based and must lie in \[1, 4\], got \[0\]"),
    (lambda c: c["linear_attn_config"].update(kda_layers=[1, 4]), r"must be disjoint, got \[3\]"),
    (lambda c: c.update(rms_norm_eps=0), r"rms_norm_eps must be a number in \(0, 1\), got 0"),
])
def test_bad_config(edit, message):
    cfg = json.loads(json.dumps(MINIMAL))
    edit(cfg)
    with pytest.raises(KdaError, match=message):
        Glm5NextKdaConfig.from_hf(cfg)


def test_config_file_errors(tmp_path):
    with pytest.raises(KdaError, match="config not found"):
        Glm5NextKdaConfig.from_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(KdaError, match="not valid JSON"):
        Glm5NextKdaConfig.from_json(tmp_path / "config.json")


@pytest.fixture
def ckpt_copy(ckpts, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpts["softplus"], dst)
    return dst


def _edit_tensor(path, name, fn):
    f = path / "model.safetensors"
    t = load_file(str(f))
    fn(t, name)
    save_file(t, str(f))


def test_reads_single_and_sharded_identically(tmp_path):
    cfg = synthetic.preset_config("tiny", layers=8)
    one = Checkpoint(synthetic.write_checkpoint(tmp_path / "one", cfg, seed=3))
    many = Checkpoint(synthetic.write_checkpoint(tmp_path / "many", cfg, seed=3, shards=3))
    assert len({p.name for p in many.weight_map.values()}) == 3
    for i in cfg.kda_layers:
        a, b = one.layer_tensors(i), many.layer_tensors(i)
        assert a.keys() == b.keys()
        assert all(np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)) for k in a)
    assert one.layer_tensors(0)["A_log"].shape == (4,)
    assert one.problems() == []


def test_a_log_as_h_vector_is_accepted(ckpt_copy):
    name = tensor_name(KIMI, 0, "A_log")
    _edit_tensor(ckpt_copy, name, lambda t, n: t.__setitem__(n, t[n].reshape(-1)))
    assert Checkpoint(ckpt_copy).layer_tensors(0)["A_log"].shape == (4,)


def test_missing_tensor(ckpt_copy):
    name = tensor_name(KIMI, 1, "g_b_proj.weight")
    _edit_tensor(ckpt_copy, name, lambda t, n: t.pop(n))
    with pytest.raises(KdaError, match=f"missing tensor {name}"):
        Checkpoint(ckpt_copy).layer_tensors(1)


def test_unknown_tensor_in_a_kda_layer_is_refused(ckpt_copy):
    name = tensor_name(KIMI, 0, "g_b_proj.bias")
    _edit_tensor(ckpt_copy, name, lambda t, n: t.__setitem__(n, np.ones(256, ml_dtypes.bfloat16)))
    with pytest.raises(KdaError, match=r"layer 0 has tensors kdarun does not implement: "
                                       r"\['model.layers.0.self_attn.g_b_proj.bias'\]"):
        Checkpoint(ckpt_copy).layer_tensors(0)
    assert Checkpoint(ckpt_copy).layer_tensors(1)  # other layers are unaffected


def test_wrong_shape(ckpt_copy):
    name = tensor_name(KIMI, 0, "o_proj.weight")
    _edit_tensor(ckpt_copy, name, lambda t, n: t.__setitem__(n, t[n][:, :128].copy()))
    with pytest.raises(KdaError, match=rf"{name} has shape \[256, 128\], expected \[256, 256\]"):
        Checkpoint(ckpt_copy).layer_tensors(0)


def test_wrong_dtype(ckpt_copy):
    name = tensor_name(KIMI, 0, "q_proj.weight")
    _edit_tensor(ckpt_copy, name, lambda t, n: t.__setitem__(n, t[n].astype(np.float32)))
    with pytest.raises(KdaError, match=f"{name} has dtype F32, expected BF16"):
        Checkpoint(ckpt_copy).layer_tensors(0)


def test_small_params_may_be_bf16(ckpt_copy):
    name = tensor_name(KIMI, 0, "dt_bias")
    _edit_tensor(ckpt_copy, name, lambda t, n: t.__setitem__(n, t[n].astype(ml_dtypes.bfloat16)))
    assert Checkpoint(ckpt_copy).layer_tensors(0)["dt_bias"].dtype == ml_dtypes.bfloat16


def test_truncated_file(ckpt_copy):
    f = ckpt_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(KdaError, match="model.safetensors: not a readable safetensors file"):
        Checkpoint(ckpt_copy)


def test_not_a_kda_layer_and_missing_files(ckpt_copy, tmp_path):
    with pytest.raises(KdaError, match=r"layer 3 is not a KDA layer .*\[0, 1, 2\]"):
        Checkpoint(ckpt_copy).layer_tensors(3)
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(KdaError, match="neither model.safetensors nor"):
        Checkpoint(ckpt_copy)
    with pytest.raises(KdaError, match="nowhere does not exist"):
        Checkpoint(tmp_path / "nowhere")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(KdaError, match="a-file is not a directory"):
        Checkpoint(tmp_path / "a-file")


def test_problems_reports_non_finite(ckpt_copy):
    name = tensor_name(KIMI, 2, "f_a_proj.weight")

    def plant(t, n):
        t[n] = t[n].copy()
        t[n][0, :3] = np.nan
    _edit_tensor(ckpt_copy, name, plant)
    assert Checkpoint(ckpt_copy).problems() == [
        f"{name} holds 3 NaN/Inf value(s), the first at [0, 0]"]
    with pytest.raises(KdaError, match=rf"{name} holds 3 NaN/Inf value\(s\), the first at "
                                       r"\[0, 0\]"):
        Checkpoint(ckpt_copy).layer_tensors(2)
