"""Every kind of user mistake, tried as a new user would: each is refused with one line that
names the problem, the right exit code (1, or 2 for usage) and no traceback, and every file
the user had is byte-identical afterwards (nothing overwritten, no temporary left behind).
API misuse (freed objects, bad arguments, memory) raises KdaError before anything happens."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import click
import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from kdarun import DevicePtr, Glm5NextKdaWorkspace, KdaError, KdaSeqState, open_backend, synthetic
from kdarun.backends import cuda_available
from kdarun.checkpoint import INDEX_FILE, LAYER_PREFIXES, canonical, shard_tensors, tensor_name
from kdarun.cli import main
from kdarun.host_backend import HostBackend
from kdarun.loader import load_stack
from kdarun.pool import KdaStatePool
from kdarun.run import RunPlan, random_hidden, run_layer
from kdarun.tp import TpGroup, launch
from kdarun.weights import Glm5NextKdaWeights

KIMI = LAYER_PREFIXES["kimi_linear"]
GLM = LAYER_PREFIXES["glm5_next"]
BF16 = ml_dtypes.bfloat16
RUN = ("--tokens", "4", "--decode-steps", "1", "--backend", "host")  # a short run


# -- the user's files, before and after ------------------------------------------------------

def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every file under `root` by relative path: its bytes (a symbolic link: its target)."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath, name)
            rel = str(p.relative_to(root))
            out[rel] = os.readlink(p) if p.is_symlink() else p.read_bytes()
    return out


def invoke(*args: str) -> click.testing.Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_refused(r: click.testing.Result, code: int, pattern: str) -> None:
    """Exit code `code`, no traceback, and the one error line matching `pattern`."""
    assert r.exit_code == code, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1, r.output
    assert re.search(pattern, errors[0]), errors[0]


# -- checkpoints to spoil -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """Tiny 4-layer checkpoints (layers 0-2 KDA): one file, sharded, GLM-5.3-Flash layout."""
    root = tmp_path_factory.mktemp("made")
    cfg = synthetic.preset_config("tiny", layers=4)
    glm = synthetic.preset_config("tiny", "bounded", layers=4, layout="glm5_next")
    return {"single": synthetic.write_checkpoint(root / "single", cfg, seed=1),
            "sharded": synthetic.write_checkpoint(root / "sharded", cfg, seed=1, shards=2),
            "glm": synthetic.write_checkpoint(root / "glm", glm, seed=1)}


class Case:
    """One bad input: `setup(tmp, made)` lays out the user's files under tmp and returns the
    command's arguments; the command must exit `code` with an error line matching `pattern`."""

    def __init__(self, id_: str, setup: Callable[[Path, dict], list], code: int, pattern: str):
        self.id, self.setup, self.code, self.pattern = id_, setup, code, pattern


def ck(tmp: Path, made: dict, kind: str = "single") -> Path:
    """A copy of a made checkpoint under tmp, to spoil."""
    dst = tmp / "ck"
    shutil.copytree(made[kind], dst)
    return dst


def inspect(c: Path) -> list:
    return ["inspect", c]


def run0(c: Path) -> list:
    return ["layer-run", c, "--layer", "0", *RUN]


def spoiled(edit: Callable[[Path], object], kind: str = "single",
            cmd: Callable[[Path], list] = inspect):
    """A copy of checkpoint `kind` spoiled by `edit(directory)`, given to `cmd`."""
    def setup(tmp, made):
        c = ck(tmp, made, kind)
        edit(c)
        return cmd(c)
    return setup


def with_config(edit: Callable[[dict], object], kind: str = "single"):
    def edit_file(c: Path) -> None:
        cfg = json.loads((c / "config.json").read_text())
        edit(cfg)
        (c / "config.json").write_text(json.dumps(cfg))
    return spoiled(edit_file, kind)


def with_file(name: str, data: bytes, kind: str = "single"):
    return spoiled(lambda c: (c / name).write_bytes(data), kind)


def with_tensors(edit: Callable[[dict], object]):
    def edit_file(c: Path) -> None:
        t = load_file(str(c / "model.safetensors"))
        edit(t)
        save_file(t, str(c / "model.safetensors"))
    return spoiled(edit_file, cmd=run0)


def with_index(edit: Callable[[Path, dict], object], cmd: Callable[[Path], list] = inspect):
    def edit_file(c: Path) -> None:
        doc = json.loads((c / INDEX_FILE).read_text())
        edit(c, doc)
        (c / INDEX_FILE).write_text(json.dumps(doc))
    return spoiled(edit_file, "sharded", cmd)


def lac(edit: Callable[[dict], object]) -> Callable[[dict], object]:
    return lambda cfg: edit(cfg["linear_attn_config"])


def name0(short: str, prefix: str = KIMI) -> str:
    return tensor_name(prefix, 0, short)


def _set(key: str, value):
    return lambda d: d.__setitem__(key, value)


def _poison(name: str, value: float, index=(0, 0)):
    def edit(t):
        a = t[name].astype(np.float32)
        a[index] = value
        t[name] = a.astype(t[name].dtype)
    return edit


def _fp8(name: str):
    return lambda t: t.__setitem__(name, t[name].astype(np.float32).astype(
        ml_dtypes.float8_e4m3fn))


def _both_spellings(t):
    t[name0("forget_gate.A_log")] = t[name0("A_log")]


def _both_prefixes(t):
    for k in [k for k in t if k.startswith(f"{KIMI}0.")]:
        t[GLM + k[len(KIMI):]] = t[k]


def _dir_for(name: str):
    def edit(c: Path) -> None:
        (c / name).unlink()
        (c / name).mkdir()
    return edit


def _truncate(c: Path) -> None:
    f = c / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])


CONFIGS = [
    Case("config-missing", spoiled(lambda c: (c / "config.json").unlink()), 1,
         r"config not found: .*config\.json"),
    Case("config-not-json", with_file("config.json", b"{not json"), 1,
         r"config\.json: not valid JSON"),
    Case("config-binary", with_file("config.json", b"\xff\xfe\x00garbage"), 1,
         "not valid JSON"),
    Case("config-a-list", with_file("config.json", b"[1, 2]"), 1,
         "expected a JSON object, got list"),
    Case("config-a-directory", spoiled(_dir_for("config.json")), 1,
         r"config\.json: cannot be read"),
    Case("config-no-hidden-size", with_config(lambda c: c.pop("hidden_size")), 1,
         "missing field hidden_size"),
    Case("config-hidden-250", with_config(_set("hidden_size", 250)), 1,
         r"hidden_size must be a multiple of 8 .*got 250"),
    Case("config-head-dim-96", with_config(lac(_set("head_dim", 96))), 1,
         r"head_dim must be one of \(64, 128\), got 96"),
    Case("config-heads-a-string", with_config(lac(_set("num_heads", "4"))), 1,
         "num_heads must be a positive integer, got '4'"),
    Case("config-0-based-kda-layers", with_config(lac(_set("kda_layers", [0, 1]))), 1,
         r"kda_layers are 1-based and must lie in \[1, 4\], got \[0\]"),
    Case("config-bool-layer", with_config(lac(_set("kda_layers", [True, 2]))), 1,
         "kda_layers must be a list of 1-based layer numbers"),
    Case("config-lower-bound-7", with_config(lac(_set("gate_lower_bound", -7.0))), 1,
         r"gate_lower_bound must be a number in \[-5, 0\)"),
    Case("config-model-type", with_config(_set("model_type", "llama")), 1,
         "model_type 'llama' is not a KDA model kdarun reads"),
    Case("config-model-type-a-list", with_config(_set("model_type", ["kimi_linear"])), 1,
         r"model_type must be a string, got \['kimi_linear'\]"),
    Case("config-layers-a-string", with_config(_set("num_hidden_layers", "4")), 1,
         r"num_hidden_layers must be an integer in \[1, 65536\], got '4'"),
    Case("config-layers-huge", with_config(
        lambda c: (c["text_config"].__setitem__("num_hidden_layers", 300000000),
                   c["text_config"].pop("layer_types")), "glm"), 1,
         r"text_config\.num_hidden_layers must be an integer in \[1, 65536\], got 300000000"),
    Case("config-eps-a-string", with_config(_set("rms_norm_eps", "1e-5")), 1,
         r"rms_norm_eps must be a number in \(0, 1\)"),
    Case("config-conv-9", with_config(lac(_set("short_conv_kernel_size", 9))), 1,
         r"conv_kernel \(short_conv_kernel_size\) must be in \[2, 8\], got 9"),
    Case("config-layer-types-length", with_config(
        lambda c: c["text_config"]["layer_types"].pop(), "glm"), 1,
        "layer_types must be a list of 4 layer families"),
    Case("config-layer-type-unknown", with_config(
        lambda c: c["text_config"]["layer_types"].__setitem__(3, "sliding"), "glm"), 1,
        r"layer_types\[3\] is 'sliding', expected one of"),
]

