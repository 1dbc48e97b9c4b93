"""The serving run behind `kdarun layer-run --batch N`: every sequence within tolerance of the
float64 reference, on the host backend."""

from __future__ import annotations

from kdarun.batch_run import BATCH_TOL, batch_plan, run_batch
from kdarun.loader import load_stack


def test_every_sequence_of_a_batch_matches_the_reference(host, ckpts):
    stack = load_stack(host, ckpts["bounded"], 128, [1])
    checks = run_batch(host, stack, 1, 6, seed=3, max_prompt=128).checks
    assert [c.sequence for c in checks] == list(range(6))
    assert [c.prefill for c in checks][:4] == [1, 63, 64, 65]
    assert len({c.slot for c in checks}) == 6
    for c in checks:
        assert c.ok and 0 < c.out_rel < BATCH_TOL and 0 < c.state_rel < BATCH_TOL, c


def test_batch_plan_fits_the_workspace():
    lengths, slots = batch_plan(8, 50, seed=1)
    assert lengths[0] == 1 and all(1 <= t <= 50 for t in lengths)  # 63, 64, 65 do not fit
    assert len(set(slots)) == 8 and all(0 <= s < 16 for s in slots)
