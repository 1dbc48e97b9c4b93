"""Stage dumps: every buffer a kernel wrote during a run, saved in order, and a comparison
that finds the first stage that goes wrong.

A dump directory holds `stages.safetensors` (each stage's valid rows, bf16 kept as bf16, plus
the run's input under `input.hidden`) and `manifest.json` (how to repeat the run, the
fingerprint of what it ran on, and each stage's kernel, shape, dtype and layout, in the order
written). The fingerprint (digests of the checkpoint's KDA config and of the layer's tensors)
lets a comparison tell a checkpoint that changed since the dump from a kernel that went wrong.
Stage keys are `<call>/<buffer>`: calls are `prefill`, `decode.<i>` and `decode_k`; per-token
buffers of the stateful decode walk carry their row, `conv_out[2]`; states are
`state.recurrent` and `state.conv`. A serving run (`layer-run --batch N`) keys each sequence's
rows of a batched call apart, `seq<i>.<call>/<buffer>` with calls `prefill` (the packed
prefill), `decode.<j>` (batched decodes) and `verify`, its states read from its pool slot
after each call; its input is every sequence's rows, one sequence after the other.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from . import reference
from .reference import KDARUN, KDARUN_LABEL
from .backend import GpuBackend
from .checkpoint import Checkpoint, tensors_digest
from .config import Glm5NextKdaConfig, hf_layout
from .errors import KdaError
from .files import PendingDir
from .layer import Stage
from .run import RunPlan, compare, open_run_checkpoint
from .state import CONV_TOL, RECURRENT_TOL, conv_shape, recurrent_shape
from .workspace import BUFFERS

MANIFEST = "manifest.json"
TENSORS_FILE = "stages.safetensors"
INPUT_KEY = "input.hidden"
FORMAT = 2  # 2: the manifest holds the fingerprint
DUMP_FILES = (MANIFEST, TENSORS_FILE)

# Each stage's tolerance, by buffer name: the workspace table's and the two states'.
STAGE_TOL = {b.name: b.tol for b in BUFFERS if b.public} | {"state.recurrent": RECURRENT_TOL,
                                                             "state.conv": CONV_TOL}


def _base(name: str) -> str:
    return re.sub(r"\[\d+\]$", "", name)


@dataclass
class StageRecord:
    key: str  # <call>/<buffer>
    kernel: str
    shape: list[int]  # of the saved (valid) rows
    dtype: str
    row_axis: int
    layout: str


class StageRecorder:
    """A layer stage hook that copies each stage's valid rows to the host as it is written.
    It synchronises the stream at every stage, so it is for debugging runs, not timing."""

    def __init__(self) -> None:
        self.call = "run"
        self.records: list[StageRecord] = []
        self.arrays: dict[str, np.ndarray] = {}
        self._window: dict[str, tuple[int, ...]] = {}  # a sequence's key -> the call it came in

    def begin(self, call: str) -> None:
        self.call = call

    def __call__(self, stage: Stage, gpu: GpuBackend, stream: int) -> None:
        full = gpu.download(stage.ptr, stage.shape, stage.dtype, stream)
        if not stage.seq_rows:
            self.record(f"{self.call}/{stage.name}", stage.kernel,
                        np.take(full, np.arange(stage.valid_rows), axis=stage.row_axis),
                        stage.row_axis, stage.layout)
        for i, (start, stop) in zip(stage.seq_ids, stage.seq_rows):
            rows = np.take(full, np.arange(start, stop), axis=stage.row_axis)
            key = f"seq{i}.{self.call}/{stage.name}"
            if key not in self.arrays or self._window.get(key) is stage.seq_ids:
                self.record(key, stage.kernel, rows, stage.row_axis, stage.layout)
                self._window[key] = stage.seq_ids
                continue
            # a later window's piece of a sequence longer than a window: its rows follow
            self._window[key] = stage.seq_ids
            whole = np.concatenate([self.arrays[key], rows], axis=stage.row_axis)
            self.arrays[key] = whole
            next(r for r in self.records if r.key == key).shape = list(whole.shape)

    def record(self, key: str, kernel: str, a: np.ndarray, row_axis: int, layout: str) -> None:
        """Keep `a` as stage `key` (`<call>/<buffer>`), in the order written."""
        if key in self.arrays:
            raise KdaError(f"stage {key} written twice in one call")
        self.arrays[key] = np.ascontiguousarray(a)
        self.records.append(StageRecord(key, kernel, list(a.shape), str(a.dtype), row_axis,
                                        layout))


def config_digest(cfg: Glm5NextKdaConfig) -> str:
    """A SHA-256 of the checkpoint's KDA config (as `to_hf` writes it)."""
    return hashlib.sha256(json.dumps(cfg.to_hf(), sort_keys=True).encode()).hexdigest()