WEIGHTS = [
    Case("weight-shape", with_tensors(lambda t: t.__setitem__(
        name0("o_proj.weight"), t[name0("o_proj.weight")][:, :128].copy())), 1,
        r"o_proj.weight has shape \[256, 128\], expected \[256, 256\]"),
    Case("weight-dtype", with_tensors(lambda t: t.__setitem__(
        name0("q_proj.weight"), t[name0("q_proj.weight")].astype(np.float32))), 1,
        "q_proj.weight has dtype F32, expected BF16"),
    Case("weight-missing", with_tensors(lambda t: t.pop(name0("g_b_proj.weight"))), 1,
         r"missing tensor model\.layers\.0\.self_attn\.g_b_proj\.weight"),
    Case("weight-extra-bias", with_tensors(lambda t: t.__setitem__(
        name0("o_proj.bias"), np.ones(256, BF16))), 1, "has tensors kdarun does not implement"),
    Case("weight-nan", with_tensors(_poison(name0("f_a_proj.weight"), np.nan, (2, 5))), 1,
         r"f_a_proj\.weight holds 1 NaN/Inf value\(s\), the first at \[2, 5\]"),
    Case("weight-inf", with_tensors(_poison(name0("dt_bias"), np.inf, (7,))), 1,
         r"dt_bias holds 1 NaN/Inf value\(s\), the first at \[7\]"),
    Case("weight-fp8", with_tensors(_fp8(name0("k_proj.weight"))), 1,
         r"stored as FP8 \(F8_E4M3\), expected BF16"),
    Case("weight-two-spellings", with_tensors(_both_spellings), 1, "mixes tensor spellings"),
    Case("weight-two-prefixes", with_tensors(_both_prefixes), 1,
         "KDA layers' tensors under both"),
    Case("weights-truncated", spoiled(_truncate), 1,
         "model.safetensors: not a readable safetensors file"),
    Case("weights-garbage", with_file("model.safetensors", b"\x00" * 64), 1,
         "not a readable safetensors file"),
    Case("weights-none", spoiled(lambda c: (c / "model.safetensors").unlink()), 1,
         "neither model.safetensors nor model.safetensors.index.json"),
    Case("weights-dangling-link", spoiled(lambda c: ((c / "model.safetensors").unlink(),
                                                     (c / "model.safetensors").symlink_to(
                                                         "../../blobs/abc"))), 1,
         r"model\.safetensors is a symbolic link to \.\./\.\./blobs/abc, which is missing"),
    Case("checkpoint-missing", lambda tmp, made: ["layer-run", tmp / "nope", *RUN], 1,
         r"checkpoint: .*nope does not exist"),
]


def _duplicate_name(c: Path) -> None:
    text = (c / INDEX_FILE).read_text()
    key = name0("A_log")
    shard = json.loads(text)["weight_map"][key]
    (c / INDEX_FILE).write_text(text.replace('"weight_map": {', f'"weight_map": {{"{key}": '
                                             f'"{shard}",', 1))


def _shard(doc: dict, short: str = "q_proj.weight") -> str:
    return doc["weight_map"][name0(short)]


def _copy_into_other_shard(c: Path, doc: dict) -> None:
    name = name0("q_proj.weight")
    here = _shard(doc)
    other = next(s for s in set(doc["weight_map"].values()) if s != here)
    t = load_file(str(c / other))
    t[name] = load_file(str(c / here))[name]
    save_file(t, str(c / other))


def _drop_from_shard(c: Path, doc: dict) -> None:
    f = c / _shard(doc)
    t = load_file(str(f))
    t.pop(name0("q_proj.weight"))
    save_file(t, str(f))


def _dangling_link(c: Path, doc: dict) -> None:
    f = c / _shard(doc)
    f.unlink()
    f.symlink_to("../../blobs/0123")


INDEXES = [
    Case("index-not-json", with_file(INDEX_FILE, b"{", "sharded"), 1,
         "model.safetensors.index.json: not a readable JSON file"),
    Case("index-a-list", with_file(INDEX_FILE, b"[]", "sharded"), 1,
         "expected a JSON object with a weight_map, got list"),
    Case("index-no-weight-map", with_index(lambda c, d: d.pop("weight_map")), 1,
         "weight_map must be a non-empty object"),
    Case("index-shard-a-number", with_index(
        lambda c, d: d["weight_map"].__setitem__(name0("A_log"), 3)), 1,
        r"weight_map\['model\.layers\.0\.self_attn\.A_log'\] must be a shard file name, got 3"),
    Case("index-shard-outside", with_index(
        lambda c, d: d["weight_map"].__setitem__(name0("A_log"), "../other/x.safetensors")), 1,
        r"is '\.\./other/x\.safetensors', outside the checkpoint directory"),
    Case("index-shard-absolute", with_index(
        lambda c, d: d["weight_map"].__setitem__(name0("A_log"), "/etc/x.safetensors")), 1,
        "outside the checkpoint directory"),
    Case("index-duplicate-name", spoiled(_duplicate_name, "sharded"), 1,
         "listed more than once"),
    Case("index-tensor-in-two-shards", with_index(_copy_into_other_shard), 1,
         r"self_attn\.q_proj\.weight is stored in both model-0000\d-of-00002\.safetensors and"),
    Case("index-beside-single-file", with_file("model.safetensors", b"stale", "sharded"), 1,
         r"holds both model\.safetensors and model\.safetensors\.index\.json; .*ambiguous"),
    Case("index-shard-missing", with_index(lambda c, d: (c / _shard(d)).unlink()), 1,
         r"checkpoint shard missing: .*model-00001-of-00002\.safetensors"),
    Case("index-shard-dangling-link", with_index(_dangling_link), 1,
         r"a symbolic link to \.\./\.\./blobs/0123, which is missing"),
    Case("index-points-at-wrong-shard", with_index(_drop_from_shard, run0), 1,
         r"missing tensor model\.layers\.0\.self_attn\.q_proj\.weight \(the index points "
         r"here\)"),
]


def with_input(make: Callable[[Path], object], name: str = "h.npy", *extra: str):
    def setup(tmp, made):
        make(tmp / name)
        return ["layer-run", made["single"], "--input", tmp / name, *extra]
    return setup


def _fp8_file(name: str) -> bytes:
    """A safetensors file's bytes holding `name` [10, 256] as FP8, which NumPy cannot read."""
    from safetensors.numpy import save
    return save({name: _rows(10).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)})


def _npy(array) -> Callable[[Path], object]:
    return lambda p: np.save(p, array) if p.suffix == ".npy" else p.write_bytes(array)


def _rows(n: int, width: int = 256, dtype=np.float32, bad: float | None = None, at: int = 0):
    a = np.random.default_rng(0).standard_normal((n, width)).astype(dtype)
    if bad is not None:
        a[at, 3] = bad
    return a


INPUTS = [
    Case("input-garbage-npy", with_input(lambda p: p.write_bytes(b"not an npy file")), 1,
         r"h\.npy: not a \.npy file \(no \.npy header"),
    Case("input-truncated-npy", with_input(lambda p: (np.save(p, _rows(10)), p.write_bytes(
        p.read_bytes()[:200]))), 1, r"h\.npy: not a readable \.npy file"),
    Case("input-pickled-npy", with_input(lambda p: np.save(p, np.array([{}, 1], object))), 1,
         "not a readable .npy file"),
    Case("input-npz-as-npy", with_input(lambda p: np.savez(open(p, "wb"), a=_rows(4))), 1,
         "not a .npy file"),
    Case("input-width", with_input(_npy(_rows(10, 100))), 1,
         r"hidden states must be \[N, 256\], got \[10, 100\]"),
    Case("input-3d", with_input(_npy(np.zeros((2, 10, 256), np.float32))), 1,
         r"must be \[N, 256\], got \[2, 10, 256\]"),
    Case("input-ints", with_input(_npy(np.zeros((10, 256), np.int32))), 1,
         r"hidden states must be bf16, float16, float32 or float64 \(either byte order\), got "
         "int32"),
    Case("input-fp8-safetensors", with_input(lambda p: p.write_bytes(_fp8_file("hidden")),
                                             "h.safetensors"), 1,
         "hidden states must be one of BF16, F16, F32, F64, got 'hidden' as F8_E4M3"),
    Case("input-nan-row", with_input(_npy(_rows(10, bad=np.nan, at=6))), 1,
         r"1 row\(s\) hold NaN/Inf \(as bf16\), the first \[6\]"),
    Case("input-beyond-bf16", with_input(_npy(_rows(10, dtype=np.float64, bad=1e39, at=2))), 1,
         r"row\(s\) hold NaN/Inf \(as bf16\), the first \[2\]"),
    Case("input-garbage-safetensors", with_input(lambda p: p.write_bytes(b"\x08" + b"\x00" * 20),
                                                 "h.safetensors"), 1,
         "h.safetensors: not a readable safetensors file"),
    Case("input-two-tensors", with_input(lambda p: save_file({"a": _rows(4), "b": _rows(4)},
                                                             str(p)), "h.safetensors"), 1,
         r"expected a tensor named 'hidden' or a single tensor, found 2: a, b$"),
    Case("input-suffix", with_input(lambda p: p.write_text("1 2 3"), "h.txt"), 1,
         "input must be .npy or .safetensors"),
    Case("input-too-few-rows", with_input(_npy(_rows(10)), "h.npy", "--tokens", "20"), 1,
         r"holds 10 rows; the run takes 24 \(prefill 20 \+ decode steps 4 \+ k 0\)"),
    Case("input-fewer-rows-than-decodes", with_input(_npy(_rows(3)), "h.npy", "--k", "2"), 1,
         "holds 3 rows, fewer than --decode-steps 4 and --k 2 take"),
    Case("input-missing", lambda tmp, made: ["layer-run", "--input", tmp / "nope.npy"], 2,
         "does not exist"),
]


def _out_args(tmp: Path, made: dict, output, *extra) -> list:
    return ["layer-run", made["single"], *RUN, "--output", output, *extra]


def _existing(tmp: Path, name: str, data: bytes = b"precious") -> Path:
    (tmp / name).write_bytes(data)
    return tmp / name


def _output_over_input(tmp: Path, made: dict) -> list:
    np.save(tmp / "in.npy", _rows(5))
    return ["layer-run", made["single"], "--input", tmp / "in.npy", "--decode-steps", "1",
            "--backend", "host", "--output", tmp / "in.npy", "--force"]


def _output_link_to_input(tmp: Path, made: dict) -> list:
    args = _output_over_input(tmp, made)
    (tmp / "link.npy").symlink_to(tmp / "in.npy")
    return args[:-2] + [tmp / "link.npy", "--force"]


