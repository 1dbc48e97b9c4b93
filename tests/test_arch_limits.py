"""Every kernel fits every GPU kdarun supports: each kernels_cu/ family built with nvcc for each
architecture of kernels.SUPPORTED_ARCHS (with that architecture's compile_defines), and each
entry's registers and shared memory checked against the limits of a block there. The builds
are the runtime's, less NVRTC; skipped where nvcc is missing (CI has it)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kdarun.backend import kernels_dir
from kdarun.host_kernels import HOST_KERNELS
from kdarun.config import MAX_DECODE_ROWS
from kdarun.kernels import (FAMILIES, GEMV_BLOCKS_PER_SM, SMEM_PER_BLOCK, SUPPORTED_ARCHS,
                            THREADS, arch_cc, compile_defines, decode_batch_blocks_per_sm,
                            decode_batch_bulk, decode_batch_smem, gemv_stages)

REGISTERS_PER_BLOCK = 64 * 1024  # 32-bit registers, every capability from 8.0 to 12.x
REGISTERS_PER_THREAD = 255
STATIC_SMEM = 48 * 1024  # static shared memory a block may declare


def _build(arch: str, fam: str, tmp: Path) -> tuple[str, str]:
    """ptxas' report and the PTX of one family built for one architecture."""
    d = tmp / f"{arch}-{fam}"
    d.mkdir()
    p = subprocess.run([shutil.which("nvcc"), f"-arch={arch}", "-std=c++17", "-I",
                        str(kernels_dir()), *compile_defines(arch_cc(arch)), "-cubin",
                        "-Xptxas", "-v", "-keep", "-keep-dir", str(d), "-o", str(d / "k.cubin"),
                        str(kernels_dir() / f"{fam}.cu")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    (ptx,) = d.glob("*.ptx")
    return p.stderr, ptx.read_text()


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[tuple[str, str], tuple[str, str]]:
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    tmp = tmp_path_factory.mktemp("arch")
    jobs = [(arch, fam) for arch in SUPPORTED_ARCHS for fam in FAMILIES]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        done = pool.map(lambda job: _build(*job, tmp), jobs)
        return dict(zip(jobs, done))


def _kernels(report: str, ptx: str) -> dict[str, dict[str, int]]:
    """Each entry's registers, static and exported dynamic shared memory, and block size (its
    __launch_bounds__; THREADS for the element-wise kernels, which launch blocks of THREADS)."""
    out = {}
    for m in re.finditer(r"Compiling entry function '(\w+)'.*?Used (\d+) registers(.*?)\n",
                         report, re.S):
        static = re.search(r"(\d+) bytes smem", m.group(3))
        out[m.group(1)] = {"regs": int(m.group(2)), "static": int(static.group(1)) if static else 0}
    for name, k in out.items():
        dyn = re.search(rf"\.u32 {name}_smem = (\d+);", ptx)
        k["dynamic"] = int(dyn.group(1)) if dyn else 0
        bounds = re.search(rf"\.entry {name}\((?:.|\n)*?\)\s*(\.maxntid (\d+),)?", ptx)
        k["threads"] = int(bounds.group(2)) if bounds.group(2) else THREADS
    return out


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_every_launch_fits_the_architecture(builds, arch):
    cc, limit = arch_cc(arch), SMEM_PER_BLOCK[arch_cc(arch)]
    for fam in FAMILIES:
        kernels = _kernels(*builds[arch, fam])
        # the Hopper walk (alone, or beside intra blocks) exists where its warpgroup MMAs do;
        # every other entry everywhere
        want = {n for n in HOST_KERNELS[fam] if arch == "sm_90a"
                or not n.startswith(("kda_chunk_inter_d", "kda_chunk_core_d"))}
        assert set(kernels) == want, (arch, fam)
        for name, k in kernels.items():
            where = f"{name} on {arch} (capability {cc / 10:.1f})"
            assert k["regs"] <= REGISTERS_PER_THREAD, where
            assert k["regs"] * k["threads"] <= REGISTERS_PER_BLOCK, (where, k)
            assert k["static"] <= STATIC_SMEM, (where, k)
            assert k["static"] + k["dynamic"] <= limit, (where, k, limit)
            if name.removesuffix("_x2") in ("dense_gemv_bf16", "front_end_gemv") and \
                    gemv_stages(cc) > 2:
                # a deeper ring never costs a block an SM (a block's limit standing for the SM's)
                assert GEMV_BLOCKS_PER_SM * (k["static"] + k["dynamic"]) <= limit, (where, k)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_no_build_loses_performance_by_ptxas_report(builds, arch):
    """ptxas reports no "Potential Performance Loss" (C75xx) for any kernel: one warpgroup MMA
    issued on a path of its own, for one, serialises every warpgroup MMA of the walk, which
    changes no result and so shows in no other test."""
    for fam in FAMILIES:
        report = builds[arch, fam][0]
        assert "Performance Loss" not in report, (arch, fam, [
            line for line in report.splitlines() if "Performance Loss" in line])


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_batch_decode_shared_memory(builds, arch):
    """kda_decode_batch's launches size their shared memory by kernels.decode_batch_smem, which
    must agree with the largest the source exports; where it stages state rows by bulk copies,
    a one-token launch's blocks fit an SM as many times as its __launch_bounds__ says (the
    runtime reserves 1 KB a block)."""
    cc = arch_cc(arch)
    kernels = _kernels(*builds[arch, "recurrent"])
    for d in (64, 128):
        k = kernels[f"kda_decode_batch_d{d}"]
        assert k["dynamic"] == decode_batch_smem(cc, d, d, MAX_DECODE_ROWS), (arch, d)
        if decode_batch_bulk(cc):
            block = k["static"] + decode_batch_smem(cc, d, d, 1) + 1024
            assert decode_batch_blocks_per_sm(cc) * block <= SMEM_PER_BLOCK[cc] + 1024, (arch, d)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])  # rows in registers; by bulk copies
def test_batch_decode_smem_formula_is_the_kernels(arch, tmp_path):
    """The shared memory a kda_decode_batch launch passes (kernels.decode_batch_smem) is the
    kernel's own layout (recurrent.cu's decode_batch_smem) at every head size, split and row
    count: a probe built beside the kernels exports the kernel's values."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    cc = arch_cc(arch)
    cases = [(d, d // split, nrows) for d in (64, 128) for split in (1, 2, 4, 8)
             for nrows in range(1, MAX_DECODE_ROWS + 1)]
    probe = tmp_path / "probe.cu"
    probe.write_text('#include "recurrent.cu"\nextern "C" __constant__ int probe_smem[] = {'
                     + ", ".join(f"decode_batch_smem({d}, {r}, {n})" for d, r, n in cases)
                     + "};\n")
    p = subprocess.run([shutil.which("nvcc"), f"-arch={arch}", "-std=c++17", "-I",
                        str(kernels_dir()), *compile_defines(cc), "-ptx", "-o",
                        str(tmp_path / "probe.ptx"), str(probe)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    m = re.search(r"probe_smem\[(\d+)\] = \{([\d, ]*)\}", (tmp_path / "probe.ptx").read_text())
    raw = [int(b) for b in m.group(2).split(",")] + [0] * int(m.group(1))
    kernel = [int.from_bytes(bytes(raw[4 * i:4 * i + 4]), "little") for i in range(len(cases))]
    assert kernel == [decode_batch_smem(cc, d, r, n) for d, r, n in cases]
