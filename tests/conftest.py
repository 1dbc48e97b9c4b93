"""Shared fixtures: tiny synthetic checkpoints of both gate forms, the host backend."""

from __future__ import annotations

import pytest

from kdarun import open_backend, synthetic

from .helpers import GATES


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """gate form -> path of a tiny 4-layer checkpoint (layers 0-2 KDA, 3 full attention)."""
    out = {}
    for gate in GATES:
        cfg = synthetic.preset_config("tiny", gate, layers=4, lower_bound=-3.0)
        out[gate] = str(synthetic.write_checkpoint(tmp_path_factory.mktemp(gate), cfg, seed=7))
    return out


@pytest.fixture(scope="session")
def host():
    return open_backend("host")
