"""The GLM-5.3-Flash layout (glm5_next) beside Kimi Linear's: every config and tensor spelling
loads to the same layer, the same weights run to the same bits in either layout, and what
kdarun cannot run (FP8 KDA tensors, mixed spellings, unknown layer families) is refused with
a message naming it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kdarun import Checkpoint, Glm5NextKdaConfig, KdaError, open_backend, synthetic
from kdarun.checkpoint import LAYER_PREFIXES, tensor_name
from kdarun.loader import load_stack
from kdarun.run import RunPlan, random_hidden, run_layer

from .helpers import bits

GLM = LAYER_PREFIXES["glm5_next"]
TEXT = {"hidden_size": 4096, "num_hidden_layers": 45, "rms_norm_eps": 1e-5,
        "layer_types": ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention"
                        for i in range(45)],
        "linear_attn_config": {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0},
        "vocab_size": 151552, "num_attention_heads": 32}
RELEASE = {  # GLM-5.3-Flash's config.json: the text model nested beside vision and FP8 fields
    "model_type": "glm5_next", "text_config": TEXT,
    "vision_config": {"hidden_size": 1536, "depth": 24},
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                            "modules_to_not_convert": [f"{GLM}0.self_attn.q_proj"]},
}
TRANSFORMERS = {  # a config transformers' Glm5NextTextConfig saves: flat linear_* fields
    "model_type": "glm5_next_text", "hidden_size": 4096, "num_hidden_layers": 45,
    "rms_norm_eps": 1e-5, "linear_num_heads": 64, "linear_head_dim": 128,
    "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0,
}


def copy(d: dict) -> dict:
    return json.loads(json.dumps(d))


def test_release_config_is_the_preset():
    cfg = Glm5NextKdaConfig.from_hf(RELEASE)
    assert cfg == synthetic.preset_config("glm-5.3-flash")
    assert cfg.layout == "glm5_next" and len(cfg.kda_layers) == 34 and cfg.gate_form == "bounded"
    assert 3 not in cfg.kda_layers and 44 in cfg.kda_layers and len(cfg.full_attn_layers) == 11
    assert Glm5NextKdaConfig.from_hf(cfg.to_hf()) == cfg


def test_flat_export_and_transformers_spelling_read_the_same():
    flat = {"model_type": "glm5_next", **TEXT}
    want = Glm5NextKdaConfig.from_hf(RELEASE)
    assert Glm5NextKdaConfig.from_hf(flat) == want
    assert Glm5NextKdaConfig.from_hf(TRANSFORMERS) == want  # no layer_types: i % 4 == 3 attention
    nested = {"model_type": "glm5_next", "text_config": {k: v for k, v in TRANSFORMERS.items()
                                                          if k != "model_type"}}
    assert Glm5NextKdaConfig.from_hf(nested) == want
    softplus = copy(TRANSFORMERS) | {"linear_lower_bound": None}
    assert Glm5NextKdaConfig.from_hf(softplus).gate_form == "softplus"


def test_every_attention_family_spelling_is_accepted():
    cfg = copy(RELEASE)
    families = ["full_attention", "indexed_attention", "deepseek_sparse_attention"]
    cfg["text_config"]["layer_types"] = ["linear_attention" if i % 4 != 3 else families[i % 3]
                                         for i in range(45)]
    want = Glm5NextKdaConfig.from_hf(RELEASE).kda_layers
    assert Glm5NextKdaConfig.from_hf(cfg).kda_layers == want


def _set(path: str, value):
    def edit(c: dict) -> None:
        *outer, last = path.split(".")
        d = c
        for k in outer:
            d = d[k]
        d[last] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_set("text_config.layer_types", ["linear_attention"] * 7 + ["mamba2"] * 38),
     r"text_config.layer_types\[7\] is 'mamba2', expected one of \['linear_attention', "
     r"'full_attention', 'indexed_attention', 'deepseek_sparse_attention'\]"),
    (_set("text_config.layer_types", ["linear_attention"] * 44),
     r"text_config.layer_types must be a list of 45 layer families"),
    (_set("text_config.layer_types", ["full_attention"] * 45),
     r"text_config.layer_types has no 'linear_attention' \(KDA\) layer"),
    (_set("model_type", "qwen3_next"),
     r"model_type 'qwen3_next' is not a KDA model kdarun reads; model types \['glm5_next', "
     r"'glm5_next_text', 'kimi_linear'\] are \(supported: kimi_linear .* and glm5_next"),
    (_set("text_config.linear_num_heads", 64),
     r"text_config.linear_attn_config and the flat fields \['linear_num_heads'\] both describe"),
    (_set("text_config.linear_attn_config.head_dim", 96),
     r"\(glm5_next layout\): config: head_dim must be one of \(64, 128\), got 96"),
    (_set("text_config", [1]), "text_config must be an object, got list"),
])
def test_bad_glm_config(edit, message):
    cfg = copy(RELEASE)
    edit(cfg)
    with pytest.raises(KdaError, match=message):
        Glm5NextKdaConfig.from_hf(cfg)


def test_bad_transformers_config_and_unknown_layouts():
    cfg = copy(TRANSFORMERS)
    cfg.pop("linear_head_dim")
    with pytest.raises(KdaError, match="missing field linear_head_dim"):
        Glm5NextKdaConfig.from_hf(cfg)
    with pytest.raises(KdaError, match="cannot tell the layout .* supported: kimi_linear"):
        Glm5NextKdaConfig.from_hf({"hidden_size": 4096, "num_hidden_layers": 4})


# -- checkpoints: the same tiny weights written in every layout and spelling ------------------

def tiny(layout: str) -> Glm5NextKdaConfig:
    return synthetic.preset_config("tiny", "bounded", layers=4, lower_bound=-3.0, layout=layout)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, str]:
    """variant -> a tiny 4-layer checkpoint of seed 5: the same weights in each."""
    root = tmp_path_factory.mktemp("layouts")
    variants = {"kimi": (tiny("kimi_linear"), 1, "flat"),
                "glm": (tiny("glm5_next"), 1, "flat"),
                "glm_sharded": (tiny("glm5_next"), 2, "flat"),
                "glm_transformers": (tiny("glm5_next"), 1, "transformers")}
    return {name: str(synthetic.write_checkpoint(root / name, cfg, seed=5, shards=shards,
                                                 spelling=spelling))
            for name, (cfg, shards, spelling) in variants.items()}


def test_every_variant_reads_the_same_tensors(written):
    base = Checkpoint(written["kimi"])
    assert (base.layout, base.prefix) == ("kimi_linear", "model.layers.")
    for name in ("glm", "glm_sharded", "glm_transformers"):
        ck = Checkpoint(written[name])
        assert (ck.layout, ck.prefix) == ("glm5_next", GLM)
        assert ck.config.kda_layers == base.config.kda_layers == (0, 1, 2)
        for i in base.config.kda_layers:
            a, b = base.layer_tensors(i), ck.layer_tensors(i)
            assert a.keys() == b.keys()
            for k in a:
                assert np.array_equal(bits(a[k]), bits(b[k])), f"{name} layer {i} {k}"
        assert ck.problems() == []
    assert len({p.name for p in Checkpoint(written["glm_sharded"]).weight_map.values()}) == 2
    stored = Checkpoint(written["glm_transformers"]).weight_map
    assert f"{GLM}1.self_attn.conv1d.weight" in stored
    assert f"{GLM}1.self_attn.forget_gate.A_log" in stored
    assert f"{GLM}1.self_attn.q_conv1d.weight" not in stored
    assert Checkpoint(written["glm_transformers"]).layer_spelling(1) == "transformers"
    flat, fused = (load_file(f"{written[n]}/model.safetensors")
                   for n in ("glm", "glm_transformers"))
    qkv = np.concatenate([flat[tensor_name(GLM, 1, f"{p}_conv1d.weight")] for p in "qkv"])
    assert np.array_equal(bits(fused[f"{GLM}1.self_attn.conv1d.weight"]), bits(qkv))  # q|k|v


def test_both_layouts_run_to_identical_bits(written):
    """The same weights as Kimi Linear and as GLM-5.3-Flash (transformers' spelling, too) give
    the same output and states, bit for bit, on the host backend."""
    host = open_backend("host")
    plan = RunPlan(70, 2, 3)
    hidden = random_hidden(plan.total, 256, seed=9)
    runs = {}
    for name in ("kimi", "glm", "glm_transformers"):
        stack = load_stack(host, written[name], plan.prefill, [1])
        runs[name] = run_layer(host, stack, 1, hidden, plan)
        stack.free(host)
    for name in ("glm", "glm_transformers"):
        for field in ("final_out", "recurrent_state", "conv_state"):
            assert np.array_equal(bits(getattr(runs["kimi"], field)),
                                  bits(getattr(runs[name], field))), f"{name} {field}"


def test_config_spellings_load_from_disk(written, tmp_path):
    want = Checkpoint(written["glm"]).layer_tensors(2)
    text = tiny("glm5_next").to_hf()["text_config"]
    for name, cfg in (("flat", {"model_type": "glm5_next", **text}),
                      ("transformers", {"model_type": "glm5_next_text", "hidden_size": 256,
                                        "num_hidden_layers": 4, "rms_norm_eps": 1e-5,
                                        "linear_num_heads": 4, "linear_head_dim": 64,
                                        "linear_conv_kernel_dim": 4, "linear_lower_bound": -3.0})):
        dst = tmp_path / name
        shutil.copytree(written["glm"], dst)
        (dst / "config.json").write_text(json.dumps(cfg))
        ck = Checkpoint(dst)
        assert ck.config == tiny("glm5_next")
        got = ck.layer_tensors(2)
        assert all(np.array_equal(bits(want[k]), bits(got[k])) for k in want)


def test_hf_cache_snapshot_of_symbolic_links(written, tmp_path):
    """A Hugging Face cache: the snapshot's files link into ../../blobs/, named by hash."""
    repo = tmp_path / "models--zai-org--GLM-5.3-Flash"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for f in sorted(os.listdir(written["glm_sharded"])):
        data = open(os.path.join(written["glm_sharded"], f), "rb").read()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snap / f).symlink_to(f"../../blobs/{blob}")
    ck = Checkpoint(snap)
    assert all((snap / f).is_symlink() for f in os.listdir(snap))
    want = Checkpoint(written["glm_sharded"]).layer_tensors(1)
    got = ck.layer_tensors(1)
    assert all(np.array_equal(bits(want[k]), bits(got[k])) for k in want)
    assert ck.problems() == []
    shard = snap / "model-00002-of-00002.safetensors"
    (repo / "blobs" / os.readlink(shard).split("/")[-1]).unlink()  # an unfinished download
    with pytest.raises(KdaError, match=r"shard missing: .*model-00002-of-00002.safetensors \(a "
                                       r"symbolic link to \.\./\.\./blobs/[0-9a-f]+, which is "
                                       r"missing\)"):
        ck.layer_tensors(2)


