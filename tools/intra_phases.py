#!/usr/bin/env python3
"""Where kda_chunk_intra's time goes, phase by phase (clocks left alone):

    python3 tools/intra_phases.py --preset large --tokens 16384

chunk.cu's intra kernel carries a mark after each block-wide barrier, built only with
-DKDA_INTRA_PHASES: thread 0 then adds the clock64() cycles since its last mark into a
__device__ array, so each phase is the block's time from barrier to barrier, summed over both
passes and over the solve's blocks. The layer runs one prefill on random weights, then the
marked build replaces the chunk module and runs the intra step once more. It prints the
kernel's time with and without the marks, and each phase's cycles a (chunk, head) block and
share. Two blocks share an SM, so a phase's cycles include the other block's competition.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PHASES = ("loads + cumulative sum", "qg / kd / k exp(G) element-wise", "scaled rows",
          "A / Aqk products", "Aqk out (split words)", "A split, solve set-up",
          "solve: right-hand sides + C", "solve: block, stores")

DEFINE = "-DKDA_INTRA_PHASES"  # the build with the marks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="large")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--gate", choices=("softplus", "bounded"), default="bounded")
    args = ap.parse_args()

    import numpy as np

    from kdarun import open_backend, synthetic
    from kdarun.bench import median_ms, random_layer
    from kdarun.config import CHUNK

    gpu = open_backend("cuda")
    cfg = synthetic.preset_config(args.preset, args.gate)
    T = args.tokens
    layer, ws, state, h = random_layer(gpu, cfg, T, 0)
    layer.prefill(gpu, h, T, state, ws, 0)  # the intra kernel's inputs
    intra = layer.prefill_steps(h, T, state, ws)["chunk_intra"]
    plain = median_ms(gpu, lambda: intra(0), 0, 10, 3)

    marked_module = layer.kernels.modules["chunk"] = gpu.load_module("chunk", (DEFINE,))
    marked = median_ms(gpu, lambda: intra(0), 0, 10, 3)
    counters = gpu.module_global(marked_module, "phase_cycles")  # unsigned long long [16]
    cycles = np.zeros(16, np.uint64)
    gpu.memset(counters, 0, cycles.nbytes, 0)
    intra(0)
    gpu.copy_d2h(cycles, counters, 0)
    gpu.synchronize(0)
    blocks = cfg.t_pad(T) // CHUNK * cfg.num_heads
    per = cycles[:len(PHASES)].astype(np.float64) / blocks
    print(f"{gpu.device_name}, {args.preset} T={T}: kda_chunk_intra {plain:.3f} ms "
          f"({marked:.3f} with the marks); {blocks} blocks of {per.sum():.0f} cycles")
    for name, c in zip(PHASES, per):
        print(f"  {name:<34} {c:9.0f} cycles  {100 * c / per.sum():5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
