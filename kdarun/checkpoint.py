"""Reading KDA tensors from an HF-layout safetensors checkpoint, lazily.

A checkpoint is a directory with `config.json` and either `model.safetensors` or a
sharded `model.safetensors.index.json`. Only the attention tensors of the KDA layers are
read, one layer at a time; every tensor's shape and dtype are checked against
`TENSORS` before its data is touched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors import safe_open

from .config import Glm5NextKdaConfig
from .errors import KdaError

PREFIX = "model.layers.{i}.self_attn."


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its accepted shapes (first is canonical) and dtypes."""
    name: str
    shapes: Callable[[Glm5NextKdaConfig], tuple[tuple[int, ...], ...]]
    dtypes: tuple[str, ...]


_MAT = ("BF16",)
_SMALL = ("BF16", "F32")
TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("q_proj.weight", lambda c: ((c.qkv, c.hidden_size),), _MAT),
    TensorSpec("k_proj.weight", lambda c: ((c.qkv, c.hidden_size),), _MAT),
    TensorSpec("v_proj.weight", lambda c: ((c.qkv, c.hidden_size),), _MAT),
    TensorSpec("q_conv1d.weight", lambda c: ((c.qkv, 1, c.conv_kernel),), _SMALL),
    TensorSpec("k_conv1d.weight", lambda c: ((c.qkv, 1, c.conv_kernel),), _SMALL),
    TensorSpec("v_conv1d.weight", lambda c: ((c.qkv, 1, c.conv_kernel),), _SMALL),
    TensorSpec("A_log", lambda c: ((1, 1, c.num_heads, 1), (c.num_heads,)), _SMALL),
    TensorSpec("dt_bias", lambda c: ((c.qkv,),), _SMALL),
    TensorSpec("f_a_proj.weight", lambda c: ((c.rank, c.hidden_size),), _MAT),
    TensorSpec("f_b_proj.weight", lambda c: ((c.qkv, c.rank),), _MAT),
    TensorSpec("b_proj.weight", lambda c: ((c.num_heads, c.hidden_size),), _MAT),
    TensorSpec("g_a_proj.weight", lambda c: ((c.rank, c.hidden_size),), _MAT),
    TensorSpec("g_b_proj.weight", lambda c: ((c.qkv, c.rank),), _MAT),
    TensorSpec("o_norm.weight", lambda c: ((c.head_dim,),), _SMALL),
    TensorSpec("o_proj.weight", lambda c: ((c.hidden_size, c.qkv),), _MAT),
)


def tensor_name(layer_idx: int, short: str) -> str:
    return PREFIX.format(i=layer_idx) + short


def canonical(cfg: Glm5NextKdaConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checkpoint shapes -> the shapes the runtime uses: `A_log` [H], conv weights [qkv, W]."""
    out = dict(tensors)
    out["A_log"] = out["A_log"].reshape(cfg.num_heads)
    for p in "qkv":
        out[f"{p}_conv1d.weight"] = out[f"{p}_conv1d.weight"].reshape(cfg.qkv, cfg.conv_kernel)
    return out


class Checkpoint:
    """An opened checkpoint directory: its config and a lazy per-layer tensor reader."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise KdaError(f"checkpoint: {self.path} is not a directory")
        self.config = Glm5NextKdaConfig.from_json(self.path / "config.json")
        self.weight_map = self._read_weight_map()

    def _read_weight_map(self) -> dict[str, Path]:
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.exists():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise KdaError(f"{index}: not a safetensors index with a weight_map ({e})") from None
            return {name: self.path / shard for name, shard in wm.items()}
        if single.exists():
            return {name: single for name in self._keys(single)}
        raise KdaError(f"checkpoint {self.path}: neither model.safetensors nor "
                       "model.safetensors.index.json found")

    @staticmethod
    def _open(file: Path):
        if not file.exists():
            raise KdaError(f"checkpoint shard missing: {file}")
        try:
            return safe_open(str(file), framework="numpy")
        except Exception as e:  # safetensors raises its own error type for corrupt files
            raise KdaError(f"{file}: not a readable safetensors file ({e})") from None

    def _keys(self, file: Path) -> list[str]:
        with self._open(file) as f:
            return list(f.keys())

    def layer_tensors(self, layer_idx: int) -> dict[str, np.ndarray]:
        """All KDA tensors of layer `layer_idx` (0-based), keyed by their short name,
        shapes canonical (`A_log` as `[H]`, conv weights `[qkv, W]`), dtypes as stored."""
        cfg = self.config
        if layer_idx not in cfg.kda_layers:
            raise KdaError(f"layer {layer_idx} is not a KDA layer of {self.path} "
                           f"(0-based KDA layers: {list(cfg.kda_layers)})")
        prefix = PREFIX.format(i=layer_idx)
        known = {tensor_name(layer_idx, spec.name) for spec in TENSORS}
        extra = sorted(n for n in self.weight_map if n.startswith(prefix) and n not in known)
        if extra:  # e.g. a bias kdarun does not apply: running without it would be silently wrong
            raise KdaError(f"checkpoint {self.path}: layer {layer_idx} has tensors kdarun does "
                           f"not implement: {extra}")
        out: dict[str, np.ndarray] = {}
        by_file: dict[Path, list[TensorSpec]] = {}
        for spec in TENSORS:
            name = tensor_name(layer_idx, spec.name)
            if name not in self.weight_map:
                raise KdaError(f"checkpoint {self.path}: missing tensor {name}")
            by_file.setdefault(self.weight_map[name], []).append(spec)
        for file, specs in by_file.items():
            with self._open(file) as f:
                keys = set(f.keys())
                for spec in specs:
                    name = tensor_name(layer_idx, spec.name)
                    if name not in keys:
                        raise KdaError(f"{file}: missing tensor {name} (the index points here)")
                    out[spec.name] = self._read_checked(f, file, name, spec)
        return canonical(cfg, out)

    def _read_checked(self, f, file: Path, name: str, spec: TensorSpec) -> np.ndarray:
        sl = f.get_slice(name)
        shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
        shapes = spec.shapes(self.config)
        if shape not in shapes:
            want = " or ".join(str(list(s)) for s in shapes)
            raise KdaError(f"{file}: tensor {name} has shape {list(shape)}, expected {want}")
        if dtype not in spec.dtypes:
            raise KdaError(f"{file}: tensor {name} has dtype {dtype}, expected "
                           f"{' or '.join(spec.dtypes)}")
        try:
            arr = f.get_tensor(name)
        except Exception as e:
            raise KdaError(f"{file}: cannot read tensor {name} ({e})") from None
        return np.ascontiguousarray(arr)

    def problems(self) -> list[str]:
        """Every problem found in the KDA tensors of every KDA layer (empty when clean)."""
        found = []
        for i in self.config.kda_layers:
            try:
                tensors = self.layer_tensors(i)
            except KdaError as e:
                found.append(str(e))
                continue
            for name, arr in tensors.items():
                bad = int(np.count_nonzero(~np.isfinite(arr.astype(np.float32))))
                if bad:
                    found.append(f"{tensor_name(i, name)}: {bad} non-finite values")
        return found