def _edit(ckpt_dir, fn) -> None:
    f = ckpt_dir / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f))


@pytest.fixture
def glm_copy(written, tmp_path):
    dst = tmp_path / "glm"
    shutil.copytree(written["glm"], dst)
    return dst


def test_fp8_kda_tensor_is_refused(glm_copy):
    name = tensor_name(GLM, 0, "k_proj.weight")

    def to_fp8(t):
        t[name] = t[name].astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    _edit(glm_copy, to_fp8)
    with pytest.raises(KdaError, match=rf"tensor {name} is stored as FP8 \(F8_E4M3\), expected "
                                       r"BF16; the KDA projections must be bf16: the checkpoint's "
                                       r"quantization_config should list them in "
                                       r"modules_to_not_convert"):
        Checkpoint(glm_copy).layer_tensors(0)
    assert Checkpoint(glm_copy).layer_tensors(1)  # the other layers still load


def test_fp8_scale_sibling_is_refused(glm_copy):
    scale = tensor_name(GLM, 2, "o_proj.weight_scale_inv")
    _edit(glm_copy, lambda t: t.__setitem__(scale, np.ones((2, 2), np.float32)))
    with pytest.raises(KdaError, match=rf"layer 2 is block-FP8 quantized \(scale tensors "
                                       rf"\['{scale}'\]\); the KDA projections must be bf16"):
        Checkpoint(glm_copy).layer_tensors(2)
    assert "block-FP8" in Checkpoint(glm_copy).problems()[0]