def _output_over_checkpoint(tmp: Path, made: dict) -> list:
    c = ck(tmp, made)
    return ["layer-run", c, *RUN, "--output", c / "model.safetensors", "--force"]


def _dump_setup(extra_file: str | None = None, force: bool = True):
    def setup(tmp, made):
        d = tmp / "dump"
        d.mkdir()
        (d / "manifest.json").write_text('{"mine": true}')
        if extra_file:
            (d / extra_file).write_text("notes")
        return ["layer-run", made["single"], *RUN, "--dump-stages", d,
                *(["--force"] if force else [])]
    return setup


def _dump_holding_input(tmp: Path, made: dict) -> list:
    """An input named as a dump's tensors file, in the directory the dump would replace."""
    (tmp / "d").mkdir()
    save_file({"hidden": _rows(5).astype(BF16)}, str(tmp / "d/stages.safetensors"))
    return ["layer-run", made["single"], "--input", tmp / "d/stages.safetensors",
            "--decode-steps", "1", "--backend", "host", "--dump-stages", tmp / "d", "--force"]


def _make_over(kind: str, *extra: str):
    def setup(tmp, made):
        return ["make-checkpoint", ck(tmp, made, kind), "--layers", "4", "--seed", "7", *extra]
    return setup


def _make_into_foreign(tmp: Path, made: dict) -> list:
    c = ck(tmp, made)
    (c / "tokenizer.json").write_text("{}")
    return ["make-checkpoint", c, "--layers", "4", "--force"]


OUTPUTS = [
    Case("output-over-checkpoint", _output_over_checkpoint, 1,
         r"would overwrite the checkpoint's file .*model\.safetensors; .*not even --force"),
    Case("output-over-input", _output_over_input, 1, r"would overwrite the input .*in\.npy"),
    Case("output-empty", lambda tmp, made: ["layer-run", *RUN, "--output", ""], 2,
         "'--output': an empty path names nothing"),
    Case("dump-empty", lambda tmp, made: ["layer-run", *RUN, "--dump-stages", ""], 2,
         "'--dump-stages': an empty path names nothing"),
    Case("output-link-to-input", _output_link_to_input, 1, "would overwrite the input"),
    Case("output-exists", lambda tmp, made: _out_args(tmp, made, _existing(tmp, "o.npy")), 1,
         r"output .*o\.npy exists; pass --force"),
    Case("output-missing-directory", lambda tmp, made: _out_args(tmp, made, tmp / "no/o.npy"), 1,
         r"its directory .*/no does not exist"),
    Case("output-under-a-file", lambda tmp, made: _out_args(
        tmp, made, _existing(tmp, "f.txt") / "o.npy"), 1, r"f\.txt is not a directory"),
    Case("output-suffix", lambda tmp, made: _out_args(tmp, made, tmp / "o.txt"), 1,
         r"output .*o\.txt: must end in \.npy or \.safetensors"),
    Case("output-a-directory", lambda tmp, made: _out_args(tmp, made, tmp), 2,
         "is a directory"),
    Case("output-in-dump", lambda tmp, made: _out_args(tmp, made, tmp / "d/o.npy",
                                                       "--dump-stages", tmp / "d"), 1,
         "lies in the --dump-stages directory"),
    Case("output-is-the-dump", lambda tmp, made: _out_args(tmp, made, tmp / "d.npy",
                                                           "--dump-stages", tmp / "d.npy"), 1,
         "lies in the --dump-stages directory"),
    Case("dump-over-dump", _dump_setup(force=False), 1,
         r"stage dump .*dump exists and holds manifest\.json; pass --force"),
    Case("dump-over-foreign", _dump_setup("notes.txt"), 1,
         r"holds notes\.txt, which a stage dump does not write"),
    Case("dump-into-checkpoint", spoiled(lambda c: None, cmd=lambda c: [
        "layer-run", c, *RUN, "--dump-stages", c, "--force"]), 1,
        r"stage dump .* holds the checkpoint's file .*config\.json"),
    Case("dump-holding-input", _dump_holding_input, 1,
         r"stage dump .*/d holds the input .*d/stages\.safetensors"),
    Case("dump-a-file", lambda tmp, made: ["layer-run", "--dump-stages",
                                           _existing(tmp, "f.txt")], 2, "is a file"),
    Case("make-over-checkpoint", _make_over("single"), 1,
         r"checkpoint .*ck exists and holds config\.json, model\.safetensors; pass --force"),
    Case("make-over-sharded", _make_over("sharded"), 1, "exists and holds config.json"),
    Case("make-over-foreign", _make_into_foreign, 1,
         r"holds tokenizer\.json, which a checkpoint does not write"),
    Case("make-under-a-file", lambda tmp, made: [
        "make-checkpoint", _existing(tmp, "f.txt") / "ck", "--layers", "4"], 1,
        r"f\.txt is not a directory"),
    Case("make-missing-parent", lambda tmp, made: [
        "make-checkpoint", tmp / "a/b/ck", "--layers", "4"], 1, "does not exist"),
    Case("make-a-file", lambda tmp, made: ["make-checkpoint", _existing(tmp, "f.txt")], 2,
         "is a file"),
]


# -- dumps --------------------------------------------------------------------------------------

def make_dump(tmp: Path, made: dict, name: str = "dump", *extra: str) -> tuple[Path, Path]:
    """A fresh dump of a copy of the single-file checkpoint: (dump, checkpoint)."""
    c = tmp / "ck" if (tmp / "ck").exists() else ck(tmp, made)
    d = tmp / name
    r = invoke("layer-run", c, "--tokens", "6", "--decode-steps", "1", "--k", "2", "--backend",
               "host", "--dump-stages", d, *extra)
    assert r.exit_code == 0, r.output
    return d, c


def with_manifest(edit: Callable[[dict], object]):
    def setup(tmp, made):
        d, _ = make_dump(tmp, made)
        m = json.loads((d / "manifest.json").read_text())
        edit(m)
        (d / "manifest.json").write_text(json.dumps(m))
        return ["stages", d, "--reference"]
    return setup


def with_dump(edit: Callable[[Path, Path], object], *args: str):
    def setup(tmp, made):
        d, c = make_dump(tmp, made)
        edit(d, c)
        return ["stages", d, *(args or ("--reference",))]
    return setup


def _reseed(d: Path, c: Path) -> None:
    synthetic.write_checkpoint(c, synthetic.preset_config("tiny", layers=4), seed=2, force=True)


def _regate(d: Path, c: Path) -> None:
    synthetic.write_checkpoint(c, synthetic.preset_config("tiny", "bounded", layers=4), seed=1,
                               force=True)


def _relayout(d: Path, c: Path) -> None:
    synthetic.write_checkpoint(c, synthetic.preset_config("tiny", layers=4, layout="glm5_next"),
                               seed=1, force=True)


def _tensors_file(d: Path, edit: Callable[[dict], object]) -> None:
    t = load_file(str(d / "stages.safetensors"))
    edit(t)
    save_file(t, str(d / "stages.safetensors"))


def _against(edit_other: Callable[[Path, Path], object] | None, *extra: str):
    def setup(tmp, made):
        d, c = make_dump(tmp, made)
        if edit_other is not None:
            edit_other(d, c)
        o, _ = make_dump(tmp, made, "other", *extra)
        return ["stages", d, "--against", o]
    return setup


DUMPS = [
    Case("dump-no-manifest", lambda tmp, made: ["stages", tmp, "--reference"], 1,
         "no manifest.json"),
    Case("dump-manifest-not-json", with_dump(lambda d, c: (d / "manifest.json").write_text("{")),
         1, "corrupt manifest.json"),
    Case("dump-old-format", with_manifest(_set("format", 1)), 1,
         "format 1, this kdarun reads format 2"),
    Case("dump-stages-not-a-list", with_manifest(_set("stages", 5)), 1,
         "stages must be a list, got 5"),
    Case("dump-stage-no-key", with_manifest(lambda m: m["stages"][0].pop("key")), 1,
         r"stages\[0\]\.key must be a string"),
    Case("dump-stage-unknown-buffer", with_manifest(
        lambda m: m["stages"][0].__setitem__("key", "prefill/nope")), 1,
        r"stages\[0\]\.key must be a new <call>/<buffer> of a known buffer"),
    Case("dump-plan-negative", with_manifest(lambda m: m["run"]["plan"].__setitem__("k", -1)), 1,
         "run.plan must be"),
    Case("dump-no-fingerprint", with_manifest(lambda m: m.pop("fingerprint")), 1,
         "fingerprint must be an object"),
    Case("dump-config-corrupt", with_manifest(
        lambda m: m["run"]["config"].__setitem__("hidden_size", 250)), 1,
        r"corrupt manifest\.json: run\.config .*hidden_size must be a multiple of 8"),
    Case("dump-checkpoint-field", with_manifest(lambda m: m["run"].__setitem__("checkpoint", 3)),
         1, "run.checkpoint must be an object"),
    Case("dump-tensors-missing", with_dump(lambda d, c: (d / "stages.safetensors").unlink()), 1,
         "stages.safetensors is missing"),
    Case("dump-tensors-garbage", with_dump(
        lambda d, c: (d / "stages.safetensors").write_bytes(b"\x00" * 16)), 1,
        "stages.safetensors is not readable"),
    Case("dump-stage-shape", with_dump(lambda d, c: _tensors_file(
        d, lambda t: t.__setitem__("prefill/core", t["prefill/core"][:2].copy()))), 1,
        "stage prefill/core is .* the manifest says"),
    Case("dump-input-changed", with_dump(lambda d, c: _tensors_file(
        d, lambda t: t.__setitem__("input.hidden", -t["input.hidden"]))), 1,
        "does not match the manifest's checksum"),
    Case("dump-checkpoint-reseeded", with_dump(_reseed), 1,
         r"the checkpoint changed since this dump .*: layer 0's weights differ"),
    Case("dump-checkpoint-relayout", with_dump(_relayout), 1,
         r"the checkpoint changed since this dump .*: its config differs \(layout kimi_linear -> "
         r"glm5_next: its fields moved"),
    Case("dump-checkpoint-regated", with_dump(_regate), 1,
         r"the checkpoint changed since this dump .*: its config differs \(linear_attn_config"
         r"\.gate_lower_bound: 'absent' -> -5\.0\)"),
    Case("dump-checkpoint-gone", with_dump(lambda d, c: shutil.rmtree(c)), 1,
         "is not there any more"),
    Case("dump-against-other-weights", _against(_reseed), 1, "ran on different weights"),
    Case("dump-against-other-plan", _against(None, "--tokens", "5"), 1,
         "different runs: plan"),
    Case("dump-only-unknown", with_dump(lambda d, c: None, "--reference", "--only", "nope"), 1,
         r"unknown stage name\(s\) \['nope'\]"),
    Case("dump-neither-mode", with_dump(lambda d, c: None, "--only", "core"), 2,
         "pass exactly one of --against OTHER_DIR or --reference"),
    Case("dump-both-modes", with_dump(lambda d, c: None, "--reference", "--against", "."), 2,
         "exactly one of"),
]

