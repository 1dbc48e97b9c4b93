"""Glm5NextKdaConfig: the shape facts of one KDA block, read from an HF `config.json`.

Two layouts of `config.json` are read (`LAYOUTS`):

- `kimi_linear` (Kimi Linear): flat fields and `linear_attn_config` with 1-based `kda_layers`;
- `glm5_next` (GLM-5.3-Flash): the text model's fields under `text_config` (or flat at the
  top level), `layer_types` (0-based, `linear_attention` = KDA; absent: every layer but
  i % 4 == 3), and the KDA shape either as `linear_attn_config` (no `kda_layers`) or as
  transformers' flat `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`,
  `linear_lower_bound` (`LINEAR_FIELDS`).

Every derived size (qkv, conv_dim, the gate_in width, T_pad) is a property
here, so no other module re-derives it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .errors import KdaError, check_int

CHUNK = 64  # C: the chunk length of the WY prefill
MAX_DECODE_ROWS = 8  # a sequence's rows a call at most (decode_k's K): the decode walk's bound
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_CONV_KERNEL = 8  # W at most: the conv kernels' register window
MAX_LAYERS = 1 << 16  # num_hidden_layers at most: no model comes near; a larger one is a typo
# that would build layer tables of that length
L2_NORM_EPS = 1e-6  # q and k are normalised as x / sqrt(sum(x^2) + L2_NORM_EPS)
# int32 fields of a packed prefill's segment table row (kernels_cu/segments.cuh):
# chunk0, chunks, row0, rows, slot, init, every, ckpt
SEG_FIELDS = 8
# The fields a layer's buffers are shaped by: a state (recurrent [H, D, D], conv [W-1, 3 H D])
# fits a layer whose STATE_FIELDS agree, a workspace one whose BUFFER_FIELDS agree.
STATE_FIELDS = ("num_heads", "head_dim", "conv_kernel")
BUFFER_FIELDS = ("hidden_size",) + STATE_FIELDS

LAYOUTS = ("kimi_linear", "glm5_next")
MODEL_TYPES = {"kimi_linear": "kimi_linear", "glm5_next": "glm5_next",
               "glm5_next_text": "glm5_next"}  # config.json's model_type -> layout
KDA_LAYER_TYPE = "linear_attention"
ATTN_LAYER_TYPES = ("full_attention", "indexed_attention", "deepseek_sparse_attention")
# Glm5NextKdaConfig field -> (key in linear_attn_config, transformers' flat key)
LINEAR_FIELDS = {
    "num_heads": ("num_heads", "linear_num_heads"),
    "head_dim": ("head_dim", "linear_head_dim"),
    "conv_kernel": ("short_conv_kernel_size", "linear_conv_kernel_dim"),
    "gate_lower_bound": ("gate_lower_bound", "linear_lower_bound"),
}


@dataclass(frozen=True)
class Glm5NextKdaConfig:
    """One KDA block's shapes and constants, and the layout of the checkpoint they came from.

    `kda_layers` are 0-based indices in the stack (`layer_idx`); a Kimi Linear `config.json`
    lists them 1-based and `from_hf` converts. `full_attn_layers` are the stack's other
    attention layers (full or sparse), which kdarun does not read.
    """

    hidden_size: int
    num_heads: int  # H
    head_dim: int  # D (key and value dims are both D; also the low-rank gate rank R)
    conv_kernel: int = 4  # W
    rms_norm_eps: float = 1e-6
    gate_lower_bound: float | None = None  # None: softplus gate; else the bounded form
    num_hidden_layers: int = 1
    kda_layers: tuple[int, ...] = (0,)
    full_attn_layers: tuple[int, ...] = ()
    layout: str = "kimi_linear"  # one of LAYOUTS: how config.json and the tensors are laid out

    def __post_init__(self) -> None:
        def bad(name: str, expected: str, actual: Any) -> KdaError:
            return KdaError(f"config: {name} must be {expected}, got {actual!r}")

        if self.layout not in LAYOUTS:
            raise bad("layout", f"one of {LAYOUTS}", self.layout)
        for name in ("hidden_size", "num_heads", "head_dim", "conv_kernel", "num_hidden_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(name, "a positive integer", v)
        if self.hidden_size % 8:
            raise bad("hidden_size", "a multiple of 8 (rows are read as 16-byte vectors)",
                      self.hidden_size)
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise bad("head_dim", f"one of {SUPPORTED_HEAD_DIMS}", self.head_dim)
        if not 2 <= self.conv_kernel <= MAX_CONV_KERNEL:
            raise bad("conv_kernel (short_conv_kernel_size)", f"in [2, {MAX_CONV_KERNEL}]",
                      self.conv_kernel)
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 < self.rms_norm_eps < 1):
            raise bad("rms_norm_eps", "a number in (0, 1)", self.rms_norm_eps)
        lb = self.gate_lower_bound
        if lb is not None and not (isinstance(lb, (int, float)) and -5.0 <= lb < 0.0):
            raise bad("gate_lower_bound", "a number in [-5, 0) or absent/None", lb)
        n = self.num_hidden_layers
        for name in ("kda_layers", "full_attn_layers"):
            for i in getattr(self, name):
                if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
                    raise bad(name, f"0-based layer indices in [0, {n})", i)
        if not self.kda_layers:
            raise bad("kda_layers", "a non-empty list", list(self.kda_layers))
        both = set(self.kda_layers) & set(self.full_attn_layers)
        if both:
            raise bad("kda_layers/full_attn_layers", "disjoint", sorted(both))
        if len(set(self.kda_layers)) != len(self.kda_layers):
            raise bad("kda_layers", "free of duplicates", list(self.kda_layers))

    # -- derived sizes (the one place they are computed) ---------------------------------------
    @property
    def qkv(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return 3 * self.qkv

    @property
    def rank(self) -> int:
        """R, the inner width of the low-rank gates f_a/f_b and g_a/g_b."""
        return self.head_dim

    @property
    def proj_rows(self) -> int:
        """Rows of the packed input projection weight w_in: q|k|v (conv_dim) then
        f_a|g_a|b (gate_in_rows)."""
        return self.conv_dim + self.gate_in_rows

    @property
    def gate_in_rows(self) -> int:
        """f_a|g_a|b, the projection outputs after q|k|v: the low-rank gates' inputs and b."""
        return 2 * self.rank + self.num_heads

    def gate_in_col(self, part: str) -> int:
        """First column of `part` (f_a, g_a or b) in a row of the gate_in buffer."""
        cols = {"f_a": 0, "g_a": self.rank, "b": 2 * self.rank}
        if part not in cols:
            raise KdaError(f"gate_in_col: unknown part {part!r}; expected one of {sorted(cols)}")
        return cols[part]

    @property
    def gate_in_width(self) -> int:
        """Row stride of the gate_in buffer: `gate_in_rows` rounded up to 8 so every row
        starts 16-byte aligned."""
        return -(-self.gate_in_rows // 8) * 8

    @property
    def gate_form(self) -> str:
        return "softplus" if self.gate_lower_bound is None else "bounded"

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @staticmethod
    def t_pad(t: int) -> int:
        return math.ceil(t / CHUNK) * CHUNK

    # -- tensor parallel over heads ------------------------------------------------------------
    def mismatch(self, other: "Glm5NextKdaConfig", fields: tuple[str, ...]) -> str | None:
        """How `other` differs from this config in `fields` ("num_heads 32, not 2"), or None
        where it agrees in all of them."""
        for name in fields:
            if getattr(other, name) != getattr(self, name):
                return f"{name} {getattr(other, name)}, not {getattr(self, name)}"
        return None

    def shard(self, tp_size: int) -> "Glm5NextKdaConfig":
        """The config one of `tp_size` ranks runs: H / tp_size heads, everything else as here
        (the low-rank gates' rank R = D and the hidden size do not shrink). Every per-rank
        shape (weights, workspace, states) follows from it, so the kernels run unchanged."""
        self.check_tp(0, tp_size)
        return self if tp_size == 1 else replace(self, num_heads=self.num_heads // tp_size)

    def check_tp(self, tp_rank: int, tp_size: int) -> None:
        """Refuse a rank or group size that cannot shard this config's heads evenly."""
        tp_size = check_int(tp_size, "tensor parallel: tp_size", 1)
        tp_rank = check_int(tp_rank, "tensor parallel: tp_rank", 0)
        if self.num_heads % tp_size:
            raise KdaError(f"tensor parallel: num_heads {self.num_heads} is not divisible by "
                           f"tp_size {tp_size}; every rank must own the same number of heads "
                           f"(divisors of {self.num_heads}: "
                           f"{[d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]})")
        if tp_rank >= tp_size:
            raise KdaError(f"tensor parallel: tp_rank must lie in [0, {tp_size}), got {tp_rank}")

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> "Glm5NextKdaConfig":
        """Build from an HF config dict of either layout (only the KDA fields are read)."""
        layout = hf_layout(cfg, source)
        text, where = cfg, ""
        if layout == "glm5_next" and "text_config" in cfg:
            text, where = _object(cfg, "text_config", "", source), "text_config."
        n_layers = check_int(_need(text, "num_hidden_layers", where, source),
                             f"{source}: {where}num_hidden_layers", 1, MAX_LAYERS)
        if layout == "kimi_linear":
            kda, full = _kimi_layers(_object(text, "linear_attn_config", where, source),
                                     n_layers, source)
        else:
            kda, full = _glm_layers(text, n_layers, where, source)
        fields = {"hidden_size": _need(text, "hidden_size", where, source),
                  "rms_norm_eps": text.get("rms_norm_eps", 1e-6), **_linear_fields(text, where,
                                                                                    source)}
        try:
            return cls(num_hidden_layers=n_layers, kda_layers=kda, full_attn_layers=full,
                       layout=layout, **fields)
        except KdaError as e:
            raise KdaError(f"{source} ({layout} layout): {e}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "Glm5NextKdaConfig":
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise KdaError(f"config not found: {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise KdaError(f"{path}: not valid JSON ({e})") from None
        except OSError as e:
            raise KdaError(f"{path}: cannot be read ({e.strerror})") from None
        if not isinstance(cfg, dict):
            raise KdaError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
        return cls.from_hf(cfg, source=str(path))

    def to_hf(self) -> dict[str, Any]:
        """The minimal HF config dict, in this config's layout, that `from_hf` reads back to
        this config (`glm5_next` writes every non-KDA layer as `full_attention`)."""
        lac: dict[str, Any] = {
            "head_dim": self.head_dim,
            "num_heads": self.num_heads,
            "short_conv_kernel_size": self.conv_kernel,
        }
        if self.gate_lower_bound is not None:
            lac["gate_lower_bound"] = self.gate_lower_bound
        text = {"hidden_size": self.hidden_size, "rms_norm_eps": self.rms_norm_eps,
                "num_hidden_layers": self.num_hidden_layers}
        if self.layout == "kimi_linear":
            lac |= {"kda_layers": [i + 1 for i in self.kda_layers],
                    "full_attn_layers": [i + 1 for i in self.full_attn_layers]}
            return {"model_type": "kimi_linear", **text, "linear_attn_config": lac}
        kda = set(self.kda_layers)
        layer_types = [KDA_LAYER_TYPE if i in kda else ATTN_LAYER_TYPES[0]
                       for i in range(self.num_hidden_layers)]
        return {"model_type": "glm5_next",
                "text_config": {**text, "layer_types": layer_types, "linear_attn_config": lac}}


def check_config(cfg: object, what: str) -> Glm5NextKdaConfig:
    """`cfg` when it is a `Glm5NextKdaConfig`; else a KdaError naming `what`."""
    if not isinstance(cfg, Glm5NextKdaConfig):
        raise KdaError(f"{what}: cfg must be a Glm5NextKdaConfig, got {type(cfg).__name__}")
    return cfg


def hf_layout(cfg: dict[str, Any], source: str = "config.json") -> str:
    """The layout (one of `LAYOUTS`) of an HF config dict: its `model_type` where it has one,
    else its shape; anything else is refused with what is supported."""
    supported = ("supported: kimi_linear (linear_attn_config with 1-based kda_layers) and "
                 "glm5_next (text_config or flat fields with layer_types, linear_attn_config "
                 "or linear_num_heads/linear_head_dim/...)")
    model_type = cfg.get("model_type")
    if model_type is not None:
        if not isinstance(model_type, str):
            raise KdaError(f"{source}: model_type must be a string, got {model_type!r}")
        if model_type not in MODEL_TYPES:
            raise KdaError(f"{source}: model_type {model_type!r} is not a KDA model kdarun "
                           f"reads; model types {sorted(MODEL_TYPES)} are ({supported})")
        return MODEL_TYPES[model_type]
    lac = cfg.get("linear_attn_config")
    if isinstance(lac, dict) and "kda_layers" in lac:
        return "kimi_linear"
    if any(k in cfg for k in ("text_config", "layer_types",
                              *(flat for _, flat in LINEAR_FIELDS.values()))):
        return "glm5_next"
    raise KdaError(f"{source}: cannot tell the layout (no model_type, no "
                   f"linear_attn_config.kda_layers, text_config, layer_types or linear_* "
                   f"fields); {supported}")


def _need(d: dict[str, Any], key: str, where: str, source: str) -> Any:
    if key not in d:
        raise KdaError(f"{source}: missing field {where}{key}")
    return d[key]


def _object(d: dict[str, Any], key: str, where: str, source: str) -> dict[str, Any]:
    v = _need(d, key, where, source)
    if not isinstance(v, dict):
        raise KdaError(f"{source}: {where}{key} must be an object, got {type(v).__name__}")
    return v


def _linear_fields(text: dict[str, Any], where: str, source: str) -> dict[str, Any]:
    """num_heads, head_dim, conv_kernel and gate_lower_bound (absent or None: softplus gate)
    from `linear_attn_config` or from transformers' flat `linear_*` fields, not both."""
    flat = sorted(k for _, k in LINEAR_FIELDS.values() if k in text)
    if flat and "linear_attn_config" in text:
        raise KdaError(f"{source}: {where}linear_attn_config and the flat fields {flat} "
                       "both describe the KDA shape; expected one of the two")
    if flat:
        src, at, col = text, where, 1
    else:
        src, at, col = (_object(text, "linear_attn_config", where, source),
                        f"{where}linear_attn_config.", 0)
    defaults = {"conv_kernel": 4, "gate_lower_bound": None}
    return {field: (src.get(keys[col], defaults[field]) if field in defaults
                    else _need(src, keys[col], at, source))
            for field, keys in LINEAR_FIELDS.items()}


def _kimi_layers(lac: dict[str, Any], n_layers: int,
                 source: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """0-based (kda_layers, full_attn_layers) from Kimi Linear's 1-based lists."""
    out = []
    for name, lst in (("kda_layers", _need(lac, "kda_layers", "linear_attn_config.", source)),
                      ("full_attn_layers", lac.get("full_attn_layers", []))):
        if not isinstance(lst, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                for i in lst):
            raise KdaError(f"{source}: linear_attn_config.{name} must be a list of "
                           f"1-based layer numbers, got {lst!r}")
        bad = [i for i in lst if not 1 <= i <= n_layers]
        if bad:
            raise KdaError(f"{source}: linear_attn_config.{name} are 1-based and must lie in "
                           f"[1, {n_layers}], got {bad}")
        out.append(tuple(i - 1 for i in lst))
    return out[0], out[1]


def _glm_layers(text: dict[str, Any], n_layers: int, where: str,
                source: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """0-based (kda_layers, other attention layers) from `layer_types`, or, without it,
    every layer KDA but i % 4 == 3."""
    types = text.get("layer_types")
    if types is None:
        types = [ATTN_LAYER_TYPES[0] if i % 4 == 3 else KDA_LAYER_TYPE for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise KdaError(f"{source}: {where}layer_types must be a list of {n_layers} layer "
                       f"families (num_hidden_layers), got {types!r}")
    for i, t in enumerate(types):
        if t != KDA_LAYER_TYPE and t not in ATTN_LAYER_TYPES:
            raise KdaError(f"{source}: {where}layer_types[{i}] is {t!r}, expected one of "
                           f"{[KDA_LAYER_TYPE, *ATTN_LAYER_TYPES]}")
    kda = tuple(i for i, t in enumerate(types) if t == KDA_LAYER_TYPE)
    if not kda:
        raise KdaError(f"{source}: {where}layer_types has no {KDA_LAYER_TYPE!r} (KDA) layer")
    return kda, tuple(i for i, t in enumerate(types) if t != KDA_LAYER_TYPE)
