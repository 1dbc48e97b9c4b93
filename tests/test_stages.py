"""Stage dumps on the host backend: against the reference, a planted wrong stage found at
exactly that stage, bit-exact bf16 round trip, the manifest repeating the run, bad use."""

from __future__ import annotations

import json
import shlex
import shutil

import click
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from kdarun import KdaError
from kdarun.cli import main
from kdarun.stages import TENSORS_FILE, compare_stages, load_dump


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    d = tmp_path_factory.mktemp("dump") / "host"
    r = cli("layer-run", "--tokens", 70, "--decode-steps", 2, "--k", 3, "--backend", "host",
            "--seed", 5, "--dump-stages", d)
    assert r.exit_code == 0, r.output
    return d


def _plant(src, dst, key, fn):
    shutil.copytree(src, dst)
    t = load_file(str(dst / TENSORS_FILE))
    t[key] = fn(t[key])
    save_file(t, str(dst / TENSORS_FILE))
    return dst


def test_dump_order_and_reference(dump):
    d = load_dump(dump)
    keys = d.keys
    assert keys[0] == "prefill/qkv_proj" and keys[-1] == "decode_k/final_out"
    assert keys.index("prefill/state.conv") < keys.index("prefill/core")
    assert "decode_k/state.recurrent[2]" in keys and "decode.1/conv_out[0]" in keys
    assert d.tensors["prefill/core"].shape == (70, 4, 64)  # valid rows only, not T_pad
    table = compare_stages(dump)
    assert table.ok and table.first_failure is None and len(table.rows) == len(keys)
    r = cli("stages", dump, "--reference")
    assert r.exit_code == 0 and "all stages within tolerance" in r.output


@pytest.mark.parametrize("key", ["prefill/core", "decode.1/gate", "decode_k/state.recurrent[1]"])
def test_planted_wrong_stage_is_the_first_failure(dump, tmp_path, key):
    bad = _plant(dump, tmp_path / "bad", key, lambda a: (-a.astype(np.float32)).astype(a.dtype))
    for table in (compare_stages(bad), compare_stages(bad, dump)):
        assert table.first_failure.key == key
        assert [r.key for r in table.rows if not r.ok] == [key]
    r = cli("stages", bad, "--against", dump)
    assert r.exit_code == 1
    line = next(ln for ln in r.output.splitlines() if ln.strip().startswith(key))
    assert "FAIL" in line and "first stage past its tolerance" in line


def test_nan_in_a_stage_fails_it(dump, tmp_path):
    def nan_one(a):
        a = a.copy()
        a.reshape(-1)[3] = np.nan
        return a
    bad = _plant(dump, tmp_path / "nan", "decode.0/conv_out[0]", nan_one)
    row = compare_stages(bad, dump).first_failure
    assert row.key == "decode.0/conv_out[0]" and row.nonfinite == 1


def test_bf16_round_trip_is_bit_exact(host, ckpts, tmp_path):
    from kdarun.loader import load_stack
    from kdarun.run import RunPlan, random_hidden, run_layer
    from kdarun.stages import StageRecorder, claim_dump, fingerprint, write_dump
    stack = load_stack(host, ckpts["bounded"], 64, [1])
    rec = StageRecorder()
    h = random_hidden(40, stack.cfg.hidden_size, 1)
    run_layer(host, stack, 1, h, RunPlan(38, 1, 1), recorder=rec)
    run = {"checkpoint": {"path": ckpts["bounded"]}, "layer": 1, "config": stack.cfg.to_hf(),
           "plan": {"prefill": 38, "decode_steps": 1, "k": 1}}
    write_dump(claim_dump(tmp_path / "d"), rec, h, run,
               fingerprint(stack.cfg, stack.checkpoint.layer_tensors(1)))
    back = load_dump(tmp_path / "d")
    for key, a in rec.arrays.items():
        b = back.tensors[key]
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), key
    assert back.tensors["prefill/conv_out"].dtype.name == "bfloat16"


def test_manifest_repeats_the_run(dump, tmp_path):
    run = json.loads((dump / "manifest.json").read_text())["run"]
    assert run["plan"] == {"prefill": 70, "decode_steps": 2, "k": 3} and run["input"] == "random"
    again = tmp_path / "again"
    r = cli(*shlex.split(run["command"])[1:], "--dump-stages", again)
    assert r.exit_code == 0, r.output
    a, b = load_dump(dump), load_dump(again)
    assert a.keys == b.keys
    for k in a.keys:
        assert np.array_equal(a.tensors[k].view(np.uint8), b.tensors[k].view(np.uint8)), k


def test_repeat_command_names_every_option_of_the_run(dump):
    """The repeat command is built from layer-run's own parameters: every one that shapes the
    run appears (a new option cannot be forgotten), and where results go does not."""
    from kdarun.cli import _NOT_REPEATED, layer_run
    words = shlex.split(json.loads((dump / "manifest.json").read_text())["run"]["command"])
    for param in layer_run.params:
        if isinstance(param, click.Option) and param.name not in _NOT_REPEATED and not (
                param.is_flag or param.name in ("input_path", "batch")):  # unset in this run
            assert param.opts[0] in words, param.opts[0]
    assert not {"--dump-stages", "--output", "--json"} & set(words)