NUMBERS = [
    Case("tokens-negative", lambda tmp, made: ["layer-run", "--tokens", "-1"], 2,
         r"'--tokens': -1 is not in the range 0<=x<=2147483647"),
    Case("tokens-not-a-number", lambda tmp, made: ["layer-run", "--tokens", "1e3"], 2,
         "'1e3' is not a valid integer"),
    Case("tokens-past-int64", lambda tmp, made: ["layer-run", "--tokens", str(10**20)], 2,
         r"'--tokens': 100000000000000000000 is not in the range 0<=x<=2147483647"),
    Case("decode-steps-past-int32", lambda tmp, made: ["layer-run", "--decode-steps",
                                                        str(2**31)], 2,
         r"'--decode-steps': 2147483648 is not in the range 0<=x<=2147483647"),
    Case("decode-steps-negative", lambda tmp, made: ["layer-run", "--decode-steps", "-1"], 2,
         "--decode-steps"),
    Case("k-9", lambda tmp, made: ["layer-run", "--k", "9"], 2,
         r"'--k': 9 is not in the range 0<=x<=8"),
    Case("seed-negative", lambda tmp, made: ["layer-run", "--seed", "-1"], 2, "--seed"),
    Case("layer-attention", lambda tmp, made: ["layer-run", "--layer", "3"], 1,
         r"--layer 3 is not a KDA layer of the built-in demo checkpoint .*\[0, 1, 2\]"),
    Case("layer-negative", lambda tmp, made: ["layer-run", "--layer", "-1"], 1,
         "--layer -1 is not a KDA layer"),
    Case("layer-past-the-stack", lambda tmp, made: ["layer-run", "--layer", "99"], 1,
         "--layer 99 is not a KDA layer"),
    Case("no-tokens", lambda tmp, made: ["layer-run", "--tokens", "0", "--decode-steps", "0"],
         1, "at least one token"),
    Case("tokens-a-billion", lambda tmp, made: ["layer-run", "--tokens", "1000000000",
                                                "--backend", "host"], 1,
         r"a workspace of 1000000000 tokens needs [\d.]+ GiB of device memory, but CPU "
         r"\(NumPy\) has [\d.]+ GiB free"),
    Case("tokens-a-billion-tp", lambda tmp, made: ["layer-run", "--tokens", "1000000000",
                                                   "--backend", "host", "--tp", "2"], 1,
         r"2 tp rank\(s\) of layer 0 with a workspace of 1000000000 tokens needs [\d.]+ GiB of "
         r"device memory, but CPU \(NumPy\) has [\d.]+ GiB free"),
    Case("backend-unknown", lambda tmp, made: ["layer-run", "--backend", "tpu"], 2,
         "'tpu' is not one of"),
    Case("layers-0", lambda tmp, made: ["make-checkpoint", tmp / "c", "--layers", "0"], 2,
         r"'--layers': 0 is not in the range 1<=x<=1024"),
    Case("layers-huge", lambda tmp, made: ["make-checkpoint", tmp / "c", "--layers", "10**6"],
         2, "is not a valid integer"),
    Case("layers-million", lambda tmp, made: ["make-checkpoint", tmp / "c", "--layers",
                                              "1000000"], 2, "not in the range 1<=x<=1024"),
    Case("shards-0", lambda tmp, made: ["make-checkpoint", tmp / "c", "--shards", "0"], 2,
         "--shards"),
    Case("shards-past-layers", lambda tmp, made: ["make-checkpoint", tmp / "c", "--layers",
                                                  "4", "--shards", "5"], 1,
         r"shards \(one layer a shard at most, 4 layers\) must be an integer in \[1, 4\], "
         r"got 5"),
    Case("lower-bound-7", lambda tmp, made: ["make-checkpoint", tmp / "c", "--gate", "bounded",
                                             "--lower-bound", "-7"], 2,
         r"'--lower-bound': -7\.0 is not in the range -5\.0<=x<0\.0"),
    Case("lower-bound-0", lambda tmp, made: ["make-checkpoint", tmp / "c", "--gate", "bounded",
                                             "--lower-bound", "0"], 2, "not in the range"),
    Case("lower-bound-softplus", lambda tmp, made: ["make-checkpoint", tmp / "c",
                                                    "--lower-bound", "-3"], 2,
         "--lower-bound applies to the bounded gate, and the gate is softplus"),
    Case("make-seed-negative", lambda tmp, made: ["make-checkpoint", tmp / "c", "--seed", "-2"],
         2, "--seed"),
    Case("preset-unknown", lambda tmp, made: ["make-checkpoint", tmp / "c", "--preset", "big"],
         2, "'big' is not one of"),
    Case("bench-tokens-list", lambda tmp, made: ["bench", "--tokens", "64,x"], 2,
         "expected comma-separated integers, got '64,x'"),
    Case("bench-batch-0", lambda tmp, made: ["bench", "--batch", "0,8"], 2,
         "expected positive integers"),
    Case("bench-k-0", lambda tmp, made: ["bench", "--k", "0"], 2, "not in the range 1<=x<=8"),
]

TP = [
    Case("tp-0", lambda tmp, made: ["layer-run", "--tp", "0"], 2,
         r"'--tp': 0 is not in the range x>=1"),
    Case("tp-not-dividing-heads", lambda tmp, made: ["layer-run", *RUN, "--tp", "3"], 1,
         r"num_heads 4 is not divisible by tp_size 3; .*\(divisors of 4: \[1, 2, 4\]\)"),
    Case("tp-past-the-heads", lambda tmp, made: ["layer-run", made["glm"], *RUN, "--tp", "8"], 1,
         "num_heads 4 is not divisible by tp_size 8"),
    Case("tp-with-batch", lambda tmp, made: ["layer-run", *RUN, "--tp", "2", "--batch", "2"], 2,
         "the serving run of --batch is not tensor parallel"),
    Case("tp-with-dump", lambda tmp, made: ["layer-run", *RUN, "--tp", "2", "--dump-stages",
                                            tmp / "d"], 2, "dump with --tp 1"),
    Case("tp-nccl-on-host", lambda tmp, made: ["layer-run", *RUN, "--tp", "2", "--tp-mode",
                                               "nccl"], 2,
         "--tp-mode nccl runs on CUDA GPUs; the backend is host"),
    Case("tp-mode-unknown", lambda tmp, made: ["layer-run", "--tp", "2", "--tp-mode", "mpi"], 2,
         "'mpi' is not one of"),
    Case("bench-tp-prefill", lambda tmp, made: ["bench", "--tp", "2", "--mode", "prefill"], 2,
         "--tp times decode and decode-k; got --mode prefill"),
    Case("bench-tp-not-dividing-heads", lambda tmp, made: ["bench", "--tp", "3"], 1,
         "num_heads 32 is not divisible by tp_size 3"),
    Case("bench-tp-nccl-too-few-gpus",  # 64 ranks: more GPUs than any one host here has
         lambda tmp, made: ["bench", "--preset", "glm-5.3-flash", "--tp", "64", "--tp-mode",
                            "nccl"], 1,
         r"--tp 64 over NCCL needs 64 GPUs, one a rank, but \d+ (is|are) visible; .*in-turn"),
]

CASES = CONFIGS + WEIGHTS + INDEXES + INPUTS + OUTPUTS + DUMPS + NUMBERS + TP


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_and_changes_nothing(case: Case, made, tmp_path):
    args = case.setup(tmp_path, made)
    before, made_before = snapshot(tmp_path), {k: snapshot(p) for k, p in made.items()}
    r = invoke(*args)
    assert_refused(r, case.code, case.pattern)
    assert snapshot(tmp_path) == before, "the user's files changed"
    assert {k: snapshot(p) for k, p in made.items()} == made_before


def test_the_suite_covers_every_class():
    classes = {"configs": CONFIGS, "weights": WEIGHTS, "indexes": INDEXES, "inputs": INPUTS,
               "outputs": OUTPUTS, "dumps": DUMPS, "numbers": NUMBERS, "tp": TP}
    assert all(len(c) >= 5 for c in classes.values()) and len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