def fingerprint(cfg: Glm5NextKdaConfig, tensors: dict[str, np.ndarray]) -> dict[str, str]:
    """What a run's result depends on besides its input: digests of the checkpoint's KDA
    config (`config`) and of the layer's tensors (`weights`)."""
    return {"config": config_digest(cfg), "weights": tensors_digest(tensors)}


def claim_dump(path: str | Path, force: bool = False,
               protected: dict[Path, str] | None = None) -> PendingDir:
    """Claim a dump directory before the run (see `files.PendingDir`): a new or empty one,
    or, with `force`, an older dump; never one holding one of `protected` (the run's input,
    its checkpoint's files)."""
    return PendingDir(path, force=force, what="stage dump", owned=DUMP_FILES.__contains__,
                      protected=protected)


def write_dump(out: PendingDir, recorder: StageRecorder, hidden: np.ndarray,
               run: dict[str, Any], fingerprint: dict[str, str]) -> Path:
    """Save a recorded run into the claimed `out`: `run` describes it (checkpoint, layer,
    backend, plan, seed...), `fingerprint` (`fingerprint()`) what it ran on."""
    tensors = dict(recorder.arrays)
    tensors[INPUT_KEY] = np.ascontiguousarray(hidden)
    manifest = {"format": FORMAT, "run": run, "fingerprint": fingerprint,
                "input_sha256": _sha(hidden), "stages": [asdict(r) for r in recorder.records]}

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / TENSORS_FILE))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out.commit(write)


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8)).hexdigest()


@dataclass
class Dump:
    path: Path
    manifest: dict[str, Any]
    tensors: dict[str, np.ndarray]

    @property
    def run(self) -> dict[str, Any]:
        return self.manifest["run"]

    @property
    def keys(self) -> list[str]:
        return [s["key"] for s in self.manifest["stages"]]

    @property
    def hidden(self) -> np.ndarray:
        return self.tensors[INPUT_KEY]


_KINDS = {str: "a string", int: "an integer", list: "a list", dict: "an object"}
_STAGE_FIELDS = {"key": str, "kernel": str, "shape": list, "dtype": str, "row_axis": int,
                 "layout": str}
_DEMO_FIELDS = {"preset": str, "gate": str, "layers": int, "seed": int}


