"""Glm5NextKdaConfig: the shape facts of one KDA block, read from an HF `config.json`.

Every derived size (qkv, conv_dim, the gate_in width, T_pad) is a property
here, so no other module re-derives it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import KdaError

CHUNK = 64  # C: the chunk length of the WY prefill
MAX_DECODE_ROWS = 8  # decode_k's K at most: rows one GEMV launch and one decode walk serve
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_CONV_KERNEL = 8  # W at most: the conv kernels' register window
L2_NORM_EPS = 1e-6  # q and k are normalised as x / sqrt(sum(x^2) + L2_NORM_EPS)


@dataclass(frozen=True)
class Glm5NextKdaConfig:
    """One KDA block's shapes and constants.

    `kda_layers` are 0-based indices in the stack (`layer_idx`); HF `config.json` lists them
    1-based and `from_hf` converts.
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

    def __post_init__(self) -> None:
        def bad(name: str, expected: str, actual: Any) -> KdaError:
            return KdaError(f"config: {name} must be {expected}, got {actual!r}")

        for name in ("hidden_size", "num_heads", "head_dim", "conv_kernel", "num_hidden_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(name, "a positive integer", v)
        if self.hidden_size % 8:
            raise bad("hidden_size", "a multiple of 8 (rows are read as 16-byte vectors)",
                      self.hidden_size)
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise bad("linear_attn_config.head_dim", f"one of {SUPPORTED_HEAD_DIMS}", self.head_dim)
        if not 2 <= self.conv_kernel <= MAX_CONV_KERNEL:
            raise bad("linear_attn_config.short_conv_kernel_size", f"in [2, {MAX_CONV_KERNEL}]",
                      self.conv_kernel)
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 < self.rms_norm_eps < 1):
            raise bad("rms_norm_eps", "a number in (0, 1)", self.rms_norm_eps)
        lb = self.gate_lower_bound
        if lb is not None and not (isinstance(lb, (int, float)) and -5.0 <= lb < 0.0):
            raise bad("linear_attn_config.gate_lower_bound", "a number in [-5, 0) or absent", lb)
        n = self.num_hidden_layers
        for name in ("kda_layers", "full_attn_layers"):
            for i in getattr(self, name):
                if not isinstance(i, int) or not 0 <= i < n:
                    raise bad(name, f"0-based layer indices in [0, {n})", i)
        if not self.kda_layers:
            raise bad("linear_attn_config.kda_layers", "a non-empty list", list(self.kda_layers))
        both = set(self.kda_layers) & set(self.full_attn_layers)
        if both:
            raise bad("kda_layers/full_attn_layers", "disjoint", sorted(both))
        if len(set(self.kda_layers)) != len(self.kda_layers):
            raise bad("linear_attn_config.kda_layers", "free of duplicates", list(self.kda_layers))

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

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> "Glm5NextKdaConfig":
        """Build from an HF Kimi Linear style config dict (only the KDA fields are read)."""
        def need(d: dict, key: str, where: str) -> Any:
            if key not in d:
                raise KdaError(f"{source}: missing field {where}{key}")
            return d[key]

        lac = need(cfg, "linear_attn_config", "")
        if not isinstance(lac, dict):
            raise KdaError(f"{source}: linear_attn_config must be an object, got {type(lac).__name__}")
        n_layers = need(cfg, "num_hidden_layers", "")
        kda_1 = need(lac, "kda_layers", "linear_attn_config.")
        full_1 = lac.get("full_attn_layers", [])
        for name, lst in (("kda_layers", kda_1), ("full_attn_layers", full_1)):
            if not isinstance(lst, list) or not all(isinstance(i, int) for i in lst):
                raise KdaError(f"{source}: linear_attn_config.{name} must be a list of "
                               f"1-based layer numbers, got {lst!r}")
            bad = [i for i in lst if not (isinstance(n_layers, int) and 1 <= i <= n_layers)]
            if bad:
                raise KdaError(f"{source}: linear_attn_config.{name} are 1-based and must lie in "
                               f"[1, {n_layers}], got {bad}")
        try:
            return cls(
                hidden_size=need(cfg, "hidden_size", ""),
                num_heads=need(lac, "num_heads", "linear_attn_config."),
                head_dim=need(lac, "head_dim", "linear_attn_config."),
                conv_kernel=lac.get("short_conv_kernel_size", 4),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                gate_lower_bound=lac.get("gate_lower_bound"),
                num_hidden_layers=n_layers,
                kda_layers=tuple(i - 1 for i in kda_1),
                full_attn_layers=tuple(i - 1 for i in full_1),
            )
        except KdaError as e:
            raise KdaError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "Glm5NextKdaConfig":
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise KdaError(f"config not found: {path}") from None
        except json.JSONDecodeError as e:
            raise KdaError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise KdaError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
        return cls.from_hf(cfg, source=str(path))

    def to_hf(self) -> dict[str, Any]:
        """The minimal HF config dict that `from_hf` reads back to this config."""
        lac: dict[str, Any] = {
            "kda_layers": [i + 1 for i in self.kda_layers],
            "full_attn_layers": [i + 1 for i in self.full_attn_layers],
            "head_dim": self.head_dim,
            "num_heads": self.num_heads,
            "short_conv_kernel_size": self.conv_kernel,
        }
        if self.gate_lower_bound is not None:
            lac["gate_lower_bound"] = self.gate_lower_bound
        return {"model_type": "kimi_linear", "hidden_size": self.hidden_size,
                "rms_norm_eps": self.rms_norm_eps, "num_hidden_layers": self.num_hidden_layers,
                "linear_attn_config": lac}
