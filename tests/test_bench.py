"""The benchmark code paths run end to end on the host backend (timings there mean nothing;
this keeps the GPU tool from breaking where CI can see it)."""

from __future__ import annotations

import os

import pytest

from kdarun import bench
from kdarun.layer import Step


def test_bench_paths_on_host(host):
    ceil = bench.Ceilings(4000.0, 700.0, 0.0)
    stream = host.create_stream()
    r = bench.bench_decode(host, "tiny", 4, True, ceil, stream, reps=2)
    assert r.k == 4 and r.us > 0 and r.bytes > 0
    assert list(r.kernels_us) == ["front_end", "decode_rows", "o_proj"]  # decode_steps' order
    (p,) = bench.bench_prefill(host, "tiny", [65], stream)
    assert p.tokens == 65 and p.ms > 0 and p.core_ms > 0 and p.gemm_ms > 0
    assert set(p.kernels_ms) == {"conv", "chunk_intra", "chunk_inter", "rmsnorm"}
    assert all(v > 0 for v in p.kernels_ms.values())
    b = bench.bench_batch(host, "tiny", 3, 2, ceil, stream, reps=2)
    assert (b.mode, b.batch, b.k) == ("batch-verify", 3, 2) and b.us > 0
    one = bench.bench_batch(host, "tiny", 3, 1, ceil, stream, reps=2)
    assert b.bytes > one.bytes  # a verify moves its rows and snapshots too
    table = bench.results_table([vars(r)])
    assert "decode-k" in table and "tiny" in table
    assert "row 1 kernels_us: front_end" in table


def test_step_medians_runs_the_steps_in_order_each_rep(host):
    """A prefill's steps run in their order, once a rep (warm-up included), each with its own
    median: they are timed inside the layer, not one by one."""
    stream = host.create_stream()
    calls: list[str] = []
    names = ("qkv_gemm", "conv", "o_proj_gemm")
    steps = [Step(n, "kernel", (), lambda s, n=n: calls.append(n)) for n in names]
    out = bench.step_medians(host, steps, stream, reps=3, warmup=2)
    assert calls == list(names) * 5
    assert list(out) == list(names) and all(v >= 0 for v in out.values())


def test_medians_in_turn_alternates_and_takes_medians():
    """Timers are called in turn, rep by rep (warm-up included), and each gets its own median:
    a drift over the run falls on both alike."""
    calls: list[str] = []
    clock = iter(range(100))

    def timer(name: str):
        def once() -> float:
            calls.append(name)
            return float(next(clock))
        return once
    a, b = bench.medians_in_turn([timer("a"), timer("b")], reps=3, warmup=1)
    assert calls == ["a", "b"] * 4
    assert (a, b) == (4.0, 5.0)  # a's timed reps read 2, 4, 6; b's 3, 5, 7


def test_varlen_paths_on_host(host):
    (r,) = bench.bench_varlen(host, "tiny", [(3, 256)], host.create_stream(), reps=1)
    assert (r.mix, r.tokens) == ("3x256", 768) and min(r.ms, r.ms_checkpoints, r.one_ms) > 0
    assert 0 < r.host_ms and 0 < r.one_host_ms  # the host runs the kernels: all is host time
    assert bench.parse_mix("1x4096,32x128") == [(1, 4096), (32, 128)]
    with pytest.raises(ValueError, match="a mix is NxT"):
        bench.parse_mix("32*128")


def test_fla_means_flas_own_kernels(monkeypatch):
    """fla_available switches fla's backend dispatch off before fla is imported: with FlashKDA
    importable, fla 0.6's chunk_kda would otherwise run FlashKDA (and refuse its bf16 A_log),
    so the "fla" columns would not be fla's. A user's own setting is left alone."""
    from kdarun import bench
    monkeypatch.delenv("FLA_DISABLE_BACKEND_DISPATCH", raising=False)
    bench.fla_available()
    assert os.environ["FLA_DISABLE_BACKEND_DISPATCH"] == "1"
    monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "0")
    bench.fla_available()
    assert os.environ["FLA_DISABLE_BACKEND_DISPATCH"] == "0"