def test_output_into_a_read_only_directory(made, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if _writable(ro):  # root writes anywhere but in /sys
        ro = Path("/sys")
        if not ro.is_dir() or _writable(ro):
            pytest.skip("no directory this process cannot write in")
    before = snapshot(tmp_path)
    r = invoke("layer-run", made["single"], *RUN, "--output", ro / "o.npy")
    assert_refused(r, 1, rf"output {ro}/o\.npy: cannot write in {ro} \(")
    assert snapshot(tmp_path) == before


def _writable(d: Path) -> bool:
    try:
        (d / ".kdarun-probe").touch()
    except OSError:
        return False
    (d / ".kdarun-probe").unlink()
    return True


@pytest.mark.skipif(cuda_available(), reason="a CUDA device is present")
@pytest.mark.parametrize("args", [["bench"], ["bench", "--tp", "2"], ["layer-run", "--backend", "cuda"]])
def test_no_cuda_device(args):
    assert_refused(invoke(*args), 1, "no usable CUDA device")


# -- the numbered defects, each end to end --------------------------------------------------

def test_stale_index_beside_a_new_single_file_is_refused(tmp_path):
    """make-checkpoint over a sharded checkpoint used to leave its index beside the new
    model.safetensors, and the index's stale weights loaded with the new config."""
    x = tmp_path / "X"
    assert invoke("make-checkpoint", x, "--layers", "4", "--shards", "2").exit_code == 0
    shutil.copy(x / INDEX_FILE, tmp_path / "index")
    r = invoke("make-checkpoint", x, "--layers", "4", "--seed", "7", "--gate", "bounded",
               "--force")
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(x)) == ["config.json", "model.safetensors"]  # nothing stale
    shutil.copy(tmp_path / "index", x / INDEX_FILE)  # the mix the old writer left
    for args in (["inspect", x], ["layer-run", x, *RUN]):
        assert_refused(invoke(*args), 1, "holds both model.safetensors and "
                                         r"model\.safetensors\.index\.json")


def test_interrupted_make_checkpoint_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """Ctrl-C in the middle of writing over a checkpoint leaves the old one whole, and no
    temporary directory behind."""
    x = tmp_path / "X"
    synthetic.write_checkpoint(x, synthetic.preset_config("tiny", layers=4), shards=2)
    before = snapshot(tmp_path)
    real, calls = synthetic.synth_layer_tensors, []

    def interrupted(cfg, rng):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(cfg, rng)
    monkeypatch.setattr(synthetic, "synth_layer_tensors", interrupted)
    r = invoke("make-checkpoint", x, "--layers", "4", "--seed", "7", "--gate", "bounded",
               "--force")
    assert r.exit_code == 1 and "Aborted" in r.output and len(calls) == 2
    assert snapshot(tmp_path) == before


def test_make_checkpoint_force_replaces_the_whole_checkpoint(tmp_path):
    x = tmp_path / "X"
    assert invoke("make-checkpoint", x, "--layers", "4", "--shards", "2").exit_code == 0
    r = invoke("make-checkpoint", x, "--layers", "8", "--seed", "3", "--force")
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(x)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["X"]  # no temporary or old copy left
    fresh = synthetic.write_checkpoint(tmp_path / "fresh", synthetic.preset_config(
        "tiny", layers=8), seed=3)
    assert snapshot(x) == snapshot(fresh)


def test_layer_run_output_never_destroys_the_checkpoint(made, tmp_path):
    c = ck(tmp_path, made)
    before = snapshot(c)
    for force in ([], ["--force"]):
        r = invoke("layer-run", c, *RUN, "--output", c / "model.safetensors", *force)
        assert_refused(r, 1, "would overwrite the checkpoint's file")
    assert snapshot(c) == before


def test_stages_says_the_checkpoint_changed_instead_of_blaming_a_kernel(made, tmp_path):
    d, c = make_dump(tmp_path, made)
    assert invoke("stages", d, "--reference").exit_code == 0
    _reseed(d, c)
    r = invoke("stages", d, "--reference")
    assert_refused(r, 1, "the checkpoint changed since this dump")
    assert "first at" not in r.output and "FAIL" not in r.output


def test_dump_over_an_older_dump_needs_force(made, tmp_path):
    d, _ = make_dump(tmp_path, made)
    manifest = (d / "manifest.json").read_bytes()
    assert_refused(invoke("layer-run", made["single"], *RUN, "--dump-stages", d), 1,
                   "exists and holds manifest.json, stages.safetensors; pass --force")
    assert (d / "manifest.json").read_bytes() == manifest
    r = invoke("layer-run", made["single"], *RUN, "--dump-stages", d, "--force")
    assert r.exit_code == 0, r.output
    assert json.loads((d / "manifest.json").read_text())["run"]["plan"]["prefill"] == 4


def test_dumps_are_readable_as_the_umask_allows(made, tmp_path):
    """Every file of a dump takes the mode a plain write would (0666 less the umask), so a dump
    made by one user can be compared by another; safetensors alone writes 0600."""
    d, _ = make_dump(tmp_path, made)
    mask = os.umask(0)
    os.umask(mask)
    for f in d.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, f


def test_a_dump_path_that_is_a_link_is_refused_before_the_run(made, tmp_path):
    """A --dump-stages symlink is refused up front, even with --force: the dump is renamed into
    place whole, which would replace the link and leave its target's old dump."""
    d, _ = make_dump(tmp_path, made)
    link = tmp_path / "link"
    link.symlink_to(d)
    manifest = (d / "manifest.json").read_bytes()
    assert_refused(invoke("layer-run", made["single"], *RUN, "--dump-stages", link, "--force"),
                   1, "is a symbolic link")
    assert link.is_symlink() and (d / "manifest.json").read_bytes() == manifest


# -- NaN and strict JSON --------------------------------------------------------------------

def test_json_is_strict_when_a_stage_is_nan(made, tmp_path):
    d, _ = make_dump(tmp_path, made)

    def nan(t):
        a = t["prefill/core"].copy()
        a.reshape(-1)[5] = np.nan
        t["prefill/core"] = a
    _tensors_file(d, nan)
    r = invoke("stages", d, "--reference", "--json")
    assert r.exit_code == 1

    def refuse(const):
        raise AssertionError(f"bare {const} in --json output")
    table = json.loads(r.stdout, parse_constant=refuse)
    row = next(x for x in table["rows"] if x["key"] == "prefill/core")
    assert row["rel"] is None and row["nonfinite"] == 1 and table["first_failure"] == row["key"]


# -- the command line itself ------------------------------------------------------------------

def test_every_option_has_help_and_the_readme_lists_it():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    synopsis = readme.split("## Command line", 1)[1].split("```")[1]
    for cmd in [main, *main.commands.values()]:
        for param in cmd.params:
            if isinstance(param, click.Option):
                assert param.help, f"{cmd.name} {param.opts[0]} has no help"
                for opt in param.opts + param.secondary_opts:
                    if opt.startswith("--"):
                        assert opt in synopsis, f"README synopsis lacks {cmd.name} {opt}"


def test_version_and_debug():
    r = invoke("--version")
    assert r.exit_code == 0 and r.output.startswith("kdarun, version ")
    r = invoke("--debug", "layer-run", "--layer", "3")
    assert isinstance(r.exception, KdaError) and "--layer 3 is not a KDA layer" in str(
        r.exception)


# -- API misuse ---------------------------------------------------------------------------------

@pytest.fixture
def bound(made):
    """A host backend of its own, a stack of layer 0 and a zero state."""
    gpu = HostBackend()
    stack = load_stack(gpu, made["single"], 16, [0])
    return gpu, stack, KdaSeqState(gpu, stack.cfg)


def _decode(gpu, stack, state, ws=None):
    h = gpu.upload(random_hidden(1, stack.cfg.hidden_size, 0))
    stack.layer(0).decode(gpu, h, state, ws or stack.workspace, 0)


def test_freed_state_refuses_use_and_a_second_free(bound):
    gpu, stack, state = bound
    _decode(gpu, stack, state)
    state.free()
    other = KdaSeqState(gpu, stack.cfg)  # may reuse the freed memory
    with pytest.raises(KdaError, match="KdaSeqState was freed: its (recurrent|conv) cannot be "
                                       "used"):
        _decode(gpu, stack, state)
    with pytest.raises(KdaError, match="KdaSeqState was freed"):
        state.download()
    with pytest.raises(KdaError, match=r"KdaSeqState\.free\(\): already freed"):
        state.free()
    assert not other.download()[0].any()  # the other state is untouched
    other.free()


def test_freed_pool_and_its_slot_states_refuse_use(bound):
    gpu, stack, _ = bound
    pool = KdaStatePool(gpu, stack.cfg, 3)
    slot = pool.state(1)
    _decode(gpu, stack, slot)
    pool.free()
    with pytest.raises(KdaError, match="KdaStatePool was freed"):
        _decode(gpu, stack, slot)
    with pytest.raises(KdaError, match=r"KdaStatePool\.state: the KdaStatePool was freed"):
        pool.state(0)
    with pytest.raises(KdaError, match="KdaStatePool.*was freed"):
        pool.download(0)
    table = gpu.upload(np.zeros(1, np.int32))
    with pytest.raises(KdaError, match="KdaStatePool was freed"):
        stack.layer(0).decode_batch(gpu, gpu.upload(random_hidden(1, 256, 0)), 1, table, pool,
                                    stack.workspace, 0)
    with pytest.raises(KdaError, match="already freed"):
        pool.free()


def test_freed_workspace_and_stack_refuse_use(bound):
    gpu, stack, state = bound
    ws = Glm5NextKdaWorkspace(gpu, stack.cfg, 8)
    ws.free()
    with pytest.raises(KdaError, match=r"Glm5NextKdaWorkspace\.ptr\('gate_in'\): the "
                                       "Glm5NextKdaWorkspace was freed"):
        _decode(gpu, stack, state, ws)
    with pytest.raises(KdaError, match="Glm5NextKdaWorkspace was freed"):
        ws.read("final_out", 1)
    with pytest.raises(KdaError, match="already freed"):
        ws.free()
    layer = stack.layer(0)
    stack.free(gpu)
    with pytest.raises(KdaError, match="KdaStack was freed: its layers"):
        stack.layer(0)
    with pytest.raises(KdaError, match="Glm5NextKdaWeights was freed"):
        layer.decode(gpu, gpu.upload(random_hidden(1, 256, 0)), state, ws, 0)
    with pytest.raises(KdaError, match=r"KdaStack\.free\(\): already freed"):
        stack.free(gpu)
    with pytest.raises(KdaError, match=r"Glm5NextKdaWeights\.free\(\): already freed"):
        layer.weights.free(gpu)


