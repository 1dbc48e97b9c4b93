#!/usr/bin/env python3
"""Where each launch of the batched-decode benchmark's graph replay sits in time, as the
CUDA activity that PyTorch's profiler records (CUPTI) shows it: per launch of a replay, its
median start after the replay's first kernel started, its duration, and its gap after the
launch ahead (negative: the two overlapped). The step figures of `kdarun bench` time each
launch alone; this shows what the chained launches do together (overlapped launches,
`kdarun.kernels.DECODE_OVERLAP` / `BATCH_OVERLAP_ROWS`, among them).

    PYTHONPATH=. python3 tools/timeline.py --batch 1,64 [--preset kimi-linear-48b] [--k 1]
        [--set BATCH_OVERLAP_ROWS=0,32]                # on the device machine

The replays run under the profiler, which may stretch them a little: compare variants of one
run, not these times with the benchmark's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import add_set_argument, applied, label, parse_sets  # noqa: E402  (this tree's, beside this file)

COPIES = ("Memcpy", "Memset")  # activity rows that are not kernels


def launches(events: list[tuple[float, float, str]], reps: int) -> list[dict]:
    """Kernel activity [(start us, end us, name)] of `reps` replays of one graph -> per launch
    position of a replay: its name and the medians of its start (after the replay's first
    start), duration and gap after the launch ahead. Every replay must launch the same
    kernels in the same order."""
    events = sorted(events)
    if not events or len(events) % reps:
        raise SystemExit(f"{len(events)} kernel records for {reps} replays: the profiler did "
                         f"not see every launch")
    per = len(events) // reps
    runs = [events[r * per:(r + 1) * per] for r in range(reps)]
    names = [e[2] for e in runs[0]]
    if any([e[2] for e in run] != names for run in runs):
        raise SystemExit("the replays' kernels differ in name or order")
    out = []
    for i, name in enumerate(names):
        out.append({
            "name": name,
            "start": statistics.median(run[i][0] - run[0][0] for run in runs),
            "us": statistics.median(run[i][1] - run[i][0] for run in runs),
            "gap": statistics.median(run[i][0] - run[i - 1][1] for run in runs) if i else None,
        })
    out.append({"name": "(the replay: first start to last end)", "start": 0.0, "gap": None,
                "us": statistics.median(max(e[1] for e in run) - run[0][0] for run in runs)})
    return out


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'#':>3}  {'kernel':<40} {'start':>8} {'us':>8} {'gap':>8}"]
    for i, r in enumerate(rows):
        gap = "" if r["gap"] is None else f"{r['gap']:8.1f}"
        lines.append(f"{i:>3}  {r['name'][:40]:<40} {r['start']:8.1f} {r['us']:8.1f} {gap:>8}")
    return "\n".join(lines)


def profile_replays(replay, synchronize, reps: int) -> list[tuple[float, float, str]]:
    """The CUDA kernel activity of `reps` calls of `replay`, as PyTorch's profiler gives it."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        synchronize()
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == DeviceType.CUDA and not e.name.startswith(COPIES)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kimi-linear-48b")
    ap.add_argument("--batch", default="1,64", help="sequences, comma-separated")
    ap.add_argument("--k", type=int, default=1, help="rows a sequence (> 1: batched verify)")
    ap.add_argument("--reps", type=int, default=20)
    add_set_argument(ap)
    args = ap.parse_args()

    from kdarun import kernels, open_backend
    from kdarun.bench import BatchRun

    variants = parse_sets(args.set, kernels)
    gpu = open_backend("cuda")
    stream = gpu.create_stream()
    for variant in applied(variants, kernels):
        for b in (int(x) for x in args.batch.split(",")):
            run = BatchRun.make(gpu, args.preset, b, args.k, stream)
            run.step()
            graph = gpu.capture(run.step, stream)
            for _ in range(3):
                graph.replay(stream)
            events = profile_replays(lambda: graph.replay(stream),
                                     lambda: gpu.synchronize(stream), args.reps)
            run.release()
            print(f"\n== {label(variant)}, {args.preset}, B={b} K={args.k}, "
                  f"{gpu.device_name} ==\n{format_rows(launches(events, args.reps))}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