def _check_manifest(path: Path, m: Any) -> Glm5NextKdaConfig:
    """Check a manifest's every field a comparison reads (types, the plan, the stage keys,
    the config); returns the run's config."""
    def bad(where: str, want: str, got: Any) -> KdaError:
        return KdaError(f"dump {path}: corrupt {MANIFEST}: {where} must be {want}, got "
                        f"{str(got)[:80]}")

    def need(d: Any, key: str, kind: type, where: str = "") -> Any:
        v = d.get(key) if isinstance(d, dict) else None
        if not isinstance(v, kind) or (isinstance(v, bool) and kind is int):
            raise bad(where + key, _KINDS[kind], v)
        return v

    if not isinstance(m, dict):
        raise bad("the manifest", "a JSON object", type(m).__name__)
    if m.get("format") != FORMAT:
        raise KdaError(f"dump {path}: format {m.get('format')!r}, this kdarun reads format "
                       f"{FORMAT} (re-run the dump with the command in its {MANIFEST})")
    seen = set()
    if not need(m, "stages", list):
        raise bad("stages", "at least one stage", [])
    for i, st in enumerate(m["stages"]):
        for key, kind in _STAGE_FIELDS.items():
            need(st, key, kind, f"stages[{i}].")
        if not all(isinstance(n, int) and n >= 0 for n in st["shape"]):
            raise bad(f"stages[{i}].shape", "a list of sizes", st["shape"])
        call, _, buf = st["key"].partition("/")
        if not call or _base(buf) not in STAGE_TOL or st["key"] in seen:
            raise bad(f"stages[{i}].key", "a new <call>/<buffer> of a known buffer", st["key"])
        seen.add(st["key"])
    run = need(m, "run", dict)
    plan = need(run, "plan", dict, "run.")
    try:
        RunPlan(**plan).check()
    except (TypeError, KdaError):
        raise bad("run.plan", "{prefill, decode_steps, k} token counts", plan) from None
    if "batch" in run:
        lengths = need(need(run, "batch", dict, "run."), "lengths", list, "run.batch.")
        if not lengths or not all(isinstance(n, int) and n >= 1 for n in lengths):
            raise bad("run.batch.lengths", "a list of prompt lengths >= 1", lengths)
    need(run, "layer", int, "run.")
    ckpt = need(run, "checkpoint", dict, "run.")
    if "demo" in ckpt:
        for key, kind in _DEMO_FIELDS.items():
            need(need(ckpt, "demo", dict, "run.checkpoint."), key, kind, "run.checkpoint.demo.")
    else:
        need(ckpt, "path", str, "run.checkpoint.")
    need(m, "input_sha256", str)
    for key in ("config", "weights"):
        need(need(m, "fingerprint", dict), key, str, "fingerprint.")
    try:
        return Glm5NextKdaConfig.from_hf(need(run, "config", dict, "run."), "run.config")
    except KdaError as e:
        raise KdaError(f"dump {path}: corrupt {MANIFEST}: {e}") from None


def load_dump(path: str | Path) -> Dump:
    """Read a dump directory, checking it is whole: manifest, tensors, every listed stage."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise KdaError(f"dump {path}: no {MANIFEST} (not a stage dump, or an incomplete one)")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KdaError(f"dump {path}: corrupt {MANIFEST} ({e})") from None
    cfg = _check_manifest(path, manifest)
    tpath = path / TENSORS_FILE
    if not tpath.exists():
        raise KdaError(f"dump {path}: {TENSORS_FILE} is missing")
    try:
        tensors = load_file(str(tpath))
    except Exception as e:  # safetensors raises its own error type for corrupt files
        raise KdaError(f"dump {path}: {TENSORS_FILE} is not readable ({e})") from None
    for s in manifest["stages"]:
        a = tensors.get(s["key"])
        if a is None:
            raise KdaError(f"dump {path}: stage {s['key']} is in the manifest but not in "
                           f"{TENSORS_FILE}")
        if list(a.shape) != s["shape"] or str(a.dtype) != s["dtype"]:
            raise KdaError(f"dump {path}: stage {s['key']} is {list(a.shape)} {a.dtype}, the "
                           f"manifest says {s['shape']} {s['dtype']}")
    hidden = tensors.get(INPUT_KEY)
    if hidden is None:
        raise KdaError(f"dump {path}: the run's input ({INPUT_KEY}) is missing")
    total = input_rows(manifest["run"])
    if hidden.ndim != 2 or hidden.shape[0] < total or hidden.shape[1] != cfg.hidden_size:
        raise KdaError(f"dump {path}: the run's input is {list(hidden.shape)}, expected "
                       f"[{total}, {cfg.hidden_size}] for its plan and config")
    if _sha(hidden) != manifest["input_sha256"]:
        raise KdaError(f"dump {path}: the stored input does not match the manifest's checksum")
    return Dump(path, manifest, tensors)


def input_rows(run: dict[str, Any]) -> int:
    """The input rows a run takes: its plan's tokens, or in a serving run (`run["batch"]`)
    every sequence's prompt, decode and verify rows."""
    plan = RunPlan(**run["plan"])
    if "batch" not in run:
        return plan.total
    lengths = run["batch"]["lengths"]
    return sum(lengths) + len(lengths) * (plan.decode_steps + plan.k)


