#!/usr/bin/env python3
"""Everything GPU in one run, for the device machine: the GPU tests, the decode, batched
decode and verify, and prefill benchmarks (with fla alongside where importable, and FlashKDA's
forward beside the prefill core where `flash_kda` imports) and a short summary table last.

    PYTHONPATH=. python3 tools/gpu_check.py [--skip-tests] [--skip-bench] [--quick]
        [--only prefill,batch,decode,varlen] [--budget-s 300] [--batch 1,8,64]
        [--mix 1x4096,32x128] [--tokens 1024,4096] [--presets glm-5.3-flash,kimi-linear-48b]
        [--no-fla] [--no-flashkda] [--pytest-args "-k prefill"]

`--tree-id` prints the id of the tree the tool sits in (a hash of kdarun/, kernels_cu/ and
tools/) and exits; a run prints it first and in its summary, so figures name the code they
measured (compare with `--tree-id` on a checkout here, or on a tree tools/ab_trees.py exported).

Installs nothing. The benchmarks run only if the tests pass, for each preset the modes of
--only in its order (default decode, batch, varlen, prefill). With --budget-s no benchmark
starts once that many seconds have passed since the first: the run ends with what it has and
says what it left out, so a device call's limit never cuts the table. Full results go to
$OUT/gpu_check.json when OUT is set.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kdarun import bench, open_backend  # noqa: E402  (the tree this tool sits in)

MODES = ("decode", "batch", "varlen", "prefill")
TREE_DIRS = ("kdarun", "kernels_cu", "tools")  # what the figures depend on


def tree_id(root: Path = ROOT) -> str:
    """12 hex digits of a hash over the files of TREE_DIRS under root (their paths and bytes,
    in path order; caches left out): equal for equal code wherever the tree was copied."""
    h = hashlib.sha256()
    for d in TREE_DIRS:
        for f in sorted((root / d).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                name = f.relative_to(root).as_posix().encode()
                h.update(name + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def parse_modes(text: str) -> list[str]:
    """--only's comma-separated benchmark modes, in the order given, each once."""
    modes = list(dict.fromkeys(m.strip() for m in text.split(",")))
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(bad) or repr(text)}; "
                                         f"the modes are {', '.join(MODES)}")
    return modes


class Budget:
    """Seconds the benchmarks may start in (None: no limit), and what was left out past it."""

    def __init__(self, seconds: float | None, clock=time.monotonic):
        self.clock, self.end = clock, None if seconds is None else clock() + seconds
        self.skipped: list[str] = []

    def allows(self, what: str) -> bool:
        """Whether the benchmark `what` may start; if not, it is noted as left out."""
        if self.end is None or self.clock() < self.end:
            return True
        self.skipped.append(what)
        return False


