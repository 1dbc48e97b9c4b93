#!/usr/bin/env python3
"""One warm layer call on random weights, for a profiler to attach to:

    ncu --clock-control none -k regex:kda_chunk --launch-skip 4 --launch-count 2 \
        python3 tools/profile_layer.py --preset kimi-linear-48b --mode prefill --tokens 4096

The call runs three times (two warm-ups, then the one to profile), on the legacy stream.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kimi-linear-48b")
    ap.add_argument("--mode", choices=("prefill", "decode", "decode-k", "batch-decode"),
                    default="prefill")
    ap.add_argument("--tokens", type=int, default=4096, help="prefill length, or K for decode-k")
    ap.add_argument("--batch", type=int, default=64, help="sequences of batch-decode")
    ap.add_argument("--gate", choices=("softplus", "bounded"), default="bounded")
    args = ap.parse_args()

    import numpy as np

    from kdarun import KdaStatePool, open_backend, synthetic
    from kdarun.bench import random_layer

    gpu = open_backend("cuda")
    cfg = synthetic.preset_config(args.preset, args.gate)
    rows = {"decode": 1, "batch-decode": args.batch}.get(args.mode, args.tokens)
    layer, ws, state, h = random_layer(gpu, cfg, rows, 0)
    if args.mode == "batch-decode":  # the sequences in shuffled slots of a pool
        pool = KdaStatePool(gpu, cfg, rows, 0)
        slots = gpu.upload(np.random.default_rng(0).permutation(rows).astype(np.int32), 0)
    for _ in range(3):
        if args.mode == "batch-decode":
            layer.decode_batch(gpu, h, rows, slots, pool, ws, 0)
        elif args.mode == "prefill":
            layer.prefill(gpu, h, rows, state, ws, 0)
        elif args.mode == "decode":
            layer.decode(gpu, h, state, ws, 0)
        else:
            layer.decode_k(gpu, h, rows, state, ws, (), 0)
    gpu.synchronize(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
