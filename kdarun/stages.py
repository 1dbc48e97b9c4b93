"""Stage dumps: every buffer a kernel wrote during a run, saved in order, and a comparison
that finds the first stage that goes wrong.

A dump directory holds `stages.safetensors` (each stage's valid rows, bf16 kept as bf16, plus
the run's input under `input.hidden`) and `manifest.json` (how to repeat the run, and each
stage's kernel, shape, dtype and layout, in the order written). Stage keys are
`<call>/<buffer>`: calls are `prefill`, `decode.<i>` and `decode_k`; per-token buffers of the
stateful decode walk carry their row, `conv_out[2]`; states are `state.recurrent` and
`state.conv`.
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
from .backend import GpuBackend
from .config import Glm5NextKdaConfig
from .errors import KdaError
from .layer import Stage
from .run import RunPlan, compare
from .state import CONV_TOL, RECURRENT_TOL, conv_shape, recurrent_shape
from .workspace import BUFFERS

MANIFEST = "manifest.json"
TENSORS_FILE = "stages.safetensors"
INPUT_KEY = "input.hidden"
FORMAT = 1

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

    def begin(self, call: str) -> None:
        self.call = call

    def __call__(self, stage: Stage, gpu: GpuBackend, stream: int) -> None:
        full = gpu.download(stage.ptr, stage.shape, stage.dtype, stream)
        valid = np.take(full, np.arange(stage.valid_rows), axis=stage.row_axis)
        key = f"{self.call}/{stage.name}"
        if key in self.arrays:
            raise KdaError(f"stage {key} written twice in one call")
        self.arrays[key] = np.ascontiguousarray(valid)
        self.records.append(StageRecord(key, stage.kernel, list(valid.shape),
                                        str(np.dtype(stage.dtype)), stage.row_axis, stage.layout))


def write_dump(out: str | Path, recorder: StageRecorder, hidden: np.ndarray,
               run: dict[str, Any]) -> Path:
    """Save a recorded run: `run` describes it (checkpoint, layer, backend, plan, seed...)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(recorder.arrays)
    tensors[INPUT_KEY] = np.ascontiguousarray(hidden)
    save_file(tensors, str(out / TENSORS_FILE))
    manifest = {"format": FORMAT, "run": run, "input_sha256": _sha(hidden),
                "stages": [asdict(r) for r in recorder.records]}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out


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


def load_dump(path: str | Path) -> Dump:
    """Read a dump directory, checking it is whole: manifest, tensors, every listed stage."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.exists():
        raise KdaError(f"dump {path}: no {MANIFEST} (not a stage dump, or an incomplete one)")
    try:
        manifest = json.loads(mpath.read_text())
        stages = manifest["stages"]
        manifest["run"]["plan"]
        if manifest.get("format") != FORMAT:
            raise KdaError(f"dump {path}: format {manifest.get('format')!r}, this kdarun "
                           f"reads format {FORMAT}")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise KdaError(f"dump {path}: corrupt {MANIFEST} ({e})") from None
    tpath = path / TENSORS_FILE
    if not tpath.exists():
        raise KdaError(f"dump {path}: {TENSORS_FILE} is missing")
    try:
        tensors = load_file(str(tpath))
    except Exception as e:
        raise KdaError(f"dump {path}: {TENSORS_FILE} is not readable ({e})") from None
    for s in stages:
        a = tensors.get(s["key"])
        if a is None:
            raise KdaError(f"dump {path}: stage {s['key']} is in the manifest but not in "
                           f"{TENSORS_FILE}")
        if list(a.shape) != s["shape"] or str(a.dtype) != s["dtype"]:
            raise KdaError(f"dump {path}: stage {s['key']} is {list(a.shape)} {a.dtype}, the "
                           f"manifest says {s['shape']} {s['dtype']}")
    if INPUT_KEY not in tensors:
        raise KdaError(f"dump {path}: the run's input ({INPUT_KEY}) is missing")
    if _sha(tensors[INPUT_KEY]) != manifest.get("input_sha256"):
        raise KdaError(f"dump {path}: the stored input does not match the manifest's checksum")
    return Dump(path, manifest, tensors)


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
        r = reference.layer(cfg, tensors, hidden[:plan.prefill], R, C)
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
            r = reference.layer(cfg, tensors, hidden[pos:pos + 1], R, C)
            for name in ("conv_out", "core", "o_norm_out"):
                out[f"{call}/{name}[{row}]"] = r.stages[name]
            out[f"{call}/state.recurrent[{row}]"] = r.recurrent_state
            out[f"{call}/state.conv[{row}]"] = r.conv_state
            R, C, pos = r.recurrent_state, r.conv_state, pos + 1
            rows.append(r.stages)
        front(call, {k: np.concatenate([s[k] for s in rows], axis=1 if k == "qkv_parts" else 0)
                     for k in rows[0]})
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


def _check_same_run(a: Dump, b: Dump) -> None:
    for field_ in ("config", "layer", "plan"):
        if a.run.get(field_) != b.run.get(field_):
            raise KdaError(f"dumps {a.path} and {b.path} are of different runs: {field_} "
                           f"{a.run.get(field_)!r} vs {b.run.get(field_)!r}")
    if a.manifest["input_sha256"] != b.manifest["input_sha256"]:
        raise KdaError(f"dumps {a.path} and {b.path} were fed different inputs")


def compare_stages(dump: str | Path, against: str | Path | None = None,
                   only: list[str] | None = None) -> StageTable:
    """Compare every stage of `dump` with the same stage of `against` (another dump) or, when
    `against` is None, with the float64 reference fed the dump's input. `only` restricts the
    table to stage keys or buffer names (`final_out` matches every call's final_out)."""
    d = load_dump(dump)
    if against is None:
        from .checkpoint import Checkpoint
        from .run import open_run_checkpoint
        with open_run_checkpoint(d.run) as ckpt_path:
            ckpt = Checkpoint(ckpt_path)
            tensors = ckpt.layer_tensors(d.run["layer"])
            cfg = ckpt.config
        plan = RunPlan(**d.run["plan"])
        expect = reference_stages(cfg, tensors, d.hidden.astype(np.float64), plan)
        label = "the float64 reference"
    else:
        o = load_dump(against)
        _check_same_run(d, o)
        expect = {k: o.tensors[k] for k in o.keys}
        label = str(o.path)
    keys = d.keys
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