def test_bad_use(dump, tmp_path):
    with pytest.raises(KdaError, match="no manifest.json"):
        compare_stages(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(dump, broken)
    (broken / "manifest.json").write_text("{")
    with pytest.raises(KdaError, match="corrupt manifest.json"):
        compare_stages(broken)
    gone = tmp_path / "gone"
    shutil.copytree(dump, gone)
    (gone / TENSORS_FILE).unlink()
    with pytest.raises(KdaError, match="stages.safetensors is missing"):
        compare_stages(gone)
    with pytest.raises(KdaError, match=r"unknown stage name\(s\) \['nope'\]"):
        compare_stages(dump, only=["nope"])
    assert [r.key for r in compare_stages(dump, only=["final_out"]).rows] == [
        "prefill/final_out", "decode.0/final_out", "decode.1/final_out", "decode_k/final_out"]
    other = tmp_path / "other"
    assert cli("layer-run", "--tokens", 70, "--decode-steps", 1, "--k", 3, "--backend", "host",
               "--seed", 5, "--dump-stages", other).exit_code == 0
    with pytest.raises(KdaError, match="different runs: plan"):
        compare_stages(dump, other)
    r = cli("stages", dump)
    assert r.exit_code != 0 and "exactly one of --against OTHER_DIR or --reference" in r.output
    assert [r.key for r in compare_stages(dump, only="final_out").rows][0] == "prefill/final_out"
    empty = tmp_path / "empty"
    shutil.copytree(dump, empty)
    m = json.loads((empty / "manifest.json").read_text())
    (empty / "manifest.json").write_text(json.dumps(m | {"stages": []}))
    with pytest.raises(KdaError, match="stages must be at least one stage"):
        compare_stages(empty)
    fewer = tmp_path / "fewer"
    shutil.copytree(dump, fewer)
    (fewer / "manifest.json").write_text(json.dumps(m | {"stages": m["stages"][:3]}))
    with pytest.raises(KdaError, match="holds stages .* lacks"):
        compare_stages(fewer, dump)


@pytest.fixture(scope="module")
def batch_dump(tmp_path_factory):
    d = tmp_path_factory.mktemp("dump") / "batch"
    r = cli("layer-run", "--batch", 3, "--tokens", 70, "--decode-steps", 2, "--k", 2,
            "--backend", "host", "--seed", 4, "--dump-stages", d)
    assert r.exit_code == 0, r.output
    return d


def test_batch_dump_keys_every_sequence_apart(batch_dump):
    d = load_dump(batch_dump)
    run = d.run
    lengths = run["batch"]["lengths"]
    assert run["plan"] == {"prefill": 70, "decode_steps": 2, "k": 2} and len(lengths) == 3
    assert d.hidden.shape[0] == sum(lengths) + 3 * (2 + 2)
    for i in range(3):  # the pack (1 + 63 + 64 rows) runs in windows of 70
        assert d.tensors[f"seq{i}.prefill/core"].shape == (lengths[i], 4, 64)
        assert d.tensors[f"seq{i}.prefill/q_f32"].shape == (lengths[i], 256)  # padded rows
        assert d.tensors[f"seq{i}.verify/core"].shape == (2, 4, 64)  # its k rows
        assert d.tensors[f"seq{i}.decode.1/qkv_parts"].shape[:2] == (3, 1)
        for call in ("prefill", "decode.0", "decode.1", "verify"):
            assert f"seq{i}.{call}/state.recurrent" in d.keys
    table = compare_stages(batch_dump)
    assert table.ok and len(table.rows) == len(d.keys)


@pytest.mark.parametrize("key", ["seq2.prefill/k_f32", "seq1.verify/core",
                                 "seq2.decode.0/gate", "seq0.decode.1/state.conv"])
def test_planted_wrong_stage_of_one_sequence_is_the_first_failure(batch_dump, tmp_path, key):
    bad = _plant(batch_dump, tmp_path / "bad", key,
                 lambda a: (-a.astype(np.float32) - 1).astype(a.dtype))
    for table in (compare_stages(bad), compare_stages(bad, batch_dump)):
        assert [r.key for r in table.rows if not r.ok] == [key]
        assert table.first_failure.key == key


def test_batch_dump_repeats_and_is_not_a_single_run(batch_dump, dump, tmp_path):
    run = json.loads((batch_dump / "manifest.json").read_text())["run"]
    again = tmp_path / "again"
    assert cli(*shlex.split(run["command"])[1:], "--dump-stages", again).exit_code == 0
    a, b = load_dump(batch_dump), load_dump(again)
    assert a.keys == b.keys and a.run["batch"] == b.run["batch"]
    for k in a.keys:
        assert np.array_equal(a.tensors[k].view(np.uint8), b.tensors[k].view(np.uint8)), k
    with pytest.raises(KdaError, match="different runs: a serving \\(--batch\\) dump against a "
                                       "single-sequence dump"):
        compare_stages(batch_dump, dump)


def test_compare_counts_nan_on_either_side():
    """A NaN or Inf fails a comparison and is counted on either side: in `stages --against`
    the other dump may hold it."""
    from kdarun.run import compare
    a, b = np.ones(4), np.ones(4)
    assert compare(a, b).ok(1e-3)
    for out, ref in ((np.array([1, np.nan, 1, 1.0]), b), (a, np.array([1, 1, np.inf, 1.0])),
                     (np.array([np.nan] * 4), np.array([np.nan, 1, 1, np.inf]))):
        e = compare(out, ref)
        assert not e.ok(1.0) and e.nonfinite == (np.count_nonzero(~np.isfinite(out))
                                                 + np.count_nonzero(~np.isfinite(ref)))
