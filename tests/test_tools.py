"""Developer tools' host-side parts: the SASS mix read from an Nsight Compute listing, the
tree A/B's export, flattening and table, the intra kernel's phase marks, the sweep's
variants, gpu_check's modes, budget and tree id, and the timeline's launches."""

import argparse
import functools
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sass_mix, ab_trees, chunk_phases = _tool("sass_mix"), _tool("ab_trees"), _tool("chunk_phases")
timeline = _tool("timeline")

COLS = ('"Address","Source","Warp Stall Sampling (All Samples)",'
        '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed"')


def _listing(kernel: str, rows: list[tuple[str, int, int]]) -> str:
    body = "".join(f'"0x{i:x}","{src}","{smp}","0","{n:,}"\n'
                   for i, (src, n, smp) in enumerate(rows))
    return f'"Kernel Name","{kernel}",\n{COLS}\n{body}'


def test_shares_per_mnemonic_with_guards_and_repeated_views(tmp_path):
    walk = [("IMAD.MOV.U32 R1, RZ, RZ, R2", 3000, 10),
            ("@P0 HMMA.16816.F32.BF16 R4, R8, R12, R4", 1000, 30),
            ("IMAD.MOV.U32 R3, RZ, RZ, R5", 1000, 0), ("EXIT", 0, 0)]
    other = [("FFMA R1, R2, R3, R1", 7, 1)]
    csv = tmp_path / "sass.csv"
    # ncu lists each kernel once per view: only the first listing counts
    again = [("FFMA R1, R2, R3, R1", 5000, 50)]
    csv.write_text(_listing("walk", walk) + _listing("walk", again) + _listing("other", other))
    mix = sass_mix.opcode_mix(csv)
    assert list(mix) == ["walk", "other"]
    rows = {r.mnemonic: r for r in mix["walk"]}
    assert set(rows) == {"IMAD.MOV.U32", "HMMA.16816.F32.BF16", "EXIT"}
    assert [r.mnemonic for r in mix["walk"]][:2] == ["IMAD.MOV.U32", "HMMA.16816.F32.BF16"]
    assert rows["IMAD.MOV.U32"].instructions == pytest.approx(0.8)
    assert rows["HMMA.16816.F32.BF16"].instructions == pytest.approx(0.2)
    assert rows["HMMA.16816.F32.BF16"].samples == pytest.approx(0.75)
    assert mix["other"][0].instructions == pytest.approx(1.0)


def test_rows_before_the_column_names_are_refused(tmp_path):
    csv = tmp_path / "bad.csv"
    csv.write_text('"Kernel Name","walk",\n"0x0","EXIT","0","0","1"\n')
    with pytest.raises(ValueError, match="before the column names"):
        sass_mix.opcode_mix(csv)


def _report(layer_ms: float, intra_ms: float, with_decode: bool = True) -> dict:
    decode = [{"preset": "tiny", "k": 1, "graph": True, "us": 30.0}] if with_decode else []
    prefill = [{"preset": "tiny", "tokens": 64, "ms": layer_ms, "core_ms": 0.5, "gemm_ms": 0.25,
                "kernels_ms": {"chunk_intra": intra_ms, "conv": 0.125}}]
    return {"decode": decode, "prefill": prefill}


def test_figures_flatten_every_step():
    f = ab_trees.figures(_report(2.0, 0.75))
    assert f == {"decode tiny K=1 graph us": 30.0, "prefill tiny T=64 layer ms": 2.0,
                 "prefill tiny T=64 core ms": 0.5, "prefill tiny T=64 GEMMs ms": 0.25,
                 "prefill tiny T=64 chunk_intra ms": 0.75, "prefill tiny T=64 conv ms": 0.125}


