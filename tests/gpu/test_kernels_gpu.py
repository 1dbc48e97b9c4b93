"""The CUDA backend launches each kernel with the dynamic shared memory its source exports
(`<kernel>_smem`), read back from the NVRTC build the runtime uses."""

from __future__ import annotations

from kdarun import Glm5NextKdaKernels, synthetic


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
    assert 48 * 1024 < smem["kda_chunk_intra_d64"] <= smem["kda_chunk_intra_d128"]
    assert 48 * 1024 < smem[f"{walk[1]}_d64"] <= smem[f"{walk[1]}_d128"] <= 227 * 1024
