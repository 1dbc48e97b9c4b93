"""Reading KDA tensors from an HF-layout safetensors checkpoint, lazily.

A checkpoint is a directory with `config.json` and either `model.safetensors` or a
sharded `model.safetensors.index.json` (never both: which one holds the weights would be a
guess); its files may be symbolic links (a Hugging Face cache snapshot links them into
`../../blobs/`), but the index names each shard by a path inside the directory, and no tensor
is stored in two shards. The KDA layers live under one of
`LAYER_PREFIXES` (`model.layers.` in Kimi Linear, `model.language_model.layers.` in
GLM-5.3-Flash) and spell their attention tensors one of two ways (`SPELLINGS`): the
released checkpoints' flat names with three separate convs, or transformers' module tree
(`forget_gate.*` and one fused `conv1d`). Only the attention tensors of the KDA layers are
read, one layer at a time; every tensor's shape and dtype are checked before its data is
touched, and a tensor holding NaN or Inf is refused, naming it. A tensor parallel rank reads
only its slices of each tensor (`TensorSpec.head_axis`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import numpy as np
from safetensors import safe_open

from .config import Glm5NextKdaConfig
from .errors import KdaError, check_int

LAYER_PREFIXES = {"kimi_linear": "model.layers.", "glm5_next": "model.language_model.layers."}
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FP8_SCALE_SUFFIX = ".weight_scale_inv"  # block-FP8 checkpoints store each weight's scales here
NOT_BF16_HINT = ("the KDA projections must be bf16: the checkpoint's quantization_config "
                 "should list them in modules_to_not_convert")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as kdarun uses it: its accepted shapes (first is canonical) and dtypes, and
    `head_axis`, the axis of the canonical shape that runs over heads (a rank of a tensor
    parallel group reads its share of it; None: every rank reads it whole)."""
    name: str
    shapes: Callable[[Glm5NextKdaConfig], tuple[tuple[int, ...], ...]]
    dtypes: tuple[str, ...]
    head_axis: int | None = None


_MAT = ("BF16",)
_SMALL = ("BF16", "F32")
# Tensor parallel over heads (vLLM's recipe): q/k/v and their convs, f_b, g_b, b, A_log and
# dt_bias are split by heads; o_proj by its input columns (row-parallel, so each rank's
# final_out is a partial sum); f_a, g_a and o_norm are replicated.
TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("q_proj.weight", lambda c: ((c.qkv, c.hidden_size),), _MAT, 0),
    TensorSpec("k_proj.weight", lambda c: ((c.qkv, c.hidden_size),), _MAT, 0),
    TensorSpec("v_proj.weight", lambda c: ((c.qkv, c.hidden_size),), _MAT, 0),
    TensorSpec("q_conv1d.weight", lambda c: ((c.qkv, 1, c.conv_kernel),), _SMALL, 0),
    TensorSpec("k_conv1d.weight", lambda c: ((c.qkv, 1, c.conv_kernel),), _SMALL, 0),
    TensorSpec("v_conv1d.weight", lambda c: ((c.qkv, 1, c.conv_kernel),), _SMALL, 0),
    TensorSpec("A_log", lambda c: ((1, 1, c.num_heads, 1), (c.num_heads,)), _SMALL, 2),
    TensorSpec("dt_bias", lambda c: ((c.qkv,),), _SMALL, 0),
    TensorSpec("f_a_proj.weight", lambda c: ((c.rank, c.hidden_size),), _MAT),
    TensorSpec("f_b_proj.weight", lambda c: ((c.qkv, c.rank),), _MAT, 0),
    TensorSpec("b_proj.weight", lambda c: ((c.num_heads, c.hidden_size),), _MAT, 0),
    TensorSpec("g_a_proj.weight", lambda c: ((c.rank, c.hidden_size),), _MAT),
    TensorSpec("g_b_proj.weight", lambda c: ((c.qkv, c.rank),), _MAT, 0),
    TensorSpec("o_norm.weight", lambda c: ((c.head_dim,),), _SMALL),
    TensorSpec("o_proj.weight", lambda c: ((c.hidden_size, c.qkv),), _MAT, 1),
)
_BY_NAME = {s.name: s for s in TENSORS}

