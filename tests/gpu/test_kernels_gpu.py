"""Kernels on their own: the CUDA backend launches each with the dynamic shared memory its
source exports (`<kernel>_smem`, read back from the NVRTC build the runtime uses); the batch
GEMVs' rows are decode's bits."""

from __future__ import annotations

import numpy as np
import pytest

from kdarun import Glm5NextKdaKernels, kernels, synthetic
from kdarun.dtypes import BF16
from kdarun.kernels import GEMV_COLUMNS, GEMV_WARPS, WG_TILE, dense_split_tiles


def test_exported_shared_memory_reaches_the_launch(cuda):
    kn = Glm5NextKdaKernels(cuda, synthetic.preset_config("tiny"))
    walk = ("chunk_portable", "kda_chunk_inter_portable") if kn.core == "portable" else (
        "chunk", "kda_chunk_inter")  # the walk this GPU takes
    smem = {name: cuda.shared_bytes(kn.modules[fam], name) for fam, name in (
        ("gemv", "dense_gemv_bf16"), ("gemv", "front_end_gemv"), ("chunk", "kda_chunk_intra_d64"),
        ("chunk", "kda_chunk_intra_d128"), (walk[0], f"{walk[1]}_d64"),
        (walk[0], f"{walk[1]}_d128"), ("norm", "gated_rmsnorm"))}
    assert smem["gated_rmsnorm"] == 0  # exports none: takes none
    assert smem["dense_gemv_bf16"] == smem["front_end_gemv"] > 0
    for name in ("front_end_gemv_batch", "dense_gemv_bf16_batch"):  # the slab rings: past 48 KB
        assert 48 * 1024 < cuda.shared_bytes(kn.modules["gemv"], name) <= 227 * 1024, name
    assert 48 * 1024 < cuda.shared_bytes(kn.modules["gemv_wg"], "dense_gemv_wg") <= 227 * 1024
    assert 48 * 1024 < smem["kda_chunk_intra_d64"] <= smem["kda_chunk_intra_d128"]
    assert 48 * 1024 < smem[f"{walk[1]}_d64"] <= smem[f"{walk[1]}_d128"] <= 227 * 1024


@pytest.mark.parametrize("n, k, m, groups", [
    (200, 136, 9, 1), (200, 136, 9, 2), (2304, 4096, 16, 2), (200, 136, 17, 2),
    (130, 1000, 65, 1), (64, 64, 200, 1), (2304, 4096, 64, 1), (2304, 4096, 130, 1),
    (2304, 4096, 300, 1)])
def test_batch_gemv_rows_are_decodes_bits(cuda, monkeypatch, n, k, m, groups):
    """dense_gemv_bf16_batchm over m token rows (up to DECODE_GEMV_GROUPS column groups
    decode's launch, two in its _x2 entry; past them from DENSE_WG_FROM_ROWS on sm_90a
    dense_gemv_wg, by tensor maps and warpgroup MMAs, its K shares split over blocks up to
    DENSE_SPLIT_ROWS rows; otherwise the slab kernel) equals decode's launch over each 8 of
    them, bit for bit, twice in a row (the split's counts are left zero), at shapes whose
    weight rows, token rows and K end inside a tile, a slab, a stage and a TMA box; the output
    row past m keeps its poison."""
    monkeypatch.setattr(kernels, "DECODE_GEMV_GROUPS", groups)
    kn = Glm5NextKdaKernels(cuda, synthetic.preset_config("tiny"))
    assert kn.wg == (cuda.compute_capability == 90 and cuda.has_wgmma)
    rng = np.random.default_rng(n + k + m)
    w = cuda.upload((rng.standard_normal((n, k), np.float32) * 0.05).astype(BF16))
    x = cuda.upload(rng.standard_normal((m, k), np.float32).astype(BF16))
    poison = np.full((m + 1, n), np.nan, np.float32).astype(BF16)
    y, ref = cuda.upload(poison), cuda.upload(poison)
    tiles = dense_split_tiles(m, n)
    part = cuda.upload(np.full((tiles * GEMV_WARPS, WG_TILE * WG_TILE), np.nan, np.float32))
    count = cuda.upload(np.zeros(tiles, np.int32))
    for r0 in range(0, m, GEMV_COLUMNS):
        kn.dense_gemv_bf16_batchm(0, w, x + 2 * r0 * k, ref + 2 * r0 * n, n, k,
                                  min(GEMV_COLUMNS, m - r0), part, count)
    want = cuda.download(ref, (m + 1, n), BF16).view(np.uint16)
    assert np.isfinite(want[:m].view(BF16).astype(np.float32)).all()
    for _ in range(2):
        kn.dense_gemv_bf16_batchm(0, w, x, y, n, k, m, part, count)
        got = cuda.download(y, (m + 1, n), BF16).view(np.uint16)
        assert np.array_equal(got[:m], want[:m])
        assert np.array_equal(got[m], poison[m].view(np.uint16))
        assert not cuda.download(count, (tiles,), np.int32).any()
        cuda.copy_h2d(y, poison, 0)
    for p in (w, x, y, ref, part, count):
        cuda.free(p)