# -- the float64 reference of every stage of a run --------------------------------------------
def reference_stages(cfg: Glm5NextKdaConfig, tensors: dict, hidden: np.ndarray,
                     plan: RunPlan) -> dict[str, np.ndarray]:
    """Every stage key a run of `plan` writes, computed in float64 from `hidden` and zero
    states (the prefill as one call, decode rows one token at a time)."""
    out: dict[str, np.ndarray] = {}
    R, C = np.zeros(recurrent_shape(cfg)), np.zeros(conv_shape(cfg))
    pos = 0

    def front(call: str, st: dict) -> None:
        for name in ("qkv_parts", "qkv_proj", "g_raw", "out_gate", "gate", "beta", "final_out"):
            out[f"{call}/{name}"] = st[name]

    if plan.prefill:
        r = reference.layer(cfg, tensors, hidden[:plan.prefill], R, C, rounding=KDARUN)
        front("prefill", r.stages)
        for name in ("conv_out", "core", "o_norm_out"):
            out[f"prefill/{name}"] = r.stages[name]
        for i, name in enumerate(("q_f32", "k_f32", "v_f32")):
            out[f"prefill/{name}"] = r.stages["conv_out"][:, i * cfg.qkv:(i + 1) * cfg.qkv]
        out["prefill/state.recurrent"], out["prefill/state.conv"] = r.recurrent_state, r.conv_state
        R, C, pos = r.recurrent_state, r.conv_state, plan.prefill
    calls = [(f"decode.{i}", 1) for i in range(plan.decode_steps)]
    if plan.k:
        calls.append(("decode_k", plan.k))
    for call, n in calls:
        rows = []
        for row in range(n):
            r = reference.layer(cfg, tensors, hidden[pos:pos + 1], R, C, rounding=KDARUN)
            for name in ("conv_out", "core", "o_norm_out"):
                out[f"{call}/{name}[{row}]"] = r.stages[name]
            out[f"{call}/state.recurrent[{row}]"] = r.recurrent_state
            out[f"{call}/state.conv[{row}]"] = r.conv_state
            R, C, pos = r.recurrent_state, r.conv_state, pos + 1
            rows.append(r.stages)
        front(call, {k: np.concatenate([s[k] for s in rows], axis=1 if k == "qkv_parts" else 0)
                     for k in rows[0]})
    return out


def reference_batch_stages(cfg: Glm5NextKdaConfig, tensors: dict, hidden: np.ndarray,
                           plan: RunPlan, lengths: list[int]) -> dict[str, np.ndarray]:
    """Every stage key of a serving run (`seq<i>.<call>/<buffer>`) in float64: sequence i is
    the next lengths[i] + decode_steps + k rows of `hidden`, run alone from zero states as a
    prefill, single decodes and a decode_k (its `verify`); a batched call's per-row buffers
    are its rows stacked, its states those after its last row."""
    out: dict[str, np.ndarray] = {}
    start = 0
    for i, t in enumerate(lengths):
        n = t + plan.decode_steps + plan.k
        one = reference_stages(cfg, tensors, hidden[start:start + n],
                               RunPlan(t, plan.decode_steps, plan.k))
        start += n
        rows: dict[str, list[np.ndarray]] = {}
        for key, a in one.items():  # rows in order: reference_stages walks them so
            call, buf = key.split("/", 1)
            key = f"seq{i}.{'verify' if call == 'decode_k' else call}/{_base(buf)}"
            if buf == _base(buf):
                out[key] = a
            elif buf.startswith("state."):
                out[key] = a  # the last row's state stays
            else:
                rows.setdefault(key, []).append(a)
        out |= {key: np.concatenate(parts) for key, parts in rows.items()}
    return out


