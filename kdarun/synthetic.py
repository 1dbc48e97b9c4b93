"""Seeded synthetic checkpoints in either HF layout (Kimi Linear or GLM-5.3-Flash).

Parameters are initialised the way Kimi Linear / fla initialise a fresh KDA block:
linear layers N(0, 0.02), depthwise conv U(±1/sqrt(W)) (PyTorch's Conv1d default),
`A = U(1, 16)` stored as `A_log`, and `o_norm` near one. `dt_bias` is chosen so that the
per-step decay at g_raw = 0 spreads log-uniformly, as a trained model's does: for the
softplus gate it is the inverse softplus of a step in [1e-3, 0.1] (fla's init); for the
bounded gate it solves `lower_bound * sigmoid(A * dt_bias) = -r` for a rate r in
[2e-4, 0.1] * |lower_bound| (1e-3 to 0.5 at lower_bound -5). The stack mixes KDA and attention
layers 3:1 like both models (every layer i with i % 4 == 3 is attention); attention layers
carry only placeholder tensors the reader skips. The weights depend only on the shapes and
the seed, so the same weights can be written in either layout and either tensor spelling.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .checkpoint import LAYER_PREFIXES, SPELLINGS, TENSORS, tensor_name
from .config import Glm5NextKdaConfig, check_config
from .dtypes import BF16, F32
from .errors import KdaError, check_int, format_bytes
from .files import PendingDir


@dataclass(frozen=True)
class Preset:
    """A model shape `make-checkpoint` writes, with the layout, gate and shard count it is
    written with unless told otherwise."""
    hidden_size: int
    num_heads: int  # H
    head_dim: int  # D
    layout: str = "kimi_linear"
    gate: str = "softplus"
    shards: int = 1


PRESETS: dict[str, Preset] = {
    "tiny": Preset(hidden_size=256, num_heads=4, head_dim=64),
    "kimi-linear-48b": Preset(hidden_size=2304, num_heads=32, head_dim=128),
    "glm-5.3-flash": Preset(hidden_size=4096, num_heads=64, head_dim=128, layout="glm5_next",
                            gate="bounded", shards=4),
}
GATES = ("softplus", "bounded")
DEFAULT_LAYERS = 45
MAX_LAYERS = 1024  # a synthetic stack's depth at most, far beyond any model's
DEFAULT_LOWER_BOUND = -5.0
_FP32_TENSORS = ("A_log", "dt_bias", "o_norm.weight")  # the rest are written as bf16
_SAFETENSORS_DTYPES = {BF16: "BF16", F32: "F32"}
CHECKPOINT_FILE = re.compile(r"config\.json|model\.safetensors(\.index\.json)?|"
                             r"model-\d+-of-\d+\.safetensors")  # the files a checkpoint holds


def preset_config(preset: str, gate: str | None = None, layers: int = DEFAULT_LAYERS,
                  lower_bound: float = DEFAULT_LOWER_BOUND,
                  layout: str | None = None) -> Glm5NextKdaConfig:
    """The config of a preset (`gate` and `layout` default to the preset's own): every
    layer i with i % 4 == 3 attention, the rest KDA."""
    if preset not in PRESETS:
        raise KdaError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    gate = p.gate if gate is None else gate
    if gate not in GATES:
        raise KdaError(f"unknown gate {gate!r}; expected one of {GATES}")
    layers = check_int(layers, "layers", 1, MAX_LAYERS)
    full = tuple(i for i in range(layers) if i % 4 == 3)
    kda = tuple(i for i in range(layers) if i not in full)
    return Glm5NextKdaConfig(p.hidden_size, p.num_heads, p.head_dim, conv_kernel=4,
                             rms_norm_eps=1e-5,
                             gate_lower_bound=lower_bound if gate == "bounded" else None,
                             num_hidden_layers=layers, kda_layers=kda, full_attn_layers=full,
                             layout=p.layout if layout is None else layout)


def layer_layout(cfg: Glm5NextKdaConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The shape and dtype each KDA tensor is written with (keyed by short name): the
    checkpoint's canonical shape, bf16 but for the per-channel parameters (fp32, as the
    released checkpoints store them)."""
    return {s.name: (s.shapes(cfg)[0], F32 if s.name in _FP32_TENSORS else BF16)
            for s in TENSORS}


def synth_layer_tensors(cfg: Glm5NextKdaConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One KDA layer's tensors, keyed by short name, in checkpoint shapes and dtypes."""
    def linear(out_f: int, in_f: int) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f), dtype=np.float32) * 0.02).astype(BF16)

    bound = cfg.conv_kernel ** -0.5
    a = rng.uniform(1, 16, (1, 1, cfg.num_heads, 1))
    if cfg.gate_lower_bound is None:
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), cfg.qkv)).clip(1e-4)
        dt_bias = dt + np.log(-np.expm1(-dt))
    else:
        f = np.exp(rng.uniform(np.log(2e-4), np.log(0.1), cfg.qkv))  # rate / |lower_bound|
        dt_bias = np.log(f / (1 - f)) / np.repeat(a.reshape(-1), cfg.head_dim)
    t = {
        "q_proj.weight": linear(cfg.qkv, cfg.hidden_size),
        "k_proj.weight": linear(cfg.qkv, cfg.hidden_size),
        "v_proj.weight": linear(cfg.qkv, cfg.hidden_size),
        "A_log": np.log(a).astype(np.float32),
        "dt_bias": dt_bias.astype(np.float32),
        "f_a_proj.weight": linear(cfg.rank, cfg.hidden_size),
        "f_b_proj.weight": linear(cfg.qkv, cfg.rank),
        "b_proj.weight": linear(cfg.num_heads, cfg.hidden_size),
        "g_a_proj.weight": linear(cfg.rank, cfg.hidden_size),
        "g_b_proj.weight": linear(cfg.qkv, cfg.rank),
        "o_norm.weight": (1 + 0.1 * rng.standard_normal(cfg.head_dim)).astype(np.float32),
        "o_proj.weight": linear(cfg.hidden_size, cfg.qkv),
    }
    for p in "qkv":
        t[f"{p}_conv1d.weight"] = rng.uniform(-bound, bound, (cfg.qkv, 1, cfg.conv_kernel)
                                              ).astype(BF16)
    assert {n: (x.shape, x.dtype) for n, x in t.items()} == layer_layout(cfg)
    return t


