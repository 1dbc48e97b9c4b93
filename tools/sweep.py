#!/usr/bin/env python3
"""The launch geometry swept in one process, for the device machine: each variant of
kdarun/kernels.py's constants (GEMV_SLAB_TILES, GEMV_SLAB_X_STAGES, PORTABLE_WALK_STAGES, ...;
every build takes them as -D flags) is set, the benchmark's layers are built with it, and
batched decode (batched verify with --k) or prefill is timed, one variant after another:

    PYTHONPATH=. python3 tools/sweep.py --mode batch-decode --batch 64,256 \\
        --set GEMV_SLAB_X_STAGES=3,5 --set GEMV_SLAB_TILES=4,8
    PYTHONPATH=. python3 tools/sweep.py --batch 64 --k 4 --set WG_FROM_ROWS=65,257  # verify
    PYTHONPATH=. python3 tools/sweep.py --mode prefill --tokens 16384 \\
        --set PORTABLE_WALK_STAGES=4,5

The variants are the product of the --set lists; the first value of each is the first
variant. Figures only: a variant may change a row's sums (GEMV_BLOCKS_PER_SM sets decode's K
shares) or break a kernel's layout, so run the GPU tests on one before keeping it. A variant
that does not build or launch is reported and skipped. Each line gives the call's time and its
steps'; the table last.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_sets(items: list[str], module) -> list[dict[str, int]]:
    """--set NAME=v1,v2 ... -> the variants, each {NAME: value}, in product order. NAME must be
    an int constant of `module` (kdarun.kernels)."""
    axes = []
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not values:
            raise SystemExit(f"--set {item!r}: expected NAME=v1,v2,...")
        current = getattr(module, name, None)
        if not name.isupper() or not isinstance(current, int) or isinstance(current, bool):
            raise SystemExit(f"--set {name}: not an int constant of kdarun/kernels.py")
        try:
            axes.append([(name, int(v)) for v in values.split(",")])
        except ValueError:
            raise SystemExit(f"--set {item!r}: values must be integers") from None
    if len({name for axis in axes for name, _ in axis}) != len(axes):
        raise SystemExit("--set: a constant given twice")
    return [dict(combo) for combo in itertools.product(*axes)] if axes else [{}]


def label(variant: dict[str, int]) -> str:
    return " ".join(f"{n}={v}" for n, v in variant.items()) or "as built"


def add_set_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--set", action="append", default=[], metavar="NAME=v1,v2",
                    help="a constant of kdarun/kernels.py and its values (repeatable)")


def applied(variants: list[dict[str, int]], module) -> Iterator[dict[str, int]]:
    """Each variant in turn with its constants set on `module`; the values it had before are
    put back after the last, or when the loop over them stops early."""
    saved = {name: getattr(module, name) for name in variants[0]}
    caches = [f for f in vars(module).values() if callable(getattr(f, "cache_clear", None))]
    try:
        for variant in variants:
            for name, value in variant.items():
                setattr(module, name, value)
            for f in caches:  # e.g. _gemv_shares, which reads GEMV_BLOCKS_PER_SM
                f.cache_clear()
            yield variant
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        for f in caches:
            f.cache_clear()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("batch-decode", "prefill"), default="batch-decode")
    ap.add_argument("--preset", default="kimi-linear-48b")
    ap.add_argument("--batch", default="64", help="batched decode: sequences, comma-separated")
    ap.add_argument("--k", type=int, default=1, help="batched decode: rows a sequence (> 1: "
                    "batched verify)")
    ap.add_argument("--tokens", default="16384", help="prefill: lengths, comma-separated")
    add_set_argument(ap)
    args = ap.parse_args()

    from kdarun import bench, kernels, open_backend
    variants = parse_sets(args.set, kernels)
    gpu = open_backend("cuda")
    stream = gpu.create_stream()
    ceil = bench.measure_ceilings(gpu, stream)

    def measure(variant: dict[str, int]) -> list[tuple[str, str, str, dict]]:
        out = []
        if args.mode == "batch-decode":
            for b in (int(x) for x in args.batch.split(",")):
                r = bench.bench_batch(gpu, args.preset, b, args.k, ceil, stream, reps=30)
                out.append((label(variant), f"B={b}" + (f" K={args.k}" if args.k > 1 else ""),
                            f"{r.us:.1f} us", r.kernels_us))
                print(*out[-1], flush=True)
        else:
            for r in bench.bench_prefill(gpu, args.preset, [int(x) for x in args.tokens.split(",")],
                                         stream, flashkda=False):
                steps = dict(r.kernels_ms, gemms=r.gemm_ms)
                if r.portable_walk_ms is not None:
                    steps["portable_walk"] = r.portable_walk_ms
                out.append((label(variant), f"T={r.tokens}", f"{r.ms:.3f} ms", steps))
                print(*out[-1], flush=True)
        return out

    rows = []
    for variant in applied(variants, kernels):
        try:
            rows += measure(variant)
        except Exception as e:  # a variant that does not build or launch: the next one
            rows.append((label(variant), "-", "failed", {}))
            print(label(variant), f"failed: {type(e).__name__}: {e}", flush=True)
    print(f"\n==== sweep, {args.mode}, {args.preset}: {gpu.device_name} ====")
    for variant, size, total, steps in rows:
        print(f"{variant:<48} {size:<8} {total:>11}  " +
              ", ".join(f"{n} {v:.{1 if args.mode == 'batch-decode' else 3}f}"
                        for n, v in steps.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