# -- comparison -------------------------------------------------------------------------------
@dataclass
class StageRow:
    key: str
    kernel: str
    shape: list[int]
    rel: float
    max_abs: float
    nonfinite: int
    tol: float
    ok: bool
    first_failure: bool = False


@dataclass
class StageTable:
    """Per-stage errors of a dump against the reference or another dump, in run order."""
    dump: str
    against: str
    rows: list[StageRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def first_failure(self) -> StageRow | None:
        return next((r for r in self.rows if not r.ok), None)

    def format(self) -> str:
        lines = [f"stages of {self.dump} against {self.against}",
                 f"  {'stage':<34} {'kernel':<18} {'rel':>10} {'max-abs':>10} {'NaN/Inf':>7} "
                 f"{'tol':>8}  status"]
        for r in self.rows:
            status = "ok" if r.ok else "FAIL"
            if r.first_failure:
                status += "   <== first stage past its tolerance"
            lines.append(f"  {r.key:<34} {r.kernel:<18} {r.rel:>10.3e} {r.max_abs:>10.3e} "
                         f"{r.nonfinite:>7} {r.tol:>8.1e}  {status}")
        f = self.first_failure
        lines.append("result: all stages within tolerance" if f is None else
                     f"result: FAIL, first at {f.key} (kernel {f.kernel})")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"dump": self.dump, "against": self.against, "ok": self.ok,
                "first_failure": self.first_failure.key if self.first_failure else None,
                "rows": [asdict(r) for r in self.rows]}


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict's leaves by dotted key."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def _config_change(then: dict[str, Any], now: dict[str, Any]) -> str:
    """The fields of a config that differ, as `field: then -> now`."""
    a, b = _flat(then), _flat(now)
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k, "absent") != b.get(k, "absent"))
    return "; ".join(f"{k}: {a.get(k, 'absent')!r} -> {b.get(k, 'absent')!r}" for k in keys[:3])


def _check_unchanged(d: Dump, ckpt: Checkpoint) -> dict[str, np.ndarray]:
    """The dumped layer's tensors, once the checkpoint is known to be the one the dump ran on
    (its config and the layer's weights, by the fingerprint); else a KdaError saying it
    changed, before any stage is blamed."""
    changed = f"the checkpoint changed since this dump ({d.path})"
    redo = f"; re-run the dump (the command is in its {MANIFEST})"
    then = d.manifest["fingerprint"]
    cfg = ckpt.config
    if config_digest(cfg) != then["config"]:
        was = hf_layout(d.run["config"], f"dump {d.path}: run.config")
        diff = (f"layout {was} -> {cfg.layout}: its fields moved, so they are not compared one "
                "by one" if was != cfg.layout else _config_change(d.run["config"], cfg.to_hf()))
        raise KdaError(f"{changed}: its config differs ({diff}){redo}")
    tensors = ckpt.layer_tensors(d.run["layer"])
    now = tensors_digest(tensors)
    if now != then["weights"]:
        raise KdaError(f"{changed}: layer {d.run['layer']}'s weights differ (digest "
                       f"{then['weights'][:12]}... at the dump, {now[:12]}... now){redo}")
    return tensors