def run_tests(extra: list[str]) -> dict:
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "--tb=short",
                        "-p", "no:cacheprovider", "tests/gpu", *extra],
                       cwd=ROOT, capture_output=True, text=True)
    print(p.stdout[-20000:], p.stderr[-4000:], sep="\n", flush=True)
    last = [ln for ln in p.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return {"returncode": p.returncode, "summary": last[-1] if last else "no summary",
            "seconds": round(time.time() - t0, 1)}


def print_steps(what: str, times: dict[str, float], unit: str = "ms") -> None:
    """One line of step times, under the benchmark row it breaks down."""
    digits = 3 if unit == "ms" else 1
    print(f"  {what}, {unit}: " + ", ".join(f"{n} {v:.{digits}f}" for n, v in times.items()),
          flush=True)


def decode_row(gpu, preset, k, graph, ceil, stream, use_fla, report, rows) -> None:
    r = bench.bench_decode(gpu, preset, k, graph, ceil, stream)
    if use_fla and k == 1:
        r.fla_us = bench.fla_decode_us(preset, graph)
    report["decode"].append(vars(r))
    one = next((d for d in report["decode"] if d["preset"] == preset and d["k"] == 1
                and d["graph"] == graph), None)
    vs = f" fla {r.fla_us:.1f} us ({r.fla_us / r.us:.2f}x)" if r.fla_us else ""
    k_ratio = f" = {r.us / one['us']:.2f}x one decode" if k > 1 and one else ""
    rows.append((f"decode {preset}", f"K={k} {'graph' if graph else 'eager'}",
                 f"{r.us:.1f} us, {r.gbps:.0f} GB/s = {100 * r.frac_copy:.0f}% of copy"
                 f"{k_ratio}{vs}"))
    print(rows[-1], flush=True)
    if graph:
        print("  each launch (every layer in turn, graph-replayed), us: " + ", ".join(
            f"{n} {v:.1f}" for n, v in r.kernels_us.items()), flush=True)


def batch_row(gpu, preset, b, k, ceil, stream, use_fla, report, rows) -> None:
    r = bench.bench_batch(gpu, preset, b, k, ceil, stream)
    if use_fla and k == 1:
        r.fla_us = bench.fla_decode_us(preset, True, batch=b)
    report["batch"].append(vars(r))
    vs = f" | fla {r.fla_us:.1f} us ({r.fla_us / r.us:.2f}x)" if r.fla_us else ""
    rows.append((f"{r.mode} {preset}", f"B={b}" + (f" K={k}" if k > 1 else ""),
                 f"{r.us:.1f} us, {100 * r.frac_copy:.0f}% of its memory floor{vs}"))
    print(rows[-1], flush=True)
    print_steps("each step (every layer in turn, graph-replayed)", r.kernels_us, "us")


def varlen_rows(gpu, preset, mix, stream, use_fla, report, rows) -> None:
    for r in bench.bench_varlen(gpu, preset, bench.parse_mix(mix), stream, fla=use_fla):
        report["varlen"].append(vars(r))
        vs = f" | fla {r.fla_ms:.2f} ms ({r.fla_ms / r.ms:.2f}x)" if r.fla_ms else ""
        rows.append((f"packed prefill {preset}", r.mix,
                     f"{r.ms:.2f} ms = {r.ms / r.one_ms:.2f}x one {r.tokens}-token "
                     f"prefill ({r.one_ms:.2f}); checkpoints every "
                     f"{bench.CHECKPOINT_EVERY}: {r.ms_checkpoints / r.ms:.2f}x; host "
                     f"{r.host_ms:.2f} ms (one prefill's {r.one_host_ms:.2f}){vs}"))
        print(rows[-1], flush=True)
        print_steps("each step of the packed table", r.steps_ms)


def prefill_rows(r, report, rows) -> None:
    preset, f_ms, f_core = r.preset, r.fla_ms, r.fla_core_ms
    report["prefill"].append(vars(r))
    vs = (f" | fla {f_ms:.2f} ms ({f_ms / r.ms:.2f}x), fla chunk_kda {f_core:.2f} ms "
          f"({f_core / r.core_ms:.2f}x)") if f_ms else ""
    rows.append((f"prefill {preset}", f"T={r.tokens}",
                 f"{r.ms:.3f} ms, core {r.core_ms:.3f} ms, GEMMs {r.gemm_ms:.3f} ms{vs}"))
    print(rows[-1], flush=True)
    if r.flashkda_core_ms:  # like for like: both cores compute the decay and beta themselves
        mine = r.core_ms
        rows.append((f"prefill {preset}", f"T={r.tokens} FlashKDA",
                     f"core {mine:.3f} ms, FlashKDA {r.flashkda_core_ms:.3f}"
                     f" ms ({mine / r.flashkda_core_ms:.2f}x FlashKDA's time)"))
        print(rows[-1], flush=True)
    if r.portable_core_ms:  # the intra kernel and both walks alone, one after the other
        hopper_core = r.intra_ms + r.hopper_walk_ms
        vs = f", fla chunk_kda {f_core / r.portable_core_ms:.2f}x" if f_ms else ""
        rows.append((f"prefill {preset}", f"T={r.tokens} portable",
                     f"core {r.portable_core_ms:.3f} ms = "
                     f"{r.portable_core_ms / hopper_core:.2f}x the Hopper core "
                     f"{hopper_core:.3f} ms (intra {r.intra_ms:.3f}, walks "
                     f"{r.portable_walk_ms:.3f} / {r.hopper_walk_ms:.3f} ms; the layer's core "
                     f"{r.core_ms:.3f}){vs}"))
        print(rows[-1], flush=True)
    print_steps("each step in the layer", r.kernels_ms)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer presets and lengths")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments")
    ap.add_argument("--only", type=parse_modes, default=list(MODES),
                    help="benchmark modes in the order to run them, comma-separated "
                    f"(default {','.join(MODES)})")
    ap.add_argument("--budget-s", type=float,
                    help="start no benchmark after this many seconds of benchmarks")
    ap.add_argument("--mix", default="1x4096,8x512,32x128,128x32",
                    help="packed prefills (kimi-linear-48b), sequences x tokens, comma-separated")
    ap.add_argument("--batch", default="1,8,32,64,128,256",
                    help="sequences a call of batched decode, comma-separated")
    ap.add_argument("--tokens", help="prefill lengths, comma-separated")
    ap.add_argument("--presets", help="presets in the order to run them, comma-separated "
                    "(default kimi-linear-48b,glm-5.3-flash; --quick: kimi-linear-48b)")
    ap.add_argument("--no-fla", action="store_true", help="leave fla out of the benchmarks")
    ap.add_argument("--no-flashkda", action="store_true",
                    help="leave FlashKDA out of the prefill benchmark")
    ap.add_argument("--tree-id", action="store_true",
                    help="print this tree's id and exit (no GPU needed)")
    args = ap.parse_args()
    tree = tree_id()
    if args.tree_id:
        print(tree)
        return 0
    print(f"kdarun tree {tree}", flush=True)

    gpu = open_backend("cuda")
    report: dict = {"device": gpu.device_name, "tree": tree}
    tests = None
    if not args.skip_tests:
        tests = report["tests"] = run_tests(shlex.split(args.pytest_args))
        if tests["returncode"] != 0:
            print("GPU tests failed: benchmarks skipped (figures from failing code mean nothing)")
            args.skip_bench = True
    rows: list[tuple[str, str, str]] = []
    if not args.skip_bench:
        stream = gpu.create_stream()
        ceil = bench.measure_ceilings(gpu, stream)
        report["ceilings"] = vars(ceil)
        use_fla = not args.no_fla and bench.fla_available()
        report["fla"] = use_fla
        presets = ["kimi-linear-48b"] if args.quick else ["kimi-linear-48b", "glm-5.3-flash"]
        if args.presets:
            presets = args.presets.split(",")
        tokens = [64, 1024, 4096] if args.quick else [64, 1024, 4096, 16384]
        if args.tokens:
            tokens = [int(x) for x in args.tokens.split(",")]
        report["decode"], report["batch"], report["varlen"], report["prefill"] = [], [], [], []
        batches = [int(x) for x in args.batch.split(",")]
        budget = Budget(args.budget_s)
        for preset in presets:
            for mode in args.only:
                if mode == "decode":
                    for k, graph in (1, True), (1, False), (4, True):
                        if budget.allows(f"decode {preset} K={k} {'graph' if graph else 'eager'}"):
                            decode_row(gpu, preset, k, graph, ceil, stream, use_fla, report, rows)
                elif mode == "batch":
                    for b, k in [(b, 1) for b in batches] + [(64, 4)]:
                        if budget.allows(f"batch {preset} B={b} K={k}"):
                            batch_row(gpu, preset, b, k, ceil, stream, use_fla, report, rows)
                elif mode == "varlen" and preset == "kimi-linear-48b":
                    if budget.allows(f"varlen {preset}"):
                        varlen_rows(gpu, preset, args.mix, stream, use_fla, report, rows)
                elif mode == "prefill":
                    runs = bench.bench_prefill(gpu, preset, tokens, stream, fla=use_fla,
                                               flashkda=not args.no_flashkda)
                    for t in tokens:
                        if not budget.allows(f"prefill {preset} T={t}"):
                            continue
                        prefill_rows(next(runs), report, rows)
                    runs.close()
        report["skipped"] = budget.skipped
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"\n==== kdarun GPU check: {report['device']}, tree {tree} ====")
    if tests:
        print(f"tests: {tests['summary']} ({tests['seconds']} s)")
    if "ceilings" in report:
        c = report["ceilings"]
        print(f"ceilings (this run): copy {c['copy_gbps']:.0f} GB/s, bf16 GEMM "
              f"{c['gemm_tflops']:.0f} TFLOP/s (max abs error of its product "
              f"{c['gemm_max_err']:.3g}); fla importable: {report['fla']}")
    w = max((len(a) + len(b) for a, b, _ in rows), default=0) + 1
    for a, b, c in rows:
        print(f"{(a + ' ' + b).ljust(w)}  {c}")
    if report.get("skipped"):
        print(f"left out (past --budget-s {args.budget_s:g}): " + "; ".join(report["skipped"]))
    return 0 if not tests or tests["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
