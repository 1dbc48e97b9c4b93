"""Tensor parallel on one GPU: the ranks in turn against one rank, the float64 reference and
the host's sum; decode_k within a group; the group's decode in a CUDA graph; and the NCCL
pieces one GPU can run (a one-member group's all-reduce captured in a graph, the launcher
with one rank). Two ranks of NCCL need two GPUs (NCCL refuses two ranks on one)."""

from __future__ import annotations

import numpy as np
import pytest

from kdarun import synthetic
from kdarun.checkpoint import Checkpoint
from kdarun.dtypes import BF16, F32
from kdarun.kernels import Glm5NextKdaKernels
from kdarun.loader import load_stack
from kdarun.run import RunPlan, random_hidden, reference_of, run_layer, run_tp
from kdarun.workspace import SPEC

from ..helpers import E2E_TOL, bits, rel
from ..test_tp import TP_VS_ONE_TOL, Group, _warm, check_decode_k_is_serial_decodes


# The joined ranks' recurrent state against one rank's on the GPU. The sharding itself keeps
# a head's arithmetic (the host backend gives the same bits, and here the conv state, i.e.
# q|k|v, is bit-identical); the likely cause, not yet isolated stage by stage, is a projection
# whose reduction order depends on its number of output rows (cuBLAS picks a prefill GEMM's
# kernel by shape; the decode GEMV's K shares follow the row count), so a rank's gate or beta
# can differ from the whole layer's by a bf16 rounding. Measured on the H200: bit-identical
# for tiny x2 (both gates), rel 7.8e-7 for tiny x4 and 5.1e-4 for d128 x2; about twice the
# worst.
RANK_STATE_TOL = 1e-3


def _one(gpu, path, hidden, plan):
    stack = load_stack(gpu, path, max(plan.prefill, plan.k, 1), [1])
    try:
        return run_layer(gpu, stack, 1, hidden, plan)
    finally:
        stack.free(gpu)


@pytest.mark.parametrize("name, tp", [("bounded", 2), ("bounded", 4), ("softplus", 2),
                                      ("d128", 2)])
def test_ranks_in_turn_match_one_rank(cuda, host, gpu_ckpts, name, tp):
    """Prefill across chunks, decodes and a decode_k through tp ranks in turn on the GPU:
    final_out within the reordered sum's tolerance of one rank and E2E of float64, the
    same as the host's ranks within it; the conv state bit for bit, the joined recurrent
    state within RANK_STATE_TOL of one rank's (bit for bit on the host; on the H200 in 2 of
    these 4 cases: see RANK_STATE_TOL), whether bit-identical printed."""
    path, plan = gpu_ckpts[name], RunPlan(150, 3, 4)
    hidden = random_hidden(plan.total, Checkpoint(path).config.hidden_size, 5)
    one = _one(cuda, path, hidden, plan)
    got = run_tp(cuda, path, 1, hidden, plan, tp)
    on_host = run_tp(host, path, 1, hidden, plan, tp)
    ref = reference_of(Checkpoint(path), 1, hidden)
    same_rec = bits(got.recurrent_state).tobytes() == bits(one.recurrent_state).tobytes()
    same_conv = bits(got.conv_state).tobytes() == bits(one.conv_state).tobytes()
    print(f"tp {name} x{tp}: out vs tp1 {rel(got.final_out, one.final_out):.2e}, vs float64 "
          f"{rel(got.final_out, ref.stages['final_out']):.2e}, vs host tp "
          f"{rel(got.final_out, on_host.final_out):.2e}; recurrent state bit-identical "
          f"{same_rec} (rel {rel(got.recurrent_state, one.recurrent_state):.2e}), conv "
          f"{same_conv}")
    assert rel(got.final_out, one.final_out) < TP_VS_ONE_TOL
    assert rel(got.final_out, ref.stages["final_out"]) < E2E_TOL
    assert rel(got.final_out, on_host.final_out) < SPEC["final_out"].tol  # CUDA vs host
    assert same_conv and rel(got.recurrent_state, one.recurrent_state) < RANK_STATE_TOL


@pytest.mark.parametrize("tp", [2, 4])
def test_decode_k_within_a_group_is_serial_decodes(cuda, gpu_ckpts, tp):
    check_decode_k_is_serial_decodes(cuda, gpu_ckpts["bounded"], tp)