def _stored_layer(cfg: Glm5NextKdaConfig, i: int, t: dict[str, np.ndarray] | None,
                  spelling: str) -> dict[str, np.ndarray]:
    """Layer i's tensors as the file stores them, by full name: its KDA tensors `t` (None for
    an attention layer, which gets a placeholder the reader skips) in `spelling`, and the
    layer's input norm."""
    prefix = LAYER_PREFIXES[cfg.layout]
    out = {f"{prefix}{i}.input_layernorm.weight": np.ones(cfg.hidden_size, BF16)}
    if t is None:  # an attention layer: present, and not ours to read
        out[tensor_name(prefix, i, "kv_a_layernorm.weight")] = np.ones(8, BF16)
        return out
    if cfg.layout == "glm5_next":  # GLM-5.3-Flash stores A_log as [H]
        t = t | {"A_log": t["A_log"].reshape(-1)}
    for short, holds in SPELLINGS[spelling].items():  # a fused tensor: dim 0 in order
        out[tensor_name(prefix, i, short)] = t[holds[0]] if len(holds) == 1 \
            else np.concatenate([t[h] for h in holds])
    return out


def _header(tensors: dict[str, np.ndarray]) -> bytes:
    """A safetensors header for `tensors`, their data laid out in the dict's order."""
    entries, offset = {}, 0
    for name, a in tensors.items():
        entries[name] = {"dtype": _SAFETENSORS_DTYPES[a.dtype], "shape": list(a.shape),
                         "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write_checkpoint(out: str | Path, cfg: Glm5NextKdaConfig, seed: int = 0, shards: int = 1,
                     spelling: str = "flat", *, force: bool = False,
                     progress: Callable[[int], None] | None = None) -> Path:
    """Write `config.json` (in `cfg.layout`) and the weights of every layer of `cfg` to the
    directory `out`, the KDA tensors named as `spelling` (a key of `checkpoint.SPELLINGS`)
    names them.

    With `shards > 1` the layers are spread over that many files plus
    `model.safetensors.index.json`, as large HF checkpoints are. The weights depend only on
    the shapes and `seed`, not on the layout, spelling or sharding. The files are written a
    layer at a time (`progress(1)` after each) into a temporary directory beside `out`, which
    then takes `out`'s place: an existing `out` that holds anything is replaced only with
    `force` and only when it holds nothing but a checkpoint's files, and an interrupted write
    leaves the old checkpoint (or nothing) there, never a mix.
    """
    check_config(cfg, "write_checkpoint")
    seed = check_int(seed, "write_checkpoint: seed", 0)
    shards = check_int(shards, f"shards (one layer a shard at most, {cfg.num_hidden_layers} "
                               "layers)", 1, cfg.num_hidden_layers)
    if spelling not in SPELLINGS:
        raise KdaError(f"unknown spelling {spelling!r}; expected one of {sorted(SPELLINGS)}")
    shard_of = [i * shards // cfg.num_hidden_layers for i in range(cfg.num_hidden_layers)]
    names = ["model.safetensors"] if shards == 1 else \
        [f"model-{s + 1:05d}-of-{shards:05d}.safetensors" for s in range(shards)]
    shapes = {n: np.broadcast_to(np.zeros((), dt), shape)
              for n, (shape, dt) in layer_layout(cfg).items()}  # each tensor, holding no data
    layout = [{k: a for i in range(cfg.num_hidden_layers) if shard_of[i] == s
               for k, a in _stored_layer(cfg, i, shapes if i in cfg.kda_layers else None,
                                         spelling).items()} for s in range(shards)]
    headers = [_header(shard) for shard in layout]
    with PendingDir(out, force=force, what="checkpoint",
                    owned=lambda n: CHECKPOINT_FILE.fullmatch(n) is not None) as pending:
        data = sum(a.nbytes for shard in layout for a in shard.values())
        need = data + sum(len(h) for h in headers)
        free = shutil.disk_usage(pending.tmp).free
        if need > free:
            raise KdaError(f"checkpoint {pending.path}: needs {format_bytes(need)} of disk, "
                           f"{format_bytes(free)} free there")

        def write(tmp: Path) -> None:
            rng = np.random.default_rng(seed)
            for s, (fname, header) in enumerate(zip(names, headers)):
                with open(tmp / fname, "wb") as f:
                    f.write(header)
                    for i in (i for i in range(cfg.num_hidden_layers) if shard_of[i] == s):
                        t = synth_layer_tensors(cfg, rng) if i in cfg.kda_layers else None
                        for a in _stored_layer(cfg, i, t, spelling).values():
                            np.ascontiguousarray(a).tofile(f)
                        if progress is not None:
                            progress(1)
            if shards > 1:
                weight_map = {k: fname for fname, shard in zip(names, layout) for k in shard}
                (tmp / "model.safetensors.index.json").write_text(
                    json.dumps({"metadata": {"total_size": data}, "weight_map": weight_map},
                               indent=1))
            (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
        return pending.commit(write)
