"""Tensor parallel over heads on the host backend: a rank's config and sliced reads in every
checkpoint layout and spelling, the ranks run in turn and summed against one rank and the
float64 reference, each rank's state against the head slice of the single run's, decode_k
against serial decodes within a group, the serving calls, and the fp32 sum itself."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file

from kdarun import KdaSeqState, synthetic
from kdarun.bench import Ceilings, bench_decode_tp
from kdarun.checkpoint import Checkpoint, shard_tensors
from kdarun.cli import main
from kdarun.dtypes import BF16, F32
from kdarun.errors import KdaError
from kdarun.layer import prefill_packed
from kdarun.loader import load_stack
from kdarun.pool import KdaStatePool
from kdarun.run import RunPlan, random_hidden, reference_of, run_layer, run_tp
from kdarun.tp import TpGroup, join_conv, join_recurrent, rank_conv, rank_recurrent

from .helpers import E2E_TOL, STATE_TOL, bits, rel

# The sum of the ranks' bf16 partials, each rounded once by o_proj before the fp32 sum, against
# one rank's o_proj (rounded once in all): measured <= 3.3e-3 on the host (tiny preset, both
# gates, tp 2 and 4, 4 seeds, T 1 to 138 with decodes and decode_k) and 3.4e-3 on the H200
# (a D = 128 stack at tp 2); about twice that.
TP_VS_ONE_TOL = 6e-3
LAYOUTS = [("kimi_linear", "flat"), ("glm5_next", "flat"), ("glm5_next", "transformers")]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[tuple[str, str], str]:
    """(layout, spelling) -> a tiny checkpoint (H = 4, bounded gate) of the same weights."""
    out = {}
    for layout, spelling in LAYOUTS:
        cfg = synthetic.preset_config("tiny", "bounded", layers=4, lower_bound=-3.0,
                                      layout=layout)
        out[layout, spelling] = str(synthetic.write_checkpoint(
            tmp_path_factory.mktemp(f"{layout}-{spelling}"), cfg, seed=7, spelling=spelling))
    return out


def test_rank_config_divides_heads_only():
    cfg = synthetic.preset_config("glm-5.3-flash")
    r = cfg.shard(4)
    assert (r.num_heads, r.head_dim, r.hidden_size, r.rank) == \
        (cfg.num_heads // 4, cfg.head_dim, cfg.hidden_size, cfg.rank)
    assert r.qkv * 4 == cfg.qkv and r.conv_dim * 4 == cfg.conv_dim
    assert cfg.shard(1) is cfg
    with pytest.raises(KdaError, match="not divisible by tp_size 3"):
        cfg.shard(3)
    with pytest.raises(KdaError, match=r"tp_rank must lie in \[0, 2\)"):
        cfg.check_tp(2, 2)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("where", LAYOUTS)
def test_sliced_reads_are_the_ranks_share_and_only_it(layouts, where, tp, monkeypatch):
    """Every layout and spelling (the fused conv1d holds q|k|v: three slices a rank) gives
    each rank exactly `shard_tensors` of the whole tensors, and no read covers more than the
    rank's share: the elements requested equal the elements returned."""
    ckpt = Checkpoint(layouts[where])
    whole = ckpt.layer_tensors(1)
    requested: list[int] = []
    real_open = Checkpoint._open

    class Slice:
        def __init__(self, sl):
            self._sl = sl

        def __getattr__(self, name):
            return getattr(self._sl, name)

        def __getitem__(self, idx):
            part = self._sl[idx]
            requested.append(part.size)
            return part

    class File:
        def __init__(self, f):
            self._f = f

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._f.keys()

        def get_slice(self, name):
            return Slice(self._f.get_slice(name))

        def get_tensor(self, name):
            raise AssertionError(f"{name} read whole")

    monkeypatch.setattr(Checkpoint, "_open", staticmethod(lambda file: File(real_open(file))))
    cfg = ckpt.config
    for r in range(tp):
        requested.clear()
        got = ckpt.layer_tensors(1, r, tp)
        want = shard_tensors(cfg, whole, r, tp)
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and bits(got[name]).tobytes() == \
                bits(want[name]).tobytes(), name
        assert sum(requested) == sum(a.size for a in got.values())
        h = cfg.num_heads // tp
        assert np.array_equal(got["A_log"], whole["A_log"][r * h:(r + 1) * h])
        cols = slice(r * h * cfg.head_dim, (r + 1) * h * cfg.head_dim)
        assert np.array_equal(got["o_proj.weight"], whole["o_proj.weight"][:, cols])
        assert np.array_equal(got["v_conv1d.weight"], whole["v_conv1d.weight"][cols])
        for name in ("f_a_proj.weight", "g_a_proj.weight", "o_norm.weight"):
            assert np.array_equal(got[name], whole[name])  # replicated


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("gate", ["softplus", "bounded"])
def test_ranks_in_turn_match_one_rank_and_float64(host, ckpts, gate, tp):
    """Prefill (across a chunk boundary), decodes and a decode_k through tp ranks: final_out
    within the reordered sum's tolerance of one rank and E2E of float64; the joined states
    bit-identical to the single run's (a rank's heads run the same arithmetic)."""
    plan = RunPlan(70, 3, 4)
    hidden = random_hidden(plan.total, 256, 11)
    stack = load_stack(host, ckpts[gate], 70, [1])
    one = run_layer(host, stack, 1, hidden, plan)
    stack.free(host)
    ref = reference_of(Checkpoint(ckpts[gate]), 1, hidden)
    got = run_tp(host, ckpts[gate], 1, hidden, plan, tp)
    assert rel(got.final_out, one.final_out) < TP_VS_ONE_TOL
    assert rel(got.final_out, ref.stages["final_out"]) < E2E_TOL
    assert rel(got.recurrent_state, ref.recurrent_state) < STATE_TOL
    assert bits(got.recurrent_state).tobytes() == bits(one.recurrent_state).tobytes()
    assert bits(got.conv_state).tobytes() == bits(one.conv_state).tobytes()
    for r in range(tp):  # the rank helpers invert the joins
        assert np.array_equal(rank_recurrent(got.recurrent_state, r, tp),
                              got.recurrent_state[r * 4 // tp:(r + 1) * 4 // tp])
    parts = [rank_conv(got.conv_state, r, tp) for r in range(tp)]
    assert bits(join_conv(parts)).tobytes() == bits(got.conv_state).tobytes()
    assert np.array_equal(join_recurrent([rank_recurrent(got.recurrent_state, r, tp)
                                          for r in range(tp)]), got.recurrent_state)


def test_tp_of_one_is_the_layer(host, ckpts):
    plan = RunPlan(20, 2, 3)
    hidden = random_hidden(plan.total, 256, 2)
    stack = load_stack(host, ckpts["softplus"], 20, [1])
    one = run_layer(host, stack, 1, hidden, plan)
    stack.free(host)
    got = run_tp(host, ckpts["softplus"], 1, hidden, plan, 1)
    assert bits(got.final_out).tobytes() == bits(one.final_out).tobytes()


class Group:
    """tp ranks of layer 1 in turn, workspaces of `rows` tokens, sums of up to `sum_rows`
    (default `rows`), states from a whole state sliced by heads."""

    def __init__(self, gpu, path: str, tp: int, rows: int, sum_rows: int | None = None):
        self.gpu, self.tp = gpu, tp
        self.stacks = [load_stack(gpu, path, rows, [1], 0, r, tp) for r in range(tp)]
        self.group = TpGroup.of(gpu, self.stacks, 1, max_rows=sum_rows or rows)
        self.cfg = self.stacks[0].cfg

    def states(self, rec: np.ndarray, conv: np.ndarray) -> list[KdaSeqState]:
        out = []
        for r in range(self.tp):
            s = KdaSeqState(self.gpu, self.cfg)
            s.upload(rank_recurrent(rec, r, self.tp), rank_conv(conv, r, self.tp))
            out.append(s)
        return out

    def out(self, rows: int) -> np.ndarray:
        return self.stacks[0].workspace.read("final_out", rows)

    def free(self) -> None:
        self.group.free()
        for s in self.stacks:
            s.free(self.gpu)


def _warm(tp_cfg_heads: int, seed: int, conv_dim: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rec = (rng.standard_normal((tp_cfg_heads, d, d), dtype=np.float32) * 0.05).astype(F32)
    conv = rng.standard_normal((3, conv_dim), dtype=np.float32).astype(BF16)
    return rec, conv


def check_decode_k_is_serial_decodes(gpu, path: str, tp: int) -> None:
    """decode_k over K rows through a group of tp ranks is bit-identical to K serial group
    decodes: outputs, every rank's snapshots and final states."""
    g, K = Group(gpu, path, tp, 8), 5
    rec, conv = _warm(4, 3, 3 * 256, 64)
    hp = gpu.upload(random_hidden(K, 256, 4))
    serial = g.states(rec, conv)
    outs, snaps = [], []
    for t in range(K):
        g.group.decode(gpu, hp + t * 512, serial, 0)
        outs.append(g.out(1))
        snaps.append([s.download() for s in serial])
    batch = g.states(rec, conv)
    dst = [[KdaSeqState(gpu, g.cfg) for _ in range(K - 1)] for _ in range(tp)]
    g.group.decode_k(gpu, hp, K, batch, [[(s.recurrent, s.conv) for s in d] for d in dst], 0)
    assert bits(g.out(K)).tobytes() == bits(np.concatenate(outs)).tobytes()
    for r in range(tp):
        for t in range(K - 1):
            for a, b in zip(dst[r][t].download(), snaps[t][r]):
                assert bits(a).tobytes() == bits(b).tobytes()
        for a, b in zip(batch[r].download(), snaps[-1][r]):
            assert bits(a).tobytes() == bits(b).tobytes()
    g.free()


@pytest.mark.parametrize("tp", [2, 4])
def test_decode_k_within_a_group_is_serial_decodes(host, ckpts, tp):
    check_decode_k_is_serial_decodes(host, ckpts["bounded"], tp)


def test_the_sum_is_fp32_in_rank_order_rounded_once(host, ckpts):
    """The group's output is the ranks' partials (each rank's layer alone) widened, added in
    fp32 in rank order and rounded to bf16 once, bit for bit."""
    tp = 4
    g = Group(host, ckpts["softplus"], tp, 3)
    rec, conv = _warm(4, 5, 3 * 256, 64)
    hp = host.upload(random_hidden(3, 256, 6))
    partial_states = g.states(rec, conv)
    partials = []
    for (layer, ws), st in zip(g.group.ranks, partial_states):
        layer.decode_k(host, hp, 3, st, ws, (), 0)
        partials.append(ws.read("final_out", 3).astype(np.float32))
    acc = partials[0].copy()
    for p in partials[1:]:
        acc += p
    g.group.decode_k(host, hp, 3, g.states(rec, conv), None, 0)
    assert bits(g.out(3)).tobytes() == bits(acc.astype(BF16)).tobytes()
    for _, ws in g.group.ranks:  # every held rank holds the sum
        assert bits(ws.read("final_out", 3)).tobytes() == bits(g.out(3)).tobytes()
    g.free()


@pytest.mark.parametrize("tp", [2, 4])
def test_serving_calls_through_a_group(host, ckpts, tp):
    """decode_batch, verify_batch with snapshots and prefill_packed through the group: rows
    within the reordered sum's tolerance of one rank's, every rank's pool slots (states and
    snapshots) bit-identical to the head slices of one rank's."""
    path, b, k = ckpts["bounded"], 3, 3
    one, grp = Group(host, path, 1, 80), Group(host, path, tp, 80)
    nslots = b * k
    rng = np.random.default_rng(9)
    rec = (rng.standard_normal((nslots, 4, 64, 64), dtype=np.float32) * 0.05).astype(F32)
    conv = rng.standard_normal((nslots, 3, 3 * 256), dtype=np.float32).astype(BF16)
    pools = {}
    for name, g in (("one", one), ("tp", grp)):
        pools[name] = [KdaStatePool(host, g.cfg, nslots) for _ in range(g.tp)]
        for r, pool in enumerate(pools[name]):
            for s in range(nslots):
                pool.upload(s, rank_recurrent(rec[s], r, g.tp), rank_conv(conv[s], r, g.tp))
    slots = host.upload(np.array([2, 0, 1], np.int32))
    snaps = host.upload((3 + np.arange(b * (k - 1))).astype(np.int32))
    h = host.upload(random_hidden(b * k, 256, 8))
    seq_lens = [5, 64, 9]
    hp = host.upload(random_hidden(sum(seq_lens), 256, 10))
    out = {n: host.alloc(sum(seq_lens) * 512) for n in ("one", "tp")}
    cu = np.cumsum([0, *seq_lens]).tolist()
    calls = [
        ("decode_batch", lambda g, p, n: g.group.decode_batch(host, h, b, slots, p, 0), b),
        ("verify_batch", lambda g, p, n: g.group.verify_batch(host, h, b, k, slots, p, snaps, 0),
         b * k),
        ("prefill_packed", lambda g, p, n: g.group.prefill_packed(
            host, hp, cu, [6, 7, 8], [True, False, True], p, out[n], 0), None),
    ]
    for name, call, rows in calls:
        got = {}
        for n, g in (("one", one), ("tp", grp)):
            call(g, pools[n], n)
            got[n] = g.out(rows) if rows else host.download(out[n], (cu[-1], 256), BF16)
        assert rel(got["tp"], got["one"]) < TP_VS_ONE_TOL, name
        for s in range(nslots):
            whole = pools["one"][0].download(s)
            for r, pool in enumerate(pools["tp"]):
                mine = pool.download(s)
                assert bits(mine[0]).tobytes() == bits(rank_recurrent(whole[0], r, tp)).tobytes()
                assert bits(mine[1]).tobytes() == bits(rank_conv(whole[1], r, tp)).tobytes()
    for n in ("one", "tp"):
        for pool in pools[n]:
            pool.free()
    one.free()
    grp.free()


@pytest.mark.parametrize("tp", [2, 4])
def test_windowed_prefill_through_a_group(host, ckpts, tp):
    """A prefill longer than the workspace, in windows, through the group: rows within the
    reordered sum's tolerance of one rank's windows, states the head slices bit for bit."""
    t = 150
    one, grp = Group(host, ckpts["softplus"], 1, 64), Group(host, ckpts["softplus"], tp, 64, t)
    rec, conv = _warm(4, 14, 3 * 256, 64)
    hp = host.upload(random_hidden(t, 256, 15))
    got = {}
    for name, g in (("one", one), ("tp", grp)):
        states, out = g.states(rec, conv), host.alloc(t * 512)
        g.group.prefill_windowed(host, hp, t, states, out, 0)
        got[name] = (host.download(out, (t, 256), BF16), [s.download() for s in states])
    assert rel(got["tp"][0], got["one"][0]) < TP_VS_ONE_TOL
    whole_rec, whole_conv = got["one"][1][0]
    for r, (rr, cc) in enumerate(got["tp"][1]):
        assert bits(rr).tobytes() == bits(rank_recurrent(whole_rec, r, tp)).tobytes()
        assert bits(cc).tobytes() == bits(rank_conv(whole_conv, r, tp)).tobytes()
    one.free()
    grp.free()


def test_group_decode_replays_from_a_captured_graph(host, ckpts):
    """A group's decode captured (the in-turn ranks and the sum in one graph) replays to the
    eager call's bits."""
    g = Group(host, ckpts["softplus"], 2, 1)
    rec, conv = _warm(4, 12, 3 * 256, 64)
    hp = host.upload(random_hidden(1, 256, 13))
    eager, replayed = g.states(rec, conv), g.states(rec, conv)
    g.group.decode(host, hp, eager, 0)
    want = g.out(1)
    graph = host.capture(lambda: g.group.decode(host, hp, replayed, 0), 0)
    graph.replay(0)
    assert bits(g.out(1)).tobytes() == bits(want).tobytes()
    g.free()


def test_decode_benchmark_in_turn_runs_on_the_host(host):
    r = bench_decode_tp(host, "tiny", 1, True, Ceilings(1.0, 1.0, 0.0), 0, 2, reps=2)
    assert r.tp == 2 and r.tp_mode == "in-turn" and r.us > 0 and r.rank_us > 0


def test_layer_run_tp_on_the_host(host, ckpts, tmp_path):
    """`kdarun layer-run --tp 2` runs the ranks in turn, passes against float64, says so, and
    writes the group's output and joined states, those of `run_tp`."""
    out = tmp_path / "o.safetensors"
    r = CliRunner().invoke(main, ["layer-run", ckpts["bounded"], "--layer", "1", "--tokens",
                                  "40", "--decode-steps", "2", "--k", "3", "--backend", "host",
                                  "--tp", "2", "--output", str(out), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    assert doc["ok"] and doc["tp"] == 2 and doc["tp_mode"] == "in-turn"
    got = load_file(str(out))
    want = run_tp(host, ckpts["bounded"], 1, random_hidden(45, 256, 0),
                  RunPlan(40, 2, 3), 2)
    for name in ("final_out", "recurrent_state", "conv_state"):
        assert bits(got[name]).tobytes() == bits(getattr(want, name)).tobytes(), name


def test_a_group_checks_every_rank_before_any_runs(host, ckpts, tmp_path):
    """A bad argument for rank 1 is refused before rank 0 moves (a retry would step rank 0
    twice); ranks of two checkpoints, a layer or workspace given twice, one state for two ranks
    and snapshots in a state's own buffers are refused."""
    stacks = [load_stack(host, ckpts["bounded"], 16, [1], tp_rank=r, tp_size=2) for r in range(2)]
    group = TpGroup.of(host, stacks, 1)
    h = host.upload(random_hidden(4, 256, 12))
    states = [KdaSeqState(host, s.cfg) for s in stacks]
    states[0].upload(*_warm(stacks[0].cfg.num_heads, 13, stacks[0].cfg.conv_dim,
                            stacks[0].cfg.head_dim))
    before = states[0].download()
    whole = KdaSeqState(host, Checkpoint(ckpts["bounded"]).config)
    for call, pattern in [
        (lambda: group.decode(host, h, [states[0], whole], 0),
         "layer 1: the state was made for a config of num_heads 4, not 2"),
        (lambda: group.decode(host, h, [states[0], None], 0),
         "rank 1.s state must be a KdaSeqState, got NoneType"),
        (lambda: group.decode(host, h, [states[0], states[0]], 0), "the same object is given"),
        (lambda: group.prefill(host, h, "5", states, 0), "rows must be a positive integer"),
        (lambda: group.prefill(host, h, 40, states, 0), "40 tokens exceed the workspace"),
        (lambda: group.decode_k(host, h, 2, states, [[], [(states[1].recurrent,
                                                           states[1].conv)]], 0),
         "rank 1's snapshot 0 .* lies in the state's own buffers"),
        (lambda: group.decode_k(host, h, 2, states, [[("a", "b")], []], 0),
         "pass k-1 = 1 snapshots or none, got 0|must be a \\(recurrent, conv\\) pair"),
    ]:
        with pytest.raises(KdaError, match=pattern):
            call()
        for x, y in zip(before, states[0].download()):
            assert np.array_equal(bits(x), bits(y)), pattern
    with pytest.raises(KdaError, match="a rank's layer is given twice"):
        TpGroup(host, [(stacks[0].layer(1), stacks[0].workspace)] * 2, 2)
    other = synthetic.write_checkpoint(tmp_path / "other", Checkpoint(ckpts["bounded"]).config,
                                       seed=99)
    foreign = load_stack(host, str(other), 16, [1], tp_rank=1, tp_size=2)
    with pytest.raises(KdaError, match="come from different checkpoints"):
        TpGroup.of(host, [stacks[0], foreign], 1)


def test_a_group_refuses_a_rank_s_state_for_another_rank(host, ckpts):
    """Every rank's state has the same shapes, so states passed in another rank order would run
    each rank on another rank's heads: a call marks each state and pool with its rank
    (`tp_rank`), and a later call that passes it for another rank is refused before any rank
    runs. A refused call marks nothing; setting tp_rank to None lets a state be reused. A pool
    slot's state carries its own mark (slots of one pool may hold different ranks')."""
    stacks = [load_stack(host, ckpts["bounded"], 16, [1], tp_rank=r, tp_size=2) for r in range(2)]
    group = TpGroup.of(host, stacks, 1)
    h = host.upload(random_hidden(4, 256, 21))
    states = [KdaSeqState(host, s.cfg) for s in stacks]
    with pytest.raises(KdaError, match="40 tokens exceed the workspace"):
        group.prefill(host, h, 40, states, 0)
    small = TpGroup.of(host, stacks, 1, max_rows=2)
    with pytest.raises(KdaError, match="3 rows exceed the sum buffer's 2"):
        small.decode_k(host, h, 3, states, None, 0)
    assert [s.tp_rank for s in states] == [None, None]  # refused: not marked
    group.prefill(host, h, 4, states, 0)
    assert [s.tp_rank for s in states] == [0, 1]
    before = [s.download() for s in states]
    with pytest.raises(KdaError, match="decode: states: the one given for rank 0 holds rank "
                                       "1's heads"):
        group.decode(host, h, states[::-1], 0)
    for s, b in zip(states, before):
        assert all(np.array_equal(bits(x), bits(y)) for x, y in zip(s.download(), b))
    group.decode(host, h, states, 0)  # in order: still taken
    states[0].tp_rank = states[1].tp_rank = None  # reused: the caller says so
    group.decode(host, h, states[::-1], 0)
    assert [s.tp_rank for s in states] == [1, 0]
    pools = [KdaStatePool(host, s.cfg, 2) for s in stacks]
    slots = host.upload(np.array([1], np.int32))
    group.decode_batch(host, h, 1, slots, pools, 0)
    assert [p.tp_rank for p in pools] == [0, 1]
    with pytest.raises(KdaError, match="decode_batch: pools: the one given for rank 0 holds "
                                       "rank 1's heads"):
        group.decode_batch(host, h, 1, slots, pools[::-1], 0)
    one = KdaStatePool(host, stacks[0].cfg, 2)  # slot 0 rank 0's, slot 1 rank 1's
    group.decode(host, h, [one.state(0), one.state(1)], 0)
    assert (one.state(0).tp_rank, one.state(1).tp_rank, one.tp_rank) == (0, 1, None)
    with pytest.raises(KdaError, match="the one given for rank 0 holds rank 1's heads"):
        group.decode(host, h, [one.state(1), one.state(0)], 0)


def test_a_group_refuses_hidden_a_rank_overwrites_and_checks_every_ranks_pack(host, ckpts):
    """The ranks run in turn, so hidden inside `out` or inside a rank's final_out (the group's
    own, as when layers are chained) would reach the next rank as the first rank's partial:
    refused, where the single layer takes them. A packed prefill checks every rank's slots
    against its own pool before any rank runs, naming the rank."""
    stacks = [load_stack(host, ckpts["bounded"], 64, [1], tp_rank=r, tp_size=2) for r in range(2)]
    group = TpGroup.of(host, stacks, 1)
    row = stacks[0].cfg.hidden_size * 2
    pools = [KdaStatePool(host, s.cfg, n) for s, n in zip(stacks, (8, 4))]
    pools[0].upload(6, *_warm(stacks[0].cfg.num_heads, 14, stacks[0].cfg.conv_dim,
                              stacks[0].cfg.head_dim))
    before = pools[0].download(6)
    states = [KdaSeqState(host, s.cfg) for s in stacks]
    buf = host.upload(random_hidden(100, 256, 15))
    for call, pattern in [
        (lambda: group.prefill_packed(host, buf, [0, 4, 10], [0, 1], [False] * 2, pools, buf,
                                      0), "tp group prefill_packed: hidden .* overlaps out"),
        (lambda: group.prefill_windowed(host, buf, 80, states, buf + 20 * row, 0),
         "tp group prefill_windowed: hidden .* overlaps out"),
        (lambda: group.decode(host, group.final_out, states, 0),
         "tp group decode: hidden .* overlaps rank 0's final_out"),
        (lambda: group.prefill_packed(host, buf, [0, 10], [6], [True], pools,
                                      host.alloc(10 * row), 0),
         r"tp group rank 1: prefill_packed: slots: a slot must be an integer in \[0, 4\), got 6"),
        (lambda: group.prefill_packed(host, buf, 10, [6], [True], pools, host.alloc(10 * row), 0),
         "tp group rank 0: prefill_packed: cu_seqlens must be a host sequence"),
    ]:
        with pytest.raises(KdaError, match=pattern):
            call()
    for x, y in zip(before, pools[0].download(6)):
        assert np.array_equal(bits(x), bits(y))
    assert not states[0].download()[0].any()
    # the single layer reads hidden before it writes out: in place is allowed there
    layer, ws = stacks[0].layer(1), stacks[0].workspace
    prefill_packed(layer, host, buf, [0, 4, 10], [0, 1], [False] * 2, pools[0], ws, buf, 0)


@pytest.mark.parametrize("call, pattern", [
    (lambda f, c: rank_recurrent(f, 2, 2), r"tp_rank must be an integer in \[0, 1\], got 2"),
    (lambda f, c: rank_recurrent(f, 0, 3), "4 heads do not split into 3 equal ranks"),
    (lambda f, c: rank_recurrent(c, 0, 2), "need a NumPy array of 3 dimensions"),
    (lambda f, c: rank_conv(c, 0, 3), r"96 channels \(q\|k\|v\) do not split into 3"),
    (lambda f, c: join_recurrent([]), "need one .* array a rank"),
    (lambda f, c: join_conv([c, c[:, :48]]), "all of one shape"),
])
def test_state_slices_refuse_bad_ranks(call, pattern):
    full, conv = np.zeros((4, 8, 8), np.float32), np.zeros((3, 96), np.float32)
    with pytest.raises(KdaError, match=pattern):
        call(full, conv)


def _exit_at_once(code: int) -> None:
    import os
    os._exit(code)


def _put_after(results, rank: int, delay: float) -> None:
    import time
    time.sleep(delay)
    results.put((rank, True, rank * 10))


def test_the_launcher_names_a_rank_that_died_without_a_result():
    """A rank killed before it reports (a crash, the OOM killer) is named with its exit code
    at once, not after the launch's hour, and the others (which would wait for it in NCCL)
    are ended; ranks that report are gathered in rank order."""
    import multiprocessing
    import time

    from kdarun import tp
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_put_after, args=(results, 0, 60.0)),
             ctx.Process(target=_exit_at_once, args=(9,))]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    with pytest.raises(KdaError, match="tp rank 1 of 2 exited with code 9 without a result"):
        tp.gather(procs, results, 600.0)
    assert time.monotonic() - t0 < 30 and all(p.exitcode is not None for p in procs)
    results = ctx.Queue()
    procs = [ctx.Process(target=_put_after, args=(results, r, 0.1 * (2 - r))) for r in range(2)]
    for p in procs:
        p.start()
    assert tp.gather(procs, results, 600.0) == [0, 10]