# The one name-mapping table: spelling -> {name under `self_attn.` -> the TENSORS it holds}.
# A fused tensor holds several, stacked along dim 0 in the order listed.
_TRANSFORMERS_OWN = {
    "forget_gate.f_a_proj.weight": ("f_a_proj.weight",),
    "forget_gate.f_b_proj.weight": ("f_b_proj.weight",),
    "forget_gate.A_log": ("A_log",),
    "forget_gate.dt_bias": ("dt_bias",),
    "conv1d.weight": ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"),
}
_RENAMED = {held for names in _TRANSFORMERS_OWN.values() for held in names}
SPELLINGS: dict[str, dict[str, tuple[str, ...]]] = {
    "flat": {s.name: (s.name,) for s in TENSORS},
    "transformers": {**{s.name: (s.name,) for s in TENSORS if s.name not in _RENAMED},
                     **_TRANSFORMERS_OWN},
}
# The names only one spelling uses: a layer holding names of two spellings is refused.
_OWN_NAMES = {sp: set(names) - {n for other, o in SPELLINGS.items() if other != sp for n in o}
              for sp, names in SPELLINGS.items()}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as the checkpoint stores it: its full name and the TENSORS it holds
    (a fused tensor holds several, stacked along dim 0)."""
    name: str
    holds: tuple[TensorSpec, ...]

    def shapes(self, cfg: Glm5NextKdaConfig) -> tuple[tuple[int, ...], ...]:
        n = len(self.holds)
        return tuple((n * s[0],) + s[1:] for s in self.holds[0].shapes(cfg))

    @property
    def dtypes(self) -> tuple[str, ...]:
        return self.holds[0].dtypes

    def rank_index(self, cfg: Glm5NextKdaConfig, shape: tuple[int, ...], tp_rank: int,
                   tp_size: int) -> list[tuple[slice, ...]]:
        """The index tuples that select rank `tp_rank`'s share of this tensor stored as
        `shape` (one of `shapes(cfg)`, the whole model's config), one for each part it holds,
        in order: the part's rows (parts are stacked along dim 0) and, along the head axis,
        the rank's 1/tp_size of them (heads are contiguous, so that is the rank's heads).
        Concatenated along dim 0 they hold the rank's parts stacked the same way. The one
        place a tensor is sharded: the checkpoint's sliced reads and `shard_tensors` both
        apply it."""
        n, spec = len(self.holds), self.holds[0]
        rows = shape[0] // n
        axis = spec.head_axis
        if axis is not None:
            canon = spec.shapes(cfg)[0]  # another accepted shape (A_log [H]): the heads' axis
            axis = axis if len(shape) == len(canon) else shape.index(canon[axis])
        out = []
        for i in range(n):
            idx = [slice(None)] * len(shape)
            idx[0] = slice(i * rows, (i + 1) * rows)
            if axis is not None and tp_size > 1:
                lo, extent = (i * rows, rows) if axis == 0 else (0, shape[axis])
                share = extent // tp_size
                idx[axis] = slice(lo + tp_rank * share, lo + (tp_rank + 1) * share)
            out.append(tuple(idx))
        return out


def tensor_name(prefix: str, layer_idx: int, short: str) -> str:
    """The full name of attention tensor `short` of layer `layer_idx` under `prefix`."""
    return f"{prefix}{layer_idx}.self_attn.{short}"


def tensors_digest(tensors: dict[str, np.ndarray]) -> str:
    """A SHA-256 over tensors (by name: name, dtype, shape and bytes): the fingerprint of the
    weights a run used."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.view(np.uint8).reshape(-1))
    return h.hexdigest()


def nonfinite(name: str, arr: np.ndarray) -> str | None:
    """None when `arr` is finite; else what and where: the count and the first index."""
    bad = ~np.isfinite(arr.astype(np.float32))
    n = int(np.count_nonzero(bad))
    if not n:
        return None
    first = [int(i) for i in np.unravel_index(int(np.argmax(bad)), arr.shape)]
    return f"{name} holds {n} NaN/Inf value(s), the first at {first}"


