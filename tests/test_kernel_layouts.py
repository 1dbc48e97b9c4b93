"""The launch wrappers in kernels.py mirror constants and shared-memory layouts that live in
the CUDA sources; a host program compiled from those sources prints them, and they must agree.
Skipped where nvcc is missing (CI has it: it compiles every kernel file)."""

from __future__ import annotations

import re
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

from kdarun import kernels
from kdarun.backend import kernels_dir
from kdarun.config import CHUNK, MAX_CONV_KERNEL, MAX_DECODE_ROWS

PRINT_CHUNK_LAYOUTS = r"""
#include "chunk.cu"
#include <cstdio>
int main() {
    printf("CH %d\nTHREADS %d\nAP %d\nintra %d\n", CH, THREADS, AP, Intra::FLOATS * 4);
    printf("MAX_W %d\n", MAX_W);
    printf("walk_64 %d\nwalk_128 %d\n", Walk<64>::BYTES, Walk<128>::BYTES);
    printf("walk_rows %d\nwalk_block %d\n", Walk<128>::VS, Walk<128>::BLOCK);
    for (int n = 0; n < CH; ++n)
        for (int p = 0; p < 64; ++p) printf("img_%d_%d %d\n", n, p, img_word(CH, n, p));
    for (int t = 0; t < CH; ++t)
        for (int d = 0; d < 128; ++d) printf("wimg_%d_%d %d\n", d, t, w_word(d, t));
    for (int t = 0; t < CH; ++t)
        for (int d = 0; d < 128; ++d) printf("park128_%d_%d %d\n", t, d, park_word<128>(t, d));
    for (int t = 0; t < CH; ++t)
        for (int d = 0; d < 64; ++d) printf("park64_%d_%d %d\n", t, d, park_word<64>(t, d));
    for (int t = 0; t < CH; ++t)
        for (int v = 0; v < WALK_VS; ++v) printf("u_%d_%d %d\n", t, v, u_word(t, v));
}
"""


