#!/usr/bin/env python3
"""Which instructions a kernel spends its issue slots and its stalls on, from Nsight Compute's
source counters (clocks left alone):

    ncu --clock-control none -k regex:kda_chunk --launch-skip 4 --launch-count 2 \
        --section SourceCounters -o rep python3 tools/profile_layer.py --preset glm-5.3-flash
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 tools/sass_mix.py sass.csv

prints, per kernel, each mnemonic's share of the executed warp instructions and of the warp
stall samples, largest first. ncu may list a kernel more than once; the first listing counts.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MixRow:
    mnemonic: str  # e.g. "IMAD.MOV.U32" (a predicate guard is dropped)
    instructions: float  # share of the kernel's executed warp instructions
    samples: float  # share of its warp stall samples


def opcode_mix(path: str | Path) -> dict[str, list[MixRow]]:
    """Per kernel name, its mnemonics by executed instructions, largest first."""
    sections: dict[str, tuple[Counter, Counter]] = {}
    counts = None
    header: list[str] = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                # a kernel listed again is not counted twice
                fresh = row[1] not in sections
                counts = sections.setdefault(row[1], (Counter(), Counter())) if fresh else None
            elif row[0] == "Address":
                header = row
            elif counts is not None:
                if not header:
                    raise ValueError(f"{path}: an instruction row before the column names")
                words = row[header.index("Source")].split()
                mnemonic = words[1] if words[0].startswith("@") else words[0]
                for c, col in zip(counts, ("Instructions Executed",
                                           "Warp Stall Sampling (All Samples)")):
                    c[mnemonic] += int(row[header.index(col)].replace(",", ""))
    mix = {}
    for name, (instr, samples) in sections.items():
        ti, ts = sum(instr.values()) or 1, sum(samples.values()) or 1
        mix[name] = [MixRow(m, n / ti, samples[m] / ts) for m, n in instr.most_common()]
    return mix


def main() -> int:
    ap = argparse.ArgumentParser(description="executed instructions and stall samples by SASS "
                                             "mnemonic, per kernel")
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass")
    ap.add_argument("--top", type=int, default=15, help="mnemonics a kernel")
    args = ap.parse_args()
    for name, rows in opcode_mix(args.csv).items():
        print(f"{name}: instructions / stall samples")
        for r in rows[:args.top]:
            print(f"  {r.mnemonic:28s} {100 * r.instructions:5.1f}%  {100 * r.samples:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
