"""The command line: the demo run, checkpoint tools, inputs and outputs, clear errors."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from kdarun import Checkpoint, reference
from kdarun.cli import main
from kdarun.run import DEMO, compare, open_run_checkpoint, random_hidden, reference_of


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_layer_run_demo_with_no_arguments():
    r = run("layer-run")
    assert r.exit_code == 0, r.output
    assert "host (CPU (NumPy))" in r.output and "PASS" in r.output
    r = run("layer-run", "--tokens", "5", "--decode-steps", "2", "--k", "3", "--json")
    res = json.loads(r.output)
    assert res["ok"] and res["tokens"] == 10 and res["final_out"]["rel"] < 1e-2
    assert set(res["wall_ms"]) == {"prefill", "decode", "decode_k"}


@pytest.mark.parametrize("seed", [7, 17])
def test_layer_run_checks_against_kdarun_rounding_points(seed):
    """One token whose heads' q . k nearly cancel: the bf16 q and k alone put the output 1.3e-2
    to 1.6e-2 from the unrounded float64 reference, past the tolerance, on a correct run. The
    verdict's reference rounds where kdarun's buffers are bf16, and the host backend lands on
    its bits."""
    r = run("layer-run", "--tokens", "1", "--decode-steps", "0", "--seed", str(seed), "--json")
    res = json.loads(r.output)
    assert r.exit_code == 0 and res["ok"], r.output
    assert res["final_out"]["rel"] < 1e-6 and res["recurrent_state"]["rel"] < 1e-5
    assert res["reference"] == reference.KDARUN_LABEL
    with open_run_checkpoint({"checkpoint": {"demo": DEMO}}) as path:
        ckpt = Checkpoint(path)
        h = random_hidden(1, ckpt.config.hidden_size, seed)
        exact = reference_of(ckpt, 0, h).stages["final_out"]
        rounded = reference_of(ckpt, 0, h, rounding=reference.KDARUN).stages["final_out"]
    assert compare(rounded, exact).rel > 1e-2  # what the unrounded check failed on


def test_make_checkpoint_inspect_and_run(tmp_path):
    ck = tmp_path / "ck"
    r = run("make-checkpoint", str(ck), "--preset", "tiny", "--gate", "bounded", "--layers", "8",
            "--shards", "2")
    assert r.exit_code == 0 and "6 KDA" in r.output
    r = run("inspect", str(ck))
    assert r.exit_code == 0 and "bounded (lower bound -5.0)" in r.output
    assert "kimi_linear (layers under model.layers.)" in r.output
    assert "problems: none" in r.output and "KDA layers (0-based, 6)  0, 1, 2, 4, 5, 6" in r.output
    h = np.random.default_rng(0).standard_normal((12, 256)).astype(ml_dtypes.bfloat16)
    save_file({"hidden": h}, str(tmp_path / "h.safetensors"))
    out = tmp_path / "o.safetensors"
    r = run("layer-run", str(ck), "--layer", "5", "--input", str(tmp_path / "h.safetensors"),
            "--decode-steps", "2", "--output", str(out), "--backend", "host")
    assert r.exit_code == 0, r.output
    assert "prefill 10 + decode 2" in r.output
    got = load_file(str(out))
    assert got["final_out"].shape == (12, 256) and got["final_out"].dtype == ml_dtypes.bfloat16
    assert np.all(np.isfinite(got["final_out"].astype(np.float32)))


def test_layout_option_writes_glm5_next(tmp_path):
    ck = tmp_path / "ck"
    r = run("make-checkpoint", str(ck), "--layout", "glm5_next", "--layers", "8")
    assert r.exit_code == 0, r.output
    assert "glm5_next layout, softplus gate, 8 layers (6 KDA), 1 shard" in r.output
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["model_type"] == "glm5_next"
    assert cfg["text_config"]["layer_types"][2:4] == ["linear_attention", "full_attention"]
    r = run("inspect", str(ck))
    assert r.exit_code == 0, r.output
    assert "glm5_next (layers under model.language_model.layers.)" in r.output
    assert "KDA layers (0-based, 6)  0, 1, 2, 4, 5, 6" in r.output and "problems: none" in r.output
    assert ("model.language_model.layers.0.self_attn.q_conv1d.weight  expected [256, 1, 4]"
            in r.output)


def test_glm_preset_makes_and_runs(tmp_path):
    """The GLM-5.3-Flash shape end to end on the host: its own layout, bounded gate and an
    index over shards by default."""
    ck = tmp_path / "ck"
    r = run("make-checkpoint", str(ck), "--preset", "glm-5.3-flash", "--layers", "4")
    assert r.exit_code == 0, r.output
    assert "glm5_next layout, bounded gate, 4 layers (3 KDA), 4 shard(s)" in r.output
    assert (ck / "model.safetensors.index.json").exists()
    r = run("layer-run", str(ck), "--tokens", "70", "--decode-steps", "1", "--backend", "host")
    assert r.exit_code == 0, r.output
    assert "bounded gate, H=64, D=128, hidden=4096" in r.output and "PASS" in r.output


def test_clear_errors(tmp_path):
    r = run("layer-run", str(tmp_path))
    assert r.exit_code != 0 and "config not found" in r.output and "Traceback" not in r.output
    r = run("layer-run", "--layer", "3")
    assert r.exit_code != 0 and "layer 3 is not a KDA layer" in r.output
    np.save(tmp_path / "bad.npy", np.zeros((4, 100), np.float32))
    r = run("layer-run", "--input", str(tmp_path / "bad.npy"))
    assert r.exit_code != 0 and "must be [N, 256], got [4, 100]" in r.output
    r = run("layer-run", "--tokens", "0", "--decode-steps", "0")
    assert r.exit_code != 0 and "at least one token" in r.output


def test_layer_run_batch_checks_every_sequence():
    r = CliRunner().invoke(main, ["layer-run", "--batch", "5", "--backend", "host", "--tokens",
                                  "90", "--decode-steps", "2", "--k", "2"])
    assert r.exit_code == 0, r.output
    rows = [ln for ln in r.output.splitlines() if ln.rstrip().endswith(("PASS", "FAIL"))]
    assert len(rows) == 5 and all(ln.rstrip().endswith("PASS") for ln in rows)
    assert "result: PASS, 5 of 5 sequences" in r.output


def test_layer_run_batch_takes_no_input_or_output(tmp_path):
    r = CliRunner().invoke(main, ["layer-run", "--batch", "2", "--backend", "host", "--output",
                                  str(tmp_path / "o.npy")])
    assert r.exit_code == 2 and "--batch runs random prompts" in r.output
    assert not (tmp_path / "o.npy").exists()


@pytest.mark.parametrize("flag", ["--tokens", "--k"])
def test_layer_run_batch_refuses_zero_tokens_or_drafts(flag):
    """--batch prefills prompts of 1 to --tokens tokens and verifies --k drafts a sequence: 0
    of either is a usage error, not the default put in its place."""
    r = CliRunner().invoke(main, ["layer-run", "--batch", "2", "--backend", "host", flag, "0"])
    assert r.exit_code == 2 and "both need at least 1" in r.output and f"{flag} 0" in r.output