@pytest.mark.parametrize("make, pattern", [
    (lambda: DevicePtr(-16), r"DevicePtr: a device address must be a non-negative integer, "
                             "got -16"),
    (lambda: DevicePtr(1.5), "must be a non-negative integer, got 1.5"),
    (lambda: DevicePtr("0x10"), "got '0x10'"),
    (lambda: DevicePtr(256) + 1.5, r"DevicePtr offset from DevicePtr\(0x100\): the byte count "
                                   "must be an integer, got 1.5"),
    (lambda: DevicePtr(256) + -512, "must be a non-negative integer, got -256"),
])
def test_device_ptr_refuses_bad_addresses(make, pattern):
    with pytest.raises(KdaError, match=pattern):
        make()
    assert DevicePtr(256) + np.int64(16) == 272 and DevicePtr(0).is_null


def _cfg():
    return synthetic.preset_config("tiny", layers=4)


@pytest.mark.parametrize("call, pattern", [
    (lambda gpu, c: Glm5NextKdaWorkspace(gpu, c, 0), "max_tokens must be a positive integer"),
    (lambda gpu, c: Glm5NextKdaWorkspace(gpu, c, 2.5), "got 2.5"),
    (lambda gpu, c: Glm5NextKdaWorkspace(gpu, c, True), "got True"),
    (lambda gpu, c: KdaSeqState(gpu, "tiny"), "cfg must be a Glm5NextKdaConfig, got str"),
    (lambda gpu, c: KdaStatePool(gpu, c, 0), "slots must be a positive integer"),
    (lambda gpu, c: KdaSeqState(gpu, c).upload([1], None), "recurrent must be a NumPy array"),
    (lambda gpu, c: Glm5NextKdaWorkspace(gpu, c, 4).ptr("nope"), "no buffer 'nope'"),
    (lambda gpu, c: Glm5NextKdaWorkspace(gpu, c, 4).read("final_out", 0),
     "token count must be a positive integer, got 0"),
    (lambda gpu, c: Glm5NextKdaWeights.upload(gpu, c, {}), "tensor .* is missing"),
    (lambda gpu, c: synthetic.preset_config("huge"), "unknown preset 'huge'"),
    (lambda gpu, c: synthetic.preset_config("tiny", layers=0),
     r"layers must be an integer in \[1, 1024\], got 0"),
    (lambda gpu, c: synthetic.write_checkpoint("/nonexistent-kdarun/x", c, spelling="odd"),
     "unknown spelling 'odd'"),
    (lambda gpu, c: synthetic.write_checkpoint("/nonexistent-kdarun/x", c, seed=-1),
     "seed must be a non-negative integer"),
    (lambda gpu, c: RunPlan(2.5).check(), "prefill tokens must be a non-negative integer"),
    (lambda gpu, c: RunPlan(4, 0, 9).check(), r"k must be an integer in \[0, 8\], got 9"),
    (lambda gpu, c: open_backend("tpu"), "expected 'auto', 'cuda' or 'host'"),
    (lambda gpu, c: gpu.alloc(0), "nbytes must be a positive integer"),
    (lambda gpu, c: gpu.alloc(2**70), "alloc needs .* of device memory, but .* free"),
    (lambda gpu, c: gpu.memset(gpu.alloc(4), 256, 4, 0),
     r"memset: byte must be an integer in \[0, 255\], got 256"),
    (lambda gpu, c: gpu.download(gpu.alloc(4), (-1,), np.float32),
     "download: a dimension of the shape must be a non-negative integer, got -1"),
    (lambda gpu, c: Glm5NextKdaWorkspace(gpu, c, 4).read(["final_out"], 1),
     r"no buffer \['final_out'\]"),
    (lambda gpu, c: KdaStatePool(gpu, c, 2).check_slots(5, "zero"),
     "zero: pass the slots as a list or 1-D array of integers, got 5"),
    (lambda gpu, c: c.shard(0), "tp_size must be a positive integer, got 0"),
    (lambda gpu, c: c.check_tp(-1, 2), "tp_rank must be a non-negative integer, got -1"),
    (lambda gpu, c: c.check_tp(np.int64(1), np.int64(2)) or c.check_tp(2, 2),
     r"tp_rank must lie in \[0, 2\), got 2"),
    (lambda gpu, c: shard_tensors(c, {}, 4, 4), r"tp_rank must lie in \[0, 4\), got 4"),
    (lambda gpu, c: launch(64, print), r"--tp 64 over NCCL needs 64 GPUs"),
])
def test_api_misuse_is_a_kda_error(call, pattern):
    gpu = HostBackend()
    with pytest.raises(KdaError, match=pattern):
        call(gpu, _cfg())


def test_load_stack_refuses_bad_arguments_before_allocating(made):
    gpu = HostBackend()
    for kw, pattern in (({"max_tokens": 0}, "max_tokens must be a positive integer"),
                        ({"max_tokens": 8, "layers": [3]}, "layer 3 is not a KDA layer"),
                        ({"max_tokens": 8, "layers": [True]}, "layer index must be an integer"),
                        ({"max_tokens": 8, "layers": 0}, "layers must be 0-based layer indices"),
                        ({"max_tokens": 8, "layers": "0"}, "layers must be 0-based layer indices"),
                        ({"max_tokens": 8, "layers": {0: 1}},
                         "layers must be 0-based layer indices"),
                        ({"max_tokens": 8, "layers": []}, "layers is empty"),
                        ({"max_tokens": 8, "layers": [0, 1, 0]},
                         r"layers names a layer more than once: \[0, 1, 0\]"),
                        ({"max_tokens": 8, "tp_size": 3}, "num_heads 4 is not divisible by "
                                                          "tp_size 3"),
                        ({"max_tokens": 8, "tp_rank": 2, "tp_size": 2},
                         r"tp_rank must lie in \[0, 2\), got 2"),
                        ({"max_tokens": 10 ** 9}, r"3 layer\(s\) with a workspace of "
                                                  r"1000000000 tokens needs")):
        with pytest.raises(KdaError, match=pattern):
            load_stack(gpu, made["single"], **kw)
        assert gpu.free_memory() == HostBackend().free_memory()  # nothing left allocated


def test_run_layer_refuses_too_few_rows(bound):
    gpu, stack, _ = bound
    with pytest.raises(KdaError, match="9 tokens planned but only 5 hidden rows"):
        run_layer(gpu, stack, 0, random_hidden(5, 256, 0), RunPlan(8, 1))


def test_tp_group_refuses_a_wrong_set_of_ranks(made):
    """A group in turn needs every rank's stack in order, a state a rank, and rows its sum
    buffer holds; a freed group refuses its sum."""
    gpu = HostBackend()
    r0, r1 = (load_stack(gpu, made["single"], 4, [0], 0, r, 2) for r in (0, 1))
    whole = load_stack(gpu, made["single"], 4, [0])
    with pytest.raises(KdaError, match=r"need the stacks of ranks \[0, 1\], in order, got "
                                       r"\[1, 0\]"):
        TpGroup.of(gpu, [r1, r0], 0)
    with pytest.raises(KdaError, match=r"stacks come from groups of sizes \[1, 2\]"):
        TpGroup.of(gpu, [r0, whole], 0)
    group = TpGroup.of(gpu, [r0, r1], 0, max_rows=2)
    h = gpu.upload(random_hidden(3, 256, 0))
    states = [KdaSeqState(gpu, r0.cfg) for _ in range(2)]
    with pytest.raises(KdaError, match=r"pass one a held rank \(2\), got 1"):
        group.decode(gpu, h, states[:1], 0)
    with pytest.raises(KdaError, match=r"3 rows exceed the sum buffer's 2"):
        group.decode_k(gpu, h, 3, states, None, 0)
    group.free()
    with pytest.raises(KdaError, match="was freed"):
        group.decode(gpu, h, states, 0)


# -- memory -----------------------------------------------------------------------------------

class _SmallDevice(HostBackend):
    """A host backend whose device has 256 KiB free."""

    def free_memory(self) -> int:
        return 256 << 10


@pytest.mark.parametrize("make, pattern", [
    (lambda gpu, c: Glm5NextKdaWorkspace(gpu, c, 4096), "a workspace of 4096 tokens needs"),
    (lambda gpu, c: KdaStatePool(gpu, c, 64), "a state pool of 64 slots needs"),
    (lambda gpu, c: Glm5NextKdaWeights.upload(gpu, c, canonical(
        c, synthetic.synth_layer_tensors(c, np.random.default_rng(0)))),
     "a layer's weights needs"),
])
def test_memory_is_checked_before_allocating(make, pattern):
    gpu = _SmallDevice()
    with pytest.raises(KdaError, match=pattern + r" [\d.]+ [MK]iB of device memory, but CPU "
                                                 r"\(NumPy\) has 256\.0 KiB free"):
        make(gpu, _cfg())
    assert HostBackend.free_memory(gpu) == HostBackend().free_memory()  # nothing allocated