def canonical(cfg: Glm5NextKdaConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checkpoint shapes -> the shapes the runtime uses: `A_log` [H], conv weights [qkv, W]."""
    out = dict(tensors)
    out["A_log"] = out["A_log"].reshape(cfg.num_heads)
    for p in "qkv":
        out[f"{p}_conv1d.weight"] = out[f"{p}_conv1d.weight"].reshape(cfg.qkv, cfg.conv_kernel)
    return out


def shard_tensors(cfg: Glm5NextKdaConfig, tensors: dict[str, np.ndarray], tp_rank: int,
                  tp_size: int) -> dict[str, np.ndarray]:
    """Rank `tp_rank`'s share of in-memory layer tensors of the whole model's `cfg` (keyed by
    `TENSORS` name, canonical or checkpoint shapes), by the same rule as the checkpoint's
    sliced reads: what `Checkpoint.layer_tensors(i, tp_rank, tp_size)` returns for them."""
    cfg.check_tp(tp_rank, tp_size)
    out = {}
    for name, arr in tensors.items():
        (idx,) = StoredTensor(name, (_BY_NAME[name],)).rank_index(cfg, arr.shape, tp_rank,
                                                                 tp_size)
        out[name] = np.ascontiguousarray(arr[idx])
    return out


class Checkpoint:
    """An opened checkpoint directory: its config (whose `layout` says which of the two
    config layouts it is), the prefix its layers live under, and a lazy per-layer reader."""

    def __init__(self, path: str | Path):
        if not isinstance(path, (str, Path)):
            raise KdaError(f"checkpoint: the path must be a str or pathlib.Path (a checkpoint "
                           f"directory), got {path!r}")
        self.path = Path(path)
        if not self.path.is_dir():
            raise KdaError(f"checkpoint: {self.path} "
                           f"{'is not a directory' if self.path.exists() else 'does not exist'}")
        self.config = Glm5NextKdaConfig.from_json(self.path / "config.json")
        self.weight_map = self._read_weight_map()
        self.prefix = self._find_prefix()

    @property
    def layout(self) -> str:
        """The layout of `config.json`: "kimi_linear" or "glm5_next"."""
        return self.config.layout

    def tensor_name(self, layer_idx: int, short: str) -> str:
        return tensor_name(self.prefix, layer_idx, short)

    def _read_weight_map(self) -> dict[str, Path]:
        index, single = self.path / INDEX_FILE, self.path / SINGLE_FILE
        if index.exists() and single.exists():
            raise KdaError(f"checkpoint {self.path} holds both {SINGLE_FILE} and {INDEX_FILE}; "
                           "which of them holds the weights is ambiguous (one is likely left "
                           "over from an older checkpoint): remove the stale one")
        if index.exists():
            return self._read_index(index)
        if single.exists():
            return {name: single for name in self._keys(single)}
        for f in (single, index):
            if f.is_symlink():  # a download cut short leaves the link and not its blob
                raise KdaError(f"checkpoint {self.path}: {f.name} is a symbolic link to "
                               f"{os.readlink(f)}, which is missing")
        raise KdaError(f"checkpoint {self.path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")

    def _read_index(self, index: Path) -> dict[str, Path]:
        """The index's weight map, checked: a JSON object whose `weight_map` maps each tensor
        name once to a shard inside the directory, each shard holding the tensors the index
        puts there and no other shard holding them too."""
        def once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            dup = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
            if dup:
                raise KdaError(f"{index}: {dup[:3]} listed more than once; expected each "
                               "tensor once")
            return dict(pairs)

        try:
            doc = json.loads(index.read_text(), object_pairs_hook=once)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise KdaError(f"{index}: not a readable JSON file ({e})") from None
        if not isinstance(doc, dict):
            raise KdaError(f"{index}: expected a JSON object with a weight_map, got "
                           f"{type(doc).__name__}")
        wm = doc.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise KdaError(f"{index}: weight_map must be a non-empty object (tensor name -> "
                           f"shard file), got {str(wm)[:60]}")
        for name, shard in wm.items():
            if not isinstance(shard, str) or not shard:
                raise KdaError(f"{index}: weight_map[{name!r}] must be a shard file name, got "
                               f"{shard!r}")
            rel = PurePosixPath(shard)
            if rel.is_absolute() or ".." in rel.parts or "\\" in shard:
                raise KdaError(f"{index}: weight_map[{name!r}] is {shard!r}, outside the "
                               f"checkpoint directory; expected a file name inside {self.path}")
        files = {shard: self.path / shard for shard in set(wm.values())}
        where: dict[str, str] = {}
        for shard in sorted(files):
            for key in self._keys(files[shard]):
                if key in where:
                    raise KdaError(f"checkpoint {self.path}: tensor {key} is stored in both "
                                   f"{where[key]} and {shard}; which copy to read is ambiguous")
                where[key] = shard
        return {name: files[shard] for name, shard in wm.items()}

    def _find_prefix(self) -> str:
        """The one of `LAYER_PREFIXES` the KDA layers' attention tensors live under."""
        kda = {str(i) for i in self.config.kda_layers}
        found = sorted({p for p in LAYER_PREFIXES.values() for n in self.weight_map
                        if n.startswith(p) and n[len(p):].split(".", 1)[0] in kda
                        and ".self_attn." in n})
        if len(found) == 1:
            return found[0]
        if not found:
            raise KdaError(f"checkpoint {self.path}: no KDA layer's attention tensors under "
                           f"{' or '.join(LAYER_PREFIXES.values())} (0-based KDA layers: "
                           f"{list(self.config.kda_layers)})")
        raise KdaError(f"checkpoint {self.path}: KDA layers' tensors under both {found}; "
                       "expected one prefix")

    @staticmethod
    def _open(file: Path):
        """Open one shard, following symbolic links (a Hugging Face cache's blobs)."""
        if not file.exists():
            link = (f" (a symbolic link to {os.readlink(file)}, which is missing)"
                    if file.is_symlink() else "")
            raise KdaError(f"checkpoint shard missing: {file}{link}")
        try:
            return safe_open(str(file.resolve()), framework="numpy")
        except Exception as e:  # safetensors raises its own error type for corrupt files
            raise KdaError(f"{file}: not a readable safetensors file ({e})") from None

    def files(self) -> list[Path]:
        """Every file the checkpoint is read from: config.json, the index, the weight files."""
        index = self.path / INDEX_FILE
        return [self.path / "config.json", *([index] if index.exists() else []),
                *sorted(set(self.weight_map.values()))]

    def _keys(self, file: Path) -> list[str]:
        with self._open(file) as f:
            return list(f.keys())

    def _layer_names(self, layer_idx: int) -> list[str]:
        """Every tensor name under layer `layer_idx`'s `self_attn.`, short (prefix removed)."""
        cfg = self.config
        if layer_idx not in cfg.kda_layers:
            raise KdaError(f"layer {layer_idx} is not a KDA layer of {self.path} "
                           f"(0-based KDA layers: {list(cfg.kda_layers)})")
        lp = self.tensor_name(layer_idx, "")
        return sorted(n[len(lp):] for n in self.weight_map if n.startswith(lp))

    def layer_spelling(self, layer_idx: int) -> str:
        """The spelling (a key of `SPELLINGS`) of layer `layer_idx`'s tensors; a layer holding
        names of two spellings is refused."""
        names = set(self._layer_names(layer_idx))
        found = {sp: sorted(names & own) for sp, own in _OWN_NAMES.items() if names & own}
        if len(found) > 1:
            held = "; ".join(f"{sp}: {[self.tensor_name(layer_idx, n) for n in ns]}"
                             for sp, ns in found.items())
            raise KdaError(f"checkpoint {self.path}: layer {layer_idx} mixes tensor spellings "
                           f"({held}); a layer spells its gate and conv one way: flat "
                           "(f_a_proj, A_log, q/k/v_conv1d, ...) or transformers' "
                           "(forget_gate.*, one fused conv1d)")
        return next(iter(found), "flat")

    def stored_tensors(self, layer_idx: int) -> list[StoredTensor]:
        """The tensors layer `layer_idx` must store, in its spelling."""
        spelling = SPELLINGS[self.layer_spelling(layer_idx)]
        return [StoredTensor(self.tensor_name(layer_idx, short), tuple(_BY_NAME[h] for h in holds))
                for short, holds in spelling.items()]

    def _read_layer(self, layer_idx: int, tp_rank: int = 0,
                    tp_size: int = 1) -> list[tuple[StoredTensor, np.ndarray]]:
        """Layer `layer_idx`'s stored tensors, each checked, dtypes as stored: rank
        `tp_rank`'s share of each of `tp_size` (`StoredTensor.rank_index`), read as slices."""
        stored = self.stored_tensors(layer_idx)
        names = [self.tensor_name(layer_idx, n) for n in self._layer_names(layer_idx)]
        scales = [n for n in names if n.endswith(FP8_SCALE_SUFFIX)]
        if scales:
            raise KdaError(f"checkpoint {self.path}: layer {layer_idx} is block-FP8 quantized "
                           f"(scale tensors {scales}); {NOT_BF16_HINT}")
        known = {s.name for s in stored}
        extra = [n for n in names if n not in known]
        if extra:  # e.g. a bias kdarun does not apply: running without it would be silently wrong
            raise KdaError(f"checkpoint {self.path}: layer {layer_idx} has tensors kdarun does "
                           f"not implement: {extra}")
        by_file: dict[Path, list[StoredTensor]] = {}
        for s in stored:
            if s.name not in self.weight_map:
                raise KdaError(f"checkpoint {self.path}: missing tensor {s.name}")
            by_file.setdefault(self.weight_map[s.name], []).append(s)
        out: list[tuple[StoredTensor, np.ndarray]] = []
        for file, specs in by_file.items():
            with self._open(file) as f:
                keys = set(f.keys())
                for s in specs:
                    if s.name not in keys:
                        raise KdaError(f"{file}: missing tensor {s.name} (the index points here)")
                    out.append((s, self._read_checked(f, file, s, tp_rank, tp_size)))
        return out

    def layer_tensors(self, layer_idx: int, tp_rank: int = 0,
                      tp_size: int = 1) -> dict[str, np.ndarray]:
        """All KDA tensors of layer `layer_idx` (0-based), keyed by their `TENSORS` name
        whatever the spelling (a fused conv split into q, k, v), shapes canonical (`A_log`
        as `[H]`, conv weights `[qkv, W]`) for the config `config.shard(tp_size)`, dtypes as
        stored. With tp_size > 1 only rank `tp_rank`'s share of each tensor is read (its
        heads' rows, o_proj's columns; f_a, g_a, o_norm whole), never a whole sharded tensor.
        A tensor holding NaN or Inf is refused, naming it and where."""
        layer_idx = check_int(layer_idx, "checkpoint layer_tensors: layer_idx", 0)
        self.config.check_tp(tp_rank, tp_size)
        out: dict[str, np.ndarray] = {}
        for s, arr in self._read_layer(layer_idx, tp_rank, tp_size):
            bad = nonfinite(s.name, arr)
            if bad:
                raise KdaError(f"checkpoint {self.path}: {bad}")
            for spec, part in zip(s.holds, np.split(arr, len(s.holds))):
                out[spec.name] = np.ascontiguousarray(part)
        return canonical(self.config.shard(tp_size), out)

    def _read_checked(self, f, file: Path, s: StoredTensor, tp_rank: int,
                      tp_size: int) -> np.ndarray:
        sl = f.get_slice(s.name)
        shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
        shapes = s.shapes(self.config)
        if dtype in FP8_DTYPES:
            raise KdaError(f"{file}: tensor {s.name} is stored as FP8 ({dtype}), expected "
                           f"{' or '.join(s.dtypes)}; {NOT_BF16_HINT}")
        if shape not in shapes:
            want = " or ".join(str(list(x)) for x in shapes)
            raise KdaError(f"{file}: tensor {s.name} has shape {list(shape)}, expected {want}")
        if dtype not in s.dtypes:
            raise KdaError(f"{file}: tensor {s.name} has dtype {dtype}, expected "
                           f"{' or '.join(s.dtypes)}")
        try:
            parts = [sl[idx] for idx in s.rank_index(self.config, shape, tp_rank, tp_size)]
        except Exception as e:
            raise KdaError(f"{file}: cannot read tensor {s.name} ({e})") from None
        return np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts))

    def problems(self) -> list[str]:
        """Every problem found in the KDA tensors of every KDA layer (empty when clean)."""
        found = []
        for i in self.config.kda_layers:
            try:
                arrays = self._read_layer(i)
            except KdaError as e:
                found.append(str(e))
                continue
            found += [bad for s, arr in arrays if (bad := nonfinite(s.name, arr))]
        return found