def test_figures_take_batched_decode_packed_prefill_and_the_portable_walk():
    report = {"batch": [{"mode": "batch-decode", "preset": "tiny", "batch": 64, "k": 1,
                         "us": 150.0, "kernels_us": {"front_end": 40.0}}],
              "varlen": [{"preset": "tiny", "mix": "32x128", "ms": 1.5, "ms_checkpoints": 1.625,
                          "one_ms": 1.25}],
              "prefill": [{"preset": "tiny", "tokens": 64, "ms": 2.0, "core_ms": 0.5,
                           "gemm_ms": 0.25, "kernels_ms": {}, "hopper_walk_ms": 0.125,
                           "portable_walk_ms": 0.25, "portable_core_ms": None}]}
    assert ab_trees.figures(report) == {
        "batch-decode tiny B=64 K=1 us": 150.0, "batch-decode tiny B=64 K=1 front_end us": 40.0,
        "varlen tiny 32x128 ms": 1.5, "varlen tiny 32x128 checkpointed ms": 1.625,
        "varlen tiny 32x128 one sequence ms": 1.25, "prefill tiny T=64 layer ms": 2.0,
        "prefill tiny T=64 core ms": 0.5, "prefill tiny T=64 GEMMs ms": 0.25,
        "prefill tiny T=64 hopper walk ms": 0.125, "prefill tiny T=64 portable walk ms": 0.25}


def test_table_gives_runs_and_ratio_of_medians():
    runs = {"main": [ab_trees.figures(_report(ms, 1.0)) for ms in (2.0, 4.0, 9.0)],
            "new": [ab_trees.figures(_report(2.0, 0.5, with_decode=False))]}
    lines = ab_trees.table(["main", "new"], runs).splitlines()
    assert lines[0].split() == ["figure", "main", "new", "new", "/", "main"]
    layer = next(ln for ln in lines if ln.startswith("prefill tiny T=64 layer ms"))
    # the median of main is 4.0 (a mean would be 5.0)
    assert layer.split()[-7:] == ["2.000", "/", "4.000", "/", "9.000", "2.000", "0.500"]
    intra = next(ln for ln in lines if ln.startswith("prefill tiny T=64 chunk_intra ms"))
    assert intra.split()[-1] == "0.500"
    decode = next(ln for ln in lines if ln.startswith("decode tiny"))
    assert decode.split()[-2:] == ["-", "-"]  # no run of `new` has it


def test_run_prints_the_table_after_each_tree(tmp_path, capsys):
    """A call cut short (here: the second tree's measurement fails) has already printed the
    first tree's figures; trees of one name are refused before anything is measured."""
    a, b = tmp_path / "main", tmp_path / "new"

    def measure(tree, bench_args):
        if tree == b:
            raise SystemExit("cut short")
        return ab_trees.figures(_report(2.0, 0.75))

    with pytest.raises(SystemExit, match="cut short"):
        ab_trees.run([a, b], 1, False, [], measure)
    out = capsys.readouterr().out
    assert "round 1: main done" in out
    layer = next(ln for ln in out.splitlines() if ln.startswith("prefill tiny T=64 layer ms"))
    assert layer.split()[-3:] == ["2.000", "-", "-"]  # main's run; none of new's yet
    with pytest.raises(SystemExit, match="distinct directory names"):
        ab_trees.run([a, tmp_path / "x" / "main"], 1, False, [], measure)