def test_host_memory_cap_counts_live_allocations():
    gpu = HostBackend()
    free = gpu.free_memory()
    assert 0 < free < (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    p = gpu.alloc(1 << 20)
    assert gpu.free_memory() == free - (1 << 20)
    gpu.free(p)
    assert gpu.free_memory() == free


def test_the_current_directory_is_never_replaced(tmp_path, monkeypatch):
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    for args in (["make-checkpoint", "."], ["make-checkpoint", tmp_path, "--force"],
                 ["layer-run", *RUN, "--dump-stages", "."]):
        assert_refused(invoke(*args), 1, "is \\(or holds\\) the current directory")
    assert os.listdir(tmp_path) == ["here"] and os.listdir(tmp_path / "here") == []


def test_make_checkpoint_checks_the_disk_first(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(
        10 << 20, 10 << 20, 1 << 20))
    r = invoke("make-checkpoint", tmp_path / "c", "--layers", "8")
    assert_refused(r, 1, r"checkpoint .*/c: needs [\d.]+ MiB of disk, 1\.0 MiB free there")
    assert os.listdir(tmp_path) == []


def test_a_write_the_system_refuses_leaves_the_target(tmp_path):
    from kdarun.files import PendingFile
    target = tmp_path / "o.npy"
    target.write_bytes(b"old")

    def full(tmp: Path) -> None:
        tmp.write_bytes(b"partial")
        raise OSError(28, "No space left on device")
    with pytest.raises(KdaError, match=r"output .*o\.npy: cannot be written \(No space left on "
                                       r"device\)"):
        PendingFile(target, force=True).commit(full)
    assert os.listdir(tmp_path) == ["o.npy"] and target.read_bytes() == b"old"


def test_a_safetensors_write_the_system_refuses_is_one_line(tmp_path):
    """safetensors raises its own error on a full disk, not an OSError: still a KdaError."""
    from safetensors import SafetensorError

    from kdarun.files import PendingFile

    def full(tmp: Path) -> None:
        raise SafetensorError("Error while serializing: No space left on device")
    with pytest.raises(KdaError, match=r"o\.safetensors: cannot be written \(Error while "
                                       r"serializing: No space left on device\)"):
        PendingFile(tmp_path / "o.safetensors", force=False).commit(full)
    assert os.listdir(tmp_path) == []


def test_a_big_endian_input_is_read_as_its_values(made, tmp_path):
    """Hidden states saved big-endian (`>f4`) are floats like any other: the same output as
    the same values saved native."""
    rows = _rows(5)
    outs = []
    for order in ("<", ">"):
        np.save(tmp_path / f"h{order == '>'}.npy", rows.astype(f"{order}f4"))
        outs.append(tmp_path / f"o{order == '>'}.npy")
        r = invoke("layer-run", made["single"], "--input", tmp_path / f"h{order == '>'}.npy",
                   "--output", outs[-1], *RUN)
        assert r.exit_code == 0, r.output
    assert np.load(outs[0]).tobytes() == np.load(outs[1]).tobytes()


def test_a_terminated_run_leaves_no_temporaries(made, tmp_path):
    """SIGTERM (a scheduler's or `timeout`'s kill) ends a run through its cleanups, as Ctrl-C
    does: the claimed output's and dump's temporaries are removed, exit 128 + 15."""
    import signal
    import subprocess
    import sys
    import time
    proc = subprocess.Popen(
        [sys.executable, "-m", "kdarun.cli", "layer-run", str(made["single"]), "--tokens",
         "100000", "--backend", "host", "--output", str(tmp_path / "o.npy"), "--dump-stages",
         str(tmp_path / "d")], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    deadline = time.monotonic() + 60
    while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:  # both claimed
        time.sleep(0.05)
    assert len(os.listdir(tmp_path)) == 2 and proc.poll() is None, os.listdir(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM, proc.stderr.read()
    assert os.listdir(tmp_path) == []


def test_a_target_that_appears_during_the_run_is_kept(tmp_path):
    """An output claimed while absent (or a dump directory while empty) is checked again when
    it is put in place: a file or directory that appeared meanwhile (another run's, the
    user's) is not replaced without force, nor, with force, a directory that now holds files
    a dump does not write; nothing of the run's is left behind."""
    from kdarun.files import PendingDir, PendingFile
    target = tmp_path / "o.npy"
    pending = PendingFile(target, force=False)
    target.write_text("precious")
    with pytest.raises(KdaError, match="o.npy appeared while this run wrote it and was left as "
                                       "it is; nothing was written"):
        pending.commit(lambda tmp: tmp.write_bytes(b"new"))
    assert target.read_text() == "precious" and os.listdir(tmp_path) == ["o.npy"]
    for force, pattern in ((False, "exists and holds notes.txt"),
                           (True, "holds notes.txt, which a dump does not write")):
        d = tmp_path / f"d{force}"
        pending = PendingDir(d, force=force, what="dump", owned=lambda n: n.endswith(".npy"))
        d.mkdir()
        (d / "notes.txt").write_text("notes")
        with pytest.raises(KdaError, match=pattern):
            pending.commit(lambda tmp: (tmp / "a.npy").write_bytes(b"new"))
        assert os.listdir(d) == ["notes.txt"]
    file_dir = tmp_path / "f"
    pending = PendingDir(file_dir, force=True, what="dump", owned=lambda n: True)
    file_dir.write_text("a file now")
    with pytest.raises(KdaError, match="appeared while this run wrote it"):
        pending.commit(lambda tmp: (tmp / "a.npy").write_bytes(b"new"))
    assert file_dir.read_text() == "a file now"
    assert sorted(os.listdir(tmp_path)) == ["dFalse", "dTrue", "f", "o.npy"]
    pending = PendingFile(target, force=True)  # force replaces what is there
    pending.commit(lambda tmp: tmp.write_bytes(b"new"))
    assert target.read_bytes() == b"new"


def test_single_sequence_calls_check_their_buffers_before_the_state_moves(bound):
    """decode / decode_k / prefill_windowed refuse a missing state or hidden, snapshot targets
    of the wrong kind or inside the state, and an out that is missing, inside the state or
    too small, before the state moves."""
    from kdarun.layer import prefill_windowed
    gpu, stack, state = bound
    layer, ws, cfg = stack.layer(0), stack.workspace, stack.cfg
    state.upload(np.full(state.download()[0].shape, 0.25, np.float32), state.download()[1])
    before = state.download()
    h = gpu.upload(random_hidden(40, cfg.hidden_size, 7))
    small = gpu.alloc(10 * cfg.hidden_size * 2)
    other = KdaSeqState(gpu, cfg)
    for call, pattern in [
        (lambda: layer.decode(gpu, h, None, ws, 0), "decode: the state must be a KdaSeqState"),
        (lambda: layer.decode(gpu, h, [state], ws, 0),
         "decode: the state must be a KdaSeqState, got list"),
        (lambda: layer.decode(gpu, None, state, ws, 0), "decode: hidden must be a device pointer"),
        (lambda: layer.decode_k(gpu, h, 2, state, ws, [other], 0),
         r"snapshot 0 must be a \(recurrent, conv\) pair of device pointers"),
        (lambda: layer.decode_k(gpu, h, 2, state, ws, None, 0), "snapshots must be a list"),
        (lambda: layer.decode_k(gpu, h, 2, state, ws, [(state.recurrent, state.conv)], 0),
         "snapshot 0 .* lies in the state's own buffers"),
        (lambda: layer.decode_k(gpu, h, 2, state, ws, [(other.conv, other.recurrent)], 0),
         "decode_k: snapshot 0: access of .* runs past its allocation"),
        (lambda: prefill_windowed(layer, gpu, h, 40, state, ws, None, 0),
         "prefill_windowed: out must be a device pointer"),
        (lambda: prefill_windowed(layer, gpu, h, 40, state, ws, state.recurrent, 0),
         "overlaps the state's own buffers"),
        (lambda: prefill_windowed(layer, gpu, h, 40, state, ws, small, 0),
         "prefill_windowed: out: access of .* runs past its allocation"),
        (lambda: prefill_windowed(layer, gpu, h, 41, state, ws, small, 0),
         "prefill_windowed: hidden: access of .* runs past its allocation"),
    ]:
        with pytest.raises(KdaError, match=pattern):
            call()
        for x, y in zip(before, state.download()):
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), pattern


def test_uploads_of_another_element_size_are_refused_before_the_state_moves(bound):
    """An int64 slot table (NumPy's default integer) read as int32 would name slot 0 in every
    other entry, and float32 rows read as bf16 are other numbers: where a pointer is an
    upload's, the call refuses elements of another size, the pool and state untouched. Same-
    size views (bf16 bits as uint16) pass, and a copy_h2d over an upload re-tags it."""
    gpu, stack, state = bound
    layer, ws, cfg = stack.layer(0), stack.workspace, stack.cfg
    pool = KdaStatePool(gpu, cfg, 6)
    pool.upload(4, *(np.full(a.shape, 0.5, a.dtype) for a in pool.download(4)))
    before = [pool.download(s) for s in range(6)]
    h2 = gpu.upload(random_hidden(2, cfg.hidden_size, 3))
    wide = gpu.upload(np.array([3, 5]))  # int64
    for call, pattern in [
        (lambda: layer.decode_batch(gpu, h2, 2, wide, pool, ws, 0),
         r"decode_batch: slots: the kernels read int32 \(4-byte\) elements there, but "
         r"DevicePtr\(0x[0-9a-f]+\) was uploaded from a int64 array"),
        (lambda: layer.verify_batch(gpu, h2, 1, 2, gpu.upload(np.array([1], np.int32)), pool, ws,
                                    gpu.upload(np.array([[2]], np.int64)), 0),
         "verify_batch: snapshot_slots: the kernels read int32"),
        (lambda: pool.check_tables(wide, 2), "check_tables: slots: the kernels read int32"),
        (lambda: pool.check_tables(gpu.upload(np.array([1], np.int32)), 2),
         r"check_tables: slots: access of 8 bytes .* runs past its allocation"),
        (lambda: layer.decode_batch(gpu, gpu.upload(random_hidden(2, cfg.hidden_size, 3)
                                                    .astype(np.float32)), 2,
                                    gpu.upload(np.array([3, 5], np.int32)), pool, ws, 0),
         "decode_batch: hidden: the kernels read bfloat16 \\(2-byte\\) elements there, but .* "
         "float32"),
        (lambda: layer.decode(gpu, gpu.upload(np.zeros((1, cfg.hidden_size), np.float32)),
                              state, ws, 0), "decode: hidden: .* float32 array"),
        (lambda: layer.prefill(gpu, gpu.upload(np.zeros((4, cfg.hidden_size), np.float64)), 4,
                               state, ws, 0), "prefill: hidden: .* float64 array"),
        (lambda: layer.prefill(gpu, gpu.upload(random_hidden(4, cfg.hidden_size, 3)
                                               .astype(np.float16)), 4, state, ws, 0),
         r"prefill: hidden: the kernels read bfloat16 \(2-byte\) elements there, but .* "
         r"float16 array \(2-byte elements\); convert it with .astype\(bfloat16\)"),
        (lambda: layer.decode_batch(gpu, h2, 2, gpu.upload(np.array([3, 5], np.float32)), pool,
                                    ws, 0), "decode_batch: slots: .* float32 array"),
    ]:
        with pytest.raises(KdaError, match=pattern):
            call()
        for s in range(6):
            assert all(np.array_equal(x, y) for x, y in zip(before[s], pool.download(s)))
    bits = gpu.upload(random_hidden(2, cfg.hidden_size, 3).view(np.uint16))
    retagged = gpu.upload(np.zeros(2, np.int64))  # 16 bytes: four int32 entries, two used
    gpu.copy_h2d(retagged, np.array([3, 5, -1, -1], np.int32), 0)
    layer.decode_batch(gpu, bits, 2, retagged, pool, ws, 0)
    assert not np.array_equal(before[3][0], pool.download(3)[0])


def test_seed_pieces_and_stack_lookups_check_their_arguments(bound):
    """front_end / stateful_row / back_end (the seed API's pieces) refuse counts that are not
    integers or past the workspace (on a GPU they would run past its buffers), a missing
    state; a stack's and a checkpoint's layer lookups take integers only; a layer refuses
    weights of another config and a stage hook that cannot be called."""
    from kdarun.checkpoint import Checkpoint
    from kdarun.kernels import Glm5NextKdaKernels
    from kdarun.layer import Glm5NextKdaLayer
    gpu, stack, state = bound
    layer, ws, cfg = stack.layer(0), stack.workspace, stack.cfg
    h = gpu.upload(random_hidden(16, cfg.hidden_size, 1))
    half = cfg.shard(2)
    for call, pattern in [
        (lambda: layer.front_end(gpu, h, 2.5, ws, 0), "front_end: t must be a positive integer"),
        (lambda: layer.front_end(gpu, h, 17, ws, 0),
         "front_end: 17 tokens exceed the workspace's max_tokens 16"),
        (lambda: layer.front_end(gpu, None, 1, ws, 0), "front_end: hidden must be a device"),
        (lambda: layer.stateful_row(gpu, -1, state, ws, 0),
         "stateful_row: row must be a non-negative integer, got -1"),
        (lambda: layer.stateful_row(gpu, 16, state, ws, 0),
         r"stateful_row: row \+ 1: 17 tokens exceed the workspace's max_tokens 16"),
        (lambda: layer.stateful_row(gpu, 0, None, ws, 0),
         "stateful_row: the state must be a KdaSeqState"),
        (lambda: layer.back_end(gpu, 1.5, ws, 0), "back_end: t must be a positive integer"),
        (lambda: layer.back_end(gpu, 40, ws, 0), "back_end: 40 tokens exceed"),
        (lambda: stack.layer(True), "KdaStack.layer: layer_idx must be a non-negative integer"),
        (lambda: stack.layer(0.0), "got 0.0"),
        (lambda: Checkpoint(None), "checkpoint: the path must be a str or pathlib.Path"),
        (lambda: stack.checkpoint.layer_tensors(True), "layer_idx must be a non-negative "
                                                       "integer, got True"),
        (lambda: Glm5NextKdaLayer(0, half, layer.weights, Glm5NextKdaKernels(gpu, half)),
         "layer 0: the weights were uploaded for a config of num_heads 4, not 2"),
        (lambda: Glm5NextKdaLayer(0, cfg, {}, layer.kernels),
         "the weights must be a Glm5NextKdaWeights, got dict"),
        (lambda: setattr(layer, "stage_hook", 5), "stage_hook must be callable"),
        (lambda: setattr(layer, "stage_hook", lambda stage: None),
         r"stage_hook must be callable as hook\(stage, gpu, stream\)"),
    ]:
        with pytest.raises(KdaError, match=pattern):
            call()
    assert layer.stage_hook is None


def test_snapshots_apart_and_out_in_place_or_apart(bound):
    """decode_k's snapshot targets may not overlap each other (one row's state would be
    lost), and prefill_windowed's / prefill_packed's out is hidden itself or apart from it (a
    window's output would overwrite rows a later window reads); in place gives what a
    separate out gives."""
    from kdarun.layer import prefill_packed, prefill_windowed
    gpu, stack, state = bound
    layer, ws, cfg = stack.layer(0), stack.workspace, stack.cfg
    a, c = KdaSeqState(gpu, cfg), KdaSeqState(gpu, cfg)
    h3 = gpu.upload(random_hidden(3, cfg.hidden_size, 2))
    row = cfg.hidden_size * 2
    rows = random_hidden(40, cfg.hidden_size, 5)
    big = gpu.upload(np.concatenate([rows, rows[:1]]))  # room for out one row on
    pool = KdaStatePool(gpu, cfg, 4)
    before = state.download()
    for call, pattern in [
        (lambda: layer.decode_k(gpu, h3, 3, state, ws, [(a.recurrent, a.conv)] * 2, 0),
         "decode_k: snapshot 1 .* overlaps snapshot 0's"),
        (lambda: layer.decode_k(gpu, h3, 2, state, ws, [(c.recurrent, c.recurrent)], 0),
         "decode_k: snapshot 0 .* overlaps its own recurrent target"),
        (lambda: prefill_windowed(layer, gpu, big, 40, state, ws, big + row, 0),
         "prefill_windowed: out .* overlaps hidden .* without being it"),
        (lambda: prefill_packed(layer, gpu, big, [0, 20, 40], [0, 1], [False, False], pool, ws,
                                big + row, 0), "prefill_packed: out .* overlaps hidden"),
        (lambda: prefill_packed(layer, gpu, big, [0, 4, 8, 12, 16], [0, 1, 2, 3], [False] * 4,
                                pool, ws, ws.final_out, 0),
         "prefill_packed: out .* overlaps the workspace's final_out, which every window "
         "writes"),
        (lambda: prefill_windowed(layer, gpu, big, 8, state, ws, ws.final_out + row, 0),
         "prefill_windowed: out .* overlaps the workspace's final_out"),
    ]:
        with pytest.raises(KdaError, match=pattern):
            call()
        assert all(np.array_equal(x, y) for x, y in zip(before, state.download()))
    apart = gpu.alloc(40 * row)
    prefill_windowed(layer, gpu, big, 40, state, ws, apart, 0)
    expected = gpu.download(apart, (40, cfg.hidden_size), BF16)
    state.upload(*before)
    prefill_windowed(layer, gpu, big, 40, state, ws, big, 0)  # in place
    assert np.array_equal(gpu.download(big, (40, cfg.hidden_size), BF16).view(np.uint16),
                          expected.view(np.uint16))


def test_a_stage_hook_that_raises_says_the_states_hold_part_of_the_call(bound):
    """A stage hook's exception stops the call between steps: it comes back as a KdaError
    that names the stage and says the states took the steps before it (the conv state has
    moved, the recurrent state not), with the hook's exception as its cause."""
    gpu, stack, state = bound
    layer, ws, cfg = stack.layer(0), stack.workspace, stack.cfg
    state.upload(*(np.full(a.shape, 0.25, a.dtype) for a in state.download()))
    before = state.download()

    def hook(stage, gpu_, stream):
        if stage.name == "conv_out":
            raise OSError("disk full")

    layer.stage_hook = hook
    try:
        with pytest.raises(KdaError, match=r"layer 0: the stage hook raised at stage conv_out "
                                           r"\(OSError: disk full\); the call stopped after its "
                                           r"conv step, so the states it took hold a part") as e:
            layer.prefill(gpu, gpu.upload(random_hidden(4, cfg.hidden_size, 1)), 4, state, ws, 0)
    finally:
        layer.stage_hook = None
    assert isinstance(e.value.__cause__, OSError)
    rec, conv = state.download()
    assert np.array_equal(rec, before[0]) and not np.array_equal(conv.view(np.uint16),
                                                                 before[1].view(np.uint16))


def test_a_bf16_npy_input_is_told_why_it_reads_as_void(made, tmp_path):
    """numpy.save writes bf16 as 2-byte voids: the refusal says so and what to save."""
    np.save(tmp_path / "bf.npy", random_hidden(4, 256, 0))
    r = invoke("layer-run", made["single"], "--input", tmp_path / "bf.npy", *RUN)
    assert r.exit_code == 1
    assert ".npy cannot name bf16; save float32, or bf16 in .safetensors" in r.output, r.output


def test_layer_run_says_which_input_rows_it_takes(made, tmp_path):
    """An --input longer than the run: the rows it takes are printed, not silently cut."""
    np.save(tmp_path / "h.npy", random_hidden(100, 256, 0).astype(np.float32))
    r = invoke("layer-run", made["single"], "--input", tmp_path / "h.npy", *RUN)
    assert r.exit_code == 0, r.output
    assert re.search(r"input\s+.*h\.npy: rows 0-4 of its 100", r.output), r.output
    r = invoke("layer-run", made["single"], *RUN, "--json")
    assert json.loads(r.output)["input"] == "random (seed 0)"
