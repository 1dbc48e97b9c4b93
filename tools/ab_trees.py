#!/usr/bin/env python3
"""A/B of whole source trees, for kernel experiments.

One tree's figures move 3-5% between runs on the device machine, so a comparison runs the
trees in turn, several rounds, in one call: a drift of the GPU's clocks then falls on every
tree alike. Per figure it prints each tree's runs and the ratio of its median to the first
tree's.

    python3 tools/ab_trees.py export DIR REF [REF ...]      # here: `git archive` each ref
    PYTHONPATH=. python3 tools/ab_trees.py run TREE [TREE ...] [--rounds 2] [--tests]
        [--only prefill,batch] [--tokens 4096,16384] [--batch 1,64,256]
        [--presets kimi-linear-48b,glm-5.3-flash]            # on the device machine

`export` writes DIR/<ref> (slashes become '-'); keep DIR in an ignored folder and carry it.
`run` times each tree with its own `tools/gpu_check.py --skip-tests --no-fla`; `--tests`
first runs each tree's GPU tests (its `gpu_check.py --skip-bench`) and leaves out the trees
that fail them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import MODES, parse_modes  # noqa: E402  (this tree's, beside this file)

TEST_TIMEOUT_S = 300  # a tree whose kernels hang is dropped, not waited on


def export(into: Path, refs: list[str], repo: Path = Path(".")) -> list[Path]:
    """`git archive` of each ref of `repo` into `into`/<ref with '/' as '-'>; returns the
    trees. An existing tree is never overwritten."""
    trees = []
    for ref in refs:
        tree = into / ref.replace("/", "-")
        tree.mkdir(parents=True, exist_ok=False)
        archive = subprocess.run(["git", "archive", ref], cwd=repo, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        trees.append(tree)
    return trees


def figures(report: dict) -> dict[str, float]:
    """A gpu_check report as flat {figure: value}: decode and batched decode in us (each
    launch of a batched call too), packed and plain prefill in ms, each step of a prefill and
    the portable walk's figures (where the layer took the Hopper one) as figures of their own."""
    out: dict[str, float] = {}
    for d in report.get("decode", []):
        key = f"decode {d['preset']} K={d['k']} {'graph' if d['graph'] else 'eager'}"
        out[f"{key} us"] = d["us"]
    for d in report.get("batch", []):
        key = f"{d['mode']} {d['preset']} B={d['batch']} K={d['k']}"
        out[f"{key} us"] = d["us"]
        for launch, us in (d.get("kernels_us") or {}).items():
            out[f"{key} {launch} us"] = us
    for v in report.get("varlen", []):
        key = f"varlen {v['preset']} {v['mix']}"
        out[f"{key} ms"], out[f"{key} checkpointed ms"] = v["ms"], v["ms_checkpoints"]
        out[f"{key} one sequence ms"] = v["one_ms"]
    for p in report.get("prefill", []):
        key = f"prefill {p['preset']} T={p['tokens']}"
        out[f"{key} layer ms"] = p["ms"]
        out[f"{key} core ms"] = p["core_ms"]
        out[f"{key} GEMMs ms"] = p["gemm_ms"]
        for step, ms in p["kernels_ms"].items():
            out[f"{key} {step} ms"] = ms
        for name in ("intra_ms", "hopper_walk_ms", "portable_walk_ms", "portable_core_ms"):
            if p.get(name) is not None:
                out[f"{key} {name.removesuffix('_ms').replace('_', ' ')} ms"] = p[name]
    return out


def table(names: list[str], runs: dict[str, list[dict[str, float]]]) -> str:
    """One row per figure: each tree's runs ('a / b'), then its median over the first
    tree's. Figures missing from a tree's runs show as '-'."""
    keys = list(dict.fromkeys(k for n in names for r in runs[n] for k in r))
    base = names[0]
    rows = [["figure", *names, *(f"{n} / {base}" for n in names[1:])]]
    for k in keys:
        vals = {n: [r[k] for r in runs[n] if k in r] for n in names}
        cells = [" / ".join(f"{v:.3f}" for v in vals[n]) or "-" for n in names]
        ratios = [f"{statistics.median(vals[n]) / statistics.median(vals[base]):.3f}"
                  if vals[n] and vals[base] else "-" for n in names[1:]]
        rows.append([k, *cells, *ratios])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _gpu_tests_pass(tree: Path) -> bool:
    """The tree's own GPU tests, through its gpu_check (the same command as its CI on a GPU)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    try:
        p = subprocess.run([sys.executable, "tools/gpu_check.py", "--skip-bench"], cwd=tree,
                           env=env, capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"{tree}: GPU tests ran past {TEST_TIMEOUT_S} s: left out", flush=True)
        return False
    summary = [ln for ln in p.stdout.splitlines() if ln.startswith("tests:")]
    print(f"{tree}: " + (summary[-1] if summary else p.stderr.strip()[-2000:]), flush=True)
    return p.returncode == 0


def _measure(tree: Path, bench_args: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=str(tree), OUT=out)
        p = subprocess.run([sys.executable, "tools/gpu_check.py", "--skip-tests", "--no-fla",
                            *bench_args], cwd=tree, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{tree}: gpu_check failed ({p.returncode}):\n{p.stderr[-4000:]}")
        return figures(json.loads(Path(out, "gpu_check.json").read_text()))


def run(trees: list[Path], rounds: int, tests: bool, bench_args: list[str],
        measure=_measure) -> str:
    """The table of `rounds` rounds over the trees (each tree's own gpu_check, by `measure`),
    also printed after each tree's run, so a call cut short by its time limit still leaves
    the figures measured so far in its output."""
    names = [t.name for t in trees]
    if len(set(names)) != len(names):
        raise SystemExit(f"trees need distinct directory names, got {names}")
    if tests:
        trees = [t for t in trees if _gpu_tests_pass(t)]
        names = [t.name for t in trees]
    if not trees:
        raise SystemExit("no tree left to measure")
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for i in range(rounds):
        for tree in trees:
            runs[tree.name].append(measure(tree, bench_args))
            print(f"round {i + 1}: {tree.name} done\n{table(names, runs)}", flush=True)
    return table(names, runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="git archive refs into trees")
    ex.add_argument("into", type=Path)
    ex.add_argument("refs", nargs="+")
    rn = sub.add_parser("run", help="measure trees in turn (device machine)")
    rn.add_argument("trees", nargs="+", type=Path)
    rn.add_argument("--rounds", type=int, default=2)
    rn.add_argument("--tests", action="store_true", help="each tree's GPU tests first")
    rn.add_argument("--only", type=parse_modes,
                    help=f"benchmark modes, comma-separated ({', '.join(MODES)})")
    rn.add_argument("--tokens", help="prefill lengths, comma-separated")
    rn.add_argument("--batch", help="batched decode's sequence counts, comma-separated")
    rn.add_argument("--presets", help="presets, comma-separated")
    args = ap.parse_args(argv)
    if args.cmd == "export":
        for tree in export(args.into, args.refs):
            print(tree)
        return 0
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    missing = [str(t) for t in args.trees if not (t / "tools" / "gpu_check.py").is_file()]
    if missing:
        ap.error(f"not a kdarun tree (no tools/gpu_check.py): {', '.join(missing)}")
    bench_args = [f"--{name}={getattr(args, name)}" for name in ("tokens", "batch", "presets")
                  if getattr(args, name)] + ([f"--only={','.join(args.only)}"] if args.only else [])
    print(run([t.resolve() for t in args.trees], args.rounds, args.tests, bench_args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
