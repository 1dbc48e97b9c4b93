#!/usr/bin/env python3
"""Where the chunked core's two kernels spend their time, phase by phase (clocks left alone):

    python3 tools/chunk_phases.py --preset glm-5.3-flash --tokens 16384

chunk.cu carries marks, built only with -DKDA_CHUNK_PHASES: thread 0 of each block adds the
clock64() cycles since its last mark into a __device__ array at PHASE(i). The intra kernel
marks 0-7, one after each block-wide barrier (summed over both passes and the solve's
blocks); the walk marks 8-13 at each chunk's waits and product groups (summed over the
chunks). The layer runs one prefill on random weights, then the marked build replaces the
chunk module and each kernel runs once more. It prints each kernel's time with and without
the marks, and each phase's cycles (an intra block's; a walk block's chunk) and share. Two
intra blocks share an SM, so an intra phase's cycles include the other block's competition.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

INTRA_PHASES = ("loads + cumulative sum", "qg / kd / k exp(G) element-wise", "scaled rows",
                "A / Aqk products", "Aqk out (split words)", "A split, solve set-up",
                "solve: right-hand sides + C", "solve: block, stores")
WALK_PHASES = ("wait for w, qg, u, gl", "W^T product (O^T's 1st term queued)",
               "v^T, its fragments, the decay", "wait for kd^T, Aqk",
               "S^T product (O^T's 2nd term queued)", "S^T's fragments, O^T stored")
WALK_FIRST = len(INTRA_PHASES)  # the walk's first mark

DEFINE = "-DKDA_CHUNK_PHASES"  # the build with the marks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="glm-5.3-flash")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--gate", choices=("softplus", "bounded"), default="bounded")
    args = ap.parse_args()

    import numpy as np

    from kdarun import open_backend, synthetic
    from kdarun.bench import median_ms, random_layer
    from kdarun.config import CHUNK
    from kdarun.kernels import WALK_ROWS, compile_defines

    gpu = open_backend("cuda")
    cfg = synthetic.preset_config(args.preset, args.gate)
    T = args.tokens
    layer, ws, state, h = random_layer(gpu, cfg, T, 0)
    layer.prefill(gpu, h, T, state, ws, 0)  # the kernels' inputs
    # each kernel alone over all chunks: the layer may run the walk beside the last intra blocks
    intra, walk = layer.core_apart(ws, state.recurrent, T)
    kernels = (("kda_chunk_intra", intra, INTRA_PHASES, 0,
                cfg.t_pad(T) // CHUNK * cfg.num_heads, "blocks"),
               ("kda_chunk_inter", walk, WALK_PHASES, WALK_FIRST,
                cfg.num_heads * cfg.head_dim // WALK_ROWS * (cfg.t_pad(T) // CHUNK),
                "chunks of a block"))
    plain = [median_ms(gpu, lambda: run(0), 0, 10, 3) for _, run, *_ in kernels]

    marked_module = layer.kernels.modules["chunk"] = gpu.load_module(
        "chunk", (*compile_defines(), DEFINE))
    counters = gpu.module_global(marked_module, "phase_cycles")  # unsigned long long [16]
    print(f"{gpu.device_name}, {args.preset} T={T}:")
    for (name, run, phases, first, units, unit), ms in zip(kernels, plain):
        marked = median_ms(gpu, lambda: run(0), 0, 10, 3)
        cycles = np.zeros(16, np.uint64)
        gpu.memset(counters, 0, cycles.nbytes, 0)
        run(0)
        gpu.copy_d2h(cycles, counters, 0)
        gpu.synchronize(0)
        per = cycles[first:first + len(phases)].astype(np.float64) / units
        print(f"{name} {ms:.3f} ms ({marked:.3f} with the marks); {units} {unit} of "
              f"{per.sum():.0f} cycles")
        for phase, c in zip(phases, per):
            print(f"  {phase:<34} {c:9.0f} cycles  {100 * c / per.sum():5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