def test_mixed_spellings_are_refused(glm_copy, written, tmp_path):
    both = tensor_name(GLM, 1, "forget_gate.A_log")  # a layer holding both spellings of A_log
    _edit(glm_copy, lambda t: t.__setitem__(both, t[tensor_name(GLM, 1, "A_log")]))
    with pytest.raises(KdaError, match=r"layer 1 mixes tensor spellings \(flat: \['"
                                       rf"{GLM}1.self_attn.A_log', .*\]; transformers: "
                                       rf"\['{both}'\]\)"):
        Checkpoint(glm_copy).layer_tensors(1)
    half = tmp_path / "half"  # transformers' gate beside three separate convs
    shutil.copytree(written["glm_transformers"], half)

    def split_conv(t):
        fused = t.pop(tensor_name(GLM, 0, "conv1d.weight"))
        for p, part in zip("qkv", np.split(fused, 3)):
            t[tensor_name(GLM, 0, f"{p}_conv1d.weight")] = part
    _edit(half, split_conv)
    with pytest.raises(KdaError, match=r"layer 0 mixes tensor spellings \(flat: \['.*"
                                       r"k_conv1d.weight', .*\]; transformers: \['.*"
                                       r"forget_gate.A_log', .*\]\)"):
        Checkpoint(half).layer_tensors(0)
    assert Checkpoint(half).layer_tensors(1)


def test_unknown_layer_family_on_disk(glm_copy):
    cfg = json.loads((glm_copy / "config.json").read_text())
    cfg["text_config"]["layer_types"][3] = "sliding_attention"
    (glm_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KdaError, match=r"config.json: text_config.layer_types\[3\] is "
                                       r"'sliding_attention', expected one of"):
        Checkpoint(glm_copy)


def test_layers_under_two_prefixes_are_refused(glm_copy):
    def duplicate(t):
        for k in [k for k in t if k.startswith(f"{GLM}0.")]:
            t["model.layers." + k[len(GLM):]] = t[k]
    _edit(glm_copy, duplicate)
    with pytest.raises(KdaError, match=r"KDA layers' tensors under both \['model.language_model."
                                       r"layers.', 'model.layers.'\]; expected one prefix"):
        Checkpoint(glm_copy)
