"""The GLM-5.3-Flash layout (glm5_next) beside Kimi Linear's: every config spelling reads to the
same config, and what kdarun cannot read (unknown layer families or model types) is refused
with a message naming it."""

from __future__ import annotations

import json

import pytest

from kdarun import Glm5NextKdaConfig, KdaError

GLM = "model.language_model.layers."
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


def test_release_config():
    cfg = Glm5NextKdaConfig.from_hf(RELEASE)
    assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.conv_kernel) == (4096, 64, 128, 4)
    assert (cfg.rms_norm_eps, cfg.gate_lower_bound, cfg.num_hidden_layers) == (1e-5, -5.0, 45)
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
    assert Glm5NextKdaConfig.from_hf(cfg).kda_layers == Glm5NextKdaConfig.from_hf(RELEASE).kda_layers


def _set(path: str, value):
    def edit(c: dict) -> None:
        *outer, last = path.split(".")
        d = c
        for k in outer:
            d = d[k]
        d[last] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_set("text_config.layer_types", ["linear_attention"] * 7 + ["mamba2"] + ["linear_attention"] * 37),
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
