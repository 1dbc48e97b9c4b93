"""Developer tools that run without a GPU: the SASS mix read from an Nsight Compute listing."""

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "sass_mix", Path(__file__).resolve().parent.parent / "tools" / "sass_mix.py")
sass_mix = sys.modules["sass_mix"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_mix)

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