def test_the_sum_kernels_match_their_twins(cuda, host):
    """tp_accumulate and tp_round on the device give the host twins' bits, ties to even
    included, over rows of several launches' worth."""
    rng = np.random.default_rng(0)
    n = 1000 * 256
    parts = [rng.standard_normal(n, dtype=np.float32).astype(BF16) for _ in range(3)]
    parts[0][:4] = np.array([1, 2 ** -8, 1, 3 * 2 ** -9], np.float32).astype(BF16)
    parts[1][:4] = np.array([2 ** -8, 1, 2 ** -9, 1], np.float32).astype(BF16)
    parts[2][:4] = 0  # sums 1 + 2^-8 twice (ties, to even: 1), 1 + 2^-9, 1 + 3 2^-9
    outs = []
    for gpu in (cuda, host):
        kn = Glm5NextKdaKernels(gpu, synthetic.preset_config("tiny"))
        acc, y = gpu.alloc(n * 4), gpu.alloc(n * 2)
        for i, p in enumerate(parts):
            kn.tp_accumulate(0, gpu.upload(p), acc, n, i == 0)
        kn.tp_round(0, acc, y, n)
        outs.append((gpu.download(acc, (n,), F32, 0), gpu.download(y, (n,), BF16, 0)))
    assert bits(outs[0][0]).tobytes() == bits(outs[1][0]).tobytes()
    assert bits(outs[0][1]).tobytes() == bits(outs[1][1]).tobytes()
    assert outs[0][1][:4].astype(np.float32).tolist() == [1.0, 1.0, 1.0, 1.0 + 2 ** -7]


def test_group_decode_in_a_cuda_graph(cuda, gpu_ckpts):
    """Every rank's decode and the sum captured in one graph replay to the eager bits."""
    g = Group(cuda, gpu_ckpts["bounded"], 4, 1)
    rec, conv = _warm(4, 12, 3 * 256, 64)
    hp = cuda.upload(random_hidden(1, 256, 13))
    stream = cuda.create_stream()
    eager, replayed = g.states(rec, conv), g.states(rec, conv)
    g.group.decode(cuda, hp, eager, stream)
    want = g.stacks[0].workspace.read("final_out", 1, stream)
    graph = cuda.capture(lambda: g.group.decode(cuda, hp, replayed, stream), stream)
    graph.replay(stream)
    assert bits(g.stacks[0].workspace.read("final_out", 1, stream)).tobytes() == \
        bits(want).tobytes()
    for a, b in zip(eager, replayed):
        assert bits(a.download()[0]).tobytes() == bits(b.download()[0]).tobytes()
    g.free()


def test_nccl_all_reduce_of_one_member_in_a_cuda_graph(cuda):
    """The NCCL member's all-reduce (one rank: the identity) enqueued on the layer's stream
    and captured into a CUDA graph, the unique id made first as the launcher makes it."""
    from cupy.cuda import nccl

    from kdarun.tp import NcclComm
    comm = NcclComm(nccl.get_unique_id(), 0, 1)
    n = 4096
    x = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
    buf, stream = cuda.upload(x), cuda.create_stream()
    graph = cuda.capture(lambda: comm.all_reduce_f32(buf, n, stream), stream)
    graph.replay(stream)
    cuda.synchronize(stream)
    assert bits(cuda.download(buf, (n,), F32, stream)).tobytes() == bits(x).tobytes()
    comm.close()


def test_launcher_runs_a_rank_process(cuda, gpu_ckpts):
    """`run_tp` over NCCL with one rank: a spawned process on GPU 0 with its NCCL member runs
    the layer and sends its result back, bit-identical to the same run in this process."""
    path, plan = gpu_ckpts["bounded"], RunPlan(70, 2, 3)
    hidden = random_hidden(plan.total, 256, 21)
    here = _one(cuda, path, hidden, plan)
    there = run_tp(None, path, 1, hidden, plan, 1, "nccl")
    assert bits(there.final_out).tobytes() == bits(here.final_out).tobytes()
    assert bits(there.recurrent_state).tobytes() == bits(here.recurrent_state).tobytes()