@pytest.fixture(scope="module")
def chunk_layouts(tmp_path_factory) -> dict[str, int]:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    d = tmp_path_factory.mktemp("layouts")
    (d / "print.cu").write_text(PRINT_CHUNK_LAYOUTS)
    # PTX only for the device side (no ptxas): the host program is all that runs
    subprocess.run([nvcc, "-arch=compute_90", "-I", str(kernels_dir()), "-o", str(d / "print"),
                    str(d / "print.cu")], check=True, capture_output=True)
    out = subprocess.run([str(d / "print")], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_chunk_constants_match(chunk_layouts):
    assert chunk_layouts["CH"] == CHUNK
    assert chunk_layouts["THREADS"] == kernels.THREADS
    assert chunk_layouts["AP"] == kernels.CHUNK_AP
    assert chunk_layouts["MAX_W"] == MAX_CONV_KERNEL  # the conv kernels' widest window


def test_chunk_shared_memory_matches(chunk_layouts):
    assert chunk_layouts["intra"] == kernels.intra_smem_bytes()
    for d in (64, 128):
        assert chunk_layouts[f"walk_{d}"] == kernels.walk_smem_bytes(d), d
    assert chunk_layouts["walk_rows"] == kernels.WALK_ROWS
    assert chunk_layouts["walk_block"] == kernels.WALK_THREADS


def test_walk_image_matches(chunk_layouts):
    """The host backend lays the chunk operands out exactly as the CUDA kernels write and the
    walk's bulk copies stage them (img_word in chunk.cu), here for a [C, 128] block."""
    from kdarun.host_kernels import from_walk_image, to_walk_image
    words = np.arange(CHUNK * 128, dtype=np.uint32).reshape(CHUNK, 128)  # split_words' order
    image = to_walk_image(words)
    for n in range(CHUNK):
        for p in range(64):
            at = chunk_layouts[f"img_{n}_{p}"]
            assert image[at] == words[n, 2 * p]  # hi of pair p
            assert image[at + CHUNK * 64] == words[n, 2 * p + 1]  # its lo, a plane on
    assert np.array_equal(from_walk_image(image, CHUNK), words)


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


def test_w_image_matches(chunk_layouts):
    """The host backend lays w out as the CUDA solve writes it and the walk reads it (w_word:
    MN-major, tokens t and t ^ 1 of dimension d in one word, t even in the low half)."""
    from kdarun.host_kernels import from_walk_image_mn, to_walk_image_mn
    x = np.random.default_rng(0).standard_normal((CHUNK, 128)).astype(np.float32)  # [t, d]
    image = to_walk_image_mn(x)
    halves = image.view(np.uint16)
    hi = x.astype(ml_dtypes.bfloat16)
    lo = (x - hi.astype(np.float32)).astype(ml_dtypes.bfloat16)
    for d in range(128):
        for t in range(CHUNK):
            at = 2 * chunk_layouts[f"wimg_{d}_{t}"] + (t & 1)
            assert halves[at] == hi[t, d].view(np.uint16)
            assert halves[at + CHUNK * 128] == lo[t, d].view(np.uint16)  # a plane on
    assert np.array_equal(from_walk_image_mn(image, CHUNK),
                          hi.astype(np.float32) + lo.astype(np.float32))


def test_u_slices_match(chunk_layouts):
    """The host backend places u[t][v] of a slice where the CUDA solve writes it and the walk
    reads it (u_word), one word each."""
    from kdarun.host_kernels import swizzle_u
    x = np.arange(CHUNK * kernels.WALK_ROWS, dtype=np.float32).reshape(CHUNK, kernels.WALK_ROWS)
    placed = swizzle_u(x).ravel()
    for t in range(CHUNK):
        for v in range(kernels.WALK_ROWS):
            assert placed[chunk_layouts[f"u_{t}_{v}"]] == x[t, v], (t, v)
    assert np.array_equal(swizzle_u(swizzle_u(x)), x)


def test_decode_split_matches():
    src = (kernels_dir() / "recurrent.cu").read_text()
    assert int(re.search(r"^#define SPLIT (\d+)", src, re.M).group(1)) == kernels.DECODE_SPLIT


def test_conv_tokens_match():
    src = (kernels_dir() / "conv.cu").read_text()
    assert int(re.search(r"^#define CONV_TOKENS (\d+)", src, re.M).group(1)) == kernels.CONV_TOKENS


def test_conv_kernels_exist_on_both_backends():
    """kernels.py launches prefill_conv_qkv_w4 for width 4 and prefill_conv_qkv otherwise."""
    from kdarun.host_kernels import HOST_KERNELS
    src = (kernels_dir() / "conv.cu").read_text()
    compiled = set(re.findall(r'^extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?'
                              r'(\w+)\(', src, re.M))
    names = {"prefill_conv_qkv", "prefill_conv_qkv_w4", "conv_roll_state"}
    assert names <= compiled and names <= set(HOST_KERNELS["conv"])


def test_gemv_constants_match():
    src = (kernels_dir() / "gemv.cu").read_text()
    define = lambda name: int(re.search(rf"^#define {name} (\d+)", src, re.M).group(1))  # noqa: E731
    assert define("WARPS") == kernels.GEMV_WARPS
    assert define("TILE") == kernels.GEMV_TILE
    assert define("SK") == kernels.GEMV_STAGE_K
    assert define("STAGES") == kernels.GEMV_STAGES
    bounds = re.findall(r"__launch_bounds__\(WARPS \* 32, (\d+)\)", src)
    assert bounds and {int(b) for b in bounds} == {kernels.GEMV_BLOCKS_PER_SM}
    assert define("MAX_ROWS") == MAX_DECODE_ROWS


def test_chunk_entries_are_the_launched_ones(tmp_path):
    """chunk.cu instantiates every kernel the wrappers launch (both head dims; the intra kernel
    and the walk), and nothing else."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    ptx = tmp_path / "chunk.ptx"
    subprocess.run([nvcc, "-arch=compute_90", "-std=c++17", "-I", str(kernels_dir()), "-ptx",
                    "-o", str(ptx), str(kernels_dir() / "chunk.cu")], check=True,
                   capture_output=True)
    entries = set(re.findall(r"\.entry (\w+)\(", ptx.read_text()))
    assert entries == ({f"kda_chunk_intra_d{d}" for d in (64, 128)}
                       | {f"kda_chunk_inter_d{d}" for d in (64, 128)})
