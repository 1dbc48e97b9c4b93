#!/usr/bin/env python3
"""What kdarun's bf16 rounding points cost against transformers' on one KDA layer (CPU only):

    python3 tools/rounding_points.py --preset glm-5.3-flash --layers 4 --tokens 64,256

kdarun and transformers' GLM-5.3-Flash code round at the same points but two: kdarun rounds the
L2-normalised q and k into bf16 (`conv_out`) and keeps beta = sigmoid(b) in fp32; transformers
keeps the normalised q and k in fp32 inside the delta rule and rounds beta to bf16. The table
gives the relative error of final_out and of the final recurrent state against
`kdarun.reference` (float64, unrounded) over T tokens from a zero state, for kdarun's host
backend and for `rounded_layer`: the float64 reference rounded to bf16 at the points common
to both (`kdarun.reference.Rounding.buffers`: every projection, the low-rank gates' inner f_a
and g_a included; the conv's SiLU output; the gated RMSNorm's output, which takes the core's
output unrounded; final_out) and at each combination of the two points in question. Between
rounding points the model computes in float64 where kdarun's kernels compute in fp32.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kdarun import open_backend, reference, synthetic  # noqa: E402
from kdarun.checkpoint import Checkpoint  # noqa: E402
from kdarun.loader import load_stack  # noqa: E402
from kdarun.run import RunPlan, compare, random_hidden, reference_run, run_layer  # noqa: E402
from kdarun.state import conv_shape, recurrent_shape  # noqa: E402

VARIANTS = {  # name -> where the float64 model rounds (reference.Rounding)
    "kdarun points": reference.KDARUN,
    "transformers points": reference.Rounding(buffers=True, beta=True),
    "neither": reference.Rounding(buffers=True),
    "both": reference.Rounding(buffers=True, qk=True, beta=True),
}


def rounded_layer(cfg, t: dict, h: np.ndarray,
                  rounding: reference.Rounding) -> tuple[np.ndarray, np.ndarray]:
    """The block over h [T, hidden] (bf16) from a zero state in float64, rounded to bf16 where
    `rounding` says. `t` holds the layer's tensors as `Checkpoint.layer_tensors` returns them.
    Returns final_out [T, hidden] and the recurrent state [H, Dv, Dk]."""
    r = reference.layer(cfg, t, h, np.zeros(recurrent_shape(cfg)), np.zeros(conv_shape(cfg)),
                        rounding=rounding)
    return r.stages["final_out"], r.recurrent_state


def measure(ckpt: str, layer_idx: int, tokens: list[int], seed: int = 0) -> list[dict]:
    """One row per T and per run (the host backend, then each of `VARIANTS`): the relative
    errors of final_out and of the recurrent state against the float64 reference."""
    host = open_backend("host")
    stack = load_stack(host, ckpt, max(tokens), [layer_idx])
    t = Checkpoint(ckpt).layer_tensors(layer_idx)
    rows = []
    for T in tokens:
        h = random_hidden(T, stack.cfg.hidden_size, seed)
        ref = reference_run(stack, layer_idx, h)
        res = run_layer(host, stack, layer_idx, h, RunPlan(T, 0, 0))
        runs = {"kdarun host backend": (res.final_out, res.recurrent_state)}
        runs |= {name: rounded_layer(stack.cfg, t, h, r) for name, r in VARIANTS.items()}
        for name, (out, state) in runs.items():
            rows.append({"tokens": T, "run": name,
                         "final_out": compare(out, ref.stages["final_out"]).rel,
                         "state": compare(state, ref.recurrent_state).rel})
    stack.free(host)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="an existing checkpoint (default: a synthetic one of "
                                         "--preset, --layers and --seed 0, written to a temp dir)")
    ap.add_argument("--preset", default="glm-5.3-flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layer", type=int, default=None, help="default: the first KDA layer")
    ap.add_argument("--tokens", default="64,256", help="comma-separated T")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random hidden states")
    args = ap.parse_args()
    tokens = [int(x) for x in args.tokens.split(",")]
    with tempfile.TemporaryDirectory(prefix="kdarun-rounding-") as tmp:
        ckpt = args.checkpoint or str(synthetic.write_checkpoint(
            tmp, synthetic.preset_config(args.preset, layers=args.layers)))
        layer = Checkpoint(ckpt).config.kda_layers[0] if args.layer is None else args.layer
        rows = measure(ckpt, layer, tokens, args.seed)
    print(f"{ckpt if args.checkpoint else args.preset}, layer {layer}, zero state; relative "
          "error against the float64 reference")
    print(f"{'T':>5}  {'run':<22} {'final_out':>10} {'state':>10}")
    for r in rows:
        print(f"{r['tokens']:>5}  {r['run']:<22} {r['final_out']:>10.3e} {r['state']:>10.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