def _check_same_run(a: Dump, b: Dump) -> None:
    kind = {True: "a serving (--batch) dump", False: "a single-sequence dump"}
    if ("batch" in a.run) != ("batch" in b.run):
        raise KdaError(f"dumps {a.path} and {b.path} are of different runs: "
                       f"{kind['batch' in a.run]} against {kind['batch' in b.run]}")
    if a.run["config"] != b.run["config"]:
        raise KdaError(f"dumps {a.path} and {b.path} are of different runs: their configs "
                       f"differ ({_config_change(a.run['config'], b.run['config'])})")
    for field_ in ("layer", "plan", "batch"):
        if a.run.get(field_) != b.run.get(field_):
            raise KdaError(f"dumps {a.path} and {b.path} are of different runs: {field_} "
                           f"{a.run.get(field_)!r} vs {b.run.get(field_)!r}")
    wa, wb = a.manifest["fingerprint"]["weights"], b.manifest["fingerprint"]["weights"]
    if wa != wb:
        ca, cb = a.run["checkpoint"], b.run["checkpoint"]
        why = (f"they ran on different checkpoints ({ca} vs {cb})" if ca != cb
               else "the checkpoint changed between them")
        raise KdaError(f"dumps {a.path} and {b.path} ran on different weights (layer "
                       f"{a.run['layer']}'s digest {wa[:12]}... vs {wb[:12]}...): {why}")
    if a.manifest["input_sha256"] != b.manifest["input_sha256"]:
        raise KdaError(f"dumps {a.path} and {b.path} were fed different inputs")


def compare_stages(dump: str | Path, against: str | Path | None = None,
                   only: list[str] | None = None) -> StageTable:
    """Compare every stage of `dump` with the same stage of `against` (another dump) or, when
    `against` is None, with the float64 reference fed the dump's input. `only` restricts the
    table to stage keys or buffer names (`final_out` matches every call's final_out). A dump
    whose checkpoint (config or the layer's weights) changed since, or two dumps of different
    weights, are refused before any stage is compared."""
    d = load_dump(dump)
    if against is None:
        with open_run_checkpoint(d.run) as ckpt_path:
            ckpt = Checkpoint(ckpt_path)
            tensors = _check_unchanged(d, ckpt)
        plan, hidden = RunPlan(**d.run["plan"]), d.hidden.astype(np.float64)
        expect = (reference_batch_stages(ckpt.config, tensors, hidden, plan,
                                         d.run["batch"]["lengths"]) if "batch" in d.run
                  else reference_stages(ckpt.config, tensors, hidden, plan))
        label = f"the reference ({KDARUN_LABEL})"
    else:
        o = load_dump(against)
        _check_same_run(d, o)
        expect = {k: o.tensors[k] for k in o.keys}
        label = str(o.path)
        extra = sorted(set(o.keys) - set(d.keys))
        if extra and not only:
            raise KdaError(f"{label} holds stages {d.path} lacks ({extra[:4]}"
                           f"{' ...' if len(extra) > 4 else ''}): the dumps do not cover the "
                           f"same stages")
    keys = d.keys
    if isinstance(only, str):
        only = [only]
    if only:
        known = set(keys) | {k.split("/", 1)[1] for k in keys} | {_base(k.split("/", 1)[1])
                                                                     for k in keys}
        unknown = [n for n in only if n not in known]
        if unknown:
            raise KdaError(f"unknown stage name(s) {unknown}; this dump has "
                           f"{sorted({_base(k.split('/', 1)[1]) for k in keys})}")
        keys = [k for k in keys if k in only or k.split("/", 1)[1] in only
                or _base(k.split("/", 1)[1]) in only]
    table = StageTable(str(d.path), label)
    kernels = {s["key"]: s["kernel"] for s in d.manifest["stages"]}
    for key in keys:
        if key not in expect:
            raise KdaError(f"stage {key} of {d.path} has no counterpart in {label}")
        a, b = d.tensors[key], expect[key]
        if a.shape != b.shape:
            raise KdaError(f"stage {key}: shape {list(a.shape)} in {d.path} vs "
                           f"{list(b.shape)} in {label}")
        e = compare(a, b)
        tol = STAGE_TOL[_base(key.split("/", 1)[1])]
        table.rows.append(StageRow(key, kernels[key], list(a.shape), e.rel, e.max_abs,
                                   e.nonfinite, tol, e.ok(tol)))
    first = table.first_failure
    if first is not None:
        first.first_failure = True
    return table