def test_export_writes_each_ref_as_a_tree(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    (repo / "tools" / "gpu_check.py").write_text("# a tree\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    for cmd in (["init", "-q", "-b", "wip/x"], ["add", "-A"], ["commit", "-q", "-m", "x"]):
        subprocess.run(git + cmd, check=True, capture_output=True)
    (tree,) = ab_trees.export(tmp_path / "trees", ["wip/x"], repo)
    assert tree == tmp_path / "trees" / "wip-x"
    assert (tree / "tools" / "gpu_check.py").read_text() == "# a tree\n"
    with pytest.raises(FileExistsError):  # an existing tree is never overwritten
        ab_trees.export(tmp_path / "trees", ["wip/x"], repo)


def test_run_refuses_what_is_not_a_tree(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ab_trees.main(["run", str(tmp_path)])
    assert "not a kdarun tree" in capsys.readouterr().err


def test_chunk_phases_marks_every_phase_of_both_kernels(tmp_path):
    """chunk.cu marks each phase the tool names, the intra kernel's then the walk's, and its
    marked build compiles (where nvcc is on PATH, as in CI)."""
    from kdarun.backend import kernels_dir
    from kdarun.kernels import compile_defines
    src = (kernels_dir() / "chunk.cu").read_text()
    walk = src.index("// ---- walk:")
    marks = lambda text: {int(m) for m in re.findall(r"PHASE\((\d+)\);", text)}  # noqa: E731
    intra = marks(src[:walk])
    intra |= {int(m) for pair in re.findall(r"PHASE\(r == 0 \? (\d) : (\d)\)", src) for m in pair}
    assert sorted(intra) == list(range(len(chunk_phases.INTRA_PHASES)))
    first = chunk_phases.WALK_FIRST
    assert sorted(marks(src[walk:])) == list(range(first, first + len(chunk_phases.WALK_PHASES)))
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    for arch in ("sm_90", "sm_90a"):
        subprocess.run([nvcc, f"-arch={arch}", "-std=c++17", *compile_defines(), chunk_phases.DEFINE, "-I",
                        str(kernels_dir()), "-cubin", "-o", str(tmp_path / "marked.cubin"),
                        str(kernels_dir() / "chunk.cu")], check=True, capture_output=True)


def test_sweep_variants_are_the_product_of_the_sets():
    from kdarun import kernels
    sweep = _tool("sweep")
    got = sweep.parse_sets(["GEMV_SLAB_TILES=4,8", "PORTABLE_WALK_STAGES=4,5"], kernels)
    assert got == [{"GEMV_SLAB_TILES": 4, "PORTABLE_WALK_STAGES": 4},
                   {"GEMV_SLAB_TILES": 4, "PORTABLE_WALK_STAGES": 5},
                   {"GEMV_SLAB_TILES": 8, "PORTABLE_WALK_STAGES": 4},
                   {"GEMV_SLAB_TILES": 8, "PORTABLE_WALK_STAGES": 5}]
    assert sweep.parse_sets([], kernels) == [{}]
    assert sweep.label(got[1]) == "GEMV_SLAB_TILES=4 PORTABLE_WALK_STAGES=5"
    for bad, why in (("GEMV_SLAB_TILES", "expected NAME=v1"), ("SMEM_PER_BLOCK=1", "not an int"),
                     ("smem_per_block=1", "not an int"), ("GEMV_SLAB_TILES=4,x", "integers")):
        with pytest.raises(SystemExit, match=why):
            sweep.parse_sets([bad], kernels)
    with pytest.raises(SystemExit, match="given twice"):
        sweep.parse_sets(["GEMV_SLAB_TILES=4", "GEMV_SLAB_TILES=8"], kernels)


def test_gpu_check_modes_keep_their_order_and_refuse_unknown_names():
    gpu_check = _tool("gpu_check")
    assert gpu_check.parse_modes("prefill,batch,prefill") == ["prefill", "batch"]
    assert gpu_check.parse_modes(" decode ") == ["decode"]
    for bad in ("prefil", "prefill,", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="unknown mode"):
            gpu_check.parse_modes(bad)
    with pytest.raises(SystemExit):  # ab_trees takes the same names
        ab_trees.main(["run", str(ROOT), "--only", "walk"])


def test_gpu_check_budget_lets_nothing_start_past_its_end():
    gpu_check = _tool("gpu_check")
    now = [0.0]
    budget = gpu_check.Budget(10.0, clock=lambda: now[0])
    assert budget.allows("prefill T=64")
    now[0] = 9.9
    assert budget.allows("prefill T=1024")
    now[0] = 10.0
    assert not budget.allows("prefill T=4096") and not budget.allows("batch B=64 K=1")
    assert budget.skipped == ["prefill T=4096", "batch B=64 K=1"]
    unlimited = gpu_check.Budget(None, clock=lambda: 1e12)
    assert unlimited.allows("decode") and unlimited.skipped == []


def test_gpu_check_tree_id_names_the_code_not_the_copy(tmp_path):
    """Two copies of a tree have one id; a byte changed in a kernel, a file added, or a file
    renamed gives another; caches do not count."""
    gpu_check = _tool("gpu_check")
    a, b = tmp_path / "a", tmp_path / "b"
    for d in gpu_check.TREE_DIRS:
        shutil.copytree(ROOT / d, a / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(a, b)
    (b / "kdarun" / "__pycache__").mkdir(exist_ok=True)
    (b / "kdarun" / "__pycache__" / "x.pyc").write_bytes(b"cache")
    assert gpu_check.tree_id(a) == gpu_check.tree_id(b) == gpu_check.tree_id(ROOT)
    kernel = b / "kernels_cu" / "gemv.cu"
    kernel.write_bytes(kernel.read_bytes() + b" ")
    changed = gpu_check.tree_id(b)
    assert changed != gpu_check.tree_id(a)
    kernel.rename(b / "kernels_cu" / "gemv2.cu")
    assert gpu_check.tree_id(b) not in (changed, gpu_check.tree_id(a))


def test_timeline_places_each_launch_of_the_replays():
    """Two replays of three launches (given out of order, as activity records may come): per
    launch the median start after the replay's first, duration and gap (negative where the
    launch started before the one ahead ended), and the replay's span."""
    reps = [(0.0, [(0, 30, "front"), (28, 100, "walk"), (101, 110, "o_proj")]),
            (500.0, [(0, 32, "front"), (31, 105, "walk"), (104, 112, "o_proj")])]
    events = [(t0 + a, t0 + b, n) for t0, run in reps for a, b, n in run][::-1]
    rows = timeline.launches(events, 2)
    assert [r["name"] for r in rows[:3]] == ["front", "walk", "o_proj"]
    assert [r["start"] for r in rows[:3]] == [0.0, 29.5, 102.5]
    assert [r["us"] for r in rows] == [31.0, 73.0, 8.5, 111.0]
    assert [r["gap"] for r in rows] == [None, -1.5, 0.0, None]
    table = timeline.format_rows(rows).splitlines()
    assert table[2].split() == ["1", "walk", "29.5", "73.0", "-1.5"]


def test_timeline_refuses_replays_it_cannot_line_up():
    with pytest.raises(SystemExit, match="5 kernel records for 2 replays"):
        timeline.launches([(i, i + 1, "k") for i in range(5)], 2)
    with pytest.raises(SystemExit, match="differ in name or order"):
        timeline.launches([(0, 1, "a"), (2, 3, "b"), (10, 11, "b"), (12, 13, "a")], 2)


def test_sweep_applies_each_variant_and_puts_the_built_values_back():
    """Each variant's constants are set, and the module's cached functions (kernels.py's
    _gemv_shares reads GEMV_BLOCKS_PER_SM) answer from them, not from an earlier variant."""
    sweep = _tool("sweep")
    mod = argparse.Namespace(A=1, B=2)
    mod.cached = functools.cache(lambda: mod.A)
    assert mod.cached() == 1
    seen = [(mod.A, mod.B, mod.cached()) for _ in sweep.applied([{"A": 5}, {"A": 6}], mod)]
    assert seen == [(5, 2, 5), (6, 2, 6)] and (mod.A, mod.B, mod.cached()) == (1, 2, 1)
    with pytest.raises(RuntimeError):  # a loop that stops early puts them back too
        for _ in sweep.applied([{"B": 7}, {"B": 8}], mod):
            raise RuntimeError
    assert (mod.A, mod.B) == (1, 2)
