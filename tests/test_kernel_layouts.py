"""The kernel sources as built: every launched entry exists on both backends, each kernel's
dynamic shared memory is exported for the launch and fits an SM, and the chunk kernels' private
operand layouts put every element in a word of its own. The sources are compiled here with
nvcc and the flags the runtime builds them with; skipped where nvcc is missing (CI has it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kdarun.backend import kernels_dir
from kdarun.config import CHUNK
from kdarun.host_kernels import HOST_KERNELS
from kdarun.kernels import FAMILIES, WALK_ROWS, compile_defines

SM90_SMEM_PER_BLOCK = 227 * 1024  # the most dynamic shared memory one block may take on sm_90

PRINT_CHUNK_LAYOUTS = r"""
#include "chunk.cu"
#include <cstdio>
int main() {
    for (int n = 0; n < CHUNK; ++n)
        for (int p = 0; p < 64; ++p) printf("img_%d_%d %d\n", n, p, img_word(CHUNK, n, p));
    for (int t = 0; t < CHUNK; ++t)
        for (int d = 0; d < 128; ++d) printf("wimg_%d_%d %d\n", d, t, w_word(d, t));
    for (int t = 0; t < CHUNK; ++t)
        for (int d = 0; d < 128; ++d) printf("park128_%d_%d %d\n", t, d, park_word<128>(t, d));
    for (int t = 0; t < CHUNK; ++t)
        for (int d = 0; d < 64; ++d) printf("park64_%d_%d %d\n", t, d, park_word<64>(t, d));
    for (int t = 0; t < CHUNK; ++t)
        for (int v = 0; v < WALK_ROWS; ++v) printf("u_%d_%d %d\n", t, v, u_word(t, v));
}
"""


def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    return nvcc


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> dict[str, str]:
    """Each kernel family's PTX, built with the runtime's flags (sm_90a: the walk's MMAs)."""
    nvcc, d = _nvcc(), tmp_path_factory.mktemp("ptx")
    out = {}
    for fam in FAMILIES:
        dst = d / f"{fam}.ptx"
        subprocess.run([nvcc, "-arch=compute_90a", "-std=c++17", "-I", str(kernels_dir()),
                        *compile_defines(), "-ptx", "-o", str(dst),
                        str(kernels_dir() / f"{fam}.cu")], check=True, capture_output=True)
        out[fam] = dst.read_text()
    return out


@pytest.fixture(scope="module")
def chunk_layouts(tmp_path_factory) -> dict[str, int]:
    nvcc, d = _nvcc(), tmp_path_factory.mktemp("layouts")
    (d / "print.cu").write_text(PRINT_CHUNK_LAYOUTS)
    # PTX only for the device side (no ptxas): the host program is all that runs
    subprocess.run([nvcc, "-arch=compute_90", "-std=c++17", "-I", str(kernels_dir()),
                    *compile_defines(), "-o", str(d / "print"), str(d / "print.cu")],
                   check=True, capture_output=True)
    out = subprocess.run([str(d / "print")], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def _entries(ptx: str) -> list[tuple[str, str]]:
    """(entry name, its body) of every kernel in a PTX module."""
    heads = list(re.finditer(r"\.entry (\w+)\(", ptx))
    return [(m.group(1), ptx[m.end():heads[i + 1].start() if i + 1 < len(heads) else len(ptx)])
            for i, m in enumerate(heads)]


def test_sources_refuse_a_build_without_the_geometry(tmp_path):
    nvcc = _nvcc()
    p = subprocess.run([nvcc, "-arch=compute_90", "-I", str(kernels_dir()), "-ptx", "-o",
                        str(tmp_path / "x.ptx"), str(kernels_dir() / "gate.cu")],
                       capture_output=True, text=True)
    assert p.returncode != 0 and "compile_defines" in p.stderr


def test_every_entry_has_a_host_twin(ptx):
    """The two backends launch kernels by the same names with the same arguments: each CUDA
    entry has a NumPy twin in its family, and no twin lacks its kernel."""
    for fam in FAMILIES:
        assert {name for name, _ in _entries(ptx[fam])} == set(HOST_KERNELS[fam]), fam


def test_dynamic_shared_memory_is_exported_and_fits(ptx):
    """Every kernel that takes dynamic shared memory exports its size as <kernel>_smem (the CUDA
    backend launches with it; a missing export would launch it with none), and that size fits
    one sm_90 block; nothing else is exported."""
    taking = set()
    for fam in FAMILIES:
        exported = {m.group(1): int(m.group(2)) for m in
                    re.finditer(r"\.u32 (\w+)_smem = (\d+);", ptx[fam])}
        dynamic = re.findall(r"\.extern \.shared .*?(\w+)\[\];", ptx[fam])
        for name, body in _entries(ptx[fam]):
            if any(re.search(rf"\b{sym}\b", body) for sym in dynamic):
                taking.add(name)
                assert name in exported, f"{name} takes dynamic shared memory but exports no size"
                assert 0 < exported[name] <= SM90_SMEM_PER_BLOCK, (name, exported[name])
        assert set(exported) <= taking, fam
    assert taking == {f"{g}{s}" for g in ("dense_gemv_bf16", "front_end_gemv")
                      for s in ("", "_x2", "_batch")} | {"dense_gemv_wg", "front_end_wg"} | {
        f"kda_chunk_{k}_d{d}"
        for k in ("intra", "inter", "core", "inter_portable", "inter_portable_r32")
        for d in (64, 128)} | {
        f"kda_decode_batch_d{d}" for d in (64, 128)}


@pytest.mark.parametrize("name, n, words", [("img", CHUNK, 64), ("u", CHUNK, WALK_ROWS)])
def test_operand_images_give_every_element_its_word(chunk_layouts, name, n, words):
    """img_word (the walk's K-major images) and u_word (u's swizzled slices) are permutations of
    their block: no two elements share a word, none is left out."""
    placed = sorted(chunk_layouts[f"{name}_{i}_{j}"] for i in range(n) for j in range(words))
    assert placed == list(range(n * words))


def test_w_image_gives_every_element_its_half_word(chunk_layouts):
    """w_word (w's MN-major image): tokens t and t ^ 1 of a dimension share a word, t even in
    its low half, and every (dimension, token) takes a half of its own."""
    halves = sorted(2 * chunk_layouts[f"wimg_{d}_{t}"] + (t & 1)
                    for d in range(128) for t in range(CHUNK))
    assert halves == list(range(128 * CHUNK))


@pytest.mark.parametrize("d", [64, 128])
def test_parked_rows_fill_their_solve_block(chunk_layouts, d):
    """The intra kernel parks k exp(G) in exactly the image words that w's rows of the same
    16-row solve block take (park_word, w_word), so the solve reads a block's rows before any
    thread overwrites them, and nothing of another block."""
    for r0 in range(0, CHUNK, 16):
        rows = range(r0, r0 + 16)
        parked = [chunk_layouts[f"park{d}_{t}_{c}"] for t in rows for c in range(d)]
        assert len(set(parked)) == len(parked)  # one word each
        image = {chunk_layouts[f"wimg_{c}_{t}"] + plane * CHUNK * d // 2
                 for plane in (0, 1) for t in rows for c in range(d)}
        assert set(parked) == image


def test_chunk_entries_are_the_launched_ones(ptx):
    """chunk.cu instantiates every kernel the wrappers launch (both head dims; the intra kernel,
    the walk, and the walk beside intra blocks), and nothing else."""
    assert {name for name, _ in _entries(ptx["chunk"])} == {
        f"kda_chunk_{k}_d{d}" for k in ("intra", "inter", "core") for d in (64, 128)}


def test_sources_take_no_value_the_geometry_sets():
    """No kernel source defines a name compile_defines() passes (a second definition would
    either clash or silently win)."""
    names = [f[2:].split("=")[0] for f in compile_defines()]
    for src in Path(kernels_dir()).glob("*.cu*"):
        text = src.read_text()
        for name in names:
            assert not re.search(rf"^\s*#define {name}\b", text, re.M), (src.name, name)
