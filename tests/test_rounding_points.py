"""tools/rounding_points.py: its float64 model rounded where kdarun rounds lands on the host
backend's result, and the transformers rounding points move the result measurably."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from kdarun import Checkpoint
from kdarun.loader import load_stack
from kdarun.run import RunPlan, compare, random_hidden, run_layer

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("rounding_points",
                                               ROOT / "tools" / "rounding_points.py")
rounding_points = sys.modules["rounding_points"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rounding_points)


def test_model_of_kdarun_points_matches_the_host_backend(ckpts, host):
    stack = load_stack(host, ckpts["bounded"], 80, [1])
    t = Checkpoint(ckpts["bounded"]).layer_tensors(1)
    h = random_hidden(80, stack.cfg.hidden_size, seed=3)
    res = run_layer(host, stack, 1, h, RunPlan(80, 0, 0))
    ours, theirs = (rounding_points.rounded_layer(stack.cfg, t, h, rounding_points.VARIANTS[v])
                    for v in ("kdarun points", "transformers points"))
    near = compare(res.recurrent_state, ours[1]).rel
    far = compare(res.recurrent_state, theirs[1]).rel
    assert near < 1e-4 and far > 100 * near  # measured 2.8e-6 and 2.6e-3
    assert compare(res.final_out, ours[0]).rel < compare(res.final_out, theirs[0]).rel / 3
    stack.free(host)


def test_measure_rows(ckpts):
    rows = rounding_points.measure(ckpts["softplus"], 0, [64])
    assert [r["run"] for r in rows] == ["kdarun host backend", *rounding_points.VARIANTS]
    assert all(0 < r["final_out"] < 1e-2 and 0 < r["state"] < 1e-2 for r in rows)
